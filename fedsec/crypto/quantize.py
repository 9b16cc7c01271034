"""Clip, weight and quantize an update into the SecAgg ring; pack it for the wire.

A member's update Δ is clipped to L2 norm ``clip`` (C), scaled by its weight
w ∈ [0, 1], mapped from [-C, C] to [0, L] with L = 2^b − 1 levels, and rounded
*stochastically* (up with probability equal to the fractional part), which
makes the quantized value an unbiased estimate of the real one.  The weight is
quantized the same way (w·L) and appended as the last coordinate, so one
secure sum yields both Σ w·Δ and Σ w.

Ring Z_{2^m}: a sum of n values in [0, L] is at most n·(2^b − 1) < 2^(b + ⌈log₂ n⌉),
so m = b + max(1, ⌈log₂ n⌉) never wraps (:func:`default_ring_bits`).  In memory a ring
vector uses the smallest unsigned dtype of at least m bits; arithmetic wraps
mod 2^dtype_bits and is reduced mod 2^m by masking, which is exact because 2^m
divides 2^dtype_bits.

Error bound (documented contract, tested): each coordinate of a member's
dequantized input differs from w·clip(Δ) by less than one step 2C/L, and the
rounding is unbiased; hence the dequantized Σ w·Δ over n members is within
n·2C/L of the exact sum in every coordinate, and the mean of n equally
weighted members within 2C/L (typically ~2C/(L·√n)).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fedsec.crypto import kernels, packing, prg
from fedsec.crypto.errors import BadVector, QuantizationError

MIN_BITS, MAX_BITS = 2, 16
# b ≤ 16 plus ⌈log₂ n⌉ for a million members is 36; 56 keeps every element of a
# packed group of eight within one 64-bit word (shift ≤ 7 plus 56 bits).
MAX_RING_BITS = 56
_ROUNDING_DOMAIN = b"stochastic-rounding"

RingVector = npt.NDArray[np.unsignedinteger]


def ring_dtype(ring_bits: int) -> np.dtype[np.unsignedinteger]:
    """Smallest unsigned little-endian dtype holding ``ring_bits`` bits."""
    if not 1 <= ring_bits <= MAX_RING_BITS:
        raise QuantizationError(f"ring bits must be in 1..{MAX_RING_BITS}, got {ring_bits}")
    for width, code in ((8, "<u1"), (16, "<u2"), (32, "<u4"), (64, "<u8")):
        if ring_bits <= width:
            return np.dtype(code)
    raise AssertionError("unreachable")


def default_ring_bits(bits: int, members: int) -> int:
    """m = b + max(1, ⌈log₂ n⌉): the smallest ring in which the sum of ``members``
    b-bit values never wraps, since n·(2^b − 1) < 2^⌈log₂ n⌉·2^b (at least one bit of
    headroom, which a ring needs above b).  Every bit here is sent once per coordinate
    and member, so a spare one would cost 1/m of the payload for nothing."""
    if members < 1:
        raise QuantizationError(f"need at least one member, got {members}")
    return bits + max(1, math.ceil(math.log2(members)))


@dataclass(frozen=True, slots=True)
class QuantSpec:
    """How updates are quantized: b bits per coordinate, clip C, ring Z_{2^m}."""

    bits: int
    clip: float
    ring_bits: int

    def __post_init__(self) -> None:
        if not MIN_BITS <= self.bits <= MAX_BITS:
            raise QuantizationError(f"bits must be in {MIN_BITS}..{MAX_BITS}, got {self.bits}")
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise QuantizationError(f"clip norm must be a positive number, got {self.clip}")
        if not self.bits < self.ring_bits <= MAX_RING_BITS:
            raise QuantizationError(
                f"ring bits must be in {self.bits + 1}..{MAX_RING_BITS}, got {self.ring_bits}"
            )

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    @property
    def dtype(self) -> np.dtype[np.unsignedinteger]:
        return ring_dtype(self.ring_bits)

    @property
    def ring_mask(self) -> int:
        return (1 << self.ring_bits) - 1

    def max_members(self) -> int:
        """Largest n whose sum of quantized inputs cannot wrap the ring."""
        return (1 << self.ring_bits) // (self.levels + 1)

    def step(self) -> float:
        """Width of one quantization level in update units: 2C / L."""
        return 2.0 * self.clip / self.levels


def _l2_norm(vec: npt.NDArray[np.float32]) -> float:
    with np.errstate(over="ignore"):
        norm = float(np.linalg.norm(vec))  # sqrt(x·x) in float32: squares overflow above ~1.8e19
    if not math.isfinite(norm):
        if not np.all(np.isfinite(vec)):
            raise QuantizationError("update contains NaN or infinite values")
        # finite but huge: rescale by the largest magnitude (rare path, one temporary vector)
        peak = float(np.max(np.abs(vec)))
        norm = peak * float(np.linalg.norm(vec / np.float32(peak)))
    return norm


def clip_l2(delta: npt.NDArray[np.floating], clip: float) -> npt.NDArray[np.float32]:
    """``delta`` as float32, scaled down so its L2 norm is at most ``clip``."""
    vec = np.asarray(delta, dtype=np.float32).reshape(-1)
    norm = _l2_norm(vec)
    if norm > clip:
        return vec * np.float32(clip / norm)
    return vec


# One buffer of rounding words per thread, reused: a fresh 4·d-byte array each update
# faulted its pages in on first write, as long as the rounding pass itself.
_words = threading.local()


def _rounding_words(count: int) -> npt.NDArray[np.uint32]:
    buf: npt.NDArray[np.uint32] | None = getattr(_words, "buf", None)
    if buf is None or buf.size != count:
        buf = np.empty(count, dtype="<u4")
        _words.buf = buf
    return buf


def quantize(
    delta: npt.NDArray[np.floating], weight: float, spec: QuantSpec, seed: bytes
) -> RingVector:
    """Clip, weight and stochastically round ``delta``; append the weight.

    Args:
        delta: the update, any shape (flattened); not modified.
        weight: w in [0, 1].
        spec: quantization parameters.
        seed: 32 bytes of fresh randomness for the rounding (a member's secret).

    Returns:
        Ring vector of length ``delta.size + 1`` with values in [0, L].

    Raises:
        QuantizationError: weight out of range or non-finite update.
    """
    if not (math.isfinite(weight) and 0.0 <= weight <= 1.0):
        raise QuantizationError(f"weight must be in [0, 1], got {weight}")
    x = np.asarray(delta, dtype=np.float32).reshape(-1)
    d = x.size
    norm = _l2_norm(x)
    shrink = spec.clip / norm if norm > spec.clip else 1.0
    scale = spec.levels / (2.0 * spec.clip)
    # ⌊(w·clip(x) + C)·L/(2C) + u⌋ clipped to [0, L] (float32 rounding at the edges must not
    # leave it), u uniform on [0, 1) from 24 bits of each keystream word as prg.uniform01
    # takes them; clipping is folded into the scale so the update is read once, and the
    # rounding is one compiled float32 pass, bit for bit numpy's multiply, add, add,
    # floor and clip.
    words = _rounding_words(d)
    prg.expand_into(seed, _ROUNDING_DOMAIN, words)
    out = np.empty(d + 1, dtype=spec.dtype)
    kernels.quantize_round(
        x,
        words,
        np.float32(shrink * weight * scale),
        np.float32(spec.clip * scale),
        spec.levels,
        out[:d],
    )
    wy = weight * spec.levels
    wfloor = math.floor(wy)
    u = float(prg.uniform01(seed, _ROUNDING_DOMAIN + b"/weight", 1)[0])
    out[d] = min(spec.levels, wfloor + (1 if u < wy - wfloor else 0))
    return out


def dequantize_sum(
    ring_sum: RingVector, members: int, spec: QuantSpec
) -> tuple[npt.NDArray[np.float64], float]:
    """Turn the ring sum of ``members`` quantized inputs into (Σ w·Δ, Σ w).

    Raises:
        QuantizationError: ``members`` exceeds what the ring holds without wrapping.
    """
    q = np.asarray(ring_sum)
    total = dequantize_run(q[:-1], members, spec)
    return total, float(q[-1] & spec.dtype.type(spec.ring_mask)) / spec.levels


def dequantize_run(
    run: RingVector,
    members: int,
    spec: QuantSpec,
    out: npt.NDArray[np.float64] | None = None,
) -> npt.NDArray[np.float64]:
    """Σ w·Δ of :func:`dequantize_sum` for a run of a ring sum's coordinates (any slice
    of them, without the weight's element), into ``out`` if given (same length).  Each
    coordinate is decoded alone, so a sum decoded run by run is the sum decoded whole,
    bit for bit.

    Raises:
        QuantizationError: ``members`` exceeds what the ring holds without wrapping.
    """
    if not 1 <= members <= spec.max_members():
        raise QuantizationError(
            f"{members} members do not fit ring 2^{spec.ring_bits} at {spec.bits} bits"
        )
    q = np.asarray(run) & spec.dtype.type(spec.ring_mask)
    if out is None:
        out = q.astype(np.float64)
    else:
        out[...] = q
    out *= spec.step()
    out -= members * spec.clip
    return out


def ring_from_integers(ints: npt.NDArray[np.int64], spec: QuantSpec) -> RingVector:
    """The ring sum SecAgg+ would have unmasked, from the plain integer sum of the same
    quantized vectors (a homomorphic round's decryption): ``ints mod 2^ring_bits`` in the
    ring's dtype, bit for bit the same for any int64, negative ones and a 64-bit ring
    included."""
    return (np.asarray(ints).view("<u8") & np.uint64(spec.ring_mask)).astype(spec.dtype)


def dequantize_one(q: RingVector, spec: QuantSpec) -> tuple[npt.NDArray[np.float64], float]:
    """One member's quantized input back to (w·Δ, w), e.g. for an auditor's check."""
    return dequantize_sum(q, 1, spec)


# --- wire packing --------------------------------------------------------------------------


def packed_size(count: int, ring_bits: int) -> int:
    """Bytes of ``count`` elements at ``ring_bits`` bits each, padded to a byte."""
    return (count * ring_bits + 7) // 8


def pack(vector: RingVector, ring_bits: int) -> bytes:
    """Pack ring elements at exactly ``ring_bits`` bits each, little-endian bit order
    (element i at bits [i·m, (i + 1)·m) of one little-endian bit string), each value
    reduced mod 2^m.

    Widths of 8/16/32/64 bits are a plain little-endian copy.  Other widths run the
    width's compiled loop (:mod:`fedsec.crypto.packing`), about the time of that copy.
    """
    dt = ring_dtype(ring_bits)
    arr = np.ascontiguousarray(vector, dtype=dt)
    if ring_bits == dt.itemsize * 8:
        return arr.tobytes()
    raw = np.zeros(packed_size(arr.size, ring_bits), dtype=np.uint8)
    packing.pack_into(arr.reshape(-1), raw, ring_bits)
    return raw.tobytes()


def _packed_bytes(raw: bytes, count: int, ring_bits: int) -> npt.NDArray[np.uint8]:
    """``raw`` as bytes, checked to be exactly ``count`` elements of ``ring_bits`` bits
    with zero padding.

    Raises:
        BadVector: wrong byte length, or non-zero padding (a non-canonical encoding).
    """
    expected = packed_size(count, ring_bits)
    if len(raw) != expected:
        raise BadVector(
            f"vector must be {expected} bytes ({count} elements x {ring_bits} bits), got {len(raw)}"
        )
    used = (count * ring_bits) % 8
    if used and raw[-1] >> used:
        raise BadVector("vector has non-zero padding bits after the last element")
    return np.frombuffer(raw, dtype=np.uint8)


def unpack(raw: bytes, count: int, ring_bits: int) -> RingVector:
    """Inverse of :func:`pack`, validating the length and the padding bits.

    Raises:
        BadVector: wrong byte length, or non-zero padding (a non-canonical encoding).
    """
    dt = ring_dtype(ring_bits)
    data = _packed_bytes(raw, count, ring_bits)
    if ring_bits == dt.itemsize * 8:
        return np.frombuffer(raw, dtype=dt, count=count)
    out = np.zeros(count, dtype=dt)
    packing.unpack_add(out, data, ring_bits)
    return out


def check_packed(raw: bytes, count: int, ring_bits: int) -> None:
    """What :func:`unpack` checks of ``raw``, without unpacking it.

    Raises:
        BadVector: wrong byte length, or non-zero padding (a non-canonical encoding).
    """
    _packed_bytes(raw, count, ring_bits)


def unpack_runs(
    raw: bytes, count: int, ring_bits: int, run: int
) -> Iterator[tuple[int, RingVector]]:
    """:func:`unpack` (raw, count, ring_bits), ``run`` elements at a time: (start,
    elements [start, start + run)), for a reader whose memory must not grow with the
    vector.  ``raw`` is checked whole before the first run.

    Raises:
        BadVector: as :func:`unpack`.
        ValueError: ``run`` is not a positive multiple of 8 (runs must start on a byte).
    """
    if run < 8 or run % 8:
        raise ValueError(f"a run of a packed vector is a positive multiple of 8, got {run}")
    data = _packed_bytes(raw, count, ring_bits)
    return _runs(raw, data, count, ring_bits, run)


def _runs(
    raw: bytes, data: npt.NDArray[np.uint8], count: int, ring_bits: int, run: int
) -> Iterator[tuple[int, RingVector]]:
    dt = ring_dtype(ring_bits)
    for start in range(0, count, run):
        n = min(run, count - start)
        if ring_bits == dt.itemsize * 8:
            yield start, np.frombuffer(raw, dtype=dt, count=n, offset=start * dt.itemsize)
            continue
        out = np.zeros(n, dtype=dt)
        first = start * ring_bits // 8  # a run starts on a byte: start is a multiple of 8
        packing.unpack_add(out, data[first : first + packed_size(n, ring_bits)], ring_bits)
        yield start, out


class RingSum:
    """A running sum of packed ring vectors of ``count`` elements, modulo 2^ring_bits:
    how a server takes each member's wire vector without unpacking it into a buffer of
    its own first.

    A width below :data:`~fedsec.crypto.packing.PACKED_SUM_BELOW` (not 8) keeps the sum
    in the wire's packed form and adds field-wise; the others add into a vector of the
    ring's dtype (a plain add for 8/16/32/64 bits, a compiled unpack-add otherwise).
    """

    def __init__(self, count: int, ring_bits: int) -> None:
        """Raises:
        QuantizationError: ``ring_bits`` is not a supported ring width.
        """
        self.count = count
        self.ring_bits = ring_bits
        self._dtype = ring_dtype(ring_bits)
        self._packed = ring_bits % 8 != 0 and ring_bits < packing.PACKED_SUM_BELOW
        if self._packed:
            self._acc = np.zeros((packed_size(count, ring_bits) + 7) // 8, dtype=np.uint64)
        else:
            self._acc = np.zeros(count, dtype=self._dtype)
        self._taken = False

    def add(self, raw: bytes) -> None:
        """sum += :func:`unpack` (raw, count, ring_bits); unchanged when ``raw`` is refused.

        Raises:
            BadVector: wrong byte length or non-zero padding.
            ValueError: the sum was taken (:meth:`take`).
        """
        if self._taken:
            raise ValueError("the running sum was taken: nothing can be added to it")
        data = _packed_bytes(raw, self.count, self.ring_bits)
        if self._packed:
            packing.packed_add(self._acc, data, self.ring_bits)
        elif self.ring_bits == self._dtype.itemsize * 8:
            np.add(self._acc, np.frombuffer(raw, dtype=self._dtype), out=self._acc)
        else:
            packing.unpack_add(self._acc, data, self.ring_bits)

    def total(self) -> RingVector:
        """The sum so far, as a fresh vector of the ring's dtype.

        Raises:
            ValueError: the sum was taken (:meth:`take`).
        """
        if self._taken:
            raise ValueError("the running sum was taken already")
        if not self._packed:
            return self._acc.copy()
        out = np.zeros(self.count, dtype=self._dtype)
        raw = self._acc.view(np.uint8)[: packed_size(self.count, self.ring_bits)]
        packing.unpack_add(out, raw, self.ring_bits)
        return out

    def take(self, into: RingVector | None = None) -> RingVector:
        """The sum, the running sum ending here: its accumulator is given back (a packed
        one is unpacked first), so a server that decodes the sum next does not hold
        both (at 9 ring bits the packed sum is 1.1 bytes a coordinate; 50 MiB at 45M).
        Nothing can be added or taken afterwards.

        Args:
            into: a zeroed, contiguous, writable vector of ``count`` elements of the
                ring's dtype to write the sum into (the caller places it); None: the
                accumulator itself, or a new vector.

        Raises:
            ValueError: the sum was taken before, or ``into`` is not such a vector.
        """
        if self._taken:
            raise ValueError("the running sum was taken already")
        if into is not None and (
            into.shape != (self.count,)
            or into.dtype != self._dtype
            or not into.flags.c_contiguous
            or not into.flags.writeable
        ):
            raise ValueError(f"a ring sum goes into {self.count} contiguous {self._dtype}")
        if into is None:
            out = self.total() if self._packed else self._acc  # unpacked: its own buffer
        elif self._packed:
            out = into
            raw = self._acc.view(np.uint8)[: packed_size(self.count, self.ring_bits)]
            packing.unpack_add(out, raw, self.ring_bits)
        else:
            out = into
            out[...] = self._acc
        self._acc = np.zeros(0, dtype=self._acc.dtype)
        self._taken = True
        return out
