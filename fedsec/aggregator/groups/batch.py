"""Group commit of a group server's accepted messages: the messages its desk validated
while the store was busy are stored, logged (and receipted) in one transaction, and
each is answered only once that transaction committed.

Each commit of SQLite's ``synchronous=FULL`` store is an fsync of its WAL under the
write lock the leader and every group server share; one per message bounded intake with
4 group servers at the lock (0.47-0.79 ms a message, of which ~0.2 ms CPU:
bench/results/scale-profile.md).  A batch pays that fsync once.

A message joins the :class:`CommitQueue` only once the desk validated it completely (its
session took it); :func:`commit` then settles every message of a batch, each with the
outcome a transaction of its own would give it: a message whose stage moved on, or
whose group the leader took over, is refused alone (the checks are read once per
(attempt, stage, group) in the transaction, before any write of theirs); a write that
fails rolls the batch back and its messages are committed one by one, so one bad message
never loses the others; a failed ``COMMIT`` (or the leader's fence at ``BEGIN``) fails
every message of the batch, none of which was answered before.

The queue and :func:`commit` are sans-I/O, over a :class:`BatchStore`;
:class:`StoreWrites` is that store over the leader's state store.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from fedsec.aggregator.groups.hosts import GroupFence, ServedTraffic
from fedsec.aggregator.storage.audit_trail import append_entry, store_accepted
from fedsec.aggregator.workspace import Workspace
from fedsec.errors import DuplicateMessage, WrongStage
from fedsec.protocol import wire
from fedsec.protocol.log_entries import AcceptedEntry
from fedsec.protocol.stages import Stage

#: The most messages one transaction stores.  The write lock is held for the batch's
#: writes (0.15-0.22 ms of CPU a message inside it, measured over the three upload
#: stages) and one WAL fsync: 64 hold it ~15 ms, well inside the leader's 50 ms tick, so
#: the leader's stage moves and the other servers' commits wait for at most one such
#: hold, while the fsync is already shared 64 ways (past that the CPU inside the lock
#: dominates).
MAX_BATCH: Final = 64


@dataclass(eq=False)  # one object per message: identical retries share it
class Pending:
    """A validated message of ``member`` in group ``group`` of attempt (``round``,
    ``attempt``), waiting for its batch's commit; ``extra``: what its log entry and
    receipt need besides the bytes (a masked input's statement, a share's report)."""

    round: int
    attempt: int
    stage: Stage
    member: str
    group: int
    raw: bytes
    extra: dict[str, Any]
    #: Set by :func:`commit`: stored (with its receipt, for a masked input) or refused.
    settled: bool = False
    receipt: wire.Receipt | None = None
    error: Exception | None = None
    #: The digest the archive holds its bytes under (set before its transaction).
    sha256: str = ""

    @property
    def key(self) -> tuple[int, int, Stage, str]:
        return (self.round, self.attempt, self.stage, self.member)

    @property
    def scope(self) -> tuple[int, int, Stage, int]:
        """What one check in a transaction covers: the attempt's stage and the group's
        fence."""
        return (self.round, self.attempt, self.stage, self.group)

    @property
    def accepted(self) -> bool:
        return self.settled and self.error is None


@dataclass
class CommitQueue:
    """The validated messages not yet settled, in the order they were validated (the
    order their log entries take)."""

    _waiting: dict[tuple[int, int, Stage, str], Pending] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._waiting)

    def pending(self, round_: int, attempt: int, stage: Stage, member: str) -> Pending | None:
        """The message of ``member`` for ``stage`` waiting for its commit, if any."""
        return self._waiting.get((round_, attempt, stage, member))

    def join(self, message: Pending) -> Pending:
        """Queue ``message``; an identical one already waiting is returned instead (its
        sender awaits the same outcome).

        Raises:
            DuplicateMessage: a different message of the member's stage is waiting;
                the queue is unchanged.
        """
        waiting = self._waiting.get(message.key)
        if waiting is not None:
            if waiting.raw != message.raw:
                raise DuplicateMessage(
                    f"{message.member} already sent a different {message.stage} message this round"
                )
            return waiting
        self._waiting[message.key] = message
        return message

    def take(self) -> list[Pending]:
        """The next batch: at most :data:`MAX_BATCH` waiting messages, oldest first.
        They stay :meth:`pending` (a retry joins them) until :meth:`settle`."""
        return list(itertools.islice(self._waiting.values(), MAX_BATCH))

    def settle(self, batch: list[Pending]) -> None:
        """Forget ``batch``'s messages (each settled, or failed with ``error``): a
        retry now finds the message in the store, or is taken anew."""
        for message in batch:
            if not message.settled:
                message.settled = True
                message.error = message.error or RuntimeError("the batch was not committed")
            self._waiting.pop(message.key, None)


class BatchStore(Protocol):
    """What :func:`commit` needs of the desk and its store."""

    def transaction(self) -> AbstractContextManager[None]:
        """One atomic commit of the writes inside."""
        ...

    def check(self, message: Pending) -> None:
        """Inside the transaction, before ``message``'s writes: read its attempt's stage
        and its group's fence.

        Raises:
            FedsecError: the message may not be stored (its refusal).
        """
        ...

    def write(self, message: Pending) -> wire.Receipt | None:
        """Inside the transaction: store, log (and receipt) ``message``."""
        ...


def commit(batch: list[Pending], store: BatchStore) -> int:
    """Settle every message of ``batch`` (module docstring); the number of
    transactions it took.  Never raises: each failure is its message's ``error``."""
    try:
        with store.transaction():
            wrote = _write_all(batch, store)
    except _WriteFailed:  # rolled back: one message's fault, not the others'
        return 1 + _one_by_one(batch, store)
    except Exception as exc:  # BEGIN (the leader's fence) or COMMIT: the whole batch
        for message in batch:
            message.receipt, message.error = None, message.error or exc
    else:
        for message, receipt in wrote:
            message.receipt = receipt
    for message in batch:
        message.settled = True
    return 1


class _WriteFailed(Exception):
    """A message's writes failed inside the batch's transaction (rolls it back)."""


def _write_all(
    batch: list[Pending], store: BatchStore
) -> list[tuple[Pending, wire.Receipt | None]]:
    """The batch's checks (once per scope) and writes; (message, receipt) of those
    written.  A refused message gets its ``error``; a failed write raises
    :class:`_WriteFailed`."""
    refusals: dict[tuple[int, int, Stage, int], Exception | None] = {}
    wrote: list[tuple[Pending, wire.Receipt | None]] = []
    for message in batch:
        if message.scope not in refusals:
            refusals[message.scope] = _refusal(store.check, message)
        refused = refusals[message.scope]
        if refused is not None:
            message.error = refused
            continue
        try:
            wrote.append((message, store.write(message)))
        except Exception as exc:
            raise _WriteFailed from exc
    return wrote


def _refusal(check: Callable[[Pending], None], message: Pending) -> Exception | None:
    try:
        check(message)
    except Exception as exc:
        return exc
    return None


def _one_by_one(batch: list[Pending], store: BatchStore) -> int:
    """Each message of a rolled-back batch in a transaction of its own: its own
    outcome.  The number of transactions."""
    for message in batch:
        message.receipt, message.error = None, None
        try:
            with store.transaction():
                store.check(message)
                message.receipt = store.write(message)
        except Exception as exc:
            message.receipt, message.error = None, exc
        message.settled = True
    return len(batch)


class StoreWrites:
    """A batch's writes (:class:`BatchStore`) in the leader's store: a message is
    stored, logged (and receipted) as the leader's intake does, after a check that the
    attempt is still in its stage and its group still this server's."""

    def __init__(self, ws: Workspace, traffic: ServedTraffic, clock: Callable[[], float]) -> None:
        self._ws, self._traffic, self._clock = ws, traffic, clock

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """One transaction; the bytes counted since the last commit ride on it."""
        state = self._ws.state
        with state.transaction():
            yield
            self._traffic.write(state)
        self._traffic.written()

    def check(self, message: Pending) -> None:
        """Raises: WrongStage: the leader moved the stage on; NotLeader: the leader took
        the group over."""
        state, r, a = self._ws.state, message.round, message.attempt
        row = state.rounds.get(r, a)
        if row is None or row.stage != message.stage:
            raise WrongStage(
                f"{message.stage} message refused: round {r} moved on to stage "
                f"{row.stage if row else 'none'}"
            )
        GroupFence(state, r, a, message.group).check()

    def write(self, message: Pending) -> wire.Receipt | None:
        """Store ``message``, its privacy report if any, their log entries and (for a
        masked input) its receipt, inside the caller's transaction; the receipt.

        Raises:
            sqlite3.Error, psycopg.Error: the store fails (a constraint, a full disk).
        """
        state, extra, ws = self._ws.state, message.extra, self._ws
        r, a, member = message.round, message.attempt, message.member
        if "report" in extra:
            report, body = extra["report"]
            state.reports.add(r, a, member, report.epsilon, body)
            append_entry(state.log, self._clock(), report)
        accepted = AcceptedEntry(
            round=r,
            attempt=a,
            stage=message.stage,
            member=member,
            sha256=message.sha256,
            bytes=len(message.raw),
            commitment=extra.get("commitment"),
            signature=extra.get("signature"),
        )
        return store_accepted(
            state,
            lambda entry: append_entry(state.log, self._clock(), entry),
            ws.signer,
            ws.federation_id,
            self._clock,
            accepted,
            message.raw,
            extra.get("receipt_for"),
        )
