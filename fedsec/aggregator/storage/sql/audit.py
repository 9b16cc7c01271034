"""The transparency log and audit challenges in SQL (tables ``log``, ``challenges``
and ``reveals``), and the aggregator's named values (table ``server_state``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from fedsec.aggregator.storage.sql.db import SqlDb, count_rows


class SqlLog:
    """:class:`~fedsec.aggregator.storage.interfaces.LogStore` in table ``log``."""

    def __init__(self, db: SqlDb) -> None:
        self._db = db

    def add_log_line(self, index: int, line: bytes) -> None:
        self._db.write("INSERT INTO log VALUES (?, ?)", (index, line))

    def log_tail(self) -> tuple[int, bytes] | None:
        row = self._db.read_one("SELECT idx, line FROM log ORDER BY idx DESC LIMIT 1")
        return (int(row[0]), bytes(row[1])) if row else None

    def log_lines(self, start: int = 0) -> Iterator[tuple[int, bytes]]:
        cur = self._db.read("SELECT idx, line FROM log WHERE idx >= ? ORDER BY idx", (start,))
        for idx, line in cur:
            yield int(idx), bytes(line)

    def in_transaction(self) -> bool:
        return self._db.in_transaction()

    def on_commit(self, callback: Callable[[], None]) -> None:
        self._db.on_commit(callback)


class SqlChallenges:
    """:class:`~fedsec.aggregator.storage.interfaces.ChallengeStore` in tables
    ``challenges`` and ``reveals``."""

    def __init__(self, db: SqlDb) -> None:
        self._db = db

    def add(self, round_: int, attempt: int, member: str, auditor: str, body: bytes) -> None:
        self._db.write(
            "INSERT INTO challenges VALUES (?, ?, ?, ?, ?)",
            (round_, attempt, member, auditor, body),
        )

    def get(self, round_: int, attempt: int, member: str, auditor: str) -> bytes | None:
        row = self._db.read_one(
            "SELECT body FROM challenges WHERE round=? AND attempt=? AND member=? AND auditor=?",
            (round_, attempt, member, auditor),
        )
        return bytes(row[0]) if row else None

    def open_for(self, member: str) -> list[bytes]:
        rows = list(
            self._db.read(
                "SELECT c.body FROM challenges c LEFT JOIN reveals v ON c.round=v.round AND "
                "c.attempt=v.attempt AND c.member=v.member AND c.auditor=v.auditor "
                "WHERE c.member=? AND v.body IS NULL ORDER BY c.round, c.attempt",
                (member,),
            )
        )
        return [bytes(r[0]) for r in rows]

    def count(self) -> int:
        return count_rows(self._db, "SELECT COUNT(*) FROM challenges")

    def add_reveal(self, round_: int, attempt: int, member: str, auditor: str, body: bytes) -> None:
        self._db.write(
            "INSERT INTO reveals VALUES (?, ?, ?, ?, ?)", (round_, attempt, member, auditor, body)
        )

    def reveals_for(self, auditor: str) -> list[bytes]:
        rows = list(
            self._db.read(
                "SELECT body FROM reveals WHERE auditor=? ORDER BY round, attempt, member",
                (auditor,),
            )
        )
        return [bytes(r[0]) for r in rows]


class SqlValues:
    """:class:`~fedsec.aggregator.storage.interfaces.KeyValueStore` in table
    ``server_state``."""

    def __init__(self, db: SqlDb) -> None:
        self._db = db

    def put(self, name: str, value: bytes) -> None:
        self._db.write(
            "INSERT INTO server_state VALUES (?, ?) "
            "ON CONFLICT (name) DO UPDATE SET value = excluded.value",
            (name, value),
        )

    def get(self, name: str) -> bytes | None:
        row = self._db.read_one("SELECT value FROM server_state WHERE name=?", (name,))
        return bytes(row[0]) if row else None
