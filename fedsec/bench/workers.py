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
- with ``--stall``: one more job of the largest N whose last worker stalls half way
  (for 10 straggler timeouts): how long rank 0 waited for it before the job restarted
  (``straggler_wait_s``, against ``--straggler-timeout``), the step it resumed from,
  its steps and difference from the in-process update;
- with ``--nodes M`` (M > 1, case ``nodes``): one job over M nodes of one worker each on
  loopback (nodes 1.. follow the agent's jobs in threads of this process, as
  ``fedsec agent train-node`` does on its own machine), its difference and wall time;
- with ``--dp-seeds K`` (case ``dp``): DP-SGD (``--noise-multiplier``, ``--clip``) for K
  seeds, each N against one process in-process: the ε each run's accountant reports,
  the test accuracy of each, their difference in points, and the update's relative
  difference; then a ``dp_summary`` row per N with the largest ε and accuracy gaps
  (the issue's targets: the same ε, accuracy within 1 point).

One JSON object per line with its parameters, the software versions and the floor.
"""

from __future__ import annotations

import json
import socket
import tempfile
import threading
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
from fedsec.learning.worker_nodes import follow_jobs
from fedsec.learning.worker_settings import TrainingWorkers
from fedsec.learning.workers import WorkersResult, train_with_workers
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
    stall: bool = False,
    straggler_timeout: float = 5.0,
    nodes: int = 1,
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
    faulty = TrainingWorkers(
        workers=max(max(counts), 2),
        max_restarts=1,
        checkpoint_steps=checkpoint_steps,
        checkpoint_interval_s=0,
        straggler_timeout_s=straggler_timeout,
    )
    job = _Job(task, dataset, params, seed, reference, start)
    if stall:
        rows.append(_stall_row(base, job, faulty, floor.steps // 2 + 1))
    if nodes > 1:
        rows.append(_nodes_row(base, job, nodes))
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


class _Job:
    """What every job of the bench trains, and the in-process update it is held to."""

    def __init__(
        self,
        task: Task,
        dataset: TensorDataset,
        params: TrainingParams,
        seed: int,
        reference: np.ndarray,
        start: np.ndarray,
    ) -> None:
        self.task, self.dataset, self.params, self.seed = task, dataset, params, seed
        self.reference, self.start = reference, start

    def run(
        self, settings: TrainingWorkers, state: Path, **faults: int
    ) -> tuple[WorkersResult, float, float]:
        """Train a job: its result, its wall seconds and its update's relative difference."""
        model = self.task.build_model(0)
        started = time.perf_counter()
        done = train_with_workers(
            model,
            self.dataset,
            self.params,
            torch.device("cpu"),
            self.seed,
            self.task,
            {},
            state,
            settings,
            **faults,  # type: ignore[arg-type]  # crash_at_step / stall_at_step
        )
        wall = time.perf_counter() - started
        diff = float(np.max(np.abs(flatten_params(model) - self.start - self.reference)))
        scale = float(np.max(np.abs(self.reference)))
        return done, wall, diff / scale if scale else diff


def _stall_row(
    base: dict[str, Any], job: _Job, settings: TrainingWorkers, stall_at: int
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as state:
        done, wall, rel_diff = job.run(settings, Path(state), stall_at_step=stall_at)
    return with_environment(
        {
            **base,
            "workers": settings.workers,
            "case": "stall",
            "stalled_at_step": stall_at,
            "straggler_timeout_s": settings.straggler_timeout_s,
            "straggler_wait_s": max(done.straggler_waits_s, default=None),
            "checkpoint_steps": settings.checkpoint_steps,
            "restarts": done.restarts,
            "resumed_from_step": done.resumed_from_step,
            "job_steps": done.trained.steps,
            "rel_diff": rel_diff,
            "job_seconds": round(wall, 3),
        }
    )


def _nodes_row(base: dict[str, Any], job: _Job, nodes: int) -> dict[str, Any]:
    with socket.socket() as probe:  # a free loopback port for node 0's rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = TrainingWorkers(
        workers=1, max_restarts=0, nodes=nodes, rendezvous_endpoint=f"127.0.0.1:{port}"
    )
    ended = threading.Event()
    with tempfile.TemporaryDirectory() as state:
        followers = [
            threading.Thread(
                target=follow_jobs,
                args=(Path(state), replace(settings, node_rank=rank), ended.is_set),
                kwargs={"poll_s": 0.1},
            )
            for rank in range(1, nodes)
        ]
        for follower in followers:
            follower.start()
        try:
            done, wall, rel_diff = job.run(settings, Path(state))
        finally:
            ended.set()
            for follower in followers:
                follower.join()
    return with_environment(
        {
            **base,
            "workers": done.workers,
            "nodes": nodes,
            "case": "nodes",
            "job_steps": done.trained.steps,
            "rel_diff": rel_diff,
            "seconds_per_epoch": round(done.trained.duration_s / base["epochs"], 4),
            "job_seconds": round(wall, 3),
        }
    )


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
    "--stall/--no-stall",
    default=True,
    show_default=True,
    help="Also stall a worker half way: the straggler timeout restarts the job.",
)
@click.option("--straggler-timeout", default=5.0, show_default=True, type=_POSITIVE)
@click.option(
    "--nodes",
    default=1,
    show_default=True,
    type=click.IntRange(1, 8),
    help="Also one job over this many loopback nodes of one worker each (1: none).",
)
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
    a killed and a stalled worker's restart, several nodes, and DP-SGD's ε and accuracy
    over several seeds."""
    del as_json
    try:
        parsed = [int(c) for c in counts.split(",") if c.strip()]
    except ValueError as exc:
        raise click.BadParameter(f"not a list of integers: {counts}") from exc
    for row in run_workers(parsed, **options):
        click.echo(json.dumps(row))
