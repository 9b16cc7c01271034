"""The aggregator's side of the audit trail: transparency log entries and the archive.

Entries are written to the ``log`` table of the state database in the same
transaction as the state change they record, so the log and the state can never
disagree; after each commit the new lines are appended to ``audit/log.jsonl``,
the file third parties verify (:mod:`fedsec.protocol.log` documents the format).  The
database is the durable copy: the file is fsynced at a round close (and a clean stop),
not per line, and a file that is behind the database (a crash before its lines reached
the disk) is completed at start-up; one that disagrees with it (a torn tail) is
rewritten from it.

Accepted protocol messages are also copied into the content-addressed archive
(``audit/archive``) before their log entry is written, so every aggregate can be
re-run by anyone holding the archive.  The messages table holds the same bytes,
committed before the member's answer, so the copy is written without an fsync
(:meth:`AuditTrail.keep_message`); each round close makes the objects written since
the last one durable in one pass and records, in its transaction, the log index
before which every object is durable (:data:`SYNCED_BEFORE`).  At start-up the objects
that the entries from there on name are checked and any that a machine crash lost or
left short is rewritten from the database, before anything is served.

With a retention window (``audit.archive_retention_rounds``) the objects of older
rounds are deleted at a round close, but only after an ``archive_pruned`` entry saying
which has been committed and written to the file: a crash in between leaves objects
the log calls deleted, and the next start deletes them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from fedsec.aggregator.storage.interfaces import LogStore, StateStore
from fedsec.aggregator.storage.models import ModelStore
from fedsec.aggregator.storage.roster_file import Roster
from fedsec.archive import Archive, ArchiveIndex
from fedsec.crypto.identity import SigningIdentity
from fedsec.faults import NO_FAULTS, Faults
from fedsec.fsio import atomic_write, fsync_path
from fedsec.protocol import wire
from fedsec.protocol.log import GENESIS_PREV, LogEntry, entry_from_line, head_body, make_entry
from fedsec.protocol.log_entries import (
    AcceptedEntry,
    GenesisEntry,
    HeadEntry,
    LogBody,
    ModelVersionEntry,
    RollbackEntry,
)
from fedsec.protocol.roster import RosterEntry

log = logging.getLogger(__name__)

LOG_FILE = "audit/log.jsonl"
ARCHIVE_DIR = "audit/archive"
#: The named value (state database) holding the log index before which every archive
#: object an ``accepted`` entry names is durable on disk; written at each round close.
#: Absent in a workspace an older release wrote, which fsynced every object: there the
#: last signed head stands for it.
SYNCED_BEFORE = "archive_synced_before"


class AuditTrail:
    """The transparency log's entries, its file and the archive (module docstring).

    Args:
        root: the workspace (``audit/`` is in it).
        state: the state database's log.
        signer, federation_id: who signs the heads, of which federation.
        clock: Unix time for the entries.
        faults: crash points for chaos tests.
        store: the state database ``state`` belongs to: its messages table restores
            archive objects after a crash and its named values keep
            :data:`SYNCED_BEFORE`.  None (tools holding only a log): every object is
            fsynced as it is written and nothing is restored.
    """

    def __init__(
        self,
        root: Path,
        state: LogStore,
        signer: SigningIdentity,
        federation_id: str,
        clock: Callable[[], float] = time.time,
        faults: Faults = NO_FAULTS,
        *,
        store: StateStore | None = None,
    ) -> None:
        self.state = state
        self._store = store
        self._faults = faults
        self.signer = signer
        self.federation_id = federation_id
        self.clock = clock
        self.path = Path(root) / LOG_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.archive = Archive(Path(root) / ARCHIVE_DIR)
        self._file_unsynced = False  # lines appended since the file's last fsync
        self._file_sync_due = False  # a round closed: fsync with its lines
        self._file_count = self._reconcile_file()
        state.on_commit(self.sync_file)
        self._roster_logged: set[tuple[str, str]] = set()
        self._versions_logged: set[int] = set()
        last_head = -1
        for index, line in state.log_lines():
            body = entry_from_line(line).decode()
            if isinstance(body, RosterEntry):
                self._roster_logged.add((body.agent_id, body.status))
            elif isinstance(body, ModelVersionEntry):
                self._versions_logged.add(body.version)
            elif isinstance(body, HeadEntry):
                last_head = index
        # which archive objects the log refers to, kept up to date by _index_log
        self._index = ArchiveIndex()
        self._index_count = 0  # entries indexed
        self._index_tail = b""  # the line of the last one, to spot a rolled-back transaction
        self._pending_deletion: LogEntry | None = None
        state.on_commit(self._delete_pruned)  # after sync_file: the file has the entry first
        self._index_log()
        self._finish_last_pruning()
        self._restore_archive(last_head)

    # -- writing -------------------------------------------------------------------------------

    def append(self, body: LogBody) -> LogEntry:
        """Add an entry carrying ``body`` (inside the caller's transaction, if any); its
        kind is the body's (:mod:`fedsec.protocol.log_entries`)."""
        entry = append_entry(self.state, self.clock(), body)
        if not self.state.in_transaction():
            self.sync_file()
        return entry

    def sign_head(self) -> LogEntry:
        """Sign the chain so far (called at every round close and abort, inside its
        transaction).

        First the archive objects written without an fsync since the last head are made
        durable, then :data:`SYNCED_BEFORE` moves to this head in the same transaction:
        the start-up check begins there.  The file is fsynced with the head's lines,
        after the commit.

        Raises:
            OSError: the archive's objects could not be made durable (nothing recorded).
        """
        tail = self.state.log_tail()
        assert tail is not None
        self.archive.sync()
        if self._store is not None:
            self._store.values.put(SYNCED_BEFORE, str(tail[0] + 1).encode())
        self._file_sync_due = True
        last = entry_from_line(tail[1])
        return self.append(head_body(self.signer, self.federation_id, last))

    def genesis(self, body: GenesisEntry) -> None:
        if self.state.log_tail() is None:
            self.append(body)

    def sync_roster(self, roster: Roster) -> None:
        for entry in roster.entries():
            key = (entry.agent_id, entry.status)
            if key not in self._roster_logged:
                self.append(entry)
                self._roster_logged.add(key)

    def sync_models(self, models: ModelStore, defer_round: int | None = None) -> None:
        """Log every model version not logged yet, except (``defer_round``) the aggregate
        of a round still in progress: written by an incarnation that died before closing
        the round, it is logged after the round's aggregate entry, where verifiers look."""
        for manifest in models.history():
            if manifest.version in self._versions_logged:
                continue
            if manifest.kind == "aggregate" and manifest.round == defer_round:
                continue
            self.append(ModelVersionEntry(**msgspec.structs.asdict(manifest)))
            if manifest.kind == "rollback":
                self.append(
                    RollbackEntry(
                        version=manifest.version, weights_of=manifest.parent, note=manifest.note
                    )
                )
            self._versions_logged.add(manifest.version)

    def keep(self, data: bytes) -> str:
        """Archive ``data``, durably before this returns; return its sha256."""
        return self.archive.put(data)

    def keep_message(self, raw: bytes) -> str:
        """Archive an accepted message's bytes ``raw``, which the messages table holds
        (or will, in the transaction that logs them); return the sha256.  Written
        without an fsync: durable at the next round close (:meth:`sign_head`), and
        rewritten from the database at start-up if a machine crash lost it before.
        Without the database at hand (``store`` None), as :meth:`keep`."""
        return self.archive.put(raw, sync=self._store is None)

    def close(self) -> None:
        """A clean stop: make the archive objects and the file's lines written without an
        fsync durable.  :data:`SYNCED_BEFORE` stays (no database write here): the next
        start checks the objects of the round in progress again."""
        try:
            self.archive.sync()
            if self._file_unsynced:
                fsync_path(self.path)
                self._file_unsynced = False
        except OSError as exc:  # the next start checks and completes both from the database
            log.warning("event=audit_copies_not_synced error=%s", exc)

    # -- retention -----------------------------------------------------------------------------

    def prune_archive(self, retention_rounds: int) -> LogEntry | None:
        """Log the archive objects that fall out of the retention window; delete them once
        the entry is committed.

        Call at a round close, inside its transaction and before :meth:`sign_head`, so the
        round's head signs the entry.  ``retention_rounds`` 0 keeps everything.

        Returns:
            the ``archive_pruned`` entry, or None when nothing is due.
        """
        if retention_rounds < 1:
            return None
        self._index_log()
        pruning = self._index.plan(retention_rounds, self.archive.contains)
        if pruning is None:
            return None
        entry = self.append(pruning)
        self._pending_deletion = entry
        if not self.state.in_transaction():  # committed (and in the file) already
            self._delete_pruned()
        return entry

    def _index_log(self) -> None:
        """Bring the archive index up to the log's tail (this transaction's lines included).

        A rolled-back transaction may have taken lines the index saw: then start over.
        """
        if self._index_count:
            tail = next(iter(self.state.log_lines(self._index_count - 1)), None)
            if tail is None or tail[1] != self._index_tail:
                self._index, self._index_count = ArchiveIndex(), 0
        for index, line in self.state.log_lines(self._index_count):
            self._index.observe(index, entry_from_line(line).decode())
            self._index_tail, self._index_count = line, index + 1

    def _delete_pruned(self) -> None:
        """After a commit: delete what a just-committed ``archive_pruned`` entry lists."""
        entry, self._pending_deletion = self._pending_deletion, None
        if entry is None:
            return
        committed = next(iter(self.state.log_lines(entry.index)), None)
        if committed is None or committed[1] != entry.line:
            return  # the transaction that wrote it was rolled back
        self._index_log()
        # chaos tests: die with the entry committed and in the file, nothing deleted yet
        self._faults.crash(max(self._index.closed, default=0), "archive_prune")
        self._delete_listed(entry.index)

    def _finish_last_pruning(self) -> None:
        """At start-up: finish the deletions of the newest pruning (a crash may have cut
        them short; earlier ones were finished by earlier starts)."""
        if self._index.prunings:
            self._delete_listed(max(self._index.prunings))

    def _delete_listed(self, index: int) -> None:
        pruning = self._index.prunings[index]
        deleted = sum(
            self.archive.delete(digest)
            for digest in pruning.objects
            if self._index.still_deletable(index, digest)
        )
        if deleted:
            log.info(
                "event=archive_pruned log_index=%d rounds=%s before_round=%d deleted=%d",
                index,
                list(pruning.rounds),
                pruning.before_round,
                deleted,
            )

    # -- the exported file ---------------------------------------------------------------------

    def sync_file(self) -> None:
        """Append committed lines the file does not have yet; fsync it when a round
        closed (:meth:`sign_head`) since the last fsync, not per line: the database
        holds every line durably and the file is completed from it at start-up."""
        new = list(self.state.log_lines(self._file_count))
        if not new:
            return
        # one write of whole lines (O_APPEND): a reader of the live file sees each commit's
        # lines land together, though a copy taken meanwhile may end mid-line
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            view = memoryview(b"".join([line + b"\n" for _, line in new]))
            while view:
                view = view[os.write(fd, view) :]
            if self._file_sync_due:
                os.fsync(fd)
        finally:
            os.close(fd)
        self._file_unsynced = not self._file_sync_due
        self._file_sync_due = False
        self._file_count = new[-1][0] + 1

    def _reconcile_file(self) -> int:
        db = [line for _, line in self.state.log_lines()]
        try:
            on_disk = self.path.read_bytes().splitlines()
        except FileNotFoundError:
            on_disk = []
        if on_disk == db[: len(on_disk)]:
            count = len(on_disk)
        else:
            log.warning("event=log_file_rewritten path=%s reason=differs_from_state", self.path)
            atomic_write(self.path, b"".join(line + b"\n" for line in db))
            count = len(db)
        self._file_count = count
        if count < len(db):
            self._file_sync_due = True  # once, at start-up
            self.sync_file()
        return len(db)

    def _restore_archive(self, last_head: int) -> None:
        """At start-up, before serving: the archive objects the ``accepted`` entries from
        :data:`SYNCED_BEFORE` on name are checked, and one a machine crash lost or left
        short is rewritten from the messages table.  Entries before it name durable
        objects, so this reads the objects of the rounds since the last close, not the
        history.  An object whose bytes the database does not hold is logged as lost."""
        if self._store is None:
            return
        value = self._store.values.get(SYNCED_BEFORE)
        start = int(value) if value is not None else last_head + 1
        checked = rewritten = 0
        for index, line in self.state.log_lines(start):
            entry = entry_from_line(line)
            if entry.kind != "accepted":
                continue
            digest, round_ = entry.body["sha256"], entry.body["round"]
            if self._index.deleted_by(digest, round_, index) is not None:
                continue  # pruned since, as the log says
            checked += 1
            if self.archive.intact(digest):
                continue
            attempt, stage, member = (entry.body[k] for k in ("attempt", "stage", "member"))
            raw = self._store.messages.get(round_, attempt, stage, member)
            if raw is None or hashlib.sha256(raw).hexdigest() != digest:
                log.error(
                    "event=archive_object_lost sha256=%s log_index=%d round=%d member=%s",
                    digest,
                    index,
                    round_,
                    member,
                )
                continue
            self.archive.restore(raw)
            rewritten += 1
        log.log(
            logging.WARNING if rewritten else logging.INFO,
            "event=archive_checked from_log_index=%d checked=%d rewritten=%d",
            start,
            checked,
            rewritten,
        )


def append_entry(state: LogStore, now: float, body: LogBody) -> LogEntry:
    """Add the entry carrying ``body`` after the log's tail, inside the caller's
    transaction (if any): the one definition of where the next entry goes, for the
    leader's :class:`AuditTrail` and a group server's writes
    (:mod:`fedsec.aggregator.groups`).  Two writers keep one chain because each reads
    the tail inside its own write transaction (SQLite's ``BEGIN IMMEDIATE``)."""
    tail = state.log_tail()
    index, prev = (0, GENESIS_PREV) if tail is None else (tail[0] + 1, _hash(tail[1]))
    entry = make_entry(index, prev, now, body)
    state.add_log_line(entry.index, entry.line)
    return entry


def _hash(line: bytes) -> str:
    return hashlib.sha256(line).hexdigest()


def store_accepted(
    state: StateStore,
    append: Callable[[LogBody], LogEntry],
    signer: SigningIdentity,
    federation_id: str,
    clock: Callable[[], float],
    accepted: AcceptedEntry,
    raw: bytes,
    receipt_for: str | None,
) -> wire.Receipt | None:
    """Store an accepted message's bytes ``raw`` and log ``accepted`` through ``append``,
    inside the caller's transaction; with ``receipt_for`` (the contribution's sha256),
    sign and store its receipt, which names the entry's log index.  The one definition
    for the leader's intake and a group server's."""
    r, a, member = accepted.round, accepted.attempt, accepted.member
    state.messages.add(r, a, accepted.stage, member, raw)
    entry = append(accepted)
    if receipt_for is None:
        return None
    receipt = wire.Receipt(
        federation_id=federation_id,
        round=r,
        attempt=a,
        member=member,
        contribution_sha256=receipt_for,
        log_index=entry.index,
        issued_at=clock(),
    ).sign(signer)
    state.receipts.add(r, a, member, wire.encode(receipt))
    return receipt
