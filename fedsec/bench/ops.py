"""``fedsec bench ops``: what operations cost the aggregator.

- ``--part metrics``: ``GET /metrics`` (and the dashboard snapshot) latency over loopback
  HTTP with ``--members`` enrolled agents and ``--rounds`` closed rounds in the state, the
  metrics fed the events of those rounds (every member joining, contributing and
  reporting in each, a few refusals, every endpoint answered).
- ``--part dashboard``: ``fedsec simulate`` runs with and without open dashboards,
  interleaved, each reporting its wall time and what the pushed snapshots cost the
  aggregator (its ``fedsec_dashboard_push_seconds_total``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import click
import msgspec

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.http import make_app
from fedsec.aggregator.http.keys import OPS
from fedsec.aggregator.rounds.events import (
    CohortFixed,
    ContributionAccepted,
    ContributionRefused,
    PrivacyReported,
    RoundEnded,
    RoundOpened,
    StageEntered,
)
from fedsec.aggregator.transport import start_server
from fedsec.bench.common import with_environment
from fedsec.crypto.identity import SigningIdentity
from fedsec.federation import create_federation, federation_toml
from fedsec.protocol import wire
from fedsec.protocol.endpoints import ENDPOINTS
from fedsec.protocol.roster import sign_roster_entry

_STAGES = ("open", "advertise", "share_keys", "masked_input", "unmask")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _fill_state(root: Path, members: int, rounds: int) -> tuple[Any, list[str]]:
    """A workspace with ``members`` agents and ``rounds`` closed rounds in state.db."""
    text = federation_toml("bench-ops", "breast_cancer", round_={"rounds": rounds + 10})
    ws = create_federation(root, "bench-ops", "breast_cancer", text)
    names = [f"member-{i:03d}" for i in range(members)]
    admin = ws.admin()
    for name in names:
        identity = SigningIdentity.generate()
        ws.roster.add(
            sign_roster_entry(
                federation_id="bench-ops",
                agent_id=name,
                public_key=identity.public_bytes,
                role="agent",
                admin=admin,
            )
        )
    t0 = time.time() - rounds * 60
    state = ws.state
    with state.transaction():
        for r in range(1, rounds + 1):
            opened = t0 + 60 * r
            state.rounds.open(r, 0, opened)
            summary = _summary(r, members, opened)
            state.rounds.close(
                r, 0, "closed", opened + 30, model_version=None, summary=summary, detail=""
            )
            for i, name in enumerate(names):
                state.joins.add(r, 0, name, 100 + i, opened)
                state.receipts.add(r, 0, name, b"{}")
                state.reports.add(r, 0, name, 0.01 * r, b"{}")
    return ws, names


def _summary(r: int, members: int, opened: float) -> bytes:
    return wire.encode(
        wire.RoundSummary(
            round=r,
            attempt=0,
            stage="closed",
            cohort=members,
            participants=members,
            survivors=members - 1,
            dropped=["member-000"],
            model_version=r,
            accuracy=0.9,
            loss=0.3,
            aggregation_s=0.05,
            duration_s=30.0,
            epsilon_max=0.01 * r,
            detail="",
            bytes_up=members * 18_000,
            bytes_down=members * 40_000,
        )
    )


def _feed_events(ops: Any, names: list[str], rounds: int) -> None:
    """The events of ``rounds`` rounds, so every counter and histogram has its series."""
    for r in range(1, rounds + 1):
        now = time.time()
        ops.metrics.on_event(RoundOpened(r, 0, now))
        ops.metrics.on_event(CohortFixed(r, 0, tuple(names), now))
        for before, stage in itertools.pairwise(_STAGES):
            ops.metrics.on_event(StageEntered(r, 0, stage, before, 2.0, now))
        for name in names:
            ops.metrics.on_event(ContributionAccepted(r, 0, name, 18_000))
            ops.live.on_event(PrivacyReported(r, 0, name, 0.01 * r, 8.0))
        ops.metrics.on_event(
            ContributionRefused(r, 0, names[r % len(names)], "wrong_stage", now, True)
        )
        summary = msgspec.json.decode(_summary(r, len(names), now), type=wire.RoundSummary)
        event = RoundEnded(summary, "unmask", 3.0, "", tuple(names[1:]), now)
        ops.metrics.on_event(event)
        ops.live.on_event(event)
    for ep in ENDPOINTS:
        for status in (200, 400, 401, 409):
            ops.metrics.observe_request(ep.name, status, 1000, 2000)


async def _latency(url: str, path: str, repeat: int) -> list[float]:
    times = []
    async with aiohttp.ClientSession() as session:
        for _ in range(repeat):
            start = time.perf_counter()
            async with session.get(url + path) as answer:
                await answer.read()
                assert answer.status == 200, answer.status
            times.append(time.perf_counter() - start)
    return times


async def _metrics_part(members: int, rounds: int, repeat: int) -> list[dict[str, Any]]:
    root = Path(tempfile.mkdtemp(prefix="fedsec-bench-ops-"))
    ws, names = _fill_state(root, members, rounds)
    app = make_app(ws, Coordinator(ws))
    _feed_events(app[OPS], names, rounds)
    server = await start_server(app, "127.0.0.1", 0, None, ws.config.server)
    out = []
    try:
        for path in ("/metrics", "/dashboard/api/snapshot"):
            await _latency(server.url, path, 20)  # warm up
            times = await _latency(server.url, path, repeat)
            out.append(
                with_environment(
                    {
                        "bench": "ops",
                        "part": "metrics",
                        "path": path,
                        "members": members,
                        "closed_rounds": rounds,
                        "requests": repeat,
                        "p50_ms": round(1000 * statistics.median(times), 3),
                        "p99_ms": round(1000 * _percentile(times, 0.99), 3),
                        "max_ms": round(1000 * max(times), 3),
                    }
                )
            )
        # what a push costs when it is not served from the cache: a stage change (the
        # attempt's live counts only) and a round's end (history, members, models too)
        builder = app[OPS].dashboard
        for what, rebuild in (("snapshot_stage_change", False), ("snapshot_round_end", True)):
            times = []
            for _ in range(min(repeat, 200)):
                if rebuild:
                    builder.invalidate()
                start = time.perf_counter()
                wire.encode(builder.build())
                times.append(time.perf_counter() - start)
            out.append(
                with_environment(
                    {
                        "bench": "ops",
                        "part": "metrics",
                        "path": what,
                        "members": members,
                        "closed_rounds": rounds,
                        "requests": len(times),
                        "p50_ms": round(1000 * statistics.median(times), 3),
                        "p99_ms": round(1000 * _percentile(times, 0.99), 3),
                        "max_ms": round(1000 * max(times), 3),
                    }
                )
            )
    finally:
        await server.close()
        ws.close()
    return out


def _dashboard_part(agents: int, rounds: int, pairs: int, viewers: int) -> list[dict[str, Any]]:
    from fedsec.simulation import SimulationSpec, run_simulation

    out = []
    for pair in range(pairs):
        # interleaved, the order alternating, so drift in the machine's speed hits both
        order = (0, viewers) if pair % 2 == 0 else (viewers, 0)
        for n in order:
            spec = SimulationSpec(
                task="mnist1d",
                agents=agents,
                rounds=rounds,
                secure_sum="secagg",
                baseline=False,
                dashboard_viewers=n,
            )
            result = asyncio.run(run_simulation(spec))
            wall = result["wall_s"]
            out.append(
                with_environment(
                    {
                        "bench": "ops",
                        "part": "dashboard",
                        "pair": pair,
                        "agents": agents,
                        "rounds": result["rounds"],
                        "dashboard_viewers": n,
                        "wall_s": wall,
                        "round_s_mean": result["round_s_mean"],
                        "dashboard_pushes": result.get("dashboard_pushes", 0),
                        "dashboard_push_s": result.get("dashboard_push_s", 0.0),
                        "push_share_of_wall": round(result.get("dashboard_push_s", 0.0) / wall, 5),
                    }
                )
            )
    return out


@click.command()
@click.option("--part", type=click.Choice(["metrics", "dashboard"]), required=True)
@click.option("--members", default=100, show_default=True, help="metrics: enrolled agents")
@click.option("--closed-rounds", default=1000, show_default=True, help="metrics: rounds in state")
@click.option("--repeat", default=1000, show_default=True, help="metrics: requests per path")
@click.option("--agents", default=50, show_default=True, help="dashboard: simulated agents")
@click.option("--rounds", default=30, show_default=True, help="dashboard: rounds per run")
@click.option("--pairs", default=3, show_default=True, help="dashboard: with/without pairs")
@click.option("--viewers", default=2, show_default=True, help="dashboard: open dashboards")
@click.option("--json", "as_json", is_flag=True, help="print JSON (the default format)")
def bench_ops(
    part: str,
    members: int,
    closed_rounds: int,
    repeat: int,
    agents: int,
    rounds: int,
    pairs: int,
    viewers: int,
    as_json: bool,
) -> None:
    """What /metrics and the live dashboard cost the aggregator."""
    if part == "metrics":
        lines = asyncio.run(_metrics_part(members, closed_rounds, repeat))
    else:
        lines = _dashboard_part(agents, rounds, pairs, viewers)
    for line in lines:
        click.echo(json.dumps(line))
