"""A shared random rotation: the randomised Walsh-Hadamard transform.

``rotate(x) = H·D·pad(x) / √N`` where ``pad`` appends zeros up to N, the next power of
two, D is a diagonal of random signs and H the N×N Walsh-Hadamard matrix.  H/√N is
orthonormal and its own inverse, so ``unrotate(y) = D·H·y / √N`` (then truncated to
the original length) undoes it exactly up to float rounding, and the L2 norm is kept.

Why rotate before discretising: after a random rotation every coordinate of a vector of
norm s is close to N(0, s²/N) whatever the vector looked like, so one large coordinate
cannot dominate the bit budget and the per-coordinate bounds that size the ring hold
with high probability (Kairouz, Liu, Steinke, ICML 2021; Suresh et al., ICML 2017).

Why the signs must be shared: every member rotates with the *same* D (derived from the
signed round spec), so the rotation is one linear map and the sum of rotated vectors is
the rotation of the sum; the aggregator unrotates the sum once.  The signs come from the
AES-CTR keystream of :mod:`fedsec.crypto.prg`.  They need not be secret (the rotation
only spreads the mass), but they must not be chosen by any one party after seeing the
data, which the signed spec's fresh per-attempt seed ensures.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from fedsec.crypto import prg
from fedsec.crypto.errors import QuantizationError

# 2^26 coordinates (64M, 512 MB as float64) is far beyond any model this project trains
# in one piece; refusing larger inputs keeps a bad spec from allocating without bound.
MAX_ROTATION_LOG2 = 26
# H_N is applied as a Kronecker product of small Hadamard matrices, one dense product
# (BLAS) per factor along one axis of x seen as a tensor: ⌈log₂N / 4⌉ passes over
# memory instead of log₂N butterfly levels.  Factors of at most 2^4 measured fastest at
# N = 2^20 (16^5: 6-8 ms; 32^4: 9 ms; radix-4 butterflies: 32 ms, on this machine):
# larger factors multiply by ±1 more often than the passes they save are worth.
MAX_FACTOR_LOG2 = 4
# Each pass is a stack of products of at most 16·16·1024 = 2^18 multiply-adds, the size
# up to which OpenBLAS stays on the calling thread: its threads wait for each other on a
# busy machine (2x slower than one thread with 2 cores shared by several processes,
# about 1.3x faster when idle), and the member's other cores stay free for its own work.
MAX_PRODUCT_COLUMNS = 1024
_SIGN_DOMAIN = b"rotation/signs"

FloatVector = npt.NDArray[np.float64]
_F = TypeVar("_F", npt.NDArray[np.float64], npt.NDArray[np.float32])

# Row b: the eight signs that keystream byte b encodes, least significant bit first
# (bit 1 → −1.0), so one gather turns N/8 bytes into N signs.
_SIGN_TABLE = 1.0 - 2.0 * np.unpackbits(
    np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little"
).astype(np.float64)
_SIGN_TABLE.setflags(write=False)


def padded_length(d: int) -> int:
    """N: the smallest power of two ≥ ``d`` (at least 1).

    Raises:
        QuantizationError: ``d`` is below 1 or above 2^MAX_ROTATION_LOG2.
    """
    if not 1 <= d <= 1 << MAX_ROTATION_LOG2:
        raise QuantizationError(
            f"a rotated vector must have 1..{1 << MAX_ROTATION_LOG2} coordinates, got {d}"
        )
    return 1 << (d - 1).bit_length()


def signs(seed: bytes, n: int) -> FloatVector:
    """The diagonal D: ``n`` values ±1.0, one keystream bit each, from ``seed``
    (bit i of byte j is sign 8j + i; a set bit is −1).

    Raises:
        ValueError: ``seed`` is not 32 bytes.
    """
    return _SIGN_TABLE[_sign_bytes(seed, n)].reshape(-1)[:n]


def _sign_bytes(seed: bytes, n: int) -> npt.NDArray[np.uint8]:
    return np.frombuffer(prg.keystream(seed, _SIGN_DOMAIN, (n + 7) // 8), dtype=np.uint8)


def _flip(values: npt.NDArray[np.floating], seed: bytes, out: npt.NDArray[np.floating]) -> None:
    """``out = D·values`` for the first ``values.size`` signs, by XOR of each sign bit
    into the float's sign bit (float64 or float32): exactly the product with ±1.0, at a
    third of its cost (no float vector of signs)."""
    n = values.size
    word = np.uint64 if values.dtype == np.float64 else np.uint32
    bits = np.unpackbits(_sign_bytes(seed, n), bitorder="little", count=n)
    masks = np.left_shift(bits, word(8 * values.itemsize - 1), dtype=word)
    np.bitwise_xor(values.view(word), masks, out=out.view(word))


@lru_cache(maxsize=2 * (MAX_FACTOR_LOG2 + 1))
def _sylvester(bits: int, single: bool = False) -> npt.NDArray[np.floating]:
    """H_{2^bits} as a dense ±1 matrix, float32 if ``single`` else float64 (read-only)."""
    h = np.ones((1, 1), dtype=np.float32 if single else np.float64)
    for _ in range(bits):
        h = np.block([[h, h], [h, -h]])
    h.setflags(write=False)
    return h


def _factor_bits(log2n: int) -> list[int]:
    """log₂N split into ⌈log₂N / MAX_FACTOR_LOG2⌉ parts as even as possible."""
    parts = -(-log2n // MAX_FACTOR_LOG2)
    return [log2n // parts + (i < log2n % parts) for i in range(parts)]


def _transform(x: _F, factor: float, overwrite: bool) -> _F:
    """``factor``·H·x for a contiguous float64 or float32 vector of power-of-two length,
    in its own precision.

    x is viewed as a tensor with one axis per Kronecker factor of H_N = H_f1 ⊗ ... ⊗ H_fk;
    each pass multiplies one axis by its H_f (the first pass also by ``factor``) into
    the other of two buffers.  ``overwrite``: x may serve as one of them."""
    n = x.size
    bits = _factor_bits(n.bit_length() - 1)
    if not bits:  # N = 1
        return x * factor
    first = np.empty_like(x)
    buffers = (first, x if overwrite else np.empty_like(x)) if len(bits) > 1 else (first,)
    src, left = x, 1
    for i, b in enumerate(bits):
        dst = buffers[i % 2]
        h = _sylvester(b, x.dtype == np.float32)
        if i == 0:
            h = (h * factor).astype(x.dtype)
        f = 1 << b
        right = n // (left * f)
        if right == 1:  # the last axis: rows times H (H is symmetric)
            rows = min(left, MAX_PRODUCT_COLUMNS)
            shape: tuple[int, ...] = (left // rows, rows, f)
            np.matmul(src.reshape(shape), h, out=dst.reshape(shape))
        else:  # H times (f, chunk) slices, chunk ≤ MAX_PRODUCT_COLUMNS contiguous values
            chunk = min(right, MAX_PRODUCT_COLUMNS)
            shape = (left, f, right // chunk, chunk)
            slices = src.reshape(shape).transpose(0, 2, 1, 3)
            np.matmul(h, slices, out=dst.reshape(shape).transpose(0, 2, 1, 3))
        src, left = dst, left * f
    return src


def squared_norm(x: npt.NDArray[np.floating]) -> float:
    """‖x‖² of a float vector, on the calling thread (in its own precision).

    numpy's ``x @ x`` is an OpenBLAS dot, which above 10,000 values wakes its worker
    threads; they then spin for the next call and took as much CPU as the whole
    rotation on a shared 2-core machine.  einsum's own loop stays on this thread."""
    return float(np.einsum("i,i->", x, x))


def hadamard(x: FloatVector) -> FloatVector:
    """The unnormalised Walsh-Hadamard transform H·x of a power-of-two-length vector
    (a new float64 array; ``x`` is not modified).

    Raises:
        QuantizationError: the length is not a power of two.
    """
    n = x.size
    if n & (n - 1):
        raise QuantizationError(f"the Hadamard transform needs a power-of-two length, got {n}")
    vec = np.ascontiguousarray(x, dtype=np.float64).reshape(-1)
    if n == 0:
        return vec.copy()
    return _transform(vec, 1.0, overwrite=False)


def rotate(x: npt.ArrayLike, seed: bytes, *, scale: float = 1.0) -> FloatVector:
    """``scale``·H·D·pad(x)/√N: ``x`` (any shape, flattened) rotated into N coordinates.

    Args:
        x: the vector; not modified.
        seed: 32 bytes every member of the round shares (from the signed round spec).
        scale: a factor folded into the transform (free, where a separate pass over the
            result is not).

    Returns:
        A float64 vector of length :func:`padded_length` of ``x.size``, of L2 norm
        ``scale``·‖x‖ (up to float64 rounding: about log₂N·2^-53 relative).

    Raises:
        QuantizationError: empty or oversized vector, or non-finite values.
        ValueError: ``seed`` is not 32 bytes.
    """
    return _rotate(np.asarray(x, dtype=np.float64).reshape(-1), seed, scale)


def rotate_single(x: npt.ArrayLike, seed: bytes, *, scale: float = 1.0) -> npt.NDArray[np.float32]:
    """:func:`rotate` in float32, at half the memory traffic: for a vector rounded to a
    few bits next, where a relative error of about log₂N·2^-24 vanishes; never where
    the result's norm bounds a privacy guarantee.

    Raises:
        QuantizationError / ValueError: see :func:`rotate`.
    """
    return _rotate(np.asarray(x, dtype=np.float32).reshape(-1), seed, scale)


def _rotate(flat: _F, seed: bytes, scale: float) -> _F:
    n = padded_length(flat.size)
    # the squared norm finds any NaN or ±inf (they reach the sum); only an overflowing
    # square of finite values needs the full check
    if not math.isfinite(squared_norm(flat)) and not np.all(np.isfinite(flat)):
        raise QuantizationError("a vector to rotate contains NaN or infinite values")
    padded = np.empty(n, dtype=flat.dtype)
    _flip(flat, seed, padded[: flat.size])
    padded[flat.size :] = 0.0
    return _transform(padded, scale / math.sqrt(n), overwrite=True)


def unrotate(y: npt.ArrayLike, seed: bytes, d: int, *, scale: float = 1.0) -> FloatVector:
    """Inverse of :func:`rotate`: ``scale``·D·H·y/√N truncated to the first ``d``
    coordinates (``y`` is not modified).

    Raises:
        QuantizationError: ``y``'s length is not the padded length of ``d``.
        ValueError: ``seed`` is not 32 bytes.
    """
    vec = np.ascontiguousarray(y, dtype=np.float64).reshape(-1)
    n = padded_length(d)
    if vec.size != n:
        raise QuantizationError(
            f"a rotated vector of {d} coordinates has {n} elements, got {vec.size}"
        )
    out = _transform(vec, scale / math.sqrt(n), overwrite=False)[:d]
    _flip(out, seed, out)
    return out
