"""The transparency log and audit challenges in SQLite (tables ``log``, ``challenges``
and ``reveals``), and the aggregator's named values (table ``server_state``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from fedsec.aggregator.storage.sqlite.connection import SqliteConnection


class SqliteLog:
    """:class:`~fedsec.aggregator.storage.interfaces.LogStore` in table ``log``."""

    def __init__(self, conn: SqliteConnection) -> None:
        self._conn = conn
        self._db = conn.db

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
        return self._conn.in_transaction()

    def on_commit(self, callback: Callable[[], None]) -> None:
        self._conn.on_commit(callback)


class SqliteChallenges:
    """:class:`~fedsec.aggregator.storage.interfaces.ChallengeStore` in tables
    ``challenges`` and ``reveals``."""

    def __init__(self, conn: SqliteConnection) -> None:
        self._db = conn.db

    def add(self, round_: int, attempt: int, member: str, auditor: str, body: bytes) -> None:
        self._db.execute(
            "INSERT INTO challenges VALUES (?, ?, ?, ?, ?)",
            (round_, attempt, member, auditor, body),
        )

    def get(self, round_: int, attempt: int, member: str, auditor: str) -> bytes | None:
        row = self._db.execute(
            "SELECT body FROM challenges WHERE round=? AND attempt=? AND member=? AND auditor=?",
            (round_, attempt, member, auditor),
        ).fetchone()
        return bytes(row[0]) if row else None

    def open_for(self, member: str) -> list[bytes]:
        rows = self._db.execute(
            "SELECT c.body FROM challenges c LEFT JOIN reveals v ON c.round=v.round AND "
            "c.attempt=v.attempt AND c.member=v.member AND c.auditor=v.auditor "
            "WHERE c.member=? AND v.body IS NULL ORDER BY c.round, c.attempt",
            (member,),
        ).fetchall()
        return [bytes(r[0]) for r in rows]

    def count(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM challenges").fetchone()[0])

    def add_reveal(self, round_: int, attempt: int, member: str, auditor: str, body: bytes) -> None:
        self._db.execute(
            "INSERT INTO reveals VALUES (?, ?, ?, ?, ?)", (round_, attempt, member, auditor, body)
        )

    def reveals_for(self, auditor: str) -> list[bytes]:
        rows = self._db.execute(
            "SELECT body FROM reveals WHERE auditor=? ORDER BY round, attempt, member", (auditor,)
        ).fetchall()
        return [bytes(r[0]) for r in rows]


class SqliteValues:
    """:class:`~fedsec.aggregator.storage.interfaces.KeyValueStore` in table
    ``server_state``."""

    def __init__(self, conn: SqliteConnection) -> None:
        self._db = conn.db

    def put(self, name: str, value: bytes) -> None:
        self._db.execute(
            "INSERT INTO server_state VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET value=?",
            (name, value, value),
        )

    def get(self, name: str) -> bytes | None:
        row = self._db.execute("SELECT value FROM server_state WHERE name=?", (name,)).fetchone()
        return bytes(row[0]) if row else None
