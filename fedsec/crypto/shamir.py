"""Shamir secret sharing of 32-byte secrets over GF(p), p = 2^256 + 297.

p is the smallest prime above 2^256, so every 32-byte string is a field element
and shares are 33 bytes.  Reconstruction interpolates at zero with exactly
``threshold`` shares; Lagrange coefficients depend only on the x-coordinates,
so they are cached: a server reconstructing one secret per member from the same
neighbour sets pays for each x-set once.  When more than ``threshold`` shares
are offered, exactly one more (the next smallest x) is read and checked to lie
on the same polynomial, so a corrupted or inconsistent share among those used
is refused instead of silently producing a wrong secret; the remaining shares
are not needed and not read (checking every extra share would cost O(t²) each,
which for classic SecAgg at n = 100 was seconds per round).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from functools import lru_cache
from math import prod
from typing import NamedTuple

from fedsec.crypto.errors import ShamirError

PRIME = (1 << 256) + 297
SECRET_BYTES = 32
Y_BYTES = 33
SHARE_BYTES = 2 + Y_BYTES
MAX_X = 0xFFFF  # x is encoded in 2 bytes: up to 65535 members in one neighbourhood


class Share(NamedTuple):
    """One point (x, y) of the sharing polynomial; x is the holder's 1-based index.

    A named tuple: a server parses every share of every unmask answer (~2,000 a round
    at 100 members), and a tuple is built several times faster than a frozen dataclass.
    """

    x: int
    y: int

    def to_bytes(self) -> bytes:
        return self.x.to_bytes(2, "big") + self.y.to_bytes(Y_BYTES, "big")

    @classmethod
    def from_bytes(cls, raw: bytes) -> Share:
        """Raises:
        ShamirError: not :data:`SHARE_BYTES` long, or x or y out of range.
        """
        if len(raw) != SHARE_BYTES:
            raise ShamirError(f"a share is {SHARE_BYTES} bytes, got {len(raw)}")
        share = cls(int.from_bytes(raw[:2], "big"), int.from_bytes(raw[2:], "big"))
        _check_point(share)
        return share


def _check_point(share: Share) -> None:
    if not 1 <= share.x <= MAX_X:
        raise ShamirError(f"share x-coordinate {share.x} is outside 1..{MAX_X}")
    if not 0 <= share.y < PRIME:
        raise ShamirError(f"share at x={share.x} has a y-coordinate outside the field")


def split(secret: bytes, threshold: int, xs: Sequence[int]) -> list[Share]:
    """Share ``secret`` so that any ``threshold`` of the returned shares recover it.

    Args:
        secret: 32 bytes.
        threshold: shares needed, 1 <= threshold <= len(xs).
        xs: distinct x-coordinates in 1..65535, one per holder.

    Raises:
        ShamirError: bad threshold, duplicate or out-of-range x.
    """
    if len(secret) != SECRET_BYTES:
        raise ShamirError(f"secret must be {SECRET_BYTES} bytes, got {len(secret)}")
    if not 1 <= threshold <= len(xs):
        raise ShamirError(f"threshold {threshold} must be in 1..{len(xs)} (number of holders)")
    if len(set(xs)) != len(xs):
        raise ShamirError("x-coordinates must be distinct")
    for x in xs:
        if not 1 <= x <= MAX_X:
            raise ShamirError(f"x-coordinate {x} is outside 1..{MAX_X}")
    coeffs = [int.from_bytes(secret, "big")] + [
        secrets.randbelow(PRIME) for _ in range(threshold - 1)
    ]
    shares = []
    for x in xs:
        acc = 0
        for c in reversed(coeffs):  # Horner
            acc = (acc * x + c) % PRIME
        shares.append(Share(x, acc))
    return shares


@lru_cache(maxsize=4096)
def _weights(xs: tuple[int, ...]) -> tuple[int, ...]:
    """Barycentric weights w_i = 1 / prod_{j != i} (x_i - x_j) mod p.

    They depend on the x-set only, so the secret (at 0) and the check (at the next
    x) share them.  The x are below 2^16, so each product is a plain integer of at
    most 16·(len(xs) - 1) bits before the one reduction; all of them are inverted
    with a single modular inversion (Montgomery's trick), not one each.
    """
    dens = [prod([xi - xj for xj in xs if xj != xi]) % PRIME for xi in xs]
    prefix = [1]
    for d in dens:
        prefix.append(prefix[-1] * d % PRIME)
    inverse = pow(prefix[-1], -1, PRIME)
    weights = [0] * len(xs)
    for i in range(len(xs) - 1, -1, -1):
        weights[i] = inverse * prefix[i] % PRIME
        inverse = inverse * dens[i] % PRIME
    return tuple(weights)


@lru_cache(maxsize=4096)
def _lagrange_at(xs: tuple[int, ...], target: int) -> tuple[int, ...]:
    """Coefficients l_i with f(target) = sum l_i * f(xs[i]) for deg f < len(xs);
    ``target`` is not one of ``xs``."""
    full = prod([target - x for x in xs])  # exact: prod_{j != i} is full / (target - x_i)
    return tuple(full // (target - xi) * w % PRIME for xi, w in zip(xs, _weights(xs), strict=True))


def reconstruct(shares: Sequence[Share], threshold: int) -> bytes:
    """Recover the secret from at least ``threshold`` shares.

    Exactly ``threshold`` shares (those with the smallest x) are interpolated;
    if another share is available, the one with the next smallest x must lie on
    the same polynomial.  Duplicates and out-of-field values are refused in all
    shares offered.

    Raises:
        ShamirError: too few shares, duplicates, values outside the field, or
            shares that do not lie on one polynomial of degree < threshold.
    """
    if threshold < 1:
        raise ShamirError(f"threshold must be at least 1, got {threshold}")
    by_x: dict[int, int] = {}
    for share in shares:
        _check_point(share)
        if share.x in by_x:
            raise ShamirError(f"duplicate share for x={share.x}")
        by_x[share.x] = share.y
    if len(by_x) < threshold:
        raise ShamirError(f"need {threshold} shares, got {len(by_x)}")
    ordered = sorted(by_x)
    base_xs = tuple(ordered[:threshold])
    base_ys = [by_x[x] for x in base_xs]
    value = sum(c * y for c, y in zip(_lagrange_at(base_xs, 0), base_ys, strict=True)) % PRIME
    for x in ordered[threshold : threshold + 1]:
        expected = (
            sum(c * y for c, y in zip(_lagrange_at(base_xs, x), base_ys, strict=True)) % PRIME
        )
        if expected != by_x[x]:
            raise ShamirError(
                f"share at x={x} is inconsistent with the others (corrupted or forged)"
            )
    if value >= 1 << (8 * SECRET_BYTES):
        raise ShamirError("shares do not encode a 32-byte secret (inconsistent shares)")
    return value.to_bytes(SECRET_BYTES, "big")
