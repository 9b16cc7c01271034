"""The aggregator's state in one SQLite file: every concern's store on one connection."""

from __future__ import annotations

from pathlib import Path

from fedsec.aggregator.storage.sqlite.audit import SqliteChallenges, SqliteLog, SqliteValues
from fedsec.aggregator.storage.sqlite.connection import SqliteConnection, Transaction
from fedsec.aggregator.storage.sqlite.messages import SqliteMessages, SqliteReceipts, SqliteReports
from fedsec.aggregator.storage.sqlite.ops import SqliteAlerts, SqliteTokens, SqliteVerdicts
from fedsec.aggregator.storage.sqlite.rounds import SqliteJoins, SqliteRounds


class SqliteStateStore:
    """:class:`~fedsec.aggregator.storage.interfaces.StateStore` in SQLite (WAL).

    Args:
        path: the database file (``state.db`` of a workspace); created if absent.

    Raises:
        sqlite3.Error: the file cannot be opened or is not a database.
    """

    def __init__(self, path: Path) -> None:
        self._conn = SqliteConnection(path)
        self.rounds = SqliteRounds(self._conn)
        self.joins = SqliteJoins(self._conn)
        self.messages = SqliteMessages(self._conn)
        self.reports = SqliteReports(self._conn)
        self.receipts = SqliteReceipts(self._conn)
        self.challenges = SqliteChallenges(self._conn)
        self.log = SqliteLog(self._conn)
        self.values = SqliteValues(self._conn)
        self.alerts = SqliteAlerts(self._conn)
        self.tokens = SqliteTokens(self._conn)
        self.verdicts = SqliteVerdicts(self._conn)

    @property
    def path(self) -> Path:
        """The database file (tests and tools read it directly)."""
        return self._conn.path

    def transaction(self) -> Transaction:
        return self._conn.transaction()

    def close(self) -> None:
        self._conn.close()
