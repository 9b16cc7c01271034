"""What the archive holds, and what a head-signed retention entry allowed it to delete.

The whole log is read once before any entry is judged (:meth:`ArchiveRecords.read_ahead`)
because a later ``archive_pruned`` entry decides how earlier entries are checked: their
archive objects may be gone.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from fedsec.archive import Archive, ArchiveIndex, check_pruning
from fedsec.audit.log import read_log
from fedsec.audit.verifier import EntryProblem
from fedsec.errors import FedsecError, IntegrityError, NotFound
from fedsec.protocol.log import LogEntry
from fedsec.protocol.log_entries import ArchivePrunedEntry, HeadEntry, LogBody, kind_of


class ArchiveRecords:
    """The archive (None: not given, nothing is re-aggregated) and the prunings."""

    def __init__(self, archive: Archive | None) -> None:
        self.archive = archive
        self.archived = ArchiveIndex()  # the log so far: what refers to which object
        self.ahead = ArchiveIndex()  # the whole log, read first: which objects were pruned
        self.last_head = -1
        # rounds whose archive objects retention deleted: {"round", "log_entry", "detail"}
        self.pruned_rounds: list[dict[str, Any]] = []

    def read_ahead(self, log_path: Path) -> None:
        """First pass: the chain, the last head, and the head-signed prunings.

        Raises:
            IntegrityError: the chain is broken (the first bad line).
        """
        head, pruned = kind_of(HeadEntry), kind_of(ArchivePrunedEntry)
        prunings: list[LogEntry] = []
        for entry in read_log(log_path):
            if entry.kind == head:
                self.last_head = entry.index
            if entry.kind == pruned:
                prunings.append(entry)
            else:
                with contextlib.suppress(FedsecError):  # named in the second pass
                    self.ahead.observe(entry.index, entry.decode())
        for entry in prunings:
            if entry.index < self.last_head:  # an unsigned one explains nothing
                with contextlib.suppress(FedsecError):
                    self.ahead.observe(entry.index, entry.decode())

    def observe(self, index: int, body: LogBody) -> None:
        """Take a checked entry into the index of what refers to which object."""
        self.archived.observe(index, body)

    def pruned(self, round_: int) -> bool:
        """Whether a head-signed retention entry pruned ``round_``."""
        return self.ahead.pruned_by(round_) is not None

    def check(self, index: int, round_: int, what: str, digest: str) -> None:
        """The object exists and hashes to ``digest``, or a signed pruning deleted it.

        Raises:
            EntryProblem: missing, and no signed pruning lists it.
            IntegrityError: it does not hash to ``digest``.
        """
        assert self.archive is not None
        try:
            self.archive.get(digest)
        except NotFound:
            if self.ahead.deleted_by(digest, round_, index) is not None:
                return
            pruned = self.ahead.pruned_by(round_)
            why = (
                f"round {round_} was pruned by log entry {pruned}, which does not list it"
                if pruned is not None
                else "no archive_pruned entry records its deletion"
            )
            raise EntryProblem(
                f"round {round_}: archive object {digest} ({what}) is missing; {why}"
            ) from None

    def get(self, index: int, round_: int, what: str, digest: str) -> bytes:
        """The archived object ``digest`` of a round that is not pruned.

        Raises:
            EntryProblem: missing (and why), or not hashing to ``digest``.
        """
        assert self.archive is not None
        try:
            return self.archive.get(digest)
        except NotFound:
            pass
        except IntegrityError as exc:
            raise EntryProblem(f"round {round_}: {what}: {exc.detail}") from None
        self.check(index, round_, what, digest)  # says why it is missing
        raise EntryProblem(f"round {round_}: archive object {digest} ({what}) is missing")

    def on_pruned(self, index: int, pruning: ArchivePrunedEntry) -> None:
        """A retention entry: signed by a later head, and keeping to the retention rules.

        Raises:
            EntryProblem, FedsecError: unsigned, or deleting what must be kept.
        """
        check_pruning(pruning)
        if index > self.last_head:
            raise EntryProblem(
                "no head signs it (the aggregator writes it at a round close, before that "
                "close's head)"
            )
        problem = self.archived.problem_with(pruning)
        if problem is not None:
            raise EntryProblem(problem)
        for round_ in pruning.rounds:
            self.pruned_rounds.append(
                {
                    "round": round_,
                    "log_entry": index,
                    "detail": f"pruned by retention (log entry {index})",
                }
            )
