"""Local training of one round, with or without DP-SGD (Opacus), and a centralized baseline.

With DP, Opacus samples each batch by Poisson sampling (each record joins a step with
probability ``sample_rate``), clips every per-sample gradient to ``max_grad_norm`` and
adds Gaussian noise of standard deviation ``noise_multiplier * max_grad_norm``. Opacus
wraps a private *copy* of the model, so its hooks and wrappers never reach the caller's
model, which only receives the trained weights.

The seed decides batch sampling and DP noise. In production it must be secret to the
member (use :func:`fresh_seed` each round): anyone who knows it can regenerate the noise
and subtract it from the update. Fixed seeds are for tests and simulations.
"""

from __future__ import annotations

import copy
import math
import secrets
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from opacus import PrivacyEngine
from opacus.grad_sample.gsm_base import AbstractGradSampleModule
from opacus.validators.errors import UnsupportedModuleError
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from fedsec.errors import ConfigError
from fedsec.tasks.base import Dataset, Task, TrainingParams
from fedsec.tasks.evaluation import evaluate

__all__ = [
    "DPParams",
    "LocalTrainResult",
    "TrainingParams",
    "fresh_seed",
    "plan_round",
    "train_centralized",
    "train_local",
]


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


def fresh_seed() -> int:
    """A secret 63-bit seed from the OS CSPRNG, for production training rounds."""
    return secrets.randbits(63)


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


def _seeds(seed: int) -> tuple[int, int]:
    # Independent streams for sampling and noise, so changing one use never shifts the other.
    sampling, noise = np.random.SeedSequence(seed).generate_state(2, dtype=np.uint64)
    return int(sampling) >> 1, int(noise) >> 1


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
) -> LocalTrainResult:
    """Train ``model`` in place on ``(x, y)`` for ``params.local_epochs`` epochs.

    A copy of the model is trained on ``device`` and its weights are copied back into
    ``model`` (which keeps its own device and gains no hooks or wrappers). Deterministic
    on the CPU for a given ``seed``.

    Args:
        model: the model to train, e.g. the current global model.
        x: float32 features, shape ``(n, *input_shape)``.
        y: int64 class indices, shape ``(n,)``.
        params: optimiser settings.
        dp: DP-SGD settings, or None for plain training (simulation baselines only).
        device: where to train.
        seed: batch sampling and DP noise seed; secret in production (see module doc).
        progress: show a progress bar on the terminal.

    Returns:
        steps taken, sample count, sample rate, this round's epsilon (DP only), mean
        training loss and wall time.

    Raises:
        ConfigError: empty data, mismatched ``x``/``y``, or a model Opacus cannot train.
    """
    started = time.perf_counter()
    n = len(y)
    if n < 1 or len(x) != n:
        raise ConfigError(f"training needs matching non-empty x and y, got {len(x)} and {n}")
    target = torch.device(device)
    work = copy.deepcopy(model).to(target)
    steps, loss_sum, seen, sample_rate, epsilon = _train_copy(
        work, x, y, params, dp, target, seed, progress
    )
    with torch.no_grad():
        model.load_state_dict(work.state_dict())
    return LocalTrainResult(
        steps=steps,
        samples=n,
        sample_rate=sample_rate,
        epsilon_round=epsilon,
        train_loss=loss_sum / seen if seen else float("nan"),
        duration_s=time.perf_counter() - started,
    )


def _train_copy(
    work: torch.nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    params: TrainingParams,
    dp: DPParams | None,
    target: torch.device,
    seed: int,
    progress: bool,
) -> tuple[int, float, int, float, float | None]:
    """Train ``work`` (a copy already on ``target``): (steps, loss sum, samples seen,
    sample rate, this round's epsilon or None without DP)."""
    sampling_seed, noise_seed = _seeds(seed)
    sample_rate, planned_steps = plan_round(len(y), params)
    work.train()
    optimizer = _make_optimizer(work.parameters(), params)
    loader = _loader(x, y, params.batch_size, sampling_seed)
    engine: PrivacyEngine | None = None
    trained: torch.nn.Module = work
    if dp is not None:
        engine, trained, optimizer, loader = _make_private(
            work, optimizer, loader, dp, target, noise_seed
        )
        sample_rate = float(loader.sample_rate)  # type: ignore[attr-defined]
    try:
        with _progress(progress, planned_steps, "local training") as advance:
            steps, loss_sum, seen = _run_epochs(
                trained, optimizer, loader, params.local_epochs, target, advance
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
    x: np.ndarray, y: np.ndarray, batch_size: int, sampling_seed: int
) -> DataLoader[tuple[torch.Tensor, ...]]:
    data = TensorDataset(
        torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)),
        torch.from_numpy(np.ascontiguousarray(y, dtype=np.int64)),
    )
    return DataLoader(
        data,
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(sampling_seed),
    )


def _make_private(
    work: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader[tuple[torch.Tensor, ...]],
    dp: DPParams,
    target: torch.device,
    noise_seed: int,
) -> tuple[PrivacyEngine, torch.nn.Module, torch.optim.Optimizer, DataLoader[Any]]:
    """Opacus' private model, optimiser and Poisson-sampling loader for ``work``."""
    with warnings.catch_warnings():
        # Opacus warns that secure_mode is off; the noise seed policy is ours (see
        # the module docstring) and the warning would repeat every round.
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        engine = PrivacyEngine(accountant="rdp")
    try:
        trained, private_optimizer, private_loader = engine.make_private(
            module=work,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=dp.noise_multiplier,
            max_grad_norm=dp.max_grad_norm,
            poisson_sampling=True,
            noise_generator=torch.Generator(device=target).manual_seed(noise_seed),
        )
    except UnsupportedModuleError as exc:
        raise ConfigError(f"model cannot be trained with DP-SGD: {exc}") from exc
    return engine, trained, private_optimizer, private_loader


def _run_epochs(
    trained: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader[Any],
    epochs: int,
    target: torch.device,
    advance: Callable[[], None],
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
                    loss = F.cross_entropy(trained(xb), yb)
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
        ``(test accuracy, test loss)``.
    """
    model = task.build_model(seed)
    settings = replace(params or task.defaults, local_epochs=epochs)
    train_local(model, dataset.x_train, dataset.y_train, settings, None, device, seed)
    return evaluate(model, dataset.x_test, dataset.y_test, device)
