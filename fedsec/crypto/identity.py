"""Long-lived identities: Ed25519 signing keys and their public halves.

Every signature fedsec makes is over ``DOMAIN_PREFIX || domain || 0x00 || message``
so a signature made for one message type can never be replayed as another
(a signed key advertisement is not a signed receipt, even if the bytes match).
Key ids are fingerprints of the public key, so they are self-certifying.

No I/O here: a secret key travels as bytes (:meth:`SigningIdentity.to_secret_bytes`,
:meth:`SigningIdentity.from_secret_bytes`); :mod:`fedsec.keys` writes and reads the
files, with their permissions.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import nacl.exceptions
import nacl.signing

from fedsec.crypto.errors import KeyFileError, SignatureError

DOMAIN_PREFIX = b"fedsec/v1/"
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
_KEY_FILE_KIND = "fedsec-ed25519-secret"


def key_id(public_key: bytes) -> str:
    """Fingerprint of an Ed25519 public key: ``"ed25519:"`` + first 16 bytes of SHA-256, hex."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise SignatureError(f"an Ed25519 public key is 32 bytes, got {len(public_key)}")
    return "ed25519:" + hashlib.sha256(public_key).hexdigest()[:32]


# One encoder for every call: json.dumps with non-default options builds a new
# JSONEncoder each time, which was half the cost of encoding a SecAgg+ envelope's
# associated data (~70 encodings per member and round).  The encoder keeps no state.
_CANONICAL_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical_json(value: Any) -> bytes:
    """Deterministic JSON encoding (sorted keys, no spaces, UTF-8) for signing and hashing."""
    return _CANONICAL_ENCODER.encode(value).encode()


def _signed_bytes(domain: str, message: bytes) -> bytes:
    if not domain or "\x00" in domain:
        raise ValueError("signature domain must be a non-empty string without NUL")
    return DOMAIN_PREFIX + domain.encode() + b"\x00" + message


class PublicIdentity:
    """The public half of an identity: verifies signatures."""

    __slots__ = ("_verify_key", "public_bytes")

    def __init__(self, public_bytes: bytes) -> None:
        if len(public_bytes) != PUBLIC_KEY_BYTES:
            raise SignatureError(f"an Ed25519 public key is 32 bytes, got {len(public_bytes)}")
        self.public_bytes = bytes(public_bytes)
        self._verify_key = nacl.signing.VerifyKey(self.public_bytes)

    @property
    def key_id(self) -> str:
        return key_id(self.public_bytes)

    def verify(self, domain: str, message: bytes, signature: bytes) -> None:
        """Check ``signature`` over ``message`` in ``domain``.

        Raises:
            SignatureError: the signature is malformed or does not verify.
        """
        if len(signature) != SIGNATURE_BYTES:
            raise SignatureError(f"{domain}: signature must be 64 bytes, got {len(signature)}")
        try:
            self._verify_key.verify(_signed_bytes(domain, message), signature)
        except nacl.exceptions.BadSignatureError:
            raise SignatureError(f"{domain}: signature by {self.key_id} does not verify") from None

    def verify_http_signature_base(self, signature_base: bytes, signature: bytes) -> bool:
        """Whether ``signature`` is this key's plain Ed25519 signature over an RFC 9421
        signature base (see :meth:`SigningIdentity.sign_http_signature_base`).

        libsodium's check (pynacl), as for every other fedsec signature: half the CPU of
        OpenSSL's on the aggregator's hottest path, one check per signed request.
        """
        if len(signature) != SIGNATURE_BYTES or not signature_base.startswith(b'"'):
            return False
        try:
            self._verify_key.verify(signature_base, signature)
        except nacl.exceptions.BadSignatureError:
            return False
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PublicIdentity) and other.public_bytes == self.public_bytes

    def __hash__(self) -> int:
        return hash(self.public_bytes)

    def __repr__(self) -> str:
        return f"PublicIdentity({self.key_id})"


class SigningIdentity:
    """An Ed25519 signing key. Never logged, never serialised except to a 0600 file."""

    __slots__ = ("_signing_key", "public")

    def __init__(self, seed: bytes) -> None:
        if len(seed) != 32:
            raise KeyFileError(f"an Ed25519 seed is 32 bytes, got {len(seed)}")
        self._signing_key = nacl.signing.SigningKey(seed)
        self.public = PublicIdentity(bytes(self._signing_key.verify_key))

    @classmethod
    def generate(cls) -> SigningIdentity:
        return cls(os.urandom(32))

    @property
    def key_id(self) -> str:
        return self.public.key_id

    @property
    def public_bytes(self) -> bytes:
        return self.public.public_bytes

    def sign(self, domain: str, message: bytes) -> bytes:
        """Detached Ed25519 signature over ``message`` in ``domain``."""
        return bytes(self._signing_key.sign(_signed_bytes(domain, message)).signature)

    def sign_http_signature_base(self, signature_base: bytes) -> bytes:
        """Plain Ed25519 over an RFC 9421 signature base (``alg="ed25519"`` requires it).

        Every RFC 9421 signature base starts with ``"`` (the first component
        identifier) while every domain-separated message starts with
        ``fedsec/v1/``, so neither kind of signature can pass as the other.

        Raises:
            ValueError: ``signature_base`` does not start with ``"``.
        """
        if not signature_base.startswith(b'"'):
            raise ValueError("an RFC 9421 signature base starts with a quoted component name")
        return bytes(self._signing_key.sign(signature_base).signature)

    def x25519_secret(self) -> bytes:
        """The X25519 secret birationally equivalent to this Ed25519 key.

        Lets an auditor open reveals sealed to its Ed25519 public key without a second
        key pair to distribute.  Never log or store the result.
        """
        return bytes(self._signing_key.to_curve25519_private_key())

    def to_secret_bytes(self) -> bytes:
        """The secret key document (kind, seed, public key) that a key file holds.

        Secret: only :func:`fedsec.keys.save_identity` should see it, to write it to a
        0600 file.
        """
        return canonical_json(
            {
                "kind": _KEY_FILE_KIND,
                "seed": bytes(self._signing_key).hex(),
                "public_key": self.public_bytes.hex(),
            }
        )

    @classmethod
    def from_secret_bytes(cls, document: bytes) -> SigningIdentity:
        """Read a document written by :meth:`to_secret_bytes`.

        Raises:
            KeyFileError: not a fedsec Ed25519 secret key, or its public key does not
                match its seed; the detail says which.
        """
        try:
            doc = json.loads(document)
            if not isinstance(doc, dict) or doc.get("kind") != _KEY_FILE_KIND:
                raise ValueError("not a fedsec Ed25519 key file")
            identity = cls(bytes.fromhex(doc["seed"]))
            if identity.public_bytes.hex() != doc["public_key"]:
                raise ValueError("public key does not match the secret key")
        except (ValueError, KeyError, TypeError) as exc:
            raise KeyFileError(str(exc)) from None
        return identity

    def __repr__(self) -> str:
        return f"SigningIdentity({self.key_id})"
