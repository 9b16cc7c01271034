"""Which part this aggregator process plays among replicas sharing one database.

Kept free of any database driver, so the HTTP layer and the round logic can tell a
leader from a standby (and refuse a standby's writes) without knowing which store runs:
an embedded SQLite store is ``single``, a PostgreSQL store leads or stands by according
to its lease (:mod:`fedsec.aggregator.storage.postgres.lease`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from fedsec.errors import RetryLater
from fedsec.protocol.wire import NOT_LEADER

#: ``single``: the only aggregator (SQLite); ``leader``: holds the lease of a shared
#: database; ``standby``: does not, and refuses every write.
Role = Literal["leader", "standby", "single"]


@dataclass(frozen=True, slots=True)
class Leadership:
    """This process's role, as last known.

    Attributes:
        role: see :data:`Role`.
        token: this process's fencing token while it leads, else None.
        leader: the lease holder's name (host:pid), None when nobody ever led.
        leader_url: the URL the holder advertised, None when it advertised none.
    """

    role: Role
    token: int | None = None
    leader: str | None = None
    leader_url: str | None = None


SINGLE: Leadership = Leadership("single")


class NotLeader(RetryLater):
    """This aggregator does not hold the leader lease (a standby, or deposed): it may
    not write.  ``leader`` names the current holder, ``leader_url`` the URL it
    advertised (where the same request, signed anew or not, should go)."""

    code = NOT_LEADER
    http_status = 503

    def __init__(self, detail: str, leader: str | None, leader_url: str | None = None) -> None:
        super().__init__(detail)
        self.leader = leader
        self.leader_url = leader_url


class StateUnavailable(RetryLater):
    """This aggregator cannot reach its state database now (the network to it is down,
    the database restarts or fails over): it can neither serve the request nor say who
    leads, so the caller retries later or tries another replica.  Nothing of the
    request was kept: a transaction the break met was rolled back by the server."""

    code = "state_unavailable"
    http_status = 503


@runtime_checkable
class Leased(Protocol):
    """A lease as the serve layer uses it (the PostgreSQL store's ``lease``)."""

    #: This process's fencing token once it took the lease, None on a standby (a
    #: deposed leader keeps its stale one: the database's fence refuses it).
    token: int | None
    #: Writes the fence refused this process (the fencing counter).
    refused: int
    #: Every fenced transaction takes the writers' lock: set where group servers
    #: (:mod:`fedsec.aggregator.groups`) write beside the leader, each reading the
    #: log's tail inside its own transaction.
    order_writers: bool

    @property
    def deposed(self) -> bool:
        """True once this process learned another replica took its lease over."""
        ...

    def leadership(self) -> Leadership:
        """The role now: a standby reads the holder and its URL from the database.

        Raises:
            Exception: the database fails (the driver's error).
        """
        ...

    def take_over(self, now: float) -> bool:
        """Take the lease if it is free or expired, and keep renewing it from then on.

        Returns:
            True when this process leads now.

        Raises:
            Exception: the database fails (the driver's error).
        """
        ...

    @property
    def following(self) -> bool:
        """True once :meth:`follow` was called: this process writes under another's token."""
        ...

    def follow(self) -> int | None:
        """Write under the token of whoever leads now without taking the lease (a group
        server), writes ordered with the leader's; never renew nor release it.

        Returns:
            The token followed, None when nobody leads.

        Raises:
            Exception: the database fails (the driver's error).
        """
        ...

    def advertise(self, url: str) -> None:
        """Record ``url`` as where this process answers, published in the lease while
        it leads so standbys can name it.

        Raises:
            Exception: the database fails (the driver's error).
        """
        ...

    def standby_refusal(self) -> NotLeader | None:
        """The refusal a write gets from this process without reaching the database's
        fence: None while this process leads (or believes it does: the fence then
        decides), else :class:`NotLeader` naming the leader and its URL."""
        ...


@runtime_checkable
class Replaceable(Protocol):
    """A shared store whose coordinator a take-over replaces (the PostgreSQL store)."""

    def forget_commit_callbacks(self) -> None:
        """Drop the replaced coordinator's after-commit callbacks."""
        ...


def lease_of(state: object) -> Leased | None:
    """The lease of a state store, None for a store that is alone (SQLite)."""
    lease = getattr(state, "lease", None)
    if lease is None:  # first: the runtime Protocol check costs ~60 µs, on every request
        return None
    return lease if isinstance(lease, Leased) else None


def leadership_of(state: object) -> Leadership:
    """The role of the process owning ``state`` (:data:`SINGLE` without a lease).

    Raises:
        Exception: the database fails (the driver's error).
    """
    lease = lease_of(state)
    return SINGLE if lease is None else lease.leadership()


@dataclass(frozen=True, slots=True)
class LocalRole:
    """This process's role as it knows it, without asking the database (what health
    probes and scrapes report, so they stay cheap and answer while the database is
    away).  A deposed leader reports ``leader`` with its stale token until it notices
    (its next write, or its keeper's next renewal, at most a third of the lease later);
    the fence refuses its writes all the same, and ``fenced`` counts them."""

    role: Role
    token: int | None = None
    fenced: int = 0


def local_role(state: object) -> LocalRole:
    """:class:`LocalRole` of the process owning ``state`` (``single`` without a lease)."""
    lease = lease_of(state)
    if lease is None:
        return LocalRole("single")
    if lease.token is None or lease.deposed:
        return LocalRole("standby", None, lease.refused)
    return LocalRole("leader", lease.token, lease.refused)
