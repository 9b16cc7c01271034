"""``fedsec bench async``: buffered asynchronous rounds (FedBuff) against synchronous
rounds when a fifth of the members are ten times slower.

Both runs are full federations over loopback HTTP with SecAgg+ (see
:mod:`fedsec.simulation`) on the same data, seeds and total number of member
updates: the synchronous run has R rounds of all N members; the buffered run
aggregates every K contributions, for R·N/K model versions.  Reported: the wall
time at which each first reaches the target held-out accuracy, ``speedup``
(synchronous ÷ buffered), and both final accuracies.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import click

from fedsec.bench.common import with_environment
from fedsec.simulation import SimulationSpec, run_simulation


async def run_async_bench(
    task: str = "mnist1d",
    agents: int = 20,
    rounds: int = 25,
    buffer_size: int = 8,
    max_staleness: int = 4,
    slow_fraction: float = 0.2,
    slowdown: float = 10.0,
    target_accuracy: float = 0.7,
    seed: int = 0,
    local_epochs: int = 2,
    buffered_server_lr: float = 1.0,
) -> dict[str, Any]:
    base = SimulationSpec(
        task=task,
        agents=agents,
        rounds=rounds,
        secure_sum="secagg",
        slow_fraction=slow_fraction,
        slowdown=slowdown,
        target_accuracy=target_accuracy,
        seed=seed,
        baseline=False,
        local_epochs=local_epochs,
    )
    sync = await run_simulation(replace(base, mode="sync"))
    buffered = await run_simulation(
        replace(
            base,
            rounds=max(1, rounds * agents // buffer_size),
            mode="buffered",
            buffer_size=buffer_size,
            max_staleness=max_staleness,
            # consecutive buffers build on nearly the same base: a full step each overshoots
            server_lr=buffered_server_lr,
        )
    )
    t_sync, t_buf = sync["time_to_target_s"], buffered["time_to_target_s"]
    return with_environment(
        {
            "bench": "async",
            "task": task,
            "agents": agents,
            "slow_fraction": slow_fraction,
            "slowdown": slowdown,
            "buffer_size": buffer_size,
            "max_staleness": max_staleness,
            "local_epochs": local_epochs,
            "buffered_server_lr": buffered_server_lr,
            "target_accuracy": target_accuracy,
            "sync_rounds": sync["rounds"],
            "buffered_versions": buffered["rounds"],
            "sync_time_to_target_s": t_sync,
            "buffered_time_to_target_s": t_buf,
            "speedup": round(t_sync / t_buf, 2) if t_sync and t_buf else None,
            "sync_final_accuracy": sync["final_accuracy"],
            "buffered_final_accuracy": buffered["final_accuracy"],
            "accuracy_gap_pt": round(
                100 * (sync["final_accuracy"] - buffered["final_accuracy"]), 2
            ),
            "sync_wall_s": sync["wall_s"],
            "buffered_wall_s": buffered["wall_s"],
        }
    )


@click.command()
@click.option("--task", default="mnist1d", show_default=True)
@click.option("--agents", default=20, show_default=True)
@click.option("--rounds", default=25, show_default=True, help="synchronous rounds")
@click.option("--buffer-size", default=8, show_default=True, help="K")
@click.option("--max-staleness", default=4, show_default=True, help="S")
@click.option("--slow-fraction", default=0.2, show_default=True)
@click.option("--slowdown", default=10.0, show_default=True)
@click.option("--target-accuracy", default=0.7, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--local-epochs", default=2, show_default=True)
@click.option("--buffered-server-lr", default=1.0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print JSON (the default format)")
def bench_async(
    task: str,
    agents: int,
    rounds: int,
    buffer_size: int,
    max_staleness: int,
    slow_fraction: float,
    slowdown: float,
    target_accuracy: float,
    seed: int,
    local_epochs: int,
    buffered_server_lr: float,
    as_json: bool,
) -> None:
    """Buffered vs synchronous rounds with slow members: time to a target accuracy."""
    result = asyncio.run(
        run_async_bench(
            task,
            agents,
            rounds,
            buffer_size,
            max_staleness,
            slow_fraction,
            slowdown,
            target_accuracy,
            seed,
            local_epochs,
            buffered_server_lr,
        )
    )
    click.echo(json.dumps(result))
