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
never produced, which adds at most d·2^-53 to δ.
"""

from __future__ import annotations

import math
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
# Guide table for inversion: 4 buckets per table entry leaves nearly every uniform at
# most a step or two from its answer; after 3 vector steps the rest binary-search.
GUIDE_PER_ENTRY = 4
GUIDE_STEPS = 3

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
    integers: npt.NDArray[np.int64]  # before wrapping (for a simulation's wrap count)
    rounding_draws: int  # 1 unless the conditional rounding drew again
    clipped: bool  # the vector's norm was above the clip


def encode(x: npt.ArrayLike, spec: DdpSpec, shared_seed: bytes, secret_seed: bytes) -> Encoded:
    """Clip, rotate, scale, round, add a noise share and wrap ``x`` into the ring.

    Args:
        x: the member's float vector (``spec.dim`` values, any shape); not modified.
        spec: the round's discretisation.
        shared_seed: 32 bytes every member shares (the rotation).
        secret_seed: 32 fresh secret bytes of this member (rounding and noise).  Anyone
            who knows it can subtract the noise share: never reuse or reveal it.

    Returns:
        :class:`Encoded` with ``spec.padded`` ring elements in the ring's dtype.

    Raises:
        QuantizationError: wrong length or non-finite values; rounding that fails
            MAX_ROUNDING_TRIES times (probability ≤ 1e-192).
        ValueError: a seed is not 32 bytes.
    """
    flat = np.asarray(x, dtype=np.float64).reshape(-1)
    if flat.size != spec.dim:
        raise QuantizationError(f"vector must have {spec.dim} values, got {flat.size}")
    if not np.all(np.isfinite(flat)):
        raise QuantizationError("vector contains NaN or infinite values")
    norm = float(np.linalg.norm(flat))
    clipped = norm > spec.clip
    scaled = rotate(flat * (spec.clip / norm) if clipped else flat, shared_seed)
    scaled *= spec.scale
    ints, draws = _conditional_round(scaled, spec.rounding_bound, secret_seed)
    if spec.noise_multiplier > 0:
        ints += skellam(secret_seed, spec.share_variance, ints.size)
    return Encoded(to_ring(ints, spec.ring_bits), ints, draws, clipped)


def _conditional_round(
    y: FloatVector, bound: float, seed: bytes
) -> tuple[npt.NDArray[np.int64], int]:
    """Unbiased stochastic rounding of ``y``, drawn again while the error's L2 norm
    exceeds ``bound``."""
    floor = np.floor(y)
    frac = y - floor
    for draw in range(1, MAX_ROUNDING_TRIES + 1):
        domain = _ROUNDING_DOMAIN + str(draw).encode()
        up = uniform53(seed, domain, y.size) < frac
        error = up - frac  # the rounded value minus y
        if float(error @ error) <= bound * bound:
            floor += up
            return floor.astype(np.int64), draw
    raise QuantizationError(
        f"conditional rounding exceeded its error bound {MAX_ROUNDING_TRIES} times"
    )


def uniform53(seed: bytes, domain: bytes, count: int) -> FloatVector:
    """``count`` float64 values uniform on [0, 1) with 53 bits of resolution (exact
    multiples of 2^-53), from the AES-CTR keystream."""
    words = prg.expand(seed, domain, count, np.uint64) >> np.uint64(11)
    return words.astype(np.float64) * (1.0 / (1 << 53))


def _table_half_width(variance: float) -> int:
    return math.ceil(NOISE_TAIL_STDDEVS * math.sqrt(variance)) + 2


@lru_cache(maxsize=16)
def _skellam_cdf(variance: float) -> tuple[int, FloatVector, npt.NDArray[np.intp]]:
    """(K, CDF over −K..K, guide) of Skellam(μ₁ = μ₂ = variance/2): P(k) = e^{−v}·I_k(v).

    ``guide[j]`` is the first index whose CDF exceeds j/G (G = 4·table size): the answer
    for a uniform u is at or after ``guide[⌊u·G⌋]``, usually there or one step on."""
    half = _table_half_width(variance)
    ks = np.abs(np.arange(-half, half + 1, dtype=np.float64))
    pmf = special.ive(ks, variance)  # exponentially scaled Bessel: e^{-v} I_|k|(v)
    cdf = np.cumsum(pmf)
    cdf.setflags(write=False)
    buckets = GUIDE_PER_ENTRY * cdf.size
    guide = np.searchsorted(cdf, np.arange(buckets) / buckets, side="right")
    guide.setflags(write=False)
    return half, cdf, guide


def skellam(seed: bytes, variance: float, count: int) -> npt.NDArray[np.int64]:
    """``count`` independent Skellam variables of mean 0 and ``variance``, by inversion
    of 53-bit keystream uniforms (the same values ``np.searchsorted(cdf, u, "right")``
    gives, found through the guide table: a few vector steps instead of a binary search
    per value).

    Raises:
        QuantizationError: variance not positive or its table beyond MAX_NOISE_TABLE.
        ValueError: ``seed`` is not 32 bytes.
    """
    if not (math.isfinite(variance) and variance > 0):
        raise QuantizationError(f"noise variance must be positive, got {variance}")
    if 2 * _table_half_width(variance) + 1 > MAX_NOISE_TABLE:
        raise QuantizationError(f"noise variance {variance:g} needs too large a table")
    half, cdf, guide = _skellam_cdf(float(variance))
    u = uniform53(seed, _NOISE_DOMAIN, count)
    idx = guide[(u * guide.size).astype(np.intp)]
    todo = np.arange(count)
    for _ in range(GUIDE_STEPS):
        todo = todo[idx[todo] < cdf.size]
        todo = todo[cdf[idx[todo]] <= u[todo]]
        if todo.size == 0:
            break
        idx[todo] += 1
    if todo.size:  # the rare values in a tail bucket: binary search
        idx[todo] = np.searchsorted(cdf, u[todo], side="right")
    np.minimum(idx, 2 * half, out=idx)  # u above the table's float sum (< 1e-15 of mass)
    return idx.astype(np.int64) - half


def to_ring(ints: npt.NDArray[np.int64], ring_bits: int) -> RingVector:
    """Signed integers modulo 2^ring_bits, in the ring's dtype (modular clipping)."""
    mask = np.uint64((1 << ring_bits) - 1)
    return (np.asarray(ints, dtype=np.int64).view(np.uint64) & mask).astype(ring_dtype(ring_bits))


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
