"""Audit commitments, reveals sealed to the auditor, and unpredictable challenge sampling.

A member commits to the exact quantized update its masked input hid:
``SHA-256(domain || salt || federation || round || attempt || member || dim ||
ring_bits || vector)``, every variable-length field length-prefixed so no two
different inputs share an encoding.  The 32-byte random salt makes the commitment
hiding (the update has far less than 256 bits of entropy in some coordinates); the
hash makes it binding.  The context fields bind it to one contribution, so a
commitment (or a reveal) for one round or member never verifies for another.

A reveal travels through the aggregator, so it is sealed (libsodium ``SealedBox``:
ephemeral X25519 + XSalsa20-Poly1305) to the auditor's X25519 key, derived from the
auditor's published Ed25519 identity key (birational map, as libsodium documents).
The aggregator relays bytes it cannot read.

Challenges are drawn from a *beacon* that exists only after the round closed (the
signed log head), so no member can know at training time whether it will be audited:
``(member, round)`` is challenged iff ``HMAC-SHA256(beacon, encoding(member, round))``
read as a uniform number in [0, 1) is below the audit rate.  Anyone holding the beacon
recomputes the same selection, so the auditor cannot pick targets either.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import nacl.bindings as sodium
import nacl.exceptions
import nacl.public
import numpy as np

from fedsec.crypto.errors import DecryptionError, IntegrityError, QuantizationError
from fedsec.crypto.identity import SigningIdentity
from fedsec.crypto.quantize import RingVector, ring_dtype

__all__ = [
    "BEACON_BYTES",
    "COMMITMENT_BYTES",
    "SALT_BYTES",
    "CommitmentContext",
    "auditor_curve25519_secret",
    "challenge_draw",
    "challenged",
    "commit",
    "open_reveal",
    "seal_reveal",
    "verify_commitment",
]

#: 256-bit salt: the commitment stays hiding even against a guesser who knows every
#: coordinate but one (matches ``fedsec.agent.vault.SALT_BYTES``).
SALT_BYTES: Final = 32
COMMITMENT_BYTES: Final = 32
#: The beacon is a SHA-256 log head hash.
BEACON_BYTES: Final = 32
ED25519_PUBLIC_BYTES: Final = 32
CURVE25519_SECRET_BYTES: Final = 32

_COMMIT_DOMAIN: Final = b"fedsec/v1/audit-commitment\x00"
_CHALLENGE_DOMAIN: Final = b"fedsec/v1/audit-challenge\x00"
_U64: Final = struct.Struct("<Q")
# 53 bits: the largest integer range a float64 represents exactly, so the uniform draw
# u = k / 2^53 has no rounding bias when compared with the rate.
_UNIFORM_BITS: Final = 53


@dataclass(frozen=True, slots=True)
class CommitmentContext:
    """Which contribution a commitment is for, and the ring its vector lives in."""

    federation_id: str
    round: int
    attempt: int
    member: str
    ring_bits: int

    def describe(self) -> str:
        return (
            f"member '{self.member}' round {self.round} attempt {self.attempt} "
            f"of federation '{self.federation_id}'"
        )


def _field(raw: bytes) -> bytes:
    return _U64.pack(len(raw)) + raw


def _canonical_vector(quantized: RingVector, ring_bits: int) -> tuple[int, bytes]:
    """(dim, little-endian bytes in the ring's dtype); refuses values outside the ring."""
    dtype = ring_dtype(ring_bits)
    arr = np.asarray(quantized)
    if arr.ndim != 1 or arr.dtype.kind != "u":
        raise QuantizationError(
            f"a committed vector is 1-D unsigned, got {arr.dtype} with shape {arr.shape}"
        )
    if arr.size and int(arr.max()) >> ring_bits:
        raise QuantizationError(f"committed vector has values outside the ring 2^{ring_bits}")
    return int(arr.size), np.ascontiguousarray(arr, dtype=dtype).tobytes()


def commit(quantized: RingVector, salt: bytes, context: CommitmentContext) -> bytes:
    """The 32-byte commitment to one member's quantized update.

    Args:
        quantized: the ring vector as quantized (``dim + 1`` elements, weight last).
        salt: the 32 random bytes kept with it in the member's vault.
        context: federation, round, attempt, member and ring width it belongs to.

    Returns:
        SHA-256 over the domain-separated encoding described in the module docstring.

    Raises:
        QuantizationError: the vector is not 1-D unsigned or leaves the ring.
        IntegrityError: the salt is not 32 bytes, or round/attempt is negative.
    """
    if len(salt) != SALT_BYTES:
        raise IntegrityError(f"a commitment salt is {SALT_BYTES} bytes, got {len(salt)}")
    if context.round < 0 or context.attempt < 0:
        raise IntegrityError(
            f"round and attempt must be >= 0, got {context.round}/{context.attempt}"
        )
    dim, body = _canonical_vector(quantized, context.ring_bits)
    digest = hashlib.sha256(_COMMIT_DOMAIN)
    digest.update(salt)
    digest.update(_field(context.federation_id.encode("utf-8")))
    digest.update(_U64.pack(context.round))
    digest.update(_U64.pack(context.attempt))
    digest.update(_field(context.member.encode("utf-8")))
    digest.update(_U64.pack(dim))
    digest.update(bytes([context.ring_bits]))
    digest.update(body)
    return digest.digest()


def verify_commitment(
    commitment: bytes, quantized: RingVector, salt: bytes, context: CommitmentContext
) -> None:
    """Check that a revealed vector and salt open ``commitment`` for ``context``.

    Raises:
        IntegrityError: they do not (the message names the member and round), or the
            salt/commitment has the wrong length or the vector is malformed.
    """
    if len(commitment) != COMMITMENT_BYTES:
        raise IntegrityError(
            f"commitment of {context.describe()} must be {COMMITMENT_BYTES} bytes, "
            f"got {len(commitment)}"
        )
    try:
        expected = commit(quantized, salt, context)
    except QuantizationError as exc:
        raise IntegrityError(f"revealed vector of {context.describe()}: {exc.detail}") from None
    if not hmac.compare_digest(expected, commitment):
        raise IntegrityError(
            f"revealed update of {context.describe()} does not match its commitment"
        )


# --- reveals sealed to the auditor ---------------------------------------------------------


def recipient_box_key(public_ed25519: bytes) -> nacl.public.PublicKey:
    """The X25519 box key of a published Ed25519 identity key (libsodium's birational map).

    Raises:
        DecryptionError: the key is not a valid Ed25519 public key.
    """
    if len(public_ed25519) != ED25519_PUBLIC_BYTES:
        raise DecryptionError(
            f"an Ed25519 public key is {ED25519_PUBLIC_BYTES} bytes, got {len(public_ed25519)}"
        )
    try:
        curve = sodium.crypto_sign_ed25519_pk_to_curve25519(public_ed25519)
    except nacl.exceptions.RuntimeError:
        raise DecryptionError("the key is not a valid Ed25519 public key") from None
    return nacl.public.PublicKey(curve)


def auditor_curve25519_secret(identity: SigningIdentity) -> bytes:
    """The X25519 secret matching ``identity``'s Ed25519 key, for :func:`open_reveal`."""
    return identity.x25519_secret()


def seal_reveal(auditor_public_ed25519: bytes, payload: bytes) -> bytes:
    """Encrypt ``payload`` so that only the auditor holding the Ed25519 key can open it.

    Raises:
        DecryptionError: the auditor key is malformed.
    """
    return bytes(nacl.public.SealedBox(recipient_box_key(auditor_public_ed25519)).encrypt(payload))


def open_reveal(curve25519_secret: bytes, sealed: bytes) -> bytes:
    """Decrypt a reveal sealed by :func:`seal_reveal`.

    Args:
        curve25519_secret: from :func:`auditor_curve25519_secret`.
        sealed: the sealed reveal.

    Raises:
        DecryptionError: sealed to another key, truncated or tampered.
    """
    if len(curve25519_secret) != CURVE25519_SECRET_BYTES:
        raise DecryptionError(
            f"an X25519 secret is {CURVE25519_SECRET_BYTES} bytes, got {len(curve25519_secret)}"
        )
    box = nacl.public.SealedBox(nacl.public.PrivateKey(curve25519_secret))
    try:
        return bytes(box.decrypt(sealed))
    except (nacl.exceptions.CryptoError, nacl.exceptions.ValueError, TypeError):
        raise DecryptionError("reveal is not sealed to this auditor's key") from None


# --- challenge sampling --------------------------------------------------------------------


def challenge_draw(member: str, round: int, beacon: bytes) -> float:
    """The uniform number in [0, 1) that decides whether ``(member, round)`` is audited.

    Raises:
        IntegrityError: beacon not 32 bytes, or a negative round.
    """
    if len(beacon) != BEACON_BYTES:
        raise IntegrityError(f"a challenge beacon is {BEACON_BYTES} bytes, got {len(beacon)}")
    if round < 0:
        raise IntegrityError(f"round must be >= 0, got {round}")
    message = _CHALLENGE_DOMAIN + _field(member.encode("utf-8")) + _U64.pack(round)
    mac = hmac.new(beacon, message, hashlib.sha256).digest()
    k = int.from_bytes(mac[:8], "big") >> (64 - _UNIFORM_BITS)
    return k / float(1 << _UNIFORM_BITS)


def challenged(members: Sequence[str], round: int, beacon: bytes, rate: float) -> list[str]:
    """The members of ``round`` whose updates must be revealed, in input order.

    Each member is selected independently with probability ``rate``; the choice is a
    deterministic function of the beacon, unknown to anyone before the beacon exists.

    Args:
        members: the round's contributing members (duplicates are an error).
        round: the round number.
        beacon: 32 bytes published after the round closed (the signed log head hash).
        rate: audit probability in [0, 1].

    Raises:
        IntegrityError: malformed beacon, negative round, bad rate or duplicate members.
    """
    if not (math.isfinite(rate) and 0.0 <= rate <= 1.0):
        raise IntegrityError(f"audit rate must be in [0, 1], got {rate}")
    if len(set(members)) != len(members):
        raise IntegrityError("challenge sampling got duplicate member ids")
    return [m for m in members if challenge_draw(m, round, beacon) < rate]
