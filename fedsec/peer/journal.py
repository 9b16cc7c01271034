"""A peer's own hash-chained record of what it sent, received and refused.

Each peer keeps one, so that a later cross-check can match a message one side logged as
sent with the other side's record of receiving it (same round, same SHA-256).  The lines
are the transparency log's (:mod:`fedsec.protocol.log`): canonical JSON of ``index``,
``prev``, ``time``, ``kind`` and ``body``, each entry's hash the SHA-256 of its line, and a
``head`` entry signing the chain up to the entry before it with the peer's own key.  The
kinds are the peer's own (the aggregator's log registry is closed: its verifier treats
every kind it holds), so a peer journal is read with :func:`verify_journal`, not by the
aggregator-log reader.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import msgspec

from fedsec.crypto.identity import SigningIdentity, canonical_json
from fedsec.errors import IntegrityError
from fedsec.protocol.log import GENESIS_PREV, MAX_LINE_BYTES, LogEntry, head_body, verify_head
from fedsec.protocol.log_entries import HeadEntry

KINDS: Final[tuple[str, ...]] = (
    "peer_sent",
    "peer_received",
    "peer_refused",
    "peer_combined",
    "peer_caught_up",
)


class PeerSent(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    round: int
    to: str  # the neighbour's key id
    sha256: str  # of the message bytes
    exchange: int = 0


class PeerReceived(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    round: int
    sender: str
    sha256: str
    samples: int
    exchange: int = 0


class PeerRefused(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A neighbour's model kept out of the peer's average (filtered, or too stale)."""

    round: int
    sender: str
    sha256: str
    reason: str


class PeerCombined(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The peer's model after an exchange of a round: its own update and the neighbours'
    it averaged (exchange 0), or the neighbours' models it mixed in (later exchanges)."""

    round: int
    accepted: list[str]
    refused: list[str]
    missing: list[str]
    model_sha256: str
    exchange: int = 0


class PeerCaughtUp(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The peer rejoined at ``round`` after missing rounds, from its neighbours' offers."""

    round: int
    sources: list[str]  # the neighbours whose offers made the model, sorted
    sha256: list[str]  # of each one's offer, in the same order
    model_sha256: str


JournalBody = PeerSent | PeerReceived | PeerRefused | PeerCombined | PeerCaughtUp
_KIND_OF: Final = {
    PeerSent: "peer_sent",
    PeerReceived: "peer_received",
    PeerRefused: "peer_refused",
    PeerCombined: "peer_combined",
    PeerCaughtUp: "peer_caught_up",
}


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
        return self._chain(_KIND_OF[type(body)], msgspec.to_builtins(body))

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


def verify_journal(lines: Sequence[bytes], peer_public: bytes, federation_id: str) -> int:
    """Check a journal's chain and every head in it against the peer's key.

    Returns:
        The index of the last entry a head signs (-1 when no head does).

    Raises:
        IntegrityError: a line that is not canonical, a broken link, an unknown kind, or
            a head that does not verify.
    """
    prev, signed = GENESIS_PREV, -1
    entries: list[LogEntry] = []
    for i, line in enumerate(lines):
        if len(line) > MAX_LINE_BYTES:
            raise IntegrityError(f"journal line {i}: longer than {MAX_LINE_BYTES} bytes")
        doc = msgspec.json.decode(line)
        if not isinstance(doc, dict) or canonical_json(doc) != line:
            raise IntegrityError(f"journal line {i}: not in canonical form (altered)")
        if doc.get("index") != i or doc.get("prev") != prev:
            raise IntegrityError(f"journal line {i}: the chain breaks here")
        if doc.get("kind") not in (*KINDS, "head"):
            raise IntegrityError(f"journal line {i}: unknown kind {doc.get('kind')!r}")
        entry = LogEntry(i, prev, float(doc["time"]), doc["kind"], doc["body"], line)
        if entry.kind == "head":
            head = msgspec.convert(entry.body, HeadEntry)
            if i == 0 or head.federation_id != federation_id:
                raise IntegrityError(f"journal line {i}: a head of another federation")
            verify_head(head, peer_public, entries[-1])
            signed = i - 1
        entries.append(entry)
        prev = hashlib.sha256(line).hexdigest()
    return signed
