"""The key custodian's answer to a decrypt stage, as custodian, aggregator, agent and
auditor read it: ``POST /rounds/{r}/decryption``'s body.

Every body is ``u32 LE n | n bytes of the signed DecryptionStatement's JSON | rest``.

- ``he.model_visible_to_aggregator = true``: the rest is the plaintext, the dim + 1
  summed integers of the members' quantized vectors, one little-endian int64 each.
- ``false`` (the model hidden from the operator): the rest is a **sealed release**:
  ``u32 LE k | k × (u8 len | recipient id, UTF-8 | sealed content key) | ciphertext``,
  where the ciphertext (:mod:`fedsec.crypto.sealing`) holds ``plaintext || model file``
  and each recipient's box opens its content key.  The statement names the model file's
  SHA-256 and the ciphertext's, so the aggregator stores and serves bytes it can check
  but not read, and a member checks what it opened against the custodian's signature.
  The whole body, statement included, is the file the aggregator stores and serves for
  that version (manifest kind ``sealed``), so whoever downloads it checks the
  custodian's signature without reading the log (:func:`open_release`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Final

from fedsec.crypto.sealing import (
    KEY_BOX_BYTES,
    NONCE_BYTES,
    TAG_BYTES,
    ReleaseContext,
    open_payload,
)
from fedsec.errors import IntegrityError, PayloadError
from fedsec.protocol import wire
from fedsec.protocol.limits import MAX_COHORT

#: The statement's length prefix: a little-endian u32.
LENGTH_BYTES: Final = 4
#: The released plaintext: one little-endian int64 per summed value.
PLAINTEXT_DTYPE: Final = "<i8"
PLAINTEXT_ITEM_BYTES: Final = 8
#: What a sealed release's ciphertext is bound to (:class:`ReleaseContext` purpose).
RELEASE_PURPOSE: Final = "he-model-release"


def frame(statement: wire.DecryptionStatement, rest: bytes) -> bytes:
    """A decryption body: the statement's length, the statement, then ``rest``."""
    doc = wire.encode(statement)
    return len(doc).to_bytes(LENGTH_BYTES, "little") + doc + rest


def unframe(raw: bytes, max_json_bytes: int) -> tuple[wire.DecryptionStatement, bytes]:
    """Split a decryption body into its statement and the rest.

    Args:
        raw: the body as received (and as stored).
        max_json_bytes: bound on the statement's length (``server.max_json_bytes``).

    Raises:
        PayloadError: truncated, a statement length over the bound, or a statement that
            does not decode strictly (unknown fields, repeated keys, wrong types).
    """
    if len(raw) < LENGTH_BYTES:
        raise PayloadError("a decryption starts with the u32 length of its statement")
    length = int.from_bytes(raw[:LENGTH_BYTES], "little")
    if length > max_json_bytes:
        raise PayloadError(
            f"the decryption statement declares {length} bytes, over the {max_json_bytes} allowed"
        )
    end = LENGTH_BYTES + length
    if len(raw) < end:
        raise PayloadError(
            f"the decryption statement is cut off ({len(raw) - LENGTH_BYTES} of {length} bytes)"
        )
    statement = wire.decode(
        raw[LENGTH_BYTES:end],
        wire.DecryptionStatement,
        max_bytes=max_json_bytes,
        what="decryption statement",
    )
    return statement, raw[end:]


def release_context(statement: wire.DecryptionStatement) -> ReleaseContext:
    """What the sealed payload of ``statement``'s release is bound to."""
    return ReleaseContext(
        RELEASE_PURPOSE, statement.federation_id, statement.round, statement.attempt
    )


@dataclass(frozen=True, slots=True)
class SealedRelease:
    """A hidden-model release: the content key sealed to each recipient, and the payload."""

    boxes: dict[str, bytes]
    ciphertext: bytes

    def encode(self) -> bytes:
        out = bytearray(len(self.boxes).to_bytes(4, "little"))
        for member in sorted(self.boxes):
            name = member.encode()
            out += len(name).to_bytes(1, "little") + name + self.boxes[member]
        return bytes(out) + self.ciphertext


def decode_sealed(raw: bytes) -> SealedRelease:
    """Read a sealed release (the rest of a hidden-model decryption body).

    Counts and lengths are checked before anything is copied.

    Raises:
        PayloadError: truncated, over :data:`MAX_COHORT` recipients, a repeated or
            non-UTF-8 recipient id, or no ciphertext.
    """
    if len(raw) < 4:
        raise PayloadError("a sealed release starts with the u32 count of its recipients")
    count = int.from_bytes(raw[:4], "little")
    if not 1 <= count <= MAX_COHORT:
        raise PayloadError(f"a sealed release names 1..{MAX_COHORT} recipients, not {count}")
    if len(raw) < 4 + count * (2 + KEY_BOX_BYTES):
        raise PayloadError(f"a sealed release of {count} recipients is cut off")
    at, boxes = 4, {}
    for _ in range(count):
        length = raw[at]
        end = at + 1 + length + KEY_BOX_BYTES
        if length == 0 or end > len(raw):
            raise PayloadError("a sealed release's recipient list is cut off or names no one")
        try:
            member = raw[at + 1 : at + 1 + length].decode()
        except UnicodeDecodeError:
            raise PayloadError("a sealed release's recipient id is not UTF-8") from None
        if member in boxes:
            raise PayloadError(f"a sealed release names recipient {member} twice")
        boxes[member] = raw[at + 1 + length : end]
        at = end
    if at == len(raw):
        raise PayloadError("a sealed release holds no ciphertext")
    return SealedRelease(boxes, raw[at:])


def split_payload(payload: bytes, values: int) -> tuple[bytes, bytes]:
    """A sealed payload's (plaintext of ``values`` int64s, model file).

    Raises:
        PayloadError: shorter than the plaintext, or no model file after it.
    """
    cut = values * PLAINTEXT_ITEM_BYTES
    if len(payload) <= cut:
        raise PayloadError(
            f"the sealed payload is {len(payload)} bytes: {values} int64 values and a model "
            "file need more"
        )
    return payload[:cut], payload[cut:]


#: Bound on a stored release's statement when it is read back as a model file: a
#: statement names at most MAX_COHORT contributors and recipients of 64 characters.
MAX_STATEMENT_BYTES: Final = 2 * MAX_COHORT * 70 + 4096


def sealed_release_allowance(values: int, recipients: int) -> int:
    """Bytes a sealed version's file takes beyond its model file: the statement, the sum
    of ``values`` int64s, ``recipients`` key boxes and the AEAD's nonce and tag."""
    boxes = 4 + recipients * (1 + 64 + int(KEY_BOX_BYTES))
    aead = int(NONCE_BYTES) + int(TAG_BYTES)
    return LENGTH_BYTES + MAX_STATEMENT_BYTES + boxes + values * PLAINTEXT_ITEM_BYTES + aead


@dataclass(frozen=True, slots=True)
class OpenedRelease:
    """A hidden model version, opened and checked."""

    statement: wire.DecryptionStatement
    plaintext: bytes  # the decrypted integer sum (``<i8``)
    model: bytes  # the model file


def open_release(
    data: bytes, custodian_key: bytes, recipient: str, x25519_secret: bytes, values: int
) -> OpenedRelease:
    """Open a hidden model version's file as one of its recipients.

    Args:
        data: the version's file (a whole sealed decryption body).
        custodian_key: the Ed25519 key of the custodian the round spec names (roster).
        recipient: the reader's roster id.
        x25519_secret: the reader's X25519 secret (from its identity key).
        values: the round's dim + 1 (the plaintext's length in int64s).

    Raises:
        PayloadError: not a sealed release, or it does not parse.
        SignatureError: the statement is not the custodian's.
        IntegrityError: not sealed to ``recipient``, or the release, sum or model is not
            the statement's.
        DecryptionError: the key box or payload does not open (tampered with).
    """
    statement, rest = unframe(data, MAX_STATEMENT_BYTES)
    if not statement.sealed:
        raise PayloadError("the model file is not a sealed release")
    statement.verify(custodian_key)
    return open_sealed(statement, rest, recipient, x25519_secret, values)


def open_sealed(
    statement: wire.DecryptionStatement,
    rest: bytes,
    recipient: str,
    x25519_secret: bytes,
    values: int,
) -> OpenedRelease:
    """Open the sealed release ``rest`` of a statement already verified (see
    :func:`open_release`, which raises the same)."""
    if hashlib.sha256(rest).hexdigest() != statement.sealed_sha256:
        raise IntegrityError("the sealed release is not the one its statement names")
    sealed = decode_sealed(rest)
    box = sealed.boxes.get(recipient)
    if box is None:
        raise IntegrityError(f"the model of round {statement.round} is not sealed to {recipient}")
    payload = open_payload(x25519_secret, box, sealed.ciphertext, release_context(statement))
    plaintext, model = split_payload(payload, values)
    if hashlib.sha256(model).hexdigest() != statement.model_sha256:
        raise IntegrityError("the model inside the sealed release is not the statement's")
    if hashlib.sha256(plaintext).hexdigest() != statement.plaintext_sha256:
        raise IntegrityError("the sum inside the sealed release is not the statement's")
    return OpenedRelease(statement, plaintext, model)
