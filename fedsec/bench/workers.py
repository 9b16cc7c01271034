"""``fedsec bench workers``: a round's local training split over torchrun workers.

For each worker count N of ``--workers`` it trains the same model from the same seed on
the same records (no DP: DP-SGD is not split over workers, see
:mod:`fedsec.learning.workers`) and reports, against one process training in-process
(the floor, measured in the same run):

- ``max_abs_diff`` and ``rel_diff``: the largest difference of any weight from the
  in-process update, absolute and relative to the largest update; the issue's target is
  a relative difference of at most 1e-5;
- ``seconds_per_epoch``: the training time per epoch the workers report (rank 0), and
  ``job_seconds``: the whole job's wall time, torchrun's and the workers' start-up (each
  imports torch) included;
- with ``--kill``: one more job of the largest N whose last worker SIGKILLs itself half
  way through the round: its restarts, the step it resumed from (its checkpoint's
  age is ``killed_at_step`` minus that), its steps (the redone ones count once), its
  difference from the in-process update, and the resumed attempt's training time.

One JSON object per line with its parameters, the software versions and the floor.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
import numpy as np
import torch
from torch.utils.data import TensorDataset

from fedsec.bench.common import with_environment
from fedsec.learning.training import train_dataset
from fedsec.learning.worker_settings import TrainingWorkers
from fedsec.learning.workers import train_with_workers
from fedsec.tasks import Task, TrainingParams, get_task
from fedsec.tasks.params import flatten_params

__all__ = ["bench_workers", "run_workers"]


def run_workers(
    counts: list[int],
    task_name: str,
    records: int,
    epochs: int,
    batch_size: int,
    seed: int,
    kill: bool,
    checkpoint_steps: int,
) -> list[dict[str, Any]]:
    """The rows of ``fedsec bench workers`` (see the module docstring).

    Raises:
        ConfigError: an unknown task, or a worker count out of range.
        TrainingWorkersFailed: a job failed past its restarts.
    """
    task = get_task(task_name)
    data = task.load()
    x, y = data.x_train[:records], data.y_train[:records]
    records_used = len(y)
    dataset = TensorDataset(torch.from_numpy(x).float(), torch.from_numpy(y))
    params = replace(task.defaults, local_epochs=epochs, batch_size=batch_size)
    start = flatten_params(task.build_model(0))
    model = task.build_model(0)
    started = time.perf_counter()
    floor = train_dataset(model, dataset, params, None, "cpu", seed, task=task)
    floor_s = time.perf_counter() - started
    reference = flatten_params(model) - start
    base = {
        "bench": "workers",
        "task": task_name,
        "records": records_used,
        "epochs": epochs,
        "batch_size": batch_size,
        "steps": floor.steps,
        "floor_seconds_per_epoch": round(floor.duration_s / epochs, 4),
        "floor_wall_seconds": round(floor_s, 3),
    }
    rows = []
    for count in counts:
        rows.append(_job_row(base, task, dataset, params, seed, reference, start, count, None, 0))
    if kill:
        count = max(max(counts), 2)
        crash_at = floor.steps // 2 + 1
        rows.append(
            _job_row(
                base,
                task,
                dataset,
                params,
                seed,
                reference,
                start,
                count,
                crash_at,
                checkpoint_steps,
            )
        )
    return rows


def _job_row(
    base: dict[str, Any],
    task: Task,
    dataset: TensorDataset,
    params: TrainingParams,
    seed: int,
    reference: np.ndarray,
    start: np.ndarray,
    count: int,
    crash_at: int | None,
    checkpoint_steps: int,
) -> dict[str, Any]:
    model = task.build_model(0)
    settings = TrainingWorkers(
        workers=count, max_restarts=1 if crash_at else 0, checkpoint_steps=checkpoint_steps
    )
    with tempfile.TemporaryDirectory() as state:
        started = time.perf_counter()
        done = train_with_workers(
            model,
            dataset,
            params,
            torch.device("cpu"),
            seed,
            task,
            {},
            Path(state),
            settings,
            crash_at_step=crash_at,
        )
        job_s = time.perf_counter() - started
    update = flatten_params(model) - start
    diff = float(np.max(np.abs(update - reference)))
    scale = float(np.max(np.abs(reference)))
    row = {
        **base,
        "workers": count,
        "case": "kill" if crash_at else "plain",
        "job_steps": done.trained.steps,
        "restarts": done.restarts,
        "max_abs_diff": diff,
        "rel_diff": diff / scale if scale else diff,
        "job_seconds": round(job_s, 3),
    }
    if crash_at:
        row.update(
            killed_at_step=crash_at,
            checkpoint_steps=checkpoint_steps,
            resumed_from_step=done.resumed_from_step,
            resumed_attempt_seconds=round(done.trained.duration_s, 4),
        )
    else:
        row["seconds_per_epoch"] = round(done.trained.duration_s / base["epochs"], 4)
    return with_environment(row)


@click.command("workers")
@click.option(
    "--workers", "counts", default="1,2", show_default=True, help="Worker counts, comma-separated."
)
@click.option("--task", "task_name", default="breast_cancer", show_default=True)
@click.option("--records", default=400, show_default=True, type=click.IntRange(1))
@click.option("--epochs", default=2, show_default=True, type=click.IntRange(1))
@click.option("--batch-size", default=16, show_default=True, type=click.IntRange(1))
@click.option("--seed", default=7, show_default=True, type=click.IntRange(0))
@click.option(
    "--kill/--no-kill",
    default=True,
    show_default=True,
    help="Also SIGKILL a worker half way and resume from its checkpoint.",
)
@click.option("--checkpoint-steps", default=4, show_default=True, type=click.IntRange(1))
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line (always).")
def bench_workers(counts: str, as_json: bool, **options: Any) -> None:
    """Train with 1..N torchrun workers against one process: same update, time per epoch,
    and a killed worker's restart."""
    del as_json
    try:
        parsed = [int(c) for c in counts.split(",") if c.strip()]
    except ValueError as exc:
        raise click.BadParameter(f"not a list of integers: {counts}") from exc
    for row in run_workers(parsed, **options):
        click.echo(json.dumps(row))
