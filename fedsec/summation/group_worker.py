"""A shard group's SecAgg+ session in a worker process of its own (``[round]
shard_workers = true``).

:class:`GroupWorker` is the group's session as the leader's
:class:`~fedsec.summation.sharded.ShardedSession` sees it: each call is sent over a pipe to
a child process that holds the real
:class:`~fedsec.summation.secagg.SecAggPlusSession` and answers with the result or the
refusal, so validation stays the group session's own and the leader's state changes only
on an answer.  What the split buys is the unmask: every group's ``finalize_ring`` is
started before any is collected, so the groups remove their dropped members' masks
(O(dropped × k × d) PRG each) on as many cores as there are groups.  A message still
reaches its group in the leader's request order, one answer at a time: intake is the
leader's, as before.

A worker that dies (killed, out of memory) is started again on the next call and rebuilt
before the call is retried: from the leader's state store when the session was given it
(``SessionInputs.stored``: the group's accepted messages fed as crash resume feeds them,
so the leader keeps nothing of a group's messages in memory), else from every call it had
taken, kept for that purpose.  The child ends when its pipe closes: the session's end, or
the leader's.
"""

from __future__ import annotations

import logging
import multiprocessing
import weakref
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

from fedsec.crypto.secagg import RoundResult
from fedsec.errors import FedsecError, ProtocolError
from fedsec.protocol import wire
from fedsec.protocol.stages import SECAGG_STAGES
from fedsec.summation.mode import StoredMessage, feed
from fedsec.summation.session import StageMessage, SummationResult
from fedsec.summation.sharded import GroupSession

log = logging.getLogger("fedsec.aggregator.coordinator")

#: The calls that change the group session's state: replayed, in order, into a worker
#: started again after its predecessor died.
_STATEFUL = frozenset({"receive", "replay", "close"})


#: The attempt's accepted messages of the given stages, as the leader's store holds them.
StoredMessages = Callable[[Sequence[str]], Sequence[StoredMessage]]

#: How a worker opens its group's session: ``(spec, keys, consistency=..., group=...)``
#: (:class:`~fedsec.summation.secagg.SecAggPlusSession`; it crosses to the worker by name).
GroupFactory = Callable[..., GroupSession]


def _serve(
    conn: Connection,
    factory: GroupFactory,
    spec: wire.RoundSpec,
    keys: dict[str, bytes],
    consistency: bool,
    group: int,
) -> None:
    """The worker's loop: one call at a time, until the pipe closes."""
    session = factory(spec, keys, consistency=consistency, group=group)
    while True:
        try:
            name, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if name == "feed":  # rebuilding from the store, as crash resume does
                feed(session, *args)
                conn.send(("ok", None))
                continue
            conn.send(("ok", getattr(session, name)(*args)))
        except (FedsecError, ValueError) as exc:  # the session's refusals
            conn.send(("raised", exc))


def _stop(conn: Connection, process: multiprocessing.process.BaseProcess) -> None:
    conn.close()  # the child's recv ends: it returns
    process.join(timeout=5)
    if process.is_alive():
        process.kill()


class GroupWorker(GroupSession):
    """Group ``group`` of ``spec``'s SecAgg+ session, in a worker process.

    Args:
        factory: opens the group's session in the worker (a module-level class or
            function, which the worker imports by name).
        spec: the attempt's signed spec (sharded).
        roster_keys: member id -> Ed25519 public key, for the cohort.
        consistency: as :class:`~fedsec.summation.secagg.SecAggPlusSession`'s.
        group: the group's index in ``spec.groups``.
        stored: the attempt's accepted messages from the leader's store, to rebuild a
            worker started again; None: keep every call taken in memory for that.
    """

    def __init__(
        self,
        factory: GroupFactory,
        spec: wire.RoundSpec,
        roster_keys: Mapping[str, bytes],
        *,
        consistency: bool = True,
        group: int,
        stored: StoredMessages | None = None,
    ) -> None:
        super().__init__(spec)
        self._factory, self._stored = factory, stored
        self._closed = 0  # stages closed so far
        self.stages = tuple(s for s in SECAGG_STAGES if consistency or s != "consistency")
        members = spec.groups[group].members
        self._args = (spec, {m: roster_keys[m] for m in members if m in roster_keys})
        self._consistency, self._group = consistency, group
        self._taken: list[tuple[str, tuple[Any, ...]]] = []  # stateful calls answered "ok"
        self.restarts = 0
        self._start()

    @property
    def pid(self) -> int | None:
        """The worker process's id."""
        pid: int | None = self._process.pid
        return pid

    def _start(self) -> None:
        # spawn: the leader holds an event loop, threads and a database connection that a
        # forked child must not inherit
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        spec, keys = self._args
        self._process = context.Process(
            target=_serve,
            args=(theirs, self._factory, spec, keys, self._consistency, self._group),
            name=f"fedsec-shard-{spec.round}-{spec.attempt}-{self._group}",
            daemon=True,
        )
        self._process.start()
        theirs.close()
        self._conn = ours
        self._stopper = weakref.finalize(self, _stop, ours, self._process)

    def _restart(self) -> None:
        """Start the worker again and feed it every call it had taken.

        Raises:
            ProtocolError: a call the dead worker took is refused now (a bug).
        """
        self._stopper()
        self.restarts += 1
        log.warning(
            "event=shard_worker_restarted round=%d attempt=%d group=%d calls=%d",
            self.spec.round,
            self.spec.attempt,
            self._group,
            len(self._taken),
        )
        self._start()
        if self._stored is not None:
            self._rebuild(self._stored)
            return
        for name, args in self._taken:
            status, value = self._exchange(name, args)
            if status != "ok":
                raise ProtocolError(
                    f"shard group {self._group}'s restarted worker refused a {name} it had "
                    f"taken: {value}"
                )

    def _rebuild(self, stored: StoredMessages) -> None:
        """Feed the new worker its group's stored messages, through the stage open now.

        Raises:
            ProtocolError: a stored message is refused now (the store was altered).
        """
        members = set(self.spec.groups[self._group].members)
        messages = [m for m in stored(self.stages) if m.member in members]
        status, value = self._exchange("feed", (messages, self.stages[self._closed]))
        if status != "ok":
            raise ProtocolError(f"shard group {self._group}'s stored messages: {value}")

    def _exchange(self, name: str, args: tuple[Any, ...]) -> tuple[str, Any]:
        self._conn.send((name, args))
        answer: tuple[str, Any] = self._conn.recv()
        return answer

    def _answer(self, name: str, args: tuple[Any, ...], answer: tuple[str, Any]) -> Any:
        status, value = answer
        if status == "raised":
            raise value
        self._closed += name == "close"
        if name in _STATEFUL and self._stored is None:
            self._taken.append((name, args))
        return value

    def _call(self, name: str, *args: Any) -> Any:
        try:
            answer = self._exchange(name, args)
        except (EOFError, OSError):  # the worker died: start it again, then ask again
            self._restart()
            answer = self._exchange(name, args)
        return self._answer(name, args, answer)

    def receive(self, stage: str, message: StageMessage) -> None:
        self._call("receive", stage, message)

    def replay(self, stage: str, member: str, raw: bytes) -> None:
        self._call("replay", stage, member, raw)

    def complete(self, stage: str) -> bool:
        return bool(self._call("complete", stage))

    def close(self, stage: str) -> None:
        self._call("close", stage)

    def finalize(self) -> SummationResult:
        raise ValueError("a group's sum is decoded by its sharded session (finalize_ring)")

    def finalize_ring(self) -> RoundResult:
        return self.start_finalize()()

    def start_finalize(self) -> Callable[[], RoundResult]:
        """Start unmasking in the worker; the returned call collects the ring sum."""
        try:
            self._conn.send(("finalize_ring", ()))
        except OSError:
            return lambda: self._call("finalize_ring")

        def collect() -> RoundResult:
            try:
                answer = self._conn.recv()
            except (EOFError, OSError):
                return self._call("finalize_ring")  # type: ignore[no-any-return]
            return self._answer("finalize_ring", (), answer)  # type: ignore[no-any-return]

        return collect

    def participant_count(self) -> int:
        return int(self._call("participant_count"))

    def key_list(self, member: str) -> wire.KeyListBody:
        return self._call("key_list", member)  # type: ignore[no-any-return]

    def share_relay(self, member: str) -> wire.ShareRelayBody:
        return self._call("share_relay", member)  # type: ignore[no-any-return]

    def unmask_request(self, member: str, state_token: int) -> wire.UnmaskRequestBody:
        return self._call("unmask_request", member, state_token)  # type: ignore[no-any-return]

    def consistency_proof(self, member: str, state_token: int) -> wire.ConsistencyProofBody:
        return self._call("consistency_proof", member, state_token)  # type: ignore[no-any-return]
