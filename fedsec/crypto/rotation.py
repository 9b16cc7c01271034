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

H is applied by compiled butterflies (:mod:`fedsec.crypto.kernels`) in a fixed order of
IEEE additions, so every machine gets the same bits: the audit re-derives a decoded sum
exactly, which a BLAS product, whose rounding depends on the CPU's kernel, would not
promise.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from fedsec.crypto import prg
from fedsec.crypto.errors import QuantizationError

# 2^26 coordinates (64M, 512 MB as float64) is far beyond any model this project trains
# in one piece; refusing larger inputs keeps a bad spec from allocating without bound.
MAX_ROTATION_LOG2 = 26
_SIGN_DOMAIN = b"rotation/signs"

FloatVector = npt.NDArray[np.float64]

# Row b: the eight signs that keystream byte b encodes, least significant bit first
# (bit 1 → −1.0), so one gather turns N/8 bytes into N signs.
_SIGN_TABLE = 1.0 - 2.0 * np.unpackbits(
    np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little"
).astype(np.float64)
_SIGN_TABLE.setflags(write=False)
_SIGN_TABLE_SINGLE = _SIGN_TABLE.astype(np.float32)
_SIGN_TABLE_SINGLE.setflags(write=False)


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


def hadamard(x: FloatVector) -> FloatVector:
    """The unnormalised Walsh-Hadamard transform H·x of a power-of-two-length vector
    (a new float64 array; ``x`` is not modified).

    Raises:
        QuantizationError: the length is not a power of two.
    """
    n = x.size
    if n & (n - 1):
        raise QuantizationError(f"the Hadamard transform needs a power-of-two length, got {n}")
    from fedsec.crypto import kernels  # numba: imported (0.3 s) by processes that rotate

    vec = np.array(x, dtype=np.float64).reshape(-1)
    if n:
        kernels.hadamard_inplace(vec)
    return vec


def rotate(
    x: npt.ArrayLike,
    seed: bytes,
    *,
    scale: float = 1.0,
    out: FloatVector | None = None,
    finite: bool = False,
) -> FloatVector:
    """``scale``·H·D·pad(x)/√N: ``x`` (any shape, flattened) rotated into N coordinates.

    Args:
        x: the vector; not modified.  float32 values widen exactly (no copy is made).
        seed: 32 bytes every member of the round shares (from the signed round spec).
        scale: a factor folded into the transform (free, where a separate pass over the
            result is not).
        out: a float64 vector of N elements to write the result into (a caller that
            rotates every round keeps its memory); a new one if None.
        finite: the caller has already refused non-finite values (a pass over ``x`` is
            saved; the encoder measures the norm first, for its clip).

    Returns:
        A float64 vector of length :func:`padded_length` of ``x.size`` (``out`` if
        given), of L2 norm ``scale``·‖x‖ (up to float64 rounding: about log₂N·2^-53
        relative).

    Raises:
        QuantizationError: empty or oversized vector, non-finite values, or an ``out``
            of the wrong length or dtype.
        ValueError: ``seed`` is not 32 bytes.
    """
    flat = np.asarray(x).reshape(-1)
    if flat.dtype != np.float32:
        flat = flat.astype(np.float64, copy=False)
    rotated: FloatVector = _rotate(flat, seed, scale, np.dtype(np.float64), out, finite)
    return rotated


def rotate_single(x: npt.ArrayLike, seed: bytes, *, scale: float = 1.0) -> npt.NDArray[np.float32]:
    """:func:`rotate` in float32, at half the memory traffic: for a vector rounded to a
    few bits next, where a relative error of about log₂N·2^-24 vanishes; never where
    the result's norm bounds a privacy guarantee.

    Raises:
        QuantizationError / ValueError: see :func:`rotate`.
    """
    flat = np.asarray(x, dtype=np.float32).reshape(-1)
    rotated: npt.NDArray[np.float32] = _rotate(flat, seed, scale, np.dtype(np.float32), None, False)
    return rotated


def _rotate(
    flat: npt.NDArray[np.floating],
    seed: bytes,
    scale: float,
    dtype: np.dtype[Any],
    out: Any,
    finite: bool,
) -> Any:
    n = padded_length(flat.size)
    from fedsec.crypto import kernels  # numba: imported (0.3 s) by processes that rotate

    # the squared norm finds any NaN or ±inf (they reach the sum); only an overflowing
    # square of finite values needs the full check
    checked = finite or math.isfinite(kernels.squared_norm(flat))
    if not checked and not np.all(np.isfinite(flat)):
        raise QuantizationError("a vector to rotate contains NaN or infinite values")

    if out is None:
        out = np.empty(n, dtype=dtype)
    elif out.dtype != dtype or out.shape != (n,) or not out.flags.c_contiguous:
        raise QuantizationError(f"a rotation's output must be {n} contiguous {dtype} values")
    table = _SIGN_TABLE if dtype == np.float64 else _SIGN_TABLE_SINGLE
    factor = dtype.type(scale / math.sqrt(n))
    kernels.signed_hadamard(flat, _sign_bytes(seed, flat.size), table, factor, out)
    return out


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
    work = vec * (scale / math.sqrt(n))
    unrotate_prescaled(work, seed, d)
    return work[:d]


def unrotate_prescaled(work: FloatVector, seed: bytes, d: int) -> None:
    """:func:`unrotate` in place, of a vector its caller has already multiplied by
    scale/√N (as :func:`unrotate` does first): afterwards ``work[:d]`` holds the result,
    bit for bit :func:`unrotate`'s, and the rest of ``work`` is spent.  A decoder that
    fills ``work`` itself holds one N-element vector instead of two.

    Raises:
        QuantizationError: ``work`` is not a contiguous float64 vector of the padded
            length of ``d``.
        ValueError: ``seed`` is not 32 bytes.
    """
    n = padded_length(d)
    if work.dtype != np.float64 or work.shape != (n,) or not work.flags.c_contiguous:
        raise QuantizationError(f"a rotated vector of {d} coordinates is {n} contiguous float64")
    from fedsec.crypto import kernels  # numba: imported (0.3 s) by processes that rotate

    kernels.hadamard_inplace(work)
    kernels.apply_signs(work[:d], _sign_bytes(seed, d), _SIGN_TABLE)
