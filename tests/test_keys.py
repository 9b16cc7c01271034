"""Key files: secret keys written 0600 atomically and never overwritten, unsafe modes and
malformed files refused, public keys as hex text."""

from __future__ import annotations

import os
import re
import stat
import threading
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


def _save_at_once(identities: list[SigningIdentity], path: Path) -> list[BaseException | None]:
    """Each identity saved to ``path`` by its own thread, all released together: what
    each call raised, or None where it returned."""
    start = threading.Barrier(len(identities))
    outcomes: list[BaseException | None] = [None] * len(identities)

    def write(index: int) -> None:
        start.wait()
        try:
            save_identity(identities[index], path)
        except BaseException as exc:
            outcomes[index] = exc

    writers = [threading.Thread(target=write, args=(i,)) for i in range(len(identities))]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    return outcomes


def test_two_writers_racing_for_one_key_path_one_wins_the_other_is_refused(
    tmp_path: Path,
) -> None:
    # Both writers start together, so both find no key before either has published one:
    # an existence check before the write lets the second silently replace the first's
    # key, and the first then hands out a public key whose secret is gone.
    for trial in range(20):
        path = tmp_path / f"race-{trial}" / "agent.key"
        identities = [SigningIdentity.generate(), SigningIdentity.generate()]
        outcomes = _save_at_once(identities, path)
        winners = [i for i, outcome in enumerate(outcomes) if outcome is None]
        assert len(winners) == 1, f"trial {trial}: {len(winners)} writers saved a key"
        refused = outcomes[1 - winners[0]]
        assert isinstance(refused, KeyFileError)
        assert "refusing to overwrite" in str(refused)
        stored = load_identity(path)
        assert stored.public_bytes == identities[winners[0]].public_bytes
        assert sorted(os.listdir(path.parent)) == ["agent.key"]  # no temp file left


def test_without_hard_links_the_key_is_still_created_exclusively(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_hard_links(src: object, dst: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_hard_links)
    path = tmp_path / "agent.key"
    first = SigningIdentity.generate()
    save_identity(first, path)
    with pytest.raises(KeyFileError, match="refusing to overwrite"):
        save_identity(SigningIdentity.generate(), path)
    assert load_identity(path).public_bytes == first.public_bytes
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert os.listdir(tmp_path) == ["agent.key"]


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
