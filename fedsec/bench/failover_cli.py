"""``fedsec bench failover``: the command over both harnesses, :mod:`fedsec.bench.failover`
(sync SecAgg+ rounds, a kill at every stage and the pause run) and
:mod:`fedsec.bench.failover_modes` (HE and buffered rounds, one kill mid-round each)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from fedsec.bench.failover import run_failover
from fedsec.bench.failover_modes import run_mode_failover
from fedsec.errors import ConfigError


@click.command("failover")
@click.option(
    "--mode",
    type=click.Choice(["secagg", "he", "buffered"]),
    default="secagg",
    show_default=True,
    help="secagg: sync SecAgg+ rounds, killed at every stage, and the pause run; he or "
    "buffered: those rounds, killed once mid-round (one JSON line per kill)",
)
@click.option("--agents", default=6, show_default=True)
@click.option("--rounds", default=5, show_default=True)
@click.option(
    "--database-url",
    default=None,
    help="a PostgreSQL server URL whose role may create databases (default: a temporary "
    "cluster of this machine's PostgreSQL)",
)
@click.option("--no-pause", is_flag=True, help="skip the SIGSTOP/SIGCONT run")
@click.option(
    "--workdir", type=click.Path(path_type=Path), default=None, help="default: a temp dir"
)
@click.option("--json", "as_json", is_flag=True, help="print JSON (the default format)")
def bench_failover(
    mode: str,
    agents: int,
    rounds: int,
    database_url: str | None,
    no_pause: bool,
    workdir: Path | None,
    as_json: bool,
) -> None:
    """Kill the leading aggregator replica at every stage (HE, buffered: once
    mid-round); a standby takes over."""
    if workdir is not None and workdir.exists() and any(workdir.iterdir()):
        raise ConfigError(f"{workdir} exists and is not empty; choose a new directory")
    if mode != "secagg":
        for row in run_mode_failover(
            mode, agents, rounds, database_url=database_url, workdir=workdir
        ):
            click.echo(json.dumps(row))
        return
    result = run_failover(
        agents, rounds, database_url=database_url, workdir=workdir, pause=not no_pause
    )
    click.echo(json.dumps(result))
