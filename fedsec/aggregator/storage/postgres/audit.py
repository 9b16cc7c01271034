"""The transparency log and audit challenges in PostgreSQL (tables ``log``, ``challenges``
and ``reveals``), and the aggregator's named values (table ``server_state``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from fedsec.aggregator.storage.postgres.connection import PostgresConnection


class PostgresLog:
    """:class:`~fedsec.aggregator.storage.interfaces.LogStore` in table ``log``."""

    def __init__(self, conn: PostgresConnection) -> None:
        self._conn = conn

    def add_log_line(self, index: int, line: bytes) -> None:
        self._conn.write("INSERT INTO log VALUES (%s, %s)", (index, line))

    def log_tail(self) -> tuple[int, bytes] | None:
        row = self._conn.read("SELECT idx, line FROM log ORDER BY idx DESC LIMIT 1").fetchone()
        return (int(row[0]), bytes(row[1])) if row else None

    def log_lines(self, start: int = 0) -> Iterator[tuple[int, bytes]]:
        cur = self._conn.read("SELECT idx, line FROM log WHERE idx >= %s ORDER BY idx", (start,))
        for idx, line in cur:
            yield int(idx), bytes(line)

    def in_transaction(self) -> bool:
        return self._conn.in_transaction()

    def on_commit(self, callback: Callable[[], None]) -> None:
        self._conn.on_commit(callback)


class PostgresChallenges:
    """:class:`~fedsec.aggregator.storage.interfaces.ChallengeStore` in tables
    ``challenges`` and ``reveals``."""

    def __init__(self, conn: PostgresConnection) -> None:
        self._conn = conn

    def add(self, round_: int, attempt: int, member: str, auditor: str, body: bytes) -> None:
        self._conn.write(
            "INSERT INTO challenges VALUES (%s, %s, %s, %s, %s)",
            (round_, attempt, member, auditor, body),
        )

    def get(self, round_: int, attempt: int, member: str, auditor: str) -> bytes | None:
        row = self._conn.read(
            "SELECT body FROM challenges "
            "WHERE round=%s AND attempt=%s AND member=%s AND auditor=%s",
            (round_, attempt, member, auditor),
        ).fetchone()
        return bytes(row[0]) if row else None

    def open_for(self, member: str) -> list[bytes]:
        rows = self._conn.read(
            "SELECT c.body FROM challenges c LEFT JOIN reveals v ON c.round=v.round AND "
            "c.attempt=v.attempt AND c.member=v.member AND c.auditor=v.auditor "
            "WHERE c.member=%s AND v.body IS NULL ORDER BY c.round, c.attempt",
            (member,),
        ).fetchall()
        return [bytes(r[0]) for r in rows]

    def count(self) -> int:
        return self._conn.count("SELECT COUNT(*) FROM challenges")

    def add_reveal(self, round_: int, attempt: int, member: str, auditor: str, body: bytes) -> None:
        self._conn.write(
            "INSERT INTO reveals VALUES (%s, %s, %s, %s, %s)",
            (round_, attempt, member, auditor, body),
        )

    def reveals_for(self, auditor: str) -> list[bytes]:
        rows = self._conn.read(
            "SELECT body FROM reveals WHERE auditor=%s ORDER BY round, attempt, member", (auditor,)
        ).fetchall()
        return [bytes(r[0]) for r in rows]


class PostgresValues:
    """:class:`~fedsec.aggregator.storage.interfaces.KeyValueStore` in table
    ``server_state``."""

    def __init__(self, conn: PostgresConnection) -> None:
        self._conn = conn

    def put(self, name: str, value: bytes) -> None:
        self._conn.write(
            "INSERT INTO server_state VALUES (%s, %s) "
            "ON CONFLICT (name) DO UPDATE SET value = excluded.value",
            (name, value),
        )

    def get(self, name: str) -> bytes | None:
        row = self._conn.read("SELECT value FROM server_state WHERE name=%s", (name,)).fetchone()
        return bytes(row[0]) if row else None
