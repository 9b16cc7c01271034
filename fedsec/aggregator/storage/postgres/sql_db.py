"""The PostgreSQL connection as the :class:`~fedsec.aggregator.storage.sql.db.SqlDb`
the shared SQL repositories use.

Only the placeholder differs from their SQL (psycopg's ``%s`` for ``?``), and a
generated key comes back through ``RETURNING``.  Every change goes through
:meth:`PostgresConnection.write`, so it runs in a transaction that begins with the
lease's fencing check.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

from fedsec.aggregator.storage.postgres.connection import PostgresConnection, Transaction
from fedsec.aggregator.storage.sql.db import Params, Row


@functools.lru_cache(maxsize=256)
def _psycopg(sql: str) -> str:
    """``sql`` with psycopg's placeholders: a literal ``%`` doubled, ``?`` to ``%s``
    (the shared SQL has no ``?`` inside a string literal)."""
    return sql.replace("%", "%%").replace("?", "%s")


class PostgresSqlDb:
    """:class:`~fedsec.aggregator.storage.sql.db.SqlDb` over a
    :class:`PostgresConnection`."""

    def __init__(self, conn: PostgresConnection) -> None:
        self._conn = conn

    def read(self, sql: str, params: Params = ()) -> Iterator[Row]:
        return iter(self._conn.read(_psycopg(sql), params))

    def read_one(self, sql: str, params: Params = ()) -> Row | None:
        return self._conn.read(_psycopg(sql), params).fetchone()

    def write(self, sql: str, params: Params = ()) -> int:
        """Run a statement that changes state (see :meth:`PostgresConnection.write`);
        the number of rows it changed.

        Raises:
            NotLeader: this store does not hold the lease (the fence).
            psycopg.Error: the statement fails or the connection breaks.
        """
        return self._conn.write(_psycopg(sql), params).rowcount

    def insert(self, sql: str, params: Params, key: str) -> int:
        """Run an ``INSERT`` of one row as :meth:`write`; its generated ``key``.

        Raises:
            NotLeader: this store does not hold the lease (the fence).
            psycopg.Error: the statement fails or the connection breaks.
        """
        row = self._conn.write(_psycopg(f"{sql} RETURNING {key}"), params).fetchone()
        assert row is not None  # RETURNING of a one-row INSERT returns its row
        return int(row[0])

    def transaction(self) -> Transaction:
        return self._conn.transaction()

    def in_transaction(self) -> bool:
        return self._conn.in_transaction()

    def on_commit(self, callback: Callable[[], None]) -> None:
        self._conn.on_commit(callback)
