"""The shared randomised Hadamard rotation: orthonormal, invertible, linear, seeded."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedsec.crypto.rotation import (
    hadamard,
    padded_length,
    rotate,
    rotate_single,
    signs,
    unrotate,
)
from fedsec.errors import QuantizationError

SEED = hashlib.sha256(b"round spec").digest()
# sha256 of three rotations of a fixed vector (see the last test)
KNOWN_DIGEST = "25fe380467122dc3559e88173c7494776e4132187be72e409ab568f3ea71c3c2"
vectors = hnp.arrays(
    np.float64,
    st.integers(1, 300),
    elements=st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False),
)


@settings(max_examples=60, deadline=None)
@given(vectors)
def test_rotation_keeps_the_norm_and_unrotate_inverts_it(x: np.ndarray) -> None:
    y = rotate(x, SEED)
    assert y.size == padded_length(x.size)
    scale = max(1.0, float(np.abs(x).max()))
    assert np.linalg.norm(y) == pytest.approx(np.linalg.norm(x), rel=1e-9, abs=1e-9 * scale)
    np.testing.assert_allclose(unrotate(y, SEED, x.size), x, rtol=0, atol=1e-9 * scale)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 200), st.integers(0, 2**32))
def test_the_sum_of_rotations_is_the_rotation_of_the_sum(d: int, seed: int) -> None:
    # what lets the aggregator unrotate the members' sum once
    rng = np.random.default_rng(seed)
    parts = [rng.normal(size=d) for _ in range(5)]
    np.testing.assert_allclose(
        sum(rotate(p, SEED) for p in parts), rotate(sum(parts), SEED), atol=1e-9
    )


def test_hadamard_matches_the_matrix_and_signs_are_balanced_and_seeded() -> None:
    h = np.array([[1.0]])
    for _ in range(4):
        h = np.block([[h, h], [h, -h]])
    x = np.arange(16, dtype=np.float64)
    np.testing.assert_array_equal(hadamard(x), h @ x)
    s = signs(SEED, 4096)
    assert set(np.unique(s)) == {-1.0, 1.0}
    assert abs(s.sum()) < 4 * 64  # 4 standard deviations of 4096 fair signs
    np.testing.assert_array_equal(s, signs(SEED, 4096))
    assert not np.array_equal(s, signs(hashlib.sha256(b"other").digest(), 4096))


def _butterflies(x: np.ndarray) -> np.ndarray:
    """H·x one radix-2 level at a time: the textbook transform to check against."""
    y = x.astype(np.float64).copy()
    h = 1
    while h < y.size:
        pairs = y.reshape(-1, 2, h)
        a, b = pairs[:, 0, :].copy(), pairs[:, 1, :].copy()
        pairs[:, 0, :], pairs[:, 1, :] = a + b, a - b
        h *= 2
    return y


@pytest.mark.parametrize("log2n", range(15))
def test_the_compiled_transform_is_the_textbook_butterflies(log2n: int) -> None:
    # lengths 1..2^14: even and odd numbers of radix-2 levels after the radix-4 passes,
    # and lengths below the first pass's group of eight; integers keep it exact
    x = np.random.default_rng(log2n).integers(-1000, 1000, size=1 << log2n).astype(np.float64)
    np.testing.assert_array_equal(hadamard(x), _butterflies(x))
    assert hadamard(x) is not x


def test_a_scale_folded_into_the_transform_is_the_same_as_scaling_after() -> None:
    x = np.random.default_rng(1).normal(size=1000)
    np.testing.assert_allclose(rotate(x, SEED, scale=37.5), 37.5 * rotate(x, SEED), atol=1e-12)
    y = rotate(x, SEED)
    np.testing.assert_allclose(unrotate(y, SEED, 1000, scale=0.25), 0.25 * x, atol=1e-15)
    np.testing.assert_allclose(unrotate(rotate(x, SEED, scale=8.0), SEED, 1000, scale=1 / 8), x)


@pytest.mark.parametrize("d", [1, 7, 1000, 4096])
def test_rotate_is_h_times_the_public_signs_times_the_padded_vector(d: int) -> None:
    # the sign flip works on the floats' sign bits: it must be the product with signs()
    x = np.random.default_rng(d).normal(size=d)
    n = padded_length(d)
    padded = np.zeros(n)
    padded[:d] = x
    s = signs(SEED, n)
    np.testing.assert_allclose(rotate(x, SEED), hadamard(s * padded) / np.sqrt(n), atol=1e-12)
    y = np.random.default_rng(d + 1).normal(size=n)
    np.testing.assert_allclose(unrotate(y, SEED, d), (s * hadamard(y))[:d] / np.sqrt(n), atol=1e-12)


@pytest.mark.parametrize("d", [1, 5, 1000, 5210, 1 << 16])
def test_the_single_precision_rotation_is_the_same_map(d: int) -> None:
    x = np.random.default_rng(d).standard_normal(d)
    y = rotate_single(x.astype(np.float32), SEED, scale=3.0)
    assert y.dtype == np.float32 and y.size == padded_length(d)
    # the same signs and transform: within float32 rounding of the float64 rotation
    exact = rotate(x.astype(np.float32), SEED, scale=3.0)
    assert np.max(np.abs(y - exact)) <= 1e-5 * np.abs(exact).max()
    np.testing.assert_allclose(unrotate(y, SEED, d, scale=1 / 3.0), x, rtol=0, atol=1e-5)
    with pytest.raises(QuantizationError):
        rotate_single(np.array([1.0, np.nan]), SEED)


def test_a_spike_is_spread_over_every_coordinate() -> None:
    x = np.zeros(1000)
    x[7] = 1.0
    y = rotate(x, SEED)
    np.testing.assert_allclose(np.abs(y), 1 / np.sqrt(1024))


def test_bad_lengths_and_values_are_refused() -> None:
    with pytest.raises(QuantizationError, match="1024 elements, got 1000"):
        unrotate(np.zeros(1000), SEED, 1000)
    with pytest.raises(QuantizationError, match="NaN"):
        rotate(np.array([1.0, np.nan]), SEED)
    with pytest.raises(QuantizationError, match="coordinates"):
        rotate(np.zeros(0), SEED)
    with pytest.raises(QuantizationError, match="power-of-two"):
        hadamard(np.zeros(3))


def test_a_float32_vector_rotates_as_its_float64_widening() -> None:
    x = np.random.default_rng(5).standard_normal(5210).astype(np.float32)
    np.testing.assert_array_equal(
        rotate(x, SEED, scale=3.0), rotate(x.astype(np.float64), SEED, scale=3.0)
    )


def test_a_rotation_writes_into_the_buffer_it_is_given_or_refuses_it() -> None:
    x = np.random.default_rng(6).standard_normal(1000)
    out = np.full(1024, np.nan)
    assert rotate(x, SEED, out=out) is out
    np.testing.assert_array_equal(out, rotate(x, SEED))
    for bad in (np.empty(1000), np.empty(1024, dtype=np.float32), np.empty(2048)[::2]):
        with pytest.raises(QuantizationError, match="1024 contiguous float64"):
            rotate(x, SEED, out=bad)


def test_the_transform_gives_the_same_bits_on_every_machine() -> None:
    # a fixed order of IEEE additions (no BLAS, no fastmath): the audit's re-derivation
    # of a decoded sum depends on these exact bits, so a change to the arithmetic must
    # show here first
    x = (np.arange(5210, dtype=np.float64) % 97 - 48) / 7.0  # IEEE-exact, unlike sin
    y = rotate(x, SEED, scale=3.0)
    z = unrotate(y, SEED, 5210, scale=0.5)
    single = rotate_single(x.astype(np.float32), SEED)
    digest = hashlib.sha256(y.tobytes() + z.tobytes() + single.tobytes()).hexdigest()
    assert digest == KNOWN_DIGEST
