"""Audit commitments bind a revealed update to one contribution; reveals open for one auditor;
challenges are a deterministic, unbiased function of the beacon."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsec.crypto.commitment import (
    CommitmentContext,
    auditor_curve25519_secret,
    challenge_draw,
    challenged,
    commit,
    open_reveal,
    seal_reveal,
    verify_commitment,
)
from fedsec.crypto.identity import SigningIdentity
from fedsec.crypto.quantize import QuantSpec, quantize
from fedsec.errors import DecryptionError, IntegrityError

SPEC = QuantSpec(8, 1.0, 13)
CTX = CommitmentContext("fed-a", 3, 0, "alice", SPEC.ring_bits)
SALT = bytes(range(32))


def _vector(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return quantize(rng.standard_normal(50).astype(np.float32) * 0.1, 0.5, SPEC, bytes(32))


def test_commitment_round_trip_and_known_answer() -> None:
    q = _vector()
    c = commit(q, SALT, CTX)
    assert len(c) == 32
    verify_commitment(c, q, SALT, CTX)
    # the encoding is fixed: recompute it by hand from the documented layout
    import struct

    def field(raw: bytes) -> bytes:
        return struct.pack("<Q", len(raw)) + raw

    body = np.ascontiguousarray(q, dtype="<u2").tobytes()
    manual = hashlib.sha256(
        b"fedsec/v1/audit-commitment\x00"
        + SALT
        + field(b"fed-a")
        + struct.pack("<QQ", 3, 0)
        + field(b"alice")
        + struct.pack("<Q", q.size)
        + bytes([13])
        + body
    ).digest()
    assert c == manual


def test_commitment_independent_of_in_memory_dtype() -> None:
    q = _vector()
    assert commit(q.astype(np.uint64), SALT, CTX) == commit(q, SALT, CTX)


def test_tampered_vector_refused() -> None:
    q = _vector()
    c = commit(q, SALT, CTX)
    forged = q.copy()
    forged[7] ^= 1
    with pytest.raises(IntegrityError, match=r"alice.*round 3"):
        verify_commitment(c, forged, SALT, CTX)
    # a truncated vector or one with an extra element is refused too
    with pytest.raises(IntegrityError):
        verify_commitment(c, q[:-1], SALT, CTX)
    with pytest.raises(IntegrityError):
        verify_commitment(c, np.append(q, q[:1]), SALT, CTX)
    verify_commitment(c, q, SALT, CTX)  # the original still verifies: nothing was changed


def test_tampered_salt_refused() -> None:
    q = _vector()
    c = commit(q, SALT, CTX)
    with pytest.raises(IntegrityError, match="does not match"):
        verify_commitment(c, q, bytes(32), CTX)
    with pytest.raises(IntegrityError, match="32 bytes"):
        verify_commitment(c, q, SALT[:31], CTX)


@pytest.mark.parametrize(
    "change",
    [
        {"federation_id": "fed-b"},
        {"round": 4},
        {"attempt": 1},
        {"member": "bob"},
        {"ring_bits": 14},
    ],
)
def test_other_context_refused(change: dict[str, object]) -> None:
    q = _vector()
    c = commit(q, SALT, CTX)
    other = dataclasses.replace(CTX, **change)  # type: ignore[arg-type]
    with pytest.raises(IntegrityError):
        verify_commitment(c, q, SALT, other)


def test_vector_outside_ring_refused() -> None:
    q = _vector().astype(np.uint16)
    q[0] = 1 << SPEC.ring_bits
    with pytest.raises(IntegrityError, match="outside the ring"):
        verify_commitment(bytes(32), q, SALT, CTX)


def test_member_field_is_length_prefixed() -> None:
    # "ab" + round vs "a" + shifted bytes must never collide: fields are length-prefixed
    q = _vector()
    a = commit(q, SALT, dataclasses.replace(CTX, federation_id="fed", member="xalice"))
    b = commit(q, SALT, dataclasses.replace(CTX, federation_id="fedx", member="alice"))
    assert a != b


@settings(max_examples=50, deadline=None)
@given(st.binary(min_size=32, max_size=32), st.integers(0, 2**20))
def test_commitment_binding_property(salt: bytes, round: int) -> None:
    q = _vector(round % 7)
    ctx = dataclasses.replace(CTX, round=round)
    c = commit(q, salt, ctx)
    verify_commitment(c, q, salt, ctx)
    with pytest.raises(IntegrityError):
        verify_commitment(c, q, salt, dataclasses.replace(ctx, round=round + 1))


# --- sealed reveals --------------------------------------------------------------------


def test_reveal_opens_for_the_auditor_only() -> None:
    auditor = SigningIdentity.generate()
    payload = b"revealed update bytes" * 10
    sealed = seal_reveal(auditor.public_bytes, payload)
    assert payload not in sealed
    assert open_reveal(auditor_curve25519_secret(auditor), sealed) == payload
    other = SigningIdentity.generate()
    with pytest.raises(DecryptionError, match="not sealed to this auditor's key"):
        open_reveal(auditor_curve25519_secret(other), sealed)


def test_tampered_or_truncated_reveal_refused() -> None:
    auditor = SigningIdentity.generate()
    secret = auditor_curve25519_secret(auditor)
    sealed = bytearray(seal_reveal(auditor.public_bytes, b"payload"))
    sealed[-1] ^= 1
    with pytest.raises(DecryptionError, match="not sealed to this auditor's key"):
        open_reveal(secret, bytes(sealed))
    with pytest.raises(DecryptionError, match="not sealed to this auditor's key"):
        open_reveal(secret, bytes(sealed[:20]))


def test_bad_auditor_key_refused() -> None:
    with pytest.raises(DecryptionError, match="32 bytes"):
        seal_reveal(b"short", b"x")


# --- challenge sampling ---------------------------------------------------------------


def test_challenges_deterministic_from_beacon() -> None:
    members = [f"m{i:04d}" for i in range(200)]
    beacon = hashlib.sha256(b"log head 17").digest()
    first = challenged(members, 17, beacon, 0.3)
    assert first == challenged(members, 17, beacon, 0.3)
    assert first == [m for m in members if m in set(first)]  # input order kept
    other = challenged(members, 17, hashlib.sha256(b"log head 18").digest(), 0.3)
    assert other != first  # a different beacon picks different members
    assert challenged(members, 18, beacon, 0.3) != first  # and so does another round
    # monotone in the rate: a member picked at 0.3 is picked at any higher rate
    assert set(first) <= set(challenged(members, 17, beacon, 0.5))
    assert challenged(members, 17, beacon, 0.0) == []
    assert challenged(members, 17, beacon, 1.0) == members


def test_challenge_rate_is_respected() -> None:
    members = [f"member-{i}" for i in range(4000)]
    beacon = hashlib.sha256(b"beacon").digest()
    for rate in (0.05, 0.25):
        picked = len(challenged(members, 5, beacon, rate))
        sd = (len(members) * rate * (1 - rate)) ** 0.5
        assert abs(picked - len(members) * rate) < 4 * sd
    draws = [challenge_draw(m, 5, beacon) for m in members]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert abs(float(np.mean(draws)) - 0.5) < 0.02


def test_challenge_arguments_checked() -> None:
    beacon = bytes(32)
    with pytest.raises(IntegrityError, match="32 bytes"):
        challenged(["a"], 1, b"short", 0.5)
    with pytest.raises(IntegrityError, match="rate"):
        challenged(["a"], 1, beacon, 1.5)
    with pytest.raises(IntegrityError, match="duplicate"):
        challenged(["a", "a"], 1, beacon, 0.5)
