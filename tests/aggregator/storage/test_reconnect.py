"""A broken connection to the state database (server restart, database failover,
network drop): the call that meets the break fails, nothing of its transaction is
kept, and the store reconnects under the same lease token."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from fedsec.aggregator.nonces import SharedNonceStore
from fedsec.aggregator.storage.postgres import PostgresStateStore
from fedsec.errors import ReplayError


@pytest.fixture
def leader(database: str) -> Iterator[PostgresStateStore]:
    store = PostgresStateStore(database, holder="replica-a")
    assert store.lease.acquire(now=100.0, ttl_s=5.0)
    yield store
    store.close()


def _cut(database: str, store: PostgresStateStore) -> None:
    """End the store's server session from outside, as a server restart does."""
    pid = store._conn.db.info.backend_pid
    with psycopg.connect(database, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))


def test_a_lone_write_after_a_break_fails_once_then_the_store_reconnects(
    database: str, leader: PostgresStateStore
) -> None:
    leader.values.put("k", b"before")
    _cut(database, leader)
    with pytest.raises(psycopg.OperationalError):
        leader.values.put("k", b"met the break")
    assert leader.values.get("k") == b"before"  # reconnected; the failed write is not there
    leader.values.put("k", b"after")  # the same token still leads
    assert leader.values.get("k") == b"after" and leader.lease.token == 1


def test_a_transaction_cut_mid_way_keeps_nothing(database: str, leader: PostgresStateStore) -> None:
    with pytest.raises(psycopg.OperationalError), leader.transaction():
        leader.rounds.open(1, 0, 1.0)
        _cut(database, leader)
        leader.joins.add(1, 0, "a", 10, 1.0)
    assert not leader.log.in_transaction()
    assert leader.rounds.latest() is None and leader.joins.samples(1, 0) == {}
    with leader.transaction():
        leader.rounds.open(1, 0, 2.0)
    row = leader.rounds.latest()
    assert row is not None and row.opened_at == 2.0


def test_the_shared_nonce_store_reconnects_after_a_break(database: str) -> None:
    store = SharedNonceStore(database, 600.0)
    try:
        created = store.not_before
        store.remember("k", "A" * 22, created, created)
        pid = store._table._db.info.backend_pid
        with psycopg.connect(database, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with pytest.raises(psycopg.OperationalError):
            store.remember("k", "B" * 22, created, created)
        with pytest.raises(ReplayError, match="replayed nonce"):  # still remembered
            store.remember("k", "A" * 22, created, created)
        store.remember("k", "B" * 22, created, created)
        assert len(store) == 2
    finally:
        store.close()
