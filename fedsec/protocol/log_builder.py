"""A transparency log built in memory from a federation's messages: the entries the
aggregator's audit trail appends, without its file, its clock or its archive directory.

:class:`LogBuilder` chains each body it is given (index, ``prev`` and a time that
advances by a fixed step, so the same bodies always give the same bytes), signs a
``head`` over the entry before it with the aggregator's key on request, and keeps the
bytes of each accepted message under its SHA-256, as the archive would.
:func:`resign` rewrites a log from one entry on the way only a holder of the
aggregator's key could: re-linked, every later head signed again.

Tests build logs with these instead of writing lines by hand, so a change to the
format (:mod:`fedsec.protocol.log`) reaches them too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Final

from fedsec.crypto.identity import SigningIdentity
from fedsec.protocol.log import GENESIS_PREV, LogEntry, head_body, lines, make_entry
from fedsec.protocol.log_entries import AcceptedEntry, HeadEntry, LogBody
from fedsec.protocol.stages import Stage

#: The time of a built log's first entry (2023-11-14): any fixed time keeps the bytes
#: reproducible; a real one keeps readers that print dates honest.
START_TIME: Final = 1_700_000_000.0


class LogBuilder:
    """A valid log under construction.

    Args:
        federation_id: the federation every head names.
        aggregator: the key that signs heads (the genesis entry names its public half).
        start: the time of the first entry; each later entry is ``step`` seconds on.
        step: seconds between entries.
    """

    def __init__(
        self,
        federation_id: str,
        aggregator: SigningIdentity,
        *,
        start: float = START_TIME,
        step: float = 1.0,
    ) -> None:
        self.federation_id = federation_id
        self.aggregator = aggregator
        self.entries: list[LogEntry] = []
        #: message bytes by their SHA-256, as the archive holds what accepted entries name
        self.archive: dict[str, bytes] = {}
        self._start, self._step = start, step

    def append(self, body: LogBody, *, time: float | None = None) -> LogEntry:
        """Chain ``body`` after the last entry.

        Raises:
            ValueError: a line over the size limit or holding a non-finite number.
        """
        prev = self.entries[-1].hash if self.entries else GENESIS_PREV
        index = len(self.entries)
        when = self._start + self._step * index if time is None else time
        entry = make_entry(index, prev, when, body)
        self.entries.append(entry)
        return entry

    def extend(self, bodies: Iterable[LogBody]) -> list[LogEntry]:
        """Chain each of ``bodies`` in order.

        Raises:
            ValueError: see :meth:`append`.
        """
        return [self.append(body) for body in bodies]

    def head(self, signer: SigningIdentity | None = None) -> LogEntry:
        """A ``head`` over the last entry, signed by ``signer`` (the aggregator's key by
        default; another key makes a head no verifier accepts).

        Raises:
            IndexError: the log is empty (a head signs an entry before it).
        """
        last = self.entries[-1]
        return self.append(head_body(signer or self.aggregator, self.federation_id, last))

    def accept(
        self,
        round_: int,
        attempt: int,
        stage: Stage,
        member: str,
        raw: bytes,
        *,
        commitment: str | None = None,
        signature: str | None = None,
    ) -> AcceptedEntry:
        """Archive ``member``'s message ``raw`` of ``stage`` and log its acceptance.

        Args:
            commitment, signature: what an accepted entry carries beside the digest
                (a commitment or contribution statement), as the aggregator logs it.

        Raises:
            ValueError: see :meth:`append`.
        """
        digest = hashlib.sha256(raw).hexdigest()
        self.archive[digest] = raw
        body = AcceptedEntry(
            round=round_,
            attempt=attempt,
            stage=stage,
            member=member,
            sha256=digest,
            bytes=len(raw),
            commitment=commitment,
            signature=signature,
        )
        self.append(body)
        return body

    def lines(self) -> bytes:
        """The log file's bytes: one canonical line per entry, each ending in a newline."""
        return lines(self.entries)


def resign(entries: Sequence[LogEntry], start: int, signer: SigningIdentity) -> list[LogEntry]:
    """``entries`` re-linked from index ``start`` on, every later head signed again by
    ``signer`` over the entry before it: what an operator holding the aggregator's key
    can make of a log it changed at ``start`` (only an outside copy of an earlier head
    tells).  Times and every other body stay.

    Raises:
        IntegrityError: an entry's body does not match its kind's schema.
        ValueError: see :meth:`LogBuilder.append`.
    """
    out = list(entries[:start])
    for entry in entries[start:]:
        body = entry.decode()
        if isinstance(body, HeadEntry):
            body = head_body(signer, body.federation_id, out[-1])
        prev = out[-1].hash if out else GENESIS_PREV
        out.append(make_entry(len(out), prev, entry.time, body))
    return out
