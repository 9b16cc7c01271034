"""Accepted messages, privacy reports and receipts in SQL (tables ``messages``,
``reports`` and ``receipts``)."""

from __future__ import annotations

import time
from collections.abc import Iterator

from fedsec.aggregator.storage.sql.db import SqlDb, count_rows


class SqlMessages:
    """:class:`~fedsec.aggregator.storage.interfaces.MessageStore` in table ``messages``."""

    def __init__(self, db: SqlDb) -> None:
        self._db = db

    def add(self, round_: int, attempt: int, stage: str, member: str, body: bytes) -> int:
        return self._db.insert(
            "INSERT INTO messages (round, attempt, stage, member, body, received_at) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (round_, attempt, stage, member, body, time.time()),
            "seq",
        )

    def get(self, round_: int, attempt: int, stage: str, member: str) -> bytes | None:
        row = self._db.read_one(
            "SELECT body FROM messages WHERE round=? AND attempt=? AND stage=? AND member=?",
            (round_, attempt, stage, member),
        )
        return bytes(row[0]) if row else None

    def count(self, round_: int, attempt: int, stage: str) -> int:
        return count_rows(
            self._db,
            "SELECT COUNT(*) FROM messages WHERE round=? AND attempt=? AND stage=?",
            (round_, attempt, stage),
        )

    def of_stage(self, round_: int, attempt: int, stage: str) -> Iterator[tuple[str, bytes]]:
        cur = self._db.read(
            "SELECT member, body FROM messages WHERE round=? AND attempt=? AND stage=? "
            "ORDER BY seq",
            (round_, attempt, stage),
        )
        for member, body in cur:
            yield member, bytes(body)

    def after(
        self, round_: int, attempt: int, stage: str, seq: int
    ) -> Iterator[tuple[int, str, bytes]]:
        cur = self._db.read(
            "SELECT seq, member, body FROM messages WHERE round=? AND attempt=? AND stage=? "
            "AND seq > ? ORDER BY seq",
            (round_, attempt, stage, seq),
        )
        for number, member, body in cur:
            yield int(number), member, bytes(body)


class SqlReports:
    """:class:`~fedsec.aggregator.storage.interfaces.ReportStore` in table ``reports``."""

    def __init__(self, db: SqlDb) -> None:
        self._db = db

    def add(self, round_: int, attempt: int, member: str, epsilon: float, body: bytes) -> None:
        self._db.write(
            "INSERT INTO reports VALUES (?, ?, ?, ?, ?)", (round_, attempt, member, epsilon, body)
        )

    def get(self, round_: int, attempt: int, member: str) -> bytes | None:
        row = self._db.read_one(
            "SELECT body FROM reports WHERE round=? AND attempt=? AND member=?",
            (round_, attempt, member),
        )
        return bytes(row[0]) if row else None

    def epsilons(self) -> dict[str, float]:
        rows = list(self._db.read("SELECT member, MAX(epsilon) FROM reports GROUP BY member"))
        return {m: float(e) for m, e in rows}

    def epsilon_max(self, round_: int, attempt: int) -> float | None:
        row = self._db.read_one(
            "SELECT MAX(epsilon) FROM reports WHERE round=? AND attempt=?", (round_, attempt)
        )
        return float(row[0]) if row and row[0] is not None else None


class SqlReceipts:
    """:class:`~fedsec.aggregator.storage.interfaces.ReceiptStore` in table ``receipts``."""

    def __init__(self, db: SqlDb) -> None:
        self._db = db

    def add(self, round_: int, attempt: int, member: str, body: bytes) -> None:
        self._db.write("INSERT INTO receipts VALUES (?, ?, ?, ?)", (round_, attempt, member, body))

    def latest(self, round_: int, member: str) -> bytes | None:
        row = self._db.read_one(
            "SELECT body FROM receipts WHERE round=? AND member=? ORDER BY attempt DESC LIMIT 1",
            (round_, member),
        )
        return bytes(row[0]) if row else None

    def has(self, round_: int, attempt: int, member: str) -> bool:
        row = self._db.read_one(
            "SELECT 1 FROM receipts WHERE round=? AND attempt=? AND member=?",
            (round_, attempt, member),
        )
        return row is not None

    def contributions(self) -> dict[str, int]:
        # a receipt of an attempt that closed: that input is in the round's sum
        rows = list(
            self._db.read(
                "SELECT c.member, COUNT(*) FROM receipts c JOIN rounds r "
                "ON c.round = r.round AND c.attempt = r.attempt WHERE r.stage = 'closed' "
                "GROUP BY c.member"
            )
        )
        return {str(m): int(n) for m, n in rows}
