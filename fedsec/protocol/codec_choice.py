"""Which update codec a round spec prescribes (:func:`codec_for`): every party derives
it from the signed spec alone, checking first that its stages go together and lie
within their bounds (:mod:`fedsec.protocol.update_codec` is the codec itself)."""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING

from fedsec.crypto import rotation
from fedsec.errors import ProtocolError
from fedsec.protocol.codec_subset import SUBSET_DOMAIN
from fedsec.protocol.compat import check_spec
from fedsec.protocol.ddp import ddp_spec, is_distributed, rotation_seed
from fedsec.protocol.ring_width import check_headroom, wrapping_weight_digit_bits
from fedsec.protocol.update_codec import UpdateCodec

if TYPE_CHECKING:
    from fedsec.protocol.spec import RoundSpec

__all__ = [
    "DEFAULT_RANGE_STDDEVS",
    "MAX_RANGE_STDDEVS",
    "MIN_KEEP",
    "MIN_RANGE_STDDEVS",
    "codec_for",
    "default_range_stddevs",
]

# A keep fraction below this sends fewer than one coordinate in a thousand: the
# estimate's variance grows as N/k, so such a round would learn nothing.
MIN_KEEP = 1e-3
# Rounding range of a rotated coordinate in standard deviations: below 1 most
# coordinates saturate; above 64 a 2-bit step is wider than any coordinate.
MIN_RANGE_STDDEVS, MAX_RANGE_STDDEVS = 1.0, 64.0
# A tool's range when rotation is on and none is given: ±3 standard deviations of a
# rotated coordinate of a clipped update (one saturates with probability ≤ 0.3 %).
DEFAULT_RANGE_STDDEVS = 3.0


def default_range_stddevs(rotation: str) -> float:
    """The rounding range a tool asks for when its user gives none: ±clip (0) without
    rotation, :data:`DEFAULT_RANGE_STDDEVS` with it."""
    return DEFAULT_RANGE_STDDEVS if rotation == "hadamard" else 0.0


def _seed(spec: RoundSpec, domain: bytes) -> bytes:
    return hashlib.sha256(domain + bytes.fromhex(spec.seed)).digest()


def codec_for(spec: RoundSpec) -> UpdateCodec:
    """The codec ``spec`` prescribes.

    Raises:
        ProtocolError: features that do not go together (:func:`fedsec.protocol.compat.
            check_spec`: compression or error feedback with distributed DP, compression
            under homomorphic summation, ...), or stages that contradict one another or
            the spec (a keep fraction, range or headroom out of bounds, a ring that does
            not match the headroom).
        QuantizationError: a bit budget the ring cannot meet.
    """
    check_spec(spec)
    quant, d = spec.quant_spec(), spec.dim
    if is_distributed(spec):
        ddp = ddp_spec(spec)
        return UpdateCodec(
            "distributed", quant, d, rotation_seed(spec), ddp.padded, None, 0.0, 1.0, ddp, False
        )
    if not spec.codec.compresses and not spec.codec.error_feedback:
        return UpdateCodec("plain", quant, d, None, d, None, quant.clip, 1.0, None, False)
    return _compressed(spec)


def _compressed(spec: RoundSpec) -> UpdateCodec:
    """The compressed kind's codec (or plain rounding with error feedback).

    Raises:
        ProtocolError: a keep fraction, range or headroom out of bounds, or a ring that
            does not match the headroom.
    """
    c, quant, d = spec.codec, spec.quant_spec(), spec.dim
    where = f"round {spec.round}'s codec"
    if not (math.isfinite(c.keep) and MIN_KEEP <= c.keep <= 1.0):
        raise ProtocolError(f"{where} keeps a fraction {c.keep} outside [{MIN_KEEP}, 1]")
    rotated = c.rotation == "hadamard"
    n = rotation.padded_length(d) if rotated else d
    keep = n if c.keep >= 1.0 else max(1, min(n, round(c.keep * d)))
    if c.range_stddevs:
        if not rotated:
            raise ProtocolError(
                f"{where} sets a rounding range in standard deviations without rotation; "
                "only rotated coordinates are close to Gaussian"
            )
        if not MIN_RANGE_STDDEVS <= c.range_stddevs <= MAX_RANGE_STDDEVS:
            raise ProtocolError(
                f"{where} sets a rounding range of {c.range_stddevs} standard deviations, "
                f"outside [{MIN_RANGE_STDDEVS:g}, {MAX_RANGE_STDDEVS:g}]"
            )
        s = c.range_stddevs * quant.clip / math.sqrt(n)
    else:
        s = quant.clip
    rescale = 1.0 if c.error_feedback or keep == n else n / keep
    wraps = bool(c.headroom_bits) and check_headroom(spec, where)
    return UpdateCodec(
        "compressed",
        quant,
        d,
        _seed(spec, b"fedsec/v1/codec/rotation") if rotated else None,
        keep,
        _seed(spec, SUBSET_DOMAIN) if keep < n else None,
        s,
        rescale,
        None,
        c.error_feedback,
        len(spec.cohort),
        wrapping_weight_digit_bits(spec, where) if wraps else 0,
    )
