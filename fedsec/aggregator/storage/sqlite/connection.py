"""The SQLite database file: its schema, its pragmas and its transactions.

One connection, used from the aggregator's event-loop thread only, in autocommit mode
(``isolation_level=None``): a write outside :meth:`SqliteConnection.transaction` is
committed by itself, and a transaction is an explicit ``BEGIN IMMEDIATE`` ... ``COMMIT``.
The schema is the one every release so far has written; ``CREATE TABLE IF NOT EXISTS``
lets an aggregator open an older workspace's ``state.db`` as it is.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

from fedsec.aggregator.storage.sql.db import Params, Row

#: (table, column, definition) of each column added to a table after its first release.
_ADDED_COLUMNS = (("joins", "graph_commitment", "TEXT NOT NULL DEFAULT ''"),)

SCHEMA = """
CREATE TABLE IF NOT EXISTS rounds (
    round INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    stage TEXT NOT NULL,
    spec BLOB,
    opened_at REAL NOT NULL,
    stage_started_at REAL NOT NULL,
    closed_at REAL,
    model_version INTEGER,
    summary BLOB,
    detail TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (round, attempt)
);
CREATE TABLE IF NOT EXISTS joins (
    round INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    member TEXT NOT NULL,
    samples INTEGER NOT NULL,
    joined_at REAL NOT NULL,
    base_version INTEGER,
    graph_commitment TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (round, attempt, member)
);
CREATE TABLE IF NOT EXISTS messages (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    round INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    stage TEXT NOT NULL,
    member TEXT NOT NULL,
    body BLOB NOT NULL,
    received_at REAL NOT NULL,
    UNIQUE (round, attempt, stage, member)
);
CREATE TABLE IF NOT EXISTS reports (
    round INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    member TEXT NOT NULL,
    epsilon REAL NOT NULL,
    body BLOB NOT NULL,
    PRIMARY KEY (round, attempt, member)
);
CREATE TABLE IF NOT EXISTS receipts (
    round INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    member TEXT NOT NULL,
    body BLOB NOT NULL,
    PRIMARY KEY (round, attempt, member)
);
CREATE TABLE IF NOT EXISTS log (
    idx INTEGER PRIMARY KEY,
    line BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS challenges (
    round INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    member TEXT NOT NULL,
    auditor TEXT NOT NULL,
    body BLOB NOT NULL,
    PRIMARY KEY (round, attempt, member, auditor)
);
CREATE TABLE IF NOT EXISTS reveals (
    round INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    member TEXT NOT NULL,
    auditor TEXT NOT NULL,
    body BLOB NOT NULL,
    PRIMARY KEY (round, attempt, member, auditor)
);
CREATE TABLE IF NOT EXISTS server_state (
    name TEXT PRIMARY KEY,
    value BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS alerts (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,
    subject TEXT NOT NULL,
    detail TEXT NOT NULL,
    raised_at REAL NOT NULL,
    acked_at REAL,
    acked_by TEXT,
    ack_sha256 TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS alerts_open ON alerts (kind, subject) WHERE acked_at IS NULL;
CREATE TABLE IF NOT EXISTS access_tokens (
    sha256 TEXT PRIMARY KEY,
    observer TEXT NOT NULL,
    scope TEXT NOT NULL,
    issued_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    revoked INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS audit_verdicts (
    round INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    member TEXT NOT NULL,
    auditor TEXT NOT NULL,
    passed INTEGER NOT NULL,
    failed TEXT NOT NULL,
    received_at REAL NOT NULL,
    PRIMARY KEY (round, attempt, member, auditor)
);
"""


class SqliteConnection:
    """The open database: what every table's store shares, as the
    :class:`~fedsec.aggregator.storage.sql.db.SqlDb` the shared repositories use
    (SQLite takes their ``?`` placeholders and their SQL as they are).

    Args:
        path: the database file (created with the schema if absent).

    Raises:
        sqlite3.Error: the file cannot be opened or is not a database.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        # FULL: a commit is on disk before we acknowledge; NORMAL could lose the last
        # transactions on power loss, which would break "durable before acknowledged".
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("PRAGMA foreign_keys=ON")
        self.db.executescript(SCHEMA)
        self._add_missing_columns()
        self._after_commit: list[Callable[[], None]] = []

    def _add_missing_columns(self) -> None:
        """Columns added after a table was first created: a workspace made before them
        gets them, with their default, the first time it is opened."""
        for table, column, definition in _ADDED_COLUMNS:
            have = {row[1] for row in self.db.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                self.db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")

    def close(self) -> None:
        self.db.close()

    def in_transaction(self) -> bool:
        return self.db.in_transaction

    def on_commit(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` after every commit of an explicit transaction."""
        self._after_commit.append(callback)

    def transaction(self) -> Transaction:
        """``with connection.transaction(): ...`` groups writes into one atomic commit."""
        return Transaction(self.db, self._after_commit)

    def read(self, sql: str, params: Params = ()) -> Iterator[Row]:
        return self.db.execute(sql, params)

    def read_one(self, sql: str, params: Params = ()) -> Row | None:
        row: Row | None = self.db.execute(sql, params).fetchone()
        return row

    def write(self, sql: str, params: Params = ()) -> int:
        """Run a statement that changes state: inside the current transaction, or
        committed by itself (autocommit); the number of rows it changed.

        Raises:
            sqlite3.Error: the statement fails (a constraint, a full disk).
        """
        return self.db.execute(sql, params).rowcount

    def insert(self, sql: str, params: Params, key: str) -> int:
        """Run an ``INSERT`` as :meth:`write`; its row's ``INTEGER PRIMARY KEY``
        (``key`` names it; SQLite knows it as the rowid).

        Raises:
            sqlite3.Error: as for :meth:`write`.
        """
        rowid = self.db.execute(sql, params).lastrowid
        assert rowid is not None  # an INSERT of one row sets it
        return rowid


class Transaction:
    """An explicit transaction; entered inside another, it joins that one."""

    def __init__(self, db: sqlite3.Connection, after: list[Callable[[], None]]) -> None:
        self._db = db
        self._after = after
        self._outer = False

    def __enter__(self) -> None:
        self._outer = not self._db.in_transaction
        if self._outer:
            self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if not self._outer:
            return
        if exc_type is None:
            self._db.execute("COMMIT")
            for callback in self._after:
                callback()
        else:
            self._db.execute("ROLLBACK")
