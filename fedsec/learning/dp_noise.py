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
from dataclasses import dataclass
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

#: Noise values a CPU thread computes at a time, and threads computing them. A block's
#: words and float32 scratch (1.1 MiB) stay in L2 between the 19 passes over them, where
#: passes over whole tensors go to memory each time (ResNet-18's 11.2M values a step:
#: 0.48 s in whole-tensor passes, 0.14-0.24 s in blocks of 2^14, under load). The CPU
#: passes are numpy's: torch's float kernels start their OpenMP team on every call of
#: a few thousand elements, and on this shared 2-core machine a call on a block waited
#: milliseconds for it (log1p of 16K values: 6 ms against numpy's 0.01 ms).
NOISE_BLOCK = 1 << 14
MAX_NOISE_THREADS = 2

#: A block's values are rounded up to a multiple of this (the stream continues past the
#: tensor and the extra values are dropped), so every vectorised pass covers whole SIMD
#: registers (AVX-512: 16 float32, twice unrolled) and no element takes a scalar path
#: whose last bit could differ from the vector one.
_NOISE_LANES = 64

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


@dataclass(frozen=True)
class _Precision:
    """How noise in ``dtype`` (torch's ``dtype_torch``) reads the stream: words of
    ``word`` (torch holds them as the signed ``word_torch`` of that width), a radius's
    uniform from a word's low ``radius_bits``, an angle's from its low ``angle_bits``."""

    dtype: type[np.floating[Any]]
    dtype_torch: torch.dtype
    word: type[np.unsignedinteger[Any]]
    word_torch: torch.dtype
    radius_bits: int
    angle_bits: int


#: float32 noise reads 32-bit words: an angle takes 24 bits (the mantissa's, so the
#: uniform is exact), a radius the whole word, so the normal's tail reaches 6.66 instead
#: of 5.77 (see :func:`secure_gaussian`); float64 noise reads 64-bit words, 53 bits for
#: both. Narrower parameter dtypes (float16, bfloat16) get float32 noise rounded to them.
_FLOAT32 = _Precision(np.float32, torch.float32, np.uint32, torch.int32, 32, 24)
_FLOAT64 = _Precision(np.float64, torch.float64, np.uint64, torch.int64, 53, 53)


def secure_gaussian(seed: bytes, domain: bytes, std: float, like: torch.Tensor) -> torch.Tensor:
    """N(0, std²) noise shaped like ``like``, on its device and in its dtype: the sum of
    4 standard normals from the AES-CTR stream of ``(seed, domain)``, times ``std / 2``
    (Opacus' secure_mode shape).

    Value j is ``(std/2)·(r₀cos θ₀ + r₁cos θ₁ + r₀sin θ₀ + r₁sin θ₁)``, two Box-Muller
    pairs from the stream's words 4j .. 4j+3 (little-endian; 32-bit words for float32
    noise, 64-bit for float64), m a word's low k bits: r₀, r₁ = √(-2 ln x) of words 4j
    and 4j+1, x = (m + 1)·2^-k with k = 32 (the whole word; m and then m + 1 rounded to
    float32, exact below 2^24, where the tail is) or 53; θ₀, θ₁ = 2π·m·2^-k of
    words 4j+2 and 4j+3 with k = 24 (exact in float32) or 53. x is at least 2^-k, so ln
    never sees 0, and a radius is at most √(2k ln 2): 6.66 at k = 32, 8.57 at k = 53.
    Each step is one operation rounded to the noise's dtype, in the order of
    :func:`_normals_sum`.

    Why float32 suffices for float32 parameters: Opacus' secure_mode draws in the
    parameter's own dtype, with torch's float32 Box-Muller (24-bit uniforms) and float32
    log, cos and sin, and the 4-normal sum (Holohan and Braghin, 2021) is its defence
    against the floating-point attack at that precision. float32 log, sin and cos err by
    at most a few units in the last place, about 10⁻⁷ of a value, and the noise is
    rounded to float32 when it is added to the float32 gradient anyway. What the
    precision does bound is the tail: a value is at most √2·(largest radius) standard
    deviations, so an output one neighbouring dataset's noise can reach and the other's
    cannot needs a coordinate beyond that bound less Δ/σ = 1/z. With the whole
    sensitivity on one coordinate (the worst case), numerical integration of the sum's
    law gives that 5.4·10⁻¹⁴ a step at noise multiplier z = 0.5 and 10⁻¹⁷ at z = 1 with
    32-bit radii; with 24-bit ones (torch's float32 normals) 3.4·10⁻¹⁰ and 2.2·10⁻¹³, which
    over 10⁵ steps would reach a δ of 10⁻⁵. So radii take the whole word: the same
    keystream, one more pass. float64 parameters keep 53 bits and float64 math.

    The values are a function of (seed, domain, std, shape, dtype) and of the processor
    that computes them: bit for bit the same on one machine whatever the blocks and
    threads (each value depends on its own 4 words alone, and every operation is
    element-wise; tested against one pass over the whole tensor), while a CPU with other
    SIMD code, or a GPU, may round the last bit of a logarithm, sine or cosine
    differently. Nothing compares noise across machines bit for bit: torchrun's rank 0
    alone draws a step's noise, and the audit judges updates statistically.

    On the CPU the values are computed with numpy's SIMD loops in blocks of
    :data:`NOISE_BLOCK` on up to :data:`MAX_NOISE_THREADS` threads, each block's words
    drawn at its own offset of the stream (:func:`fedsec.crypto.prg.expand_into_at`); on
    a GPU the stream's words are moved to the device and torch computes the whole tensor
    there, the same operations in the same order.
    """
    if std == 0:
        return torch.zeros_like(like)
    precision = _FLOAT64 if like.dtype == torch.float64 else _FLOAT32
    count = like.numel()
    scale = std / math.sqrt(_NOISE_DRAWS)
    if like.device.type == "cpu":
        noise = torch.from_numpy(_cpu_noise(seed, domain, count, scale, precision))
    else:
        noise = _device_noise(seed, domain, count, scale, precision, like.device)
    return noise.to(dtype=like.dtype).view_as(like)


def _padded(count: int) -> int:
    return -(-count // _NOISE_LANES) * _NOISE_LANES


def _cpu_noise(
    seed: bytes, domain: bytes, count: int, scale: float, precision: _Precision
) -> np.ndarray:
    """:func:`secure_gaussian`'s values on the CPU, a block at a time on threads."""
    out = np.empty(count, dtype=precision.dtype)
    starts = range(0, count, NOISE_BLOCK)
    threads = min(MAX_NOISE_THREADS, len(starts), os.cpu_count() or 1)

    def blocks(lane: int) -> None:
        # the thread's blocks, interleaved with the other threads', in its own buffers
        size = _padded(min(count, NOISE_BLOCK))
        words = np.empty((size, _NOISE_DRAWS), dtype=precision.word)
        draws = np.empty((_NOISE_DRAWS, size), dtype=precision.word)
        work = np.empty((2 * _NOISE_DRAWS + 1, size), dtype=precision.dtype)
        for start in starts[lane::threads]:
            stop = min(count, start + NOISE_BLOCK)
            n = _padded(stop - start)
            prg.expand_into_at(seed, domain, _NOISE_DRAWS * start, words[:n])
            total = _normals_sum(np, words[:n], draws[:, :n], precision, scale, work[:, :n])
            out[start:stop] = total[: stop - start]

    if threads <= 1:
        blocks(0)
    else:
        # numpy releases the GIL in its loops and cryptography in the cipher
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(blocks, range(threads)))
    return out


def _device_noise(
    seed: bytes,
    domain: bytes,
    count: int,
    scale: float,
    precision: _Precision,
    device: torch.device,
) -> torch.Tensor:
    """:func:`secure_gaussian`'s values computed by torch on ``device``, the whole
    tensor at once (the stream itself is drawn on the CPU, where AES-NI is)."""
    n = _padded(count)
    words = torch.empty((n, _NOISE_DRAWS), dtype=precision.word_torch)
    prg.expand_into_at(seed, domain, 0, words.numpy().view(precision.word))
    # int64 on the device: a 32-bit word's radius bits are its unsigned value, which the
    # signed int32 torch holds it in cannot be
    wide = words.to(device).to(torch.int64)
    draws = torch.empty((_NOISE_DRAWS, n), dtype=torch.int64, device=device)
    work = torch.empty((2 * _NOISE_DRAWS + 1, n), dtype=precision.dtype_torch, device=device)
    total: torch.Tensor = _normals_sum(torch, wide, draws, precision, scale, work)
    return total[:count]


def _normals_sum(
    xp: Any, words: Any, draws: Any, precision: _Precision, scale: float, work: Any
) -> Any:
    """``scale`` times the sum of the 4 normals of each value of :func:`secure_gaussian`,
    from its row of 4 ``words`` (unsigned or non-negative), by ``xp`` (numpy on its
    arrays, or torch on its tensors: the same element-wise operations, each rounded once
    in ``work``'s dtype, Python scalars taking that dtype): the last row of ``work`` (9
    rows as long as ``words``, its scratch; ``draws``, 4 rows of ``words``' dtype, is the
    scratch that turns them to rows)."""
    # one row per draw, so every pass below runs over contiguous rows
    draws[...] = words.T
    radius_words, angle_words = draws[:2], draws[2:]
    xp.bitwise_and(radius_words, (1 << precision.radius_bits) - 1, out=radius_words)
    xp.bitwise_and(angle_words, (1 << precision.angle_bits) - 1, out=angle_words)
    uniform, cosine, sine, total = work[:4], work[4:6], work[6:8], work[8]
    uniform[...] = draws  # angles exact (m < 2^angle_bits), 32-bit radii rounded
    radius, angle = uniform[:2], uniform[2:]  # rows: of pair 0, of pair 1
    xp.add(radius, 1.0, out=radius)
    xp.multiply(radius, 2.0**-precision.radius_bits, out=radius)  # x >= 2^-bits, <= 1
    xp.log(radius, out=radius)  # never of 0
    xp.multiply(radius, -2.0, out=radius)
    xp.sqrt(radius, out=radius)
    xp.multiply(angle, 2.0 * math.pi * 2.0**-precision.angle_bits, out=angle)
    xp.cos(angle, out=cosine)
    xp.sin(angle, out=sine)
    xp.multiply(cosine, radius, out=cosine)  # rows: the normals of pair 0, of pair 1
    xp.multiply(sine, radius, out=sine)
    xp.add(cosine[0], cosine[1], out=total)
    xp.add(total, sine[0], out=total)
    xp.add(total, sine[1], out=total)
    xp.multiply(total, scale, out=total)
    return total
