"""The aggregator's side of the audit trail: transparency log entries and the archive.

Entries are written to the ``log`` table of the state database in the same
transaction as the state change they record, so the log and the state can never
disagree; after each commit the new lines are appended to ``audit/log.jsonl``,
the file third parties verify (:mod:`fedsec.protocol.log` documents the format).  A
file that is behind the database (a crash between commit and append) is
completed at start-up; one that disagrees with it is rewritten from it.

Accepted protocol messages are also copied into the content-addressed archive
(``audit/archive``) before their log entry is written, so every aggregate can be
re-run by anyone holding the archive.  With a retention window
(``audit.archive_retention_rounds``) the objects of older rounds are deleted at a
round close, but only after an ``archive_pruned`` entry saying which has been
committed and written to the file: a crash in between leaves objects the log calls
deleted, and the next start deletes them.
"""

from __future__ import annotations

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
from fedsec.fsio import atomic_write
from fedsec.protocol import wire
from fedsec.protocol.log import GENESIS_PREV, LogEntry, entry_from_line, head_body, make_entry
from fedsec.protocol.log_entries import (
    AcceptedEntry,
    GenesisEntry,
    LogBody,
    ModelVersionEntry,
    RollbackEntry,
)
from fedsec.protocol.roster import RosterEntry

log = logging.getLogger(__name__)

LOG_FILE = "audit/log.jsonl"
ARCHIVE_DIR = "audit/archive"


class AuditTrail:
    def __init__(
        self,
        root: Path,
        state: LogStore,
        signer: SigningIdentity,
        federation_id: str,
        clock: Callable[[], float] = time.time,
        faults: Faults = NO_FAULTS,
    ) -> None:
        self.state = state
        self._faults = faults
        self.signer = signer
        self.federation_id = federation_id
        self.clock = clock
        self.path = Path(root) / LOG_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.archive = Archive(Path(root) / ARCHIVE_DIR)
        self._file_count = self._reconcile_file()
        state.on_commit(self.sync_file)
        self._roster_logged: set[tuple[str, str]] = set()
        self._versions_logged: set[int] = set()
        for _, line in state.log_lines():
            body = entry_from_line(line).decode()
            if isinstance(body, RosterEntry):
                self._roster_logged.add((body.agent_id, body.status))
            elif isinstance(body, ModelVersionEntry):
                self._versions_logged.add(body.version)
        # which archive objects the log refers to, kept up to date by _index_log
        self._index = ArchiveIndex()
        self._index_count = 0  # entries indexed
        self._index_tail = b""  # the line of the last one, to spot a rolled-back transaction
        self._pending_deletion: LogEntry | None = None
        state.on_commit(self._delete_pruned)  # after sync_file: the file has the entry first
        self._index_log()
        self._finish_last_pruning()

    # -- writing -------------------------------------------------------------------------------

    def append(self, body: LogBody) -> LogEntry:
        """Add an entry carrying ``body`` (inside the caller's transaction, if any); its
        kind is the body's (:mod:`fedsec.protocol.log_entries`)."""
        entry = append_entry(self.state, self.clock(), body)
        if not self.state.in_transaction():
            self.sync_file()
        return entry

    def sign_head(self) -> LogEntry:
        """Sign the chain so far (called at every round close)."""
        tail = self.state.log_tail()
        assert tail is not None
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
        """Archive ``data``; return its sha256."""
        return self.archive.put(data)

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
        """Append committed lines the file does not have yet (fsync)."""
        new = list(self.state.log_lines(self._file_count))
        if not new:
            return
        with self.path.open("ab") as fh:
            for _, line in new:
                fh.write(line + b"\n")
            fh.flush()
            os.fsync(fh.fileno())
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
            self.sync_file()
        return len(db)


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
    import hashlib

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
