"""The transparency log: an append-only, hash-chained, periodically signed JSON-lines file.

Format (documented for third-party verifiers in docs/audit-log.md): one entry per
line, each line the canonical JSON (sorted keys, no spaces, UTF-8) of::

    {"index": n, "prev": "<sha256 hex of line n-1, or 64 zeros for n = 0>",
     "time": <unix seconds>, "kind": "<entry kind>", "body": {...}}

An entry's hash is SHA-256 over its line bytes (without the newline).  Changing,
removing, reordering or inserting any line breaks the chain at that point.  At
every round close (and on demand) the aggregator appends a ``head`` entry whose
body signs ``{"federation_id", "index", "hash"}`` of the entry before it with the
aggregator's Ed25519 key (domain ``log-head``), so the chain up to there cannot be
rewritten without the key, and the head hash serves as a public beacon.  Each
kind's body is a struct of :mod:`fedsec.protocol.log_entries`, which names the kinds.

This module is pure: it builds and checks entries; storage is the caller's (the
aggregator's audit trail writes the file, :func:`fedsec.audit.log.read_log` reads it).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fedsec.crypto.identity import PublicIdentity, SigningIdentity, canonical_json
from fedsec.errors import IntegrityError, SignatureError
from fedsec.protocol.log_entries import (
    ENTRY_TYPES,
    HeadEntry,
    LogBody,
    check_finite_body,
    decode_body,
    encode_body,
    kind_of,
)

GENESIS_PREV = "0" * 64
HEAD_DOMAIN = "log-head"
# A log line holds metadata and hashes, never vectors; 1 MiB bounds a hostile file.
MAX_LINE_BYTES = 1 << 20

#: Every entry kind, from the registry of body structs (docs/audit-log.md §3).
KINDS: frozenset[str] = frozenset(ENTRY_TYPES)


@dataclass(frozen=True, slots=True)
class LogEntry:
    index: int
    prev: str
    time: float
    kind: str
    body: dict[str, Any]
    line: bytes  # canonical encoding, without newline

    @property
    def hash(self) -> str:
        return hashlib.sha256(self.line).hexdigest()

    def decode(self) -> LogBody:
        """The body as the struct of its kind (:mod:`fedsec.protocol.log_entries`).

        Raises:
            IntegrityError: the body does not match its kind's schema exactly.
        """
        return decode_body(self.kind, self.body)


def make_entry(index: int, prev: str, time: float, body: LogBody) -> LogEntry:
    """Build the entry carrying ``body`` that follows ``prev``.

    Raises:
        ValueError: the line would be over :data:`MAX_LINE_BYTES`, or would hold NaN or
            an infinity, which standard JSON has no place for (a bug: what the
            aggregator logs was checked when it arrived).
    """
    kind, fields = kind_of(body), encode_body(body)
    # canonical_json, being json's encoder, writes NaN and Infinity where it meets them
    if not math.isfinite(time):
        raise ValueError(f"log entry {index}: time {time} is not finite")
    try:
        check_finite_body(kind, fields)
    except IntegrityError as exc:
        raise ValueError(f"log entry {index}: {exc.detail}") from None
    line = canonical_json(
        {"index": index, "prev": prev, "time": time, "kind": kind, "body": fields}
    )
    if len(line) > MAX_LINE_BYTES:
        raise ValueError(f"log entry of {len(line)} bytes exceeds {MAX_LINE_BYTES}")
    return LogEntry(index, prev, time, kind, fields, line)


def entry_from_line(line: bytes) -> LogEntry:
    """An entry from a line this process wrote itself (not checked: use
    :func:`parse_line` for lines from elsewhere)."""
    doc = json.loads(line)
    return LogEntry(doc["index"], doc["prev"], float(doc["time"]), doc["kind"], doc["body"], line)


def head_statement(federation_id: str, index: int, entry_hash: str) -> bytes:
    return canonical_json({"federation_id": federation_id, "index": index, "hash": entry_hash})


def head_body(signer: SigningIdentity, federation_id: str, last: LogEntry) -> HeadEntry:
    """Body of a ``head`` entry signing everything up to and including ``last``."""
    statement = head_statement(federation_id, last.index, last.hash)
    return HeadEntry(
        federation_id=federation_id,
        signed_index=last.index,
        signed_hash=last.hash,
        signature=signer.sign(HEAD_DOMAIN, statement).hex(),
    )


def verify_head(head: HeadEntry, aggregator_public: bytes, signed: LogEntry) -> None:
    """Check a ``head`` entry's signature over ``signed`` (the entry before it).

    The messages say what is wrong with the head but not which entry the head is:
    callers name it (``log entry 24 (head): ...``), so it is named once.

    Raises:
        IntegrityError: it names another entry, or the signature does not verify.
    """
    if head.signed_index != signed.index:
        raise IntegrityError(
            f"head claims to sign entry {head.signed_index}, but the entry before it is entry "
            f"{signed.index} (entries were deleted or inserted before the head)"
        )
    if head.signed_hash != signed.hash:
        raise IntegrityError(
            f"head signs entry {signed.index} with hash {head.signed_hash[:16]}…, but that "
            f"entry hashes to {signed.hash[:16]}… (entries up to {signed.index} were changed "
            "after the head was written)"
        )
    try:
        signature = bytes.fromhex(head.signature)
    except ValueError:
        raise IntegrityError("head signature is not hex") from None
    aggregator = PublicIdentity(aggregator_public)
    try:
        aggregator.verify(
            HEAD_DOMAIN,
            head_statement(head.federation_id, signed.index, signed.hash),
            signature,
        )
    except SignatureError:
        raise IntegrityError(
            f"head signature does not verify under the aggregator key {aggregator.key_id} "
            f"(entries up to {signed.index} were rewritten after signing, or another key "
            "signed the head)"
        ) from None


def parse_line(raw: bytes, lineno: int, source: str) -> LogEntry:
    """Decode one log line, refusing anything not in canonical form.

    Raises:
        IntegrityError: naming ``source`` and the line number.
    """
    where = f"{source} line {lineno}"
    if len(raw) > MAX_LINE_BYTES:
        raise IntegrityError(f"{where}: line of {len(raw)} bytes exceeds {MAX_LINE_BYTES}")
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise IntegrityError(f"{where}: not JSON (truncated or corrupted): {exc}") from None
    if not isinstance(doc, dict) or set(doc) != {"index", "prev", "time", "kind", "body"}:
        raise IntegrityError(f"{where}: not a log entry (fields index, prev, time, kind, body)")
    if doc["kind"] not in KINDS:
        raise IntegrityError(f"{where}: unknown entry kind {doc['kind']!r}")
    if not isinstance(doc["index"], int) or not isinstance(doc["body"], dict):
        raise IntegrityError(f"{where}: index must be an integer and body an object")
    if not isinstance(doc["time"], int | float) or not isinstance(doc["prev"], str):
        raise IntegrityError(f"{where}: time must be a number and prev a string")
    # json.loads takes NaN and Infinity, which standard JSON (docs/audit-log.md) has not
    if isinstance(doc["time"], float) and not math.isfinite(doc["time"]):
        raise IntegrityError(f"{where}: log entry {doc['index']}: time is not a finite number")
    try:
        check_finite_body(doc["kind"], doc["body"])
    except IntegrityError as exc:
        raise IntegrityError(f"{where}: log entry {doc['index']}: {exc.detail}") from None
    if canonical_json(doc) != raw:
        raise IntegrityError(f"{where}: not in canonical form (the line was altered)")
    return LogEntry(doc["index"], doc["prev"], float(doc["time"]), doc["kind"], doc["body"], raw)


def lines(entries: Iterable[LogEntry]) -> bytes:
    return b"".join(e.line + b"\n" for e in entries)
