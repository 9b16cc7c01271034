"""State-store benchmark: the same ``fedsec simulate`` federation with the aggregator's
state in SQLite (the embedded default) and in PostgreSQL (what replicas share), in
interleaved pairs.

Each pair runs both back ends one after the other, the order alternating from pair to
pair, so a machine whose load drifts slows both sides of a pair alike; the ratio is
taken within each pair (PostgreSQL's mean round time over SQLite's), and the result
reports every pair, their median and their spread.  Both workspaces live on the same
disk as the PostgreSQL cluster (not in RAM, where SQLite's fsync would cost nothing
while the server's still would); the cluster is a throw-away one of this machine's
PostgreSQL (:mod:`fedsec.bench.pgcluster`) with the server defaults (``fsync`` and
``synchronous_commit`` on, as a deployment must keep them), or the server at
``--database-url``.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import click

from fedsec.bench.common import with_environment
from fedsec.bench.failover import database_server

if TYPE_CHECKING:  # fedsec.simulation imports torch: only when a run starts
    from fedsec.simulation import SimulationSpec

#: The issue's target: a round on PostgreSQL within 1.3x of one on SQLite.
TARGET_RATIO: Final = 1.3
BACKENDS: Final = ("sqlite", "postgresql")


def _one_run(spec: SimulationSpec, root: Path) -> dict[str, Any]:
    from fedsec.simulation import run_simulation

    try:
        result: dict[str, Any] = asyncio.run(run_simulation(spec, workdir=root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {k: result.get(k) for k in ("round_s_mean", "wall_s", "rounds", "aborted_rounds")}


def _rounds_stored(url: str) -> int:
    """Rounds the PostgreSQL database holds: proof the run's state went there."""
    import psycopg

    with psycopg.connect(url) as db:
        row = db.execute("SELECT count(*) FROM rounds").fetchone()
    return int(row[0]) if row else 0


def run_store(
    agents: int = 50,
    rounds: int = 5,
    pairs: int = 3,
    *,
    task: str = "mnist1d",
    database_url: str | None = None,
) -> dict[str, Any]:
    """``pairs`` interleaved pairs of the simulate run on SQLite and on PostgreSQL.

    Returns:
        The ``bench store`` JSON object: each pair's round times and ratio, their
        median, min and max.

    Raises:
        ConfigError: PostgreSQL is not installed (and no ``database_url`` was given).
    """
    from fedsec.simulation import SimulationSpec

    base = SimulationSpec(task=task, agents=agents, rounds=rounds, baseline=False)
    workdir = Path(tempfile.mkdtemp(prefix="fedsec-store-"))
    runs: list[dict[str, Any]] = []
    try:
        with database_server(database_url) as server:
            for pair in range(pairs):
                order = BACKENDS if pair % 2 == 0 else BACKENDS[::-1]
                times: dict[str, dict[str, Any]] = {}
                for backend in order:
                    url = server.fresh_database() if backend == "postgresql" else ""
                    spec = replace(base, storage_url=url)
                    times[backend] = _one_run(spec, workdir / f"{pair}-{backend}")
                    if url:
                        times[backend]["rounds_stored"] = _rounds_stored(url)
                pg, lite = times["postgresql"]["round_s_mean"], times["sqlite"]["round_s_mean"]
                ratio = round(pg / lite, 3) if pg and lite else None
                runs.append({"pair": pair, "first": order[0], **times, "ratio": ratio})
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    ratios = [r["ratio"] for r in runs if r["ratio"] is not None]
    return with_environment(
        {
            "bench": "store",
            "task": task,
            "agents": agents,
            "rounds": rounds,
            "pairs": runs,
            "ratio_median": round(statistics.median(ratios), 3) if ratios else None,
            "ratio_min": min(ratios, default=None),
            "ratio_max": max(ratios, default=None),
            "target_ratio": TARGET_RATIO,
        }
    )


@click.command("store")
@click.option("--agents", default=50, show_default=True)
@click.option("--rounds", default=5, show_default=True)
@click.option("--pairs", default=3, show_default=True, help="interleaved SQLite/PostgreSQL pairs")
@click.option("--task", default="mnist1d", show_default=True)
@click.option(
    "--database-url",
    default=None,
    help="a PostgreSQL server URL whose role may create databases (default: a temporary "
    "cluster of this machine's PostgreSQL)",
)
@click.option("--json", "as_json", is_flag=True, help="print JSON (the default format)")
def bench_store(
    agents: int, rounds: int, pairs: int, task: str, database_url: str | None, as_json: bool
) -> None:
    """Round time of the simulate run on PostgreSQL against SQLite, in interleaved pairs."""
    click.echo(json.dumps(run_store(agents, rounds, pairs, task=task, database_url=database_url)))
