"""The request nonces in PostgreSQL (table ``nonces``), shared by every replica.

Not fenced by the leader lease: a standby verifies requests too (to answer them with
``not_leader``), and recording a nonce can only make a later request be refused, so a
deposed leader writing one harms nothing.  Its own connection in autocommit mode: a
nonce must be committed when the request is verified, whatever transaction the state
store's connection is in.  Commits are durable when they return, so unlike the SQLite
file there is no unclean stop to recover from.
"""

from __future__ import annotations

from typing import Any

import psycopg

from fedsec.aggregator.storage.postgres.connection import reaching
from fedsec.aggregator.storage.postgres.schema import migrate


class PostgresNonces:
    """The nonce table: atomic "record unless seen", lookups and purging.

    Args:
        url: the ``postgresql://`` URL of the aggregators' shared database.
        now: the time of opening.

    Raises:
        psycopg.Error: the server cannot be reached or a migration fails.
        ValueError: the database's schema is newer than this release.
    """

    def __init__(self, url: str, now: float) -> None:
        self._url = url
        self._db = self._connect()
        created = self._db.execute(
            "INSERT INTO nonce_origin VALUES (1, %s) ON CONFLICT (id) DO NOTHING RETURNING 1",
            (now,),
        ).fetchone()
        #: True when this opening created the store: no replica has recorded a nonce yet.
        self.fresh = created is not None

    def _connect(self) -> psycopg.Connection[tuple[Any, ...]]:
        db: psycopg.Connection[tuple[Any, ...]] = psycopg.connect(self._url, autocommit=True)
        migrate(db)
        return db

    def _execute(self, sql: str, params: tuple[Any, ...] = ()) -> psycopg.Cursor[tuple[Any, ...]]:
        # every statement commits by itself, so after a break (server restart, failover)
        # the next one can simply reconnect: the one that met the break has failed
        # (PostgresUnavailable when the server cannot be reached)
        with reaching(lambda: self._db):
            if self._db.broken:
                self._db = self._connect()
            return self._db.execute(sql, params)

    def count(self) -> int:
        row = self._execute("SELECT count(*) FROM nonces").fetchone()
        assert row is not None
        return int(row[0])

    def expiry(self, keyid: str, nonce: str) -> float | None:
        row = self._execute(
            "SELECT expiry FROM nonces WHERE keyid = %s AND nonce = %s", (keyid, nonce)
        ).fetchone()
        return float(row[0]) if row else None

    def record(self, keyid: str, nonce: str, expiry: float, now: float) -> bool:
        """Record the nonce unless a live row holds it; False when one does.  One
        statement, so atomic across replicas."""
        cur = self._execute(
            "INSERT INTO nonces VALUES (%s, %s, %s) ON CONFLICT (keyid, nonce) "
            "DO UPDATE SET expiry = excluded.expiry WHERE nonces.expiry < %s",
            (keyid, nonce, expiry, now),
        )
        return cur.rowcount == 1

    def purge(self, now: float) -> int:
        return self._execute("DELETE FROM nonces WHERE expiry < %s", (now,)).rowcount

    def close(self) -> None:
        self._db.close()
