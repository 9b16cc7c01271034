"""Shard groups served by group server processes (``round.group_servers``): two real
``fedsec aggregator group-serve`` processes on loopback take their groups' stage
requests over the leader's SQLite store, members sign to them as to the leader, and the
leader reads their messages from the store, unmasks and decodes once.

The model is the exact sum of every member's input, as in the leader-only sharded round
(tests/summation/test_sharded_rounds.py asserts the same ``expected_params``), and
``fedsec audit verify`` re-derives it from the one log both kinds of process wrote.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, Final

import aiohttp
import msgspec
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fedsec.agent.runtime import AgentRuntime
from fedsec.agent.vault import Vault
from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.groups import hosts
from fedsec.aggregator.groups.desk import STAGE_POLL_S, GroupDesk
from fedsec.aggregator.groups.hosts import StoreGroupHosts
from fedsec.aggregator.groups.server import make_group_app
from fedsec.aggregator.rounds.events import Event, EventBus, PrivacyReported, RoundEnded
from fedsec.aggregator.storage.interfaces import RoundRow
from fedsec.aggregator.storage.leadership import NotLeader
from fedsec.aggregator.transport import start_server
from fedsec.aggregator.workspace import Workspace
from fedsec.aggregator_client import AggregatorClient
from fedsec.audit.verify import verify_log
from fedsec.crypto.httpsig import sign_request
from fedsec.errors import BadVector, PayloadError, RetryLater, WrongGroup, WrongStage
from fedsec.protocol import codec, wire
from fedsec.protocol.shards import group_index
from tests.agent.test_agent_runtime import round_spec
from tests.summation.test_sharded_agents import MEMBERS as AGENTS
from tests.summation.test_sharded_agents import _config as agent_config
from tests.support.agent import LiveAggregator, live_aggregator
from tests.support.aggregator import (
    Cohort,
    FakeClock,
    Federation,
    contribution_statement,
    expected_params,
    join_request,
    log_entries,
    make_federation,
    model_params,
    privacy_report,
)
from tests.support.postgres import Postgres, fresh_database, postgres_server

MEMBERS = tuple(f"g{i}" for i in range(6))
SERVE = (sys.executable, "-m", "fedsec", "aggregator", "group-serve")
START_S = 60.0
WAIT_S = 20.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _group_servers(root: Path, urls: list[str]) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = [
        subprocess.Popen(
            [*SERVE, "--workspace", str(root), "--url", url, "--log-level", "WARNING"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for url in urls
    ]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


async def _until(check: Callable[[], bool], what: str, deadline_s: float = WAIT_S) -> None:
    """Wait for ``check()`` (polled; the leader ticks in this loop) within the deadline."""
    end = time.monotonic() + deadline_s
    while not check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def _healthy(urls: list[str]) -> None:
    end = time.monotonic() + START_S
    async with aiohttp.ClientSession() as http:
        for url in urls:
            while True:
                try:
                    async with http.get(f"{url}/v1/health") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                assert time.monotonic() < end, f"group server {url} did not start"
                await asyncio.sleep(0.05)


def _federation(
    root: Path,
    urls: list[str],
    members: tuple[str, ...] = MEMBERS,
    sections: dict[str, Any] | None = None,
) -> Federation:
    return make_federation(
        root,
        members,
        sections=sections,
        round={
            "rounds": 1,
            "max_weight_samples": 1000,
            "min_agents": len(members),
            "max_agents": len(members),
            "shards": 2,
            "min_shard_members": 3,
            "group_servers": urls,
            "advertise_s": 120.0,
            "share_s": 120.0,
            "masked_s": 120.0,
            "unmask_s": 120.0,
        },
        validation=False,
    )


@contextlib.asynccontextmanager
async def _round(
    tmp_path: Path, members: tuple[str, ...] = MEMBERS, *, join: bool = True
) -> AsyncIterator[tuple[Federation, LiveAggregator, list[str], list[subprocess.Popen[bytes]]]]:
    """The leader (in this process) and two group servers; with ``join``, the members
    joined and the cohort fixed."""
    urls = [f"http://127.0.0.1:{_free_port()}" for _ in range(2)]
    fed = _federation(tmp_path / "aggregator", urls, members)
    with _group_servers(fed.root, urls) as procs:
        async with live_aggregator(fed) as live:
            await _healthy(urls)
            coord = live.coordinator
            if join:
                for m in members:
                    assert coord.join(m, 1, 0, join_request(m, 1)).accepted
                await _until(lambda: coord.live.spec is not None, "the cohort")
            yield fed, live, urls, procs


@contextlib.asynccontextmanager
async def _clients(
    fed: Federation, live: LiveAggregator, spec: wire.RoundSpec
) -> AsyncIterator[dict[str, AggregatorClient]]:
    """Each member's client as the agent builds it: its group's server from the signed
    spec first, then the leader."""
    key = fed.ws.signer.public_bytes
    leader = {
        m: AggregatorClient(
            live.url,
            fed.identities[m],
            key,
            retry_max=12,
            backoff_initial_s=0.05,
            backoff_max_s=0.5,
        )
        for m in MEMBERS
    }
    try:
        yield {
            m: c.for_group(spec.groups[group_index(spec.groups, m)].url) for m, c in leader.items()
        }
    finally:
        for c in leader.values():
            await c.close()


async def _stage(live: LiveAggregator, stage: str) -> None:
    await _until(lambda: live.coordinator.live.stage == stage, f"stage {stage}")


async def _run(
    fed: Federation,
    live: LiveAggregator,
    clients: dict[str, AggregatorClient],
    cohort: Cohort,
    after_advertise: Callable[[], None] = lambda: None,
) -> None:
    spec, (r, a) = cohort.spec, (cohort.spec.round, cohort.spec.attempt)
    await asyncio.gather(*(clients[m].advertise(r, a, cohort.advertise(m)) for m in MEMBERS))
    await _stage(live, "share_keys")
    after_advertise()
    keys = await asyncio.gather(*(clients[m].keys(r, a) for m in MEMBERS))
    await asyncio.gather(
        *(
            clients[m].post_shares(r, a, cohort.share_keys(m, k))
            for m, k in zip(MEMBERS, keys, strict=True)
        )
    )
    await _stage(live, "masked_input")
    relays = await asyncio.gather(*(clients[m].get_shares(r, a) for m in MEMBERS))
    for m, relay in zip(MEMBERS, relays, strict=True):
        cohort.receive_shares(m, relay)

    async def mask(m: str) -> wire.Receipt:
        raw, _, _ = cohort.upload(m)
        statement = contribution_statement(m, spec, raw, cohort.quantized[m], fed.identities[m])
        receipt, _ = await clients[m].masked_input(r, a, raw, statement, 0.0)
        return receipt

    # each receipt is checked against the aggregator's key by the client, whichever
    # process signed it
    await asyncio.gather(*(mask(m) for m in MEMBERS))
    await _stage(live, "consistency")
    requests = await asyncio.gather(*(clients[m].get_unmask(r, a) for m in MEMBERS))
    await asyncio.gather(
        *(
            clients[m].consistency(r, a, cohort.sign(m, q))
            for m, q in zip(MEMBERS, requests, strict=True)
        )
    )
    await _stage(live, "unmask")
    proofs = await asyncio.gather(*(clients[m].get_consistency(r, a) for m in MEMBERS))
    await asyncio.gather(
        *(
            clients[m].unmask(r, a, cohort.unmask(m, p))
            for m, p in zip(MEMBERS, proofs, strict=True)
        )
    )
    await _until(lambda: live.coordinator.live.round == 2, "the round's close")


def _check_model(fed: Federation, cohort: Cohort) -> None:
    old, new = model_params(fed.ws, 1), model_params(fed.ws, 2)
    np.testing.assert_array_equal(
        new, expected_params(old, [cohort.quantized[m] for m in MEMBERS], cohort.spec)
    )
    _verified(fed)


def _verified(fed: Federation) -> None:
    audit = fed.root / "audit"
    verified = verify_log(audit / "log.jsonl", audit / "archive", fed.root)
    assert verified.ok, verified.problem
    assert (verified.rounds_verified, verified.models_verified) == (1, 1)


#: Routes no signature guards: no round's summary counts them (health checks, scrapes).
_UNSIGNED = ("health", "metrics", "unmatched")


def _wire_bytes(expositions: list[str]) -> dict[str, list[int]]:
    """What the signed requests carried by the servers' own ``/metrics``: endpoint ->
    [request bytes (head and body), response body bytes], summed over the servers."""
    totals: dict[str, list[int]] = {}
    for text in expositions:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                endpoint = sample.labels.get("endpoint")
                if endpoint is None or endpoint in _UNSIGNED:
                    continue
                row = totals.setdefault(endpoint, [0, 0])
                if sample.name in (
                    "fedsec_http_request_bytes_total",
                    "fedsec_http_request_head_bytes_total",
                ):
                    row[0] += int(sample.value)
                elif sample.name == "fedsec_http_response_bytes_total":
                    row[1] += int(sample.value)
    return totals


def _scrape(url: str) -> str:
    """``url``'s ``/metrics`` exposition (a blocking read: for a callback of the round)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=WAIT_S) as answer:
        return str(answer.read().decode())


class _LeaderTraffic:
    """The leader's own counts of attempt (1, 0) (the requests it served itself), and
    the round's summary with those counts as they stood when it was written."""

    def __init__(self, coord: Coordinator, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts = [0, 0]
        self.ended: list[tuple[wire.RoundSummary, tuple[int, int]]] = []
        count = coord.count_traffic

        def counted(key: tuple[int, int], received: int, sent: int) -> None:
            if key == (1, 0):
                self.counts[0] += received
                self.counts[1] += sent
            count(key, received, sent)

        monkeypatch.setattr(coord, "count_traffic", counted)
        coord.events.subscribe(self._on_event)

    def _on_event(self, event: Event) -> None:
        if isinstance(event, RoundEnded) and (event.summary.round, event.summary.attempt) == (1, 0):
            self.ended.append((event.summary, (self.counts[0], self.counts[1])))

    def summary(self, fed: Federation) -> tuple[wire.RoundSummary, tuple[int, int]]:
        """The stored summary of attempt (1, 0) and the leader's own counts at its close."""
        [(summary, own)] = self.ended
        row = fed.ws.state.rounds.get(1, 0)
        assert row is not None and row.summary is not None
        assert msgspec.json.decode(row.summary, type=wire.RoundSummary) == summary
        return summary, own


@pytest.mark.slow  # group server processes start; six real agents train and run a round
def test_a_round_closes_through_two_group_servers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real agents: each learns its group's server from the signed spec and sends it its
    stage messages; the leader takes none of them, and the model is the exact sum of the
    updates the members kept.  The round's summary counts the bytes of every signed
    request the leader and the group servers served for it, each once."""

    async def main() -> None:
        async with _round(tmp_path, AGENTS, join=False) as (fed, live, urls, _):
            leader = _LeaderTraffic(live.coordinator, monkeypatch)
            key = fed.ws.signer.public_bytes
            runtimes = [
                AgentRuntime(
                    agent_config(tmp_path, live.url, m, key), fed.identities[m], poll_timeout_s=2.0
                )
                for m in AGENTS
            ]
            outcomes = await asyncio.wait_for(
                asyncio.gather(*(rt.run(max_rounds=1) for rt in runtimes)), 120
            )
            assert [[o.status for o in outs] for outs in outcomes] == [["closed"]] * len(AGENTS)
            spec = round_spec(fed, 1, 0)
            assert [g.url for g in spec.groups] == urls  # signed: members follow no other
            # every stage upload went to a group server: the leader took none of them
            uploads = ("advertise", "shares", "masked-input", "consistency", "unmask")
            assert not [
                p for method, p in live.requests if method == "POST" and p.endswith(uploads)
            ]
            async with aiohttp.ClientSession() as http:
                counts, expositions = [], []
                for url in urls:
                    async with http.get(f"{url}/v1/health") as resp:
                        counts.append((await resp.json())["accepted"])
                    async with http.get(f"{url}/metrics") as resp:
                        expositions.append(await resp.text())
            assert counts == [5 * len(g.members) for g in spec.groups]
            summary, (own_up, own_down) = leader.summary(fed)
            served = _wire_bytes(expositions)
            assert summary.bytes_up == own_up + sum(up for up, _ in served.values()) > own_up
            # an unmask answer is held until the attempt is over: after its summary, at
            # the leader as at a group server
            held = served["post_unmask"][1]
            down = own_down + sum(down for _, down in served.values()) - held
            assert down <= summary.bytes_down <= down + held
            kept = [Vault(tmp_path / m).load_update(1, 0).update for m in AGENTS]
            np.testing.assert_array_equal(
                model_params(fed.ws, 2), expected_params(model_params(fed.ws, 1), kept, spec)
            )
            _verified(fed)

    asyncio.run(main())


@pytest.mark.slow  # group server processes start
def test_a_request_for_another_group_or_replayed_elsewhere_is_refused(tmp_path: Path) -> None:
    async def main() -> None:
        async with _round(tmp_path) as (fed, live, urls, _):
            spec = live.coordinator.live.spec
            assert spec is not None
            cohort = Cohort(spec, fed.identities)
            outsider = spec.groups[0].members[0]
            path = "/v1/rounds/1/advertise?attempt=0"
            body = wire.encode(cohort.advertise(outsider))
            async with aiohttp.ClientSession() as http:
                # a member of group 0 at group 1's server: 421, naming group 0's server
                headers = {"Content-Type": "application/json"}
                headers |= sign_request(
                    fed.identities[outsider], "POST", path, headers, body, created=int(time.time())
                )
                async with http.post(urls[1] + path, data=body, headers=headers) as resp:
                    refused = await resp.json()
                    assert resp.status == WrongGroup.http_status == 421
                assert refused["error"] == "wrong_group" and urls[0] in refused["detail"]
                assert fed.ws.state.messages.count(1, 0, "advertise") == 0  # nothing stored
                # the same signed request again, at the right server and at the leader:
                # its nonce was spent at the first server
                for target in (urls[0], live.url):
                    async with http.post(target + path, data=body, headers=headers) as resp:
                        replayed = await resp.json()
                        assert resp.status == 401, replayed
                    assert "replayed nonce" in replayed["detail"]
                assert fed.ws.state.messages.count(1, 0, "advertise") == 0

    asyncio.run(main())


@pytest.mark.slow  # group server processes start; a round runs over HTTP
def test_a_killed_group_server_is_taken_over_without_losing_the_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the leader runs in this process: it gives up on a silent server after 1.5 s here
    monkeypatch.setattr(hosts, "STALE_S", 1.5)

    async def main() -> None:
        async with _round(tmp_path) as (fed, live, urls, procs):
            spec = live.coordinator.live.spec
            assert spec is not None
            cohort = Cohort(spec, fed.identities)
            leader = _LeaderTraffic(live.coordinator, monkeypatch)
            expositions = []

            def kill() -> None:  # its group's advertisements are stored; it dies
                expositions.append(_scrape(urls[1]))
                os.kill(procs[1].pid, signal.SIGKILL)
                procs[1].wait()

            async with _clients(fed, live, spec) as clients:
                await _run(fed, live, clients, cohort, after_advertise=kill)
            expositions.append(_scrape(urls[0]))
            # what the dead server stored before it died is counted, and what the
            # leader then served of its group
            summary, (own_up, _) = leader.summary(fed)
            served = sum(up for up, _ in _wire_bytes(expositions).values())
            assert summary.bytes_up == own_up + served
            taken = [
                e["body"]["member"]
                for e in log_entries(fed.ws)
                if e["kind"] == "accepted" and e["body"]["stage"] == "share_keys"
            ]
            assert sorted(taken) == sorted(MEMBERS)
            assert fed.ws.state.values.get("group_taken_over 1.0.1") is not None
            assert fed.ws.state.values.get("group_taken_over 1.0.0") is None
            _check_model(fed, cohort)

    asyncio.run(main())


def _advertise(desk: GroupDesk, cohort: Cohort, member: str) -> None:
    """``member``'s advertise message, taken by ``desk``."""
    body = cohort.advertise(member)
    asyncio.run(
        desk.accept(
            member, 1, 0, "advertise", wire.encode(body), lambda m: codec.advertise_message(m, body)
        )
    )


def test_a_group_server_stores_nothing_it_may_not(tmp_path: Path) -> None:
    """The desk's refusals, in process: another group's member (421 naming its server),
    a group the leader took over (503 not_leader: the member moves on to the leader),
    a stage the store is not in; each leaves the store as it was."""
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    fed = _federation(tmp_path / "ws", urls)
    coord = Coordinator(fed.ws)
    for m in MEMBERS:
        assert coord.join(m, 1, 0, join_request(m, 1)).accepted
    spec = coord.live.spec
    assert spec is not None and coord.live.stage == "advertise"
    cohort = Cohort(spec, fed.identities)
    desk = GroupDesk(fed.ws, urls[0])

    def advertise(m: str) -> None:
        _advertise(desk, cohort, m)

    ours, theirs = spec.groups[0].members, spec.groups[1].members
    with pytest.raises(WrongGroup, match=f"group 1 of round 1, served at {urls[1]}"):
        advertise(theirs[0])
    advertise(ours[0])
    assert fed.ws.state.messages.count(1, 0, "advertise") == 1
    StoreGroupHosts(fed.ws.state, 1, 0).take_over(0)
    with pytest.raises(NotLeader, match="taken over by the leader"):
        advertise(ours[1])
    assert fed.ws.state.messages.count(1, 0, "advertise") == 1
    shares = wire.ShareKeysBody(shares=[])
    with pytest.raises(WrongStage, match="is in stage advertise"):
        asyncio.run(
            desk.accept(
                ours[2],
                1,
                0,
                "share_keys",
                wire.encode(shares),
                lambda m: codec.share_keys_message(m, shares),
            )
        )
    assert fed.ws.state.messages.count(1, 0, "share_keys") == 0


#: Two group servers' URLs that nothing listens on: the desks' tests call them directly.
DESK_URLS: Final = ["http://127.0.0.1:1", "http://127.0.0.1:2"]


def _joined_desk(tmp_path: Path) -> tuple[Federation, GroupDesk, list[float]]:
    """A two-server federation whose members joined round 1, and the first server's desk
    on a clock the test moves (``now[0]``)."""
    fed = _federation(tmp_path / "ws", DESK_URLS)
    coord = Coordinator(fed.ws)
    for m in MEMBERS:
        assert coord.join(m, 1, 0, join_request(m, 1)).accepted
    now = [1000.0]
    return fed, GroupDesk(fed.ws, DESK_URLS[0], clock=lambda: now[0]), now


def test_held_requests_share_one_read_of_the_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """However many members a group server holds, it reads the attempt's stage (a row
    that carries the round's spec) once per poll interval, and sees the leader's next
    stage at the first read after it."""
    fed, desk, now = _joined_desk(tmp_path)
    reads: list[int] = []
    get = fed.ws.state.rounds.get

    def counted(r: int, a: int) -> RoundRow | None:
        reads.append(r)
        return get(r, a)

    monkeypatch.setattr(fed.ws.state.rounds, "get", counted)
    assert all(desk.reached(1, 0, "advertise") for _ in range(250))
    assert not any(desk.reached(1, 0, "share_keys") for _ in range(250))
    assert len(reads) == 1
    fed.ws.state.rounds.set_stage(1, 0, "share_keys", now=0.0)
    assert not desk.reached(1, 0, "share_keys")  # within the interval: the read stands
    now[0] += 2 * STAGE_POLL_S
    assert desk.reached(1, 0, "share_keys") and len(reads) == 2
    assert not desk.reached(1, 1, "advertise") and len(reads) == 3  # another attempt: read


def test_a_group_server_counts_a_request_in_the_attempt_in_progress(tmp_path: Path) -> None:
    """As the leader counts its own: in the newest stored attempt when the request
    arrives (read once per poll interval, and again at once for a request naming a
    later attempt, so the first request of a new attempt is not counted in the last);
    stored with the heartbeat, where the leader reads it per attempt."""
    fed, desk, now = _joined_desk(tmp_path)
    assert desk.count_request((1, 0), 10) == (1, 0)
    desk.count_answer((1, 0), 3)
    fed.ws.state.rounds.open(1, 1, now=0.0)  # the leader retries the round
    assert desk.count_request((1, 1), 20) == (1, 1)  # within the interval: read again
    assert desk.count_request(None, 5) == (1, 1)  # a request naming none: the newest
    assert hosts.stored_traffic(fed.ws.state, 1, 1, DESK_URLS) == (0, 0)  # not yet committed
    desk.beat(now[0])
    assert hosts.stored_traffic(fed.ws.state, 1, 0, DESK_URLS) == (10, 3)
    assert hosts.stored_traffic(fed.ws.state, 1, 1, [*DESK_URLS, DESK_URLS[0]]) == (25, 0)
    desk.beat(now[0])  # nothing new: nothing added twice
    assert hosts.stored_traffic(fed.ws.state, 1, 1, DESK_URLS) == (25, 0)
    fed.ws.close()


def test_a_round_through_group_desks_survives_a_leader_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both groups' messages taken by group desks (each on a workspace of its own, as a
    group server process opens it), the leader restarted mid-round: it rebuilds each
    served group from the store, closes the round with the exact sum, and the one log
    verifies."""
    monkeypatch.setattr(hosts, "STALE_S", 600.0)  # no heartbeats here: nothing is taken over
    _desk_round(tmp_path, {})


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    with postgres_server() as server:
        yield server


def test_group_desks_write_under_the_leaders_token_on_postgresql(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, postgres: Postgres
) -> None:
    """The same round over PostgreSQL: the desks hold no lease and write under the
    leader's fencing token, ordered with its writes (one log chain). A restarted leader
    takes the lease with a new token: a desk's next write is refused in its transaction
    (RetryLater, nothing stored), and its retry passes under the new token."""
    monkeypatch.setattr(hosts, "STALE_S", 600.0)
    _desk_round(tmp_path, {"storage": {"url": fresh_database(postgres)}})


def _desk_round(tmp_path: Path, sections: dict[str, Any]) -> None:
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    fed = _federation(tmp_path / "aggregator", urls, sections=sections)
    clock = FakeClock()
    coord = Coordinator(fed.ws, clock=clock)
    for m in MEMBERS:
        assert coord.join(m, 1, 0, join_request(m, 1)).accepted
    spec = coord.live.spec
    assert spec is not None
    cohort = Cohort(spec, fed.identities)
    desks = [GroupDesk(Workspace.open(fed.root, lead=False), url) for url in urls]
    desk = {m: desks[group_index(spec.groups, m)] for m in MEMBERS}
    counted = [0, 0]

    def moved(stage: str) -> None:
        coord.tick()
        assert coord.live.stage == stage

    def served(m: str, received: int = 700, sent: int = 90) -> None:
        """A request of ``m`` its group's server served, counted as the server counts
        it (its upload's bytes on arrival, then its answer's)."""
        attempt = desk[m].count_request((1, 0), received)
        assert attempt == (1, 0)
        desk[m].count_answer(attempt, sent)
        counted[0] += received
        counted[1] += sent

    for m in MEMBERS:
        served(m)
        _advertise(desk[m], cohort, m)
    moved("share_keys")
    for m in MEMBERS:
        served(m, 300, 2_000)
        body = cohort.share_keys(m, desk[m].answer("key_list", m, 1, 0))
        asyncio.run(desk[m].share_keys(m, 1, 0, body))
    moved("masked_input")
    for m in MEMBERS:
        cohort.receive_shares(m, desk[m].answer("share_relay", m, 1, 0))
    # a refused masked input is a refused entry in the one chain, over either store
    first = MEMBERS[0]
    with pytest.raises(BadVector):
        asyncio.run(desk[first].masked_input(first, 1, 0, *cohort.upload(first, b"\0" * 8)))
    tail = fed.ws.state.log.log_tail()
    assert tail is not None and json.loads(tail[1])["kind"] == "refused"
    for m in MEMBERS:
        served(m, 20_000)
        asyncio.run(desk[m].masked_input(m, 1, 0, *cohort.upload(m)))
    moved("consistency")
    # group server 1 restarts: what it stored is kept; what it counted since (a fetch
    # whose bytes no commit carried) dies with it
    restarted = desks[1]
    restarted.count_request((1, 0), 99_999)
    desks[1] = GroupDesk(Workspace.open(fed.root, lead=False), urls[1])
    desk = {m: desks[group_index(spec.groups, m)] for m in MEMBERS}
    for m in MEMBERS:
        served(m)
        signed = cohort.sign(m, desk[m].answer("unmask_request", m, 1, 0))
        asyncio.run(
            desk[m].accept(
                m,
                1,
                0,
                "consistency",
                wire.encode(signed),
                lambda m, s=signed: codec.consistency_message(m, s),
            )
        )
    # the leader restarts: every served group is rebuilt from the store
    fed.ws.close()
    fed = Federation(Workspace.open(fed.root), fed.identities)
    coord = Coordinator(fed.ws, clock=clock)
    assert coord.live.stage == "consistency"
    moved("unmask")
    retried = 0
    for m in MEMBERS:
        served(m)
        answer = cohort.unmask(m, desk[m].answer("consistency_proof", m, 1, 0))
        try:
            asyncio.run(desk[m].unmask(m, 1, 0, answer))
        except RetryLater:  # PostgreSQL: the desk's token was the previous leader's
            assert fed.ws.state.messages.get(1, 0, "unmask", m) is None
            retried += 1
            asyncio.run(desk[m].unmask(m, 1, 0, answer))
    # on PostgreSQL each desk's first write after the restart is fenced, then it follows
    assert retried == (len(desks) if sections else 0)
    # a fetch after the server's last message: its heartbeat carries its bytes
    served(MEMBERS[0], 400, 5_000)
    desk[MEMBERS[0]].beat(time.time())
    coord.tick()
    assert coord.live.round == 2
    assert [desks[0].accepted, restarted.accepted + desks[1].accepted] == [
        5 * len(g.members) for g in spec.groups
    ]
    _check_model(fed, cohort)
    # the summary counts what both servers served, each byte once, across the restart
    # of either process and the fenced (rolled back, retried) writes
    row = fed.ws.state.rounds.get(1, 0)
    assert row is not None and row.summary is not None
    summary = msgspec.json.decode(row.summary, type=wire.RoundSummary)
    assert [summary.bytes_up, summary.bytes_down] == counted
    for d in [*desks, restarted]:
        d.ws.close()
    fed.ws.close()


def _desk_cohort(
    tmp_path: Path, urls: list[str], events: EventBus | None = None, epsilon: float = 0.0
) -> tuple[Federation, Coordinator, Cohort]:
    """The leader in process with both groups' keys shared through group desks (with
    each member's signed privacy report when ``epsilon``): the attempt waits in stage
    masked_input."""
    fed = _federation(tmp_path / "aggregator", urls)
    coord = Coordinator(fed.ws, clock=FakeClock(), events=events)
    for m in MEMBERS:
        assert coord.join(m, 1, 0, join_request(m, 1)).accepted
    spec = coord.live.spec
    assert spec is not None
    cohort = Cohort(spec, fed.identities)
    desks = [GroupDesk(fed.ws, url) for url in urls]
    desk = {m: desks[group_index(spec.groups, m)] for m in MEMBERS}
    for m in MEMBERS:
        _advertise(desk[m], cohort, m)
    coord.tick()
    for m in MEMBERS:
        body = cohort.share_keys(m, desk[m].answer("key_list", m, 1, 0))
        if epsilon:
            report = privacy_report(m, epsilon, federation_id=fed.ws.federation_id)
            body = msgspec.structs.replace(body, report=report.sign(fed.identities[m]))
        asyncio.run(desk[m].share_keys(m, 1, 0, body))
    coord.tick()
    assert coord.live.stage == "masked_input"
    for m in MEMBERS:
        cohort.receive_shares(m, desk[m].answer("share_relay", m, 1, 0))
    return fed, coord, cohort


async def _post_masked(
    fed: Federation, url: str, member: str, uploads: list[tuple[bytes, str, str]]
) -> tuple[list[tuple[int, dict[str, Any]]], str]:
    """Serve ``url``'s groups in this process (a group server's app on its own
    workspace), post ``member``'s ``uploads`` to it in turn; their answers, and the
    server's ``/metrics`` exposition after them."""
    group_ws = Workspace.open(fed.root, lead=False)
    app = make_group_app(group_ws, url)
    port = int(url.rsplit(":", 1)[1])
    server = await start_server(app, "127.0.0.1", port, None, group_ws.config.server)
    answers = []
    try:
        async with aiohttp.ClientSession() as http:
            for raw, commitment, signature in uploads:
                path = (
                    f"/v1/rounds/1/masked-input?attempt=0&commitment={commitment}"
                    f"&signature={signature}"
                )
                headers = {"Content-Type": "application/octet-stream"}
                headers |= sign_request(
                    fed.identities[member], "POST", path, headers, raw, created=int(time.time())
                )
                async with http.post(url + path, data=raw, headers=headers) as resp:
                    answers.append((resp.status, await resp.json()))
            async with http.get(f"{url}/metrics") as resp:  # loopback: open by default
                assert resp.status == 200
                exposition = await resp.text()
    finally:
        await server.close()
        group_ws.close()
    return answers, exposition


def test_a_masked_input_refused_at_a_group_server_is_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack: a member posts its group server a masked input of the wrong length
    (under a statement it signed over those bytes), then one whose statement another
    member signed.  Each is refused over HTTP, nothing is stored, and each refusal is a
    ``refused`` entry of the one log chain (as the leader writes its own), which
    ``fedsec audit verify`` reads through once the round closes."""
    monkeypatch.setattr(hosts, "STALE_S", 600.0)  # the leader takes nothing over here
    urls = [f"http://127.0.0.1:{_free_port()}", "http://127.0.0.1:2"]
    fed, coord, cohort = _desk_cohort(tmp_path, urls)
    spec = cohort.spec
    attacker = spec.groups[0].members[0]
    other = spec.groups[0].members[1]
    good, _, _ = cohort.upload(attacker)
    short = good[:-8]
    attacks = [cohort.upload(attacker, short), cohort.upload(attacker, signer=other)]

    before = len(log_entries(fed.ws))
    answers, _ = asyncio.run(_post_masked(fed, urls[0], attacker, attacks))
    assert [(s, a["error"]) for s, a in answers] == [
        (400, "bad_vector"),
        (401, "bad_signature"),
    ], answers
    assert fed.ws.state.messages.count(1, 0, "masked_input") == 0
    assert fed.ws.state.receipts.latest(1, attacker) is None
    added = log_entries(fed.ws, before)
    assert [(e["kind"], e["body"]["member"], e["body"]["code"]) for e in added] == [
        ("refused", attacker, "bad_vector"),
        ("refused", attacker, "bad_signature"),
    ]
    assert [e["body"]["sha256"] for e in added] == [
        hashlib.sha256(raw).hexdigest() for raw, _, _ in attacks
    ]
    # the round goes on as if nothing happened; the leader's file gets the entries
    desk = GroupDesk(fed.ws, urls[0]), GroupDesk(fed.ws, urls[1])
    for m in MEMBERS:
        asyncio.run(desk[group_index(spec.groups, m)].masked_input(m, 1, 0, *cohort.upload(m)))
    coord.tick()
    assert coord.live.stage == "consistency"
    lines = (fed.root / "audit" / "log.jsonl").read_text().splitlines()
    assert sum('"kind":"refused"' in line for line in lines) == 2
    audit = fed.root / "audit"
    verified = verify_log(audit / "log.jsonl", audit / "archive", fed.root)
    assert verified.ok, verified.problem
    fed.ws.close()


def test_the_leader_announces_each_report_a_group_server_stored_once(tmp_path: Path) -> None:
    """Privacy reports sent with the shares to group servers reach the leader's events
    (metrics, ε alerts) as its own do: one ``PrivacyReported`` per member, when the
    leader replays the member's shares, and none again at later ticks."""
    bus = EventBus()
    heard: list[PrivacyReported] = []
    bus.subscribe(lambda e: heard.append(e) if isinstance(e, PrivacyReported) else None)
    fed, coord, _ = _desk_cohort(tmp_path, ["http://127.0.0.1:1", "http://127.0.0.1:2"], bus, 0.5)
    coord.tick()
    assert sorted((e.member, e.epsilon, e.round) for e in heard) == [(m, 0.5, 1) for m in MEMBERS]
    assert fed.ws.state.reports.get(1, 0, MEMBERS[0]) is not None
    fed.ws.close()


def test_a_group_server_refuses_a_report_as_the_leader_does(tmp_path: Path) -> None:
    """The report check is the leader's: a report naming another member, or with an ε
    that is not finite, is refused with the shares, and nothing is stored."""
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    fed = _federation(tmp_path / "ws", urls)
    coord = Coordinator(fed.ws)
    for m in MEMBERS:
        assert coord.join(m, 1, 0, join_request(m, 1)).accepted
    spec = coord.live.spec
    assert spec is not None
    cohort = Cohort(spec, fed.identities)
    desk = GroupDesk(fed.ws, urls[0])
    ours = spec.groups[0].members
    for m in MEMBERS:
        _advertise(desk if m in ours else GroupDesk(fed.ws, urls[1]), cohort, m)
    coord.tick()
    m = ours[0]
    shares = cohort.share_keys(m, desk.answer("key_list", m, 1, 0))
    fid = fed.ws.federation_id
    for bad, why in (
        (privacy_report(ours[1], federation_id=fid), "names another member"),
        (privacy_report(m, float("nan"), federation_id=fid), "finite number"),
    ):
        body = msgspec.structs.replace(shares, report=bad.sign(fed.identities[m]))
        with pytest.raises(PayloadError, match=why):
            asyncio.run(desk.share_keys(m, 1, 0, body))
    assert fed.ws.state.messages.count(1, 0, "share_keys") == 0
    assert fed.ws.state.reports.get(1, 0, m) is None
    fed.ws.close()


def test_a_group_server_counts_what_it_serves_on_its_own_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group server's requests, bytes and contributions are on its own ``/metrics``
    (the leader's registry, less the federation's state, which the leader exports): a
    refused and an accepted masked input, counted once each, by status and code."""
    monkeypatch.setattr(hosts, "STALE_S", 600.0)
    urls = [f"http://127.0.0.1:{_free_port()}", "http://127.0.0.1:2"]
    fed, _, cohort = _desk_cohort(tmp_path, urls)
    m = cohort.spec.groups[0].members[0]
    good = cohort.upload(m)
    answers, exposition = asyncio.run(
        _post_masked(fed, urls[0], m, [cohort.upload(m, good[0][:-8]), good])
    )
    assert [s for s, _ in answers] == [400, 200]
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in exposition.splitlines()
        if line and not line.startswith("#")
    }
    assert samples['fedsec_http_requests_total{endpoint="masked_input",status="400"}'] == 1
    assert samples['fedsec_http_requests_total{endpoint="masked_input",status="200"}'] == 1
    sent = len(good[0]) + len(good[0]) - 8
    assert samples['fedsec_http_request_bytes_total{endpoint="masked_input"}'] == sent
    assert samples["fedsec_contributions_accepted_total"] == 1
    assert samples['fedsec_contributions_refused_total{code="bad_vector"}'] == 1
    # the federation's state is the leader's to export: no round gauges here
    assert not any(k.startswith("fedsec_round_stage") for k in samples)
    fed.ws.close()
