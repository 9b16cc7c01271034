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
    RingSum,
    pack,
    packed_size,
    ring_dtype,
    unpack,
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


@settings(max_examples=120, deadline=None)
@given(
    st.integers(2, MAX_RING_BITS),
    st.one_of(st.integers(0, 300), st.sampled_from([63, 64, 65, 127, 128, 129, 64 * 7 + 1])),
    st.integers(1, 6),
    st.integers(0, 2**32),
)
def test_a_ring_sum_is_the_sum_of_the_unpacked_vectors_mod_the_ring(
    ring_bits: int, count: int, vectors: int, seed: int
) -> None:
    # widths below 16 sum packed (field-wise carries across words), the others unpacked
    total = RingSum(count, ring_bits)
    expected = np.zeros(count, dtype=object)
    for k in range(vectors):
        values = _random_ring(count, ring_bits, seed + k)
        total.add(pack(values, ring_bits))
        expected += values.astype(object)
    mask = (1 << ring_bits) - 1
    got = total.total()
    assert got.dtype == ring_dtype(ring_bits)
    assert [int(v) & mask for v in got] == [int(v) & mask for v in expected]


@pytest.mark.parametrize("ring_bits", [9, 13, 15])
def test_a_packed_sum_carries_inside_straddling_fields_and_never_across(ring_bits: int) -> None:
    # every element at its maximum: each field's sum wraps, and the fields that straddle
    # two words carry from one word into the next without touching their neighbours
    count = 3 * 64 + 5
    top = np.full(count, (1 << ring_bits) - 1, dtype=ring_dtype(ring_bits))
    total = RingSum(count, ring_bits)
    for _ in range(3):
        total.add(pack(top, ring_bits))
    expected = (3 * ((1 << ring_bits) - 1)) % (1 << ring_bits)
    assert set(total.total().tolist()) == {expected}


@pytest.mark.parametrize("ring_bits", [3, 12, 15, 16, 23, 33])
def test_a_ring_sum_refuses_a_bad_vector_and_stays_unchanged(ring_bits: int) -> None:
    count = 77
    total = RingSum(count, ring_bits)
    total.add(pack(_random_ring(count, ring_bits, 5), ring_bits))
    before = total.total()
    raw = pack(_random_ring(count, ring_bits, 6), ring_bits)
    bad = [raw[:-1], raw + b"\x00"]
    if (count * ring_bits) % 8:
        bad.append(raw[:-1] + bytes([raw[-1] | 0x80]))  # a padding bit set
    for vector in bad:
        with pytest.raises(BadVector):
            total.add(vector)
        np.testing.assert_array_equal(total.total(), before)


@pytest.mark.parametrize("ring_bits", [9, 16, 23])
def test_taking_a_ring_sum_gives_its_total_and_ends_it(ring_bits: int) -> None:
    # the server's last use: the accumulator is given back, so nothing more is summed
    count = 3 * 64 + 5
    total = RingSum(count, ring_bits)
    raw = pack(_random_ring(count, ring_bits, 7), ring_bits)
    total.add(raw)
    expected = total.total()
    np.testing.assert_array_equal(total.take(), expected)
    for refused in (lambda: total.add(raw), total.total, total.take):
        with pytest.raises(ValueError, match="taken"):
            refused()


def test_warm_compiles_every_width_but_the_dtype_ones() -> None:
    assert packing.warm() == 2 * len(WIDTHS)
