"""The decryption body and the sealed release: framing and refusals."""

from __future__ import annotations

import pytest

from fedsec.crypto.sealing import KEY_BOX_BYTES
from fedsec.errors import PayloadError
from fedsec.protocol import he_release


def _release(n: int = 2) -> he_release.SealedRelease:
    return he_release.SealedRelease(
        {f"m{i}": bytes([i]) * KEY_BOX_BYTES for i in range(n)}, b"c" * 40
    )


def test_sealed_release_round_trips() -> None:
    release = _release(3)
    assert he_release.decode_sealed(release.encode()) == release


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"\x01\x00", "u32 count"),
        ((0).to_bytes(4, "little") + b"x", "1..65535 recipients"),
        ((200_000).to_bytes(4, "little"), "1..65535 recipients"),
        ((5).to_bytes(4, "little") + b"x" * 20, "cut off"),
    ],
)
def test_malformed_sealed_releases_are_refused(raw: bytes, match: str) -> None:
    with pytest.raises(PayloadError, match=match):
        he_release.decode_sealed(raw)


def test_repeated_recipient_and_missing_ciphertext_are_refused() -> None:
    box = b"\x00" * KEY_BOX_BYTES
    entry = b"\x01m" + box
    with pytest.raises(PayloadError, match="twice"):
        he_release.decode_sealed((2).to_bytes(4, "little") + entry + entry + b"c")
    with pytest.raises(PayloadError, match="no ciphertext"):
        he_release.decode_sealed((1).to_bytes(4, "little") + entry)


def test_split_payload_needs_a_model_after_the_sum() -> None:
    assert he_release.split_payload(b"\x00" * 16 + b"model", 2) == (b"\x00" * 16, b"model")
    with pytest.raises(PayloadError, match="need more"):
        he_release.split_payload(b"\x00" * 16, 2)
