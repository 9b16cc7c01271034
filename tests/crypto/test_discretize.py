"""Distributed DP discretisation: exact integer sums, bounded rounding, the noise's
variance, the wrap bound and the bit-budget refusals."""

from __future__ import annotations

import hashlib
import math
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import special

from fedsec.crypto import discretize as dz
from fedsec.crypto import prg
from fedsec.crypto.discretize import DdpSpec, decode_sum, encode, recentre, skellam, to_ring
from fedsec.crypto.rotation import rotate
from fedsec.errors import QuantizationError

SHARED = hashlib.sha256(b"round spec").digest()


def _secret(i: int) -> bytes:
    return hashlib.sha256(b"member %d" % i).digest()


def _spec(**overrides: float) -> DdpSpec:
    values: dict[str, float] = dict(
        dim=300,
        ring_bits=24,
        clip=5.0,
        sensitivity=1.0,
        noise_multiplier=1.0,
        min_survivors=3,
        max_members=4,
    )
    values.update(overrides)
    return DdpSpec(**values)  # type: ignore[arg-type]


def _members(n: int, d: int, seed: int, norm: float) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        v = rng.normal(size=d)
        out.append(v * (norm / np.linalg.norm(v)))
    return out


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(0, 2**32), st.floats(0.1, 9.0))
def test_the_ring_sum_is_the_exact_integer_sum_and_decodes_within_the_bound(
    n: int, seed: int, norm: float
) -> None:
    spec = _spec(noise_multiplier=0.0)
    xs = _members(n, spec.dim, seed, norm)
    encoded = [encode(x, spec, SHARED, _secret(i), integers=True) for i, x in enumerate(xs)]
    ring = sum(e.ring.astype(np.uint64) for e in encoded)
    ints = sum(e.integers for e in encoded)
    np.testing.assert_array_equal(recentre(ring, spec.ring_bits), ints)  # no wrap here
    # noise off: the error is the unrotated rounding error, each member's bounded in L2
    clipped = sum(x * min(1.0, spec.clip / np.linalg.norm(x)) for x in xs)
    error = np.linalg.norm(decode_sum(ring, spec, SHARED) - clipped)
    assert error <= n * spec.rounding_bound / spec.scale * (1 + 1e-9)
    assert all(e.clipped == (norm > spec.clip) for e in encoded)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32), st.floats(0.0, 20.0))
def test_conditional_rounding_error_never_exceeds_its_bound(seed: int, norm: float) -> None:
    spec = _spec(noise_multiplier=0.0)
    x = _members(1, spec.dim, seed, norm)[0]
    enc = encode(x, spec, SHARED, _secret(seed), integers=True)
    target = rotate(x * min(1.0, spec.clip / max(norm, 1e-300)), SHARED) * spec.scale
    assert np.linalg.norm(enc.integers - target) <= spec.rounding_bound
    assert np.all(np.abs(enc.integers - target) < 1)


def test_skellam_noise_has_the_target_variance_and_comes_from_the_seed() -> None:
    count = 200_000
    for variance in (0.7, 40.0, 2.5e5):
        v = skellam(_secret(1), variance, count).astype(np.float64)
        stderr = variance * math.sqrt(2 / count) * 1.5  # excess kurtosis of Skellam < 0.5
        assert abs(v.var() - variance) < 5 * stderr, variance
        assert abs(v.mean()) < 5 * math.sqrt(variance / count)
    np.testing.assert_array_equal(skellam(_secret(1), 9.0, 50), skellam(_secret(1), 9.0, 50))
    assert not np.array_equal(skellam(_secret(1), 9.0, 50), skellam(_secret(2), 9.0, 50))


def test_a_variance_beyond_the_bessel_functions_range_is_still_skellam() -> None:
    """scipy's ive gives NaN above 2^30: a table from it once made every draw the same
    value (noise that is no noise).  Such a variance is drawn as a sum of parts."""
    variance, count = 3.0e9, 100_000
    assert variance > 2 * dz.MAX_TABLE_VARIANCE
    v = skellam(_secret(3), variance, count).astype(np.float64)
    stderr = variance * math.sqrt(2 / count) * 1.5
    assert abs(v.var() - variance) < 5 * stderr
    assert abs(v.mean()) < 5 * math.sqrt(variance / count)
    assert len(np.unique(v)) > count // 2
    with pytest.raises(QuantizationError, match="not a distribution"):
        dz._skellam_table(2.0**31)  # ive's NaN is refused, never sampled from


def test_the_summed_noise_matches_the_target_for_the_survivors() -> None:
    spec = _spec(dim=2000, ring_bits=28, clip=2.0, noise_multiplier=0.8)
    xs = _members(4, spec.dim, 7, 1.5)
    residuals = []
    for trial in range(4):
        ring = sum(
            encode(x, spec, SHARED, _secret(100 * trial + i)).ring.astype(np.uint64)
            for i, x in enumerate(xs)
        )
        residuals.append(decode_sum(ring, spec, SHARED) - sum(xs))
    measured = float(np.concatenate(residuals).std())
    target = spec.noise_stddev(4)
    # 8,000 (nearly independent) coordinates: the std's sampling error is about 0.8 %
    assert measured == pytest.approx(target, rel=0.04)
    # sized for 3 survivors, 4 added their share: never below the target z·C
    assert spec.effective_noise_multiplier(4) >= spec.noise_multiplier * math.sqrt(4 / 3)
    assert spec.effective_noise_multiplier(3) == pytest.approx(
        spec.noise_multiplier * spec.inflation
    )


def test_the_wrap_rate_stays_under_its_bound() -> None:
    # k = 2 and a small ring: the bound (2·e^-2 = 27 %) is loose but binding enough to
    # make wraps happen with aligned full-norm vectors
    spec = _spec(dim=1000, ring_bits=12, clip=4.0, wrap_stddevs=2.0, max_members=4)
    direction = _members(1, spec.dim, 3, spec.clip)[0]
    ints = sum(
        encode(direction, spec, SHARED, _secret(i), integers=True).integers for i in range(4)
    )
    rate = dz.wrap_count(ints, spec.ring_bits) / ints.size
    assert 0 < rate <= spec.wrap_bound()
    inside = recentre(to_ring(ints, spec.ring_bits), spec.ring_bits) == ints
    assert np.count_nonzero(~inside) == dz.wrap_count(ints, spec.ring_bits)
    assert dz.wrap_count(np.array([2**17, -(2**17) - 1, 5, -(2**17)]), 18) == 2


def test_an_impossible_bit_budget_is_refused_with_the_reason() -> None:
    with pytest.raises(QuantizationError, match=r"2\^\(2b\) must be at least"):
        _spec(ring_bits=8, max_members=1000, min_survivors=10)
    with pytest.raises(QuantizationError, match="rounding would add"):
        _spec(dim=100_000, ring_bits=14, max_members=100, min_survivors=50, clip=50.0)
    with pytest.raises(QuantizationError, match="exceeds the vector clip"):
        _spec(sensitivity=6.0)
    with pytest.raises(QuantizationError, match="min_survivors"):
        _spec(min_survivors=5)


def test_bad_vectors_are_refused() -> None:
    spec = _spec()
    with pytest.raises(QuantizationError, match="300 values, got 299"):
        encode(np.zeros(299), spec, SHARED, _secret(0))
    with pytest.raises(QuantizationError, match="NaN"):
        encode(np.full(300, np.nan), spec, SHARED, _secret(0))
    with pytest.raises(QuantizationError, match="512 elements"):
        decode_sum(np.zeros(300, dtype=np.uint32), spec, SHARED)


def _inverted(cdf: np.ndarray, half: int, u53: np.ndarray) -> np.ndarray:
    """Inversion of the 53-bit uniforms u53/2^53 against ``cdf``, capped at 2K."""
    return np.minimum(np.searchsorted(cdf, u53 / 2.0**53, side="right"), 2 * half)


@pytest.mark.parametrize("variance", [0.3, 25.0, 6.7e5])
def test_the_guided_sampler_is_exact_inversion_of_the_keystream_uniforms(variance: float) -> None:
    # reference: the float64 CDF and u = (W·2^21 + L)/2^53, W the noise stream's 32-bit
    # words, L the top 21 bits of the low stream, taken in order by the values whose
    # guide bucket (W's top 20 bits) straddles a step; elsewhere any L gives one answer
    count = 100_000
    half = dz._table_half_width(variance)
    ks = np.abs(np.arange(-half, half + 1, dtype=np.float64))
    cdf = np.cumsum(special.ive(ks, variance))
    words = prg.expand(_secret(5), dz._NOISE_DOMAIN, count, np.uint32).astype(np.int64)
    bucket = (words >> 12) << 33
    first = _inverted(cdf, half, bucket)
    last = _inverted(cdf, half, bucket + (1 << 33) - 1)
    open_ = np.flatnonzero(first != last)
    low = prg.expand(_secret(5), dz._NOISE_DOMAIN + b"/low", open_.size, np.uint32) >> 11
    expected = first.copy()
    expected[open_] = _inverted(cdf, half, (words[open_] << 21) | low.astype(np.int64))
    assert 0 < open_.size < count // 10 or variance < 1  # both paths run
    np.testing.assert_array_equal(skellam(_secret(5), variance, count), expected - half)


def test_rounding_ties_on_the_top_32_bits_are_decided_by_21_more() -> None:
    # y's fraction puts every threshold on its own draw's word (probability 2^-32 each
    # in use): rounding then follows the low stream exactly as a 53-bit uniform would
    seed, count = _secret(9), 1000
    words = prg.expand(seed, b"ddp/rounding/1", count, np.uint32).astype(np.float64)
    low = prg.expand(seed, b"ddp/rounding/1/low", count, np.uint32) >> 11
    remainder = np.linspace(0.01, 0.99, count)  # frac·2^32 − W, exact in float64
    y = 5.0 + (words + remainder) / 2.0**32
    ints, draws = dz._conditional_round(y, bound=1e9, seed=seed)
    assert draws == 1
    np.testing.assert_array_equal(ints, 5 + (low < remainder * 2.0**21))


def test_a_fraction_that_rounds_to_one_always_rounds_up() -> None:
    # y − ⌊y⌋ is 1.0 in float64 for y a hair below an integer; it must round up
    y = np.full(10_000, -(2.0**-60))
    ints, _ = dz._conditional_round(y, bound=1e9, seed=_secret(3))
    np.testing.assert_array_equal(ints, 0)


@pytest.mark.parametrize("fraction", [2.0**-40, 0.3, 0.5 + 2.0**-33, 1 - 2.0**-20])
def test_stochastic_rounding_is_unbiased(fraction: float) -> None:
    count = 400_000
    y = np.full(count, 7.0 + fraction)
    ints, _ = dz._conditional_round(y, bound=1e9, seed=_secret(4))
    assert set(np.unique(ints)) <= {7, 8}
    rate = float((ints == 8).mean())
    assert abs(rate - fraction) <= 5 * math.sqrt(fraction * (1 - fraction) / count) + 1e-12


@pytest.mark.parametrize("variance", [25.0, 6.7e5, 2.0e7, 3.0e9])
def test_the_compiled_encoder_adds_exactly_the_skellam_noise_and_wraps(variance: float) -> None:
    # int16 guide, int32 guide (K ≥ 2^15), and a variance drawn in parts; the noise the
    # one-pass encoder adds is skellam()'s, value for value, and the ring is its residue
    y = np.random.default_rng(7).standard_normal(20_000) * 300.0
    seed = _secret(11)
    noisy, ring, draws = dz._discretise(y, 1e9, seed, 40, variance, dz._Workspace().get(y.size))
    quiet, _ = dz._conditional_round(y, 1e9, seed)
    assert draws == 1
    np.testing.assert_array_equal(noisy - quiet, skellam(seed, variance, y.size))
    np.testing.assert_array_equal(ring, to_ring(noisy, 40))
    assert ring.dtype == np.uint64


def test_an_encoding_does_not_depend_on_what_the_thread_encoded_before() -> None:
    small, large = _spec(), _spec(dim=1000)
    x = np.random.default_rng(3).standard_normal(small.dim)
    first = encode(x, small, SHARED, _secret(1), integers=True)
    other = encode(np.ones(large.dim), large, SHARED, _secret(2), integers=True)
    again = encode(x, small, SHARED, _secret(1), integers=True)
    np.testing.assert_array_equal(first.ring, again.ring)
    np.testing.assert_array_equal(first.integers, again.integers)
    # results are the caller's own: a later encoding does not write into them
    assert not np.shares_memory(first.integers, again.integers)
    assert not np.shares_memory(first.ring, again.ring)
    assert other.ring.size == large.padded

    # an encoding that finds the kept buffers in use gets its own: concurrent encodings
    # equal sequential ones
    results: dict[int, dz.Encoded] = {}

    def run(i: int) -> None:
        for _ in range(5):
            results[i] = encode(x * (i + 1), small, SHARED, _secret(i), integers=True)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for i in range(4):
        alone = encode(x * (i + 1), small, SHARED, _secret(i), integers=True)
        np.testing.assert_array_equal(results[i].ring, alone.ring)


def test_a_float32_vector_encodes_as_its_float64_widening() -> None:
    spec = _spec()
    x = np.random.default_rng(4).standard_normal(spec.dim).astype(np.float32)
    a = encode(x, spec, SHARED, _secret(5), integers=True)
    b = encode(x.astype(np.float64), spec, SHARED, _secret(5), integers=True)
    np.testing.assert_array_equal(a.integers, b.integers)
