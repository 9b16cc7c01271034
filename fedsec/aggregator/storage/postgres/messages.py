"""Accepted messages, privacy reports and receipts in PostgreSQL (tables ``messages``,
``reports`` and ``receipts``)."""

from __future__ import annotations

import time
from collections.abc import Iterator

from fedsec.aggregator.storage.postgres.connection import PostgresConnection


class PostgresMessages:
    """:class:`~fedsec.aggregator.storage.interfaces.MessageStore` in table ``messages``."""

    def __init__(self, conn: PostgresConnection) -> None:
        self._conn = conn

    def add(self, round_: int, attempt: int, stage: str, member: str, body: bytes) -> int:
        cur = self._conn.write(
            "INSERT INTO messages (round, attempt, stage, member, body, received_at) "
            "VALUES (%s, %s, %s, %s, %s, %s) RETURNING seq",
            (round_, attempt, stage, member, body, time.time()),
        )
        row = cur.fetchone()
        assert row is not None
        return int(row[0])

    def get(self, round_: int, attempt: int, stage: str, member: str) -> bytes | None:
        row = self._conn.read(
            "SELECT body FROM messages WHERE round=%s AND attempt=%s AND stage=%s AND member=%s",
            (round_, attempt, stage, member),
        ).fetchone()
        return bytes(row[0]) if row else None

    def count(self, round_: int, attempt: int, stage: str) -> int:
        return self._conn.count(
            "SELECT COUNT(*) FROM messages WHERE round=%s AND attempt=%s AND stage=%s",
            (round_, attempt, stage),
        )

    def of_stage(self, round_: int, attempt: int, stage: str) -> Iterator[tuple[str, bytes]]:
        cur = self._conn.read(
            "SELECT member, body FROM messages WHERE round=%s AND attempt=%s AND stage=%s "
            "ORDER BY seq",
            (round_, attempt, stage),
        )
        for member, body in cur:
            yield member, bytes(body)


class PostgresReports:
    """:class:`~fedsec.aggregator.storage.interfaces.ReportStore` in table ``reports``."""

    def __init__(self, conn: PostgresConnection) -> None:
        self._conn = conn

    def add(self, round_: int, attempt: int, member: str, epsilon: float, body: bytes) -> None:
        self._conn.write(
            "INSERT INTO reports VALUES (%s, %s, %s, %s, %s)",
            (round_, attempt, member, epsilon, body),
        )

    def get(self, round_: int, attempt: int, member: str) -> bytes | None:
        row = self._conn.read(
            "SELECT body FROM reports WHERE round=%s AND attempt=%s AND member=%s",
            (round_, attempt, member),
        ).fetchone()
        return bytes(row[0]) if row else None

    def epsilons(self) -> dict[str, float]:
        rows = self._conn.read(
            "SELECT member, MAX(epsilon) FROM reports GROUP BY member"
        ).fetchall()
        return {m: float(e) for m, e in rows}

    def epsilon_max(self, round_: int, attempt: int) -> float | None:
        row = self._conn.read(
            "SELECT MAX(epsilon) FROM reports WHERE round=%s AND attempt=%s", (round_, attempt)
        ).fetchone()
        return float(row[0]) if row and row[0] is not None else None


class PostgresReceipts:
    """:class:`~fedsec.aggregator.storage.interfaces.ReceiptStore` in table ``receipts``."""

    def __init__(self, conn: PostgresConnection) -> None:
        self._conn = conn

    def add(self, round_: int, attempt: int, member: str, body: bytes) -> None:
        self._conn.write(
            "INSERT INTO receipts VALUES (%s, %s, %s, %s)", (round_, attempt, member, body)
        )

    def latest(self, round_: int, member: str) -> bytes | None:
        row = self._conn.read(
            "SELECT body FROM receipts WHERE round=%s AND member=%s ORDER BY attempt DESC LIMIT 1",
            (round_, member),
        ).fetchone()
        return bytes(row[0]) if row else None

    def has(self, round_: int, attempt: int, member: str) -> bool:
        row = self._conn.read(
            "SELECT 1 FROM receipts WHERE round=%s AND attempt=%s AND member=%s",
            (round_, attempt, member),
        ).fetchone()
        return row is not None

    def contributions(self) -> dict[str, int]:
        # a receipt of an attempt that closed: that input is in the round's sum
        rows = self._conn.read(
            "SELECT c.member, COUNT(*) FROM receipts c JOIN rounds r "
            "ON c.round = r.round AND c.attempt = r.attempt WHERE r.stage = 'closed' "
            "GROUP BY c.member"
        ).fetchall()
        return {str(m): int(n) for m, n in rows}
