"""Replay refusal that survives restarts: the request nonces, persisted in SQLite.

A signed request is valid for ``clock_skew_s`` on either side of its ``created``
time, so an in-memory nonce cache forgets, at a restart, nonces whose requests
could still be replayed for up to that long.  :class:`PersistentNonceStore` keeps
every verified ``(keyid, nonce)`` with its expiry in ``nonces.db`` beside the state
database, and the primary key makes "record unless seen" one atomic insert, so it
stays correct when several aggregator processes share the file (and a shared SQL
database can implement the same :class:`~fedsec.crypto.httpsig.NonceStore`).

Why persist rather than only refuse signatures created before the process started:
that rule alone would refuse every honest request signed in the seconds around a
restart, and for as long as an agent's clock lags, after every restart.  Nonces are
committed with ``synchronous=NORMAL`` (WAL): a committed insert survives the
process crashing, at ~30 µs a request instead of an fsync each (~0.5 ms, on the
event loop, nine times per member and round).  Only an OS crash or power loss can
lose the newest inserts, so the store also records whether it was closed cleanly:
after an unclean stop, and on a fresh file (which never saw the earlier requests),
it refuses signatures created before it was opened.  The residue is a request
created in the same second as the restart; ``created`` has one-second resolution.

Replicated aggregators (``[storage] url`` names a PostgreSQL database) share one
:class:`SharedNonceStore` instead, so a request accepted through one replica is a
replay at every other; :func:`open_nonce_store` chooses.

Bound: the aggregator charges its per-member rate limit before a nonce is
recorded, so one member holds at most ``burst + rate x window`` live rows and no
member can fill the store for another.  Expired rows are deleted in batches.
"""

from __future__ import annotations

import math
import sqlite3
import time
from pathlib import Path
from typing import Final, Protocol

from fedsec.crypto.httpsig import NonceStore
from fedsec.errors import ReplayError

NONCE_DB: Final = "nonces.db"
#: Inserts between deletions of expired rows: one indexed DELETE per 1 000 requests
#: keeps the table near its live size at a negligible share of request time.
PURGE_EVERY: Final = 1000

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS nonces (
    keyid TEXT NOT NULL,
    nonce TEXT NOT NULL,
    expiry REAL NOT NULL,
    PRIMARY KEY (keyid, nonce)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS nonces_expiry ON nonces (expiry);
CREATE TABLE IF NOT EXISTS meta (
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""


class DurableNonceStore(NonceStore, Protocol):
    """A :class:`~fedsec.crypto.httpsig.NonceStore` that outlives the process: what the
    HTTP layer holds, in SQLite (:class:`PersistentNonceStore`) or shared by replicated
    aggregators in PostgreSQL (:class:`SharedNonceStore`)."""

    #: Signatures created before this are refused: the store cannot vouch for them.
    not_before: int

    def __len__(self) -> int: ...

    def purge(self, now: float) -> int:
        """Delete every expired row; return how many."""
        ...

    def close(self) -> None:
        """Release the store (a clean stop)."""
        ...


def open_nonce_store(root: Path, url: str, window_s: float) -> DurableNonceStore:
    """The nonce store of a workspace: ``nonces.db`` in ``root``, or the shared
    PostgreSQL database ``url`` names (``[storage] url``), so that a request accepted
    through one replica is a replay at every other.

    Raises:
        ValueError: ``window_s`` is not a positive number, or the database's schema is
            newer than this release.
        sqlite3.Error, psycopg.Error: the store cannot be opened.
    """
    if not url:
        return PersistentNonceStore(root / NONCE_DB, window_s)
    return SharedNonceStore(url, window_s)


def _positive_window(window_s: float) -> float:
    if not (math.isfinite(window_s) and window_s > 0):
        raise ValueError(f"nonce window must be a positive number of seconds, got {window_s}")
    return float(window_s)


def _admitted(store: DurableNonceStore, created: int, now: float) -> float:
    """The expiry of a request created at ``created``, if the store may admit it.

    Raises:
        ReplayError: signed before the store could vouch for nonces, or outside the window.
    """
    if created < store.not_before:
        raise ReplayError(
            f"signed before restart: the request was created at {created}, before the "
            f"aggregator restarted at {store.not_before} after an unclean stop; sign it anew"
        )
    expiry = created + store.window_s
    if expiry < now:
        raise ReplayError(
            f"stale timestamp: a request created at {created} is older than the "
            f"{store.window_s:g} s replay window"
        )
    return expiry


def _replayed(store: DurableNonceStore, keyid: str, nonce: str) -> ReplayError:
    return ReplayError(
        f"replayed nonce: {keyid} already used nonce {nonce!r} within the last {store.window_s:g} s"
    )


class PersistentNonceStore:
    """A :class:`~fedsec.crypto.httpsig.NonceStore` in an SQLite file (WAL).

    Args:
        path: the database file (created if absent).
        window_s: seconds after ``created`` that a nonce is remembered.

    Raises:
        ValueError: ``window_s`` is not a positive number.
        sqlite3.Error: the file cannot be opened or is not this store's database.
    """

    def __init__(self, path: Path, window_s: float) -> None:
        self._window_s = _positive_window(window_s)
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(_SCHEMA)
        clean = self._db.execute("SELECT value FROM meta WHERE name = 'clean'").fetchone()
        opened = int(time.time())
        #: Signatures created before this are refused: the store cannot vouch for
        #: their nonces (fresh file, or the last run did not close cleanly).
        self.not_before: int = 0 if clean is not None and clean[0] == "1" else opened
        # durable before any request is accepted, so a crash from here on reads unclean
        self._db.execute("INSERT OR REPLACE INTO meta VALUES ('clean', '0')")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._inserts = 0

    @property
    def window_s(self) -> float:
        return self._window_s

    def __len__(self) -> int:
        return int(self._db.execute("SELECT count(*) FROM nonces").fetchone()[0])

    def seen(self, keyid: str, nonce: str, now: float) -> bool:
        """Whether ``nonce`` from ``keyid`` is recorded and its window has not passed."""
        row = self._db.execute(
            "SELECT expiry FROM nonces WHERE keyid = ? AND nonce = ?", (keyid, nonce)
        ).fetchone()
        return row is not None and now <= row[0]

    def remember(self, keyid: str, nonce: str, created: int, now: float) -> None:
        """Record a verified request's nonce until ``created + window_s``.

        Raises:
            ReplayError: the request was signed before this store could vouch for
                nonces, is outside the window, or its nonce is already recorded.
        """
        expiry = _admitted(self, created, now)
        # one statement, so atomic across processes: a live row makes it change nothing
        changed = self._db.execute(
            "INSERT INTO nonces VALUES (?, ?, ?) ON CONFLICT (keyid, nonce) "
            "DO UPDATE SET expiry = excluded.expiry WHERE nonces.expiry < ?",
            (keyid, nonce, expiry, now),
        ).rowcount
        if changed != 1:
            raise _replayed(self, keyid, nonce)
        self._inserts += 1
        if self._inserts % PURGE_EVERY == 0:
            self.purge(now)

    def purge(self, now: float) -> int:
        """Delete every expired row; return how many."""
        return self._db.execute("DELETE FROM nonces WHERE expiry < ?", (now,)).rowcount

    def close(self) -> None:
        """Mark a clean stop (every insert is committed) and close the file."""
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("INSERT OR REPLACE INTO meta VALUES ('clean', '1')")
        self._db.close()


class SharedNonceStore:
    """A :class:`DurableNonceStore` in the PostgreSQL database replicated aggregators
    share (:mod:`fedsec.aggregator.storage.postgres.nonces`): a nonce recorded through
    one replica is refused by every other.  Commits are durable when they return, so only
    a store opened for the first time refuses signatures from before it existed.

    Args:
        url: the ``postgresql://`` URL of ``[storage] url``.
        window_s: seconds after ``created`` that a nonce is remembered.

    Raises:
        ValueError: ``window_s`` is not a positive number, or the schema is newer than
            this release.
        psycopg.Error: the database cannot be reached.
    """

    def __init__(self, url: str, window_s: float) -> None:
        # imported here: only a PostgreSQL deployment needs psycopg
        from fedsec.aggregator.storage.postgres.nonces import PostgresNonces

        self._window_s = _positive_window(window_s)
        opened = int(time.time())
        self._table = PostgresNonces(url, opened)
        self.not_before: int = opened if self._table.fresh else 0
        self._inserts = 0

    @property
    def window_s(self) -> float:
        return self._window_s

    def __len__(self) -> int:
        return self._table.count()

    def seen(self, keyid: str, nonce: str, now: float) -> bool:
        """Whether ``nonce`` from ``keyid`` is recorded and its window has not passed."""
        expiry = self._table.expiry(keyid, nonce)
        return expiry is not None and now <= expiry

    def remember(self, keyid: str, nonce: str, created: int, now: float) -> None:
        """Record a verified request's nonce until ``created + window_s``.

        Raises:
            ReplayError: signed before the store existed, outside the window, or the
                nonce is already recorded (through this replica or another).
        """
        if not self._table.record(keyid, nonce, _admitted(self, created, now), now):
            raise _replayed(self, keyid, nonce)
        self._inserts += 1
        if self._inserts % PURGE_EVERY == 0:
            self.purge(now)

    def purge(self, now: float) -> int:
        """Delete every expired row; return how many."""
        return self._table.purge(now)

    def close(self) -> None:
        self._table.close()
