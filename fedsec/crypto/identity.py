"""Long-lived identities: Ed25519 signing keys and their public halves.

Every signature fedsec makes is over ``DOMAIN_PREFIX || domain || 0x00 || message``
so a signature made for one message type can never be replayed as another
(a signed key advertisement is not a signed receipt, even if the bytes match).
Key ids are fingerprints of the public key, so they are self-certifying.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

import nacl.exceptions
import nacl.signing

from fedsec.errors import KeyFileError, SignatureError
from fedsec.fsio import atomic_write

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

    def save(self, path: Path) -> None:
        """Write the secret key to ``path`` with mode 0600, atomically; refuses to overwrite."""
        path = Path(path)
        if path.exists():
            raise KeyFileError(f"{path} already exists; refusing to overwrite a key")
        body = canonical_json(
            {
                "kind": _KEY_FILE_KIND,
                "seed": bytes(self._signing_key).hex(),
                "public_key": self.public_bytes.hex(),
            }
        )
        write_secret_file(path, body)

    @classmethod
    def load(cls, path: Path) -> SigningIdentity:
        """Read a key written by :meth:`save`.

        Raises:
            KeyFileError: missing, readable by group/others, or malformed.
        """
        path = Path(path)
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            raise KeyFileError(f"key file {path} does not exist") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise KeyFileError(
                f"key file {path} is accessible by group or others "
                f"(mode {stat.S_IMODE(mode):o}); run: chmod 600 {path}"
            )
        try:
            doc = json.loads(path.read_bytes())
            if not isinstance(doc, dict) or doc.get("kind") != _KEY_FILE_KIND:
                raise ValueError("not a fedsec Ed25519 key file")
            identity = cls(bytes.fromhex(doc["seed"]))
            if identity.public_bytes.hex() != doc["public_key"]:
                raise ValueError("public key does not match the secret key")
        except (ValueError, KeyError, TypeError) as exc:
            raise KeyFileError(f"key file {path} is malformed: {exc}") from None
        return identity

    def __repr__(self) -> str:
        return f"SigningIdentity({self.key_id})"


def write_secret_file(path: Path, body: bytes) -> None:
    """Create ``path`` with mode 0600 holding ``body``: temp file, fsync, rename."""
    atomic_write(Path(path), body, mode=0o600, parents_mode=0o777)


def save_public_key(path: Path, public_bytes: bytes) -> None:
    """Write a public key as hex text (the form handed to the consortium)."""
    Path(path).write_text(public_bytes.hex() + "\n")


def load_public_key(path: Path) -> bytes:
    """Read a public key written by :func:`save_public_key`.

    Raises:
        KeyFileError: missing or not 32 bytes of hex.
    """
    try:
        text = Path(path).read_text().strip()
        raw = bytes.fromhex(text)
    except FileNotFoundError:
        raise KeyFileError(f"public key file {path} does not exist") from None
    except ValueError:
        raise KeyFileError(f"public key file {path} is not hex") from None
    if len(raw) != PUBLIC_KEY_BYTES:
        raise KeyFileError(f"public key file {path} holds {len(raw)} bytes, expected 32")
    return raw
