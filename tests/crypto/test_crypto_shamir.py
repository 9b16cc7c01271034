"""Shamir t-of-k over GF(2^256 + 297): any t shares recover, fewer or inconsistent are refused."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsec.crypto import shamir
from fedsec.crypto.shamir import PRIME, SHARE_BYTES, Share, reconstruct, split
from fedsec.errors import ShamirError

SECRET = bytes(range(1, 33))


@st.composite
def sharing(draw: st.DrawFn) -> tuple[bytes, int, list[Share], list[Share]]:
    k = draw(st.integers(1, 20))
    t = draw(st.integers(1, k))
    xs = draw(st.lists(st.integers(1, shamir.MAX_X), min_size=k, max_size=k, unique=True))
    secret = draw(st.binary(min_size=32, max_size=32))
    shares = split(secret, t, xs)
    subset = draw(st.permutations(shares).map(lambda p: p[:t]))
    return secret, t, shares, list(subset)


def test_prime_is_smallest_above_2_256() -> None:
    assert PRIME == 2**256 + 297
    assert pow(3, PRIME - 1, PRIME) == 1  # Fermat witness: consistent with primality


@settings(max_examples=60, deadline=None)
@given(sharing())
def test_any_t_subset_recovers(case: tuple[bytes, int, list[Share], list[Share]]) -> None:
    secret, t, shares, subset = case
    assert reconstruct(subset, t) == secret
    assert reconstruct(shares, t) == secret  # all k: extras are consistent


@settings(max_examples=40, deadline=None)
@given(sharing())
def test_fewer_than_t_refused(case: tuple[bytes, int, list[Share], list[Share]]) -> None:
    _, t, _, subset = case
    with pytest.raises(ShamirError):
        reconstruct(subset[: t - 1], t)


@settings(max_examples=60, deadline=None)
@given(sharing(), st.data())
def test_corrupted_extra_share_refused(
    case: tuple[bytes, int, list[Share], list[Share]], data: st.DataObject
) -> None:
    # Documented contract: with more than t shares, the t smallest x interpolate and the
    # next one is checked; a corruption among those t + 1 is refused.
    secret, t, shares, _ = case
    if len(shares) == t:
        return  # no extra share to check against
    checked = sorted(shares, key=lambda s: s.x)[: t + 1]
    victim = data.draw(st.sampled_from(checked))
    delta = data.draw(st.integers(1, PRIME - 1))
    bad = [Share(s.x, (s.y + delta) % PRIME) if s == victim else s for s in shares]
    with pytest.raises(ShamirError):
        reconstruct(bad, t)
    assert reconstruct(shares, t) == secret


@settings(max_examples=60, deadline=None)
@given(sharing(), st.data())
def test_corruption_never_yields_a_wrong_secret_when_extras_offered(
    case: tuple[bytes, int, list[Share], list[Share]], data: st.DataObject
) -> None:
    secret, t, shares, _ = case
    if len(shares) == t:
        return
    victim = data.draw(st.sampled_from(shares))
    delta = data.draw(st.integers(1, PRIME - 1))
    bad = [Share(s.x, (s.y + delta) % PRIME) if s == victim else s for s in shares]
    try:
        result = reconstruct(bad, t)
    except ShamirError:
        return
    assert result == secret


def test_t_of_t_single_corruption_gives_wrong_or_refused() -> None:
    # With exactly t shares nothing can detect corruption; document that the result differs.
    shares = split(SECRET, 3, [1, 2, 3])
    bad = [shares[0], shares[1], Share(3, (shares[2].y + 1) % PRIME)]
    try:
        result = reconstruct(bad, 3)
    except ShamirError:
        return  # landed outside the 32-byte range: refused, also fine
    assert result != SECRET


def test_duplicates_refused() -> None:
    shares = split(SECRET, 2, [1, 2, 3])
    with pytest.raises(ShamirError, match="duplicate"):
        reconstruct([shares[0], shares[0], shares[1]], 2)
    with pytest.raises(ShamirError, match="duplicate"):
        reconstruct([shares[0], Share(1, shares[1].y), shares[2]], 2)


def test_threshold_one_is_the_secret_at_every_x() -> None:
    shares = split(SECRET, 1, [5, 9])
    assert all(s.y == int.from_bytes(SECRET, "big") for s in shares)
    assert reconstruct(shares[1:], 1) == SECRET


@pytest.mark.parametrize("x", [0, -1, shamir.MAX_X + 1])
def test_x_out_of_range(x: int) -> None:
    with pytest.raises(ShamirError):
        split(SECRET, 1, [1, x])
    with pytest.raises(ShamirError):
        reconstruct([Share(x, 5)], 1)


def test_y_outside_field_refused() -> None:
    with pytest.raises(ShamirError):
        reconstruct([Share(1, PRIME)], 1)
    with pytest.raises(ShamirError):
        reconstruct([Share(1, -1)], 1)


@pytest.mark.parametrize(
    ("threshold", "xs"),
    [(0, [1, 2]), (3, [1, 2]), (2, [1, 1, 2])],
)
def test_split_refuses_bad_parameters(threshold: int, xs: list[int]) -> None:
    with pytest.raises(ShamirError):
        split(SECRET, threshold, xs)


def test_split_refuses_non_32_byte_secret() -> None:
    with pytest.raises(ShamirError):
        split(SECRET[:31], 1, [1])


def test_reconstruct_refuses_threshold_below_one() -> None:
    with pytest.raises(ShamirError):
        reconstruct(split(SECRET, 1, [1]), 0)


def test_secret_above_2_256_is_refused() -> None:
    # A field element >= 2^256 is not a 32-byte secret: shares that interpolate to it are forged.
    value = (1 << 256) + 5
    shares = [Share(1, value), Share(2, value)]  # constant polynomial f = value
    with pytest.raises(ShamirError):
        reconstruct(shares, 2)


def test_extreme_secrets() -> None:
    for secret in (bytes(32), b"\xff" * 32):
        assert reconstruct(split(secret, 3, [1, 2, 3, 4]), 3) == secret


@settings(max_examples=50, deadline=None)
@given(st.integers(1, shamir.MAX_X), st.integers(0, PRIME - 1))
def test_share_bytes_round_trip(x: int, y: int) -> None:
    raw = Share(x, y).to_bytes()
    assert len(raw) == SHARE_BYTES
    assert Share.from_bytes(raw) == Share(x, y)


def test_share_from_bytes_refuses_bad_encodings() -> None:
    good = Share(3, 12345).to_bytes()
    with pytest.raises(ShamirError):
        Share.from_bytes(good[:-1])
    with pytest.raises(ShamirError):
        Share.from_bytes(good + b"\x00")
    with pytest.raises(ShamirError):
        Share.from_bytes(b"\x00\x00" + good[2:])  # x = 0 would reveal the secret
    with pytest.raises(ShamirError):
        Share.from_bytes(good[:2] + PRIME.to_bytes(33, "big"))


def test_shares_of_different_sharings_do_not_mix() -> None:
    a = split(SECRET, 2, [1, 2, 3])
    b = split(SECRET, 2, [1, 2, 3])  # fresh random coefficients
    assert a != b
    with pytest.raises(ShamirError):
        reconstruct([a[0], a[1], b[2]], 2)


def test_reconstruction_speed_sanity() -> None:
    xs = list(range(1, 9))
    sharings = [split(bytes([i]) * 32, 4, xs) for i in range(100)]
    start = time.perf_counter()
    for i, shares in enumerate(sharings):
        assert reconstruct(shares[2:6], 4) == bytes([i]) * 32
    assert time.perf_counter() - start < 1.0
