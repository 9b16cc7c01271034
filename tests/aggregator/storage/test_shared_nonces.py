"""The request nonces shared by replicated aggregators in PostgreSQL: a replay
recorded through one replica is refused by the other."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fedsec.aggregator.nonces import (
    PersistentNonceStore,
    SharedNonceStore,
    open_nonce_store,
)
from fedsec.errors import ReplayError

NONCE = "A" * 22
OTHER = "B" * 22


def test_a_replay_recorded_through_one_replica_is_refused_by_the_other(database: str) -> None:
    first, second = SharedNonceStore(database, 600.0), SharedNonceStore(database, 600.0)
    try:
        now = time.time()
        created = max(int(now), first.not_before)
        first.remember("member-1", NONCE, created, now)
        assert second.seen("member-1", NONCE, now)
        with pytest.raises(ReplayError, match="replayed nonce: member-1 already used"):
            second.remember("member-1", NONCE, created, now)
        assert len(second) == 1 and len(first) == 1
        second.remember("member-1", OTHER, created, now)  # a fresh nonce is fine
        with pytest.raises(ReplayError, match="replayed nonce"):
            first.remember("member-1", OTHER, created, now)
        assert len(first) == 2
    finally:
        first.close()
        second.close()


def test_only_the_first_opening_refuses_older_signatures(database: str) -> None:
    first = SharedNonceStore(database, 600.0)
    assert first.not_before > 0  # it never saw requests from before it existed
    with pytest.raises(ReplayError, match="signed before restart"):
        first.remember("k", NONCE, first.not_before - 1, time.time())
    assert len(first) == 0
    first.close()
    # a replica opened later, or a restart: every acknowledged nonce is committed
    again = SharedNonceStore(database, 600.0)
    try:
        assert again.not_before == 0
        again.remember("k", NONCE, int(time.time()) - 5, time.time())
    finally:
        again.close()


def test_an_expired_nonce_is_forgotten_and_purged(database: str) -> None:
    store = SharedNonceStore(database, 10.0)
    try:
        created = store.not_before
        store.remember("k", NONCE, created, created)
        with pytest.raises(ReplayError, match="stale timestamp"):
            store.remember("k", OTHER, created, created + 11.0)
        assert not store.seen("k", NONCE, created + 11.0)
        store.remember("k", NONCE, created + 11, created + 11.0)  # its window has passed
        store.remember("k", OTHER, created, created)
        assert store.purge(created + 15.0) == 1 and len(store) == 1
    finally:
        store.close()


def test_the_workspace_url_chooses_the_nonce_store(database: str, tmp_path: Path) -> None:
    embedded = open_nonce_store(tmp_path, "", 600.0)
    shared = open_nonce_store(tmp_path, database, 600.0)
    try:
        assert isinstance(embedded, PersistentNonceStore)
        assert (tmp_path / "nonces.db").exists()
        assert isinstance(shared, SharedNonceStore)
    finally:
        embedded.close()
        shared.close()
