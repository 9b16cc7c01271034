"""Round attempts and their joins in PostgreSQL (tables ``rounds`` and ``joins``)."""

from __future__ import annotations

from fedsec.aggregator.storage.interfaces import RoundRow
from fedsec.aggregator.storage.postgres.connection import PostgresConnection


class PostgresRounds:
    """:class:`~fedsec.aggregator.storage.interfaces.RoundStore` in table ``rounds``."""

    def __init__(self, conn: PostgresConnection) -> None:
        self._conn = conn

    def latest(self) -> RoundRow | None:
        row = self._conn.read(
            "SELECT * FROM rounds ORDER BY round DESC, attempt DESC LIMIT 1"
        ).fetchone()
        return RoundRow(*row) if row else None

    def get(self, round_: int, attempt: int) -> RoundRow | None:
        row = self._conn.read(
            "SELECT * FROM rounds WHERE round=%s AND attempt=%s", (round_, attempt)
        ).fetchone()
        return RoundRow(*row) if row else None

    def history(self, limit: int = 1000) -> list[RoundRow]:
        rows = self._conn.read(
            "SELECT * FROM rounds ORDER BY round DESC, attempt DESC LIMIT %s", (limit,)
        ).fetchall()
        return [RoundRow(*r) for r in reversed(rows)]

    def count_closed(self) -> int:
        return self._conn.count("SELECT COUNT(*) FROM rounds WHERE stage='closed'")

    def open(self, round_: int, attempt: int, now: float) -> None:
        self._conn.write(
            "INSERT INTO rounds (round, attempt, stage, opened_at, stage_started_at) "
            "VALUES (%s, %s, 'open', %s, %s)",
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
            self._conn.write(
                "UPDATE rounds SET stage=%s, stage_started_at=%s WHERE round=%s AND attempt=%s",
                (stage, now, round_, attempt),
            )
            if spec is not None:
                self._conn.write(
                    "UPDATE rounds SET spec=%s WHERE round=%s AND attempt=%s",
                    (spec, round_, attempt),
                )
            if detail is not None:
                self._conn.write(
                    "UPDATE rounds SET detail=%s WHERE round=%s AND attempt=%s",
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
        self._conn.write(
            "UPDATE rounds SET stage=%s, stage_started_at=%s, closed_at=%s, model_version=%s, "
            "summary=%s, detail=%s WHERE round=%s AND attempt=%s",
            (stage, now, now, model_version, summary, detail, round_, attempt),
        )


class PostgresJoins:
    """:class:`~fedsec.aggregator.storage.interfaces.JoinStore` in table ``joins``."""

    def __init__(self, conn: PostgresConnection) -> None:
        self._conn = conn

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
        self._conn.write(
            "INSERT INTO joins (round, attempt, member, samples, joined_at, base_version, "
            "graph_commitment) VALUES (%s, %s, %s, %s, %s, %s, %s)",
            (round_, attempt, member, samples, now, base_version, graph_commitment),
        )

    def commitments(self, round_: int, attempt: int) -> dict[str, str]:
        rows = self._conn.read(
            "SELECT member, graph_commitment FROM joins WHERE round=%s AND attempt=%s",
            (round_, attempt),
        ).fetchall()
        return {m: c for m, c in rows}

    def samples(self, round_: int, attempt: int) -> dict[str, int]:
        rows = self._conn.read(
            "SELECT member, samples FROM joins WHERE round=%s AND attempt=%s ORDER BY joined_at",
            (round_, attempt),
        ).fetchall()
        return {m: s for m, s in rows}

    def bases(self, round_: int, attempt: int) -> dict[str, int | None]:
        rows = self._conn.read(
            "SELECT member, base_version FROM joins WHERE round=%s AND attempt=%s",
            (round_, attempt),
        ).fetchall()
        return {m: (int(b) if b is not None else None) for m, b in rows}

    def nth_time(self, round_: int, attempt: int, nth: int) -> float:
        row = self._conn.read(
            "SELECT joined_at FROM joins WHERE round=%s AND attempt=%s ORDER BY joined_at "
            "LIMIT 1 OFFSET %s",
            (round_, attempt, nth - 1),
        ).fetchone()
        return float(row[0]) if row else float("inf")
