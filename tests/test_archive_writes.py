"""The archive's object writes (:mod:`fedsec.archive`, :func:`fedsec.fsio.atomic_write`):
what each accepted message relies on before its answer goes out."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from pathlib import Path

import pytest

from fedsec import archive as archive_module
from fedsec.archive import DIR_MODE, OBJECT_MODE, Archive
from fedsec.errors import IntegrityError
from fedsec.fsio import TMP_MARK, atomic_write


def test_an_object_is_stored_under_its_digest_private_to_the_aggregator(tmp_path: Path) -> None:
    archive = Archive(tmp_path / "archive")
    digest = archive.put(b"masked input")
    assert digest == hashlib.sha256(b"masked input").hexdigest()
    assert archive.get(digest) == b"masked input"
    assert stat.S_IMODE(archive.path(digest).stat().st_mode) == OBJECT_MODE
    assert stat.S_IMODE(archive.path(digest).parent.stat().st_mode) == DIR_MODE
    assert archive.put(b"masked input") == digest  # idempotent
    assert not [p for p in archive.path(digest).parent.iterdir() if TMP_MARK in p.name]


def test_a_fan_out_directory_removed_behind_the_archive_is_made_again(tmp_path: Path) -> None:
    archive = Archive(tmp_path)
    first = archive.put(b"a")
    shutil.rmtree(archive.path(first).parent)
    # the same directory again: the archive believed it existed
    assert archive.put(b"a") == first
    assert archive.get(first) == b"a"


def test_a_swapped_object_is_detected(tmp_path: Path) -> None:
    archive = Archive(tmp_path)
    one, two = archive.put(b"one"), archive.put(b"two")
    os.replace(archive.path(two), archive.path(one))
    with pytest.raises(IntegrityError, match="holds content"):
        archive.get(one)


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "model.bin"
    atomic_write(target, b"old")

    class Unwritable:  # memoryview() refuses it: the write fails after the temp file opened
        pass

    with pytest.raises(TypeError):
        atomic_write(target, Unwritable(), mode=0o600)  # type: ignore[arg-type]
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["model.bin"]
    atomic_write(str(target), bytearray(b"new" * 100_000))
    assert target.read_bytes() == b"new" * 100_000


@pytest.fixture
def syncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every fsync (by what it synced: a file's name, or a directory) and syncfs."""
    calls: list[str] = []
    fsync = os.fsync

    def counted(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        calls.append("dir" if os.path.isdir(path) else os.path.basename(path))
        fsync(fd)

    def syncfs(path: Path | str) -> bool:
        calls.append("syncfs")
        return True

    monkeypatch.setattr(os, "fsync", counted)
    monkeypatch.setattr(archive_module, "sync_filesystem", syncfs)
    return calls


def test_an_unsynced_put_is_whole_under_its_name_and_synced_in_one_batch(
    tmp_path: Path, syncs: list[str]
) -> None:
    archive = Archive(tmp_path / "archive")
    digests = [archive.put(bytes([i]) * 20_000, sync=False) for i in range(3)]
    assert syncs == []
    for i, digest in enumerate(digests):
        assert archive.get(digest) == bytes([i]) * 20_000
        assert stat.S_IMODE(archive.path(digest).stat().st_mode) == OBJECT_MODE
        assert not [p for p in archive.path(digest).parent.iterdir() if TMP_MARK in p.name]
    assert archive.sync() == 3
    assert syncs == ["syncfs"]
    assert archive.sync() == 0  # nothing new since
    assert syncs == ["syncfs"]


def test_without_syncfs_each_object_and_directory_is_fsynced(
    tmp_path: Path, syncs: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(archive_module, "sync_filesystem", lambda path: False)
    archive = Archive(tmp_path / "archive")
    digests = [archive.put(bytes([i]), sync=False) for i in range(2)]
    assert archive.sync() == 2
    # each object, its (new) fan-out directory, then the root that names the directories
    assert sorted(syncs) == sorted([*digests, "dir", "dir", "dir"])
    assert syncs[-1] == "dir"


def test_a_durable_put_of_an_unsynced_object_syncs_it_and_its_new_directory(
    tmp_path: Path, syncs: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(archive_module, "sync_filesystem", lambda path: False)
    archive = Archive(tmp_path / "archive")
    digest = archive.put(b"reveal", sync=False)
    assert archive.put(b"reveal") == digest
    assert syncs == [digest, "dir", "dir"]  # the object, its directory, the root
    assert archive.sync() == 0
    syncs.clear()
    other = archive.put(b"context")  # a new directory: named durably in the root too
    assert len(syncs) == 3 and syncs[1:] == ["dir", "dir"]  # (the temp file's name first)
    assert archive.get(other) == b"context"


def test_a_short_object_is_not_intact_and_is_restored_whole(tmp_path: Path) -> None:
    archive = Archive(tmp_path / "archive")
    data = b"masked input" * 1000
    digest = archive.put(data, sync=False)
    archive.path(digest).write_bytes(data[:100])  # what a crash can leave of it
    assert not archive.intact(digest)
    with pytest.raises(IntegrityError, match="holds content"):
        archive.get(digest)
    assert archive.put(data, sync=False) == digest  # a put does not look inside
    assert archive.restore(data) == digest
    assert archive.intact(digest) and archive.get(digest) == data
    archive.path(digest).unlink()
    assert not archive.intact(digest)
