"""One payload sealed to many recipients: a hidden model released by the key custodian.

The payload is encrypted once under a fresh random 32-byte content key with
XChaCha20-Poly1305 (random 24-byte nonce; the associated data binds it to its purpose,
federation, round and attempt, so a relaying aggregator cannot pass one round's release
off as another's).  The content key is then sealed to each recipient with libsodium's
``SealedBox`` (ephemeral X25519 + XSalsa20-Poly1305) under the X25519 key derived from
the recipient's published Ed25519 identity key, as :func:`~fedsec.crypto.commitment.seal_reveal`
does for the auditor.  A party without one of the recipients' identity keys (the
aggregator) holds only ciphertext.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

import nacl.bindings as sodium
import nacl.exceptions
import nacl.public
import nacl.utils

from fedsec.crypto.commitment import recipient_box_key
from fedsec.crypto.errors import DecryptionError
from fedsec.crypto.identity import canonical_json

#: The content key's length (XChaCha20-Poly1305's key).
CONTENT_KEY_BYTES: Final = sodium.crypto_aead_xchacha20poly1305_ietf_KEYBYTES
#: A random nonce per payload: 24 bytes, so random nonces never collide in practice.
NONCE_BYTES: Final = sodium.crypto_aead_xchacha20poly1305_ietf_NPUBBYTES
#: The AEAD's tag, which :func:`open_payload` checks before returning anything.
TAG_BYTES: Final = sodium.crypto_aead_xchacha20poly1305_ietf_ABYTES
#: A content key sealed to one recipient: ephemeral public key (32) + key (32) + MAC (16).
KEY_BOX_BYTES: Final = sodium.crypto_box_SEALBYTES + CONTENT_KEY_BYTES


@dataclass(frozen=True, slots=True)
class ReleaseContext:
    """What a sealed payload is bound to; becomes the AEAD's associated data."""

    purpose: str
    federation_id: str
    round: int
    attempt: int

    def associated_data(self) -> bytes:
        return b"fedsec/v1/sealed-release\x00" + canonical_json(
            [self.purpose, self.federation_id, self.round, self.attempt]
        )


@dataclass(frozen=True, slots=True)
class Sealed:
    """A payload sealed to several recipients."""

    boxes: dict[str, bytes]  # recipient id -> its sealed content key (KEY_BOX_BYTES)
    ciphertext: bytes  # nonce || XChaCha20-Poly1305(payload)


def seal_to_recipients(
    recipients: Mapping[str, bytes], payload: bytes, context: ReleaseContext
) -> Sealed:
    """Encrypt ``payload`` once and seal its key to every recipient.

    Args:
        recipients: recipient id -> its Ed25519 public identity key (32 bytes).
        payload: the bytes to hide.
        context: what the ciphertext is bound to.

    Raises:
        DecryptionError: a recipient key is malformed, or there is no recipient.
    """
    if not recipients:
        raise DecryptionError("a sealed release needs at least one recipient")
    key = nacl.utils.random(CONTENT_KEY_BYTES)
    nonce = nacl.utils.random(NONCE_BYTES)
    body = sodium.crypto_aead_xchacha20poly1305_ietf_encrypt(
        payload, context.associated_data(), nonce, key
    )
    boxes = {
        member: bytes(nacl.public.SealedBox(recipient_box_key(public)).encrypt(key))
        for member, public in sorted(recipients.items())
    }
    return Sealed(boxes, nonce + body)


def open_payload(
    curve25519_secret: bytes, box: bytes, ciphertext: bytes, context: ReleaseContext
) -> bytes:
    """The payload of a release, opened with one recipient's key.

    Args:
        curve25519_secret: the recipient's X25519 secret
            (:meth:`~fedsec.crypto.identity.SigningIdentity.x25519_secret`).
        box: the content key sealed to that recipient.
        ciphertext: the sealed payload (nonce first).
        context: what it must be bound to.

    Raises:
        DecryptionError: the box is not sealed to this key, or the payload is truncated,
            tampered with or bound to another context.
    """
    if len(box) != KEY_BOX_BYTES:
        raise DecryptionError(f"a sealed content key is {KEY_BOX_BYTES} bytes, got {len(box)}")
    if len(ciphertext) < NONCE_BYTES + TAG_BYTES:
        raise DecryptionError(f"a sealed payload is at least {NONCE_BYTES + TAG_BYTES} bytes")
    try:
        key = nacl.public.SealedBox(nacl.public.PrivateKey(curve25519_secret)).decrypt(box)
    except (nacl.exceptions.CryptoError, nacl.exceptions.ValueError, TypeError):
        raise DecryptionError("the release's content key is not sealed to this key") from None
    nonce, body = ciphertext[:NONCE_BYTES], ciphertext[NONCE_BYTES:]
    try:
        return bytes(
            sodium.crypto_aead_xchacha20poly1305_ietf_decrypt(
                body, context.associated_data(), nonce, key
            )
        )
    except nacl.exceptions.CryptoError:
        raise DecryptionError(
            f"the sealed payload does not authenticate for {context.purpose} of "
            f"{context.federation_id} round {context.round} attempt {context.attempt}"
        ) from None
