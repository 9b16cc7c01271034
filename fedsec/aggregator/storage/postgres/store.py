"""The aggregator's state in a PostgreSQL database: every concern's shared SQL store
(:mod:`fedsec.aggregator.storage.sql`) on one connection."""

from __future__ import annotations

import psycopg

from fedsec.aggregator.storage.postgres.connection import PostgresConnection, Transaction
from fedsec.aggregator.storage.postgres.lease import LeaderLease, default_holder
from fedsec.aggregator.storage.postgres.sql_db import PostgresSqlDb
from fedsec.aggregator.storage.sql.audit import SqlChallenges, SqlLog, SqlValues
from fedsec.aggregator.storage.sql.messages import SqlMessages, SqlReceipts, SqlReports
from fedsec.aggregator.storage.sql.ops import SqlAlerts, SqlTokens, SqlVerdicts
from fedsec.aggregator.storage.sql.rounds import SqlJoins, SqlRounds


class PostgresStateStore:
    """:class:`~fedsec.aggregator.storage.interfaces.StateStore` in PostgreSQL.

    Opening it migrates the database to this release's schema
    (:mod:`~fedsec.aggregator.storage.postgres.schema`).

    Several aggregators may open one database; the one holding :attr:`lease` leads, and
    every write of the others is refused with
    :class:`~fedsec.aggregator.storage.postgres.lease.NotLeader` (the fence).  Opening
    does not take the lease: call ``lease.acquire``.

    Args:
        url: a ``postgresql://`` URL (its password better in libpq's PGPASSFILE).
        holder: this replica's name in the lease (default: host and process id).

    Raises:
        psycopg.Error: the server cannot be reached, refuses the login, or a migration
            fails.
        ValueError: the database's schema is newer than this release.
    """

    def __init__(self, url: str, holder: str | None = None) -> None:
        name = holder or default_holder()
        self._conn = PostgresConnection(url, name)
        self.lease = LeaderLease(self._conn, name)
        # every write is conditional on this store's token, in its own transaction
        self._conn.at_begin(self.lease.check)
        db = PostgresSqlDb(self._conn)
        self.rounds = SqlRounds(db)
        self.joins = SqlJoins(db)
        self.messages = SqlMessages(db)
        self.reports = SqlReports(db)
        self.receipts = SqlReceipts(db)
        self.challenges = SqlChallenges(db)
        self.log = SqlLog(db)
        self.values = SqlValues(db)
        self.alerts = SqlAlerts(db)
        self.tokens = SqlTokens(db)
        self.verdicts = SqlVerdicts(db)

    def transaction(self) -> Transaction:
        return self._conn.transaction()

    def forget_commit_callbacks(self) -> None:
        """Drop what the coordinator built on this store registered to run after each
        commit (its audit trail's file sync): at a take-over a new coordinator replaces
        it, and the old one's sync would append, from the count it knew as a standby,
        lines the file already holds."""
        self._conn.forget_commit_callbacks()

    def close(self) -> None:
        """Give the lease up (a standby may take over at once) and close the connection."""
        try:
            self.lease.release()
        except psycopg.Error:
            pass  # the connection is gone: the lease expires by itself
        finally:
            self._conn.close()
