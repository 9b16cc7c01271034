"""End-to-end encryption of messages between two members, relayed by the aggregator.

X25519 agreement (``crypto_box_beforenm``: X25519 then HSalsa20, as in NaCl's Box)
gives a pairwise key; XChaCha20-Poly1305 encrypts with a random 24-byte nonce and
authenticates the associated data.  The associated data binds every ciphertext to
its purpose, federation, round, sender and recipient, so the relaying aggregator
cannot replay a share to another pair, another round or another federation: it
would fail authentication on opening.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import nacl.bindings as sodium
import nacl.exceptions
import nacl.public

from fedsec.crypto.errors import DecryptionError
from fedsec.crypto.identity import canonical_json

NONCE_BYTES = sodium.crypto_aead_xchacha20poly1305_ietf_NPUBBYTES  # 24: random nonces are safe
TAG_BYTES = sodium.crypto_aead_xchacha20poly1305_ietf_ABYTES
KEY_BYTES = 32


@dataclass(frozen=True)
class EnvelopeContext:
    """What a ciphertext is bound to; becomes the AEAD associated data."""

    purpose: str
    federation_id: str
    round: int
    sender: str
    recipient: str

    def associated_data(self) -> bytes:
        return b"fedsec/v1/envelope\x00" + canonical_json(
            [self.purpose, self.federation_id, self.round, self.sender, self.recipient]
        )


class KeyAgreementKey:
    """An X25519 key pair (ephemeral per round in SecAgg+)."""

    __slots__ = ("_private",)

    def __init__(self, secret: bytes | None = None) -> None:
        self._private = (
            nacl.public.PrivateKey.generate() if secret is None else nacl.public.PrivateKey(secret)
        )

    @property
    def public_bytes(self) -> bytes:
        return bytes(self._private.public_key)

    @property
    def secret_bytes(self) -> bytes:
        """The raw secret; only for Shamir-sharing it, never for logging or storage in clear."""
        return bytes(self._private)

    def shared_key(self, peer_public: bytes) -> bytes:
        """32-byte pairwise key with ``peer_public`` (X25519 + HSalsa20)."""
        return shared_key(self.secret_bytes, peer_public)


def shared_key(secret: bytes, peer_public: bytes) -> bytes:
    """Pairwise key from a raw X25519 secret (e.g. one reconstructed from Shamir shares).

    Straight to libsodium: building a ``PrivateKey`` would also derive its public key,
    a second scalar multiplication per agreement that nothing uses.
    """
    if len(secret) != KEY_BYTES:
        raise DecryptionError(f"an X25519 secret key is 32 bytes, got {len(secret)}")
    if len(peer_public) != KEY_BYTES:
        raise DecryptionError(f"an X25519 public key is 32 bytes, got {len(peer_public)}")
    try:
        return bytes(sodium.crypto_box_beforenm(peer_public, secret))
    except nacl.exceptions.RuntimeError:
        raise DecryptionError("X25519 agreement failed (low-order public key)") from None


def seal(key: bytes, plaintext: bytes, context: EnvelopeContext) -> bytes:
    """Encrypt ``plaintext`` under the pairwise ``key``; returns nonce || ciphertext || tag."""
    nonce = os.urandom(NONCE_BYTES)
    body = sodium.crypto_aead_xchacha20poly1305_ietf_encrypt(
        plaintext, context.associated_data(), nonce, key
    )
    return nonce + bytes(body)


def open_sealed(key: bytes, sealed: bytes, context: EnvelopeContext) -> bytes:
    """Decrypt what :func:`seal` produced for the same key and context.

    Raises:
        DecryptionError: truncated, tampered, or sealed for another context.
    """
    if len(sealed) < NONCE_BYTES + TAG_BYTES:
        raise DecryptionError(
            f"{context.purpose} from {context.sender} is {len(sealed)} bytes, too short"
        )
    try:
        return bytes(
            sodium.crypto_aead_xchacha20poly1305_ietf_decrypt(
                sealed[NONCE_BYTES:], context.associated_data(), sealed[:NONCE_BYTES], key
            )
        )
    except nacl.exceptions.CryptoError:
        raise DecryptionError(
            f"{context.purpose} from {context.sender} to {context.recipient} failed "
            f"authentication (tampered, or not for this round/pair)"
        ) from None
