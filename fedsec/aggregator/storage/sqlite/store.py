"""The aggregator's state in one SQLite file: every concern's shared SQL
store (:mod:`fedsec.aggregator.storage.sql`) on one connection."""

from __future__ import annotations

from pathlib import Path

from fedsec.aggregator.storage.sql.audit import SqlChallenges, SqlLog, SqlValues
from fedsec.aggregator.storage.sql.messages import SqlMessages, SqlReceipts, SqlReports
from fedsec.aggregator.storage.sql.ops import SqlAlerts, SqlTokens, SqlVerdicts
from fedsec.aggregator.storage.sql.rounds import SqlJoins, SqlRounds
from fedsec.aggregator.storage.sqlite.connection import SqliteConnection, Transaction


class SqliteStateStore:
    """:class:`~fedsec.aggregator.storage.interfaces.StateStore` in SQLite (WAL).

    Args:
        path: the database file (``state.db`` of a workspace); created if absent.

    Raises:
        sqlite3.Error: the file cannot be opened or is not a database.
    """

    def __init__(self, path: Path) -> None:
        self._conn = SqliteConnection(path)
        self.rounds = SqlRounds(self._conn)
        self.joins = SqlJoins(self._conn)
        self.messages = SqlMessages(self._conn)
        self.reports = SqlReports(self._conn)
        self.receipts = SqlReceipts(self._conn)
        self.challenges = SqlChallenges(self._conn)
        self.log = SqlLog(self._conn)
        self.values = SqlValues(self._conn)
        self.alerts = SqlAlerts(self._conn)
        self.tokens = SqlTokens(self._conn)
        self.verdicts = SqlVerdicts(self._conn)

    @property
    def path(self) -> Path:
        """The database file (tests and tools read it directly)."""
        return self._conn.path

    def transaction(self) -> Transaction:
        return self._conn.transaction()

    def close(self) -> None:
        self._conn.close()
