"""What the shared SQL repositories need of a database connection.

Statements use ``?`` placeholders and only SQL both SQLite and PostgreSQL accept
(``ON CONFLICT ... DO NOTHING`` / ``DO UPDATE``, ``TRUE``); a backend translates the
placeholder to its driver's.  Durability, transactions and (for PostgreSQL) the
lease's fencing check are the backend's: every change goes through :meth:`SqlDb.write`
or :meth:`SqlDb.insert`, so it runs inside the backend's write path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol

Params = tuple[Any, ...]
Row = tuple[Any, ...]


class SqlDb(Protocol):
    """One open database, used from one thread."""

    def read(self, sql: str, params: Params = ()) -> Iterator[Row]:
        """The rows a query returns (inside the current transaction, if any)."""
        ...

    def read_one(self, sql: str, params: Params = ()) -> Row | None:
        """The first row a query returns, or None."""
        ...

    def write(self, sql: str, params: Params = ()) -> int:
        """Run a statement that changes state, inside the current transaction or in
        one of its own; the number of rows it changed.

        Raises:
            Exception: the backend's (``NotLeader`` for a fenced PostgreSQL writer).
        """
        ...

    def insert(self, sql: str, params: Params, key: str) -> int:
        """Run an ``INSERT`` of one row, as :meth:`write`; the row's generated integer
        ``key`` column.

        Raises:
            Exception: the backend's, as for :meth:`write`.
        """
        ...

    def transaction(self) -> AbstractContextManager[None]:
        """``with db.transaction(): ...`` groups writes into one atomic commit; a
        nested one joins the outer."""
        ...

    def in_transaction(self) -> bool: ...

    def on_commit(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` after every commit of an explicit transaction."""
        ...


def count_rows(db: SqlDb, sql: str, params: Params = ()) -> int:
    """The integer a ``SELECT COUNT(*)`` query returns."""
    row = db.read_one(sql, params)
    assert row is not None  # an aggregate without GROUP BY returns one row
    return int(row[0])
