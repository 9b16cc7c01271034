"""Durable, atomic file writes shared by every part of fedsec.

A write goes to a hidden temp file beside the target, is fsynced, renamed over the
target and the directory is fsynced, so a crash at any point leaves either the old
file or the new one, never a torn one.  Leftover temp files carry :data:`TMP_MARK`
in their name so stores can clean them up at start-up.

A copy that another durable store can rebuild (an archive object whose bytes the state
database holds) may be written with ``sync=False``: still renamed into place whole, so
no reader sees it torn while the machine runs, but a machine crash may lose it or leave
it short until the writer makes it durable (:func:`sync_filesystem`, one call for a
batch) or rebuilds it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TypeVar

T = TypeVar("T")

TMP_MARK = ".tmp-"


def fsync_path(path: Path | str) -> None:
    """Make what was written to the file ``path`` durable; for a directory, the names
    made, renamed or removed in it.

    Raises:
        OSError: ``path`` cannot be opened, or the fsync failed.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: Path | str) -> None:
    """Make a rename in ``directory`` durable (:func:`fsync_path` of the directory).

    Raises:
        OSError: as :func:`fsync_path`.
    """
    fsync_path(directory)


def sync_filesystem(path: Path | str) -> bool:
    """Make every write to the filesystem holding ``path`` durable: Linux's ``syncfs``,
    one call however many files are dirty (an fsync per file is one journal commit
    each).  Returns False where the platform has no ``syncfs``: the caller fsyncs its
    files one by one.

    Raises:
        OSError: the kernel reported a write error (Linux >= 5.8 reports them).
    """
    if _SYNCFS is None:
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        if _SYNCFS(fd) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"syncfs: {os.strerror(errno)}", os.fspath(path))
    finally:
        os.close(fd)
    return True


def _load_syncfs() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).syncfs
    except (AttributeError, OSError):  # not glibc/Linux
        return None


_SYNCFS = _load_syncfs()


def atomic_write(
    path: Path | str,
    body: bytes,
    *,
    mode: int = 0o644,
    parents_mode: int | None = None,
    sync: bool = True,
) -> None:
    """Write ``body`` to ``path`` durably with permission ``mode``, replacing any file.

    Args:
        parents_mode: create missing parent directories with this mode (None: they must
            exist).
        sync: fsync the file and its directory; False for a copy another store can
            rebuild (module docstring): renamed into place whole all the same.

    On any failure the temp file is removed and the old file is untouched.
    """
    # os-level calls rather than pathlib and a buffered file: the archive writes every
    # accepted message through here, on the aggregator's event loop
    target = os.fspath(path)
    directory = os.path.dirname(target) or "."
    if parents_mode is not None:
        os.makedirs(directory, mode=parents_mode, exist_ok=True)
    tmp = os.path.join(
        directory, f".{os.path.basename(target)}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
    )
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        try:
            view = memoryview(body).cast("B")
            while view:
                view = view[os.write(fd, view) :]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if sync:
        fsync_dir(directory)


def atomic_write_with(
    path: Path,
    write: Callable[[BinaryIO], T],
    *,
    mode: int = 0o644,
    parents_mode: int | None = None,
) -> T:
    """As :func:`atomic_write`, the body written by ``write`` into the open temp file, so
    a large body (a model file) is written in pieces and never held whole.

    Returns:
        What ``write`` returned.

    Raises:
        Whatever ``write`` raises; the temp file is removed and the old file untouched.
    """
    path = Path(path)
    if parents_mode is not None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=parents_mode)
    tmp = path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            result = write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return result


def atomic_create(
    path: Path, body: bytes, *, mode: int = 0o644, parents_mode: int | None = None
) -> None:
    """Write ``body`` to ``path`` durably with permission ``mode``, only if no file is there.

    The temp file is published with a hard link, which the kernel refuses atomically
    when the name exists (a check before :func:`atomic_write` leaves a window in which
    a concurrent writer's file is replaced); where the filesystem has no hard links, the
    file is created in place with ``O_EXCL``: still exclusive, though a crash mid-write
    can leave it short.

    Raises:
        FileExistsError: ``path`` exists, or another writer created it first.
    """
    path = Path(path)
    if parents_mode is not None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=parents_mode)
    tmp = path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        _write_synced(fd, body)
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise
        except OSError:  # EPERM, ENOTSUP, EMLINK...: no hard link here
            _write_synced(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), body)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def _write_synced(fd: int, body: bytes) -> None:
    with os.fdopen(fd, "wb") as fh:
        fh.write(body)
        fh.flush()
        os.fsync(fh.fileno())
