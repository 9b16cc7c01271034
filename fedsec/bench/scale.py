"""``fedsec bench scale``: one aggregator process under 100 to 1,000 members.

Each member count is a full ``fedsec simulate`` run (every member a real
:class:`~fedsec.agent.runtime.AgentRuntime` over loopback HTTP, the aggregator its own
``fedsec aggregator serve`` process, SecAgg+ at the task's model size), without the
centralized baseline.  A row reports what grows with the roster on the aggregator: its
CPU over the rounds (read from ``/proc`` between the members' start and the last round's
close, so start-up is not counted) per member-round, its peak RSS, the wall time per
round, the requests and bytes each member sent per round, and the connections it closed
on accept (the capacity refusals this benchmark exists to keep at 0).

The floor is the members' own side: on one machine they share its cores with the
aggregator, so wall time per round is the members' training and SecAgg+ work as much as
the aggregator's.  ``aggregator_cpu_ms_per_member_round`` is the number that compares
across machines, and ``cpu_over_signature_floor`` the one that compares across loads:
the aggregator's CPU per member-round over the Ed25519 checks alone that a member-round's
signed requests need (``requests_per_member_round`` x one check, timed in the same run),
the part of its work no implementation of the protocol can skip.

``--shards 1,2,4`` reports the sharded summation instead (:mod:`fedsec.bench.scale_shards`):
for each member count, the aggregator's side of one round in one SecAgg+ session and in
that many groups, in this process, whose sums must be equal bit for bit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

import click

from fedsec.bench.common import with_environment

DEFAULT_MEMBERS = "100,300,1000"
#: Ed25519 checks timed for the floor: ~0.2 s, steady to a few per cent.
FLOOR_CHECKS = 2000
#: A fedsec signature base is ~330 bytes (the four components and the parameters).
_BASE_BYTES = 330


def ed25519_check_us() -> float:
    """CPU microseconds of one Ed25519 check over a signature base, as the aggregator's
    verifier makes it (libsodium, through :class:`~fedsec.crypto.identity.PublicIdentity`),
    timed here."""
    from fedsec.crypto.identity import SigningIdentity

    key = SigningIdentity.generate()
    base = b'"' + bytes(_BASE_BYTES - 1)
    signature = key.sign_http_signature_base(base)
    public = key.public
    start = time.process_time()
    for _ in range(FLOOR_CHECKS):
        public.verify_http_signature_base(base, signature)
    return 1e6 * (time.process_time() - start) / FLOOR_CHECKS


def scale_row(
    members: int, rounds: int, task: str, seed: int, member_processes: int = 0
) -> dict[str, Any]:
    """Run one federation of ``members`` for ``rounds`` rounds; return its row.

    ``member_processes``: the processes the simulated members run in (0 = the
    simulation's default, :func:`fedsec.simulated_members.default_member_processes`).

    Raises:
        ConfigError: the process may not open the descriptors the roster needs, or the
            simulation's aggregator did not start.
        AggregatorUnreachable: members gave up on the aggregator.
    """
    from fedsec.simulation import SimulationSpec, run_simulation

    spec = SimulationSpec(
        task=task,
        agents=members,
        rounds=rounds,
        seed=seed,
        baseline=False,
        member_processes=member_processes,
    )
    result = asyncio.run(run_simulation(spec))
    closed = int(result["rounds"])
    member_rounds = members * closed
    cpu_s = result.get("aggregator_cpu_s")
    by_request = result.get("bytes_up_by_request", {})
    requests = sum(row.get("requests", 0.0) for row in by_request.values())
    cpu_ms = round(1000 * cpu_s / member_rounds, 3) if cpu_s and member_rounds else None
    check_us = ed25519_check_us()
    floor_ms = requests * check_us / 1000
    over_floor = round(cpu_ms / floor_ms, 2) if cpu_ms and floor_ms else None
    return with_environment(
        {
            "bench": "scale",
            "task": task,
            "dim": result["dim"],
            "members": members,
            "rounds": rounds,
            "rounds_closed": closed,
            "aborted_rounds": result["aborted_rounds"],
            "connections_refused": result.get("connections_refused"),
            "aggregator_cpu_s": cpu_s,
            "aggregator_cpu_ms_per_member_round": cpu_ms,
            "ed25519_check_us": round(check_us, 1),
            "signature_floor_ms_per_member_round": round(floor_ms, 3),
            "cpu_over_signature_floor": over_floor,
            "aggregator_peak_rss_mb": result.get("aggregator_peak_rss_mb"),
            "wall_s": result["wall_s"],
            "wall_s_per_round": result["round_s_mean"],
            "requests_per_member_round": round(requests, 2),
            "bytes_up_per_member_round": result["bytes_up_per_agent_round"],
            "final_accuracy": result["final_accuracy"],
            "seed": seed,
            "member_processes": result["member_processes"],
            # members and the aggregator share this machine's cores
            "cores": len(os.sched_getaffinity(0)),
        }
    )


def _counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter("--members takes comma-separated integers") from None
    if not counts or min(counts) < 2:
        raise click.BadParameter("--members needs member counts of at least 2")
    return counts


def _shard_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter("--shards takes comma-separated integers") from None
    if not counts or min(counts) < 1:
        raise click.BadParameter("--shards needs shard counts of at least 1")
    return counts


@click.command()
@click.option("--members", default=DEFAULT_MEMBERS, show_default=True, help="member counts")
@click.option("--rounds", type=int, default=3, show_default=True)
@click.option("--task", default="mnist1d", show_default=True, help="mnist1d: d = 5,210")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--shards",
    default="",
    help="e.g. 1,2,4: instead of federations, the aggregator's summation of one round of "
    "each member count in one session and in that many shard groups, in this process "
    "(fedsec/bench/scale_shards.py); rows of one count must have the same sum",
)
@click.option("--dim", type=int, default=5210, show_default=True, help="with --shards")
@click.option(
    "--dropout", type=float, default=0.0, show_default=True, help="with --shards: share lost"
)
@click.option(
    "--shard-workers",
    is_flag=True,
    help="with --shards: also each shard count above 1 with its groups in worker processes",
)
@click.option(
    "--intake",
    default="",
    help="with one --shards count > 1, e.g. 0,1,2,4: instead, each member count's upload "
    "stages taken by that many group server processes (0: the leader), accepted messages "
    "per second at the store (fedsec/bench/scale_intake.py)",
)
@click.option(
    "--member-processes",
    type=int,
    default=0,
    show_default=True,
    help="processes the simulated members run in; 0 = one per 100, at most cores - 1",
)
@click.option(
    "--trace-memory",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="trace the aggregator's memory into DIR/<members>/ (tracemalloc snapshots, RSS "
    "log: fedsec/bench/scale_memory.py); its CPU figures are then not comparable",
)
@click.option("--json", "as_json", is_flag=True, help="one JSON object per member count")
def bench_scale(
    members: str,
    rounds: int,
    task: str,
    seed: int,
    shards: str,
    dim: int,
    dropout: float,
    shard_workers: bool,
    intake: str,
    member_processes: int,
    trace_memory: Path | None,
    as_json: bool,
) -> None:
    """One aggregator under growing rosters: CPU per member-round, peak RSS, wall time."""
    if intake:
        groups = _shard_counts(shards) if shards else []
        if len(groups) != 1 or groups[0] < 2:
            raise click.BadParameter("--intake needs one --shards count of at least 2")
        _bench_intake(_counts(members), groups[0], _server_counts(intake), as_json)
        return
    if shards:
        counts, groups = _counts(members), _shard_counts(shards)
        _bench_shards(counts, groups, dim, dropout, seed, shard_workers, as_json)
        return
    from fedsec.bench.scale_memory import traced_aggregator

    for count in _counts(members):
        traced = trace_memory / str(count) if trace_memory else None
        with traced_aggregator(traced) if traced else contextlib.nullcontext():
            row = scale_row(count, rounds, task, seed, member_processes)
        if traced:
            row["memory_traced"] = str(traced)
        if as_json:
            click.echo(json.dumps(row, sort_keys=True))
        else:
            click.echo(
                f"{count:>5} members: {row['rounds_closed']}/{rounds} rounds closed, "
                f"{row['aggregator_cpu_ms_per_member_round']} ms CPU per member-round, "
                f"peak RSS {row['aggregator_peak_rss_mb']} MB, "
                f"{row['wall_s_per_round']} s per round, "
                f"{row['connections_refused']} connections refused"
            )


def _server_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter("--intake takes comma-separated integers") from None
    if not counts or min(counts) < 0:
        raise click.BadParameter("--intake needs group server counts of at least 0")
    return counts


def _bench_intake(members: list[int], shards: int, servers: list[int], as_json: bool) -> None:
    from fedsec.bench.scale_intake import intake_rows

    def emit(row: dict[str, Any]) -> None:
        if as_json:
            click.echo(json.dumps(row, sort_keys=True))
        else:
            click.echo(
                f"{row['members']:>5} members in {row['shards']} groups, "
                f"{row['group_servers']} group server(s): {row['accepted_per_s']} accepted "
                f"messages/s ({row['accepted_per_s_by_stage']}); projected with a core per "
                f"process: {row['projected_accepted_per_s_with_cores']} "
                f"(limit: {row['projected_limit']})"
            )

    for count in members:
        intake_rows(count, shards, servers, emit)


def _bench_shards(
    members: list[int],
    shards: list[int],
    dim: int,
    dropout: float,
    seed: int,
    workers: bool,
    as_json: bool,
) -> None:
    from fedsec.bench.scale_shards import shards_rows

    for count in members:
        for row in shards_rows(count, shards, dim, dropout, seed, workers):
            if as_json:
                click.echo(json.dumps(row, sort_keys=True))
            else:
                click.echo(
                    f"{count:>5} members, {row['shards']} shard(s) of "
                    f"{row['group_members_min']}-{row['group_members_max']}: "
                    f"{'workers' if row['shard_workers'] else 'in-process'}, "
                    f"{row['aggregator_cpu_ms_per_member']} ms CPU per member, unmask "
                    f"{row['unmask_wall_s']} s, same sum as one session: "
                    f"{row['same_sum_as_one_session']}"
                )
