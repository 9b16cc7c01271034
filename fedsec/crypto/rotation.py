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

import numpy as np
import numpy.typing as npt

from fedsec.crypto import prg
from fedsec.crypto.errors import QuantizationError

# 2^26 coordinates (64M, 512 MB as float64) is far beyond any model this project trains
# in one piece; refusing larger inputs keeps a bad spec from allocating without bound.
MAX_ROTATION_LOG2 = 26
_SIGN_DOMAIN = b"rotation/signs"

FloatVector = npt.NDArray[np.float64]


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
    """The diagonal D: ``n`` values ±1.0, one keystream bit each, from ``seed``.

    Raises:
        ValueError: ``seed`` is not 32 bytes.
    """
    raw = np.frombuffer(prg.keystream(seed, _SIGN_DOMAIN, (n + 7) // 8), dtype=np.uint8)
    bits = np.unpackbits(raw, bitorder="little")[:n]
    return 1.0 - 2.0 * bits.astype(np.float64)


def hadamard(x: FloatVector) -> FloatVector:
    """The unnormalised Walsh-Hadamard transform H·x of a power-of-two-length vector.

    Radix-4 butterflies in place on one copy (two levels per pass over memory, four
    quarter-size temporaries): 2-3x faster than one level per pass at N = 2^20, where the
    transform is memory-bound."""
    n = x.size
    if n & (n - 1):
        raise QuantizationError(f"the Hadamard transform needs a power-of-two length, got {n}")
    y = np.array(x, dtype=np.float64).reshape(-1)
    h = 1
    if (n.bit_length() - 1) % 2:  # an odd number of levels: one radix-2 pass first
        pairs = y.reshape(-1, 2)
        first = pairs[:, 0].copy()
        pairs[:, 0] += pairs[:, 1]
        np.subtract(first, pairs[:, 1], out=pairs[:, 1])
        h = 2
    while h < n:
        quads = y.reshape(-1, 4, h)
        a, b, c, d = quads[:, 0, :], quads[:, 1, :], quads[:, 2, :], quads[:, 3, :]
        s1, d1, s2, d2 = a + b, a - b, c + d, c - d
        np.add(s1, s2, out=a)
        np.add(d1, d2, out=b)
        np.subtract(s1, s2, out=c)
        np.subtract(d1, d2, out=d)
        h *= 4
    return y


def rotate(x: npt.ArrayLike, seed: bytes) -> FloatVector:
    """``H·D·pad(x)/√N``: ``x`` (any shape, flattened) rotated into N coordinates.

    Args:
        x: the vector; not modified.
        seed: 32 bytes every member of the round shares (from the signed round spec).

    Returns:
        A float64 vector of length :func:`padded_length` of ``x.size``, same L2 norm.

    Raises:
        QuantizationError: empty or oversized vector, or non-finite values.
        ValueError: ``seed`` is not 32 bytes.
    """
    flat = np.asarray(x, dtype=np.float64).reshape(-1)
    n = padded_length(flat.size)
    if not np.all(np.isfinite(flat)):
        raise QuantizationError("a vector to rotate contains NaN or infinite values")
    padded = np.zeros(n, dtype=np.float64)
    padded[: flat.size] = flat
    padded *= signs(seed, n)
    out = hadamard(padded)
    out *= 1.0 / np.sqrt(n)
    return out


def unrotate(y: npt.ArrayLike, seed: bytes, d: int) -> FloatVector:
    """Inverse of :func:`rotate`: ``D·H·y/√N`` truncated to the first ``d`` coordinates.

    Raises:
        QuantizationError: ``y``'s length is not the padded length of ``d``.
        ValueError: ``seed`` is not 32 bytes.
    """
    vec = np.asarray(y, dtype=np.float64).reshape(-1)
    n = padded_length(d)
    if vec.size != n:
        raise QuantizationError(
            f"a rotated vector of {d} coordinates has {n} elements, got {vec.size}"
        )
    out = hadamard(vec)
    out *= signs(seed, n)
    out *= 1.0 / np.sqrt(n)
    return out[:d]
