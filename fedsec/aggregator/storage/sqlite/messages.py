"""Accepted messages, privacy reports and receipts in SQLite (tables ``messages``,
``reports`` and ``receipts``)."""

from __future__ import annotations

import time
from collections.abc import Iterator

from fedsec.aggregator.storage.sqlite.connection import SqliteConnection


class SqliteMessages:
    """:class:`~fedsec.aggregator.storage.interfaces.MessageStore` in table ``messages``."""

    def __init__(self, conn: SqliteConnection) -> None:
        self._db = conn.db

    def add(self, round_: int, attempt: int, stage: str, member: str, body: bytes) -> int:
        cur = self._db.execute(
            "INSERT INTO messages (round, attempt, stage, member, body, received_at) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (round_, attempt, stage, member, body, time.time()),
        )
        assert cur.lastrowid is not None
        return cur.lastrowid

    def get(self, round_: int, attempt: int, stage: str, member: str) -> bytes | None:
        row = self._db.execute(
            "SELECT body FROM messages WHERE round=? AND attempt=? AND stage=? AND member=?",
            (round_, attempt, stage, member),
        ).fetchone()
        return bytes(row[0]) if row else None

    def count(self, round_: int, attempt: int, stage: str) -> int:
        row = self._db.execute(
            "SELECT COUNT(*) FROM messages WHERE round=? AND attempt=? AND stage=?",
            (round_, attempt, stage),
        ).fetchone()
        return int(row[0])

    def of_stage(self, round_: int, attempt: int, stage: str) -> Iterator[tuple[str, bytes]]:
        cur = self._db.execute(
            "SELECT member, body FROM messages WHERE round=? AND attempt=? AND stage=? "
            "ORDER BY seq",
            (round_, attempt, stage),
        )
        for member, body in cur:
            yield member, bytes(body)


class SqliteReports:
    """:class:`~fedsec.aggregator.storage.interfaces.ReportStore` in table ``reports``."""

    def __init__(self, conn: SqliteConnection) -> None:
        self._db = conn.db

    def add(self, round_: int, attempt: int, member: str, epsilon: float, body: bytes) -> None:
        self._db.execute(
            "INSERT INTO reports VALUES (?, ?, ?, ?, ?)", (round_, attempt, member, epsilon, body)
        )

    def get(self, round_: int, attempt: int, member: str) -> bytes | None:
        row = self._db.execute(
            "SELECT body FROM reports WHERE round=? AND attempt=? AND member=?",
            (round_, attempt, member),
        ).fetchone()
        return bytes(row[0]) if row else None

    def epsilons(self) -> dict[str, float]:
        rows = self._db.execute(
            "SELECT member, MAX(epsilon) FROM reports GROUP BY member"
        ).fetchall()
        return {m: float(e) for m, e in rows}

    def epsilon_max(self, round_: int, attempt: int) -> float | None:
        row = self._db.execute(
            "SELECT MAX(epsilon) FROM reports WHERE round=? AND attempt=?", (round_, attempt)
        ).fetchone()
        return float(row[0]) if row and row[0] is not None else None


class SqliteReceipts:
    """:class:`~fedsec.aggregator.storage.interfaces.ReceiptStore` in table ``receipts``."""

    def __init__(self, conn: SqliteConnection) -> None:
        self._db = conn.db

    def add(self, round_: int, attempt: int, member: str, body: bytes) -> None:
        self._db.execute(
            "INSERT INTO receipts VALUES (?, ?, ?, ?)", (round_, attempt, member, body)
        )

    def latest(self, round_: int, member: str) -> bytes | None:
        row = self._db.execute(
            "SELECT body FROM receipts WHERE round=? AND member=? ORDER BY attempt DESC LIMIT 1",
            (round_, member),
        ).fetchone()
        return bytes(row[0]) if row else None

    def has(self, round_: int, attempt: int, member: str) -> bool:
        row = self._db.execute(
            "SELECT 1 FROM receipts WHERE round=? AND attempt=? AND member=?",
            (round_, attempt, member),
        ).fetchone()
        return row is not None

    def contributions(self) -> dict[str, int]:
        # a receipt of an attempt that closed: that input is in the round's sum
        rows = self._db.execute(
            "SELECT c.member, COUNT(*) FROM receipts c JOIN rounds r "
            "ON c.round = r.round AND c.attempt = r.attempt WHERE r.stage = 'closed' "
            "GROUP BY c.member"
        ).fetchall()
        return {str(m): int(n) for m, n in rows}
