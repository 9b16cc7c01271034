"""``fedsec bench workers``: a round's local training split over torchrun workers.

For each worker count N of ``--workers`` it trains the same model from the same seed on
the same records without DP and reports, against one process training in-process (the
floor, measured in the same run):

- ``max_abs_diff`` and ``rel_diff``: the largest difference of any weight from the
  in-process update, absolute and relative to the largest update; the issue's target is
  a relative difference of at most 1e-5;
- ``seconds_per_epoch``: the training time per epoch the workers report (rank 0), and
  ``job_seconds``: the whole job's wall time, torchrun's and the workers' start-up (each
  imports torch) included;
- with ``--kill``: one more job of the largest N whose last worker SIGKILLs itself half
  way through the round: its restarts, the step it resumed from (its checkpoint's
  age is ``killed_at_step`` minus that), its steps (the redone ones count once), its
  difference from the in-process update, and the resumed attempt's training time;
- with ``--dp-seeds K`` (case ``dp``): DP-SGD (``--noise-multiplier``, ``--clip``) for K
  seeds, each N against one process in-process: the ε each run's accountant reports,
  the test accuracy of each, their difference in points, and the update's relative
  difference; then a ``dp_summary`` row per N with the largest ε and accuracy gaps
  (the issue's targets: the same ε, accuracy within 1 point).

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
from fedsec.learning.training import DPParams, train_dataset
from fedsec.learning.worker_settings import TrainingWorkers
from fedsec.learning.workers import train_with_workers
from fedsec.tasks import Task, TrainingParams, get_task
from fedsec.tasks.base import Dataset
from fedsec.tasks.evaluation import evaluate
from fedsec.tasks.params import flatten_params

__all__ = ["bench_workers", "run_workers"]

#: δ of the DP comparison: below 1/records for the bench's record counts.
DP_DELTA = 1e-5


def run_workers(
    counts: list[int],
    task_name: str,
    records: int,
    epochs: int,
    batch_size: int,
    seed: int,
    kill: bool,
    checkpoint_steps: int,
    dp_seeds: int = 0,
    noise_multiplier: float = 1.0,
    clip: float = 1.0,
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
    if dp_seeds > 0:
        dp = DPParams(noise_multiplier, clip, DP_DELTA)
        rows.extend(_dp_rows(base, task, data, dataset, params, counts, seed, dp_seeds, dp))
    return rows


def _dp_rows(
    base: dict[str, Any],
    task: Task,
    data: Dataset,
    dataset: TensorDataset,
    params: TrainingParams,
    counts: list[int],
    seed: int,
    seeds: int,
    dp: DPParams,
) -> list[dict[str, Any]]:
    """DP-SGD over N workers against one process, for ``seeds`` seeds (module docstring)."""
    rows: list[dict[str, Any]] = []
    settings = {"noise_multiplier": dp.noise_multiplier, "clip": dp.max_grad_norm}
    for offset in range(seeds):
        run_seed = seed + offset
        model = task.build_model(run_seed)
        start = flatten_params(model)
        alone = train_dataset(model, dataset, params, dp, "cpu", run_seed, task=task)
        reference = flatten_params(model) - start
        floor_accuracy, _ = evaluate(model, data.x_test, data.y_test, task=task)
        for count in counts:
            model = task.build_model(run_seed)
            with tempfile.TemporaryDirectory() as state:
                done = train_with_workers(
                    model,
                    dataset,
                    params,
                    torch.device("cpu"),
                    run_seed,
                    task,
                    {},
                    Path(state),
                    TrainingWorkers(workers=count, max_restarts=0),
                    dp=dp,
                )
            accuracy, _ = evaluate(model, data.x_test, data.y_test, task=task)
            diff = float(np.max(np.abs(flatten_params(model) - start - reference)))
            rows.append(
                {
                    **base,
                    **settings,
                    "case": "dp",
                    "workers": count,
                    "seed": run_seed,
                    "epsilon": done.trained.epsilon_round,
                    "floor_epsilon": alone.epsilon_round,
                    "accuracy": accuracy,
                    "floor_accuracy": floor_accuracy,
                    "accuracy_diff_pts": round(100 * (accuracy - floor_accuracy), 3),
                    "rel_diff": diff / float(np.max(np.abs(reference))),
                }
            )
    return [with_environment(row) for row in rows + _dp_summaries(rows, counts, seeds)]


def _dp_summaries(
    rows: list[dict[str, Any]], counts: list[int], seeds: int
) -> list[dict[str, Any]]:
    """One row per worker count: the largest ε and accuracy gaps over the seeds."""
    summaries = []
    for count in counts:
        mine = [row for row in rows if row["workers"] == count]
        first = {k: v for k, v in mine[0].items() if k not in _PER_SEED}
        summaries.append(
            {
                **first,
                "case": "dp_summary",
                "seeds": seeds,
                "max_epsilon_gap": max(abs(r["epsilon"] - r["floor_epsilon"]) for r in mine),
                "max_accuracy_gap_pts": max(abs(r["accuracy_diff_pts"]) for r in mine),
                "max_rel_diff": max(r["rel_diff"] for r in mine),
                "mean_accuracy": float(np.mean([r["accuracy"] for r in mine])),
                "mean_floor_accuracy": float(np.mean([r["floor_accuracy"] for r in mine])),
            }
        )
    return summaries


_PER_SEED = frozenset(
    {
        "seed",
        "epsilon",
        "floor_epsilon",
        "accuracy",
        "floor_accuracy",
        "accuracy_diff_pts",
        "rel_diff",
    }
)


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


_POSITIVE = click.FloatRange(min=0.0, min_open=True)


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
@click.option(
    "--dp-seeds",
    default=3,
    show_default=True,
    type=click.IntRange(0),
    help="Seeds of the DP-SGD comparison against one process (0: none).",
)
@click.option("--noise-multiplier", default=1.0, show_default=True, type=_POSITIVE)
@click.option("--clip", default=1.0, show_default=True, type=_POSITIVE, help="Clip norm C.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line (always).")
def bench_workers(counts: str, as_json: bool, **options: Any) -> None:
    """Train with 1..N torchrun workers against one process: same update, time per epoch,
    a killed worker's restart, and DP-SGD's ε and accuracy over several seeds."""
    del as_json
    try:
        parsed = [int(c) for c in counts.split(",") if c.strip()]
    except ValueError as exc:
        raise click.BadParameter(f"not a list of integers: {counts}") from exc
    for row in run_workers(parsed, **options):
        click.echo(json.dumps(row))
