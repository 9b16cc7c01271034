"""Round attempts and their joins in SQLite (tables ``rounds`` and ``joins``)."""

from __future__ import annotations

from fedsec.aggregator.storage.interfaces import RoundRow
from fedsec.aggregator.storage.sqlite.connection import SqliteConnection


class SqliteRounds:
    """:class:`~fedsec.aggregator.storage.interfaces.RoundStore` in table ``rounds``."""

    def __init__(self, conn: SqliteConnection) -> None:
        self._conn = conn
        self._db = conn.db

    def latest(self) -> RoundRow | None:
        row = self._db.execute(
            "SELECT * FROM rounds ORDER BY round DESC, attempt DESC LIMIT 1"
        ).fetchone()
        return RoundRow(*row) if row else None

    def get(self, round_: int, attempt: int) -> RoundRow | None:
        row = self._db.execute(
            "SELECT * FROM rounds WHERE round=? AND attempt=?", (round_, attempt)
        ).fetchone()
        return RoundRow(*row) if row else None

    def history(self, limit: int = 1000) -> list[RoundRow]:
        rows = self._db.execute(
            "SELECT * FROM rounds ORDER BY round DESC, attempt DESC LIMIT ?", (limit,)
        ).fetchall()
        return [RoundRow(*r) for r in reversed(rows)]

    def count_closed(self) -> int:
        row = self._db.execute("SELECT COUNT(*) FROM rounds WHERE stage='closed'").fetchone()
        return int(row[0])

    def open(self, round_: int, attempt: int, now: float) -> None:
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
        with self._conn.transaction():
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

    def close(
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


class SqliteJoins:
    """:class:`~fedsec.aggregator.storage.interfaces.JoinStore` in table ``joins``."""

    def __init__(self, conn: SqliteConnection) -> None:
        self._db = conn.db

    def add(
        self,
        round_: int,
        attempt: int,
        member: str,
        samples: int,
        now: float,
        base_version: int | None = None,
        graph_commitment: str = "",
    ) -> None:
        self._db.execute(
            "INSERT INTO joins (round, attempt, member, samples, joined_at, base_version, "
            "graph_commitment) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (round_, attempt, member, samples, now, base_version, graph_commitment),
        )

    def commitments(self, round_: int, attempt: int) -> dict[str, str]:
        rows = self._db.execute(
            "SELECT member, graph_commitment FROM joins WHERE round=? AND attempt=?",
            (round_, attempt),
        ).fetchall()
        return {m: c for m, c in rows}

    def samples(self, round_: int, attempt: int) -> dict[str, int]:
        rows = self._db.execute(
            "SELECT member, samples FROM joins WHERE round=? AND attempt=? ORDER BY joined_at",
            (round_, attempt),
        ).fetchall()
        return {m: s for m, s in rows}

    def bases(self, round_: int, attempt: int) -> dict[str, int | None]:
        rows = self._db.execute(
            "SELECT member, base_version FROM joins WHERE round=? AND attempt=?",
            (round_, attempt),
        ).fetchall()
        return {m: (int(b) if b is not None else None) for m, b in rows}

    def nth_time(self, round_: int, attempt: int, nth: int) -> float:
        row = self._db.execute(
            "SELECT joined_at FROM joins WHERE round=? AND attempt=? ORDER BY joined_at "
            "LIMIT 1 OFFSET ?",
            (round_, attempt, nth - 1),
        ).fetchone()
        return float(row[0]) if row else float("inf")
