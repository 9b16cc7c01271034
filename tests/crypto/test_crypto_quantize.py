"""Clip, weight, stochastic rounding into the ring, and exact bit packing for the wire."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedsec.crypto.quantize import (
    MAX_RING_BITS,
    QuantSpec,
    clip_l2,
    default_ring_bits,
    dequantize_one,
    dequantize_sum,
    pack,
    packed_size,
    quantize,
    ring_dtype,
    unpack,
)
from fedsec.errors import BadVector, QuantizationError

# float32 arithmetic on y = (w·x + C)·L/(2C) costs a few ulps of y; at b = 16 (y < 2^16)
# one ulp is 2^-8 of a level.  The documented bound is "within one step"; allow that slack.
STEP_SLACK = 1.0 + 2.0**-6


def _seed(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "big")).digest()


specs = st.builds(
    lambda b, clip, extra: QuantSpec(b, clip, b + extra),
    st.integers(2, 16),
    st.sampled_from([0.01, 0.5, 1.0, 3.0, 100.0]),
    st.integers(1, 8),
)
updates = hnp.arrays(
    np.float32,
    st.integers(1, 40),
    elements=st.floats(-1e6, 1e6, width=32, allow_nan=False, allow_infinity=False),
)
weights = st.floats(0.0, 1.0, allow_nan=False)


@settings(max_examples=80, deadline=None)
@given(updates, st.sampled_from([0.01, 1.0, 7.5]))
def test_clip_norm_respected(delta: np.ndarray, clip: float) -> None:
    out = clip_l2(delta, clip)
    norm = float(np.linalg.norm(out.astype(np.float64)))
    assert norm <= clip * (1 + 1e-5)
    original = float(np.linalg.norm(delta.astype(np.float64)))
    if original <= clip:
        np.testing.assert_array_equal(out, delta)  # small updates pass untouched
    else:
        # direction kept: out is a positive multiple of delta
        np.testing.assert_allclose(out, delta * (clip / original), rtol=1e-4, atol=1e-30)


def test_clip_huge_finite_update_is_clipped_not_refused() -> None:
    delta = np.full(5, 1e20, dtype=np.float32)  # squares overflow float32
    out = clip_l2(delta, 2.0)
    assert float(np.linalg.norm(out.astype(np.float64))) == pytest.approx(2.0, rel=1e-5)
    spec = QuantSpec(8, 2.0, 12)
    q = quantize(delta, 1.0, spec, _seed(0))
    deq, _ = dequantize_one(q, spec)
    np.testing.assert_allclose(deq, 2.0 / math.sqrt(5), atol=spec.step())


@settings(max_examples=80, deadline=None)
@given(updates, weights, specs, st.binary(min_size=32, max_size=32))
def test_quantized_range_weight_last_and_within_one_step(
    delta: np.ndarray, weight: float, spec: QuantSpec, seed: bytes
) -> None:
    q = quantize(delta, weight, spec, seed)
    assert q.dtype == spec.dtype
    assert q.shape == (delta.size + 1,)
    assert int(q.max()) <= spec.levels
    assert int(q.min()) >= 0
    # weight is the last coordinate, within one level of w·L
    assert abs(int(q[-1]) - weight * spec.levels) < 1.0
    deq, w = dequantize_one(q, spec)
    assert abs(w - weight) < 1.0 / spec.levels
    exact = weight * clip_l2(delta, spec.clip).astype(np.float64)
    assert np.all(np.abs(deq - exact) < spec.step() * STEP_SLACK)


@settings(max_examples=20, deadline=None)
@given(updates, weights, specs, st.binary(min_size=32, max_size=32))
def test_quantize_deterministic_in_seed_and_keeps_input(
    delta: np.ndarray, weight: float, spec: QuantSpec, seed: bytes
) -> None:
    before = delta.copy()
    a = quantize(delta, weight, spec, seed)
    np.testing.assert_array_equal(delta, before)
    np.testing.assert_array_equal(a, quantize(delta, weight, spec, seed))


def test_stochastic_rounding_is_unbiased() -> None:
    spec = QuantSpec(4, 1.0, 8)  # coarse: 15 levels, step 2/15
    rng = np.random.default_rng(1)
    delta = (rng.uniform(-1, 1, 32) / 8).astype(np.float32)  # norm < 1: not clipped
    assert float(np.linalg.norm(delta)) < 1.0
    weight = 0.37
    runs = 400
    total = np.zeros(delta.size)
    wsum = 0.0
    for i in range(runs):
        deq, w = dequantize_one(quantize(delta, weight, spec, _seed(i)), spec)
        total += deq
        wsum += w
    mean = total / runs
    # each draw is within one step; the sd of the mean is <= step/2/sqrt(runs) = 0.0033
    np.testing.assert_allclose(mean, weight * delta, atol=5 * spec.step() / 2 / math.sqrt(runs))
    assert abs(wsum / runs - weight) < 5 / spec.levels / 2 / math.sqrt(runs)
    # and it is genuinely stochastic: not the same value every time
    assert len({quantize(delta, weight, spec, _seed(i)).tobytes() for i in range(5)}) > 1


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 12),
    st.integers(1, 20),
    st.integers(2, 16),
    st.data(),
)
def test_dequantize_sum_within_n_steps(n: int, d: int, bits: int, data: st.DataObject) -> None:
    spec = QuantSpec(bits, 1.0, default_ring_bits(bits, n))
    deltas = [
        data.draw(
            hnp.arrays(np.float32, d, elements=st.floats(-3, 3, width=32)),
        )
        for _ in range(n)
    ]
    ws = [data.draw(weights) for _ in range(n)]
    qs = [quantize(x, w, spec, _seed(i)) for i, (x, w) in enumerate(zip(deltas, ws, strict=True))]
    ring = np.zeros(d + 1, dtype=spec.dtype)
    for q in qs:
        ring += q
    ring &= spec.dtype.type(spec.ring_mask)
    # no wrap: the ring sum equals the integer sum
    assert [int(v) for v in ring] == [sum(int(q[i]) for q in qs) for i in range(d + 1)]
    total, wsum = dequantize_sum(ring, n, spec)
    exact = sum(w * clip_l2(x, 1.0).astype(np.float64) for x, w in zip(deltas, ws, strict=True))
    assert np.all(np.abs(total - exact) < n * spec.step() * STEP_SLACK)
    assert abs(wsum - sum(ws)) < n / spec.levels


def test_nan_and_inf_update_refused() -> None:
    spec = QuantSpec(8, 1.0, 12)
    for bad in (np.nan, np.inf, -np.inf):
        delta = np.array([0.1, bad, 0.2], dtype=np.float32)
        before = delta.copy()
        with pytest.raises(QuantizationError):
            quantize(delta, 1.0, spec, _seed(0))
        np.testing.assert_array_equal(delta, before)
        with pytest.raises(QuantizationError):
            clip_l2(delta, 1.0)


@pytest.mark.parametrize("weight", [-0.01, 1.01, math.nan, math.inf, -math.inf])
def test_weight_outside_unit_interval_refused(weight: float) -> None:
    with pytest.raises(QuantizationError):
        quantize(np.zeros(3, dtype=np.float32), weight, QuantSpec(8, 1.0, 12), _seed(0))


@pytest.mark.parametrize(
    ("bits", "clip", "ring_bits"),
    [
        (1, 1.0, 8),
        (17, 1.0, 40),
        (8, 0.0, 12),
        (8, -1.0, 12),
        (8, math.nan, 12),
        (8, 1.0, 8),
        (8, 1.0, 57),
    ],
)
def test_bad_spec_refused(bits: int, clip: float, ring_bits: int) -> None:
    with pytest.raises(QuantizationError):
        QuantSpec(bits, clip, ring_bits)


def test_default_ring_bits_never_wraps() -> None:
    for bits in (2, 8, 16):
        for n in (1, 2, 3, 7, 8, 9, 100, 1000):
            spec = QuantSpec(bits, 1.0, default_ring_bits(bits, n))
            assert spec.max_members() >= n
            assert n * spec.levels < 1 << spec.ring_bits
    with pytest.raises(QuantizationError):
        default_ring_bits(8, 0)


def test_dequantize_sum_refuses_too_many_members() -> None:
    spec = QuantSpec(8, 1.0, 10)  # holds 4 members
    assert spec.max_members() == 4
    with pytest.raises(QuantizationError):
        dequantize_sum(np.zeros(3, dtype=spec.dtype), 5, spec)
    with pytest.raises(QuantizationError):
        dequantize_sum(np.zeros(3, dtype=spec.dtype), 0, spec)


@pytest.mark.parametrize(
    ("bits", "dtype"),
    [
        (1, "<u1"),
        (8, "<u1"),
        (9, "<u2"),
        (16, "<u2"),
        (17, "<u4"),
        (32, "<u4"),
        (33, "<u8"),
        (56, "<u8"),
    ],
)
def test_ring_dtype(bits: int, dtype: str) -> None:
    assert ring_dtype(bits) == np.dtype(dtype)


def test_ring_dtype_out_of_range() -> None:
    for bits in (0, MAX_RING_BITS + 1):
        with pytest.raises(QuantizationError):
            ring_dtype(bits)


# -- packing -----------------------------------------------------------------------------------


def _random_ring(count: int, ring_bits: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 1 << ring_bits, size=count, dtype=np.uint64)).astype(
        ring_dtype(ring_bits)
    )


def _pack_by_hand(values: np.ndarray, ring_bits: int) -> bytes:
    acc = 0
    for i, v in enumerate(values):
        acc |= int(v) << (i * ring_bits)
    return acc.to_bytes(packed_size(len(values), ring_bits), "little")


@pytest.mark.parametrize("ring_bits", range(2, MAX_RING_BITS + 1))
def test_pack_round_trip_every_width(ring_bits: int) -> None:
    for count in (1, 3, 7, 8, 9, 15, 17, 31, 64, 101):
        values = _random_ring(count, ring_bits, count * 100 + ring_bits)
        values[0] = (1 << ring_bits) - 1  # extremes survive
        raw = pack(values, ring_bits)
        assert len(raw) == packed_size(count, ring_bits) == -(-count * ring_bits // 8)
        # exactly m bits per element, little-endian bit order
        assert raw == _pack_by_hand(values, ring_bits)
        np.testing.assert_array_equal(unpack(raw, count, ring_bits), values)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, MAX_RING_BITS), st.integers(0, 70), st.integers(0, 2**32))
def test_pack_round_trip_property(ring_bits: int, count: int, seed: int) -> None:
    values = _random_ring(count, ring_bits, seed)
    out = unpack(pack(values, ring_bits), count, ring_bits)
    assert out.dtype == ring_dtype(ring_bits)
    np.testing.assert_array_equal(out, values)


@pytest.mark.parametrize("ring_bits", [3, 8, 12, 16, 33, 56])
def test_unpack_refuses_wrong_length(ring_bits: int) -> None:
    raw = pack(_random_ring(9, ring_bits, 1), ring_bits)
    for bad in (raw[:-1], raw + b"\x00", b""):
        with pytest.raises(BadVector):
            unpack(bad, 9, ring_bits)


@pytest.mark.parametrize("ring_bits", [3, 5, 7, 9, 12, 13, 33, 55])
def test_unpack_refuses_nonzero_padding(ring_bits: int) -> None:
    count = 9
    assert (count * ring_bits) % 8 != 0
    raw = bytearray(pack(_random_ring(count, ring_bits, 2), ring_bits))
    used = (count * ring_bits) % 8
    for bit in range(used, 8):
        tampered = bytearray(raw)
        tampered[-1] |= 1 << bit
        with pytest.raises(BadVector, match="padding"):
            unpack(bytes(tampered), count, ring_bits)
    np.testing.assert_array_equal(
        unpack(bytes(raw), count, ring_bits), _random_ring(count, ring_bits, 2)
    )


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 16), st.integers(1, 12), st.integers(1, 30), st.integers(0, 2**32))
def test_quantized_packed_and_summed(bits: int, n: int, d: int, seed: int) -> None:
    """The wire form of quantized inputs round-trips at the default ring size."""
    assume(default_ring_bits(bits, n) <= MAX_RING_BITS)
    spec = QuantSpec(bits, 1.0, default_ring_bits(bits, n))
    rng = np.random.default_rng(seed)
    q = quantize(rng.normal(size=d).astype(np.float32), 0.5, spec, _seed(seed))
    np.testing.assert_array_equal(unpack(pack(q, spec.ring_bits), d + 1, spec.ring_bits), q)


def _quantize_in_numpy_passes(
    delta: np.ndarray, weight: float, spec: QuantSpec, seed: bytes
) -> np.ndarray:
    """The quantizer as numpy passes (how it was written before the compiled pass):
    the compiled rounding must give the same ring vector bit for bit."""
    from fedsec.crypto import prg
    from fedsec.crypto.quantize import _l2_norm

    x = np.asarray(delta, dtype=np.float32).reshape(-1)
    norm = _l2_norm(x)
    shrink = spec.clip / norm if norm > spec.clip else 1.0
    scale = spec.levels / (2.0 * spec.clip)
    y = np.multiply(x, np.float32(shrink * weight * scale), dtype=np.float32)
    y += np.float32(spec.clip * scale)
    y += prg.uniform01(seed, b"stochastic-rounding", x.size)
    np.floor(y, out=y)
    np.clip(y, 0, spec.levels, out=y)
    return y.astype(spec.dtype)


@settings(max_examples=120, deadline=None)
@given(updates, weights, specs, st.binary(min_size=32, max_size=32))
def test_the_compiled_rounding_is_numpys_passes_bit_for_bit(
    delta: np.ndarray, weight: float, spec: QuantSpec, seed: bytes
) -> None:
    q = quantize(delta, weight, spec, seed)
    np.testing.assert_array_equal(q[:-1], _quantize_in_numpy_passes(delta, weight, spec, seed))


@pytest.mark.parametrize("bits", [2, 8, 16])
def test_the_compiled_rounding_matches_on_a_long_update_in_every_ring_dtype(bits: int) -> None:
    delta = np.random.default_rng(bits).standard_normal(20_000).astype(np.float32)
    for ring_bits in (bits + 1, 16 if bits < 16 else 17, 32, 40):
        spec = QuantSpec(bits, 150.0, ring_bits)  # the norm (about 141) below the clip
        for weight in (1.0, 0.37, 0.0):
            expected = _quantize_in_numpy_passes(delta, weight, spec, _seed(bits))
            np.testing.assert_array_equal(quantize(delta, weight, spec, _seed(bits))[:-1], expected)
