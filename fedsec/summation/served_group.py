"""The leader's view of a shard group that a group server serves (``[round]
group_servers``).

A group server (:mod:`fedsec.aggregator.groups`) takes its group's stage messages over
HTTP, validates each with its own copy of the group's session and writes it to the
shared state store.  The leader never sees those requests: :class:`ServedGroup` reads
the group's messages from the store (``GroupHosts.stored_after``) and replays them into
the leader's own session of the group, as a resumed aggregator replays its store.  The
two sessions were fed the same messages in the same stages (a group server stores a
message only while the store's attempt is in that message's stage, checked in the
transaction that stores it), so they agree on every survivor set, and the leader's
finalize (its unmask of the group) gives the group's ring sum bit for bit as if it had
taken the messages itself.

What is spread over processes is intake: request signatures, nonces, decoding, the
group session's validation and the store's write, log entry and receipt of each
message.  The leader replays each message once more (a decode and a check of the
group's session, no signature or write) and unmasks.

A group server that stops answering is taken over: once its heartbeat in the store is
older than the hosts allow (``GroupHosts.alive``), the leader records the take-over in
the store (after which the server's writes are refused, in their own transactions),
reads what the server stored before it, and takes the group's messages itself from
then on.  Until then a message for the group that reaches the leader (a member falling
back from an unreachable server) is answered ``GroupServedElsewhere``, a 503 the member
retries.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from fedsec.crypto.secagg import RoundResult
from fedsec.errors import GroupServedElsewhere
from fedsec.protocol import wire
from fedsec.summation.mode import StoredMessage
from fedsec.summation.session import StageMessage, SummationResult
from fedsec.summation.sharded import GroupSession


class GroupHosts(Protocol):
    """What the leader reads and writes of an attempt's group servers, in the shared
    state store (:class:`fedsec.aggregator.groups.hosts.StoreGroupHosts`)."""

    def stored_after(self, stage: str, seq: int) -> Sequence[tuple[int, StoredMessage]]:
        """The attempt's ``stage`` messages stored after sequence number ``seq``, each
        with its own, in the order they were stored."""
        ...

    def now(self) -> float:
        """The clock :meth:`alive` reads (Unix time)."""
        ...

    def alive(self, url: str, last_message_at: float) -> bool:
        """Whether the group server at ``url`` wrote its heartbeat, or stored one of its
        group's messages (read at ``last_message_at``), recently enough."""
        ...

    def taken_over(self, group: int) -> bool:
        """Whether the leader took group ``group`` of the attempt over (stored)."""
        ...

    def replayed(self, stage: str, member: str) -> None:
        """``member``'s ``stage`` message, stored by a group server, is now in the
        leader's session: what the leader does for a message it takes itself, bar the
        write (a share_keys message's privacy report is announced once)."""
        ...

    def take_over(self, group: int) -> None:
        """Record that the leader takes group ``group`` over; from its commit on, the
        group's server may store nothing more for the attempt."""
        ...


class ServedGroup(GroupSession):
    """Group ``group`` of ``spec``, served by the group server its spec names; the
    leader's session of it (``inner``) fed from the store.

    Args:
        inner: the leader's session of the group (in process or in a worker).
        spec: the attempt's signed spec.
        group: the group's index in ``spec.groups``.
        hosts: the attempt's group servers, as the store knows them.
    """

    def __init__(
        self, inner: GroupSession, spec: wire.RoundSpec, group: int, hosts: GroupHosts
    ) -> None:
        super().__init__(spec)
        self.inner, self.stages = inner, inner.stages
        self.group, self.url = group, spec.groups[group].url
        self._members = frozenset(spec.groups[group].members)
        self._hosts = hosts
        self._open = 0  # index in stages of the stage open now
        self._cursor = 0  # the store's sequence number read up to, in that stage
        self._seen: set[tuple[str, str]] = set()  # (stage, member) the inner session has
        self._last_message_at = hosts.now()  # when a message of the server's was last read
        self.served_here = hosts.taken_over(group)

    # -- what the group server stored ---------------------------------------------------------

    def pull(self) -> None:
        """Replay into the leader's session the group's messages of the open stage that
        the store holds and it has not seen.

        Raises:
            ProtocolError: a stored message does not verify (the store was altered).
        """
        stage = self.stages[self._open]
        for seq, (stage_, member, raw) in self._hosts.stored_after(stage, self._cursor):
            self._cursor = seq
            if member not in self._members or (stage_, member) in self._seen:
                continue
            self.inner.replay(stage_, member, raw)
            self._seen.add((stage_, member))
            self._last_message_at = self._hosts.now()
            self._hosts.replayed(stage_, member)

    def _watch(self) -> None:
        """Take the group over once its server stopped writing its heartbeat and
        storing its messages."""
        if not self.served_here and not self._hosts.alive(self.url, self._last_message_at):
            self._hosts.take_over(self.group)
            self.served_here = True
            self.pull()  # what the server stored before the take-over committed

    # -- the session interface ------------------------------------------------------------------

    def receive(self, stage: str, message: StageMessage) -> None:
        """Raises: GroupServedElsewhere: the group's server is alive (the member may
        retry; it is taken over once its heartbeat stops); else the inner session's
        refusals."""
        self._watch()
        if not self.served_here:
            raise GroupServedElsewhere(
                f"shard group {self.group} is served at {self.url}; this aggregator takes "
                "its messages only once that server has stopped answering",
                retry_after=1.0,
            )
        self.pull()
        self.inner.receive(stage, message)
        self._seen.add((stage, str(getattr(message, "member", ""))))

    def replay(self, stage: str, member: str, raw: bytes) -> None:
        if (stage, member) in self._seen:
            return
        self.inner.replay(stage, member, raw)
        self._seen.add((stage, member))

    def complete(self, stage: str) -> bool:
        self._watch()
        self.pull()
        return self.inner.complete(stage)

    def close(self, stage: str) -> None:
        self.pull()
        self.inner.close(stage)
        self._open = min(self._open + 1, len(self.stages) - 1)
        self._cursor = 0

    def finalize(self) -> SummationResult:
        raise ValueError("a group's sum is decoded by its sharded session (finalize_ring)")

    def finalize_ring(self) -> RoundResult:
        self.pull()
        return self.inner.finalize_ring()

    def start_finalize(self) -> Callable[[], RoundResult]:
        self.pull()
        return self.inner.start_finalize()

    def participant_count(self) -> int:
        return self.inner.participant_count()

    # the leader answers a member that fell back to it: the same data the server serves

    def key_list(self, member: str) -> wire.KeyListBody:
        return self.inner.key_list(member)

    def share_relay(self, member: str) -> wire.ShareRelayBody:
        return self.inner.share_relay(member)

    def unmask_request(self, member: str, state_token: int) -> wire.UnmaskRequestBody:
        return self.inner.unmask_request(member, state_token)

    def consistency_proof(self, member: str, state_token: int) -> wire.ConsistencyProofBody:
        return self.inner.consistency_proof(member, state_token)
