"""The persistent nonce store and the per-member rate limit of the aggregator."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from fedsec.aggregator.nonces import PURGE_EVERY, PersistentNonceStore
from fedsec.aggregator.ratelimit import MemberRateLimit
from fedsec.crypto.httpsig import RequestVerifier, sign_request
from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import RateLimited, ReplayError

NONCE = "A" * 22
OTHER = "B" * 22


def _opened(path: Path, window_s: float = 600.0) -> PersistentNonceStore:
    return PersistentNonceStore(path, window_s)


def test_a_nonce_is_refused_again_after_a_clean_restart(tmp_path: Path) -> None:
    store = _opened(tmp_path / "n.db")
    now = time.time()
    store.remember("k", NONCE, int(now), now)
    store.close()
    again = _opened(tmp_path / "n.db")
    assert again.not_before == 0  # clean stop: every nonce is on disk
    assert again.seen("k", NONCE, now)
    with pytest.raises(ReplayError, match="replayed nonce"):
        again.remember("k", NONCE, int(now), now)
    again.remember("k", OTHER, int(now), now)  # a fresh nonce is fine
    assert len(again) == 2


def test_after_an_unclean_stop_older_signatures_are_refused(tmp_path: Path) -> None:
    now = time.time()
    store = _opened(tmp_path / "n.db")
    store.not_before = 0  # as if opened earlier
    store.remember("k", NONCE, int(now) - 5, now)
    # no close(): the process died; the committed row survives, but newer inserts
    # could have been lost with the OS, so older signatures are no longer vouched for
    again = _opened(tmp_path / "n.db")
    assert again.not_before >= int(now)
    with pytest.raises(ReplayError, match="signed before restart"):
        again.remember("k", OTHER, int(now) - 5, time.time())
    assert len(again) == 1
    again.remember("k", OTHER, again.not_before, time.time())


def test_a_fresh_store_refuses_signatures_from_before_it_existed(tmp_path: Path) -> None:
    store = _opened(tmp_path / "n.db")
    with pytest.raises(ReplayError, match="signed before restart"):
        store.remember("k", NONCE, store.not_before - 1, time.time())
    assert len(store) == 0


def test_two_processes_sharing_the_file_accept_a_nonce_once(tmp_path: Path) -> None:
    now = time.time()
    first = _opened(tmp_path / "n.db")
    second = _opened(tmp_path / "n.db")
    second.not_before = first.not_before  # both opened in the same second or so
    created = max(first.not_before, int(now))
    first.remember("k", NONCE, created, now)
    with pytest.raises(ReplayError, match="replayed nonce"):
        second.remember("k", NONCE, created, now)


def test_an_expired_nonce_may_be_recorded_again_and_purge_keeps_live_rows(
    tmp_path: Path,
) -> None:
    store = _opened(tmp_path / "n.db", window_s=10.0)
    t0 = float(store.not_before)
    store.remember("k", NONCE, int(t0), t0)
    store.remember("k", OTHER, int(t0) + 8, t0 + 8)
    # NONCE's window has passed: the row is stale, not a replay
    assert not store.seen("k", NONCE, t0 + 11)
    store.remember("k", NONCE, int(t0) + 11, t0 + 11)
    assert store.purge(t0 + 17.5) == 0
    assert store.purge(t0 + 19.5) == 1  # OTHER (expiry t0 + 18) goes; NONCE stays
    assert len(store) == 1
    with pytest.raises(ReplayError, match="stale timestamp"):
        store.remember("k", "C" * 22, int(t0), t0 + 30)


def test_purge_runs_by_itself_every_so_many_inserts(tmp_path: Path) -> None:
    store = _opened(tmp_path / "n.db", window_s=1.0)
    t0 = float(store.not_before)
    store.remember("old", NONCE, int(t0), t0)
    for i in range(PURGE_EVERY - 1):
        store.remember("k", f"{i:022d}", int(t0) + 5, t0 + 5)
    assert len(store) == PURGE_EVERY - 1  # the expired row went with the 1000th insert


def test_the_verifier_refuses_a_replay_across_a_restart(tmp_path: Path) -> None:
    alice = SigningIdentity.generate()
    keys = {alice.key_id: alice.public_bytes}
    headers = sign_request(alice, "POST", "/v1/rounds/1/join", {}, b"{}")
    store = _opened(tmp_path / "n.db")
    store.not_before = 0
    verifier = RequestVerifier(keys.get, store, max_skew_s=300.0)
    assert verifier.verify("POST", "/v1/rounds/1/join", headers, b"{}") == alice.key_id
    store.close()
    restarted = RequestVerifier(keys.get, _opened(tmp_path / "n.db"), max_skew_s=300.0)
    with pytest.raises(ReplayError, match="replayed nonce"):
        restarted.verify("POST", "/v1/rounds/1/join", headers, b"{}")


def test_store_file_is_not_another_database(tmp_path: Path) -> None:
    (tmp_path / "n.db").write_bytes(b"not sqlite" * 100)
    with pytest.raises(sqlite3.DatabaseError):
        _opened(tmp_path / "n.db")


def test_rate_limit_is_per_key_and_refills() -> None:
    limit = MemberRateLimit(rate_per_s=2.0, burst=3)
    for _ in range(3):
        limit.charge("alice", 100.0)
    with pytest.raises(RateLimited, match="alice sent more than 2") as info:
        limit.charge("alice", 100.0)
    assert info.value.http_status == 429 and info.value.retry_after == pytest.approx(0.5)
    limit.charge("bob", 100.0)  # another key is untouched
    limit.charge("alice", 100.5)  # one token back after 1/rate seconds
    with pytest.raises(RateLimited):
        limit.charge("alice", 100.5)
    for _ in range(3):  # never more than the burst after a long idle time
        limit.charge("alice", 1000.0)
    with pytest.raises(RateLimited):
        limit.charge("alice", 1000.0)


def test_rate_limit_configuration_is_checked() -> None:
    with pytest.raises(ValueError, match="rate > 0"):
        MemberRateLimit(0.0, 1)
    with pytest.raises(ValueError, match="burst >= 1"):
        MemberRateLimit(1.0, 0)
