"""The archive's object writes (:mod:`fedsec.archive`, :func:`fedsec.fsio.atomic_write`):
what each accepted message relies on before its answer goes out."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from pathlib import Path

import pytest

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
