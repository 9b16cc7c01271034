"""The PostgreSQL schema's migrations, and the workspace choosing PostgreSQL from
``[storage] url``, on a real cluster."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from fedsec.aggregator.storage.postgres import (
    LATEST,
    MIGRATIONS,
    PostgresStateStore,
    migrate,
    schema_version,
)
from fedsec.aggregator.storage.postgres.lease import NotLeader
from fedsec.aggregator.storage.sqlite import SqliteStateStore
from fedsec.aggregator.workspace import Workspace, init_workspace
from fedsec.config import default_federation_toml
from fedsec.errors import ConfigError

_STATE_TABLES = {
    "rounds",
    "joins",
    "messages",
    "reports",
    "receipts",
    "log",
    "challenges",
    "reveals",
    "server_state",
    "alerts",
    "access_tokens",
    "audit_verdicts",
}


def _tables(url: str) -> set[str]:
    with psycopg.connect(url) as db:
        rows = db.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
        ).fetchall()
    return {str(r[0]) for r in rows}


def test_versions_are_numbered_in_order() -> None:
    assert [v for v, _, _ in MIGRATIONS] == list(range(1, LATEST + 1))


def test_opening_an_empty_database_migrates_it_to_the_latest_version(database: str) -> None:
    with psycopg.connect(database, autocommit=True) as db:
        assert schema_version(db) == 0
    store = PostgresStateStore(database)
    store.close()
    assert _tables(database) >= _STATE_TABLES | {"schema_version"}
    with psycopg.connect(database, autocommit=True) as db:
        assert schema_version(db) == LATEST
        rows = db.execute("SELECT version, what FROM schema_version ORDER BY version").fetchall()
    assert rows == [(v, what) for v, what, _ in MIGRATIONS]
    PostgresStateStore(database).close()  # a second open applies nothing again
    with psycopg.connect(database) as db:
        assert db.execute("SELECT count(*) FROM schema_version").fetchone() == (LATEST,)


def test_a_database_newer_than_this_release_is_refused_unchanged(database: str) -> None:
    PostgresStateStore(database).close()
    with psycopg.connect(database, autocommit=True) as db:
        db.execute(
            "INSERT INTO schema_version (version, what) VALUES (%s, 'future')", (LATEST + 1,)
        )
        with pytest.raises(ValueError, match=f"schema version {LATEST + 1}, newer"):
            migrate(db)
        assert schema_version(db) == LATEST + 1
    with pytest.raises(ValueError, match="newer than this release"):
        PostgresStateStore(database)


def _toml(url: str) -> str:
    text = default_federation_toml("fed-pg")
    assert '\nurl = ""\n' in text
    return text.replace('\nurl = ""\n', f'\nurl = "{url}"\n')


def test_storage_url_selects_postgresql_and_sqlite_stays_the_default(
    database: str, tmp_path: Path
) -> None:
    embedded = init_workspace(tmp_path / "embedded", "fed-sqlite")
    try:
        assert isinstance(embedded.state, SqliteStateStore)
    finally:
        embedded.close()
    ws = init_workspace(tmp_path / "replicated", "fed-pg", config_text=_toml(database))
    try:
        assert isinstance(ws.state, PostgresStateStore)
        ws.state.rounds.open(1, 0, 1.0)
    finally:
        ws.close()
    assert not (tmp_path / "replicated" / "state.db").exists()
    again = Workspace.open(tmp_path / "replicated")
    try:
        row = again.state.rounds.latest()
        assert row is not None and (row.round, row.stage) == (1, "open")
    finally:
        again.close()


def test_an_unreachable_database_is_a_config_error_without_the_password(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match=r"storage\.url: cannot open") as refused:
        init_workspace(
            tmp_path / "ws",
            "fed-pg",
            config_text=_toml("postgresql://who:s3cret-pw@127.0.0.1:1/none?connect_timeout=2"),
        )
    assert "s3cret-pw" not in str(refused.value)


@pytest.mark.parametrize("previous", range(1, LATEST))
def test_an_older_database_migrates_to_the_latest_keeping_its_state(
    database: str, previous: int
) -> None:
    with psycopg.connect(database, autocommit=True) as db:
        assert migrate(db, upto=previous) == previous
        db.execute(
            "INSERT INTO rounds (round, attempt, stage, opened_at, stage_started_at) "
            "VALUES (4, 0, 'masked_input', 1.0, 2.0)"
        )
        db.execute("INSERT INTO log VALUES (0, %s)", (b"genesis",))
    assert ("leader_lease" in _tables(database)) == (previous >= 2)
    store = PostgresStateStore(database)
    try:
        row = store.rounds.latest()
        assert row is not None and (row.round, row.stage) == (4, "masked_input")
        assert store.log.log_tail() == (0, b"genesis")
        assert store.lease.current() is None
    finally:
        store.close()
    assert _tables(database) >= {"leader_lease", "nonces", "nonce_origin"}
    with psycopg.connect(database, autocommit=True) as db:
        assert schema_version(db) == LATEST


def test_two_workspaces_on_one_database_one_leads(database: str, tmp_path: Path) -> None:
    first = init_workspace(tmp_path / "ws", "fed-pg", config_text=_toml(database))
    second = Workspace.open(tmp_path / "ws")  # a standby started beside it
    try:
        first.state.rounds.open(1, 0, 1.0)
        with pytest.raises(NotLeader):
            second.state.rounds.open(2, 0, 2.0)
        assert [r.round for r in second.state.rounds.history()] == [1]
    finally:
        second.close()
        first.close()


def test_version_3_gains_the_lease_url_keeping_the_lease(database: str) -> None:
    with psycopg.connect(database, autocommit=True) as db:
        assert migrate(db, upto=3) == 3
        db.execute("INSERT INTO leader_lease VALUES (1, 'replica-a', 7, 50.0)")
    store = PostgresStateStore(database, holder="replica-b")
    try:
        lease = store.lease.current()
        assert lease is not None and (lease.holder, lease.token, lease.url) == ("replica-a", 7, "")
        store.lease.advertise("https://replica-b.example")
        assert store.lease.acquire(now=60.0)  # expired at 50: taken over, token 8
        lease = store.lease.current()
        assert lease is not None
        assert (lease.holder, lease.token, lease.url) == (
            "replica-b",
            8,
            "https://replica-b.example",
        )
    finally:
        store.close()
