"""``GET /metrics`` scraped from a live aggregator while real agents run rounds over
loopback HTTP, parsed with prometheus_client's own text parser: the numbers are the
state's."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import make_mocked_request
from prometheus_client.parser import text_string_to_metric_families

from fedsec.agent.runtime import AgentRuntime
from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.http import make_app
from fedsec.aggregator.http.auth import head_bytes
from fedsec.aggregator.http.keys import COORDINATOR, METRICS
from fedsec.aggregator.ops import Operations
from fedsec.aggregator.ops.live import LiveView
from fedsec.aggregator.ops.metrics import CONTENT_TYPE, FederationMetrics
from fedsec.aggregator.rounds.events import RoundEnded
from fedsec.aggregator.transport import start_server
from fedsec.federation import agent_config, create_federation, enrol_agents, federation_toml
from fedsec.protocol import wire
from fedsec.protocol.stages import SECAGG_STAGES, STAGES
from tests.support.aggregator import make_federation
from tests.support.hostile import serve
from tests.support.round_history import DDP_ROUNDS, summary

pytestmark = pytest.mark.timeout(180)


async_test = pytest.mark.asyncio

AGENTS = 4
ROUNDS = 4
TASK = "breast_cancer"


def _parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """sample name and labels -> value, through prometheus_client's parser."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _federation(root: Path) -> tuple[Any, list[Any]]:
    text = federation_toml(
        "metrics",
        TASK,
        round_={
            "min_agents": 3,
            "max_agents": AGENTS,
            "rounds": ROUNDS,
            "advertise_s": 20.0,
            "share_s": 20.0,
            "masked_s": 30.0,
            "unmask_s": 20.0,
            "open_s": 60.0,
        },
        training={"local_epochs": 1, "batch_size": 32, "lr": 0.1},
        dp={"enabled": False, "noise_multiplier": 1000.0},
        server={"port": 0},
    )
    ws = create_federation(root, "metrics", TASK, text)
    return ws, enrol_agents(ws, root, AGENTS)


@async_test
async def test_metrics_scraped_during_live_rounds_match_the_state(tmp_path: Path) -> None:
    ws, local = _federation(tmp_path)
    app = make_app(ws, Coordinator(ws))
    coord = app[COORDINATOR]
    server = await start_server(app, "127.0.0.1", 0, None, ws.config.server)
    runtimes = [
        AgentRuntime(
            agent_config(
                a,
                url=server.url,
                aggregator_public=ws.signer.public_bytes,
                task=TASK,
                part_index=i,
                parts=AGENTS,
                partition="iid",
                seed=0,
                epsilon=1e9,
                require_dp=False,
            ),
            a.identity,
        )
        for i, a in enumerate(local)
    ]
    await asyncio.gather(*(asyncio.to_thread(rt.prepare) for rt in runtimes))
    agents = asyncio.gather(*(rt.run() for rt in runtimes))
    mid_round: dict[Any, float] | None = None
    seen_stages: set[str] = set()
    try:
        async with aiohttp.ClientSession() as client:

            async def scrape() -> dict[Any, float]:
                async with client.get(f"{server.url}/metrics") as answer:
                    assert answer.status == 200
                    assert answer.headers["Content-Type"] == CONTENT_TYPE
                    return _parse(await answer.text())

            deadline = time.monotonic() + 120
            while not agents.done() and time.monotonic() < deadline:
                before = (coord.token, coord.current_attempt(), coord.live.stage)
                accepted = ws.state.messages.count(*coord.current_attempt(), "masked_input")
                samples = await scrape()
                after = (coord.token, coord.current_attempt(), coord.live.stage)
                still = ws.state.messages.count(*coord.current_attempt(), "masked_input")
                if before == after and accepted == still and coord.live.stage in SECAGG_STAGES:
                    # nothing moved while the scrape was answered: it must be the state
                    live = coord.live
                    assert _value(samples, "fedsec_round") == live.round
                    assert _value(samples, "fedsec_round_attempt") == live.attempt
                    for stage in STAGES:
                        expected = 1.0 if stage == live.stage else 0.0
                        assert _value(samples, "fedsec_round_stage", stage=stage) == expected
                    assert _value(samples, "fedsec_rounds_completed") == coord.rounds_completed
                    closed = ws.state.rounds.count_closed()
                    assert _value(samples, "fedsec_rounds_closed_total") == closed
                    assert _value(samples, "fedsec_members_active") == AGENTS
                    assert _value(samples, "fedsec_model_version") == ws.models.latest().version
                    left = _value(samples, "fedsec_stage_deadline_seconds")
                    assert 0 < left <= coord.deadline() - live.stage_started_at
                    seen_stages.add(live.stage)
                    mid_round = samples
                await asyncio.sleep(0.005)
            await asyncio.wait_for(agents, 60)
            final = await scrape()
    finally:
        if not agents.done():
            agents.cancel()
        await server.close()
    assert mid_round is not None, "no scrape landed mid-round"
    assert seen_stages & {"advertise", "share_keys", "masked_input", "unmask"}

    # the finished federation: every counter is the state's own count
    history = [r for r in ws.state.rounds.history() if r.stage in ("closed", "aborted")]
    closed = [r for r in history if r.stage == "closed"]
    aborted = [r for r in history if r.stage == "aborted"]
    assert _value(final, "fedsec_rounds_closed_total") == len(closed) == ROUNDS
    assert sum(v for (name, _), v in final.items() if name == "fedsec_rounds_aborted_total") == len(
        aborted
    )
    opened = len(ws.state.rounds.history())
    assert _value(final, "fedsec_rounds_opened_total") == opened
    accepted = sum(
        ws.state.messages.count(r.round, r.attempt, "masked_input")
        for r in ws.state.rounds.history()
    )
    assert _value(final, "fedsec_contributions_accepted_total") == accepted
    assert _value(final, "fedsec_round_duration_seconds_count") == len(closed)
    assert _value(final, "fedsec_aggregation_seconds_count") == len(closed)
    # every stage each closed attempt passed through was timed once
    assert _value(final, "fedsec_stage_duration_seconds_count", stage="unmask") == len(closed)
    latest = ws.models.latest()
    assert _value(final, "fedsec_model_validation_accuracy") == pytest.approx(
        latest.metrics["accuracy"]
    )
    assert _value(final, "fedsec_model_validation_loss") == pytest.approx(latest.metrics["loss"])
    joined = sum(len(ws.state.joins.samples(r.round, r.attempt)) for r in history)
    assert _value(final, "fedsec_members_joined_total") <= joined
    # requests by endpoint and status: the joins and masked inputs the agents made
    assert _value(final, "fedsec_http_requests_total", endpoint="masked_input", status="200") >= (
        accepted
    )
    assert _value(final, "fedsec_http_request_bytes_total", endpoint="masked_input") > 0
    # a GET has no body, but its head (signature fields) is counted
    assert _value(final, "fedsec_http_request_head_bytes_total", endpoint="get_round") > 0
    assert _value(final, "fedsec_http_response_bytes_total", endpoint="get_round") > 0
    # plain rounds sum nothing on a distributed-DP ring: no wrap is counted
    assert _value(final, "fedsec_ddp_summed_coordinates_total") == 0
    assert _value(final, "fedsec_ddp_wrapped_coordinates_total") == 0
    # epsilon reported: per member and the largest (no DP: each member reports 0)
    epsilons = ws.state.reports.epsilons()
    assert _value(final, "fedsec_epsilon_max") == pytest.approx(max(epsilons.values()))
    for member, eps in epsilons.items():
        assert _value(final, "fedsec_member_epsilon", member=member) == pytest.approx(eps)
    ws.close()


def test_member_labels_can_be_turned_off(tmp_path: Path) -> None:
    live = LiveView(lambda: (1, 0, "open", 0, 1, None), lambda: 3, dict, {"a0": 1.5})
    with_members = _parse(FederationMetrics(live, member_labels=True).exposition().decode())
    without = _parse(FederationMetrics(live, member_labels=False).exposition().decode())
    assert _value(with_members, "fedsec_member_epsilon", member="a0") == 1.5
    assert not any(name == "fedsec_member_epsilon" for name, _ in without)
    assert _value(without, "fedsec_epsilon_max") == 1.5


def test_distributed_dp_rounds_count_their_summed_and_wrapped_coordinates() -> None:
    live = LiveView(lambda: (4, 0, "open", 3, 3, None), lambda: 4, dict, {})
    metrics = FederationMetrics(live, member_labels=False)

    def ended(s: wire.RoundSummary) -> RoundEnded:
        return RoundEnded(s, "unmask", 0.1, "" if s.stage == "closed" else "aborted", (), 0.0)

    for round_ in sorted(DDP_ROUNDS):
        metrics.on_event(ended(summary(round_)))
    # an aborted attempt summed nothing, whatever its summary says
    aborted = summary(3, attempt=1, stage="aborted", model_version=None, edge_count=7)
    metrics.on_event(ended(aborted))
    samples = _parse(metrics.exposition().decode())
    assert _value(samples, "fedsec_ddp_summed_coordinates_total") == sum(
        c for _, c, _ in DDP_ROUNDS.values()
    )
    assert _value(samples, "fedsec_ddp_wrapped_coordinates_total") == sum(
        e for _, _, e in DDP_ROUNDS.values()
    )
    assert _value(samples, "fedsec_rounds_closed_total") == len(DDP_ROUNDS)


def test_two_aggregators_in_one_process_keep_their_own_numbers(tmp_path: Path) -> None:
    one = make_federation(tmp_path / "one")
    two = make_federation(tmp_path / "two")
    a, b = Operations(Coordinator(one.ws)), Operations(Coordinator(two.ws))
    a.metrics.observe_request("join", 200, 10, 20)
    assert (
        _value(
            _parse(a.metrics.exposition().decode()),
            "fedsec_http_requests_total",
            endpoint="join",
            status="200",
        )
        == 1
    )
    assert (
        _value(
            _parse(b.metrics.exposition().decode()),
            "fedsec_http_requests_total",
            endpoint="join",
            status="200",
        )
        == 0
    )


def test_a_request_head_is_counted_as_it_came_over_the_wire() -> None:
    headers = {"Host": "127.0.0.1:80", "Signature": "f=:AA==:", "Content-Length": "2"}
    request = make_mocked_request("POST", "/v1/rounds/1/join?attempt=0", headers=headers)
    sent = (
        b"POST /v1/rounds/1/join?attempt=0 HTTP/1.1\r\n"
        b"Host: 127.0.0.1:80\r\nSignature: f=:AA==:\r\nContent-Length: 2\r\n\r\n"
    )
    assert head_bytes(request) == len(sent)


def _observe_uncached(metrics: FederationMetrics, *request: Any) -> None:
    """What ``observe_request`` did before its series were cached: every label looked up."""
    endpoint, status, received, sent, head = request
    metrics.requests.labels(endpoint, str(status)).inc()
    if head:
        metrics.head_bytes_in.labels(endpoint).inc(head)
    if received:
        metrics.bytes_in.labels(endpoint).inc(received)
    if sent:
        metrics.bytes_out.labels(endpoint).inc(sent)


def test_cached_request_series_appear_when_uncached_ones_did() -> None:
    # a series must neither appear before its first count (an empty body, a 304 with no
    # bytes out) nor vanish: the exposition is compared after every request
    cached = FederationMetrics(None, member_labels=False)
    uncached = FederationMetrics(None, member_labels=False)
    requests = [
        ("round", 200, 0, 0, 150),
        ("round", 200, 0, 310, 150),
        ("join", 200, 90, 0, 0),
        ("join", 403, 90, 60, 200),
        ("round", 304, 0, 0, 150),
        ("unmatched", 404, 0, 50, 80),
        ("join", 200, 90, 120, 200),
        ("round", 200, 0, 310, 150),
        ("model", 200, 0, 9000, 120),
    ]
    for request in requests:
        cached.observe_request(*request)
        _observe_uncached(uncached, *request)
        assert cached.exposition() == uncached.exposition(), request


@async_test
async def test_unknown_paths_add_one_request_series(tmp_path: Path) -> None:
    fed = make_federation(tmp_path)
    served = await serve(fed.ws, Coordinator(fed.ws))
    try:
        metrics = served.app[METRICS]
        async with aiohttp.ClientSession() as client:
            for i in range(40):
                url = f"http://127.0.0.1:{served.port}/v1/no-such-{i}/{'x' * i}"
                async with client.request("GET" if i % 2 else "DELETE", url) as answer:
                    assert answer.status in (404, 405)
        samples = _parse(metrics.exposition().decode())
        endpoints = {
            dict(labels)["endpoint"]
            for name, labels in samples
            if name == "fedsec_http_requests_total"
        }
        assert endpoints == {"unmatched"}
        assert set(metrics._request_series) <= {("unmatched", 404), ("unmatched", 405)}
        assert set(metrics._head_series) == {"unmatched"}
    finally:
        await served.stop()
