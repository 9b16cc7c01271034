"""The compiled bit packing: every width's loop writes and reads exactly the bit string
the wire defines (element i at bits [i·m, (i + 1)·m), little-endian), and a running sum
takes a packed vector exactly as unpacking it and adding would."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsec.crypto import packing
from fedsec.crypto.quantize import (
    MAX_RING_BITS,
    pack,
    packed_size,
    ring_dtype,
    unpack,
    unpack_add,
)
from fedsec.errors import BadVector

WIDTHS = [m for m in range(2, MAX_RING_BITS + 1) if m not in (8, 16, 32)]
# around the 64-element blocks: none, one, one and a tail, several
COUNTS = (1, 63, 64, 65, 127, 128, 200)


def _random_ring(count: int, ring_bits: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 1 << ring_bits, size=count, dtype=np.uint64).astype(
        ring_dtype(ring_bits)
    )


def _pack_by_hand(values: np.ndarray, ring_bits: int) -> bytes:
    acc = 0
    for i, v in enumerate(values):
        acc |= int(v) << (i * ring_bits)
    return acc.to_bytes(packed_size(len(values), ring_bits), "little")


@pytest.mark.parametrize("ring_bits", WIDTHS)
def test_every_width_packs_the_wire_bit_string_across_blocks(ring_bits: int) -> None:
    for count in COUNTS:
        values = _random_ring(count, ring_bits, count * 1000 + ring_bits)
        values[-1] = (1 << ring_bits) - 1  # the top value, in the tail or a block's end
        raw = pack(values, ring_bits)
        assert raw == _pack_by_hand(values, ring_bits)
        np.testing.assert_array_equal(unpack(raw, count, ring_bits), values)


@pytest.mark.parametrize("ring_bits", WIDTHS)
def test_a_value_outside_the_ring_does_not_spill_into_its_neighbours(ring_bits: int) -> None:
    values = _random_ring(130, ring_bits, ring_bits).astype(np.uint64)
    wide = values | np.uint64(1 << ring_bits)  # one bit above the ring in every element
    raw = np.zeros(packed_size(values.size, ring_bits), dtype=np.uint8)
    packing.pack_into(wide.astype(ring_dtype(ring_bits)), raw, ring_bits)
    expected = (values & np.uint64((1 << ring_bits) - 1)).astype(ring_dtype(ring_bits))
    assert raw.tobytes() == pack(expected, ring_bits)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, MAX_RING_BITS),
    st.integers(0, 300),
    st.integers(1, 5),
    st.integers(0, 2**32),
)
def test_unpack_add_is_the_running_sum_of_the_unpacked_vectors(
    ring_bits: int, count: int, vectors: int, seed: int
) -> None:
    dt = ring_dtype(ring_bits)
    total = np.zeros(count, dtype=dt)
    expected = np.zeros(count, dtype=object)
    for k in range(vectors):
        values = _random_ring(count, ring_bits, seed + k)
        unpack_add(total, pack(values, ring_bits), ring_bits)
        expected += values.astype(object)
    # wraps in the dtype: the same residue mod 2^ring_bits as the exact sum
    mask = (1 << ring_bits) - 1
    assert [int(v) & mask for v in total] == [int(v) & mask for v in expected]


@pytest.mark.parametrize("ring_bits", [3, 12, 15, 16, 23, 33])
def test_unpack_add_refuses_a_bad_vector_and_leaves_the_sum_unchanged(ring_bits: int) -> None:
    count = 77
    total = _random_ring(count, ring_bits, 5)
    before = total.copy()
    raw = pack(_random_ring(count, ring_bits, 6), ring_bits)
    bad = [raw[:-1], raw + b"\x00"]
    if (count * ring_bits) % 8:
        bad.append(raw[:-1] + bytes([raw[-1] | 0x80]))  # a padding bit set
    for vector in bad:
        with pytest.raises(BadVector):
            unpack_add(total, vector, ring_bits)
        np.testing.assert_array_equal(total, before)
    with pytest.raises(BadVector, match="running sum"):
        unpack_add(total.astype(np.int64), raw, ring_bits)  # not the ring's dtype


def test_warm_compiles_every_width_but_the_dtype_ones() -> None:
    assert packing.warm() == 2 * len(WIDTHS)
