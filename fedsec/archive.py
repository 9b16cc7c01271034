"""Content-addressed archive of accepted protocol messages (masked inputs, reveals, ...).

A file's name is the SHA-256 of its bytes, so anyone holding the archive and the
transparency log can re-run every aggregation and detect a swapped file.  Masked
inputs reveal nothing on their own; unmask reveals only what the aggregator was
entitled to learn; in trusted mode (``round.secure_sum = "none"``) the objects are
members' updates in plaintext, so every object is 0600 in 0700 directories.  Writes are
atomic (temp file, rename), so no reader sees an object torn while the machine runs.
An object the state database also holds (an accepted message's bytes) is written
without an fsync (``put(..., sync=False)``) and made durable with the others of its
round in one batch (:meth:`Archive.sync`); after a machine crash its owner rewrites it
from the database (:mod:`fedsec.aggregator.storage.audit_trail`).  Every other object
is fsynced, with its directory, before :meth:`Archive.put` returns.  A reader checks
each object against its name, so a short or damaged file is never taken for the
message.

Retention (``audit.archive_retention_rounds``) may delete the objects of old rounds.
A deletion is never silent: it is announced first by an ``archive_pruned`` log entry
(:class:`~fedsec.protocol.log_entries.ArchivePrunedEntry`) naming the rounds and the
objects, signed by the round close's head.  :class:`ArchiveIndex` reads the log to say
which objects a pruning may delete (the aggregator) and whether a logged one kept to the
rules (verifiers).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from fedsec.errors import IntegrityError, NotFound
from fedsec.fsio import atomic_write, fsync_dir, sync_filesystem
from fedsec.protocol.log_entries import (
    AcceptedEntry,
    AggregateEntry,
    ArchivePrunedEntry,
    LogBody,
    RevealEntry,
    RoundOpenEntry,
)

# Objects are readable by the aggregator's user only: with round.secure_sum = "none"
# they are members' updates in plaintext, which nobody else on the machine may read
# (auditors get them through GET /v1/audit/archive, which checks who asks).
OBJECT_MODE = 0o600
DIR_MODE = 0o700

# Log entry bodies that name an archive object (``sha256``) of a round (``round``).
REFERRING_ENTRIES = (AcceptedEntry, RevealEntry)


def _is_digest(value: object) -> bool:
    return (
        isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
    )


class Archive:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._root = os.fspath(self.root)
        # the fan-out directories known to exist, so that a put (one per accepted message)
        # does not ask the filesystem again
        self._directories: set[str] = set()
        # objects written without an fsync since the last sync(): what it makes durable
        self._unsynced: set[str] = set()
        # a fan-out directory was made since the root's last fsync: its name is durable
        # only once the root is fsynced (before a durable put in it, or at sync())
        self._root_unsynced = False

    def path(self, digest: str) -> Path:
        if not _is_digest(digest):
            raise IntegrityError(f"archive reference {digest!r} is not a sha256 hex digest")
        return self.root / digest[:2] / digest

    def put(self, data: bytes, *, sync: bool = True) -> str:
        """Store ``data``; return its sha256 hex.  Idempotent.

        Args:
            sync: durable before this returns (fsync of the object and its directory);
                False for bytes another durable store holds, from which they are
                rewritten after a crash: durable at the next :meth:`sync`.

        Raises:
            OSError: the object could not be written (or made durable); nothing is
                left under its name that was not there.
        """
        digest = hashlib.sha256(data).hexdigest()
        directory = os.path.join(self._root, digest[:2])
        target = os.path.join(directory, digest)
        if os.path.exists(target):
            if sync and digest in self._unsynced:
                self._fsync_objects([digest])
                self._unsynced.discard(digest)
            return digest
        self._write(directory, target, data, sync)
        if not sync:
            self._unsynced.add(digest)
        return digest

    def restore(self, data: bytes) -> str:
        """Write ``data`` under its digest over whatever file is there (a short or damaged
        one a crash left), without an fsync: durable at the next :meth:`sync`.

        Raises:
            OSError: the object could not be written; the old file is untouched.
        """
        digest = hashlib.sha256(data).hexdigest()
        directory = os.path.join(self._root, digest[:2])
        self._write(directory, os.path.join(directory, digest), data, sync=False)
        self._unsynced.add(digest)
        return digest

    def intact(self, digest: str) -> bool:
        """Whether the object ``digest`` is there and holds the bytes its name says; if
        so, it is made durable at the next :meth:`sync` (it may have been written
        without an fsync by a process that died since)."""
        try:
            self.get(digest)
        except (NotFound, IntegrityError):
            return False
        self._unsynced.add(digest)
        return True

    def sync(self) -> int:
        """Make every object written without an fsync since the last call durable, in
        one pass; return how many there were.

        One ``syncfs`` of the archive's filesystem where the platform has it (an fsync
        per object is a journal commit each: 0.15-7 s for 2,000 objects here, against
        0.01-0.05 s); else an fsync of each object and of each directory holding one.

        Raises:
            OSError: the kernel reported a write error; the objects stay to sync.
        """
        if not self._unsynced:
            return 0
        if sync_filesystem(self._root):
            self._root_unsynced = False
        else:
            self._fsync_objects(sorted(self._unsynced))
        count = len(self._unsynced)
        self._unsynced.clear()
        return count

    def make_durable(self, digests: Iterable[str]) -> int:
        """Make those of the objects ``digests`` written without an fsync since the last
        :meth:`sync` durable now, each with its directory: what :meth:`put` with
        ``sync=True`` does, for a batch of objects put with ``sync=False`` (an fsync per
        object and per directory, not :meth:`sync`'s ``syncfs``, which writes out
        whatever else the filesystem holds dirty); how many there were.

        Raises:
            OSError: the kernel reported a write error; the objects stay to sync.
        """
        due = sorted({digest for digest in digests if digest in self._unsynced})
        if due:
            self._fsync_objects(due)
            self._unsynced.difference_update(due)
        return len(due)

    def _write(self, directory: str, target: str, data: bytes, sync: bool) -> None:
        if directory not in self._directories:
            self._make_directory(directory)
        try:
            atomic_write(target, data, mode=OBJECT_MODE, sync=sync)
        except FileNotFoundError:  # the directory went away since: make it again
            self._directories.discard(directory)
            self._make_directory(directory)
            atomic_write(target, data, mode=OBJECT_MODE, sync=sync)
        if sync and self._root_unsynced:
            fsync_dir(self._root)
            self._root_unsynced = False

    def _fsync_objects(self, digests: list[str]) -> None:
        directories: set[str] = set()
        for digest in digests:
            directory = os.path.join(self._root, digest[:2])
            try:
                fd = os.open(os.path.join(directory, digest), os.O_RDONLY)
            except FileNotFoundError:  # deleted since (pruned): nothing to make durable
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            directories.add(directory)
        for directory in sorted(directories):
            fsync_dir(directory)
        if self._root_unsynced:
            fsync_dir(self._root)
            self._root_unsynced = False

    def _make_directory(self, directory: str) -> None:
        """Create a fan-out directory (and the root) if missing; the new name is made
        durable with the first object in it that is (:attr:`_root_unsynced`)."""
        if not os.path.isdir(directory):
            os.makedirs(directory, mode=DIR_MODE, exist_ok=True)
            self._root_unsynced = True
        self._directories.add(directory)

    def get(self, digest: str) -> bytes:
        """The archived bytes for ``digest``, checked against it.

        Raises:
            NotFound: not in the archive (e.g. past retention).
            IntegrityError: the file's content does not match its name (swapped).
        """
        target = self.path(digest)
        try:
            data = target.read_bytes()
        except FileNotFoundError:
            raise NotFound(f"archive has no object {digest}") from None
        actual = hashlib.sha256(data).hexdigest()
        if not hmac.compare_digest(actual, digest):
            raise IntegrityError(f"archive object {digest} holds content with sha256 {actual}")
        return data

    def contains(self, digest: str) -> bool:
        return self.path(digest).exists()

    def delete(self, digest: str) -> bool:
        """Remove the object ``digest``; return whether it was there.  Only for objects an
        ``archive_pruned`` entry already lists (the log says why they are gone)."""
        try:
            self.path(digest).unlink()
        except FileNotFoundError:
            return False
        return True


def check_pruning(pruning: ArchivePrunedEntry) -> None:
    """Refuse an ``archive_pruned`` body whose values break the format (docs/audit-log.md,
    §3); whether it keeps to the retention rules is :meth:`ArchiveIndex.problem_with`.

    Raises:
        IntegrityError: a value is out of range or out of order.
    """
    retention, before = pruning.retention_rounds, pruning.before_round
    rounds, objects = pruning.rounds, pruning.objects
    if not (retention >= 1 and before >= 1):
        raise IntegrityError("retention_rounds and before_round must be integers >= 1")
    if not all(r < before for r in rounds):
        raise IntegrityError(f"rounds must be a list of round numbers below {before}")
    if rounds != sorted(set(rounds)):
        raise IntegrityError("rounds must be sorted, without repeats")
    if not (objects and all(_is_digest(d) for d in objects)):
        raise IntegrityError("objects must be a non-empty list of sha256 hex digests")
    if objects != sorted(set(objects)):
        raise IntegrityError("objects must be sorted, without repeats")


class ArchiveIndex:
    """Which archive objects the log refers to, from which rounds, and what was pruned.

    Feed it the log's entries in order (:meth:`observe`).  The aggregator asks it what
    to prune (:meth:`plan`); a verifier asks whether a logged pruning kept to the rules
    (:meth:`problem_with`, before observing that entry) and, reading ahead, whether a
    missing object's absence is explained (:meth:`deleted_by`, :meth:`pruned_by`).
    """

    def __init__(self) -> None:
        self.rounds: set[int] = set()  # rounds opened or closed
        self.closed: set[int] = set()  # rounds with an aggregate entry
        self.refs: dict[str, list[tuple[int, int]]] = {}  # digest -> [(log index, round)]
        self.prunings: dict[int, ArchivePrunedEntry] = {}  # log index -> what that entry pruned
        self.listed: dict[str, list[int]] = {}  # digest -> archive_pruned entries listing it
        # digests referred to since the last entry that listed them: the only candidates
        # of the next pruning, so planning costs the retention window, not the history
        self._unlisted: set[str] = set()

    def observe(self, index: int, body: LogBody) -> None:
        """Take note of log entry ``index``, whose body is ``body``.

        Raises:
            IntegrityError: an ``archive_pruned`` body with values out of range or order.
        """
        if isinstance(body, RoundOpenEntry | AggregateEntry):
            self.rounds.add(body.round)
            if isinstance(body, AggregateEntry):
                self.closed.add(body.round)
        elif isinstance(body, REFERRING_ENTRIES):
            self.refs.setdefault(body.sha256, []).append((index, body.round))
            self._unlisted.add(body.sha256)
        elif isinstance(body, ArchivePrunedEntry):
            check_pruning(body)
            self.prunings[index] = body
            for digest in body.objects:
                self.listed.setdefault(digest, []).append(index)
                self._unlisted.discard(digest)

    @property
    def pruned_before(self) -> int:
        """Every round below this one has been pruned (0: none)."""
        return max((p.before_round for p in self.prunings.values()), default=0)

    def window_start(self, retention_rounds: int) -> int | None:
        """The oldest round ``retention_rounds`` keeps (the N-th newest closed round), or
        None while fewer rounds have closed."""
        if retention_rounds < 1 or len(self.closed) < retention_rounds:
            return None
        return sorted(self.closed)[-retention_rounds]

    def plan(
        self, retention_rounds: int, present: Callable[[str], bool]
    ) -> ArchivePrunedEntry | None:
        """The pruning due under ``retention_rounds``, or None when nothing is to be deleted.

        An object is deleted when every entry referring to it belongs to a round before
        the window (an object shared by content with a kept round stays), some reference
        came after the last pruning that listed it, and it is ``present`` on disk.
        """
        start = self.window_start(retention_rounds)
        if start is None:
            return None
        objects = sorted(
            digest
            for digest in self._unlisted
            if all(r < start for _, r in self.refs[digest]) and present(digest)
        )
        if not objects:
            return None
        already = self.pruned_before
        rounds = sorted(r for r in self.rounds if already <= r < start)
        return ArchivePrunedEntry(
            retention_rounds=retention_rounds, before_round=start, rounds=rounds, objects=objects
        )

    def problem_with(self, pruning: ArchivePrunedEntry) -> str | None:
        """Why ``pruning``, as the next log entry, breaks the retention rules (or None)."""
        n = pruning.retention_rounds
        start = self.window_start(n)
        if start is None or pruning.before_round > start:
            newest = sorted(self.closed)[-n:]
            return (
                f"it prunes rounds before {pruning.before_round}, but the newest {n} closed "
                f"round(s) {newest} must all be kept"
            )
        already = self.pruned_before
        due = sorted(r for r in self.rounds if already <= r < pruning.before_round)
        if list(pruning.rounds) != due:
            return (
                f"it lists rounds {list(pruning.rounds)}, but the rounds it prunes (before "
                f"{pruning.before_round}, not pruned earlier) are {due}"
            )
        for digest in pruning.objects:
            refs = self.refs.get(digest)
            if not refs:
                return f"it deletes archive object {digest}, which no earlier entry refers to"
            kept = sorted({r for _, r in refs if r >= pruning.before_round})
            if kept:
                return (
                    f"it deletes archive object {digest}, which round {kept[0]} refers to and "
                    "retention keeps"
                )
        return None

    def pruned_by(self, round_: int) -> int | None:
        """Log index of the first ``archive_pruned`` entry that pruned ``round_``, if any."""
        return next((i for i, p in sorted(self.prunings.items()) if round_ < p.before_round), None)

    def deleted_by(self, digest: str, round_: int, index: int) -> int | None:
        """Log index of an ``archive_pruned`` entry, after entry ``index`` (which refers to
        ``digest`` for ``round_``), that lists ``digest`` and prunes ``round_``, if any."""
        for j in self.listed.get(digest, ()):
            if j > index and round_ < self.prunings[j].before_round:
                return j
        return None

    def still_deletable(self, index: int, digest: str) -> bool:
        """Whether ``digest``, listed by the pruning at ``index``, may still be deleted:
        no kept round and no later entry refers to it (it was not archived again)."""
        before = self.prunings[index].before_round
        return all(i < index and r < before for i, r in self.refs.get(digest, ()))
