"""The bounded log of refused masked inputs.

Refused masked inputs are logged within bounds, so no member can grow the
transparency log by sending requests: only refusals for an attempt that exists
and from a member of its cohort get entries, at most
:data:`REFUSED_ENTRIES_PER_ATTEMPT` of them per member and attempt, an identical
retry none; the rest are counted and logged as one aggregate ``refused`` entry
(with ``suppressed``) when an attempt closes or aborts (docs/audit-log.md).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import msgspec

from fedsec.aggregator.rounds.attempt import Attempt
from fedsec.aggregator.rounds.context import log
from fedsec.aggregator.storage.interfaces import StateStore
from fedsec.errors import FedsecError, RefusedByRule
from fedsec.protocol import wire
from fedsec.protocol.limits import MAX_ID
from fedsec.protocol.log import entry_from_line
from fedsec.protocol.log_entries import LogBody, RefusedEntry, kind_of
from fedsec.summation.session import RuleRefusal

# `refused` entries written one by one per (member, round, attempt).  An honest agent meets
# few refusals in an attempt: its client never retries a 4xx answer and an identical resend
# is not logged again, so 4 covers the distinct ones it can meet (too early or too late for
# the stage, a different resend after a local crash, a bad vector from a bug).  A hostile
# member then adds at most 4 + 1 (the aggregate entry) per attempt of which it is in the
# cohort: about its honest footprint there (advertise, share_keys, privacy_report,
# masked_input and unmask entries), not one entry per request.
REFUSED_ENTRIES_PER_ATTEMPT = 4

RefusalKey = tuple[str, int, int]  # (member, round, attempt)
# how a refused entry's kind reads in a canonical log line (no spaces, keys sorted)
_REFUSED_KIND = b'"kind":"' + kind_of(RefusedEntry).encode() + b'"'


@dataclass
class _MemberRefusals:
    """One member's refused masked inputs in one attempt: what the log holds of them."""

    logged: set[tuple[str, str, str]] = field(default_factory=set)  # (sha256, code, detail)
    unlogged: dict[str, int] = field(default_factory=dict)  # code -> refusals not yet logged
    last: RefusedEntry | None = None  # the latest of those
    aggregated: bool = False  # its aggregate entry is in the log: nothing more goes there


class RefusalBudget:
    """Which refused masked inputs get a ``refused`` entry of their own; counts the rest
    for one aggregate entry per member and attempt.  Does no I/O: :class:`RefusalLog`
    writes the entries and reports back which it wrote."""

    def __init__(self) -> None:
        self._books: dict[RefusalKey, _MemberRefusals] = {}
        self._pending: set[RefusalKey] = set()  # keys with unlogged refusals

    def load(self, body: RefusedEntry) -> None:
        """Count a ``refused`` entry already in the log (at start-up)."""
        key = (body.member, body.round, body.attempt)
        book = self._books.setdefault(key, _MemberRefusals())
        if body.suppressed is not None:
            book.aggregated = True
        else:
            book.logged.add(_refusal_identity(body))

    def admit(self, key: RefusalKey, body: RefusedEntry) -> str | None:
        """Decide on one refusal of a cohort member for an attempt that exists.

        Returns:
            None when ``body`` is to be logged as an entry of its own (then call
            :meth:`logged`); otherwise why not (``repeat``, ``over_cap``: counted for
            the aggregate entry; ``aggregated``: that entry is written, not counted).
        """
        book = self._books.setdefault(key, _MemberRefusals())
        if book.aggregated:
            return "aggregated"
        if _refusal_identity(body) in book.logged:
            reason = "repeat"
        elif len(book.logged) < REFUSED_ENTRIES_PER_ATTEMPT:
            return None
        else:
            reason = "over_cap"
        book.unlogged[body.code] = book.unlogged.get(body.code, 0) + 1
        book.last = body
        self._pending.add(key)
        return reason

    def logged(self, key: RefusalKey, body: RefusedEntry) -> None:
        self._books[key].logged.add(_refusal_identity(body))

    def due(self) -> list[tuple[RefusalKey, RefusedEntry]]:
        """The aggregate entry of every member and attempt with unlogged refusals: the
        latest of them, with ``suppressed`` (how many) and ``codes`` (how many each)."""
        due = []
        for key in sorted(self._pending):
            book = self._books[key]
            assert book.last is not None
            counts = dict(sorted(book.unlogged.items()))
            entry = msgspec.structs.replace(
                book.last, suppressed=sum(counts.values()), codes=counts
            )
            due.append((key, entry))
        return due

    def aggregated(self, keys: list[RefusalKey]) -> None:
        """Their aggregate entries are committed."""
        for key in keys:
            book = self._books[key]
            book.aggregated, book.last = True, None
            book.unlogged.clear()
            self._pending.discard(key)


def _refusal_identity(body: RefusedEntry) -> tuple[str, str, str]:
    """What makes two refusals the same entry: the bytes refused, and how."""
    return body.sha256, body.code, body.detail


class RefusalLog:
    """Writes ``refused`` entries within the budget.

    Args:
        state: the state store (its rounds and log).
        append: adds an entry to the log: the leader's
            :meth:`~fedsec.aggregator.storage.audit_trail.AuditTrail.append`, or a group
            server's own transaction around
            :func:`~fedsec.aggregator.storage.audit_trail.append_entry`
            (:mod:`fedsec.aggregator.groups.desk`).
        current: the attempt in progress.
    """

    def __init__(
        self, state: StateStore, append: Callable[[LogBody], object], current: Callable[[], Attempt]
    ) -> None:
        self._state = state
        self._append = append
        self._current = current
        self._budget = RefusalBudget()
        self._load()

    def _load(self) -> None:
        """Rebuild the budget from the log, so a restart grants no new entries."""
        for _, line in self._state.log.log_lines():
            # canonical JSON: the kind appears exactly so; decode only those lines
            if _REFUSED_KIND in line:
                body = entry_from_line(line).decode()
                if isinstance(body, RefusedEntry):
                    self._budget.load(body)

    def refused(self, member: str, round_: int, attempt: int, raw: bytes, exc: FedsecError) -> bool:
        """Write a ``refused`` entry for a refused masked input, unless it is for an
        attempt that does not exist or has no cohort, from outside the cohort, an
        identical repeat, over :data:`REFUSED_ENTRIES_PER_ATTEMPT`, or after the member's
        aggregate entry for the attempt; those go to the process log only (repeats and
        those over the cap are also counted for the aggregate entry).

        Returns:
            True when the refusal is about an attempt of which ``member`` is in the
            cohort (logged or counted); False for a made-up attempt or an outsider.
        """
        key = (member, round_, attempt)
        body = RefusedEntry(
            round=round_,
            attempt=attempt,
            stage="masked_input",
            member=member,
            sha256=hashlib.sha256(raw).hexdigest(),
            code=exc.code,
            detail=exc.detail,
        )
        reason = self._unloggable(member, round_, attempt)
        in_cohort = reason is None
        if reason is None:
            reason = self._budget.admit(key, body)
        if reason is None:
            self._append(body)
            self._budget.logged(key, body)
            return True
        log.info(
            "event=refusal_not_logged round=%d attempt=%d member=%s code=%s sha256=%s reason=%s",
            round_,
            attempt,
            member,
            exc.code,
            body.sha256,
            reason,
        )
        return in_cohort

    def rule_refused(self, round_: int, attempt: int, refusals: Iterable[RuleRefusal]) -> None:
        """Inside a round close's transaction, before :meth:`write_aggregates`: a
        ``refused`` entry (code ``refused_by_rule``) for each accepted update the
        attempt's aggregation rule kept out, within the same per-member bounds (a member
        over them is counted in its aggregate entry, written next)."""
        for refusal in refusals:
            key = (refusal.member, round_, attempt)
            body = RefusedEntry(
                round=round_,
                attempt=attempt,
                stage="masked_input",
                member=refusal.member,
                sha256=refusal.sha256,
                code=RefusedByRule.code,
                detail=refusal.detail,
            )
            reason = self._budget.admit(key, body)
            if reason is None:
                self._append(body)
                self._budget.logged(key, body)
            log.info(
                "event=refused_by_rule round=%d attempt=%d member=%s sha256=%s entry=%s reason=%r",
                round_,
                attempt,
                refusal.member,
                refusal.sha256,
                reason or "own",
                refusal.reason,
            )

    def _unloggable(self, member: str, round_: int, attempt: int) -> str | None:
        """Why a refusal for that attempt gets no entry whatever it is, or None."""
        live = self._current()
        if live.is_current(round_, attempt) and live.spec is not None:
            cohort = live.spec.cohort
        else:
            row = None
            # rounds exist from 1 to the live one; no stored attempt exceeds MAX_ID
            if 1 <= round_ <= live.round and 0 <= attempt <= MAX_ID:
                row = self._state.rounds.get(round_, attempt)
            if row is None:
                return "no_such_attempt"
            if row.spec is None:
                return "no_cohort"
            cohort = msgspec.json.decode(row.spec, type=wire.RoundSpec).cohort
        return None if member in cohort else "not_in_cohort"

    def write_aggregates(self) -> list[RefusalKey]:
        """Inside a round close's transaction, before its head: one aggregate entry per
        member and attempt with refusals not logged one by one.  Returns their keys, for
        :meth:`committed` once the transaction is committed."""
        due = self._budget.due()
        for _, body in due:
            self._append(body)
        return [key for key, _ in due]

    def committed(self, keys: list[RefusalKey]) -> None:
        """The aggregate entries of ``keys`` are committed."""
        self._budget.aggregated(keys)
