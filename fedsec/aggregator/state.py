"""Durable aggregator state in SQLite (WAL): rounds, joins, accepted messages, receipts.

Every accepted protocol message is committed here before the request is
acknowledged (``synchronous=FULL``), and a restarted aggregator rebuilds the
round it was in by replaying these rows (see ``Coordinator.resume``).  One
connection, used from the aggregator's event-loop thread only.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

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
"""


@dataclass(frozen=True, slots=True)
class RoundRow:
    round: int
    attempt: int
    stage: str
    spec: bytes | None
    opened_at: float
    stage_started_at: float
    closed_at: float | None
    model_version: int | None
    summary: bytes | None
    detail: str


class StateStore:
    """The aggregator's SQLite database."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        # FULL: a commit is on disk before we acknowledge; NORMAL could lose the last
        # transactions on power loss, which would break "durable before acknowledged".
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(SCHEMA)
        self._after_commit: list[Callable[[], None]] = []

    def close(self) -> None:
        self._db.close()

    def _tx(self) -> sqlite3.Connection:
        return self._db

    # -- rounds ------------------------------------------------------------------------------

    def latest_round(self) -> RoundRow | None:
        row = self._db.execute(
            "SELECT * FROM rounds ORDER BY round DESC, attempt DESC LIMIT 1"
        ).fetchone()
        return RoundRow(*row) if row else None

    def get_round(self, round_: int, attempt: int) -> RoundRow | None:
        row = self._db.execute(
            "SELECT * FROM rounds WHERE round=? AND attempt=?", (round_, attempt)
        ).fetchone()
        return RoundRow(*row) if row else None

    def rounds(self, limit: int = 1000) -> list[RoundRow]:
        rows = self._db.execute(
            "SELECT * FROM rounds ORDER BY round DESC, attempt DESC LIMIT ?", (limit,)
        ).fetchall()
        return [RoundRow(*r) for r in reversed(rows)]

    def open_round(self, round_: int, attempt: int, now: float) -> None:
        self._db.execute(
            "INSERT INTO rounds (round, attempt, stage, opened_at, stage_started_at) "
            "VALUES (?, ?, 'open', ?, ?)",
            (round_, attempt, now, now),
        )

    def set_stage(
        self,
        round_: int,
        attempt: int,
        stage: str,
        now: float,
        *,
        spec: bytes | None = None,
        detail: str | None = None,
    ) -> None:
        with self._transaction():
            self._db.execute(
                "UPDATE rounds SET stage=?, stage_started_at=? WHERE round=? AND attempt=?",
                (stage, now, round_, attempt),
            )
            if spec is not None:
                self._db.execute(
                    "UPDATE rounds SET spec=? WHERE round=? AND attempt=?", (spec, round_, attempt)
                )
            if detail is not None:
                self._db.execute(
                    "UPDATE rounds SET detail=? WHERE round=? AND attempt=?",
                    (detail, round_, attempt),
                )

    def close_round(
        self,
        round_: int,
        attempt: int,
        stage: str,
        now: float,
        *,
        model_version: int | None,
        summary: bytes,
        detail: str,
    ) -> None:
        self._db.execute(
            "UPDATE rounds SET stage=?, stage_started_at=?, closed_at=?, model_version=?, "
            "summary=?, detail=? WHERE round=? AND attempt=?",
            (stage, now, now, model_version, summary, detail, round_, attempt),
        )

    # -- joins -------------------------------------------------------------------------------

    def add_join(
        self,
        round_: int,
        attempt: int,
        member: str,
        samples: int,
        now: float,
        base_version: int | None = None,
    ) -> None:
        self._db.execute(
            "INSERT INTO joins VALUES (?, ?, ?, ?, ?, ?)",
            (round_, attempt, member, samples, now, base_version),
        )

    def join_bases(self, round_: int, attempt: int) -> dict[str, int | None]:
        rows = self._db.execute(
            "SELECT member, base_version FROM joins WHERE round=? AND attempt=?",
            (round_, attempt),
        ).fetchall()
        return {m: (int(b) if b is not None else None) for m, b in rows}

    def joins(self, round_: int, attempt: int) -> dict[str, int]:
        rows = self._db.execute(
            "SELECT member, samples FROM joins WHERE round=? AND attempt=? ORDER BY joined_at",
            (round_, attempt),
        ).fetchall()
        return {m: s for m, s in rows}

    def join_time(self, round_: int, attempt: int, nth: int) -> float:
        """When the ``nth`` member (1-based) joined this attempt; +inf if fewer joined."""
        row = self._db.execute(
            "SELECT joined_at FROM joins WHERE round=? AND attempt=? ORDER BY joined_at "
            "LIMIT 1 OFFSET ?",
            (round_, attempt, nth - 1),
        ).fetchone()
        return float(row[0]) if row else float("inf")

    # -- messages ----------------------------------------------------------------------------

    def add_message(self, round_: int, attempt: int, stage: str, member: str, body: bytes) -> int:
        cur = self._db.execute(
            "INSERT INTO messages (round, attempt, stage, member, body, received_at) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (round_, attempt, stage, member, body, time.time()),
        )
        assert cur.lastrowid is not None
        return cur.lastrowid

    def message(self, round_: int, attempt: int, stage: str, member: str) -> bytes | None:
        row = self._db.execute(
            "SELECT body FROM messages WHERE round=? AND attempt=? AND stage=? AND member=?",
            (round_, attempt, stage, member),
        ).fetchone()
        return bytes(row[0]) if row else None

    def count_messages(self, round_: int, attempt: int, stage: str) -> int:
        row = self._db.execute(
            "SELECT COUNT(*) FROM messages WHERE round=? AND attempt=? AND stage=?",
            (round_, attempt, stage),
        ).fetchone()
        return int(row[0])

    def count_closed_rounds(self) -> int:
        row = self._db.execute("SELECT COUNT(*) FROM rounds WHERE stage='closed'").fetchone()
        return int(row[0])

    def messages(self, round_: int, attempt: int, stage: str) -> Iterator[tuple[str, bytes]]:
        cur = self._db.execute(
            "SELECT member, body FROM messages WHERE round=? AND attempt=? AND stage=? "
            "ORDER BY seq",
            (round_, attempt, stage),
        )
        for member, body in cur:
            yield member, bytes(body)

    # -- privacy reports and receipts --------------------------------------------------------

    def add_report(
        self, round_: int, attempt: int, member: str, epsilon: float, body: bytes
    ) -> None:
        self._db.execute(
            "INSERT INTO reports VALUES (?, ?, ?, ?, ?)", (round_, attempt, member, epsilon, body)
        )

    def report(self, round_: int, attempt: int, member: str) -> bytes | None:
        row = self._db.execute(
            "SELECT body FROM reports WHERE round=? AND attempt=? AND member=?",
            (round_, attempt, member),
        ).fetchone()
        return bytes(row[0]) if row else None

    def epsilons(self) -> dict[str, float]:
        """Latest reported ε per member."""
        rows = self._db.execute(
            "SELECT member, MAX(epsilon) FROM reports GROUP BY member"
        ).fetchall()
        return {m: float(e) for m, e in rows}

    def epsilon_max(self, round_: int, attempt: int) -> float | None:
        row = self._db.execute(
            "SELECT MAX(epsilon) FROM reports WHERE round=? AND attempt=?", (round_, attempt)
        ).fetchone()
        return float(row[0]) if row and row[0] is not None else None

    def add_receipt(self, round_: int, attempt: int, member: str, body: bytes) -> None:
        self._db.execute(
            "INSERT INTO receipts VALUES (?, ?, ?, ?)", (round_, attempt, member, body)
        )

    def receipt(self, round_: int, member: str) -> bytes | None:
        row = self._db.execute(
            "SELECT body FROM receipts WHERE round=? AND member=? ORDER BY attempt DESC LIMIT 1",
            (round_, member),
        ).fetchone()
        return bytes(row[0]) if row else None

    # -- transparency log ----------------------------------------------------------------------

    def add_log_line(self, index: int, line: bytes) -> None:
        self._db.execute("INSERT INTO log VALUES (?, ?)", (index, line))

    def log_tail(self) -> tuple[int, bytes] | None:
        row = self._db.execute("SELECT idx, line FROM log ORDER BY idx DESC LIMIT 1").fetchone()
        return (int(row[0]), bytes(row[1])) if row else None

    def log_lines(self, start: int = 0) -> Iterator[tuple[int, bytes]]:
        cur = self._db.execute("SELECT idx, line FROM log WHERE idx >= ? ORDER BY idx", (start,))
        for idx, line in cur:
            yield int(idx), bytes(line)

    def in_transaction(self) -> bool:
        return self._db.in_transaction

    def on_commit(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` after every commit of an explicit transaction."""
        self._after_commit.append(callback)

    # -- audit challenges and reveals ---------------------------------------------------------

    def add_challenge(self, r: int, a: int, member: str, auditor: str, body: bytes) -> None:
        self._db.execute(
            "INSERT INTO challenges VALUES (?, ?, ?, ?, ?)", (r, a, member, auditor, body)
        )

    def challenge(self, r: int, a: int, member: str, auditor: str) -> bytes | None:
        row = self._db.execute(
            "SELECT body FROM challenges WHERE round=? AND attempt=? AND member=? AND auditor=?",
            (r, a, member, auditor),
        ).fetchone()
        return bytes(row[0]) if row else None

    def open_challenges(self, member: str) -> list[bytes]:
        rows = self._db.execute(
            "SELECT c.body FROM challenges c LEFT JOIN reveals v ON c.round=v.round AND "
            "c.attempt=v.attempt AND c.member=v.member AND c.auditor=v.auditor "
            "WHERE c.member=? AND v.body IS NULL ORDER BY c.round, c.attempt",
            (member,),
        ).fetchall()
        return [bytes(r[0]) for r in rows]

    def add_reveal(self, r: int, a: int, member: str, auditor: str, body: bytes) -> None:
        self._db.execute(
            "INSERT INTO reveals VALUES (?, ?, ?, ?, ?)", (r, a, member, auditor, body)
        )

    def reveals_for(self, auditor: str) -> list[bytes]:
        rows = self._db.execute(
            "SELECT body FROM reveals WHERE auditor=? ORDER BY round, attempt, member", (auditor,)
        ).fetchall()
        return [bytes(r[0]) for r in rows]

    # -- server optimiser state --------------------------------------------------------------

    def put_value(self, name: str, value: bytes) -> None:
        self._db.execute(
            "INSERT INTO server_state VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET value=?",
            (name, value, value),
        )

    def get_value(self, name: str) -> bytes | None:
        row = self._db.execute("SELECT value FROM server_state WHERE name=?", (name,)).fetchone()
        return bytes(row[0]) if row else None

    # -- transactions ------------------------------------------------------------------------

    def _transaction(self) -> _Tx:
        return _Tx(self._db, self._after_commit)

    def transaction(self) -> _Tx:
        """``with store.transaction(): ...`` groups writes into one atomic commit."""
        return _Tx(self._db, self._after_commit)


class _Tx:
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
