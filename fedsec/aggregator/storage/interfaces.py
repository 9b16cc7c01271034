"""What the round engine needs of durable state, one protocol per concern.

The round logic (:mod:`fedsec.aggregator.rounds`, the coordinator, the audit-challenge
desk, the HTTP layer) is written against these protocols only; :class:`StateStore`
joins them, with the transaction that makes a group of writes one atomic commit.
:mod:`fedsec.aggregator.storage.sqlite` is the embedded implementation (SQLite in WAL
mode); a replicated one (PostgreSQL) implements the same protocols and passes the
same contract tests (``tests/aggregator/test_storage.py``).

Rules every implementation keeps, because the round logic relies on them:

- a write is durable once the outermost :meth:`StateStore.transaction` commits (or, for
  a write outside any transaction, when the call returns): nothing is acknowledged
  before that;
- a transaction entered inside another joins it; an exception rolls the outer one
  back, writes of every concern together;
- the callbacks of :meth:`LogStore.on_commit` run after each commit of an explicit
  transaction, in the order they were registered;
- every ``add`` (and :meth:`RoundStore.open`) inserts one new row: a second row under
  the same key is refused with the driver's integrity error and changes nothing
  (callers look first; a refusal means a bug or a race). Only
  :meth:`KeyValueStore.put` replaces.

Blobs (``spec``, ``summary``, message and receipt bodies, log lines) are opaque bytes
to the store.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "AlertRow",
    "AlertStore",
    "ChallengeStore",
    "JoinStore",
    "KeyValueStore",
    "LogStore",
    "MessageStore",
    "ReceiptStore",
    "ReportStore",
    "RoundRow",
    "RoundStore",
    "StateStore",
    "TokenRow",
    "TokenStore",
    "VerdictRow",
    "VerdictStore",
]


@dataclass(frozen=True, slots=True)
class RoundRow:
    """One attempt of one round as stored."""

    round: int
    attempt: int
    stage: str
    spec: bytes | None
    opened_at: float
    stage_started_at: float
    closed_at: float | None
    model_version: int | None
    summary: bytes | None
    detail: str


class RoundStore(Protocol):
    """Round attempts: their stage, spec and outcome."""

    def latest(self) -> RoundRow | None:
        """The newest attempt of the newest round, or None before the first."""
        ...

    def get(self, round_: int, attempt: int) -> RoundRow | None:
        """That attempt, or None."""
        ...

    def history(self, limit: int = 1000) -> list[RoundRow]:
        """The newest ``limit`` attempts, oldest first."""
        ...

    def count_closed(self) -> int:
        """How many attempts closed with a new model (stage ``closed``)."""
        ...

    def open(self, round_: int, attempt: int, now: float) -> None:
        """Add the attempt in stage ``open``."""
        ...

    def set_stage(
        self,
        round_: int,
        attempt: int,
        stage: str,
        now: float,
        *,
        spec: bytes | None = None,
        detail: str | None = None,
    ) -> None:
        """Move the attempt to ``stage`` at ``now``; set its spec or detail if given."""
        ...

    def close(
        self,
        round_: int,
        attempt: int,
        stage: str,
        now: float,
        *,
        model_version: int | None,
        summary: bytes,
        detail: str,
    ) -> None:
        """End the attempt in ``stage`` (closed or aborted) with its outcome."""
        ...


class JoinStore(Protocol):
    """Who joined which attempt, when and with how many samples."""

    def add(
        self,
        round_: int,
        attempt: int,
        member: str,
        samples: int,
        now: float,
        base_version: int | None = None,
        graph_commitment: str = "",
    ) -> None:
        """Record ``member`` joining at ``now`` (``base_version``: the model it trained on;
        ``graph_commitment``: SecAgg+, hex of its commitment to its graph nonce)."""
        ...

    def commitments(self, round_: int, attempt: int) -> dict[str, str]:
        """Member -> the graph commitment it joined with ('' for none)."""
        ...

    def samples(self, round_: int, attempt: int) -> dict[str, int]:
        """Member -> declared samples, in the order they joined."""
        ...

    def count(self, round_: int, attempt: int) -> int:
        """How many members joined the attempt (without reading them)."""
        ...

    def joined(self, round_: int, attempt: int, member: str) -> bool:
        """Whether ``member`` joined the attempt."""
        ...

    def bases(self, round_: int, attempt: int) -> dict[str, int | None]:
        """Member -> the model version it trained on (None: not said)."""
        ...

    def nth_time(self, round_: int, attempt: int, nth: int) -> float:
        """When the ``nth`` member (1-based) joined; +inf if fewer joined."""
        ...


class MessageStore(Protocol):
    """Accepted protocol messages, replayed in order by a resumed aggregator."""

    def add(self, round_: int, attempt: int, stage: str, member: str, body: bytes) -> int:
        """Store the accepted message; return its sequence number (increasing)."""
        ...

    def get(self, round_: int, attempt: int, stage: str, member: str) -> bytes | None:
        """The member's message of that stage, or None."""
        ...

    def count(self, round_: int, attempt: int, stage: str) -> int:
        """How many messages that stage accepted."""
        ...

    def of_stage(self, round_: int, attempt: int, stage: str) -> Iterator[tuple[str, bytes]]:
        """(member, body) of that stage, in the order they were accepted."""
        ...

    def after(
        self, round_: int, attempt: int, stage: str, seq: int
    ) -> Iterator[tuple[int, str, bytes]]:
        """(sequence number, member, body) of that stage's messages stored after ``seq``,
        in the order they were accepted: what a reader that saw up to ``seq`` lacks (the
        leader reading what group servers took, :mod:`fedsec.aggregator.groups`)."""
        ...


class ReportStore(Protocol):
    """Signed privacy reports and the ε they declare."""

    def add(self, round_: int, attempt: int, member: str, epsilon: float, body: bytes) -> None:
        """Store the member's report for the attempt."""
        ...

    def get(self, round_: int, attempt: int, member: str) -> bytes | None:
        """The member's report for the attempt, or None."""
        ...

    def epsilons(self) -> dict[str, float]:
        """The largest ε each member has reported."""
        ...

    def epsilon_max(self, round_: int, attempt: int) -> float | None:
        """The largest ε reported for the attempt, or None if none was."""
        ...


class ReceiptStore(Protocol):
    """Signed receipts handed to members for their masked inputs."""

    def add(self, round_: int, attempt: int, member: str, body: bytes) -> None:
        """Store the receipt of the member's contribution to the attempt."""
        ...

    def latest(self, round_: int, member: str) -> bytes | None:
        """The member's receipt from the newest attempt of the round, or None."""
        ...

    def has(self, round_: int, attempt: int, member: str) -> bool:
        """True when the member holds a receipt for that attempt."""
        ...

    def contributions(self) -> dict[str, int]:
        """Member -> how many closed attempts it holds a receipt for: the rounds whose
        sum holds its input."""
        ...


class ChallengeStore(Protocol):
    """Audit challenges and the sealed reveals that answer them."""

    def add(self, round_: int, attempt: int, member: str, auditor: str, body: bytes) -> None:
        """Store the auditor's challenge of the member's contribution."""
        ...

    def get(self, round_: int, attempt: int, member: str, auditor: str) -> bytes | None:
        """That challenge, or None."""
        ...

    def open_for(self, member: str) -> list[bytes]:
        """The member's challenges without a reveal yet, oldest round first."""
        ...

    def count(self) -> int:
        """How many challenges were ever stored (none is ever removed, so it only grows)."""
        ...

    def add_reveal(self, round_: int, attempt: int, member: str, auditor: str, body: bytes) -> None:
        """Store the member's reveal answering that challenge."""
        ...

    def reveals_for(self, auditor: str) -> list[bytes]:
        """Reveals sealed to the auditor, by round, attempt and member."""
        ...


class LogStore(Protocol):
    """The transparency log's lines, written in the transaction of the change they
    record, and when they become durable (the audit trail copies committed lines to
    ``audit/log.jsonl``)."""

    def add_log_line(self, index: int, line: bytes) -> None:
        """Store the line at ``index`` (the next one after :meth:`log_tail`)."""
        ...

    def log_tail(self) -> tuple[int, bytes] | None:
        """(index, line) of the last line, or None for an empty log."""
        ...

    def log_lines(self, start: int = 0) -> Iterator[tuple[int, bytes]]:
        """(index, line) from ``start`` on, in order (uncommitted ones of the current
        transaction included)."""
        ...

    def in_transaction(self) -> bool:
        """True inside an explicit transaction (its lines are not durable yet)."""
        ...

    def on_commit(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` after every commit of an explicit transaction."""
        ...


class KeyValueStore(Protocol):
    """Named values of the aggregator's own (the server optimiser's moments)."""

    def put(self, name: str, value: bytes) -> None:
        """Set ``name`` to ``value``, replacing any earlier value."""
        ...

    def get(self, name: str) -> bytes | None:
        """The value of ``name``, or None."""
        ...


@dataclass(frozen=True, slots=True)
class AlertRow:
    """One operator alert as stored.  ``subject`` names what it is about (``round 4.0``,
    ``member hospital-3``): an open alert of the same kind and subject is not raised
    twice.  ``ack_sha256``: SHA-256 of the capability its webhook carries for
    acknowledging it (the token itself is never stored)."""

    id: int
    kind: str
    subject: str
    detail: str
    raised_at: float
    acked_at: float | None
    acked_by: str | None
    ack_sha256: str


class AlertStore(Protocol):
    """Operator alerts: open, acknowledged, history."""

    def add(self, kind: str, subject: str, detail: str, now: float, ack_sha256: str) -> int:
        """Store a new alert; return its id (increasing)."""
        ...

    def get(self, alert_id: int) -> AlertRow | None:
        """That alert, or None."""
        ...

    def open_of(self, kind: str, subject: str) -> AlertRow | None:
        """The unacknowledged alert of that kind and subject, or None."""
        ...

    def recent(self, limit: int = 200) -> list[AlertRow]:
        """The newest ``limit`` alerts, newest first."""
        ...

    def count_open(self) -> dict[str, int]:
        """Kind -> how many alerts of it are unacknowledged."""
        ...

    def ack(self, alert_id: int, by: str, now: float) -> bool:
        """Acknowledge the alert; False when it was already (nothing changes then)."""
        ...


@dataclass(frozen=True, slots=True)
class TokenRow:
    """A bearer token issued to an observer: only its SHA-256 is stored."""

    sha256: str
    observer: str
    scope: str
    issued_at: float
    expires_at: float
    revoked: bool


class TokenStore(Protocol):
    """Bearer tokens for what a browser or a scraper cannot sign (dashboard, metrics)."""

    def add(self, row: TokenRow) -> None:
        """Store a newly issued token."""
        ...

    def get(self, sha256: str) -> TokenRow | None:
        """The token with that hash, or None."""
        ...

    def all(self) -> list[TokenRow]:
        """Every token, newest first."""
        ...

    def revoke(self, sha256: str) -> bool:
        """Revoke the token; False when no such token exists."""
        ...


@dataclass(frozen=True, slots=True)
class VerdictRow:
    """An auditor's control-sample verdict on one member's contribution to one attempt."""

    round: int
    attempt: int
    member: str
    auditor: str
    passed: bool
    failed: str  # the names of the failed checks, comma-separated
    received_at: float


class VerdictStore(Protocol):
    """Audit verdicts submitted by auditors."""

    def add(self, row: VerdictRow) -> bool:
        """Store the verdict; False (and nothing changes) when the same auditor already
        judged that member's attempt."""
        ...

    def by_member(self) -> dict[str, list[VerdictRow]]:
        """Member -> its verdicts, oldest round first."""
        ...

    def count(self) -> int:
        """How many verdicts are stored."""
        ...


class StateStore(Protocol):
    """The aggregator's durable state: every concern, sharing one transaction."""

    @property
    def rounds(self) -> RoundStore: ...

    @property
    def joins(self) -> JoinStore: ...

    @property
    def messages(self) -> MessageStore: ...

    @property
    def reports(self) -> ReportStore: ...

    @property
    def receipts(self) -> ReceiptStore: ...

    @property
    def challenges(self) -> ChallengeStore: ...

    @property
    def log(self) -> LogStore: ...

    @property
    def values(self) -> KeyValueStore: ...

    @property
    def alerts(self) -> AlertStore: ...

    @property
    def tokens(self) -> TokenStore: ...

    @property
    def verdicts(self) -> VerdictStore: ...

    def transaction(self) -> AbstractContextManager[None]:
        """``with state.transaction(): ...`` makes the writes inside one atomic commit."""
        ...

    def close(self) -> None:
        """Release the store; nothing may be called on it afterwards."""
        ...
