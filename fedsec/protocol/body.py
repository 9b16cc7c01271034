"""JSON bodies: the field types every message declares, the one decoder of outside
input, and the base of objects that carry their own signature.

Numbers: every float of every message is finite, whichever the encoding.  JSON has
no NaN or infinity (msgspec refuses them, and literals that overflow), msgpack
(:mod:`fedsec.protocol.compact`) carries both, and the transparency log that stores
members' signed objects is standard JSON (``docs/audit-log.md``).  :func:`check_finite`
is the one check: every decoder of outside input runs it (:func:`decode`,
:func:`fedsec.protocol.compact.to_body`, :func:`fedsec.protocol.log_entries.decode_body`),
so a new ``float`` field is covered by declaring it.  A field's range beyond that is
declared with its type (:data:`NonNegative`, :data:`Probability`, or a ``msgspec.Meta``);
a rule between fields is the struct's ``__post_init__`` (it runs on decoding too, and
its ``ValueError`` becomes the decoder's refusal).
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Iterable
from typing import Annotated, Any, ClassVar, Final, TypeVar

import msgspec

from fedsec.crypto.identity import PublicIdentity, SigningIdentity, canonical_json
from fedsec.errors import PayloadError, PayloadTooLarge
from fedsec.protocol.limits import MAX_COUNT, MAX_ID

#: A round, attempt or model version.
Id = Annotated[int, msgspec.Meta(ge=0, le=MAX_ID)]
#: A count, index or token.
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
MemberId = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
#: A float >= 0 (finite, as every float: :func:`check_finite`).
NonNegative = Annotated[float, msgspec.Meta(ge=0)]
#: A float in [0, 1]: a rate, share or probability.
Probability = Annotated[float, msgspec.Meta(ge=0, le=1)]
# Canonical ASCII decimal only: int() also takes "+1", " 1", "1_0" and non-ASCII digits,
# which would give one resource many spellings.
_UINT_RE: Final = re.compile(r"0|[1-9][0-9]{0,15}")
#: A SHA-256 digest, lowercase hex.
HexDigest = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]


S = TypeVar("S", bound="_Signed")


class _Signed(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """An object that stays verifiable after its request: Ed25519 over its canonical JSON
    without the ``signature`` field, in a domain of its own (``DOMAIN``).  Fields holding
    their default are omitted, so adding an optional field later keeps old signatures
    valid."""

    DOMAIN: ClassVar[str] = ""

    def signed_bytes(self) -> bytes:
        fields = msgspec.to_builtins(self)
        fields.pop("signature", None)
        return canonical_json(fields)

    def sign(self: S, signer: SigningIdentity) -> S:
        return msgspec.structs.replace(
            self, signature=signer.sign(self.DOMAIN, self.signed_bytes()).hex()
        )

    def verify(self, public_key: bytes) -> None:
        """Raises SignatureError unless signed by ``public_key`` (PayloadError: not hex)."""
        signature = _unhex(str(getattr(self, "signature", "")), "signature")
        PublicIdentity(public_key).verify(self.DOMAIN, self.signed_bytes(), signature)


T = TypeVar("T")


def parse_uint(raw: str, what: str, max_value: int = MAX_ID) -> int:
    """A path or query integer: canonical ASCII decimal (``0|[1-9][0-9]*``), at most
    ``max_value``.

    Raises:
        PayloadError: anything else (signs, spaces, ``_``, non-ASCII digits, leading
            zeros, exponents, too large), quoted truncated.
    """
    if not _UINT_RE.fullmatch(raw) or int(raw) > max_value:
        raise PayloadError(
            f"{what} must be a decimal integer from 0 to {max_value} without sign, spaces or "
            f"leading zeros, got {raw[:24]!r}{'...' if len(raw) > 24 else ''}"
        )
    return int(raw)


def non_finite(value: Any) -> tuple[str, float] | None:
    """The first float in ``value`` that is NaN or infinite, with its path in msgspec's
    notation (``$.report.delta``); None when every float is finite.

    ``value`` is a struct or what ``json.loads``, ``msgspec.to_builtins`` or an untyped
    msgspec decoder gives; structs, lists, tuples and dicts are searched through.
    """
    if isinstance(value, float):
        return None if math.isfinite(value) else ("$", value)
    items: Iterable[tuple[Any, Any]]
    if isinstance(value, msgspec.Struct):
        items = ((name, getattr(value, name)) for name in _float_fields(type(value)))
    elif isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = non_finite(item)
        if found is not None:
            # the path is built only for the one bad value, not for every good one
            return "$" + _step(key) + found[0][1:], found[1]
    return None


@functools.cache
def _float_fields(cls: type[msgspec.Struct]) -> tuple[str, ...]:
    """The fields of ``cls`` whose type can hold a float, at any depth: the only ones
    :func:`non_finite` looks into (a share list of 100 members then costs nothing)."""
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    return tuple(f.name for f in info.fields if _may_hold_float(f.type, set()))


def _may_hold_float(t: msgspec.inspect.Type, seen: set[type]) -> bool:
    ins = msgspec.inspect
    if isinstance(t, ins.FloatType):
        return True
    if isinstance(t, ins.StructType):
        if t.cls in seen:  # a recursive struct: its floats are found where first met
            return False
        seen.add(t.cls)
        return any(_may_hold_float(f.type, seen) for f in t.fields)
    if isinstance(t, ins.UnionType):
        return any(_may_hold_float(u, seen) for u in t.types)
    if isinstance(t, ins.ListType | ins.SetType | ins.FrozenSetType | ins.VarTupleType):
        return _may_hold_float(t.item_type, seen)
    if isinstance(t, ins.TupleType):
        return any(_may_hold_float(u, seen) for u in t.item_types)
    if isinstance(t, ins.DictType):
        return _may_hold_float(t.key_type, seen) or _may_hold_float(t.value_type, seen)
    no_float = (ins.StrType, ins.IntType, ins.BoolType, ins.BytesType, ins.LiteralType)
    return not isinstance(t, (*no_float, ins.NoneType, ins.ByteArrayType, ins.EnumType))


def check_finite(value: Any, what: str) -> None:
    """Refuse a decoded message holding a float that is NaN or infinite (see the module's
    *Numbers*).

    Raises:
        PayloadError: naming ``what`` and the field.
    """
    found = non_finite(value)
    if found is not None:
        path, number = found
        raise PayloadError(
            f"{what} is invalid: {number} is not a finite number - at `{path}` "
            "(fedsec messages carry finite numbers only)"
        )


def _step(key: Any) -> str:
    """One step of a path: ``.name`` for a field or an identifier key, else ``[key]``."""
    if isinstance(key, str) and key.isidentifier():
        return f".{key[:64]}"
    text = repr(key[:64]) if isinstance(key, str) else str(key)
    return f"[{text}]"


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise PayloadError(f"duplicate JSON key {key[:64]!r}: each key may appear once")
        found[key] = value
    return found


# A signed body must mean one thing to every reader: the stdlib scanner (C) calls the
# hook for each object, which refuses a key given twice (msgspec keeps the last one).
_DUPLICATE_CHECK: Final = json.JSONDecoder(object_pairs_hook=_refuse_duplicate_keys)


def decode(raw: bytes, kind: type[T], *, max_bytes: int, what: str, unique_keys: bool = True) -> T:
    """Decode a JSON body into ``kind``, checking its size first.

    ``unique_keys`` parses the body a second time (stdlib scanner) to refuse a key
    given twice; a request body must mean one thing to every reader.  The agent's
    client turns it off for the aggregator's answers, whose signed parts it verifies
    over their canonical re-encoding, so a repeated key there changes nothing signed.

    Raises:
        PayloadTooLarge: more than ``max_bytes``.
        PayloadError: malformed JSON, a key given twice in one object, wrong types,
            numbers out of range or not finite, a rule between fields broken
            (``__post_init__``), or unknown fields (named).
    """
    value = _decoded(msgspec.json.decode, "JSON", raw, kind, max_bytes, what)
    if not unique_keys:
        return value
    try:
        _DUPLICATE_CHECK.decode(raw.decode("utf-8"))
    except PayloadError as exc:
        raise PayloadError(f"{what} is invalid: {exc.detail}") from None
    except ValueError as exc:  # msgspec accepted what the stdlib does not (never seen)
        raise PayloadError(f"{what} is not valid JSON: {str(exc)[:300]}") from None
    return value


def decode_msgpack(raw: bytes, kind: type[T], *, max_bytes: int, what: str) -> T:
    """Decode a msgpack message into ``kind``, checking its size first: :func:`decode`'s
    rules for the binary encodings (compact uploads, peer messages).

    Raises:
        PayloadTooLarge: more than ``max_bytes``.
        PayloadError: not msgpack, wrong types, numbers out of range or not finite, a
            rule between fields broken (``__post_init__``), or unknown fields (named).
    """
    return _decoded(msgspec.msgpack.decode, "msgpack", raw, kind, max_bytes, what)


def _decoded(
    decoder: Callable[..., Any], encoding: str, raw: bytes, kind: type[T], max_bytes: int, what: str
) -> T:
    """``raw`` decoded by ``decoder`` into ``kind``: its size checked first, msgspec's
    refusals named, every float finite (JSON cannot carry one, msgpack can: one rule)."""
    if len(raw) > max_bytes:
        raise PayloadTooLarge(f"{what} is {len(raw)} bytes, over the limit of {max_bytes}")
    try:
        value: T = decoder(raw, type=kind)
    except msgspec.ValidationError as exc:
        raise PayloadError(f"{what} is invalid: {str(exc)[:300]}") from None
    except msgspec.DecodeError as exc:
        raise PayloadError(f"{what} is not valid {encoding}: {str(exc)[:300]}") from None
    check_finite(value, what)
    return value


def encode(value: Any) -> bytes:
    return msgspec.json.encode(value)


def _unhex(value: str, what: str) -> bytes:
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise PayloadError(f"{what} is not hex") from None


def unhex(value: str, what: str, length: int | None = None) -> bytes:
    """Hex to bytes, refusing bad hex or the wrong length with a sentence naming ``what``."""
    raw = _unhex(value, what)
    if length is not None and len(raw) != length:
        raise PayloadError(f"{what} must be {length} bytes, got {len(raw)}")
    return raw
