"""Compiled loops (numba) for the rotation, the distributed-DP encoder and the plain
quantizer's rounding.

numpy makes one pass over memory per operation, and at d = 2^20 a pass costs 0.5-1 ms;
written in numpy, the member's encoder (rotate, scale, round, add noise, wrap) makes
some twenty.  These loops fuse them: the Walsh-Hadamard transform runs in place in
radix-4 passes with the sign flip, scale and zero padding folded into its first; the
rounding decision is one pass, and the noise lookup with the wrap into the ring another.

Every loop is plain IEEE arithmetic in a fixed order, compiled without ``fastmath``
(no reassociation, no contraction), so a result is the same bits on every machine
and every run: the audit re-derives decoded sums bit for bit on whatever CPU it
runs, which a BLAS product (whose summation order depends on the CPU's kernel) does
not promise.  No loop draws randomness: the uniforms come in as AES-CTR keystream
words (:mod:`fedsec.crypto.prg`) and are only compared and looked up here.

Each function is compiled on its first call with the argument types it sees and
cached beside this file (``cache=True``); ``nogil`` lets a caller's other threads run
meanwhile.  Bounds are checked by the Python callers, which validate every length
before calling: the loops themselves do not check.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import numpy.typing as npt

_jit = numba.njit(cache=True, nogil=True, boundscheck=False, fastmath=False)


@_jit
def _levels_from(a: Any, h: int) -> None:
    """The butterfly levels of stride h, 2h, ... N/2 of H·a, in place: radix 4 (two
    levels a pass), then one radix-2 level if an odd number remain.

    The inner loops run over slices, whose indices start at zero: that is what lets
    the compiler drop negative-index handling and vectorise them (4-5x)."""
    n = a.size
    while h * 4 <= n:
        for i in range(0, n, 4 * h):
            p0 = a[i : i + h]
            p1 = a[i + h : i + 2 * h]
            p2 = a[i + 2 * h : i + 3 * h]
            p3 = a[i + 3 * h : i + 4 * h]
            for j in range(h):
                x0 = p0[j]
                x1 = p1[j]
                x2 = p2[j]
                x3 = p3[j]
                y0 = x0 + x1
                y1 = x0 - x1
                y2 = x2 + x3
                y3 = x2 - x3
                p0[j] = y0 + y2
                p2[j] = y0 - y2
                p1[j] = y1 + y3
                p3[j] = y1 - y3
        h *= 4
    if h < n:
        for i in range(0, n, 2 * h):
            p0 = a[i : i + h]
            p1 = a[i + h : i + 2 * h]
            for j in range(h):
                u = p0[j]
                v = p1[j]
                p0[j] = u + v
                p1[j] = u - v


@_jit
def _hadamard_inplace(a: Any) -> None:
    """a ← H·a for a contiguous float vector of power-of-two length (unnormalised)."""
    _levels_from(a, 1)


@_jit
def _signed_hadamard(x: Any, sign_bytes: Any, sign_table: Any, scale: Any, out: Any) -> None:
    """out ← H·(scale·D·pad(x)): x's d values, each times ``scale`` and its sign, zero
    beyond d, then the transform.

    ``sign_table[b]`` holds the eight signs (±1) byte b encodes, so coordinate 8j + k
    has sign sign_table[sign_bytes[j], k]; sign_bytes has ⌈d/8⌉ bytes.  ``out`` has the
    padded length N ≥ d.  ``scale`` (a numpy scalar), sign_table and out share one
    float dtype, the precision of every operation; x has it too, or is float32 under a
    float64 out (each value then widens exactly, as if converted first).  The first
    pass does the first three butterfly levels on each group of eight as it loads
    them, so the signed, scaled input is never written and read back on its own."""
    d = x.size
    n = out.size
    s = scale
    zero = s - s
    if n < 8:
        for i in range(n):
            out[i] = s * x[i] * sign_table[sign_bytes[i >> 3], i & 7] if i < d else zero
        _levels_from(out, 1)
        return
    full = d - d % 8
    for i in range(0, full, 8):
        signs = sign_table[sign_bytes[i >> 3]]
        g = x[i : i + 8]
        x0 = s * g[0] * signs[0]
        x1 = s * g[1] * signs[1]
        x2 = s * g[2] * signs[2]
        x3 = s * g[3] * signs[3]
        x4 = s * g[4] * signs[4]
        x5 = s * g[5] * signs[5]
        x6 = s * g[6] * signs[6]
        x7 = s * g[7] * signs[7]
        y0 = x0 + x1
        y1 = x0 - x1
        y2 = x2 + x3
        y3 = x2 - x3
        y4 = x4 + x5
        y5 = x4 - x5
        y6 = x6 + x7
        y7 = x6 - x7
        z0 = y0 + y2
        z2 = y0 - y2
        z1 = y1 + y3
        z3 = y1 - y3
        z4 = y4 + y6
        z6 = y4 - y6
        z5 = y5 + y7
        z7 = y5 - y7
        o = out[i : i + 8]
        o[0] = z0 + z4
        o[4] = z0 - z4
        o[1] = z1 + z5
        o[5] = z1 - z5
        o[2] = z2 + z6
        o[6] = z2 - z6
        o[3] = z3 + z7
        o[7] = z3 - z7
    for i in range(full, n):
        out[i] = s * x[i] * sign_table[sign_bytes[i >> 3], i & 7] if i < d else zero
    # the partial group (if any) and the zeros after d take the three levels here
    if full < d:
        _levels_from(out[full : full + 8], 1)
    _levels_from(out, 8)


@_jit
def _apply_signs(v: Any, sign_bytes: Any, sign_table: Any) -> None:
    """v[i] *= sign_table[sign_bytes[i >> 3], i & 7] in place: D·v (a product with ±1,
    exact)."""
    for i in range(v.size):
        v[i] *= sign_table[sign_bytes[i >> 3], i & 7]


# Partial sums of the rounding error's squared norm: eight, added in a fixed order, so
# the sum is vectorised and still the same bits everywhere.
_LANES = 8


@_jit
def _squared_norm(x: Any) -> float:
    """Σ x[i]² in float64 (exact products for a float32 x), as _LANES partial sums over
    i mod _LANES added in lane order."""
    n = x.size
    lanes = np.zeros(_LANES)
    for i0 in range(0, n, _LANES):
        m = min(_LANES, n - i0)
        xv = x[i0 : i0 + m]
        for k in range(m):
            v = np.float64(xv[k])
            lanes[k] += v * v
    total = 0.0
    for k in range(_LANES):
        total += lanes[k]
    return total


@_jit
def _round_draw(y: Any, words: Any, ints: Any) -> tuple[float, int]:
    """One draw of stochastic rounding: ints[i] ← ⌊y[i]⌋ + up_i, up_i = words[i] < t_i,
    with frac_i = y[i] − ⌊y[i]⌋ and t_i = ⌊min(frac_i·2^32, 2^32 − 1)⌋ (float64).

    Returns (Σ (up_i − frac_i)², ties): the rounding error's squared norm as _LANES
    partial sums over i mod _LANES added in lane order, and how many words equalled
    their threshold (a tie counts as not rounded up: the caller decides those few with
    more bits and corrects ints)."""
    n = y.size
    lanes = np.zeros(_LANES)
    ties = 0
    top = 4294967295.0
    for i0 in range(0, n, _LANES):
        m = min(_LANES, n - i0)
        yv = y[i0 : i0 + m]
        wv = words[i0 : i0 + m]
        iv = ints[i0 : i0 + m]
        for k in range(m):
            v = np.float64(yv[k])
            f = np.floor(v)
            frac = v - f
            t = np.floor(min(frac * 4294967296.0, top))
            w = np.float64(wv[k])
            up = w < t
            ties += w == t
            iv[k] = np.int64(f) + np.int64(up)
            e = np.float64(up) - frac
            lanes[k] += e * e
    total = 0.0
    for k in range(_LANES):
        total += lanes[k]
    return total, ties


@_jit
def _add_noise_and_wrap(
    ints: Any, words: Any, guide: Any, shift: int, open_value: int, mask: int, ring: Any, opens: Any
) -> int:
    """ints[i] += guide[words[i] >> shift] and ring[i] ← ints[i] & mask (two's
    complement, in ring's dtype), in one pass.

    Where the guide entry is ``open_value`` the noise is left out and i is written to
    opens[0..count), ascending; returns count.  The caller completes those values and
    corrects ints and ring there."""
    count = 0
    for i in range(ints.size):
        g = guide[words[i] >> shift]
        v = ints[i]
        if g == open_value:
            opens[count] = i
            count += 1
        else:
            v += g
        ints[i] = v
        ring[i] = v & mask
    return count


@_jit
def _quantize_round(x: Any, words: Any, scale: Any, offset: Any, levels: Any, out: Any) -> None:
    """out[i] ← clip(⌊x[i]·scale + offset + u_i⌋, 0, levels), u_i = (words[i] >> 8)·2^-24:
    the plain quantizer's stochastic rounding in one pass.

    Every operation is float32 (x, scale, offset, levels are float32) in the order
    numpy's passes take them (multiply, add the offset, add the uniform, floor, clip),
    so the result is bit for bit what those passes give; u_i is exact (a 24-bit
    integer times a power of two)."""
    step = np.float32(1.0 / 16777216.0)
    zero = np.float32(0.0)
    for i in range(x.size):
        y = x[i] * scale
        y = y + offset
        y = y + np.float32(words[i] >> np.uint32(8)) * step
        y = np.floor(y)
        if y < zero:
            y = zero
        elif y > levels:
            y = levels
        out[i] = y


Vector = npt.NDArray[Any]


def _ro(a: Vector) -> Vector:
    """A read-only view: numba compiles a loop once per argument type, and a read-only
    array is another type than a writable one; inputs always come in read-only, so
    each loop has one variant per dtype whatever the caller's array allowed."""
    v = a.view()
    v.flags.writeable = False
    return v


def hadamard_inplace(a: Vector) -> None:
    """a ← H·a for a contiguous, writable float vector of power-of-two length
    (unnormalised)."""
    _hadamard_inplace(a)


def signed_hadamard(
    x: Vector, sign_bytes: Vector, sign_table: Vector, scale: np.floating[Any], out: Vector
) -> None:
    """out ← H·(scale·D·pad(x)); see :func:`_signed_hadamard`."""
    _signed_hadamard(_ro(x), _ro(sign_bytes), _ro(sign_table), scale, out)


def apply_signs(v: Vector, sign_bytes: Vector, sign_table: Vector) -> None:
    """v ← D·v in place, D's signs as :func:`signed_hadamard` reads them."""
    _apply_signs(v, _ro(sign_bytes), _ro(sign_table))


def squared_norm(x: Vector) -> float:
    """Σ x[i]² in float64, in a fixed order, on the calling thread (numpy's ``x @ x`` is
    an OpenBLAS dot whose worker threads spin after it on a shared machine); see
    :func:`_squared_norm`."""
    return float(_squared_norm(_ro(x)))


def round_draw(y: Vector, words: Vector, ints: Vector) -> tuple[float, int]:
    """One draw of stochastic rounding into ``ints``; see :func:`_round_draw`."""
    total, ties = _round_draw(_ro(y), _ro(words), ints)
    return float(total), int(ties)


def add_noise_and_wrap(
    ints: Vector,
    words: Vector,
    guide: Vector,
    shift: int,
    open_value: int,
    mask: int,
    ring: Vector,
    opens: Vector,
) -> int:
    """The noise lookup and the wrap into ``ring``; see :func:`_add_noise_and_wrap`."""
    return int(
        _add_noise_and_wrap(ints, _ro(words), _ro(guide), shift, open_value, mask, ring, opens)
    )


def quantize_round(
    x: Vector, words: Vector, scale: np.float32, offset: np.float32, levels: int, out: Vector
) -> None:
    """The plain quantizer's rounding pass into ``out``; see :func:`_quantize_round`."""
    _quantize_round(_ro(x), _ro(words), scale, offset, np.float32(levels), out)


def warm() -> int:
    """Compile (or load from the cache) every type combination fedsec calls these loops
    with, so that no process pays a compilation at its first round: the float32 and
    float64 transforms, the decoder's sign flip, the rounding pass, the plain
    quantizer's rounding into every ring dtype, and the noise pass for both guide dtypes
    and every ring dtype.  Returns how many combinations it ran.
    ``make`` runs it once after installing (``python -m fedsec.crypto.kernels``)."""
    count = 0
    signs = np.zeros(2, dtype=np.uint8)
    for out_dtype, in_dtypes in (
        (np.float64, (np.float64, np.float32)),
        (np.float32, (np.float32,)),
    ):
        table = np.ones((256, 8), dtype=out_dtype)
        for in_dtype in in_dtypes:
            x = np.ones(16, dtype=in_dtype)
            signed_hadamard(x, signs, table, out_dtype(1.0), np.empty(16, dtype=out_dtype))
            squared_norm(x)
            count += 2
    hadamard_inplace(np.ones(16))
    apply_signs(np.ones(32)[:16], signs, np.ones((256, 8)))
    count += 1
    y = np.linspace(-3.0, 3.0, 16)
    words = np.arange(16, dtype="<u4")
    ints = np.empty(16, dtype=np.int64)
    opens = np.empty(16, dtype=np.int64)
    round_draw(y, words, ints)
    count += 2
    for ring_code in ("<u1", "<u2", "<u4", "<u8"):
        x32 = y.astype(np.float32)
        quantize_round(
            x32, words, np.float32(1.0), np.float32(3.0), 7, np.empty(16, dtype=ring_code)
        )
        count += 1
    for guide_dtype in (np.int16, np.int32):
        guide = np.zeros(1 << 12, dtype=guide_dtype)
        for ring_code in ("<u1", "<u2", "<u4", "<u8"):
            ring = np.empty(16, dtype=ring_code)
            add_noise_and_wrap(
                ints, words, guide, 20, int(np.iinfo(guide_dtype).min), 255, ring, opens
            )
            count += 1
    return count


if __name__ == "__main__":
    from fedsec.crypto import packing

    print(f"fedsec.crypto.kernels: {warm()} loop variants compiled or loaded")
    print(f"fedsec.crypto.packing: {packing.warm()} width loops compiled or loaded")
