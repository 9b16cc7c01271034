"""DP-SGD noise from fedsec's CSPRNG: Opacus' ``PrivacyEngine`` and ``DPOptimizer`` (flat
clipping, one process) with every Gaussian drawn from the AES-256-CTR keystream of
:mod:`fedsec.crypto.prg`, in Opacus' ``secure_mode`` shape (why: the docstring of
:mod:`fedsec.learning.training`); and their distributed forms, where rank 0 of a
torchrun job adds that same noise once per step (:mod:`fedsec.learning.workers`)."""

from __future__ import annotations

import math
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from opacus import PrivacyEngine
from opacus.optimizers import DistributedDPOptimizer, DPOptimizer
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed
from opacus.validators.errors import UnsupportedModuleError
from torch.utils.data import DataLoader

from fedsec.crypto import prg
from fedsec.errors import ConfigError

#: The PRG domain of the noise streams (one per optimiser step and parameter).
_NOISE_STREAM_DOMAIN = b"dp-sgd-noise"

#: Noise values computed per block, and threads computing blocks: 2^16 values keep a
#: block's float64 temporaries (8 arrays of 512 KiB) in cache; 11.2M values (ResNet-18)
#: took 1.6 s in one pass over whole arrays, dominating a DP-SGD step on the CPU.
NOISE_BLOCK = 1 << 16
MAX_NOISE_THREADS = 2

#: Standard normals summed per noise value: Opacus' secure_mode (2n draws with n = 2, the
#: least that defeats the floating-point attack on the Gaussian mechanism).
_NOISE_DRAWS = 4


class CsprngPrivacyEngine(PrivacyEngine):  # type: ignore[misc]  # opacus is untyped
    """Opacus' ``PrivacyEngine`` whose optimiser is :class:`CsprngNoiseOptimizer`."""

    #: Whether the engine prepares a ``DPDDP`` module's optimiser (torchrun workers) or
    #: one process's; the optimiser class that adds the CSPRNG noise in that setting.
    _distributed = False
    _what = "flat clipping in one process"

    def __init__(self, noise_seed: bytes) -> None:
        super().__init__(accountant="rdp")
        self._noise_seed = noise_seed

    def _optimizer_class(self) -> type[DPOptimizer]:
        return CsprngNoiseOptimizer

    def _prepare_optimizer(
        self,
        *,
        optimizer: torch.optim.Optimizer,
        noise_multiplier: float,
        max_grad_norm: float,
        expected_batch_size: float,
        loss_reduction: str = "mean",
        distributed: bool = False,
        clipping: str = "flat",
        noise_generator: torch.Generator | None = None,
        grad_sample_mode: str = "hooks",
        **kwargs: Any,
    ) -> DPOptimizer:
        """Raises:
        ConfigError: a setting the CSPRNG noise does not cover (fedsec's training asks
            for none of them).
        """
        if (
            distributed != self._distributed
            or clipping != "flat"
            or grad_sample_mode != "hooks"
            or noise_generator
        ):
            raise ConfigError(
                f"CSPRNG noise covers {self._what}, with no noise generator; asked for "
                f"distributed={distributed}, clipping={clipping!r}, "
                f"grad_sample_mode={grad_sample_mode!r}"
            )
        if isinstance(optimizer, DPOptimizer):
            optimizer = optimizer.original_optimizer
        return self._optimizer_class()(
            optimizer,
            self._noise_seed,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size,
            loss_reduction=loss_reduction,
            **kwargs,
        )


class CsprngNoiseOptimizer(DPOptimizer):  # type: ignore[misc]  # opacus is untyped
    """Opacus' ``DPOptimizer`` (flat clipping, one process) whose Gaussian noise comes from
    the AES-CTR keystream instead of a torch generator (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, noise_seed: bytes, **kwargs: Any):
        super().__init__(optimizer, **kwargs)
        self._noise_seed = noise_seed
        self._noise_draws = 0

    def add_noise(self) -> None:
        """Opacus' ``add_noise`` with the noise of :func:`secure_gaussian`."""
        std = self.noise_multiplier * self.max_grad_norm
        for index, p in enumerate(self.params):
            _check_processed_flag(p.summed_grad)
            domain = b"%s/%d/%d" % (_NOISE_STREAM_DOMAIN, self._noise_draws, index)
            noise = secure_gaussian(self._noise_seed, domain, std, p.summed_grad)
            p.grad = (p.summed_grad + noise).view_as(p)
            _mark_as_processed(p.summed_grad)
        self._noise_draws += 1


class CsprngDistributedNoiseOptimizer(DistributedDPOptimizer, CsprngNoiseOptimizer):  # type: ignore[misc]
    """Opacus' ``DistributedDPOptimizer`` (each rank clips its own records' gradients, the
    clipped sums are all-reduced, rank 0 alone adds the noise before the reduce) with
    :class:`CsprngNoiseOptimizer`'s noise: rank 0 draws the very streams one process
    draws with the same seed, so the step's noise is added once and is one process's."""

    def __init__(self, optimizer: torch.optim.Optimizer, noise_seed: bytes, **kwargs: Any):
        # DistributedDPOptimizer passes what it does not take on to CsprngNoiseOptimizer
        super().__init__(optimizer, noise_seed=noise_seed, **kwargs)


class CsprngDistributedPrivacyEngine(CsprngPrivacyEngine):
    """:class:`CsprngPrivacyEngine` for a module wrapped in Opacus' ``DPDDP``: its
    optimiser is :class:`CsprngDistributedNoiseOptimizer`."""

    _distributed = True
    _what = "flat clipping of a DPDDP module"

    def _optimizer_class(self) -> type[DPOptimizer]:
        return CsprngDistributedNoiseOptimizer


def make_private(
    engine_class: type[CsprngPrivacyEngine],
    noise_seed: bytes,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader[Any],
    noise_multiplier: float,
    max_grad_norm: float,
    *,
    poisson_sampling: bool,
) -> tuple[PrivacyEngine, torch.nn.Module, DPOptimizer, DataLoader[Any]]:
    """Opacus' private model, optimiser and loader for ``module``, with the noise of an
    ``engine_class`` seeded by ``noise_seed``: the engine, then what ``make_private``
    returns.

    Raises:
        ConfigError: a model Opacus cannot train.
    """
    with warnings.catch_warnings():
        # Opacus warns that secure_mode is off; the noise is drawn from a CSPRNG here
        # instead (see the module docstring) and the warning would repeat every round.
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        engine = engine_class(noise_seed)
    try:
        trained, private_optimizer, private_loader = engine.make_private(
            module=module,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            poisson_sampling=poisson_sampling,
        )
    except UnsupportedModuleError as exc:
        raise ConfigError(f"model cannot be trained with DP-SGD: {exc}") from exc
    return engine, trained, private_optimizer, private_loader


def secure_gaussian(seed: bytes, domain: bytes, std: float, like: torch.Tensor) -> torch.Tensor:
    """N(0, std²) noise shaped like ``like``: the sum of 4 standard normals from the
    AES-CTR stream of ``(seed, domain)``, times ``std / 2`` (Opacus' secure_mode shape).

    Value j of ``count`` sums the Box-Muller normals j and count + j of the cosine half
    and of the sine half, from the 53-bit uniforms ``u`` of the stream's words: radii
    from ``u[:2·count]``, angles from ``u[2·count:]``. Large tensors are computed in
    blocks of :data:`NOISE_BLOCK` values on :data:`MAX_NOISE_THREADS` threads (numpy
    releases the GIL), the same element-wise operations in the same order, so the
    values are bit-identical to one pass over the whole tensor (tested); the blocks keep
    the float64 temporaries in cache instead of 8 arrays of 32·count bytes.
    """
    if std == 0:
        return torch.zeros_like(like)
    count = like.numel()
    half = (count * _NOISE_DRAWS + 1) // 2
    words = prg.expand(seed, domain, 2 * half, np.uint64) >> np.uint64(11)
    summed = np.empty(count, dtype=np.float64)
    scale = std / math.sqrt(_NOISE_DRAWS)
    starts = range(0, count, NOISE_BLOCK)
    threads = min(MAX_NOISE_THREADS, len(starts), os.cpu_count() or 1)

    def block(start: int) -> None:
        _gaussian_block(words, count, start, min(count, start + NOISE_BLOCK), scale, summed)

    if threads <= 1:
        for start in starts:
            block(start)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(block, starts))
    return torch.from_numpy(summed).to(dtype=like.dtype, device=like.device).view_as(like)


def _gaussian_block(
    words: np.ndarray, count: int, lo: int, hi: int, scale: float, out: np.ndarray
) -> None:
    """Values ``lo..hi`` of :func:`secure_gaussian` into ``out`` (``words``: the
    stream's words shifted to 53 bits, ``4·count`` of them)."""
    half = 2 * count

    def uniform(first: int) -> np.ndarray:
        # 53-bit uniforms on (0, 1]: log never sees 0
        return (words[first + lo : first + hi].astype(np.float64) + 1.0) * 2.0**-53

    radius_a = np.sqrt(-2.0 * np.log(uniform(0)))
    radius_b = np.sqrt(-2.0 * np.log(uniform(count)))
    angle_a = (2.0 * math.pi) * uniform(half)
    angle_b = (2.0 * math.pi) * uniform(half + count)
    total = radius_a * np.cos(angle_a)
    total += radius_b * np.cos(angle_b)
    total += radius_a * np.sin(angle_a)
    total += radius_b * np.sin(angle_b)
    total *= scale
    out[lo:hi] = total
