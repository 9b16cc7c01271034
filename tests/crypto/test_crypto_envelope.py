"""Member-to-member envelopes: a share opens only for its pair, round, federation and purpose."""

from __future__ import annotations

import dataclasses

import pytest

from fedsec.crypto.envelope import (
    NONCE_BYTES,
    TAG_BYTES,
    EnvelopeContext,
    KeyAgreementKey,
    open_sealed,
    seal,
    shared_key,
)
from fedsec.errors import DecryptionError

CTX = EnvelopeContext("secagg-share", "fed-a", 7, "alice", "bob")
PLAINTEXT = b"share bytes \x00\x01\x02" * 3


@pytest.fixture()
def pair() -> tuple[KeyAgreementKey, KeyAgreementKey]:
    return KeyAgreementKey(), KeyAgreementKey()


def _sealed(pair: tuple[KeyAgreementKey, KeyAgreementKey]) -> bytes:
    alice, bob = pair
    return seal(alice.shared_key(bob.public_bytes), PLAINTEXT, CTX)


def test_round_trip_both_ends_derive_same_key(
    pair: tuple[KeyAgreementKey, KeyAgreementKey],
) -> None:
    alice, bob = pair
    assert alice.shared_key(bob.public_bytes) == bob.shared_key(alice.public_bytes)
    sealed = _sealed(pair)
    assert len(sealed) == NONCE_BYTES + len(PLAINTEXT) + TAG_BYTES
    assert open_sealed(bob.shared_key(alice.public_bytes), sealed, CTX) == PLAINTEXT


def test_reconstructed_secret_gives_same_key(
    pair: tuple[KeyAgreementKey, KeyAgreementKey],
) -> None:
    alice, bob = pair
    assert shared_key(alice.secret_bytes, bob.public_bytes) == alice.shared_key(bob.public_bytes)


def test_nonces_are_fresh(pair: tuple[KeyAgreementKey, KeyAgreementKey]) -> None:
    a, b = _sealed(pair), _sealed(pair)
    assert a[:NONCE_BYTES] != b[:NONCE_BYTES]
    assert a != b


def test_wrong_recipient_key(pair: tuple[KeyAgreementKey, KeyAgreementKey]) -> None:
    alice, _ = pair
    eve = KeyAgreementKey()
    with pytest.raises(DecryptionError):
        open_sealed(eve.shared_key(alice.public_bytes), _sealed(pair), CTX)


@pytest.mark.parametrize(
    "changes",
    [
        {"sender": "bob", "recipient": "alice"},  # swapped: relayed back the other way
        {"round": 8},
        {"federation_id": "fed-b"},
        {"purpose": "receipt"},
        {"sender": "carol"},
        {"recipient": "carol"},
    ],
)
def test_other_context_refused(
    pair: tuple[KeyAgreementKey, KeyAgreementKey], changes: dict[str, object]
) -> None:
    alice, bob = pair
    sealed = _sealed(pair)
    other = dataclasses.replace(CTX, **changes)  # type: ignore[arg-type]
    with pytest.raises(DecryptionError):
        open_sealed(bob.shared_key(alice.public_bytes), sealed, other)
    # the right context still opens it: refusal did not depend on anything else
    assert open_sealed(bob.shared_key(alice.public_bytes), sealed, CTX) == PLAINTEXT


def test_associated_data_fields_cannot_be_shifted() -> None:
    # JSON encoding keeps ("a-b", "c") and ("a", "b-c") apart, unlike naive concatenation
    a = EnvelopeContext("p", "fed", 1, "a-b", "c").associated_data()
    b = EnvelopeContext("p", "fed", 1, "a", "b-c").associated_data()
    assert a != b


@pytest.mark.parametrize("position", [0, NONCE_BYTES, NONCE_BYTES + 5, -1])
def test_tampered_ciphertext(pair: tuple[KeyAgreementKey, KeyAgreementKey], position: int) -> None:
    alice, bob = pair
    sealed = bytearray(_sealed(pair))
    sealed[position] ^= 0x01
    with pytest.raises(DecryptionError):
        open_sealed(bob.shared_key(alice.public_bytes), bytes(sealed), CTX)


@pytest.mark.parametrize("length", [0, 1, NONCE_BYTES, NONCE_BYTES + TAG_BYTES - 1, -1])
def test_truncated(pair: tuple[KeyAgreementKey, KeyAgreementKey], length: int) -> None:
    alice, bob = pair
    sealed = _sealed(pair)
    cut = sealed[:length]
    with pytest.raises(DecryptionError):
        open_sealed(bob.shared_key(alice.public_bytes), cut, CTX)


def test_extended_ciphertext(pair: tuple[KeyAgreementKey, KeyAgreementKey]) -> None:
    alice, bob = pair
    with pytest.raises(DecryptionError):
        open_sealed(bob.shared_key(alice.public_bytes), _sealed(pair) + b"\x00", CTX)


def test_bad_peer_public_keys() -> None:
    key = KeyAgreementKey()
    with pytest.raises(DecryptionError):
        key.shared_key(bytes(31))
    with pytest.raises(DecryptionError):
        key.shared_key(bytes(32))  # all-zero point has small order: agreement must fail


def test_empty_plaintext_round_trip(pair: tuple[KeyAgreementKey, KeyAgreementKey]) -> None:
    alice, bob = pair
    sealed = seal(alice.shared_key(bob.public_bytes), b"", CTX)
    assert open_sealed(bob.shared_key(alice.public_bytes), sealed, CTX) == b""


def test_agreement_refuses_low_order_and_wrong_length_keys() -> None:
    alice = KeyAgreementKey()
    with pytest.raises(DecryptionError, match="low-order"):
        alice.shared_key(bytes(32))  # the identity point: the agreement would be all zero
    with pytest.raises(DecryptionError, match="public key is 32 bytes"):
        shared_key(alice.secret_bytes, bytes(31))
    with pytest.raises(DecryptionError, match="secret key is 32 bytes"):
        shared_key(alice.secret_bytes[:31], KeyAgreementKey().public_bytes)
