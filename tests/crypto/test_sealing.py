"""One payload sealed to many recipients (hidden models)."""

from __future__ import annotations

import pytest

from fedsec.crypto.errors import DecryptionError
from fedsec.crypto.identity import SigningIdentity
from fedsec.crypto.sealing import (
    KEY_BOX_BYTES,
    ReleaseContext,
    open_payload,
    seal_to_recipients,
)

CTX = ReleaseContext("he-model-release", "fed", 3, 0)


def _ids(n: int) -> dict[str, SigningIdentity]:
    return {f"m{i}": SigningIdentity.generate() for i in range(n)}


def test_every_recipient_opens_the_same_payload() -> None:
    ids = _ids(3)
    sealed = seal_to_recipients({m: i.public_bytes for m, i in ids.items()}, b"model", CTX)
    assert sorted(sealed.boxes) == ["m0", "m1", "m2"]
    assert all(len(b) == KEY_BOX_BYTES for b in sealed.boxes.values())
    for member, identity in ids.items():
        assert (
            open_payload(identity.x25519_secret(), sealed.boxes[member], sealed.ciphertext, CTX)
            == b"model"
        )


def test_a_non_recipient_cannot_open_with_any_box() -> None:
    ids = _ids(2)
    outsider = SigningIdentity.generate()
    sealed = seal_to_recipients({m: i.public_bytes for m, i in ids.items()}, b"model", CTX)
    for box in sealed.boxes.values():
        with pytest.raises(DecryptionError, match="not sealed to this key"):
            open_payload(outsider.x25519_secret(), box, sealed.ciphertext, CTX)


def test_tampered_or_rebound_payload_is_refused() -> None:
    identity = SigningIdentity.generate()
    sealed = seal_to_recipients({"m": identity.public_bytes}, b"model", CTX)
    box, secret = sealed.boxes["m"], identity.x25519_secret()
    flipped = sealed.ciphertext[:-1] + bytes([sealed.ciphertext[-1] ^ 1])
    with pytest.raises(DecryptionError, match="does not authenticate"):
        open_payload(secret, box, flipped, CTX)
    with pytest.raises(DecryptionError, match="does not authenticate"):
        open_payload(secret, box, sealed.ciphertext, ReleaseContext(CTX.purpose, "fed", 4, 0))
    with pytest.raises(DecryptionError, match="is 80 bytes"):
        open_payload(secret, box[:-1], sealed.ciphertext, CTX)
    with pytest.raises(DecryptionError, match="at least"):
        open_payload(secret, box, sealed.ciphertext[:10], CTX)


def test_two_releases_of_one_payload_share_no_bytes() -> None:
    identity = SigningIdentity.generate()
    a = seal_to_recipients({"m": identity.public_bytes}, b"model", CTX)
    b = seal_to_recipients({"m": identity.public_bytes}, b"model", CTX)
    assert a.ciphertext != b.ciphertext and a.boxes["m"] != b.boxes["m"]


def test_no_recipient_or_a_bad_key_is_refused() -> None:
    with pytest.raises(DecryptionError, match="at least one recipient"):
        seal_to_recipients({}, b"x", CTX)
    with pytest.raises(DecryptionError, match="32 bytes"):
        seal_to_recipients({"m": b"short"}, b"x", CTX)
