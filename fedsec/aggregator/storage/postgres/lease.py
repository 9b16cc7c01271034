"""One leader among the aggregators sharing a database: a lease with a fencing token.

The lease is one row (holder, token, expiry).  A replica takes it over only once it
has expired, and every take-over increments the token; the store then checks, first
in every transaction that writes, that the row still carries *its* token, reading it
``FOR SHARE`` so that a take-over (an ``UPDATE`` of that row) waits until the
transaction has ended.  A deposed leader that wakes up (a paused VM, a long GC, a
network partition healed) therefore cannot change anything: its token is stale, its
transaction is rolled back before it wrote, and it learns who leads now.

Why not an advisory lock: it vanishes silently with its session, so a leader whose
connection dropped and came back can believe it still leads while another does;
nothing ties its later writes to its leadership; and it does not work behind a
transaction-pooling PgBouncer.  Why the caller's clock: expiry only decides *when* a
standby may take over (liveness); safety rests on the token alone, so clock skew
between replicas can delay a take-over but never let two leaders write.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import psycopg

from fedsec.aggregator.storage.leadership import Leadership, NotLeader
from fedsec.aggregator.storage.postgres.connection import PostgresConnection

__all__ = ["LEASE_S", "TAKEOVER_WAIT_S", "LeaderLease", "LeaseKeeper", "LeaseRow", "NotLeader"]

log = logging.getLogger(__name__)

#: Lease lifetime.  A standby takes over at most this long after the leader stopped
#: renewing; 5 s keeps take-over within the 10 s target with room for detection, and a
#: leader renewing every LEASE_S / 3 survives two missed renewals.
LEASE_S: Final = 5.0
#: How long a take-over waits for the leader's open transaction before giving up this
#: try (the leader's transactions are short; a stopped leader's is ended by
#: ``idle_in_transaction_session_timeout``).
TAKEOVER_WAIT_S: Final = 1.0
#: The advisory lock that orders the writers of one database when group servers write
#: beside the leader (:meth:`LeaderLease.order_writers`): each reads the log's tail
#: inside its transaction, and two that read it together would both append after it.
WRITERS_LOCK: Final = 0x66656473_6C6F67  # "feds" "log"


@dataclass(frozen=True, slots=True)
class LeaseRow:
    """The lease as stored."""

    holder: str
    token: int
    expires_at: float
    #: The URL the holder advertised ("" before it started serving).
    url: str = ""


def default_holder() -> str:
    """A name for this process among the replicas: host and process id."""
    return f"{socket.gethostname()}:{os.getpid()}"


class LeaderLease:
    """This store's side of the lease: take it over, renew it, give it up.

    Args:
        conn: the store's connection.
        holder: this replica's name, shown to the others (:func:`default_holder`).
    """

    def __init__(self, conn: PostgresConnection, holder: str) -> None:
        self._conn = conn
        self.holder = holder
        #: Where this replica answers (:meth:`advertise`), published while it leads.
        self.url = ""
        #: The fencing token this store writes under; None until it first leads.
        self.token: int | None = None
        #: Writes refused because this store did not lead (the fencing counter).
        self.refused = 0
        # set once this store learns another took the lease over (a refused write, or
        # its keeper's renewal finding another token); cleared when it leads again
        self._deposed = threading.Event()
        self._keeper: LeaseKeeper | None = None
        # a group server writes under the leader's token without holding the lease
        self._following = False
        #: Take :data:`WRITERS_LOCK` in every fenced transaction (group servers share
        #: the database): the transactions of every process then commit one at a time.
        self.order_writers = False

    def current(self) -> LeaseRow | None:
        """The lease as stored now, or None before anyone led."""
        row = self._conn.read("SELECT holder, token, expires_at, url FROM leader_lease").fetchone()
        return LeaseRow(str(row[0]), int(row[1]), float(row[2]), str(row[3])) if row else None

    @property
    def following(self) -> bool:
        """True once :meth:`follow` was called: this store writes under another's token."""
        return self._following

    @property
    def deposed(self) -> bool:
        """True once this store learned that another replica took its lease over."""
        return self._deposed.is_set()

    def leads(self) -> bool:
        """True when the stored lease carries this store's token (expired or not)."""
        lease = self.current()
        return lease is not None and lease.token == self.token

    def check(self) -> None:
        """The fence, run first in every transaction: pass only if the lease carries this
        store's token.  ``FOR SHARE`` holds off a take-over until the transaction ends,
        so the check stays true up to its commit.

        Raises:
            NotLeader: another replica took the lease over (or none was ever taken);
                the caller rolls the transaction back before anything was written.
        """
        row = self._conn.read("SELECT holder, token, url FROM leader_lease FOR SHARE").fetchone()
        if row is not None and self.token is not None and int(row[1]) == self.token:
            if self.order_writers:
                self._conn.read("SELECT pg_advisory_xact_lock(%s)", (WRITERS_LOCK,))
            return
        self.refused += 1
        leader = str(row[0]) if row is not None else None
        url = (str(row[2]) or None) if row is not None else None
        log.warning(
            "fenced write refused holder=%s token=%s leader=%s leader_token=%s refused=%d",
            self.holder,
            self.token,
            leader,
            row[1] if row is not None else None,
            self.refused,
        )
        if row is None:
            raise NotLeader("not leader: no aggregator holds the leader lease", None)
        if self.token is None:
            raise NotLeader(
                f"not leader: {self.holder} is a standby; {_naming(leader, url)} leads with "
                f"token {row[1]}",
                leader,
                url,
            )
        self._deposed.set()
        raise NotLeader(
            f"not leader: {self.holder} was deposed (its fencing token {self.token} is stale); "
            f"{_naming(leader, url)} leads with token {row[1]}",
            leader,
            url,
        )

    def follow(self) -> int | None:
        """Write under the token of whoever leads now, without taking the lease: what a
        group server (:mod:`fedsec.aggregator.groups`) does, so that its writes pass
        the fence while that leader leads and are refused once another took over (it
        then follows again).  Its writes are ordered with the leader's
        (:attr:`order_writers`).  A follower never renews nor releases the lease.

        Returns:
            The token followed, None when nobody leads.

        Raises:
            psycopg.Error: the database fails.
        """
        lease = self.current()
        self._following, self.order_writers = True, True
        self.token = None if lease is None else lease.token
        self._deposed.clear()
        return self.token

    def leadership(self) -> Leadership:
        """This store's role: ``leader`` while it holds a token (the fence still checks
        it at every write), else ``standby`` with the holder read from the database.

        Raises:
            psycopg.Error: the database fails (a standby only).
        """
        if self.token is not None and not self.deposed:
            return Leadership("leader", self.token, self.holder, self.url or None)
        lease = self.current()
        if lease is None:
            return Leadership("standby")
        return Leadership("standby", None, lease.holder, lease.url or None)

    def standby_refusal(self) -> NotLeader | None:
        """The refusal of a write to a standby, decided before it reaches the fence (so
        nothing of the request is consumed: not its nonce, not a round's intake); None
        while this store holds a token.

        Raises:
            psycopg.Error: the database fails.
        """
        if self.token is not None and not self.deposed:
            return None
        lease = self.current()
        if lease is None:
            return NotLeader("not leader: no aggregator holds the leader lease", None)
        url = lease.url or None
        return NotLeader(
            f"not leader: {self.holder} is a standby; {_naming(lease.holder, url)} leads "
            f"with token {lease.token}",
            lease.holder,
            url,
        )

    def advertise(self, url: str) -> None:
        """Answer at ``url`` from now on: published in the lease row now if this store
        leads, and at each later take-over.

        Raises:
            psycopg.Error: the database fails.
        """
        self.url = url
        if self.token is not None and not self._conn.in_transaction():
            self._conn.read("UPDATE leader_lease SET url = %s WHERE token = %s", (url, self.token))

    def acquire(self, now: float, ttl_s: float = LEASE_S) -> bool:
        """Lead from ``now`` for ``ttl_s``: renew the lease if this store holds it,
        else take it over if it is absent or expired (with a new token).

        Returns:
            True when this store leads now.

        Raises:
            RuntimeError: called inside a transaction (the lease is its own commit).
            psycopg.Error: the database fails.
        """
        if self.token is not None and self.renew(now, ttl_s):
            return True
        if self._conn.in_transaction():
            raise RuntimeError("the lease is taken outside any transaction")
        db = self._conn.usable()
        try:
            with db.transaction():
                db.execute(f"SET LOCAL lock_timeout = '{int(TAKEOVER_WAIT_S * 1000)}ms'")
                row = db.execute(
                    "INSERT INTO leader_lease (id, holder, token, expires_at, url) "
                    "VALUES (1, %s, 1, %s, %s) ON CONFLICT (id) DO UPDATE "
                    "SET holder = excluded.holder, token = leader_lease.token + 1, "
                    "expires_at = excluded.expires_at, url = excluded.url "
                    "WHERE leader_lease.expires_at <= %s RETURNING token",
                    (self.holder, now + ttl_s, self.url, now),
                ).fetchone()
        except psycopg.errors.LockNotAvailable:
            # the leader is inside a transaction: try again at the next poll, having
            # ended it if its lease has expired (a paused leader holds its lock for good)
            self._end_expired_transactions(now)
            return False
        if row is None:
            return False
        self.token = int(row[0])
        self._deposed.clear()
        log.info("leader lease taken holder=%s token=%d", self.holder, self.token)
        return True

    def _end_expired_transactions(self, now: float) -> None:
        """End the idle transactions of a holder whose lease expired by ``now``: they
        hold the lease row ``FOR SHARE``, so a holder stopped between two statements
        (SIGSTOP, a paused VM) would hold every take-over off until
        ``idle_in_transaction_session_timeout``.  Nothing of such a transaction was
        committed or acknowledged; the server rolls it back.  Sessions are found by
        ``application_name``, the holder's name (same role: no extra privilege).

        Raises:
            psycopg.Error: the database fails.
        """
        lease = self.current()  # a plain read does not wait on the row lock
        if lease is None or lease.expires_at > now or lease.holder == self.holder:
            return
        ended = self._conn.read(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = %s AND datname = current_database() "
            "AND state IN ('idle in transaction', 'idle in transaction (aborted)')",
            (lease.holder,),
        ).fetchone()
        log.warning(
            "event=expired_leader_transaction_ended holder=%s token=%d sessions=%s",
            lease.holder,
            lease.token,
            ended[0] if ended else 0,
        )

    def take_over(self, now: float) -> bool:
        """:meth:`acquire`, then :meth:`keep` once this store leads (a standby's poll).

        Raises:
            RuntimeError: called inside a transaction.
            psycopg.Error: the database fails.
        """
        if not self.acquire(now):
            return False
        self.keep()
        return True

    def renew(self, now: float, ttl_s: float = LEASE_S) -> bool:
        """Extend the lease to ``now + ttl_s`` if this store still holds it.

        Returns:
            False when another replica has taken it over (this store is deposed).

        Raises:
            psycopg.Error: the database fails.
        """
        if self.token is None:
            return False
        row = self._conn.read(
            "UPDATE leader_lease SET expires_at = %s WHERE token = %s RETURNING token",
            (now + ttl_s, self.token),
        ).fetchone()
        return row is not None

    def release(self) -> None:
        """Let a standby take over at once (a clean stop), if this store still leads.

        Raises:
            psycopg.Error: the database fails.
        """
        self.stop_keeping()
        if self._following:
            return  # the token is the leader's: expiring it would depose the leader
        if self.token is not None and not self._conn.in_transaction():
            self._conn.read(
                "UPDATE leader_lease SET expires_at = '-Infinity' WHERE token = %s", (self.token,)
            )

    def keep(self, ttl_s: float = LEASE_S) -> None:
        """Renew the lease every ``ttl_s / 3`` from a background thread, on a connection of
        its own, for as long as this process runs and reaches the database: a leader
        waiting on its members between stages writes nothing, yet must go on leading.
        The thread stops when the store is deposed or :meth:`release` is called; a
        stopped process (SIGSTOP, SIGKILL) stops renewing, so a standby takes over.

        Raises:
            RuntimeError: this store does not lead.
        """
        if self.token is None:
            raise RuntimeError("only the leader keeps the lease")
        self.stop_keeping()
        self._keeper = LeaseKeeper(
            self._conn.url, self.holder, self.token, ttl_s, on_lost=self._deposed.set
        )
        self._keeper.start()

    def stop_keeping(self) -> None:
        """Stop renewing (the lease then expires after at most its ``ttl_s``)."""
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.stop()


def _naming(holder: str | None, url: str | None) -> str:
    """The leader as a refusal names it: its URL when it advertised one."""
    return f"{holder} at {url}" if url else str(holder)


class LeaseKeeper(threading.Thread):
    """The thread :meth:`LeaderLease.keep` runs: one renewal every ``ttl_s / 3``, so two
    may fail (a slow database, a dropped connection) before the lease expires."""

    def __init__(
        self,
        url: str,
        holder: str,
        token: int,
        ttl_s: float,
        on_lost: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(name=f"lease-keeper-{token}", daemon=True)
        self._url, self._holder, self._token, self._ttl_s = url, holder, token, ttl_s
        self._on_lost = on_lost
        self._stopping = threading.Event()

    def stop(self) -> None:
        """Stop renewing; wait (at most ``ttl_s``) for a renewal in flight, so none lands
        after a :meth:`LeaderLease.release`."""
        self._stopping.set()
        if self is not threading.current_thread() and self.is_alive():
            self.join(timeout=self._ttl_s)

    def run(self) -> None:
        db: psycopg.Connection[tuple[Any, ...]] | None = None
        try:
            while not self._stopping.wait(self._ttl_s / 3):
                try:
                    if db is None or db.broken:
                        db = psycopg.connect(self._url, autocommit=True, connect_timeout=2)
                    row = db.execute(
                        "UPDATE leader_lease SET expires_at = %s WHERE token = %s RETURNING token",
                        (time.time() + self._ttl_s, self._token),
                    ).fetchone()
                except psycopg.Error as exc:
                    log.warning("lease renewal failed holder=%s error=%s", self._holder, exc)
                    continue
                if row is None:
                    log.warning(
                        "leader lease lost holder=%s token=%d: another replica took it over",
                        self._holder,
                        self._token,
                    )
                    self._on_lost()
                    return
        finally:
            if db is not None:
                db.close()
