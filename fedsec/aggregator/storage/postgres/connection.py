"""The PostgreSQL connection: its settings, its migrations and its transactions.

One connection, used from the aggregator's event-loop thread only, the way the SQLite
store uses one: the round engine's transactions span several calls, so they need one
connection for their whole life, and a single-threaded caller gains nothing from a
pool.  The connection is in autocommit mode: a write outside
:meth:`PostgresConnection.transaction` runs in a transaction of its own, and a
transaction is an explicit ``BEGIN`` ... ``COMMIT``; a nested one joins the outer.

PostgreSQL commits are durable when ``COMMIT`` returns (``synchronous_commit`` on, the
server default, which a deployment must not turn off; see docs/deployment.md), so
"durable before acknowledged" holds as it does with SQLite's ``synchronous=FULL``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Final

import psycopg
from psycopg.pq import TransactionStatus

from fedsec.aggregator.storage.leadership import StateUnavailable
from fedsec.aggregator.storage.postgres.schema import migrate

#: How long a transaction may sit idle before the server ends it.  The round engine
#: never waits on the network inside a transaction, so only a stopped process (SIGSTOP,
#: a VM paused) reaches this; then its locks must not block the other replicas for
#: long.  60 s leaves room for the heaviest CPU step between two statements.
IDLE_IN_TRANSACTION_S: Final = 60

#: How often a lost database is reported in the log: every request meets the break
#: while it lasts, and one line with the driver's reason every 10 s says enough.
UNAVAILABLE_LOG_EVERY_S: Final = 10.0

Params = tuple[Any, ...]

_OPEN = (TransactionStatus.ACTIVE, TransactionStatus.INTRANS, TransactionStatus.INERROR)

log = logging.getLogger(__name__)


class PostgresUnavailable(StateUnavailable, psycopg.OperationalError):
    """The database cannot be reached: answered ``503 state_unavailable`` by the HTTP
    layer, and still the driver's ``OperationalError`` for code that handles those."""


_last_report = [float("-inf")]


@contextmanager
def reaching(connection: Callable[[], psycopg.Connection[Any]]) -> Iterator[None]:
    """Turn an error that broke ``connection()`` (or failed to open it anew) into
    :class:`PostgresUnavailable`; a statement's own error (a lock timeout, a constraint)
    leaves the connection usable and passes unchanged.

    Raises:
        PostgresUnavailable: the database cannot be reached.
    """
    try:
        yield
    except PostgresUnavailable:
        raise
    except psycopg.OperationalError as exc:
        if not connection().broken:
            raise
        now = time.monotonic()
        if now - _last_report[0] >= UNAVAILABLE_LOG_EVERY_S:
            _last_report[0] = now
            # libpq's messages name host and port, never the password
            log.warning("event=state_unavailable error=%s", str(exc).splitlines()[0])
        raise PostgresUnavailable(
            "the aggregator cannot reach its state database; retry later or ask another "
            "aggregator replica"
        ) from exc


class PostgresConnection:
    """The open database: what every table's store shares.

    Args:
        url: a libpq connection string or ``postgresql://`` URL.
        name: the session's ``application_name`` (the lease holder's name, so a
            take-over can find the sessions of a leader whose lease expired).

    Raises:
        psycopg.Error: the server cannot be reached, refuses the login, or a migration
            fails.
        ValueError: the database's schema is newer than this release.
    """

    def __init__(self, url: str, name: str = "fedsec") -> None:
        self._url = url
        self._name = name
        self.db = self._connect()
        self._after_commit: list[Callable[[], None]] = []
        self._at_begin: list[Callable[[], None]] = []

    def _connect(self) -> psycopg.Connection[tuple[Any, ...]]:
        db: psycopg.Connection[tuple[Any, ...]] = psycopg.connect(
            self._url, autocommit=True, application_name=self._name
        )
        db.execute(f"SET idle_in_transaction_session_timeout = '{IDLE_IN_TRANSACTION_S}s'")
        migrate(db)
        return db

    @property
    def url(self) -> str:
        """The URL this connection was opened with (a lease keeper opens its own)."""
        return self._url

    def usable(self) -> psycopg.Connection[tuple[Any, ...]]:
        """The connection, opened anew if the last one broke (a server restart, a
        database failover, a network drop).  Only between transactions: the call that
        met the break has already failed, and the server rolled its transaction back,
        so nothing acknowledged is lost and the lease token still decides.

        Raises:
            PostgresUnavailable: the server cannot be reached.
        """
        if self.db.broken:
            with reaching(lambda: self.db):
                self.db = self._connect()
            log.info("event=state_reconnected")
        return self.db

    def close(self) -> None:
        self.db.close()

    def in_transaction(self) -> bool:
        # a broken connection's transaction is gone: the server rolled it back
        return self.db.info.transaction_status in _OPEN

    def on_commit(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` after every commit of an explicit transaction."""
        self._after_commit.append(callback)

    def forget_commit_callbacks(self) -> None:
        """Drop every :meth:`on_commit` callback (their owner is being replaced)."""
        self._after_commit.clear()

    def at_begin(self, check: Callable[[], None]) -> None:
        """Run ``check`` first in every outermost transaction; what it raises rolls the
        transaction back before anything is written (the lease's fencing check)."""
        self._at_begin.append(check)

    def transaction(self) -> Transaction:
        """``with connection.transaction(): ...`` groups writes into one atomic commit."""
        return Transaction(self)

    def read(self, sql: str, params: Params = ()) -> psycopg.Cursor[tuple[Any, ...]]:
        """Run a query (inside the current transaction, if any).

        Raises:
            PostgresUnavailable: the server cannot be reached.
            psycopg.Error: the query fails.
        """
        db = self.db if self.in_transaction() else self.usable()
        with reaching(lambda: db):
            return db.execute(sql, params)

    def count(self, sql: str, params: Params = ()) -> int:
        """The integer a ``SELECT COUNT(*)`` query returns."""
        row = self.read(sql, params).fetchone()
        assert row is not None  # an aggregate without GROUP BY returns one row
        return int(row[0])

    def write(self, sql: str, params: Params = ()) -> psycopg.Cursor[tuple[Any, ...]]:
        """Run a statement that changes state: inside the current transaction, or in a
        transaction of its own (committed before this returns).

        Raises:
            NotLeader: the lease's fence refused a write outside a transaction.
            PostgresUnavailable: the server cannot be reached.
            psycopg.Error: the statement fails.
        """
        if self.in_transaction():
            with reaching(lambda: self.db):
                return self.db.execute(sql, params)
        # a write on its own is not an explicit transaction: no commit callbacks
        with Transaction(self, explicit=False), reaching(lambda: self.db):
            return self.db.execute(sql, params)


class Transaction:
    """A transaction; entered inside another, it joins that one.  ``explicit``: the
    caller's (:meth:`PostgresConnection.transaction`), whose commit runs the
    :meth:`~PostgresConnection.on_commit` callbacks; a lone write's is not."""

    def __init__(self, conn: PostgresConnection, *, explicit: bool = True) -> None:
        self._conn = conn
        self._explicit = explicit
        self._outer = False

    def __enter__(self) -> None:
        self._outer = not self._conn.in_transaction()
        if not self._outer:
            return
        db = self._conn.usable()
        with reaching(lambda: db):
            db.execute("BEGIN")
        try:
            for check in self._conn._at_begin:
                check()
        except BaseException:
            if not db.broken:
                db.execute("ROLLBACK")
            raise

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if not self._outer:
            return
        if exc_type is None:
            with reaching(lambda: self._conn.db):
                self._conn.db.execute("COMMIT")
            for callback in self._conn._after_commit if self._explicit else ():
                callback()
        elif not self._conn.db.broken:  # a broken one's transaction is already gone
            self._conn.db.execute("ROLLBACK")
