"""The leader keeps its lease while it runs, and loses it once it stops renewing.

Real time here (the keeper renews from a thread with the wall clock), with short
leases; every wait is on a condition with a deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from fedsec.aggregator.storage.leadership import LocalRole, local_role
from fedsec.aggregator.storage.postgres import PostgresStateStore

TTL_S = 0.6
DEADLINE_S = 10.0


def _until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        time.sleep(0.02)


@pytest.fixture
def stores(database: str) -> Iterator[tuple[PostgresStateStore, PostgresStateStore]]:
    a = PostgresStateStore(database, holder="replica-a")
    b = PostgresStateStore(database, holder="replica-b")
    yield a, b
    a.close()
    b.close()


def _expiry(store: PostgresStateStore) -> float:
    lease = store.lease.current()
    assert lease is not None
    return lease.expires_at


def test_a_kept_lease_outlives_its_ttl_and_expires_once_renewal_stops(
    stores: tuple[PostgresStateStore, PostgresStateStore],
) -> None:
    a, b = stores
    assert a.lease.acquire(time.time(), TTL_S)
    first = _expiry(a)
    a.lease.keep(TTL_S)
    _until(lambda: _expiry(a) > first + TTL_S)  # renewed past the first expiry
    assert time.time() > first  # ...which has passed: without the keeper b would lead
    assert not b.lease.acquire(time.time(), TTL_S)
    a.lease.stop_keeping()  # as if the process were stopped
    last = _expiry(a)
    _until(lambda: time.time() > last)
    assert b.lease.acquire(time.time(), TTL_S) and b.lease.token == 2


def test_the_keeper_stops_once_another_replica_took_over(
    stores: tuple[PostgresStateStore, PostgresStateStore],
) -> None:
    a, b = stores
    assert a.lease.acquire(time.time(), TTL_S)
    a.lease.keep(TTL_S)
    keeper = a.lease._keeper
    assert keeper is not None and keeper.is_alive()
    assert b.lease.acquire(time.time() + 10 * TTL_S, TTL_S)  # b's clock is ahead
    assert not a.lease.deposed
    _until(lambda: not keeper.is_alive())  # its renewal found a newer token
    assert a.lease.deposed  # ...and told its store, which now stands by
    assert local_role(a).role == "standby" and local_role(b).role == "leader"
    refusal = a.lease.standby_refusal()
    assert refusal is not None and refusal.leader == "replica-b"
    lease = b.lease.current()
    assert lease is not None and (lease.holder, lease.token) == ("replica-b", 2)
    assert a.lease.acquire(time.time() + 20 * TTL_S, TTL_S)  # it may lead again later
    assert not a.lease.deposed and local_role(a) == LocalRole("leader", 3, 0)
