"""Local training of one round, with or without DP-SGD (Opacus), and a centralized baseline.

With DP, Opacus samples each batch by Poisson sampling (each record joins a step with
probability ``sample_rate``), clips every per-sample gradient to ``max_grad_norm`` and
adds Gaussian noise of standard deviation ``noise_multiplier * max_grad_norm``. Opacus
wraps a private *copy* of the model, so its hooks and wrappers never reach the caller's
model, which only receives the trained weights.

The seed decides batch sampling and DP noise. In production it must be secret to the
member (use :func:`fresh_seed` each round): anyone who knows it can regenerate the noise
and subtract it from the update. Fixed seeds are for tests and simulations.

The noise is what Opacus' ``secure_mode`` would draw, from fedsec's own CSPRNG: each
parameter's noise at each step comes from the AES-256-CTR keystream of :mod:`fedsec.crypto.prg`
(keyed by a hash of the whole seed, one stream per step and parameter), turned into
Gaussians by Box-Muller on uniforms with the bits of the parameter's dtype (24 for
float32, as Opacus' own float32 normals; 53 for float64), in that dtype
(:func:`fedsec.learning.dp_noise.secure_gaussian`), and is the sum of four such draws halved,
Opacus' defence against floating-point attacks on the Gaussian mechanism (Holohan and
Braghin, 2021: 2n draws, n = 2).  Opacus' ``secure_mode`` itself needs ``torchcsprng``,
whose last release (0.2.1, 2021) is built for torch 1.8 and Python <= 3.9 only; torch's
own generator (Mersenne Twister, a 64-bit seed) is predictable from its output.

Data of any size: training reads a map-style torch dataset through a DataLoader, so a
member holds one batch of records at a time, never its dataset. In-memory arrays are a
``TensorDataset`` on the same path (:func:`train_local`). Poisson sampling draws one
Bernoulli mask over the record *indices* per step (Opacus' ``UniformWithReplacementSampler``
in the main process, so the draw never depends on the worker count); worker processes
only read the chosen records.
"""

from __future__ import annotations

import copy
import hashlib
import math
import multiprocessing
import os
import secrets
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import torch
from opacus import PrivacyEngine
from opacus.grad_sample.gsm_base import AbstractGradSampleModule
from torch.nn import functional as F
from torch.utils.data import DataLoader, Subset, TensorDataset, default_collate
from torch.utils.data import Dataset as TorchDataset

from fedsec.errors import ConfigError, InvalidTask
from fedsec.learning.dp_noise import CsprngPrivacyEngine, make_private
from fedsec.task.definition import as_targets
from fedsec.tasks.base import Dataset, Task, TrainingParams
from fedsec.tasks.evaluation import evaluate

__all__ = [
    "DPParams",
    "LocalTrainResult",
    "StepSharing",
    "TrainingParams",
    "fresh_seed",
    "loader_context",
    "loader_workers",
    "plan_round",
    "records",
    "train_centralized",
    "train_dataset",
    "train_local",
]


#: Bits of a production seed: the DP noise key is a hash of the whole seed, so its
#: strength is the seed's, and 256 bits match the AES-256 keystream it keys.
_FRESH_SEED_BITS = 256
#: Domain separation of the DP noise key from any other hash of the seed.
_NOISE_KEY_DOMAIN = b"fedsec/v1/dp-sgd-noise-key\x00"
#: ``(model, batch) -> 0-d loss``: what one step minimises (:meth:`Task.batch_loss`)
BatchLoss = Callable[[torch.nn.Module, Any], torch.Tensor]
#: How far the loss of two copies of one record may be from the record's own loss
#: before the loss counts as a sum, not a mean: float32 rounding of a mean of two
#: equal values is far inside it, a sum is 100 % off.
_MEAN_PROBE_RTOL = 1e-3

#: Most DataLoader worker processes reading a dataset from disk: decoding (e.g. PNG)
#: overlaps the step, and two keep a small model's step fed on the 2-core members we
#: target; more only add processes, each holding one batch in flight.
MAX_LOADER_WORKERS = 2

#: How DataLoader workers start: from a single-threaded fork server, never by forking
#: the member itself. A member trains in a thread beside its event loop (and
#: ``fedsec simulate`` runs several members as threads of one process); a plain fork
#: copies every lock another thread holds at that instant into the worker, which then
#: waits on it forever. The server preloads torch, so each worker starts in a fork's
#: time, not an interpreter's.
LOADER_START_METHOD = "forkserver"
_LOADER_PRELOAD = ["torch"]


@dataclass(frozen=True)
class DPParams:
    """DP-SGD settings: noise relative to the clip norm, the clip norm, and target delta."""

    noise_multiplier: float
    max_grad_norm: float
    delta: float

    def __post_init__(self) -> None:
        if not (self.noise_multiplier > 0 and math.isfinite(self.noise_multiplier)):
            raise ConfigError(
                f"DP noise_multiplier must be a positive finite number, got {self.noise_multiplier}"
            )
        if not (self.max_grad_norm > 0 and math.isfinite(self.max_grad_norm)):
            raise ConfigError(
                f"DP max_grad_norm must be a positive finite number, got {self.max_grad_norm}"
            )
        if not 0.0 < self.delta < 1.0:
            raise ConfigError(f"DP delta must be in (0, 1), got {self.delta}")


@dataclass(frozen=True)
class LocalTrainResult:
    """What one local training run did.

    ``epsilon_round`` is the privacy cost of this round alone (None without DP); the
    privacy ledger composes rounds from ``sample_rate`` and ``steps``.
    """

    steps: int
    samples: int
    sample_rate: float
    epsilon_round: float | None
    train_loss: float
    duration_s: float


class StepSharing(Protocol):
    """How one process of a multi-process run (:mod:`fedsec.learning.workers`) takes its
    part of every step of :func:`train_dataset`: its slice of each batch, and a model
    whose backward pass combines the processes' gradients into the whole batch's (under
    DP-SGD, :meth:`make_private` takes the place of both)."""

    def loader(
        self, data: TorchDataset[Any], batch_size: int, sampling_seed: int, workers: int
    ) -> DataLoader[Any]:
        """This process's slices of the batches one process would draw with this seed."""
        ...

    def wrap(self, work: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        """The module the steps run (``work`` stays the one whose weights are returned)."""
        ...

    def make_private(
        self,
        work: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loader: DataLoader[Any],
        dp: DPParams,
        noise_seed: bytes,
    ) -> tuple[PrivacyEngine, torch.nn.Module, torch.optim.Optimizer, DataLoader[Any]]:
        """What :func:`_make_private` returns for one process, for this process's part:
        its records of the Poisson batch one process would draw from ``loader``, and an
        optimiser that adds the step's noise once across the processes."""
        ...


def fresh_seed() -> int:
    """A secret 256-bit seed from the OS CSPRNG, for production training rounds: the DP
    noise key is a hash of all of it (batch sampling takes 63 bits of it)."""
    return secrets.randbits(_FRESH_SEED_BITS)


def plan_round(n_samples: int, params: TrainingParams) -> tuple[float, int]:
    """``(sample_rate, steps)`` that :func:`train_local` will use on ``n_samples`` records.

    Known before training, so the privacy ledger can be charged before any update
    exists. Mirrors Opacus: ``sample_rate = 1 / ceil(n / batch_size)`` and
    ``int(1 / sample_rate)`` steps per epoch.

    Raises:
        ConfigError: ``n_samples < 1``.
    """
    if n_samples < 1:
        raise ConfigError("cannot train on an empty dataset")
    batches = math.ceil(n_samples / params.batch_size)
    sample_rate = 1.0 / batches
    return sample_rate, int(1.0 / sample_rate) * params.local_epochs


def _make_optimizer(
    parameters: Iterable[torch.nn.Parameter], params: TrainingParams
) -> torch.optim.Optimizer:
    if params.optimizer == "adam":
        return torch.optim.Adam(parameters, lr=params.lr)
    return torch.optim.SGD(parameters, lr=params.lr, momentum=params.momentum)


def _seeds(seed: int) -> tuple[int, bytes]:
    """Independent seeds for sampling and noise, so changing one use never shifts the other:
    a 63-bit torch seed for batch sampling, the 32-byte CSPRNG seed of the DP noise."""
    (sampling,) = np.random.SeedSequence(seed).generate_state(1, dtype=np.uint64)
    whole = seed.to_bytes(max(1, (seed.bit_length() + 7) // 8), "big")
    return int(sampling) >> 1, hashlib.sha256(_NOISE_KEY_DOMAIN + whole).digest()


@contextmanager
def _progress(enabled: bool, total: int, label: str) -> Iterator[Callable[[], None]]:
    """Yield a callable advancing a rich progress bar, or a no-op when disabled."""
    if not enabled:
        yield lambda: None
        return
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task_id = bar.add_task(label, total=total)
        yield lambda: bar.advance(task_id)


def train_local(
    model: torch.nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    params: TrainingParams,
    dp: DPParams | None,
    device: torch.device | str,
    seed: int,
    progress: bool = False,
    task: Task | None = None,
) -> LocalTrainResult:
    """Train ``model`` in place on in-memory ``(x, y)``: :func:`train_dataset` on their
    ``TensorDataset`` (float32 features, int64 class indices, shape ``(n, ...)``).

    Raises:
        ConfigError: empty data, mismatched ``x``/``y``, or a model Opacus cannot train.
        InvalidTask: see :func:`train_dataset`.
    """
    if len(y) < 1 or len(x) != len(y):
        raise ConfigError(f"training needs matching non-empty x and y, got {len(x)} and {len(y)}")
    data = TensorDataset(*_tensors(x, y))
    return train_dataset(model, data, params, dp, device, seed, progress, task)


def train_dataset(
    model: torch.nn.Module,
    data: TorchDataset[Any],
    params: TrainingParams,
    dp: DPParams | None,
    device: torch.device | str,
    seed: int,
    progress: bool = False,
    task: Task | None = None,
    workers: int | None = None,
    sharing: StepSharing | None = None,
) -> LocalTrainResult:
    """Train ``model`` in place on the map-style dataset ``data`` for ``params.local_epochs``
    epochs, reading it batch by batch (memory does not grow with ``len(data)``).

    A copy of the model is trained on ``device`` and its weights are copied back into
    ``model`` (which keeps its own device and gains no hooks or wrappers). Deterministic
    on the CPU for a given ``seed``, whatever the worker count.

    Args:
        model: the model to train, e.g. the current global model.
        data: items ``(x, y)`` (or what the task's ``batch_step`` consumes), indexable
            ``0..len(data)-1``, e.g. an image folder read lazily from disk.
        params: optimiser settings.
        dp: DP-SGD settings, or None for plain training (simulation baselines only).
        device: where to train.
        seed: batch sampling and DP noise seed; secret in production (see module doc).
        progress: show a progress bar on the terminal.
        task: whose loss (or ``batch_step``) each step minimises; None: cross-entropy.
        workers: DataLoader worker processes; None: :func:`loader_workers`.
        sharing: this process's part of each step across processes; None: all.

    Returns:
        steps, samples, sample rate, epsilon (DP only), mean training loss, wall time.

    Raises:
        ConfigError: an empty dataset, or a model Opacus cannot train.
        InvalidTask: the task's loss is not a 0-d floating tensor, or not the batch mean
            (DP-SGD's clipping and noise assume the mean); the model is left as it was.
    """
    started = time.perf_counter()
    n = len(data)  # type: ignore[arg-type]  # map-style datasets have a length
    if n < 1:
        raise ConfigError("cannot train on an empty dataset")
    target = torch.device(device)
    work = copy.deepcopy(model).to(target)
    count = loader_workers(data) if workers is None else workers
    batch_loss = _batch_loss(task, work, data, target)
    steps, loss_sum, seen, sample_rate, epsilon = _train_copy(
        work, data, params, dp, target, seed, progress, batch_loss, count, sharing
    )
    model.load_state_dict(work.state_dict())  # copies under no_grad itself
    return LocalTrainResult(
        steps=steps,
        samples=n,
        sample_rate=sample_rate,
        epsilon_round=epsilon,
        train_loss=loss_sum / seen if seen else float("nan"),
        duration_s=time.perf_counter() - started,
    )


def loader_workers(data: TorchDataset[Any]) -> int:
    """Worker processes worth reading ``data`` with: none for records already in memory
    (a worker would only copy each batch between processes), else up to
    :data:`MAX_LOADER_WORKERS`."""
    while isinstance(data, Subset):
        data = data.dataset
    if isinstance(data, TensorDataset):
        return 0
    return min(MAX_LOADER_WORKERS, os.cpu_count() or 1)


def loader_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context every DataLoader of a member's training starts its
    workers with (:data:`LOADER_START_METHOD`; ``spawn`` where the platform has no fork
    server). A dataset read with workers must therefore pickle: a class defined at
    module level, holding paths rather than open handles."""
    if LOADER_START_METHOD not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context(LOADER_START_METHOD)
    context.set_forkserver_preload(_LOADER_PRELOAD)
    return context


def _train_copy(
    work: torch.nn.Module,
    data: TorchDataset[Any],
    params: TrainingParams,
    dp: DPParams | None,
    target: torch.device,
    seed: int,
    progress: bool,
    batch_loss: BatchLoss,
    workers: int,
    sharing: StepSharing | None = None,
) -> tuple[int, float, int, float, float | None]:
    """Train ``work`` (a copy already on ``target``): (steps, loss sum, samples seen,
    sample rate, this round's epsilon or None without DP)."""
    sampling_seed, noise_seed = _seeds(seed)
    sample_rate, planned_steps = plan_round(len(data), params)  # type: ignore[arg-type]
    work.train()
    optimizer = _make_optimizer(work.parameters(), params)
    loader = _loader(data, params.batch_size, sampling_seed, workers, target)
    engine: PrivacyEngine | None = None
    trained: torch.nn.Module = work
    if sharing is not None and dp is None:
        loader = sharing.loader(data, params.batch_size, sampling_seed, workers)
        trained = sharing.wrap(work, optimizer)
    if dp is not None:
        private = _make_private if sharing is None else sharing.make_private
        engine, trained, optimizer, loader = private(work, optimizer, loader, dp, noise_seed)
        sample_rate = float(loader.sample_rate)  # type: ignore[attr-defined]
    try:
        with _progress(progress, planned_steps, "local training") as advance:
            steps, loss_sum, seen = _run_epochs(
                trained, optimizer, loader, params.local_epochs, target, advance, batch_loss
            )
        epsilon = None if engine is None or dp is None else engine.get_epsilon(dp.delta)
    finally:
        if isinstance(trained, AbstractGradSampleModule):
            # The private copy is discarded, but dropping its hooks and per-sample
            # gradients now frees memory at once instead of at garbage collection.
            trained.remove_hooks()
            trained._close()
    return steps, loss_sum, seen, sample_rate, epsilon


def _loader(
    data: TorchDataset[Any],
    batch_size: int,
    sampling_seed: int,
    workers: int,
    target: torch.device,
) -> DataLoader[Any]:
    """The shuffled loader plain training reads; under DP, Opacus replaces its sampler
    by Poisson sampling and keeps the rest (workers, pinning, generator)."""
    return DataLoader(
        data,
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(sampling_seed),
        num_workers=workers,
        multiprocessing_context=loader_context() if workers > 0 else None,
        # the workers live for the whole call (every epoch), not one epoch each
        persistent_workers=workers > 0,
        pin_memory=workers > 0 and target.type == "cuda",
    )


def records(data: TorchDataset[Any], rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ``(x, y)`` arrays of the records ``rows`` of ``data`` (float32, int64), read
    one by one: memory for these records only.

    Raises:
        ConfigError: a record is not an ``(x, y)`` pair.
    """
    if isinstance(data, TensorDataset) and len(data.tensors) == 2:
        index = torch.from_numpy(np.asarray(rows, dtype=np.int64))
        xs, ys = (t[index].numpy() for t in data.tensors)
        return _arrays_of(xs, ys)
    items = [data[int(i)] for i in rows]
    if any(not isinstance(item, (tuple, list)) or len(item) != 2 for item in items):
        raise ConfigError("distributed DP at record level needs (x, y) records")
    if not items:
        return np.zeros((0,), np.float32), np.zeros((0,), np.int64)
    xs = np.stack([np.asarray(x) for x, _ in items])
    ys = np.asarray([np.asarray(y) for _, y in items])
    return _arrays_of(xs, ys)


def _arrays_of(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return np.ascontiguousarray(x, dtype=np.float32), as_targets(y)


def _tensors(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 features and targets the loop trains on (int64 class indices, or
    float32 regression values and multi-label labels), sharing the arrays' memory where
    they already have those dtypes."""
    return (
        torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)),
        torch.from_numpy(as_targets(y)),
    )


def _make_private(
    work: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader[Any],
    dp: DPParams,
    noise_seed: bytes,
) -> tuple[PrivacyEngine, torch.nn.Module, torch.optim.Optimizer, DataLoader[Any]]:
    """Opacus' private model, optimiser and Poisson-sampling loader for ``work``.

    Raises:
        ConfigError: a model Opacus cannot train.
    """
    return make_private(
        CsprngPrivacyEngine,
        noise_seed,
        work,
        optimizer,
        loader,
        dp.noise_multiplier,
        dp.max_grad_norm,
        poisson_sampling=True,
    )


def _run_epochs(
    trained: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader[Any],
    epochs: int,
    target: torch.device,
    advance: Callable[[], None],
    batch_loss: BatchLoss,
) -> tuple[int, float, int]:
    """Run ``epochs`` passes over ``loader``; returns (steps, summed loss, records seen)."""
    steps = 0
    loss_sum = 0.0
    seen = 0
    with warnings.catch_warnings():
        # Opacus' per-sample hooks fire on module outputs when inputs need no grad,
        # which is exactly how they are meant to work here.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        for _ in range(epochs):
            for xb, yb in loader:
                xb, yb = xb.to(target), yb.to(target)
                optimizer.zero_grad(set_to_none=True)
                if len(yb) > 0:
                    loss = batch_loss(trained, (xb, yb))
                    torch.autograd.backward(loss)
                    loss_sum += float(loss.detach()) * len(yb)
                    seen += len(yb)
                else:
                    # A Poisson batch can be empty; the step must still happen (noise is
                    # added and the accountant counts it) or skipping would leak that.
                    empty_out: torch.Tensor = trained(xb)
                    torch.autograd.backward(empty_out.sum())
                optimizer.step()
                steps += 1
                advance()
    return steps, loss_sum, seen


def _cross_entropy_step(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    xb, yb = batch
    return F.cross_entropy(model(xb), yb)


def _batch_loss(
    task: Task | None, work: torch.nn.Module, data: TorchDataset[Any], target: torch.device
) -> BatchLoss:
    """What each step minimises; a task's own loss once checked on ``work``.

    Raises:
        InvalidTask: see :func:`_check_batch_mean`.
    """
    # The default loss is the very same computation as Task.batch_loss of a task that
    # keeps the defaults, without its per-step check: the bundled tasks' models stay
    # bit-identical whichever way they are trained.
    if task is None or not task.own_loss:
        return _cross_entropy_step
    _check_batch_mean(task.name, task.batch_loss, work, data[0], target)
    return task.batch_loss


def _check_batch_mean(
    name: str,
    batch_loss: BatchLoss,
    work: torch.nn.Module,
    record: Any,
    target: torch.device,
) -> None:
    """Refuse a loss that is a batch *sum*: two copies of one record must give the
    record's own loss. Opacus clips each record's gradient of the loss and scales the
    noise by the expected batch size, assuming the mean; a sum would multiply the step
    by the batch size. Evaluated without gradients, in eval mode and on a forked RNG,
    so training afterwards is exactly what it would have been.

    Raises:
        InvalidTask: the loss is not a 0-d floating tensor, or not the batch mean.
    """
    one = _to_device(default_collate([record]), target)
    two = _to_device(default_collate([record, record]), target)
    was_training = work.training
    work.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            single, double = float(batch_loss(work, one)), float(batch_loss(work, two))
    finally:
        work.train(was_training)
    if not math.isclose(single, double, rel_tol=_MEAN_PROBE_RTOL, abs_tol=1e-12):
        raise InvalidTask(
            f"task '{name}' loss is not the batch mean: two copies of one record give "
            f"{double:.6g}, the record alone {single:.6g}; reduce over the batch with "
            ".mean() (DP-SGD clips and noises per-sample gradients of the mean)"
        )


def _to_device(batch: Any, target: torch.device) -> Any:
    """A collated batch (tensors, or tuples, lists or dicts of them) moved to ``target``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(target)
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_device(part, target) for part in batch)
    if isinstance(batch, dict):
        return {key: _to_device(part, target) for key, part in batch.items()}
    return batch


def train_centralized(
    task: Task,
    dataset: Dataset,
    epochs: int,
    device: torch.device | str,
    seed: int,
    params: TrainingParams | None = None,
) -> tuple[float, float]:
    """Train a fresh model of ``task`` on all of ``dataset``'s training data, without DP.

    The baseline a federation is compared against.

    Args:
        params: optimiser settings; default ``task.defaults`` (its epoch count is
            replaced by ``epochs``).

    Returns:
        ``(test accuracy, test loss)``, the loss the task's (see :func:`evaluate`).
    """
    model = task.build_model(seed)
    settings = replace(params or task.defaults, local_epochs=epochs)
    train_local(model, dataset.x_train, dataset.y_train, settings, None, device, seed, task=task)
    return evaluate(model, dataset.x_test, dataset.y_test, device, task=task)
