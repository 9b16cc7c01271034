"""Two aggregator replicas behind real aiohttp servers on loopback, one PostgreSQL
database: a replay recorded through one replica is refused by the other once it leads,
a standby refuses a state-changing request with ``503 not_leader`` naming the leader's
URL before consuming anything of it, and a deposed leader's refusal of a contribution
is not counted as the member's."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.http.app import make_app
from fedsec.aggregator.http.errors import LEADER_HEADER
from fedsec.aggregator.http.leadership import leads_here
from fedsec.aggregator.rounds.events import ContributionRefused, Event
from fedsec.aggregator.storage.postgres import PostgresStateStore
from fedsec.aggregator.storage.postgres.lease import LEASE_S, NotLeader
from fedsec.aggregator.workspace import Workspace
from fedsec.protocol import wire
from tests.support.aggregator import FakeClock, make_federation
from tests.support.http import AGENTS, JOIN, Api, _join_body, _to_masked_input, _upload

LEADER_URL = "https://replica-a.example:8443"

pytestmark = pytest.mark.asyncio


@pytest_asyncio.fixture
async def replicas(
    tmp_path: Path, database: str, aiohttp_client: Callable[..., Awaitable[TestClient]]
) -> AsyncIterator[tuple[Api, Api]]:
    clock = FakeClock()
    fed = make_federation(
        tmp_path / "ws",
        agents=AGENTS,
        round={"threshold": 2},  # 4 members; t = 2 as in the single-aggregator tests
        validation=False,
        sections={"storage": {"url": database}},
    )
    leader = Coordinator(fed.ws, clock=clock)
    standby_ws = Workspace.open(tmp_path / "ws")  # the lease is held: a standby
    standby = Coordinator(standby_ws, clock=clock)
    a = Api(await aiohttp_client(make_app(fed.ws, leader)), fed, leader)
    b = Api(await aiohttp_client(make_app(standby_ws, standby)), fed, standby)
    yield a, b
    for api in (a, b):  # stop the servers before their stores
        await api.client.close()
    standby_ws.close()
    fed.ws.close()


def _lease(api: Api) -> PostgresStateStore:
    store = api.coord.ws.state
    assert isinstance(store, PostgresStateStore)
    return store


def _take_over(deposed: Api, leader: Api) -> None:
    """``leader`` takes the lease over once ``deposed`` stopped renewing it (a pause)."""
    _lease(deposed).lease.stop_keeping()
    assert _lease(leader).lease.acquire(time.time() + 2 * LEASE_S)


def _stored(store: PostgresStateStore) -> tuple[object, ...]:
    """What a refused masked input must leave as it was (read through any replica)."""
    return (
        store.rounds.latest(),
        store.messages.count(1, 0, "masked_input"),
        store.receipts.has(1, 0, "a0"),
        store.log.log_tail(),
    )


async def _resumed(standby: Api, aiohttp_client: Callable[..., Awaitable[TestClient]]) -> Api:
    """What the standby serves once it took the lease over: an application around a
    coordinator rebuilt from the database (the replica's restart path)."""
    ws = standby.coord.ws
    resumed = Coordinator(ws, clock=standby.coord.context.clock)
    return Api(await aiohttp_client(make_app(ws, resumed)), standby.fed, resumed)


async def test_a_replay_through_the_new_leader_is_refused(
    replicas: tuple[Api, Api], aiohttp_client: Callable[..., Awaitable[TestClient]]
) -> None:
    a, b = replicas
    body = _join_body("a0")
    headers = a.headers("a0", "POST", JOIN, body)
    status, raw, _ = await a.send("POST", JOIN, body, headers)
    assert status == 200 and json.loads(raw)["accepted"] is True
    _take_over(a, b)
    b = await _resumed(b, aiohttp_client)
    status, raw, _ = await b.send("POST", JOIN, body, headers)
    assert status == 401 and json.loads(raw)["error"] == "replayed", raw
    assert a.fed.ws.state.joins.samples(1, 0) == {"a0": 50}


async def test_the_standby_refuses_a_write_naming_the_leader_url(
    replicas: tuple[Api, Api],
) -> None:
    a, b = replicas
    _lease(a).lease.advertise(LEADER_URL)
    body = _join_body("a1")
    headers = a.headers("a1", "POST", JOIN, body)
    async with b.client.request("POST", JOIN, data=body, headers=headers) as resp:
        status, raw, response_headers = resp.status, await resp.read(), resp.headers
    answer = json.loads(raw)
    assert (status, answer["error"]) == (503, "not_leader"), raw
    assert "is a standby" in answer["detail"] and "leads with token 1" in answer["detail"]
    assert LEADER_URL in answer["detail"]
    assert response_headers[LEADER_HEADER] == LEADER_URL
    assert a.fed.ws.state.joins.samples(1, 0) == {}
    # nothing of the request was consumed, not even its nonce: the very same signed
    # request is the leader's to accept
    status, raw, _ = await a.send("POST", JOIN, body, headers)
    assert status == 200 and json.loads(raw)["accepted"] is True, raw


async def test_a_deposed_leader_refuses_a_contribution_without_blaming_the_member(
    replicas: tuple[Api, Api], database: str
) -> None:
    a, _ = replicas
    cohort = await _to_masked_input(a)
    heard: list[Event] = []
    a.coord.events.subscribe(heard.append)
    # a third replica (its store only, so no round logic of its own runs) takes over
    # while the leader is paused
    _lease(a).lease.stop_keeping()
    c = PostgresStateStore(database, holder="replica-c")
    c.lease.advertise("https://replica-c.example:8443")
    assert c.lease.acquire(time.time() + 2 * LEASE_S)
    path, body = _upload(cohort, "a0")
    before, fenced = _stored(c), _lease(a).lease.refused
    status, raw, _ = await a.call("a0", "POST", path, body)
    answer = json.loads(raw)
    assert (status, answer["error"]) == (503, "not_leader"), raw
    assert "was deposed" in answer["detail"] and "replica-c.example" in answer["detail"]
    assert not [e for e in heard if isinstance(e, ContributionRefused)]
    # one fenced write (the acceptance's), not a second one logging the "refusal"
    assert _lease(a).lease.refused == fenced + 1
    assert _stored(c) == before
    c.close()


async def _scrape(api: Api) -> dict[str, float]:
    async with api.client.get("/metrics") as resp:
        assert resp.status == 200, await resp.text()
        text = await resp.text()
    return {
        name: float(value)
        for name, value in (
            line.split(" ", 1) for line in text.splitlines() if line and line[0] != "#"
        )
        if name in ("fedsec_leader", "fedsec_fencing_token", "fedsec_fenced_writes_refused")
    }


async def _health(api: Api) -> object:
    async with api.client.get("/v1/health") as resp:
        assert resp.status == 200
        return await resp.json()


async def test_health_and_metrics_say_each_replica_role(
    replicas: tuple[Api, Api], database: str
) -> None:
    a, b = replicas
    assert await _health(a) == {"status": "ok", "role": "leader", "token": 1}
    assert await _health(b) == {"status": "ok", "role": "standby"}
    assert await _scrape(a) == {
        "fedsec_leader": 1.0,
        "fedsec_fencing_token": 1.0,
        "fedsec_fenced_writes_refused": 0.0,
    }
    assert await _scrape(b) == {
        "fedsec_leader": 0.0,
        "fedsec_fencing_token": 0.0,
        "fedsec_fenced_writes_refused": 0.0,
    }
    # a paused leader deposed by another replica: its refused writes are counted
    _lease(a).lease.stop_keeping()
    c = PostgresStateStore(database, holder="replica-c")
    try:
        assert c.lease.acquire(time.time() + 2 * LEASE_S)
        with pytest.raises(NotLeader):
            a.coord.ws.state.rounds.open(9, 0, 1.0)
        assert (await _scrape(a))["fedsec_fenced_writes_refused"] == 1.0
        # the refusal told it: it stands by now, and says so
        assert await _health(a) == {"status": "ok", "role": "standby"}
        assert (await _scrape(a))["fedsec_leader"] == 0.0
        status, raw, _ = await a.call("a2", "POST", JOIN, _join_body("a2"))
        assert (status, json.loads(raw)["error"]) == (503, "not_leader"), raw
    finally:
        c.close()


async def test_the_dashboard_shows_each_replicas_role_and_token(
    replicas: tuple[Api, Api],
) -> None:
    seen = {}
    for name, api in zip("ab", replicas, strict=True):
        async with api.client.get("/dashboard/api/snapshot") as resp:
            assert resp.status == 200
            snapshot = msgspec.json.decode(await resp.read(), type=wire.DashboardSnapshot)
        seen[name] = (snapshot.role, snapshot.fencing)
    assert seen == {"a": ("leader", 1), "b": ("standby", None)}


async def test_a_standby_sends_member_reads_to_the_leader_too(
    replicas: tuple[Api, Api],
) -> None:
    # a standby's (or a deposed leader's) round state is stale: a member reading the
    # stage from it would be told "not reached yet" while the leader has moved on
    a, b = replicas
    _lease(a).lease.advertise(LEADER_URL)
    await _to_masked_input(a)
    for path in ("/v1/round", "/v1/rounds/1/shares", "/v1/status", "/v1/models/1"):
        status, raw, _ = await b.call("a0", "GET", path)
        assert (status, json.loads(raw)["error"]) == (503, "not_leader"), (path, raw)
    # what operators and probes read still answers
    async with b.client.get("/v1/health") as resp:
        assert resp.status == 200 and (await resp.json())["role"] == "standby"
    async with b.client.get("/dashboard/api/snapshot") as resp:
        assert resp.status == 200


async def test_a_standby_that_just_took_the_lease_refuses_writes_until_it_resumed(
    replicas: tuple[Api, Api], aiohttp_client: Callable[..., Awaitable[TestClient]]
) -> None:
    """Between taking the lease and serving a coordinator rebuilt from the database, the
    standby's own application (its round state the one it loaded at start) must not
    judge a member's request: it would call the round's stage wrong, a permanent
    refusal, and the member would drop out of a round that is going on."""
    a, b = replicas
    cohort = await _to_masked_input(a)
    for m in AGENTS[:2]:
        await a.ok(m, "POST", *_upload(cohort, m))
    _take_over(a, b)  # b leads now, but still serves the application it stood by with
    store = _lease(b)
    before = _stored(store)
    path, body = _upload(cohort, "a2")
    headers = b.headers("a2", "POST", path, body)
    status, raw, _ = await b.send("POST", path, body, headers)
    answer = json.loads(raw)
    assert (status, answer["error"]) == (503, "not_leader"), raw
    assert "resuming the round" in answer["detail"], answer
    assert _stored(store) == before
    # its round logic (deadlines, alert rules) stays idle too; the rebuilt one's runs
    assert not leads_here(b.client.app, store.lease)
    # nothing of it was consumed: the same signed request is the resumed coordinator's
    c = await _resumed(b, aiohttp_client)
    assert leads_here(c.client.app, store.lease)
    status, raw, _ = await c.send("POST", path, body, headers)
    assert status == 200, raw
    assert store.messages.count(1, 0, "masked_input") == 3
