"""How wide a round's ring is: b bits per coordinate plus the headroom its cohort's sums
need, or fewer headroom bits where the compressed codec lets sums wrap (and then how
the weight travels as digits that do not)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedsec.crypto.quantize import default_ring_bits
from fedsec.errors import ProtocolError

if TYPE_CHECKING:
    from fedsec.protocol.spec import RoundSpec

__all__ = [
    "MAX_HEADROOM_BITS",
    "check_headroom",
    "ring_bits_for",
    "weight_digit_bits",
    "wrapping_weight_digit_bits",
]

# Headroom bits a codec may ask for: ⌈log₂ n⌉ of the largest cohort (MAX_COHORT, < 2^16)
# is all any ring needs for sums that never wrap.
MAX_HEADROOM_BITS = 16


def ring_bits_for(bits: int, members: int, headroom_bits: int) -> int:
    """The ring a round of ``members`` at ``bits`` bits uses: the ring in which no sum
    wraps (:func:`default_ring_bits`), or b + ``headroom_bits`` where that is smaller.

    Raises:
        QuantizationError: fewer than one member.
    """
    full = default_ring_bits(bits, members)
    return min(full, bits + headroom_bits) if headroom_bits else full


def check_headroom(spec: RoundSpec, where: str) -> bool:
    """Whether a spec that sets headroom bits wraps: its ring is smaller than the
    cohort's no-wrap ring (a small cohort's is not, and then nothing wraps).

    Raises:
        ProtocolError: headroom bits without rotation or out of bounds, or a ring other
            than :func:`ring_bits_for` prescribes.
    """
    c, b = spec.codec, spec.quant_bits
    if c.rotation != "hadamard":
        raise ProtocolError(
            f"{where} sets headroom bits without rotation; only rotated coordinates sum "
            "to values centred enough for a ring that may wrap"
        )
    if not 1 <= c.headroom_bits <= MAX_HEADROOM_BITS:
        raise ProtocolError(
            f"{where} sets {c.headroom_bits} headroom bits, outside 1..{MAX_HEADROOM_BITS}"
        )
    ring = ring_bits_for(b, len(spec.cohort), c.headroom_bits)
    if spec.ring_bits != ring:
        raise ProtocolError(
            f"{where} has a ring of {spec.ring_bits} bits; {b} bits and {c.headroom_bits} "
            f"headroom bits for {len(spec.cohort)} members make {ring}"
        )
    return ring < default_ring_bits(b, len(spec.cohort))


def weight_digit_bits(members: int, bits: int, ring_bits: int) -> int:
    """q: the widest weight digit whose sum over ``members``, n·(2^q − 1), still fits a
    ring of ``ring_bits`` bits, at most the weight's own ``bits``; 0 where not even a
    1-bit digit fits (``members`` ≥ 2^ring_bits)."""
    return min(bits, (((1 << ring_bits) - 1) // members + 1).bit_length() - 1)


def wrapping_weight_digit_bits(spec: RoundSpec, where: str) -> int:
    """:func:`weight_digit_bits` of a wrapping round, which needs at least one bit.

    Raises:
        ProtocolError: a ring too small for the cohort's weights.
    """
    n, m = len(spec.cohort), spec.ring_bits
    q = weight_digit_bits(n, spec.quant_bits, m)
    if q < 1:
        raise ProtocolError(
            f"{where}: a ring of {m} bits cannot hold the weights of {n} members; "
            "set more headroom bits"
        )
    return q
