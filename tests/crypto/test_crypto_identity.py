"""Long-lived Ed25519 identities: the primitive against RFC 8032, our domain rules, the secret
key document (the files themselves: tests/test_keys.py)."""

from __future__ import annotations

import json

import nacl.exceptions
import nacl.signing
import pytest

from fedsec.crypto.identity import (
    DOMAIN_PREFIX,
    PublicIdentity,
    SigningIdentity,
    canonical_json,
    key_id,
)
from fedsec.errors import KeyFileError, SignatureError

# RFC 8032 §7.1, TEST 1 (empty message)
RFC8032_SECRET = bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
RFC8032_PUBLIC = bytes.fromhex("d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a")
RFC8032_SIGNATURE = bytes.fromhex(
    "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b"
)


def _good_doc() -> dict[str, str]:
    return {
        "kind": "fedsec-ed25519-secret",
        "seed": RFC8032_SECRET.hex(),
        "public_key": RFC8032_PUBLIC.hex(),
    }


MALFORMED_SECRET_DOCUMENTS = [
    b"",
    b"not json",
    b"\xff\xfe garbage",
    b"[]",
    b"42",
    b'"a string"',
    json.dumps({**_good_doc(), "kind": "something-else"}).encode(),
    json.dumps({k: v for k, v in _good_doc().items() if k != "seed"}).encode(),
    json.dumps({**_good_doc(), "seed": "zz" * 32}).encode(),
    json.dumps({**_good_doc(), "seed": "00" * 31}).encode(),
    json.dumps({**_good_doc(), "seed": 12}).encode(),
    json.dumps({**_good_doc(), "public_key": "00" * 32}).encode(),
]


def test_ed25519_rfc8032_test1_primitive() -> None:
    signing = nacl.signing.SigningKey(RFC8032_SECRET)
    assert bytes(signing.verify_key) == RFC8032_PUBLIC
    assert signing.sign(b"").signature == RFC8032_SIGNATURE
    nacl.signing.VerifyKey(RFC8032_PUBLIC).verify(b"", RFC8032_SIGNATURE)
    with pytest.raises(nacl.exceptions.BadSignatureError):
        nacl.signing.VerifyKey(RFC8032_PUBLIC).verify(b"x", RFC8032_SIGNATURE)


def test_wrapper_uses_the_rfc8032_key_and_signs_with_domain_prefix() -> None:
    identity = SigningIdentity(RFC8032_SECRET)
    assert identity.public_bytes == RFC8032_PUBLIC
    sig = identity.sign("receipt", b"")
    # the wrapper never signs the bare message: the RFC signature over b"" is not ours ...
    assert sig != RFC8032_SIGNATURE
    with pytest.raises(SignatureError):
        identity.public.verify("receipt", b"", RFC8032_SIGNATURE)
    # ... it signs DOMAIN_PREFIX || domain || 0x00 || message with the plain primitive
    raw = nacl.signing.SigningKey(RFC8032_SECRET).sign(DOMAIN_PREFIX + b"receipt\x00").signature
    assert sig == raw


def test_sign_verify_round_trip() -> None:
    identity = SigningIdentity.generate()
    sig = identity.sign("advertise", b"hello")
    assert len(sig) == 64
    identity.public.verify("advertise", b"hello", sig)
    PublicIdentity(identity.public_bytes).verify("advertise", b"hello", sig)


def test_signature_in_one_domain_fails_in_another() -> None:
    identity = SigningIdentity.generate()
    sig = identity.sign("secagg-advertise-keys", b"payload")
    with pytest.raises(SignatureError):
        identity.public.verify("receipt", b"payload", sig)


def test_domain_boundary_is_unambiguous() -> None:
    # ("ab", "\x00c") vs ("a", "b\x00c"): the NUL separator and the ban on NUL in domains
    # keep (domain, message) pairs from colliding.
    identity = SigningIdentity.generate()
    sig = identity.sign("a", b"b")
    with pytest.raises(SignatureError):
        identity.public.verify("ab", b"", sig)
    with pytest.raises(ValueError):
        identity.sign("a\x00b", b"")
    with pytest.raises(ValueError):
        identity.sign("", b"")


def test_wrong_key_refused() -> None:
    alice, mallory = SigningIdentity.generate(), SigningIdentity.generate()
    sig = mallory.sign("d", b"m")
    with pytest.raises(SignatureError):
        alice.public.verify("d", b"m", sig)


def test_tampered_message_and_signature_refused() -> None:
    identity = SigningIdentity.generate()
    sig = identity.sign("d", b"message")
    with pytest.raises(SignatureError):
        identity.public.verify("d", b"messagE", sig)
    flipped = bytes([sig[0] ^ 1]) + sig[1:]
    with pytest.raises(SignatureError):
        identity.public.verify("d", b"message", flipped)
    with pytest.raises(SignatureError):
        identity.public.verify("d", b"message", sig[:63])


def test_key_id_is_sha256_fingerprint() -> None:
    identity = SigningIdentity(RFC8032_SECRET)
    assert identity.key_id == key_id(RFC8032_PUBLIC)
    assert identity.key_id.startswith("ed25519:")
    assert len(identity.key_id) == len("ed25519:") + 32
    with pytest.raises(SignatureError):
        key_id(bytes(31))
    with pytest.raises(SignatureError):
        PublicIdentity(bytes(33))


def test_seed_length_checked() -> None:
    with pytest.raises(KeyFileError):
        SigningIdentity(bytes(31))


# -- the secret key document (written to files by fedsec.keys) -----------------------------------


def test_secret_document_round_trips_and_is_the_key_file_format() -> None:
    identity = SigningIdentity(RFC8032_SECRET)
    document = identity.to_secret_bytes()
    # the on-disk format of every key file written so far: it must not change
    assert json.loads(document) == {
        "kind": "fedsec-ed25519-secret",
        "seed": RFC8032_SECRET.hex(),
        "public_key": RFC8032_PUBLIC.hex(),
    }
    assert document == canonical_json(json.loads(document))
    loaded = SigningIdentity.from_secret_bytes(document)
    assert loaded.public_bytes == RFC8032_PUBLIC
    loaded.public.verify("d", b"m", identity.sign("d", b"m"))


@pytest.mark.parametrize("body", MALFORMED_SECRET_DOCUMENTS)
def test_malformed_secret_document_is_key_file_error(body: bytes) -> None:
    with pytest.raises(KeyFileError):
        SigningIdentity.from_secret_bytes(body)


def test_repr_never_shows_secret() -> None:
    identity = SigningIdentity(RFC8032_SECRET)
    assert RFC8032_SECRET.hex() not in repr(identity)
    assert identity.key_id in repr(identity)
