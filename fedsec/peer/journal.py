"""A peer's own hash-chained record of what it sent, received, refused and combined.

The format, its entry kinds and its checks are :mod:`fedsec.protocol.peer_journal`'s (one
definition, which the auditor's cross-check reads too); this module keeps the chain in
memory and appends each line to the peer's file.  A peer restarted on the same file
continues its chain (:meth:`PeerJournal.resume`) rather than starting a second one in it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from fedsec.crypto.identity import SigningIdentity, canonical_json
from fedsec.protocol.log import GENESIS_PREV, LogEntry, head_body
from fedsec.protocol.peer_journal import JournalBody, encode, verify_journal

__all__ = ["PeerJournal", "verify_journal"]

log = logging.getLogger("fedsec.peer")


class PeerJournal:
    """The chain in memory, each line appended to ``path`` too when one is given.

    Args:
        federation_id: what every head names.
        signer: the peer's key, which signs heads.
        path: a file to append each line to (created if absent), or None.
        clock: the time each entry records.
    """

    def __init__(
        self,
        federation_id: str,
        signer: SigningIdentity,
        path: Path | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.federation_id = federation_id
        self._signer = signer
        self._path = path
        self._clock = clock
        self.entries: list[LogEntry] = []

    def append(self, body: JournalBody) -> LogEntry:
        """Chain ``body`` after the last entry."""
        return self._chain(*encode(body))

    @classmethod
    def resume(
        cls,
        federation_id: str,
        signer: SigningIdentity,
        path: Path,
        clock: Callable[[], float] = time.time,
    ) -> PeerJournal:
        """The journal in ``path`` (empty when the file is absent), checked under the
        peer's own key, to continue.  A last line with no newline is a write the peer's
        end cut short: it is dropped (and logged), never completed.

        Raises:
            IntegrityError: the file's chain, bodies or heads do not hold.
            OSError: it cannot be read.
        """
        journal = cls(federation_id, signer, path, clock)
        if not path.exists():
            return journal
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):  # a write the peer's end cut short
            kept = data[: data.rfind(b"\n") + 1]
            log.warning(
                "event=peer_journal_torn_line path=%s bytes=%d", path, len(data) - len(kept)
            )
            with path.open("r+b") as f:
                f.truncate(len(kept))
            data = kept
        lines = data.splitlines()
        verify_journal(lines, signer.public_bytes, federation_id)
        journal.entries = [_entry(line) for line in lines]
        return journal

    def head(self) -> LogEntry:
        """A ``head`` signing the chain up to the last entry with the peer's key.

        Raises:
            IndexError: the journal is empty.
        """
        body = head_body(self._signer, self.federation_id, self.entries[-1])
        return self._chain("head", msgspec.to_builtins(body))

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [e.body for e in self.entries if e.kind == kind]

    def _chain(self, kind: str, fields: dict[str, Any]) -> LogEntry:
        index = len(self.entries)
        prev = self.entries[-1].hash if self.entries else GENESIS_PREV
        when = self._clock()
        doc = {"index": index, "prev": prev, "time": when, "kind": kind, "body": fields}
        line = canonical_json(doc)
        entry = LogEntry(index, prev, when, kind, fields, line)
        self.entries.append(entry)
        if self._path is not None:
            with self._path.open("ab") as f:
                f.write(line + b"\n")
        return entry


def _entry(line: bytes) -> LogEntry:
    doc = msgspec.json.decode(line)
    return LogEntry(doc["index"], doc["prev"], float(doc["time"]), doc["kind"], doc["body"], line)
