"""The compact encoding of a member's SecAgg+ uploads: msgpack, binary fields, no keys.

A member uploads three control messages a round: its key advertisement, its encrypted
shares (with its privacy report) and its unmask answer.  As JSON (:mod:`.wire`) their
keys, signatures and shares travel as hex, twice their size, and the shares message
alone outweighed a 16-bit masked vector of MNIST-1D.  Sent with
``Content-Type: application/msgpack`` (:data:`MEDIA_TYPE`) the same message is a
msgpack array of its fields in declaration order, bytes as msgpack ``bin``:

- advertise: ``[enc_public, mask_public, signature]``;
- shares: ``[[[recipient, ciphertext], ...], report]`` (``report``: the
  :class:`~fedsec.protocol.wire.PrivacyReport` as a msgpack map, or nil);
- unmask: ``[[[member, seed share], ...], [[member, key share], ...]]``.

This is a transport encoding only.  The aggregator turns a compact upload into the
JSON body struct (:func:`to_body`) before any check, and stores, archives, logs and
replays the canonical JSON re-encoding of that struct as for a JSON upload; so the
archive's format, the idempotency of retries, crash resume and ``fedsec audit
verify`` are the same whichever encoding a member chose.  The request signature
covers the body's digest, whatever its media type; a body cannot decode both ways
(JSON text starts with ``{``, a msgpack positive integer, not an array).

msgpack carries NaN and infinity, which JSON cannot: a compact upload holding one is
refused by the same check as every decoded message (:func:`~fedsec.protocol.wire.check_finite`),
so nothing a member sends can put one into the transparency log.

Positional fields leave nothing to repeat: a member named twice in an unmask answer is
refused here, before it could collapse into one dictionary entry; every other check
(who the shares go to, their number and lengths) is the session's, on the converted
body, as for JSON.
"""

from __future__ import annotations

from typing import Annotated, Final, TypeAlias, TypeVar

import msgspec

from fedsec.errors import PayloadError
from fedsec.protocol import body as body_codec
from fedsec.protocol import wire

#: The media type of a compact upload.
MEDIA_TYPE: Final = "application/msgpack"

_Key = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
_Signature = Annotated[bytes, msgspec.Meta(min_length=64, max_length=64)]
# a share's length is the session's to check; the body limit bounds it
_Pair: TypeAlias = tuple[wire.MemberId, bytes]


class AdvertiseUpload(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True, omit_defaults=True
):
    """:class:`~fedsec.protocol.wire.AdvertiseKeysBody`, compact."""

    enc_public: _Key
    mask_public: _Key
    signature: _Signature
    graph_nonce: Annotated[bytes, msgspec.Meta(max_length=32)] = b""


class SharesUpload(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """:class:`~fedsec.protocol.wire.ShareKeysBody`, compact: (recipient, ciphertext)."""

    shares: list[_Pair]
    report: wire.PrivacyReport | None = None


class UnmaskUpload(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """:class:`~fedsec.protocol.wire.UnmaskResponseBody`, compact: (member, share)."""

    seed_shares: list[_Pair]
    key_shares: list[_Pair]


Body = wire.AdvertiseKeysBody | wire.ShareKeysBody | wire.UnmaskResponseBody
#: The JSON body structs that also travel compact.
KINDS: Final = (wire.AdvertiseKeysBody, wire.ShareKeysBody, wire.UnmaskResponseBody)
B = TypeVar("B", wire.AdvertiseKeysBody, wire.ShareKeysBody, wire.UnmaskResponseBody)

_ENCODER: Final = msgspec.msgpack.Encoder()


def encode(body: Body) -> bytes:
    """The compact upload of a JSON body struct (its hex fields as bytes).

    Raises:
        PayloadError: a hex field of ``body`` is not hex.
    """
    upload: AdvertiseUpload | SharesUpload | UnmaskUpload
    match body:
        case wire.AdvertiseKeysBody():
            upload = AdvertiseUpload(
                wire.unhex(body.enc_public, "enc_public"),
                wire.unhex(body.mask_public, "mask_public"),
                wire.unhex(body.signature, "signature"),
                wire.unhex(body.graph_nonce, "graph_nonce"),
            )
        case wire.ShareKeysBody():
            upload = SharesUpload(
                [(s.recipient, wire.unhex(s.ciphertext, "share ciphertext")) for s in body.shares],
                body.report,
            )
        case wire.UnmaskResponseBody():
            upload = UnmaskUpload(_pairs(body.seed_shares), _pairs(body.key_shares))
    return _ENCODER.encode(upload)


def _pairs(shares: dict[str, str]) -> list[_Pair]:
    return [(m, wire.unhex(s, "share")) for m, s in shares.items()]


def to_body(raw: bytes, kind: type[B], *, max_bytes: int, what: str) -> B:
    """Decode a compact upload into the JSON body struct ``kind``, checking its size first.

    Raises:
        PayloadTooLarge: more than ``max_bytes``.
        PayloadError: not msgpack, not the upload's shape (wrong types, a key or
            signature of the wrong length, unknown report fields), a number that is not
            finite or out of its field's range, a member named twice among an unmask
            answer's shares, or ``kind`` has no compact form.
    """
    body: Body
    if kind is wire.AdvertiseKeysBody:
        a = body_codec.decode_msgpack(raw, AdvertiseUpload, max_bytes=max_bytes, what=what)
        body = wire.AdvertiseKeysBody(
            a.enc_public.hex(), a.mask_public.hex(), a.signature.hex(), a.graph_nonce.hex()
        )
    elif kind is wire.ShareKeysBody:
        s = body_codec.decode_msgpack(raw, SharesUpload, max_bytes=max_bytes, what=what)
        body = wire.ShareKeysBody([wire.OutgoingShare(m, c.hex()) for m, c in s.shares], s.report)
    elif kind is wire.UnmaskResponseBody:
        u = body_codec.decode_msgpack(raw, UnmaskUpload, max_bytes=max_bytes, what=what)
        body = wire.UnmaskResponseBody(
            _unique(u.seed_shares, what, "seed"), _unique(u.key_shares, what, "key")
        )
    else:
        raise PayloadError(f"{what} has no compact ({MEDIA_TYPE}) form; send JSON")
    assert isinstance(body, kind)
    wire.check_finite(body, what)  # msgpack, unlike JSON, carries NaN and infinity
    return body


def _unique(pairs: list[_Pair], what: str, kind: str) -> dict[str, str]:
    shares: dict[str, str] = {}
    for member, share in pairs:
        if member in shares:
            raise PayloadError(f"{what} names {member[:64]!r} twice among its {kind} shares")
        shares[member] = share.hex()
    return shares
