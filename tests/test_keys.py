"""Key files: secret keys written 0600 atomically and never overwritten, unsafe modes and
malformed files refused, public keys as hex text."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest

from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import KeyFileError
from fedsec.keys import load_identity, load_public_key, save_identity, save_public_key
from tests.crypto.test_crypto_identity import MALFORMED_SECRET_DOCUMENTS, RFC8032_PUBLIC


def test_save_writes_0600_and_load_round_trips(tmp_path: Path) -> None:
    identity = SigningIdentity.generate()
    path = tmp_path / "keys" / "agent.key"
    save_identity(identity, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    loaded = load_identity(path)
    assert loaded.public_bytes == identity.public_bytes
    loaded.public.verify("d", b"m", identity.sign("d", b"m"))
    assert not [p for p in path.parent.iterdir() if p.name != "agent.key"]  # no temp left


def test_save_is_0600_even_with_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        path = tmp_path / "agent.key"
        save_identity(SigningIdentity.generate(), path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o660, 0o644])
def test_load_refuses_group_or_other_accessible(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "agent.key"
    save_identity(SigningIdentity.generate(), path)
    before = path.read_bytes()
    path.chmod(mode)
    with pytest.raises(KeyFileError, match="chmod 600"):
        load_identity(path)
    assert path.read_bytes() == before
    assert stat.S_IMODE(path.stat().st_mode) == mode  # we refuse; we do not "fix" it silently


def test_save_refuses_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "agent.key"
    first = SigningIdentity.generate()
    save_identity(first, path)
    before = path.read_bytes()
    with pytest.raises(KeyFileError, match="refusing to overwrite"):
        save_identity(SigningIdentity.generate(), path)
    assert path.read_bytes() == before
    assert load_identity(path).public_bytes == first.public_bytes


def test_load_missing_file(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError):
        load_identity(tmp_path / "absent.key")


@pytest.mark.parametrize("body", MALFORMED_SECRET_DOCUMENTS)
def test_load_malformed_file_is_key_file_error(tmp_path: Path, body: bytes) -> None:
    path = tmp_path / "agent.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(body)
    with pytest.raises(KeyFileError, match=re.escape(f"key file {path} is malformed")):
        load_identity(path)
    assert path.read_bytes() == body


def test_public_key_file_round_trip_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "agent.pub"
    save_public_key(path, RFC8032_PUBLIC)
    assert load_public_key(path) == RFC8032_PUBLIC
    (tmp_path / "short.pub").write_text("00" * 31)
    with pytest.raises(KeyFileError):
        load_public_key(tmp_path / "short.pub")
    (tmp_path / "bad.pub").write_text("xyz")
    with pytest.raises(KeyFileError):
        load_public_key(tmp_path / "bad.pub")
    with pytest.raises(KeyFileError):
        load_public_key(tmp_path / "absent.pub")
