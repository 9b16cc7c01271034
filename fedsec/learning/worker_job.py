"""Inside each worker of a round's torchrun job (:mod:`fedsec.learning.workers` launches
it): the job directory's layout, the rank's share of each step (its slice of every
batch, the weighted all-reduce of the batch's gradient), checkpoints, resuming, the
straggler timeout, and rank 0's result. The design is told in
:mod:`fedsec.learning.workers`."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
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

from fedsec.fsio import atomic_write
from fedsec.learning.training import DPParams, LocalTrainResult, loader_context, train_dataset
from fedsec.learning.worker_nodes import JOB_FILE
from fedsec.learning.worker_privacy import (
    ShardOfBatch,
    accounting_state,
    poisson_batches,
    private_over_ranks,
    restore_accounting,
    shard_loader,
)
from fedsec.learning.worker_status import update_status
from fedsec.tasks import TrainingParams, get_task

#: Tests only: a stalled worker sleeps this many straggler timeouts, then goes on, so a
#: straggler that is not detected shows as a job without restarts instead of a hang.
STALL_TIMEOUTS: Final = 10
#: The event the ranks left waiting by a straggler print before they fail.
STRAGGLER_EVENT: Final = "worker_straggler"

#: The files of a job directory (the settings file, JOB_FILE, is worker_nodes' too: a
#: following node takes a job's presence from it).
MODEL_FILE: Final = "model.safetensors"
RECORDS_FILE: Final = "records.safetensors"
TRAINED_FILE: Final = "trained.safetensors"
RESULT_FILE: Final = "result.json"
CHECKPOINT_FILE: Final = "checkpoint.safetensors"
LOG_FILE: Final = "torchrun.log"


def plain_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors safetensors can write: detached, on the CPU, contiguous, unshared."""
    return {k: v.detach().cpu().contiguous().clone() for k, v in state.items()}


def write_json(path: Path, value: dict[str, Any]) -> None:
    """Write ``value`` as the JSON file ``path``, atomically, 0600."""
    atomic_write(path, json.dumps(value).encode(), mode=0o600)


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
        path = self._job / CHECKPOINT_FILE
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
        atomic_write(self._job / CHECKPOINT_FILE, save(plain_state(state)), mode=0o600)
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
    settings = json.loads((job / JOB_FILE).read_text())
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
        model.load_state_dict(load_file(str(job / MODEL_FILE)))
        stored = load_file(str(job / RECORDS_FILE))
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
    atomic_write(job / TRAINED_FILE, save(plain_state(model.state_dict())), mode=0o600)
    write_json(
        job / RESULT_FILE,
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
    """``python -m fedsec.learning.workers JOB_DIR`` (this module's ``main``), as torchrun
    starts each worker."""
    args = sys.argv[1:] if argv is None else list(argv)
    _worker(Path(args[0]))
