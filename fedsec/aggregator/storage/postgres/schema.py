"""The PostgreSQL schema as numbered migrations, and the code that applies them.

Each migration is applied once, in order, in its own transaction together with the
row in ``schema_version`` that records it, so a crash part-way leaves the database at
the previous version, never between two.  Replicas starting together take a
transaction-scoped advisory lock first, so one applies a migration and the others
then find it recorded (a transaction-scoped lock ends with its transaction, which
is all this needs; leadership is *not* an advisory lock, see :mod:`.lease`).

Migrations are never edited once released: a change is a new one appended to
:data:`MIGRATIONS`, tested from the version before it.
"""

from __future__ import annotations

from typing import Any, Final

import psycopg

#: An arbitrary constant naming fedsec's migration lock among the database's advisory
#: locks ("fedsec" in ASCII).
_MIGRATION_LOCK: Final = 0x666564736563

_STATE_TABLES: Final = """
CREATE TABLE rounds (
    round integer NOT NULL,
    attempt integer NOT NULL,
    stage text NOT NULL,
    spec bytea,
    opened_at double precision NOT NULL,
    stage_started_at double precision NOT NULL,
    closed_at double precision,
    model_version integer,
    summary bytea,
    detail text NOT NULL DEFAULT '',
    PRIMARY KEY (round, attempt)
);
CREATE TABLE joins (
    round integer NOT NULL,
    attempt integer NOT NULL,
    member text NOT NULL,
    samples bigint NOT NULL,
    joined_at double precision NOT NULL,
    base_version integer,
    graph_commitment text NOT NULL DEFAULT '',
    PRIMARY KEY (round, attempt, member)
);
CREATE TABLE messages (
    seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    round integer NOT NULL,
    attempt integer NOT NULL,
    stage text NOT NULL,
    member text NOT NULL,
    body bytea NOT NULL,
    received_at double precision NOT NULL,
    UNIQUE (round, attempt, stage, member)
);
CREATE TABLE reports (
    round integer NOT NULL,
    attempt integer NOT NULL,
    member text NOT NULL,
    epsilon double precision NOT NULL,
    body bytea NOT NULL,
    PRIMARY KEY (round, attempt, member)
);
CREATE TABLE receipts (
    round integer NOT NULL,
    attempt integer NOT NULL,
    member text NOT NULL,
    body bytea NOT NULL,
    PRIMARY KEY (round, attempt, member)
);
CREATE TABLE log (
    idx bigint PRIMARY KEY,
    line bytea NOT NULL
);
CREATE TABLE challenges (
    round integer NOT NULL,
    attempt integer NOT NULL,
    member text NOT NULL,
    auditor text NOT NULL,
    body bytea NOT NULL,
    PRIMARY KEY (round, attempt, member, auditor)
);
CREATE TABLE reveals (
    round integer NOT NULL,
    attempt integer NOT NULL,
    member text NOT NULL,
    auditor text NOT NULL,
    body bytea NOT NULL,
    PRIMARY KEY (round, attempt, member, auditor)
);
CREATE TABLE server_state (
    name text PRIMARY KEY,
    value bytea NOT NULL
);
CREATE TABLE alerts (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kind text NOT NULL,
    subject text NOT NULL,
    detail text NOT NULL,
    raised_at double precision NOT NULL,
    acked_at double precision,
    acked_by text,
    ack_sha256 text NOT NULL
);
CREATE INDEX alerts_open ON alerts (kind, subject) WHERE acked_at IS NULL;
CREATE TABLE access_tokens (
    sha256 text PRIMARY KEY,
    observer text NOT NULL,
    scope text NOT NULL,
    issued_at double precision NOT NULL,
    expires_at double precision NOT NULL,
    revoked boolean NOT NULL DEFAULT false
);
CREATE TABLE audit_verdicts (
    round integer NOT NULL,
    attempt integer NOT NULL,
    member text NOT NULL,
    auditor text NOT NULL,
    passed boolean NOT NULL,
    failed text NOT NULL,
    received_at double precision NOT NULL,
    PRIMARY KEY (round, attempt, member, auditor)
);
"""

# One row, never deleted: the token only grows, so a deposed leader's token can never
# match again (deleting the row would restart it at 1).
_LEADER_LEASE: Final = """
CREATE TABLE leader_lease (
    id integer PRIMARY KEY CHECK (id = 1),
    holder text NOT NULL,
    token bigint NOT NULL CHECK (token > 0),
    expires_at double precision NOT NULL
);
CREATE RULE leader_lease_kept AS ON DELETE TO leader_lease DO INSTEAD NOTHING;
"""

# Shared by every replica, so a request accepted through one is a replay at another.
# nonce_origin records when the store first opened: requests signed before it were
# never seen by it (see fedsec.aggregator.nonces).
_NONCES: Final = """
CREATE TABLE nonces (
    keyid text NOT NULL,
    nonce text NOT NULL,
    expiry double precision NOT NULL,
    PRIMARY KEY (keyid, nonce)
);
CREATE INDEX nonces_expiry ON nonces (expiry);
CREATE TABLE nonce_origin (
    id integer PRIMARY KEY CHECK (id = 1),
    opened_at double precision NOT NULL
);
"""

# Where the lease holder answers, so a standby's 503 not_leader can name it; '' until
# the holder advertises (a leader that has not started serving yet).
_LEASE_URL: Final = """
ALTER TABLE leader_lease ADD COLUMN url text NOT NULL DEFAULT '';
"""

#: (version, what it does, its SQL), in order; version n is the n-th entry.
MIGRATIONS: Final[tuple[tuple[int, str, str], ...]] = (
    (1, "the aggregator's state tables (those of the SQLite state.db)", _STATE_TABLES),
    (2, "the leader lease and its fencing token", _LEADER_LEASE),
    (3, "the request nonces every replica refuses replays from", _NONCES),
    (4, "the URL the lease holder advertises", _LEASE_URL),
)

#: The version a store opened by this release migrates to.
LATEST: Final = MIGRATIONS[-1][0]


def schema_version(db: psycopg.Connection[tuple[Any, ...]]) -> int:
    """The newest migration recorded in the database; 0 for an empty database.

    Raises:
        psycopg.Error: the query fails.
    """
    exists = db.execute("SELECT to_regclass('schema_version') IS NOT NULL").fetchone()
    if not (exists and exists[0]):
        return 0
    row = db.execute("SELECT max(version) FROM schema_version").fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def migrate(db: psycopg.Connection[tuple[Any, ...]], upto: int = LATEST) -> int:
    """Apply every migration after the database's version, up to ``upto``; return the
    version reached.  ``db`` must be in autocommit mode and outside any transaction.

    Raises:
        ValueError: ``upto`` is not a known version, or the database is newer than
            this release (a rolled-back upgrade must not write to a newer schema).
        psycopg.Error: a migration fails; it is rolled back with its version row.
    """
    if not 0 <= upto <= LATEST:
        raise ValueError(f"no schema version {upto}; this release knows 0..{LATEST}")
    for version, what, sql in MIGRATIONS[:upto]:
        with db.transaction():
            db.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            db.execute(
                "CREATE TABLE IF NOT EXISTS schema_version (version integer PRIMARY KEY, "
                "applied_at timestamptz NOT NULL DEFAULT now(), what text NOT NULL)"
            )
            current = schema_version(db)
            if current > LATEST:
                raise ValueError(
                    f"the database is at schema version {current}, newer than this "
                    f"release's {LATEST}: upgrade fedsec before opening it"
                )
            if current >= version:
                continue
            db.execute(sql)
            db.execute(
                "INSERT INTO schema_version (version, what) VALUES (%s, %s)", (version, what)
            )
    return schema_version(db)
