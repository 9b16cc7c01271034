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
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch
import torch.distributed as dist
from opacus import PrivacyEngine
from opacus.optimizers import DPOptimizer
from safetensors.torch import load_file, save
from torch._C._distributed_c10d import GradBucket, PrefixStore, TCPStore
from torch.distributed.distributed_c10d import _set_pg_timeout
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    RandomSampler,
    Sampler,
    TensorDataset,
    default_collate,
)
from torch.utils.data import Dataset as TorchDataset

from fedsec.errors import ConfigError, FedsecError
from fedsec.fsio import atomic_write
from fedsec.learning.training import (
    DPParams,
    LocalTrainResult,
    loader_context,
    records,
    train_dataset,
)
from fedsec.learning.worker_nodes import JOB_FILE, torchrun_command
from fedsec.learning.worker_privacy import (
    ShardOfBatch,
    accounting_state,
    poisson_batches,
    private_over_ranks,
    restore_accounting,
    shard_loader,
)
from fedsec.learning.worker_settings import MAX_WORKERS, TrainingWorkers
from fedsec.learning.worker_status import (
    JOBS_DIR,
    WorkersStatus,
    read_status,
    update_status,
    write_status,
)
from fedsec.tasks import Task, TrainingParams, get_task

__all__ = [
    "TrainingWorkers",
    "TrainingWorkersFailed",
    "WorkersResult",
    "backend_for",
    "clear_stale_jobs",
    "train_with_workers",
    "worker_count",
]

#: Tests only: a stalled worker sleeps this many straggler timeouts, then goes on, so a
#: straggler that is not detected shows as a job without restarts instead of a hang.
STALL_TIMEOUTS: Final = 10
#: The event the ranks left waiting by a straggler print before they fail.
STRAGGLER_EVENT: Final = "worker_straggler"

_JOB: Final = JOB_FILE
_MODEL: Final = "model.safetensors"
_RECORDS: Final = "records.safetensors"
_TRAINED: Final = "trained.safetensors"
_RESULT: Final = "result.json"
_CHECKPOINT: Final = "checkpoint.safetensors"
_LOG: Final = "torchrun.log"


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
        _write_json(job / _JOB, {**spec, "dp": dp_spec, **faults, "nproc_per_node": count})
        try:
            _run_torchrun(job, torchrun_command(job, count, settings), world)
            done = _read_result(job, model, world)
        except TrainingWorkersFailed:
            ended = {"stragglers": len(_straggler_waits(job / _LOG)), "ended_at": time.time()}
            update_status(state_dir, state="failed", **ended)
            raise
        update_status(
            state_dir,
            state="done",
            restarts=done.restarts,
            stragglers=len(done.straggler_waits_s),
            ended_at=time.time(),
        )
        return done
    finally:
        shutil.rmtree(job, ignore_errors=True)


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
    atomic_write(job / _MODEL, save(_plain(model.state_dict())), mode=0o600)
    x, y = _all_records(data)
    atomic_write(job / _RECORDS, save({"x": x, "y": y}), mode=0o600)
    return job


def _all_records(data: TorchDataset[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The records as two tensors (in memory already for a TensorDataset)."""
    if isinstance(data, TensorDataset) and len(data.tensors) == 2:
        x, y = data.tensors
        return x.contiguous(), y.contiguous()
    xs, ys = records(data, np.arange(len(data)))  # type: ignore[arg-type]
    return torch.from_numpy(xs), torch.from_numpy(ys)


def _plain(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors safetensors can write: detached, on the CPU, contiguous, unshared."""
    return {k: v.detach().cpu().contiguous().clone() for k, v in state.items()}


def _write_json(path: Path, value: dict[str, Any]) -> None:
    atomic_write(path, json.dumps(value).encode(), mode=0o600)


def _run_torchrun(job: Path, command: list[str], world: int) -> None:
    """Run the job's torchrun on this node to its end.

    Raises:
        TrainingWorkersFailed: torchrun exited non-zero (its log names the worker).
    """
    with (job / _LOG).open("wb") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise TrainingWorkersFailed(
            f"training job of {world} worker(s) failed with exit status {done.returncode} "
            f"past its restarts: {_worker_error(job / _LOG)}"
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
        summary = json.loads((job / _RESULT).read_text())
        trained = load_file(str(job / _TRAINED))
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
        _straggler_waits(job / _LOG),
    )


# -- inside each worker -------------------------------------------------------------------


class _CollateOrEmpty:
    """``default_collate``, or zero-length tensors of the data's shapes for a rank whose
    slice of a batch is empty. A class, not a closure: loader workers receive it pickled
    (:func:`~fedsec.learning.training.loader_context`)."""

    def __init__(self, empty: tuple[torch.Tensor, ...]) -> None:
        self.empty = empty

    def __call__(self, items: list[Any]) -> Any:
        return default_collate(items) if items else self.empty


class _SliceOfBatch:
    """A rank's contiguous slice of a batch (batch/N records)."""

    def __init__(self, rank: int, world: int) -> None:
        self._rank = rank
        self._world = world

    def __call__(self, batch: list[int]) -> list[int]:
        return [int(i) for i in np.array_split(np.asarray(batch), self._world)[self._rank]]


class _RankSampler(Sampler[list[int]]):
    """This rank's part (``pick``) of each batch one process draws, skipping the first
    ``skip`` batches of the whole run (a resumed job's steps already taken: they are
    still drawn, so the generator is where one process's would be)."""

    def __init__(
        self,
        batches: Sampler[list[int]],
        pick: Callable[[list[int]], list[int]],
        skip: int,
    ) -> None:
        self._batches = batches
        self._pick = pick
        self._skip = skip

    def __len__(self) -> int:
        return len(self._batches)  # type: ignore[arg-type]  # batch samplers are sized

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self._batches:
            if self._skip > 0:
                self._skip -= 1
                continue
            yield self._pick(batch)


class _Sharing:
    """A rank's :class:`~fedsec.learning.training.StepSharing`, and its checkpoints."""

    def __init__(
        self, job: Path, rank: int, world: int, device: torch.device, settings: dict[str, Any]
    ) -> None:
        self._job = job
        self.rank = rank
        self._world = world
        self._device = device
        self._every = int(settings["checkpoint_steps"])
        self._interval = float(settings["checkpoint_interval_s"])
        self.straggler_timeout_s = float(settings["straggler_timeout_s"])
        self._crash_at = settings.get("crash_at_step")
        self._stall_at = settings.get("stall_at_step")
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.count = 0  # records in this rank's slice of the current step
        self.done = 0  # steps taken, those of a resumed checkpoint included
        self.resumed = 0
        self.resumed_checkpoint_age_s: float | None = None
        # monotonic times: the last checkpoint (or this attempt's start), and the last
        # step taken since the straggler timeout was armed (None: not armed yet)
        self._checkpointed_at = _now()
        self.stepped_at: float | None = None
        self._work: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._saved_optimizer: dict[str, torch.Tensor] = {}
        self._saved_accounting: dict[str, torch.Tensor] = {}
        self._accounting: tuple[PrivacyEngine, DPOptimizer] | None = None

    def loader(
        self, data: TorchDataset[Any], batch_size: int, sampling_seed: int, workers: int
    ) -> DataLoader[Any]:
        # the generator object is the loader's and the sampler's both, as in one process
        generator = torch.Generator().manual_seed(sampling_seed)
        order = RandomSampler(data, generator=generator)  # type: ignore[arg-type]  # sized
        batches = BatchSampler(order, batch_size, False)
        pick = _SliceOfBatch(self.rank, self._world)
        return DataLoader(
            data,
            batch_sampler=_RankSampler(batches, pick, self.resumed),
            generator=generator,
            num_workers=workers,
            multiprocessing_context=loader_context() if workers > 0 else None,
            persistent_workers=workers > 0,
            collate_fn=_CollateOrEmpty(tuple(t[:0] for t in default_collate([data[0]]))),
        )

    def wrap(self, work: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        self._attach(work, optimizer)
        work.register_forward_pre_hook(self._count)
        ids = [self._device.index] if self._device.type == "cuda" else None
        shared = DistributedDataParallel(work, device_ids=ids)
        shared.register_comm_hook(self, _weighted_mean)
        self._arm_straggler_timeout()
        return shared

    def make_private(
        self,
        work: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loader: DataLoader[Any],
        dp: DPParams,
        noise_seed: bytes,
    ) -> tuple[PrivacyEngine, torch.nn.Module, torch.optim.Optimizer, DataLoader[Any]]:
        """This rank's shard of one process's Poisson batches, and Opacus' distributed
        private model and optimiser (:mod:`fedsec.learning.worker_privacy`).

        Raises:
            ConfigError: a model Opacus cannot train; a checkpoint whose accounting is
                not its steps'.
        """
        self._attach(work, optimizer)
        poisson = poisson_batches(loader)
        pick = ShardOfBatch(len(poisson.dataset), self.rank, self._world)
        shard = shard_loader(poisson, _RankSampler(poisson.batch_sampler, pick, self.resumed))
        engine, trained, private = private_over_ranks(work, optimizer, shard, dp, noise_seed)
        restore_accounting(engine, private, self._saved_accounting, self.resumed)
        self._accounting = engine, private
        self._arm_straggler_timeout()
        return engine, trained, private, shard

    def _arm_straggler_timeout(self) -> None:
        """From here on a collective fails after ``straggler_timeout_s``. Armed only once
        the ranks have met at the model's first broadcast (DDP's constructor), so the
        skew of their start-up (imports, loading the records) is not taken for a
        straggler; from then on every rank does the same work between collectives,
        but for rank 0's noise and checkpoints."""
        # torch's setter of the timeout init_process_group(timeout=) sets (private in
        # torch 2.x); that argument would also time the start-up
        _set_pg_timeout(timedelta(seconds=self.straggler_timeout_s))
        self.stepped_at = _now()

    def _attach(self, work: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Checkpoint ``work`` and ``optimizer`` after each step; restore the optimiser."""
        self._work, self._optimizer = work, optimizer
        _load_optimizer_state(optimizer, self._saved_optimizer)
        optimizer.register_step_post_hook(lambda *_: self._after_step())

    def resume(self, model: torch.nn.Module) -> None:
        """Load the job's checkpoint, if any, into ``model`` (which training copies), and
        keep its optimiser state for :meth:`wrap`; rank 0 records the attempt in the
        member's workers status."""
        path = self._job / _CHECKPOINT
        if path.exists():
            self.resumed_checkpoint_age_s = max(0.0, time.time() - path.stat().st_mtime)
            self._load_checkpoint(path, model)
        if self.rank == 0 and self.attempt > 0:
            update_status(
                _state_dir(self._job),
                restarts=self.attempt,
                resumed_from_step=self.resumed,
                resumed_checkpoint_age_s=self.resumed_checkpoint_age_s,
            )

    def _load_checkpoint(self, path: Path, model: torch.nn.Module) -> None:
        saved = load_file(str(path))
        self.resumed = self.done = int(saved.pop("steps").item())
        weights = {k[len("model.") :]: v for k, v in saved.items() if k.startswith("model.")}
        model.load_state_dict(weights)
        self._saved_optimizer = {k: v for k, v in saved.items() if k.startswith("optim.")}
        self._saved_accounting = {k: v for k, v in saved.items() if k.startswith("dp.")}

    def _count(self, _module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        self.count = int(args[0].shape[0])

    def _after_step(self) -> None:
        self.done += 1
        now = _now()
        if self.stepped_at is not None:
            self.stepped_at = now
        by_steps = self._every > 0 and self.done % self._every == 0
        by_time = self._interval > 0 and now - self._checkpointed_at >= self._interval
        if self.rank == 0 and (by_steps or by_time):
            self._checkpoint()
            self._checkpointed_at = now
        faulty = self.rank == self._world - 1 and self.attempt == 0
        if faulty and self._crash_at == self.done:
            os.kill(os.getpid(), signal.SIGKILL)
        if faulty and self._stall_at == self.done:
            time.sleep(STALL_TIMEOUTS * self.straggler_timeout_s)

    def _checkpoint(self) -> None:
        assert self._work is not None and self._optimizer is not None
        state = {f"model.{k}": v for k, v in self._work.state_dict().items()}
        for index, values in self._optimizer.state_dict()["state"].items():
            for key, value in values.items():
                if value is not None:
                    state[f"optim.{index}.{key}"] = torch.as_tensor(value)
        state["steps"] = torch.tensor(self.done)
        if self._accounting is not None:
            state.update(accounting_state(*self._accounting))
        atomic_write(self._job / _CHECKPOINT, save(_plain(state)), mode=0o600)
        update_status(_state_dir(self._job), checkpoint_step=self.done, checkpoint_at=time.time())


def _now() -> float:
    """The clock of checkpoint intervals and straggler waits (monotonic)."""
    return time.monotonic()


def _state_dir(job: Path) -> Path:
    """The member's state directory of a job directory (``STATE/training/job-*``)."""
    return job.parent.parent


def _weighted_mean(sharing: _Sharing, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce of the batch's mean gradient: Σ count·mean / Σ count over the ranks."""
    buffer = bucket.buffer()
    packed = torch.cat([buffer * sharing.count, buffer.new_tensor([float(sharing.count)])])
    future = dist.all_reduce(packed, async_op=True).get_future()

    def mean(done: torch.futures.Future[Any]) -> torch.Tensor:
        total: torch.Tensor = done.value()[0]
        return total[:-1] / total[-1]

    averaged: torch.futures.Future[torch.Tensor] = future.then(mean)
    return averaged


# DDP checks a hook's annotations against the classes themselves, which postponed
# annotations (PEP 563) turned into strings
_weighted_mean.__annotations__.update(
    bucket=GradBucket, **{"return": torch.futures.Future[torch.Tensor]}
)


def _load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, torch.Tensor]) -> None:
    """Restore a checkpoint's ``optim.<param index>.<key>`` tensors into ``optimizer``."""
    if not saved:
        return
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in saved.items():
        _, index, key = name.split(".", 2)
        state.setdefault(int(index), {})[key] = value
    optimizer.load_state_dict(
        {"state": state, "param_groups": optimizer.state_dict()["param_groups"]}
    )


def _worker(job: Path) -> None:
    """One torchrun worker: train this rank's part of the job; rank 0 writes the result."""
    settings = json.loads((job / _JOB).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = settings["backend"]
    device = (
        torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        if backend == "nccl"
        else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _join_group(backend, rank, world)
    try:
        task = get_task(settings["task"], **settings["task_options"])
        model = task.build_model(0)
        model.load_state_dict(load_file(str(job / _MODEL)))
        stored = load_file(str(job / _RECORDS))
        data = TensorDataset(stored["x"], stored["y"])
        sharing = _Sharing(job, rank, world, device, settings)
        sharing.resume(model)
        try:
            trained = train_dataset(
                model,
                data,
                TrainingParams(**settings["params"]),
                None if settings["dp"] is None else DPParams(**settings["dp"]),
                device,
                int(settings["seed"]),
                task=task,
                sharing=sharing,
            )
        except RuntimeError:
            _report_straggler(sharing)
            raise
        if rank == 0:
            _write_result(job, model, trained, sharing)
    finally:
        dist.destroy_process_group()


def _report_straggler(sharing: _Sharing) -> None:
    """Print :data:`STRAGGLER_EVENT` if this rank's failure came after waiting the whole
    straggler timeout since its last step (a collective timed out on a lagging peer; a
    dead peer fails the collective at once, and is not a straggler)."""
    if sharing.stepped_at is None:
        return
    waited = _now() - sharing.stepped_at
    if waited >= sharing.straggler_timeout_s:
        print(
            f"{STRAGGLER_EVENT} attempt={sharing.attempt} rank={sharing.rank} "
            f"step={sharing.done + 1} waited_s={waited:.1f} "
            f"timeout_s={sharing.straggler_timeout_s:g}",
            file=sys.stderr,
            flush=True,
        )


def _join_group(backend: str, rank: int, world: int) -> None:
    """Join the job's process group under a key prefix of this attempt: torchrun keeps one
    store across restarts, where a restarted worker would otherwise read its dead
    predecessors' addresses and fail to connect."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    hosted = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0 and not hosted,
    )
    prefixed = PrefixStore(f"fedsec/attempt-{attempt}/", store)
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world)


def _write_result(
    job: Path, model: torch.nn.Module, trained: LocalTrainResult, sharing: _Sharing
) -> None:
    atomic_write(job / _TRAINED, save(_plain(model.state_dict())), mode=0o600)
    _write_json(
        job / _RESULT,
        {
            "steps": sharing.resumed + trained.steps,
            "samples": trained.samples,
            "sample_rate": trained.sample_rate,
            "epsilon_round": trained.epsilon_round,
            "train_loss": trained.train_loss,
            "duration_s": trained.duration_s,
            "restarts": sharing.attempt,
            "resumed_from_step": sharing.resumed,
            "resumed_checkpoint_age_s": sharing.resumed_checkpoint_age_s,
        },
    )


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m fedsec.learning.workers JOB_DIR``, as torchrun starts each worker."""
    args = sys.argv[1:] if argv is None else list(argv)
    _worker(Path(args[0]))


if __name__ == "__main__":
    main()
