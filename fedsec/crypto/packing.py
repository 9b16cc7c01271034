"""Compiled bit packing of ring vectors: m bits per element, little-endian bit order.

The wire form (:func:`fedsec.crypto.quantize.pack`) puts element i at bits
[i·m, (i + 1)·m) of one little-endian bit string.  Written as numpy column passes or
as one loop with a runtime width, (un)packing costs 1-4 ns an element, several times
the memory-speed add of the same vector that SecAgg+'s server does for every member:
a 15-bit ring then cost the server 8x its floor.  Here every width gets its own loop,
generated with the width as a constant: 64 elements are exactly m 64-bit words, so
each element of a block sits at a fixed word and shift, and with those constants the
compiler keeps a block in registers and vectorises the adds (0.2-0.3 ns an element).
The elements after the last whole block (fewer than 64) go through one loop with a
runtime width.

Widths 8, 16, 32 and 64 are a plain little-endian copy of the ring dtype and never
come here.  The loops check no bounds: the callers in :mod:`fedsec.crypto.quantize`
validate every length first.  Each loop is compiled on first use and cached beside
this file (the generated source is compiled as this file, under a name that carries
its width, so numba's cache keys it like any other function here).
"""

from __future__ import annotations

import functools
from typing import Any

import numba
import numpy as np
import numpy.typing as npt

BLOCK = 64  # elements per block: 64 elements of m bits are exactly m 64-bit words
MAX_WIDTH = 56  # s + m ≤ 63 for a shift s ≤ 7: an element spans at most 8 bytes

_jit = numba.njit(cache=True, nogil=True, boundscheck=False, fastmath=False)
_DTYPE_NAMES = ((8, "uint8"), (16, "uint16"), (32, "uint32"), (64, "uint64"))

Vector = npt.NDArray[Any]


def _dtype_name(width: int) -> str:
    return next(name for bits, name in _DTYPE_NAMES if width <= bits)


def _unpack_add_source(m: int) -> str:
    """acc[64b + e] += element e of block b, for every whole block."""
    mask = f"np.uint64({(1 << m) - 1:#x})"
    out = _dtype_name(m)
    lines = [
        f"def _unpack_add_{m}(acc, words, blocks):",
        "    for b in range(blocks):",
        f"        w = words[b * {m} : b * {m} + {m}]",
        f"        o = acc[b * {BLOCK} : b * {BLOCK} + {BLOCK}]",
    ]
    for e in range(BLOCK):
        a, s = divmod(e * m, 64)
        field = f"(w[{a}] >> np.uint64({s}))" if s else f"w[{a}]"
        if s + m > 64:  # the element continues in the next word
            field = f"({field} | (w[{a + 1}] << np.uint64({64 - s})))"
        lines.append(f"        o[{e}] += np.{out}({field} & {mask})")
    return "\n".join(lines) + "\n"


def _pack_source(m: int) -> str:
    """Word a of block b ← the bits of the elements that overlap it, each masked to m
    bits (a value outside the ring cannot spill into its neighbours)."""
    mask = f"np.uint64({(1 << m) - 1:#x})"
    lines = [
        f"def _pack_{m}(values, words, blocks):",
        "    for b in range(blocks):",
        f"        x = values[b * {BLOCK} : b * {BLOCK} + {BLOCK}]",
        f"        w = words[b * {m} : b * {m} + {m}]",
    ]
    for a in range(m):
        terms = []
        for e in range(BLOCK):
            p = e * m - 64 * a  # the element's first bit, relative to word a
            if p + m <= 0 or p >= 64:
                continue
            value = f"(np.uint64(x[{e}]) & {mask})"
            if p > 0:
                value = f"({value} << np.uint64({p}))"
            elif p < 0:  # the element began in the word before: its high bits
                value = f"({value} >> np.uint64({-p}))"
            terms.append(value)
        lines.append(f"        w[{a}] = " + " | ".join(terms))
    return "\n".join(lines) + "\n"


@functools.cache
def _block_loops(m: int) -> tuple[Any, Any]:
    """The compiled (unpack-add, pack) block loops of width m."""
    namespace = globals()
    for source in (_unpack_add_source(m), _pack_source(m)):
        exec(compile(source, __file__, "exec"), namespace)
    return _jit(namespace[f"_unpack_add_{m}"]), _jit(namespace[f"_pack_{m}"])


@_jit
def _unpack_add_tail(acc: Any, raw: Any, m: int, start: int) -> None:
    """acc[i] += element i for i in [start, acc.size), read byte by byte from raw (the
    whole packed vector)."""
    mask = np.uint64((1 << m) - 1)
    for i in range(start, acc.size):
        p = i * m
        first = p >> 3
        shift = p & 7
        last = min(raw.size, first + (shift + m + 7) // 8)
        v = np.uint64(0)
        for k in range(first, last):
            v |= np.uint64(raw[k]) << np.uint64(8 * (k - first))
        acc[i] += (v >> np.uint64(shift)) & mask


@_jit
def _pack_tail(values: Any, raw: Any, m: int, start: int) -> None:
    """OR elements [start, values.size) into raw (zero there), byte by byte."""
    mask = np.uint64((1 << m) - 1)
    for i in range(start, values.size):
        p = i * m
        first = p >> 3
        shift = p & 7
        v = (np.uint64(values[i]) & mask) << np.uint64(shift)
        for k in range(first, min(raw.size, first + (shift + m + 7) // 8)):
            raw[k] |= np.uint8((v >> np.uint64(8 * (k - first))) & np.uint64(0xFF))


# Widths below this sit in a uint8/uint16 dtype, whose add costs about half of unpacking
# m-bit fields out of 64-bit words; a running sum of such vectors stays packed and adds
# field-wise in place (:func:`packed_add`, ~the dtype's add).  From 17 bits on the ring's
# dtype is uint32, whose add already costs what unpacking does, and the sum is unpacked.
PACKED_SUM_BELOW = 16


# Blocks whose masks are laid out end to end for one pass of the packed add: a longer
# loop than one block's m words, which the compiler vectorises; 32 blocks of masks and
# carries (at most 3 x 32 x 56 words) stay in L1.
_MASK_BLOCKS = 32


@functools.cache
def _field_masks(m: int) -> tuple[Vector, Vector]:
    """Per word of :data:`_MASK_BLOCKS` blocks (m words = 64 elements each): the bits
    below each element's top bit, and the top bits."""
    tops = sum(1 << (e * m + m - 1) for e in range(BLOCK))
    high = np.array([(tops >> (64 * a)) & 0xFFFF_FFFF_FFFF_FFFF for a in range(m)], np.uint64)
    high = np.tile(high, _MASK_BLOCKS)
    return ~high, high


@_jit
def _packed_add(acc: Any, words: Any, low: Any, high: Any) -> None:
    """acc ← acc ⊞ words, each m-bit field added modulo 2^m in place; low/high are the
    masks of whole blocks laid end to end.

    With every field's top bit cleared, a field's sum fits its m bits, so the word add
    carries out of a word only inside a field that straddles it; that carry (the
    majority of the operands' and the sum's bit 63) goes into the next word.  A block
    of 64 fields ends on a word boundary, so no carry crosses blocks, and each span of
    the masks' length starts with none.  The top bits are the XOR of the operands' top
    bits and the carry that reached them.  The carries of a span are computed before
    any word of it changes.
    """
    span = low.size
    carry = np.zeros(span + 1, dtype=np.uint64)
    for base in range(0, acc.size, span):
        top = min(span, acc.size - base)
        o = acc[base : base + top]
        w = words[base : base + top]
        for j in range(top):
            xl = o[j] & low[j]
            yl = w[j] & low[j]
            carry[j + 1] = ((xl & yl) | ((xl | yl) & ~(xl + yl))) >> np.uint64(63)
        for j in range(top):
            x = o[j]
            y = w[j]
            o[j] = ((x & low[j]) + (y & low[j]) + carry[j]) ^ ((x ^ y) & high[j])


def packed_add(acc: Vector, raw: Vector, width: int) -> None:
    """acc ← acc ⊞ raw: the sum modulo 2^width of two vectors of ``width``-bit elements
    in the wire's packed form, without unpacking either.

    ``acc`` is a contiguous uint64 array of ⌈raw.size / 8⌉ words holding such a vector
    (zero padding); ``raw`` the uint8 wire bytes of another, zero padding checked by
    the caller; ``width`` is at most :data:`MAX_WIDTH`.
    """
    low, high = _field_masks(width)
    whole = (raw.size // 8) // width * width  # words of the whole blocks
    if whole:
        _packed_add(acc[:whole], _ro(raw[: whole * 8].view("<u8")), low, high)
    rest = raw[whole * 8 :]
    if rest.size:
        tail = np.zeros(acc.size - whole, dtype=np.uint64)
        tail.view(np.uint8)[: rest.size] = rest
        _packed_add(acc[whole:], _ro(tail), low, high)


def _ro(a: Vector) -> Vector:
    """A read-only view: one compiled variant per dtype whatever the caller's array
    allowed (see :func:`fedsec.crypto.kernels._ro`)."""
    v = a.view()
    v.flags.writeable = False
    return v


def unpack_add(acc: Vector, raw: Vector, width: int) -> None:
    """acc += the ``acc.size`` elements of ``width`` bits packed in ``raw``, wrapping in
    acc's dtype.

    ``acc`` is a contiguous array of the width's ring dtype; ``raw`` a uint8 array of
    at least ⌈acc.size·width/8⌉ bytes; ``width`` is not 8, 16, 32 or 64 and at most
    :data:`MAX_WIDTH`.  Nothing is checked here: :mod:`fedsec.crypto.quantize` does.
    """
    blocks = acc.size // BLOCK
    if blocks:
        words = raw[: blocks * width * 8].view("<u8")
        _block_loops(width)[0](acc, _ro(words), blocks)
    if blocks * BLOCK < acc.size:
        _unpack_add_tail(acc, _ro(raw), width, blocks * BLOCK)


def pack_into(values: Vector, raw: Vector, width: int) -> None:
    """raw ← ``values`` packed at ``width`` bits each (each value masked to the width).

    ``raw`` is a zeroed, writable uint8 array of exactly ⌈values.size·width/8⌉ bytes;
    ``values`` a contiguous array of the width's ring dtype; the width as for
    :func:`unpack_add`.
    """
    blocks = values.size // BLOCK
    if blocks:
        words = raw[: blocks * width * 8].view("<u8")
        _block_loops(width)[1](_ro(values), words, blocks)
    if blocks * BLOCK < values.size:
        _pack_tail(_ro(values), raw, width, blocks * BLOCK)


def warm(widths: range = range(2, MAX_WIDTH + 1)) -> int:
    """Compile (or load from the cache) the loops of every width in ``widths`` that is
    not a dtype's, for its ring dtype; returns how many loops ran."""
    count = 0
    for width in widths:
        if width in (8, 16, 32, 64):
            continue
        dtype = np.dtype(_dtype_name(width))
        values = np.arange(BLOCK + 3, dtype=dtype)
        raw = np.zeros((values.size * width + 7) // 8, dtype=np.uint8)
        pack_into(values, raw, width)
        unpack_add(np.zeros_like(values), raw, width)
        count += 2
        if width < PACKED_SUM_BELOW:
            packed_add(np.zeros((raw.size + 7) // 8, dtype=np.uint64), raw, width)
    return count
