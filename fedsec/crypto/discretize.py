"""Distributed DP in the SecAgg+ ring: rotate, scale, round, add a noise share, wrap.

Every member of a round turns its float vector x (L2 norm clipped to c) into ring
elements the same way, following the Distributed Discrete Gaussian / Skellam pipeline
(Kairouz, Liu, Steinke, ICML 2021; Agarwal, Kairouz, Liu, NeurIPS 2021; TensorFlow
Federated's ``DistributedDpSumFactory``):

1. **rotate** with the round's shared randomised Hadamard transform
   (:mod:`fedsec.crypto.rotation`), padding to N = 2^⌈log₂ d⌉ coordinates;
2. **scale** by γ;
3. **round** each coordinate stochastically (up with probability equal to its
   fractional part, so unbiased) and *conditionally*: a draw whose rounding error has
   L2 norm above ``rounding_bound`` is drawn again, so the error is bounded for every
   outcome;
4. **add a noise share**: Skellam noise (the difference of two Poisson variables; a sum
   of independent Skellam variables is Skellam again, so the shares add up to exactly
   the target distribution) of variance ``share_variance``, from the AES-CTR keystream
   (:mod:`fedsec.crypto.prg`);
5. **wrap** modulo 2^m into the SecAgg+ ring (modular clipping).

After unmasking, the aggregator **recentres** the ring sum into (−2^(m−1), 2^(m−1)],
divides by γ and **unrotates** (:func:`decode_sum`).

Privacy unit and sensitivity.  ``sensitivity`` (C) is how far one unit of privacy can
move a member's float vector: one record's clipped gradient at record level, the whole
clipped update (C = c) at member level.  After scaling and rounding, two neighbouring
inputs differ by at most Δ₂ = γ·C + 2·rounding_bound in L2 (the rounding errors of both
are bounded by step 3).  The noise of the sum has standard deviation z·Δ₂ once at least
``min_survivors`` members added their share (each adds variance (z·Δ₂)²/min_survivors,
so more survivors only add noise), i.e. the sum is the Skellam mechanism with noise
multiplier z.  Rényi divergence is jointly quasi-convex, so mixing over the rounding
draws does not weaken the bound.  Skellam's RDP exceeds the Gaussian mechanism's by a
term of order Δ₁/μ² (Agarwal et al., Thm 3.5); with the variances chosen here (μ in
the thousands or more) the accountant treats it as the Gaussian mechanism of the same
noise multiplier, which is the approximation the reference implementation's
accountant makes as well.

Bit budget.  γ is the largest scale for which the sum of ``max_members`` members stays
within ``wrap_stddevs`` (k) standard deviations of the ring's half-range 2^(m−1), using
the worst case ‖Σx‖ ≤ n·c (aligned updates) and the sub-Gaussian tail of a rotated
coordinate; it is capped where rounding adds only 1 % to the sensitivity, since a larger
γ only makes the noise table bigger.  :class:`DdpSpec` refuses a ring that cannot reach
γ·C ≥ 2·rounding_bound / (MAX_INFLATION − 1), and it checks 2^(2b) ≥ n·k² for the bits
b = m − ⌈log₂ n⌉ left to each member.  A coordinate of the sum wraps with probability
at most 2·exp(−k²/2) (:meth:`DdpSpec.wrap_bound`).

Noise sampling is exact inversion of 53-bit uniforms against a float64 CDF table of the
Skellam distribution over ±(10σ + 2); mass beyond that (< 2^-53 per coordinate) is
never produced, which adds at most d·2^-53 to δ.  Rounding compares 53-bit uniforms with
the fractional parts.  Both draw 32-bit words and complete a uniform with 21 more bits
only where the word cannot decide (rarely: a guide-table bucket across a CDF step, a
word equal to the fraction's top 32 bits), so the values are those of 53-bit uniforms at
about half the keystream.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import numpy.typing as npt
from scipy import special

from fedsec.crypto import prg
from fedsec.crypto.errors import QuantizationError
from fedsec.crypto.quantize import RingVector, ring_dtype
from fedsec.crypto.rotation import padded_length, rotate, unrotate

# Integers pass through float64 on the way into the ring: 2^52 keeps every value exact.
MAX_DDP_RING_BITS = 52
# A coordinate of the sum wraps with probability ≤ 2·exp(−k²/2): 6.7e-4 at k = 4, the
# reference implementation's default.
DEFAULT_WRAP_STDDEVS = 4.0
# Rounding may add at most this factor to the sensitivity before a spec is refused: the
# noise grows by the same factor, and above a quarter more the ring is plainly too small.
MAX_INFLATION = 1.25
# γ is never raised beyond the point where rounding adds 1 % to the sensitivity: more
# scale buys no accuracy, only a larger noise table.
TARGET_INFLATION = 1.01
# Conditional rounding: the error bound is exceeded with probability ≤ this per draw
# (Hoeffding), so 64 draws fail together with probability ≤ 1e-192.
ROUNDING_FAILURE = 1e-3
MAX_ROUNDING_TRIES = 64
# Skellam table: ±(10σ + 2) integers; 2^24 entries (128 MB of float64) is the largest
# table a member builds.
NOISE_TAIL_STDDEVS = 10.0
MAX_NOISE_TABLE = 1 << 24
# Guide table for inversion: 2^20 buckets on a uniform's top bits (cached per variance),
# int16 where the table's values fit (2 MB: lookups at random stay nearer the core),
# else int32.  A bucket inside one step of the CDF answers alone; for the noise of the
# 100-member, 16-bit-ring benchmark (σ ≈ 800) under 1 % of the buckets straddle a step.
GUIDE_BITS = 20
# Largest variance whose table the Bessel function gives: scipy's ive (AMOS) returns NaN
# for arguments above 2^30.  A larger variance is drawn as the sum of equal parts at most
# this (exact: Skellam variables add); 2^29 leaves a factor of two of margin.
MAX_TABLE_VARIANCE = float(1 << 29)
# Uniforms are drawn as 32-bit words W; the 53-bit uniform W·2^21 + L is completed with a
# second word (its top 21 bits L) only where W alone cannot decide, which halves the
# keystream against drawing 53 bits for every value.
_WORD_BITS = 32
_LOW_BITS = 53 - _WORD_BITS
# A guide entry whose bucket straddles a step is its dtype's minimum: no Skellam value a
# table of that dtype holds (|k| ≤ K < MAX_NOISE_TABLE, and K < 2^15 − 1 for int16).
_GUIDE_DTYPES = (np.dtype(np.int16), np.dtype(np.int32))
_ROUNDING_DOMAIN = b"ddp/rounding/"
_NOISE_DOMAIN = b"ddp/noise"

FloatVector = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class DdpSpec:
    """How a round discretises: every member and the aggregator derive the same γ.

    Attributes:
        dim: d, the vector length before padding.
        ring_bits: m, the SecAgg+ ring Z_{2^m}.
        clip: c, the L2 bound of one member's vector.
        sensitivity: C, the L2 change one unit of privacy makes (≤ c).
        noise_multiplier: z; the sum's noise has standard deviation z·Δ₂ (0 = no noise).
        min_survivors: the fewest members the round may close with; noise is sized so
            that this many shares already make the full noise.
        max_members: the most members whose vectors may be summed (sizes the ring).
        wrap_stddevs: k.

    Raises (on construction):
        QuantizationError: a value out of range, or a bit budget the ring cannot meet
            (the message says which and why).
    """

    dim: int
    ring_bits: int
    clip: float
    sensitivity: float
    noise_multiplier: float
    min_survivors: int
    max_members: int
    wrap_stddevs: float = DEFAULT_WRAP_STDDEVS

    def __post_init__(self) -> None:
        self._check_values()
        self._check_budget()

    def _check_values(self) -> None:
        if not 2 <= self.ring_bits <= MAX_DDP_RING_BITS:
            raise QuantizationError(
                f"distributed DP needs ring bits in 2..{MAX_DDP_RING_BITS}, got {self.ring_bits}"
            )
        for name, value in (("clip", self.clip), ("sensitivity", self.sensitivity)):
            if not (math.isfinite(value) and value > 0):
                raise QuantizationError(f"{name} must be a positive number, got {value}")
        if self.sensitivity > self.clip * (1 + 1e-12):
            raise QuantizationError(
                f"sensitivity {self.sensitivity} exceeds the vector clip {self.clip}"
            )
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            raise QuantizationError(
                f"noise multiplier must be a non-negative number, got {self.noise_multiplier}"
            )
        if not 1 <= self.min_survivors <= self.max_members:
            raise QuantizationError(
                f"need 1 <= min_survivors ({self.min_survivors}) <= "
                f"max_members ({self.max_members})"
            )
        if not (math.isfinite(self.wrap_stddevs) and self.wrap_stddevs >= 1):
            raise QuantizationError(f"wrap_stddevs must be at least 1, got {self.wrap_stddevs}")
        padded_length(self.dim)

    def _check_budget(self) -> None:
        n, k, m = self.max_members, self.wrap_stddevs, self.ring_bits
        headroom = math.ceil(math.log2(n)) if n > 1 else 0
        b = m - headroom
        if b < 1 or 4.0**b < n * k * k:
            raise QuantizationError(
                f"a {m}-bit ring leaves {b} bits per member after the {headroom} bits "
                f"{n} members need, and 2^(2b) must be at least n·k² = {n * k * k:g}: "
                "raise the quantization bits or lower the number of members"
            )
        inflation = self.inflation
        if inflation > MAX_INFLATION:
            raise QuantizationError(
                f"a {m}-bit ring cannot hold the sum of {n} members within {k:g} standard "
                f"deviations at a scale where rounding stays small: rounding would add "
                f"{100 * (inflation - 1):.0f} % to the sensitivity (at most "
                f"{100 * (MAX_INFLATION - 1):.0f} %); raise the quantization bits, lower "
                "the number of members or the noise"
            )
        if self.noise_multiplier > 0 and _table_half_width(self.share_variance) * 2 + 1 > (
            MAX_NOISE_TABLE
        ):
            raise QuantizationError(
                f"a noise share of standard deviation {math.sqrt(self.share_variance):.3g} "
                "needs a sampling table beyond the limit; lower the ring bits"
            )

    @property
    def padded(self) -> int:
        """N, the rotated length."""
        return padded_length(self.dim)

    @property
    def rounding_bound(self) -> float:
        """Bound on the L2 norm of one member's rounding error (Hoeffding at
        ROUNDING_FAILURE: each squared coordinate error lies in [0, 1], mean ≤ 1/4)."""
        n = self.padded
        return math.sqrt(n / 4 + math.sqrt(n * math.log(1 / ROUNDING_FAILURE) / 2))

    @property
    def scale(self) -> float:
        """γ: the largest scale that fits the ring (see the module doc), capped at the
        point where rounding adds TARGET_INFLATION − 1 to the sensitivity."""
        return min(self._ring_scale(), self._target_scale())

    def _target_scale(self) -> float:
        return 2 * self.rounding_bound / (self.sensitivity * (TARGET_INFLATION - 1))

    def _ring_scale(self) -> float:
        # k·std(γ) ≤ 2^(m−1), with std² = γ²S² + ρ·z²(γC + 2e)² + n/4: a quadratic in γ.
        n, k = self.max_members, self.wrap_stddevs
        s2 = (n * self.clip) ** 2 / self.padded
        rho = n / self.min_survivors
        z2, c, e = self.noise_multiplier**2, self.sensitivity, self.rounding_bound
        r2 = (2.0 ** (self.ring_bits - 1) / k) ** 2
        a = s2 + rho * z2 * c * c
        b = 4 * rho * z2 * c * e
        const = 4 * rho * z2 * e * e + n / 4 - r2
        disc = b * b - 4 * a * const
        if const >= 0 or disc <= 0:
            return 0.0
        return (-b + math.sqrt(disc)) / (2 * a)

    @property
    def l2_sensitivity(self) -> float:
        """Δ₂ in ring units: γ·C + 2·rounding_bound."""
        return self.scale * self.sensitivity + 2 * self.rounding_bound

    @property
    def inflation(self) -> float:
        """Δ₂ / (γ·C): what rounding adds to the sensitivity (∞ if γ is 0)."""
        gc = self.scale * self.sensitivity
        return self.l2_sensitivity / gc if gc > 0 else math.inf

    @property
    def share_variance(self) -> float:
        """Each member's Skellam variance: (z·Δ₂)² / min_survivors (ring units)."""
        return (self.noise_multiplier * self.l2_sensitivity) ** 2 / self.min_survivors

    def noise_stddev(self, survivors: int) -> float:
        """Standard deviation of the sum's noise, in the vector's own units, when
        ``survivors`` members added their share: at least z·Δ₂/γ once survivors ≥
        min_survivors."""
        return math.sqrt(survivors * self.share_variance) / self.scale

    def effective_noise_multiplier(self, survivors: int) -> float:
        """The realised noise of the sum relative to the sensitivity C (what the
        accountant may use): z·√(survivors/min_survivors)·Δ₂/(γ·C) ≥ z."""
        return self.noise_stddev(survivors) / self.sensitivity

    def wrap_bound(self) -> float:
        """Upper bound on the probability that one coordinate of the sum wraps."""
        return min(1.0, 2 * math.exp(-(self.wrap_stddevs**2) / 2))


@dataclass(frozen=True, slots=True)
class Encoded:
    """One member's ring vector and what happened on the way."""

    ring: RingVector
    # before wrapping, if asked for (a simulation's wrap count); else None
    integers: npt.NDArray[np.int64] | None
    rounding_draws: int  # 1 unless the conditional rounding drew again
    clipped: bool  # the vector's norm was above the clip


def encode(
    x: npt.ArrayLike,
    spec: DdpSpec,
    shared_seed: bytes,
    secret_seed: bytes,
    *,
    integers: bool = False,
) -> Encoded:
    """Clip, rotate, scale, round, add a noise share and wrap ``x`` into the ring.

    Args:
        x: the member's float vector (``spec.dim`` values, any shape); not modified.
            float32 values are used as they are (they widen exactly).
        spec: the round's discretisation.
        shared_seed: 32 bytes every member shares (the rotation).
        secret_seed: 32 fresh secret bytes of this member (rounding and noise).  Anyone
            who knows it can subtract the noise share: never reuse or reveal it.
        integers: also return the integers before wrapping (a copy: only a simulation,
            which can sum them exactly, has a use for them).

    Returns:
        :class:`Encoded` with ``spec.padded`` ring elements in the ring's dtype.

    Raises:
        QuantizationError: wrong length or non-finite values; rounding that fails
            MAX_ROUNDING_TRIES times (probability ≤ 1e-192).
        ValueError: a seed is not 32 bytes.
    """
    from fedsec.crypto import kernels  # numba: imported by processes that discretise

    flat = np.asarray(x).reshape(-1)
    if flat.dtype != np.float32:
        flat = flat.astype(np.float64, copy=False)
    if flat.size != spec.dim:
        raise QuantizationError(f"vector must have {spec.dim} values, got {flat.size}")
    # the squared norm (in float64 whatever the input) finds any NaN or ±inf (they reach
    # the sum); only an overflowing square of finite values needs the full check
    squared = kernels.squared_norm(flat)
    if not math.isfinite(squared) and not np.all(np.isfinite(flat)):
        raise QuantizationError("vector contains NaN or infinite values")
    norm = math.sqrt(squared)
    clipped = norm > spec.clip
    factor = spec.scale * (spec.clip / norm if clipped else 1.0)
    with _workspace(spec.padded) as work:
        scaled = rotate(flat, shared_seed, scale=factor, out=work.y, finite=True)
        variance = spec.share_variance if spec.noise_multiplier > 0 else 0.0
        ints, ring, draws = _discretise(
            scaled, spec.rounding_bound, secret_seed, spec.ring_bits, variance, work
        )
        return Encoded(ring, ints.copy() if integers else None, draws, clipped)


class _Workspace:
    """Encoder buffers for one padded length: the rotated vector, the integers, the
    keystream words and the open-bucket indices.

    Allocated afresh for each encoding they would fault in some 30 MB of new pages at
    d = 2^20, which costs about as much as the encoding.  Every use writes them before
    it reads them, so nothing of one encoding reaches the next; what a caller gets back
    (the ring vector, a copy of the integers) is its own."""

    def __init__(self) -> None:
        self.size = -1

    def get(self, n: int) -> _Workspace:
        if n != self.size:
            self.y = np.empty(n, dtype=np.float64)
            self.ints = np.empty(n, dtype=np.int64)
            self.round_words = np.empty(n, dtype="<u4")
            self.noise_words = np.empty(n, dtype="<u4")
            self.opens = np.empty(n, dtype=np.int64)
            self.size = n
        return self


# One kept workspace per process (the last length encoded): a process's memory holds
# at most one, however many threads encode.  An encoding that finds it in use gets
# buffers of its own, freed when it returns.
_SHARED = _Workspace()
_SHARED_LOCK = threading.Lock()


@contextmanager
def _workspace(n: int) -> Iterator[_Workspace]:
    if not _SHARED_LOCK.acquire(blocking=False):
        yield _Workspace().get(n)
        return
    try:
        yield _SHARED.get(n)
    finally:
        _SHARED_LOCK.release()


def _conditional_round(
    y: FloatVector, bound: float, seed: bytes
) -> tuple[npt.NDArray[np.int64], int]:
    """(integers, draws): :func:`_discretise` without noise."""
    ints, _, draws = _discretise(y, bound, seed, MAX_DDP_RING_BITS, 0.0, _Workspace().get(y.size))
    return ints, draws


def _discretise(
    y: FloatVector, bound: float, seed: bytes, ring_bits: int, variance: float, work: _Workspace
) -> tuple[npt.NDArray[np.int64], RingVector, int]:
    """Round ``y`` (not modified) stochastically and conditionally, add Skellam noise of
    ``variance`` (none if 0) and wrap into Z_{2^ring_bits}: (integers, ring, draws).
    The integers are ``work.ints``; the ring vector is new.

    Rounding is unbiased, and drawn again while the error's L2 norm exceeds ``bound``.
    A coordinate rounds up when u < frac for a 53-bit uniform u = (W·2^21 + L)/2^53:
    with t = ⌊frac·2^32⌋ the word W decides alone unless W = t (probability 2^-32),
    and only there is L drawn, so the rule is exactly that of 53-bit uniforms.  The
    noise is :func:`skellam`'s, value for value (:func:`_add_skellam`, which also
    wraps).  The rounding is one compiled pass
    (:func:`fedsec.crypto.kernels.round_draw`); the rare ties are decided here."""
    from fedsec.crypto import kernels  # numba: imported by processes that discretise

    ints, words = work.ints, work.round_words
    for draw in range(1, MAX_ROUNDING_TRIES + 1):
        domain = _ROUNDING_DOMAIN + str(draw).encode()
        prg.expand_into(seed, domain, words)
        total, ties = kernels.round_draw(y, words, ints)
        if ties:
            total += _decide_ties(y, words, ints, seed, domain)
        if total <= bound * bound:
            break
    else:
        raise QuantizationError(
            f"conditional rounding exceeded its error bound {MAX_ROUNDING_TRIES} times"
        )
    if variance == 0:
        return ints, to_ring(ints, ring_bits), draw
    ring = np.empty(y.size, dtype=ring_dtype(ring_bits))
    _add_skellam(ints, seed, variance, work.noise_words, work.opens, ring, ring_bits)
    return ints, ring, draw


def _decide_ties(
    y: FloatVector,
    words: npt.NDArray[np.uint32],
    ints: npt.NDArray[np.int64],
    seed: bytes,
    domain: bytes,
) -> float:
    """Round up the tied coordinates (W = t) whose 21 more bits say so, and return what
    that changes in the squared error (each was counted as rounded down)."""
    frac = y - np.floor(y)
    threshold = np.minimum(frac * float(1 << _WORD_BITS), float((1 << _WORD_BITS) - 1))
    ties = np.flatnonzero(words == threshold.astype(np.uint32))
    low = _low_bits(seed, domain, ties.size)
    # frac·2^53 − t·2^21 ∈ [0, 2^21] is exact (Sterbenz): u < frac ⟺ L < it
    top = np.floor(threshold[ties]) * float(1 << _LOW_BITS)
    up = ties[low < frac[ties] * float(1 << 53) - top]
    ints[up] += 1
    f = frac[up]
    return float(np.sum((1.0 - f) ** 2 - f**2))


def _low_bits(seed: bytes, domain: bytes, count: int) -> npt.NDArray[np.int64]:
    """The low 21 bits L of ``count`` 53-bit uniforms whose top 32 bits could not
    decide, from a stream of their own (the i-th such value takes the i-th word)."""
    words = prg.expand(seed, domain + b"/low", count, np.uint32)
    return (words >> np.uint32(_WORD_BITS - _LOW_BITS)).astype(np.int64)


def uniform53(seed: bytes, domain: bytes, count: int) -> FloatVector:
    """``count`` float64 values uniform on [0, 1) with 53 bits of resolution (exact
    multiples of 2^-53), from the AES-CTR keystream."""
    words = prg.expand(seed, domain, count, np.uint64) >> np.uint64(11)
    return words.astype(np.float64) * (1.0 / (1 << 53))


def _table_half_width(variance: float) -> int:
    return math.ceil(NOISE_TAIL_STDDEVS * math.sqrt(variance)) + 2


@lru_cache(maxsize=8)
def _skellam_table(
    variance: float,
) -> tuple[int, npt.NDArray[np.int64], npt.NDArray[np.signedinteger]]:
    """(K, steps, guide) for Skellam(μ₁ = μ₂ = variance/2), P(k) = e^{−v}·I_k(v), on −K..K.

    ``steps[i] = ⌈CDF(i)·2^53⌉``, so for an integer u53 ``searchsorted(steps, u53,
    "right")`` equals ``searchsorted(cdf, u53/2^53, "right")``: inversion of the uniform
    u53/2^53 against the float64 CDF (capped at 2K: a u above the table's float sum,
    < 1e-15 of the mass, takes the last value).  ``guide[j]`` is that index minus K, the
    variable itself, for every u53 whose top GUIDE_BITS bits are j, or _OPEN where they
    straddle a step."""
    half = _table_half_width(variance)
    ks = np.abs(np.arange(-half, half + 1, dtype=np.float64))
    pmf = special.ive(ks, variance)  # exponentially scaled Bessel: e^{-v} I_|k|(v)
    cdf = np.cumsum(pmf)
    if not (np.all(np.isfinite(pmf)) and abs(float(cdf[-1]) - 1.0) < 1e-9):
        # never sample from a table that is not the distribution: noise is the guarantee
        raise QuantizationError(
            f"the Skellam table for variance {variance:g} is not a distribution "
            f"(mass {float(cdf[-1]):.6g})"
        )
    steps = np.ceil(cdf * float(1 << 53)).astype(np.int64)
    steps.setflags(write=False)
    width = 1 << (53 - GUIDE_BITS)
    starts = np.arange(1 << GUIDE_BITS, dtype=np.int64) * width
    first = np.minimum(np.searchsorted(steps, starts, side="right"), 2 * half)
    last = np.minimum(np.searchsorted(steps, starts + (width - 1), side="right"), 2 * half)
    dtype = next(t for t in _GUIDE_DTYPES if half < np.iinfo(t).max)
    guide: npt.NDArray[np.signedinteger] = np.where(
        first == last, first - half, _open(dtype)
    ).astype(dtype)
    guide.setflags(write=False)
    return half, steps, guide


def _noise_parts(variance: float) -> int:
    """How many equal parts (at most MAX_TABLE_VARIANCE each) ``variance`` is drawn as.

    Raises:
        QuantizationError: variance not positive, or its table beyond MAX_NOISE_TABLE.
    """
    if not (math.isfinite(variance) and variance > 0):
        raise QuantizationError(f"noise variance must be positive, got {variance}")
    if 2 * _table_half_width(variance) + 1 > MAX_NOISE_TABLE:
        raise QuantizationError(f"noise variance {variance:g} needs too large a table")
    return max(1, math.ceil(variance / MAX_TABLE_VARIANCE))


def _add_skellam(
    ints: npt.NDArray[np.int64],
    seed: bytes,
    variance: float,
    words: npt.NDArray[np.uint32],
    opens: npt.NDArray[np.int64],
    ring: RingVector,
    ring_bits: int,
) -> None:
    """ints += Skellam values of ``variance``, one per element (see :func:`skellam`), and
    ring ← ints mod 2^ring_bits; ``words`` and ``opens`` (one element per value) are
    working space for the keystream words and the open-bucket indices.

    Each part is one compiled pass (:func:`fedsec.crypto.kernels.add_noise_and_wrap`:
    the guide lookup and the wrap); the values whose guide bucket is open are completed
    here."""
    from fedsec.crypto import kernels  # numba: imported by processes that discretise

    parts = _noise_parts(variance)
    mask = (1 << ring_bits) - 1
    for part in range(parts):  # |sum| ≤ parts·K_part, far inside int64 under the cap
        domain = _NOISE_DOMAIN + (b"/part/%d" % part if part else b"")
        half, steps, guide = _skellam_table(float(variance / parts))
        prg.expand_into(seed, domain, words)
        count = kernels.add_noise_and_wrap(
            ints, words, guide, _WORD_BITS - GUIDE_BITS, _open(guide.dtype), mask, ring, opens
        )
        if count:  # complete those 53-bit uniforms and search
            open_ = opens[:count]
            ints[open_] += _search(steps, half, words[open_], seed, domain)
            ring[open_] = to_ring(ints[open_], ring_bits)


def _open(dtype: npt.DTypeLike) -> int:
    """The guide's mark for a bucket that straddles a step, in ``dtype``."""
    return int(np.iinfo(dtype).min)


def _search(
    steps: npt.NDArray[np.int64],
    half: int,
    words: npt.NDArray[np.uint32],
    seed: bytes,
    domain: bytes,
) -> npt.NDArray[np.int64]:
    """The Skellam values of uniforms whose top 32 bits (``words``, in stream order) fall
    in an open guide bucket: each completed to 53 bits from ``domain``'s low stream and
    inverted against the CDF steps."""
    u53 = (words.astype(np.int64) << _LOW_BITS) | _low_bits(seed, domain, words.size)
    found: npt.NDArray[np.int64] = np.minimum(np.searchsorted(steps, u53, side="right"), 2 * half)
    return found - half


def skellam(seed: bytes, variance: float, count: int) -> npt.NDArray[np.int64]:
    """``count`` independent Skellam variables of mean 0 and ``variance``, by inversion
    of 53-bit keystream uniforms against the float64 CDF (the values
    ``np.searchsorted(cdf, u, "right") − K`` gives, K the table's half-width).

    A uniform is drawn as a 32-bit word W; the guide table answers from W's top bits
    unless their bucket straddles a step of the CDF, and only there is the 53-bit
    uniform completed with 21 more bits and searched: about one table lookup per value.
    A variance above MAX_TABLE_VARIANCE is drawn as the sum of equal parts below it,
    each from a stream of its own.

    Raises:
        QuantizationError: variance not positive, its table beyond MAX_NOISE_TABLE, or
            a table that does not sum to 1 (never sampled from).
        ValueError: ``seed`` is not 32 bytes.
    """
    values = np.zeros(count, dtype=np.int64)
    words, opens = np.empty(count, dtype="<u4"), np.empty(count, dtype=np.int64)
    ring = np.empty(count, dtype=ring_dtype(MAX_DDP_RING_BITS))  # not used: no wrap here
    _add_skellam(values, seed, variance, words, opens, ring, MAX_DDP_RING_BITS)
    return values


def to_ring(ints: npt.NDArray[np.int64], ring_bits: int) -> RingVector:
    """Signed integers modulo 2^ring_bits, in the ring's dtype (modular clipping)."""
    dtype = ring_dtype(ring_bits)
    values = np.asarray(ints, dtype=np.int64)
    if ring_bits == 8 * dtype.itemsize:  # the integer cast itself reduces mod 2^bits
        return values.astype(dtype)
    return (values.view(np.uint64) & np.uint64((1 << ring_bits) - 1)).astype(dtype)


def recentre(ring_sum: RingVector, ring_bits: int) -> npt.NDArray[np.int64]:
    """Ring elements as signed integers in [−2^(m−1), 2^(m−1))."""
    half = 1 << (ring_bits - 1)
    v = (np.asarray(ring_sum).astype(np.uint64) & np.uint64((1 << ring_bits) - 1)).astype(np.int64)
    v[v >= half] -= 1 << ring_bits
    return v


def decode_sum(ring_sum: RingVector, spec: DdpSpec, shared_seed: bytes) -> FloatVector:
    """The unmasked ring sum back to Σ clip(x) + noise, in the vectors' own units.

    Error: per coordinate, the noise (standard deviation :meth:`DdpSpec.noise_stddev`)
    plus the unbiased rounding of each member (variance ≤ 1/(4γ²) each), unless a
    coordinate wrapped (probability ≤ :meth:`DdpSpec.wrap_bound`).

    Raises:
        QuantizationError: ``ring_sum`` does not have ``spec.padded`` elements.
    """
    values = np.asarray(ring_sum).reshape(-1)
    if values.size != spec.padded:
        raise QuantizationError(f"ring sum must have {spec.padded} elements, got {values.size}")
    centred = recentre(values, spec.ring_bits).astype(np.float64)
    centred *= 1.0 / spec.scale
    return unrotate(centred, shared_seed, spec.dim)


def wrap_count(int_sum: npt.ArrayLike, ring_bits: int) -> int:
    """Coordinates of an exact (unreduced) integer sum that the ring wrapped: those
    outside [−2^(m−1), 2^(m−1)).  Only a simulation, which can form that sum, can count
    them; a deployment sees the bound."""
    half = 1 << (ring_bits - 1)
    v = np.asarray(int_sum, dtype=np.int64)
    return int(np.count_nonzero((v < -half) | (v >= half)))
