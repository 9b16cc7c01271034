"""The aggregator's state in a PostgreSQL database: every concern's store on one
connection."""

from __future__ import annotations

import psycopg

from fedsec.aggregator.storage.postgres.audit import (
    PostgresChallenges,
    PostgresLog,
    PostgresValues,
)
from fedsec.aggregator.storage.postgres.connection import PostgresConnection, Transaction
from fedsec.aggregator.storage.postgres.lease import LeaderLease, default_holder
from fedsec.aggregator.storage.postgres.messages import (
    PostgresMessages,
    PostgresReceipts,
    PostgresReports,
)
from fedsec.aggregator.storage.postgres.ops import PostgresAlerts, PostgresTokens, PostgresVerdicts
from fedsec.aggregator.storage.postgres.rounds import PostgresJoins, PostgresRounds


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
        self._conn = PostgresConnection(url)
        self.lease = LeaderLease(self._conn, holder or default_holder())
        # every write is conditional on this store's token, in its own transaction
        self._conn.at_begin(self.lease.check)
        self.rounds = PostgresRounds(self._conn)
        self.joins = PostgresJoins(self._conn)
        self.messages = PostgresMessages(self._conn)
        self.reports = PostgresReports(self._conn)
        self.receipts = PostgresReceipts(self._conn)
        self.challenges = PostgresChallenges(self._conn)
        self.log = PostgresLog(self._conn)
        self.values = PostgresValues(self._conn)
        self.alerts = PostgresAlerts(self._conn)
        self.tokens = PostgresTokens(self._conn)
        self.verdicts = PostgresVerdicts(self._conn)

    def transaction(self) -> Transaction:
        return self._conn.transaction()

    def close(self) -> None:
        """Give the lease up (a standby may take over at once) and close the connection."""
        try:
            self.lease.release()
        except psycopg.Error:
            pass  # the connection is gone: the lease expires by itself
        finally:
            self._conn.close()
