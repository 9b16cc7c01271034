"""What the leader and its group servers share in the state store, besides the
messages themselves: each server's heartbeat, the leader's take-overs and the bytes
each server's requests carried in each attempt.

All are named values (:class:`~fedsec.aggregator.storage.interfaces.KeyValueStore`),
so SQLite and PostgreSQL stores hold them unchanged.  A take-over is written in a
transaction of its own; a group server reads it inside each transaction that stores a
message (:meth:`GroupFence.check`), so once it has committed, the server stores nothing
more for that group and attempt: the leader's view of the group is final.  A server's
byte counts ride on the transactions it commits anyway (:class:`ServedTraffic`), and
the leader adds them to the attempt's summary (:func:`stored_traffic`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Final

import msgspec

from fedsec.aggregator.storage.interfaces import StateStore
from fedsec.aggregator.storage.leadership import NotLeader, lease_of
from fedsec.protocol import wire
from fedsec.summation.mode import StoredMessage

#: How often a group server writes its heartbeat: one small write, 4 a second.
HEARTBEAT_S: Final = 0.25
#: A group server that wrote no heartbeat and stored none of its group's messages for
#: this long is taken over by the leader.  Its writes (heartbeats included) wait their
#: turn at the store's write lock in its event loop, so a server busy storing under
#: load can miss many beats: measured with 4 servers and a leader writing one SQLite
#: file on 2 cores, beats came more than 2 s apart while messages were being stored.
#: A killed server is replaced within this, well inside a stage's window
#: (round.advertise_s, 30 s by default).
STALE_S: float = 5.0


def heartbeat_key(url: str) -> str:
    """The named value holding the last heartbeat (Unix time) of the server at ``url``."""
    return f"group_server_heartbeat {url}"


def taken_over_key(round_: int, attempt: int, group: int) -> str:
    """The named value marking group ``group`` of the attempt as taken over."""
    return f"group_taken_over {round_}.{attempt}.{group}"


def traffic_key(round_: int, attempt: int, url: str) -> str:
    """The named value holding the bytes of the requests the server at ``url`` served
    in the attempt: ``[received, sent]``, as the leader counts its own."""
    return f"group_server_traffic {round_}.{attempt} {url}"


def beat(state: StateStore, url: str, now: float) -> None:
    """Record that the server at ``url`` is alive at ``now`` (a write of its own)."""
    state.values.put(heartbeat_key(url), repr(now).encode())


_Bytes = tuple[int, int]


class ServedTraffic:
    """The bytes of the signed requests a group server at ``url`` served, by attempt,
    counted as the leader counts its own (received: head and body, on arrival; sent:
    the answer's body), and added to the store's count of each attempt inside a
    transaction the server commits anyway: a message's, or its heartbeat's.

    Counts live here until such a commit (:meth:`write`, then :meth:`written`), and
    are then in the store once: a transaction that rolls back keeps them here for the
    next, and a restarted server adds to what the one before it stored.  A server that
    dies loses what it counted since its last commit: at most a heartbeat's worth of
    fetches, refusals and answers, since every stored message writes the counts with it.
    """

    def __init__(self, url: str) -> None:
        self._url = url
        self._pending: dict[tuple[int, int], list[int]] = {}

    def count(self, attempt: tuple[int, int], received: int, sent: int) -> None:
        """Add one request's bytes (either may be 0) to ``attempt``'s."""
        counts = self._pending.setdefault(attempt, [0, 0])
        counts[0] += received
        counts[1] += sent

    def write(self, state: StateStore) -> None:
        """Add the counts not yet stored to the store's, inside the caller's
        transaction; call :meth:`written` once it committed.

        Raises:
            NotLeader: PostgreSQL: the leader changed (the caller's transaction fails).
        """
        for (round_, attempt), (received, sent) in self._pending.items():
            name = traffic_key(round_, attempt, self._url)
            before = _decode_bytes(state.values.get(name))
            after = (before[0] + received, before[1] + sent)
            state.values.put(name, msgspec.json.encode(after))

    def written(self) -> None:
        """The transaction that :meth:`write` wrote in committed: forget those counts."""
        self._pending.clear()


def stored_traffic(
    state: StateStore, round_: int, attempt: int, urls: Iterable[str]
) -> tuple[int, int]:
    """(bytes received, bytes sent) that the group servers at ``urls`` stored for the
    attempt, summed (each URL once)."""
    received = sent = 0
    for url in sorted(set(urls)):
        up, down = _decode_bytes(state.values.get(traffic_key(round_, attempt, url)))
        received, sent = received + up, sent + down
    return received, sent


def _decode_bytes(stored: bytes | None) -> _Bytes:
    return (0, 0) if stored is None else msgspec.json.decode(stored, type=_Bytes)


class StoreGroupHosts:
    """:class:`~fedsec.summation.served_group.GroupHosts` of attempt (``round_``,
    ``attempt``) over ``state``; ``clock`` reads Unix time (the servers' heartbeats are
    theirs: the processes share a host or synchronised clocks).  ``keep`` archives each
    message read (the leader's archive, which a group server on another machine does
    not write: its log entries name objects the leader then holds; idempotent).
    ``reported`` is given each privacy report a group server stored with a member's
    shares, once the leader replayed them (the leader's events, as for its own)."""

    def __init__(
        self,
        state: StateStore,
        round_: int,
        attempt: int,
        clock: Callable[[], float] = time.time,
        keep: Callable[[bytes], str] = lambda body: "",
        reported: Callable[[wire.PrivacyReport], None] = lambda report: None,
    ) -> None:
        self._state, self._round, self._attempt, self._clock = state, round_, attempt, clock
        self._keep, self._reported = keep, reported

    def stored_after(self, stage: str, seq: int) -> Sequence[tuple[int, StoredMessage]]:
        rows = list(self._state.messages.after(self._round, self._attempt, stage, seq))
        for _, _, body in rows:
            self._keep(body)
        return [(n, StoredMessage(stage, member, body)) for n, member, body in rows]

    def replayed(self, stage: str, member: str) -> None:
        if stage != "share_keys":
            return
        # stored in the share_keys message's own transaction (groups.desk): here if any
        body = self._state.reports.get(self._round, self._attempt, member)
        if body is not None:
            self._reported(msgspec.json.decode(body, type=wire.PrivacyReport))

    def now(self) -> float:
        return self._clock()

    def alive(self, url: str, last_message_at: float) -> bool:
        now = self._clock()
        if now - last_message_at <= STALE_S:
            return True
        stored = self._state.values.get(heartbeat_key(url))
        return stored is not None and now - float(stored) <= STALE_S

    def taken_over(self, group: int) -> bool:
        key = taken_over_key(self._round, self._attempt, group)
        return self._state.values.get(key) is not None

    def take_over(self, group: int) -> None:
        with self._state.transaction():
            self._state.values.put(taken_over_key(self._round, self._attempt, group), b"leader")


class GroupTakenOver(NotLeader):
    """The leader took this group over: its server may store nothing more for it (503
    not_leader: the member's client moves on to the next of its URLs, the leader's)."""


def share_store(state: StateStore, *, follower: bool) -> None:
    """Make ``state`` fit for writers in several processes: on PostgreSQL, every fenced
    transaction takes the writers' lock (each reads the log's tail inside it), and a
    group server (``follower``) writes under the leader's token without holding the
    lease.  SQLite's ``BEGIN IMMEDIATE`` orders the writers already.

    Raises:
        psycopg.Error: the database fails.
    """
    lease = lease_of(state)
    if lease is None:
        return
    if follower:
        lease.follow()
    else:
        lease.order_writers = True


def follow_again(state: StateStore) -> bool:
    """After a write refused by the fence: follow whoever leads now (a group server's
    store); whether ``state`` follows a leader (False: SQLite, or a leader's own store).

    Raises:
        psycopg.Error: the database fails.
    """
    lease = lease_of(state)
    if lease is None or not lease.following:
        return False
    lease.follow()
    return True


class GroupFence:
    """The check a group server runs inside each transaction that stores a message of
    group ``group`` of the attempt: the leader has not taken the group over."""

    def __init__(self, state: StateStore, round_: int, attempt: int, group: int) -> None:
        self._state = state
        self._key = taken_over_key(round_, attempt, group)
        self._group = group

    def check(self) -> None:
        """Raises: NotLeader: the leader took the group over; nothing may be stored
        (503 not_leader: the member's client moves on to the next of its URLs, the
        leader's)."""
        if self._state.values.get(self._key) is not None:
            raise GroupTakenOver(
                f"shard group {self._group} was taken over by the leader; send its "
                "messages to the leader's URL",
                None,
            )
