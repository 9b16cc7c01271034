"""One leader, fenced: a deposed aggregator's writes are refused and change nothing.

Two store objects on one real PostgreSQL database stand for two aggregator processes.
Time is passed in (``now``), so a lease expires without waiting for it.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from fedsec.aggregator.storage.postgres import PostgresStateStore
from fedsec.aggregator.storage.postgres.lease import NotLeader


@pytest.fixture
def old(database: str) -> Iterator[PostgresStateStore]:
    store = PostgresStateStore(database, holder="replica-a")
    assert store.lease.acquire(now=100.0, ttl_s=5.0)
    yield store
    store.close()


@pytest.fixture
def new(database: str) -> Iterator[PostgresStateStore]:
    store = PostgresStateStore(database, holder="replica-b")
    yield store
    store.close()


def test_a_deposed_leaders_writes_are_refused_and_change_nothing(
    old: PostgresStateStore, new: PostgresStateStore
) -> None:
    old.rounds.open(1, 0, 100.0)
    assert not new.lease.acquire(now=104.0, ttl_s=5.0)  # the lease is live: no take-over
    assert new.lease.acquire(now=106.0, ttl_s=5.0)  # expired: replica-b takes over
    assert (old.lease.token, new.lease.token) == (1, 2)

    # replica-a wakes up (it was paused) and carries on as if it still led
    with pytest.raises(NotLeader, match="replica-b leads") as refused:
        old.rounds.set_stage(1, 0, "advertise", 107.0, spec=b"from the deposed leader")
    assert refused.value.leader == "replica-b" and refused.value.code == "not_leader"
    with pytest.raises(NotLeader), old.transaction():
        old.messages.add(1, 0, "advertise", "m0", b"keys")
        old.log.add_log_line(0, b"a forged log line")
    with pytest.raises(NotLeader):
        old.values.put("fedadam.m", b"stale moments")
    assert old.lease.refused == 3

    row = new.rounds.get(1, 0)
    assert row is not None and (row.stage, row.spec, row.stage_started_at) == ("open", None, 100)
    assert new.messages.count(1, 0, "advertise") == 0
    assert new.log.log_tail() is None and new.values.get("fedadam.m") is None
    assert not old.log.in_transaction()

    new.rounds.set_stage(1, 0, "advertise", 108.0, spec=b"spec")  # the leader writes
    row = new.rounds.get(1, 0)
    assert row is not None and row.spec == b"spec"


def test_a_take_over_never_lands_inside_the_leaders_transaction(
    old: PostgresStateStore, new: PostgresStateStore
) -> None:
    # the fence is read FOR SHARE: while replica-a's transaction is open its check stays
    # true, so the take-over cannot slip in between the check and the commit
    with old.transaction():
        old.rounds.open(1, 0, 100.0)
        assert not new.lease.acquire(now=104.0, ttl_s=5.0)  # live lease: not now
    assert new.rounds.get(1, 0) is not None  # replica-a's transaction committed whole
    with pytest.raises(NotLeader):
        assert new.lease.acquire(now=106.0, ttl_s=5.0)
        old.rounds.open(2, 0, 107.0)
    assert new.rounds.get(2, 0) is None


def test_every_take_over_has_a_new_token_and_a_renewal_keeps_it(
    old: PostgresStateStore, new: PostgresStateStore, database: str
) -> None:
    assert old.lease.renew(now=104.0, ttl_s=5.0) and old.lease.token == 1
    assert not new.lease.acquire(now=108.0, ttl_s=5.0)  # renewed until 109
    old.lease.release()  # a clean stop: replica-b need not wait for the expiry
    assert new.lease.acquire(now=108.0, ttl_s=5.0) and new.lease.token == 2
    assert not old.lease.renew(now=108.5, ttl_s=5.0)  # deposed: renewal refused
    lease = new.lease.current()
    assert lease is not None and (lease.holder, lease.token) == ("replica-b", 2)
    # replica-a restarted under the same name is a new leader, with a new token
    again = PostgresStateStore(database, holder="replica-a")
    try:
        assert again.lease.acquire(now=120.0, ttl_s=5.0) and again.lease.token == 3
        with pytest.raises(NotLeader, match="replica-a leads with token 3"):
            old.values.put("k", b"the first replica-a's")
        again.values.put("k", b"v")
        assert new.values.get("k") == b"v"
        # the row is never deleted, so the token can never restart at 1
        with psycopg.connect(database, autocommit=True) as db:
            db.execute("DELETE FROM leader_lease")
        lease = new.lease.current()
        assert lease is not None and lease.token == 3
    finally:
        again.close()


def test_a_store_that_never_led_writes_nothing(new: PostgresStateStore) -> None:
    with pytest.raises(NotLeader, match="no aggregator holds the leader lease") as refused:
        new.rounds.open(1, 0, 1.0)
    assert refused.value.leader is None and new.lease.refused == 1
    assert new.rounds.latest() is None  # reads work: a standby can answer with state


def test_a_leader_paused_inside_a_transaction_does_not_hold_the_take_over_off(
    old: PostgresStateStore, new: PostgresStateStore
) -> None:
    # replica-a stops (SIGSTOP) between two statements of a transaction: its FOR SHARE
    # lock on the lease row would hold every take-over off until PostgreSQL ends the
    # idle transaction (60 s); once the lease has expired, the take-over ends it
    paused = old.transaction()
    paused.__enter__()
    old.values.put("k", b"half of a paused transaction")
    assert not new.lease.acquire(now=104.0, ttl_s=5.0)  # live lease: nothing ended
    assert old.log.in_transaction()
    took = [new.lease.acquire(now=106.0, ttl_s=5.0) for _ in range(2)]
    assert took[-1] and new.lease.token == 2
    # replica-a wakes: its transaction is gone, nothing of it was kept
    with pytest.raises(psycopg.OperationalError):
        paused.__exit__(None, None, None)
    assert new.values.get("k") is None
    with pytest.raises(NotLeader):
        old.values.put("k", b"after waking")
    assert new.values.get("k") is None
