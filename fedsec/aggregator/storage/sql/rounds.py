"""Round attempts and their joins in SQL (tables ``rounds`` and ``joins``)."""

from __future__ import annotations

from fedsec.aggregator.storage.interfaces import RoundRow
from fedsec.aggregator.storage.sql.db import SqlDb, count_rows


class SqlRounds:
    """:class:`~fedsec.aggregator.storage.interfaces.RoundStore` in table ``rounds``."""

    def __init__(self, db: SqlDb) -> None:
        self._db = db

    def latest(self) -> RoundRow | None:
        row = self._db.read_one("SELECT * FROM rounds ORDER BY round DESC, attempt DESC LIMIT 1")
        return RoundRow(*row) if row else None

    def get(self, round_: int, attempt: int) -> RoundRow | None:
        row = self._db.read_one(
            "SELECT * FROM rounds WHERE round=? AND attempt=?", (round_, attempt)
        )
        return RoundRow(*row) if row else None

    def history(self, limit: int = 1000) -> list[RoundRow]:
        rows = list(
            self._db.read(
                "SELECT * FROM rounds ORDER BY round DESC, attempt DESC LIMIT ?", (limit,)
            )
        )
        return [RoundRow(*r) for r in reversed(rows)]

    def count_closed(self) -> int:
        return count_rows(self._db, "SELECT COUNT(*) FROM rounds WHERE stage='closed'")

    def open(self, round_: int, attempt: int, now: float) -> None:
        self._db.write(
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
        with self._db.transaction():
            self._db.write(
                "UPDATE rounds SET stage=?, stage_started_at=? WHERE round=? AND attempt=?",
                (stage, now, round_, attempt),
            )
            if spec is not None:
                self._db.write(
                    "UPDATE rounds SET spec=? WHERE round=? AND attempt=?", (spec, round_, attempt)
                )
            if detail is not None:
                self._db.write(
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
        self._db.write(
            "UPDATE rounds SET stage=?, stage_started_at=?, closed_at=?, model_version=?, "
            "summary=?, detail=? WHERE round=? AND attempt=?",
            (stage, now, now, model_version, summary, detail, round_, attempt),
        )


class SqlJoins:
    """:class:`~fedsec.aggregator.storage.interfaces.JoinStore` in table ``joins``."""

    def __init__(self, db: SqlDb) -> None:
        self._db = db

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
        self._db.write(
            "INSERT INTO joins (round, attempt, member, samples, joined_at, base_version, "
            "graph_commitment) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (round_, attempt, member, samples, now, base_version, graph_commitment),
        )

    def commitments(self, round_: int, attempt: int) -> dict[str, str]:
        rows = list(
            self._db.read(
                "SELECT member, graph_commitment FROM joins WHERE round=? AND attempt=?",
                (round_, attempt),
            )
        )
        return {m: c for m, c in rows}

    def samples(self, round_: int, attempt: int) -> dict[str, int]:
        rows = list(
            self._db.read(
                "SELECT member, samples FROM joins WHERE round=? AND attempt=? ORDER BY joined_at",
                (round_, attempt),
            )
        )
        return {m: s for m, s in rows}

    def count(self, round_: int, attempt: int) -> int:
        rows = list(
            self._db.read(
                "SELECT COUNT(*) FROM joins WHERE round=? AND attempt=?", (round_, attempt)
            )
        )
        return int(rows[0][0])

    def joined(self, round_: int, attempt: int, member: str) -> bool:
        rows = list(
            self._db.read(
                "SELECT 1 FROM joins WHERE round=? AND attempt=? AND member=?",
                (round_, attempt, member),
            )
        )
        return bool(rows)

    def bases(self, round_: int, attempt: int) -> dict[str, int | None]:
        rows = list(
            self._db.read(
                "SELECT member, base_version FROM joins WHERE round=? AND attempt=?",
                (round_, attempt),
            )
        )
        return {m: (int(b) if b is not None else None) for m, b in rows}

    def nth_time(self, round_: int, attempt: int, nth: int) -> float:
        row = self._db.read_one(
            "SELECT joined_at FROM joins WHERE round=? AND attempt=? ORDER BY joined_at "
            "LIMIT 1 OFFSET ?",
            (round_, attempt, nth - 1),
        )
        return float(row[0]) if row else float("inf")
