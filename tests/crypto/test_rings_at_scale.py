"""Rings and noise for 1,000-10,000 summands: every ring the rules pick holds the
worst-case sum of that many members without wrapping, and a configuration whose sum
could wrap is refused at construction with the numbers, never summed silently."""

from __future__ import annotations

import os

import numpy as np
import pytest

from fedsec.crypto.discretize import DdpSpec, decode_sum, encode, to_ring, wrap_count
from fedsec.crypto.errors import QuantizationError
from fedsec.crypto.quantize import (
    MAX_BITS,
    MAX_RING_BITS,
    MIN_BITS,
    QuantSpec,
    default_ring_bits,
    dequantize_sum,
    ring_from_integers,
)
from fedsec.protocol.ring_width import weight_digit_bits

# around the powers of two where the headroom grows by a bit, up to 10,000
MEMBERS = (1_000, 1_024, 1_025, 4_096, 4_097, 10_000)


@pytest.mark.parametrize("members", MEMBERS)
@pytest.mark.parametrize("bits", range(MIN_BITS, MAX_BITS + 1))
def test_the_default_ring_holds_every_member_at_either_extreme(members: int, bits: int) -> None:
    spec = QuantSpec(bits=bits, clip=1.0, ring_bits=default_ring_bits(bits, members))
    assert spec.max_members() >= members
    # every member at the top level (+clip, weight 1) and at the bottom (-clip, weight 0)
    for level, value, weight in ((spec.levels, 1.0, members), (0, -1.0, 0)):
        ints = np.full(3, level * members, dtype=np.int64)
        ints[-1] = spec.levels * members if weight else 0
        total, weights = dequantize_sum(ring_from_integers(ints, spec), members, spec)
        assert weights == pytest.approx(weight)
        np.testing.assert_allclose(total, members * value, rtol=0, atol=1e-9 * members)


@pytest.mark.parametrize("members", MEMBERS)
def test_a_ring_one_bit_short_is_refused_with_the_numbers(members: int) -> None:
    # the ring of half the members: dequantizing the full cohort's sum would wrap
    bits = 8
    short = QuantSpec(bits=bits, clip=1.0, ring_bits=default_ring_bits(bits, members) - 1)
    if short.max_members() >= members:
        pytest.skip("a power of two: the smaller ring still holds this cohort")
    with pytest.raises(QuantizationError, match=f"{members} members do not fit ring"):
        dequantize_sum(np.zeros(3, dtype=short.dtype), members, short)


@pytest.mark.parametrize("members", MEMBERS)
def test_weight_digits_fit_the_ring_or_are_none(members: int) -> None:
    for ring_bits in range(2, MAX_RING_BITS + 1):
        q = weight_digit_bits(members, 16, ring_bits)
        if q:
            assert members * ((1 << q) - 1) < 1 << ring_bits
        else:  # not even one bit: the codec refuses the round (tested in test_compat)
            assert members >= 1 << ring_bits


@pytest.mark.parametrize("members", (1_000, 10_000))
def test_distributed_dp_sizes_or_refuses_its_ring_at_scale(members: int) -> None:
    sized = 0
    for ring_bits in range(12, 33):
        try:
            spec = DdpSpec(
                dim=1000,
                ring_bits=ring_bits,
                clip=1.0,
                sensitivity=1.0,
                noise_multiplier=1.0,
                min_survivors=members * 9 // 10,
                max_members=members,
            )
        except QuantizationError as exc:
            # the refusal names the ring and the members it could not hold
            assert str(ring_bits) in str(exc) and str(members) in str(exc)
            continue
        sized += 1
        assert spec.wrap_bound() < 1e-3
        assert spec.effective_noise_multiplier(members * 9 // 10) >= 1.0
    assert sized, "no ring up to 32 bits holds distributed DP at this scale"


def test_two_thousand_noisy_members_sum_without_a_wrap() -> None:
    members, dim = 2_000, 16
    spec = DdpSpec(
        dim=dim,
        ring_bits=24,
        clip=1.0,
        sensitivity=1.0,
        noise_multiplier=1.0,
        min_survivors=members,
        max_members=members,
    )
    shared = os.urandom(32)
    rng = np.random.default_rng(0)
    exact = np.zeros(dim)
    ring_total = np.zeros(spec.padded, dtype=np.int64)
    for _ in range(members):
        x = rng.uniform(-1, 1, dim)
        x *= 0.99 / np.linalg.norm(x)  # at the clip, the largest a member sends
        exact += x
        encoded = encode(x, spec, shared, os.urandom(32), integers=True)
        assert encoded.integers is not None
        ring_total += encoded.integers
    assert wrap_count(ring_total, spec.ring_bits) == 0
    decoded = decode_sum(to_ring(ring_total, spec.ring_bits), spec, shared)
    # the error is the noise: within 6 of its standard deviations in every coordinate
    assert np.max(np.abs(decoded - exact)) < 6 * spec.noise_stddev(members)
