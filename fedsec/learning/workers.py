"""A round's local training split over processes: one ``torchrun`` job of DDP workers.

The agent keeps the protocol, its keys and the privacy ledger; it writes a job directory
inside the member's state directory (the round's model and the training records as
safetensors, the settings as JSON, nothing else), runs ``python -m torch.distributed.run``
on it and reads the trained weights back from the file rank 0 writes there. Nothing a
worker writes is unpickled: weights, records and checkpoints are safetensors, the rest
JSON, and the trained weights must have exactly the model's names and shapes.

Every worker runs :func:`fedsec.learning.training.train_dataset`, the one training loop,
with a :class:`StepSharing` that makes N processes take the step one process would:

- **Constant effective batch.** Each worker draws the very batches one process draws
  (the same sampler, generator and seed) and keeps its contiguous slice of each, so
  every step covers the same records whatever N is, with batch/N records per worker.
- **The whole batch's gradient.** DDP's gradient all-reduce is replaced by a weighted
  one: each worker sends its slice's mean gradient times its record count together with
  the count, and every worker divides the summed gradients by the summed counts, which
  is the batch mean one process computes (an epoch's last, short batch included, and a
  worker whose slice is empty sends zeros). The updates of 1 and N workers differ by
  float summation order only (tested).
- **Elasticity.** Rank 0 writes a checkpoint (model, optimiser state, steps done)
  atomically every ``checkpoint_steps`` steps or ``checkpoint_interval_s`` seconds;
  ``torchrun --max-restarts`` restarts every worker when one dies, and each resumes from
  the checkpoint, skipping the batches already taken, so the restarted run takes the
  same steps on the same records. The ledger is charged by the agent before the job
  starts, once, whatever happens inside it.
- **Stragglers.** Once the ranks have met (DDP's first broadcast), the process group's
  timeout becomes ``straggler_timeout_s``: a worker that keeps the others waiting at a
  step's all-reduce longer makes their collective fail, torchrun restarts every worker,
  and the job resumes from the checkpoint as after a crash (the waiting ranks log
  ``worker_straggler``). No step is taken while a worker is out, so the effective batch
  never shrinks.
- **DP-SGD.** Each rank keeps its shard's records of the Poisson batch one process
  draws, clips them, and rank 0 adds one process's CSPRNG noise to the all-reduced
  sums, so the mechanism and its ε are one process's with the same q, σ and steps
  (:mod:`fedsec.learning.worker_privacy`); the checkpoint carries the accounting.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save
from torch.utils.data import Dataset as TorchDataset
from torch.utils.data import TensorDataset

from fedsec.errors import ConfigError, FedsecError
from fedsec.fsio import atomic_write
from fedsec.learning.training import DPParams, LocalTrainResult, records
from fedsec.learning.worker_job import (
    LOG_FILE,
    MODEL_FILE,
    RECORDS_FILE,
    RESULT_FILE,
    STRAGGLER_EVENT,
    TRAINED_FILE,
    main,
    plain_state,
    write_json,
)
from fedsec.learning.worker_nodes import JOB_FILE, torchrun_command
from fedsec.learning.worker_settings import MAX_WORKERS, TrainingWorkers
from fedsec.learning.worker_status import (
    JOBS_DIR,
    WorkersStatus,
    read_status,
    update_status,
    write_status,
)
from fedsec.tasks import Task, TrainingParams

__all__ = [
    "TrainingWorkers",
    "TrainingWorkersFailed",
    "WorkersResult",
    "backend_for",
    "clear_stale_jobs",
    "train_with_workers",
    "worker_count",
]


class TrainingWorkersFailed(FedsecError):
    """The torchrun job of a round's training failed past its restarts."""

    code = "training_workers_failed"
    http_status = 500


@dataclass(frozen=True)
class WorkersResult:
    """What a job did: the training result, how often torchrun restarted it, the step
    its last attempt resumed from (0: from the round's start) and how old that
    checkpoint was then (None: no restart resumed from one), and for each restart a
    straggler caused, how long the others waited for it."""

    trained: LocalTrainResult
    workers: int
    restarts: int
    resumed_from_step: int = 0
    resumed_checkpoint_age_s: float | None = None
    straggler_waits_s: tuple[float, ...] = ()


def worker_count(workers: int, device: torch.device) -> int:
    """Processes a job runs: ``workers``, or one per visible GPU when ``workers`` is 0 on
    CUDA (0 on the CPU: in-process).

    Raises:
        ConfigError: more workers than :data:`MAX_WORKERS`, or than GPUs on CUDA.
    """
    if not 0 <= workers <= MAX_WORKERS:
        raise ConfigError(f"training.workers must be in 0..{MAX_WORKERS}, got {workers}")
    if device.type != "cuda":
        return max(1, workers)
    gpus = torch.cuda.device_count()
    if workers > gpus:
        raise ConfigError(f"training.workers = {workers} but this node has {gpus} GPU(s)")
    return workers or gpus


def backend_for(device: torch.device) -> str:
    """The collective backend: NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


def clear_stale_jobs(state_dir: Path) -> list[str]:
    """Remove the job directories a killed agent left in ``state_dir`` (they hold the
    records and the round's secret seed), and mark its job failed in the workers status
    if it still says running; returns their names. Call it before this agent's first
    job: it removes every job, running or not.

    Raises:
        ConfigError: a workers status that is not one
            (:func:`~fedsec.learning.worker_status.read_status`).
    """
    jobs = Path(state_dir) / JOBS_DIR
    stale = sorted(p for p in jobs.glob("job-*") if p.is_dir()) if jobs.is_dir() else []
    for job in stale:
        shutil.rmtree(job, ignore_errors=True)
    last = read_status(state_dir)
    if last is not None and last.state == "running":
        update_status(state_dir, state="failed", ended_at=time.time())
    return [job.name for job in stale]


def train_with_workers(
    model: torch.nn.Module,
    data: TorchDataset[Any],
    params: TrainingParams,
    device: torch.device,
    seed: int,
    task: Task,
    task_options: dict[str, Any],
    state_dir: Path,
    settings: TrainingWorkers,
    *,
    dp: DPParams | None = None,
    round_: int | None = None,
    crash_at_step: int | None = None,
    stall_at_step: int | None = None,
) -> WorkersResult:
    """Train ``model`` in place as :func:`train_dataset` would, in a torchrun job of
    :func:`worker_count` processes; blocks until the job ends.

    Args:
        task_options: what ``task`` was built with (each worker builds it again).
        dp: DP-SGD settings, or None; the result's ``epsilon_round`` is the job's
            accountant's, over all its steps once, restarts included.
        state_dir: the member's state directory; the job lives in ``training/`` in it and
            is removed afterwards, and its progress stays in ``training/workers.json``
            (:mod:`fedsec.learning.worker_status`).
        round_: the round trained, for that record.
        crash_at_step: tests only: the last rank SIGKILLs itself after this many steps
            on the job's first attempt.
        stall_at_step: tests only: the last rank stalls after this many steps on the
            job's first attempt (for :data:`STALL_TIMEOUTS` straggler timeouts).

    Raises:
        ConfigError: see :func:`worker_count` and
            :func:`~fedsec.learning.worker_nodes.torchrun_command`; an empty dataset; a
            ``node_rank`` other than 0 (rank 0 must be this node's).
        TrainingWorkersFailed: the job failed past its restarts, or left no result.
    """
    count = worker_count(settings.workers, device)
    if settings.node_rank != 0:
        raise ConfigError("training.node_rank must be 0 on the agent's node, which holds rank 0")
    world = count * settings.nodes
    job = _write_job(model, data, state_dir)
    write_status(state_dir, WorkersStatus(round_, world, "running", time.time()))
    try:
        spec = _job_settings(params, device, seed, task, task_options, settings)
        faults = {"crash_at_step": crash_at_step, "stall_at_step": stall_at_step}
        dp_spec = None if dp is None else asdict(dp)
        # written last: a following node takes the job's presence from this file
        write_json(job / JOB_FILE, {**spec, "dp": dp_spec, **faults, "nproc_per_node": count})
        try:
            _run_torchrun(job, torchrun_command(job, count, settings), world)
            done = _read_result(job, model, world)
        except TrainingWorkersFailed:
            _record_end(state_dir, "failed", 0, _straggler_waits(job / LOG_FILE))
            raise
        _record_end(state_dir, "done", done.restarts, done.straggler_waits_s)
        return done
    finally:
        shutil.rmtree(job, ignore_errors=True)


def _record_end(state_dir: Path, state: str, restarts: int, waits: tuple[float, ...]) -> None:
    """The job's end in the member's workers status (restarts: kept as recorded when 0)."""
    ended: dict[str, Any] = {"state": state, "stragglers": len(waits), "ended_at": time.time()}
    if restarts:
        ended["restarts"] = restarts
    update_status(state_dir, **ended)


def _job_settings(
    params: TrainingParams,
    device: torch.device,
    seed: int,
    task: Task,
    task_options: dict[str, Any],
    settings: TrainingWorkers,
) -> dict[str, Any]:
    return {
        "params": asdict(params),
        "backend": backend_for(device),
        "seed": seed,
        "task": task.name,
        "task_options": task_options,
        "checkpoint_steps": settings.checkpoint_steps,
        "checkpoint_interval_s": settings.checkpoint_interval_s,
        "straggler_timeout_s": settings.straggler_timeout_s,
    }


def _write_job(model: torch.nn.Module, data: TorchDataset[Any], state_dir: Path) -> Path:
    """A fresh job directory (0700) holding the model and the records."""
    n = len(data)  # type: ignore[arg-type]  # map-style datasets have a length
    if n < 1:
        raise ConfigError("cannot train on an empty dataset")
    jobs = Path(state_dir) / JOBS_DIR
    jobs.mkdir(mode=0o700, parents=True, exist_ok=True)
    job = jobs / f"job-{secrets.token_hex(8)}"
    job.mkdir(mode=0o700)
    atomic_write(job / MODEL_FILE, save(plain_state(model.state_dict())), mode=0o600)
    x, y = _all_records(data)
    atomic_write(job / RECORDS_FILE, save({"x": x, "y": y}), mode=0o600)
    return job


def _all_records(data: TorchDataset[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The records as two tensors (in memory already for a TensorDataset)."""
    if isinstance(data, TensorDataset) and len(data.tensors) == 2:
        x, y = data.tensors
        return x.contiguous(), y.contiguous()
    xs, ys = records(data, np.arange(len(data)))  # type: ignore[arg-type]
    return torch.from_numpy(xs), torch.from_numpy(ys)


def _run_torchrun(job: Path, command: list[str], world: int) -> None:
    """Run the job's torchrun on this node to its end.

    Raises:
        TrainingWorkersFailed: torchrun exited non-zero (its log names the worker).
    """
    with (job / LOG_FILE).open("wb") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise TrainingWorkersFailed(
            f"training job of {world} worker(s) failed with exit status {done.returncode} "
            f"past its restarts: {_worker_error(job / LOG_FILE)}"
        )


def _straggler_waits(log: Path) -> tuple[float, ...]:
    """For each attempt of the job that a straggler ended (one in which a rank printed
    :data:`STRAGGLER_EVENT`; every rank left waiting prints one), the longest a rank
    waited for it, in seconds."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ()
    waits: dict[str, float] = {}
    for line in lines:
        if line.startswith(STRAGGLER_EVENT + " "):
            fields = dict(part.split("=", 1) for part in line.split()[1:] if "=" in part)
            attempt, waited = fields.get("attempt", "?"), float(fields.get("waited_s", "nan"))
            waits[attempt] = max(waits.get(attempt, waited), waited)
    return tuple(waits[attempt] for attempt in sorted(waits))


def _worker_error(log: Path) -> str:
    """The last error a worker printed (``[rankN]: SomeError: ...``), else the log's end."""
    lines = log.read_text(errors="replace").splitlines()
    errors = [line for line in lines if line.startswith("[rank") and "Error" in line]
    return errors[-1] if errors else "\n".join(lines[-5:])


def _read_result(job: Path, model: torch.nn.Module, count: int) -> WorkersResult:
    """Load rank 0's trained weights into ``model``; names and shapes must be the model's.

    Raises:
        TrainingWorkersFailed: no result, or weights that are not this model's.
    """
    try:
        summary = json.loads((job / RESULT_FILE).read_text())
        trained = load_file(str(job / TRAINED_FILE))
    except (OSError, ValueError) as exc:
        raise TrainingWorkersFailed(f"training job left no readable result: {exc}") from exc
    state = model.state_dict()
    if set(trained) != set(state) or any(trained[k].shape != state[k].shape for k in state):
        raise TrainingWorkersFailed("training job's weights are not this model's")
    with torch.no_grad():
        model.load_state_dict(trained)
    result = LocalTrainResult(
        steps=int(summary["steps"]),
        samples=int(summary["samples"]),
        sample_rate=float(summary["sample_rate"]),
        epsilon_round=None if summary["epsilon_round"] is None else float(summary["epsilon_round"]),
        train_loss=float(summary["train_loss"]),
        duration_s=float(summary["duration_s"]),
    )
    age = summary["resumed_checkpoint_age_s"]
    return WorkersResult(
        result,
        count,
        int(summary["restarts"]),
        int(summary["resumed_from_step"]),
        None if age is None else float(age),
        _straggler_waits(job / LOG_FILE),
    )


if __name__ == "__main__":
    main()
