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

Bound: the aggregator charges its per-member rate limit before a nonce is
recorded, so one member holds at most ``burst + rate x window`` live rows and no
member can fill the store for another.  Expired rows are deleted in batches.
"""

from __future__ import annotations

import math
import sqlite3
import time
from pathlib import Path
from typing import Final

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
        if not (math.isfinite(window_s) and window_s > 0):
            raise ValueError(f"nonce window must be a positive number of seconds, got {window_s}")
        self._window_s = float(window_s)
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
        if created < self.not_before:
            raise ReplayError(
                f"signed before restart: the request was created at {created}, before the "
                f"aggregator restarted at {self.not_before} after an unclean stop; sign it anew"
            )
        expiry = created + self._window_s
        if expiry < now:
            raise ReplayError(
                f"stale timestamp: a request created at {created} is older than the "
                f"{self._window_s:g} s replay window"
            )
        # one statement, so atomic across processes: a live row makes it change nothing
        changed = self._db.execute(
            "INSERT INTO nonces VALUES (?, ?, ?) ON CONFLICT (keyid, nonce) "
            "DO UPDATE SET expiry = excluded.expiry WHERE nonces.expiry < ?",
            (keyid, nonce, expiry, now),
        ).rowcount
        if changed != 1:
            raise ReplayError(
                f"replayed nonce: {keyid} already used nonce {nonce!r} within the last "
                f"{self._window_s:g} s"
            )
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
