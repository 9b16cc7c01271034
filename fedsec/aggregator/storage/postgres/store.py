"""The aggregator's state in a PostgreSQL database: every concern's store on one
connection."""

from __future__ import annotations

from fedsec.aggregator.storage.postgres.audit import (
    PostgresChallenges,
    PostgresLog,
    PostgresValues,
)
from fedsec.aggregator.storage.postgres.connection import PostgresConnection, Transaction
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

    Args:
        url: a ``postgresql://`` URL (its password better in libpq's PGPASSFILE).

    Raises:
        psycopg.Error: the server cannot be reached, refuses the login, or a migration
            fails.
        ValueError: the database's schema is newer than this release.
    """

    def __init__(self, url: str) -> None:
        self._conn = PostgresConnection(url)
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
        self._conn.close()
