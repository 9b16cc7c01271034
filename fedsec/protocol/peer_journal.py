"""The format of a gossip peer's journal, and how one is checked: shared by the peer that
writes it (:mod:`fedsec.peer.journal`) and the auditor that cross-checks several
(:mod:`fedsec.audit.peer_journals`), which never import each other.

Each peer keeps one, so that a later cross-check can match a message one side logged as
sent with the other side's record of receiving it (same round, exchange and SHA-256),
and a catch-up with the offer its source logged making (requester, SHA-256, nonce).
The lines are the transparency log's (:mod:`fedsec.protocol.log`): canonical JSON of
``index``, ``prev``, ``time``, ``kind`` and ``body``, each entry's hash the SHA-256 of its
line, and a ``head`` entry signing the chain up to the entry before it with the peer's
own key.  The kinds are the peer's own (the aggregator's log registry is closed: its
verifier treats every kind it holds), so a peer journal is read here, not by the
aggregator-log reader.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import msgspec

from fedsec.crypto.identity import canonical_json
from fedsec.errors import IntegrityError
from fedsec.protocol.log import GENESIS_PREV, MAX_LINE_BYTES, LogEntry, verify_head
from fedsec.protocol.log_entries import HeadEntry


class _Body(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class PeerSent(_Body, frozen=True):
    round: int
    to: str  # the neighbour's key id
    sha256: str  # of the message bytes
    exchange: int = 0


class PeerReceived(_Body, frozen=True):
    round: int
    sender: str
    sha256: str
    samples: int
    exchange: int = 0


class PeerRefused(_Body, frozen=True):
    """A neighbour's model kept out of the peer's average (filtered, or too stale)."""

    round: int
    sender: str
    sha256: str
    reason: str


class PeerCombined(_Body, frozen=True):
    """The peer's model after an exchange of a round: its own update and the neighbours'
    it averaged (exchange 0), or the neighbours' models it mixed in (later exchanges)."""

    round: int
    accepted: list[str]
    refused: list[str]
    missing: list[str]
    model_sha256: str
    exchange: int = 0


class PeerCaughtUp(_Body, frozen=True):
    """The peer rejoined at ``round`` after missing rounds, from its neighbours' offers."""

    round: int
    sources: list[str]  # the neighbours whose offers made the model, sorted
    sha256: list[str]  # of each one's offered message, in the same order
    model_sha256: str
    nonce: str = ""  # of the request the offers answered ("": made with no request)


class PeerOfferSent(_Body, frozen=True):
    """The peer offered its newest trained message to a returning neighbour, answering
    that neighbour's request ``nonce``; the requester's ``peer_caught_up`` must name it."""

    round: int
    to: str  # the requester's key id
    sha256: str  # of the offered message
    nonce: str


JournalBody = PeerSent | PeerReceived | PeerRefused | PeerCombined | PeerCaughtUp | PeerOfferSent
KIND_OF: Final[dict[type[JournalBody], str]] = {
    PeerSent: "peer_sent",
    PeerReceived: "peer_received",
    PeerRefused: "peer_refused",
    PeerCombined: "peer_combined",
    PeerCaughtUp: "peer_caught_up",
    PeerOfferSent: "peer_offer_sent",
}
_TYPE_OF: Final = {kind: cls for cls, kind in KIND_OF.items()}
KINDS: Final[tuple[str, ...]] = tuple(KIND_OF.values())


@dataclass(frozen=True)
class VerifiedJournal:
    """A journal whose chain and heads hold: ``owner`` is the key id whose key signs
    its heads, ``bodies`` every entry up to the last head (heads left out), in order."""

    owner: str
    federation_id: str
    bodies: list[JournalBody]
    lines: int


def verify_journal(lines: Sequence[bytes], peer_public: bytes, federation_id: str) -> int:
    """Check a journal's chain, every body against its kind and every head against the
    peer's key.

    Returns:
        The index of the last entry a head signs (-1 when no head does).

    Raises:
        IntegrityError: a line that is not canonical, a broken link, an unknown kind, a
            body not of its kind's form, or a head that does not verify (each naming
            the line).
    """
    entries = _chain(lines)
    signed = -1
    for entry in entries:
        if entry.kind == "head":
            signed = _check_head(entries, entry, peer_public, federation_id)
    return signed


def read_journal(lines: Sequence[bytes], roster: Mapping[str, bytes]) -> VerifiedJournal:
    """Check a journal whose owner is one of ``roster`` (key id -> public key): the one
    whose key signs its first head, which every later head must verify under too.

    Raises:
        IntegrityError: as :func:`verify_journal`; no head; a head no roster key signed;
            or entries after the last head (not covered by the peer's signature).
    """
    entries = _chain(lines)
    heads = [e for e in entries if e.kind == "head"]
    if not heads:
        raise IntegrityError("the journal holds no signed head")
    federation_id = str(heads[0].body.get("federation_id"))
    owner = None
    for key, public in sorted(roster.items()):
        try:
            _check_head(entries, heads[0], public, federation_id)
        except IntegrityError:
            continue
        owner = key
        break
    if owner is None:
        raise IntegrityError(f"line {heads[0].index}: the head is signed by no key given")
    for head in heads[1:]:
        _check_head(entries, head, roster[owner], federation_id)
    if entries[-1].kind != "head":
        unsigned = entries[-1].index - heads[-1].index
        raise IntegrityError(
            f"{unsigned} entries after the last head (line {heads[-1].index}) are not "
            "signed by the peer"
        )
    bodies = [_decode(e) for e in entries if e.kind != "head"]
    return VerifiedJournal(owner, federation_id, bodies, len(entries))


def encode(body: JournalBody) -> tuple[str, dict[str, object]]:
    """The kind and JSON fields of ``body``."""
    fields: dict[str, object] = msgspec.to_builtins(body)
    return KIND_OF[type(body)], fields


def _chain(lines: Sequence[bytes]) -> list[LogEntry]:
    prev = GENESIS_PREV
    entries: list[LogEntry] = []
    for i, line in enumerate(lines):
        entry = _parse_line(line, i)
        if entry.index != i or entry.prev != prev:
            raise IntegrityError(f"journal line {i}: the chain breaks here")
        if entry.kind != "head":
            _decode(entry)
        entries.append(entry)
        prev = entry.hash
    return entries


def _parse_line(line: bytes, i: int) -> LogEntry:
    """One line, refused unless it is a canonical entry of a journal kind (the log's
    :func:`~fedsec.protocol.log.parse_line` knows only the aggregator's kinds)."""
    if len(line) > MAX_LINE_BYTES:
        raise IntegrityError(f"journal line {i}: longer than {MAX_LINE_BYTES} bytes")
    try:
        doc = msgspec.json.decode(line)
    except msgspec.DecodeError as exc:
        raise IntegrityError(f"journal line {i}: not JSON (truncated or altered): {exc}") from None
    if not isinstance(doc, dict) or set(doc) != {"index", "prev", "time", "kind", "body"}:
        raise IntegrityError(f"journal line {i}: not an entry (index, prev, time, kind, body)")
    if doc["kind"] not in (*KINDS, "head"):
        raise IntegrityError(f"journal line {i}: unknown kind {str(doc['kind'])[:40]!r}")
    if not isinstance(doc["index"], int) or not isinstance(doc["prev"], str):
        raise IntegrityError(f"journal line {i}: index must be an integer and prev a string")
    if not isinstance(doc["time"], int | float) or not isinstance(doc["body"], dict):
        raise IntegrityError(f"journal line {i}: time must be a number and body an object")
    if canonical_json(doc) != line:
        raise IntegrityError(f"journal line {i}: not in canonical form (the line was altered)")
    return LogEntry(doc["index"], doc["prev"], float(doc["time"]), doc["kind"], doc["body"], line)


def _check_head(
    entries: Sequence[LogEntry], head: LogEntry, public: bytes, federation_id: str
) -> int:
    try:
        body = msgspec.convert(head.body, HeadEntry)
    except msgspec.ValidationError as exc:
        raise IntegrityError(f"journal line {head.index}: not a head: {exc}") from None
    if head.index == 0 or body.federation_id != federation_id:
        raise IntegrityError(f"journal line {head.index}: a head of another federation")
    try:
        verify_head(body, public, entries[head.index - 1])
    except IntegrityError as exc:
        raise IntegrityError(f"journal line {head.index} (head): {exc.detail}") from None
    return head.index - 1


def _decode(entry: LogEntry) -> JournalBody:
    try:
        body: JournalBody = msgspec.convert(entry.body, _TYPE_OF[entry.kind])
    except msgspec.ValidationError as exc:
        raise IntegrityError(f"journal line {entry.index}: not a {entry.kind}: {exc}") from None
    return body
