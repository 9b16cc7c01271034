"""The round engine on PostgreSQL, unchanged: a whole SecAgg+ round, and a standby that
takes the lease over mid-round and finishes the round through the restart replay path
while the deposed leader can change nothing.

Both replicas open one workspace directory (the model files and keys every replica
mounts, docs/deployment.md) and one database; the coordinator is driven directly.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import cast

import numpy as np
import pytest

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.storage.postgres import PostgresStateStore
from fedsec.aggregator.storage.postgres.lease import LEASE_S, NotLeader
from fedsec.aggregator.workspace import Workspace
from tests.support.aggregator import (
    Cohort,
    FakeClock,
    Federation,
    advertise_all,
    expected_params,
    fetch_shares,
    fix_cohort,
    make_federation,
    mask_all,
    model_params,
    share_all,
    unmask_all,
)

MEMBERS = ("a0", "a1", "a2", "a3", "a4")


def _federation(root: Path, database: str) -> Federation:
    return make_federation(root, sections={"storage": {"url": database}})


def _start(fed: Federation, clock: FakeClock) -> tuple[Coordinator, Cohort]:
    coord = Coordinator(fed.ws, clock=clock)
    return coord, fix_cohort(coord, fed.identities, MEMBERS)


def _closed_with_the_exact_sum(ws: Workspace, cohort: Cohort) -> None:
    assert [(r.round, r.attempt, r.stage) for r in ws.state.rounds.history()] == [
        (1, 0, "closed"),
        (2, 0, "open"),
    ]
    exact = expected_params(
        model_params(ws, 1), [cohort.quantized[m] for m in MEMBERS], cohort.spec
    )
    np.testing.assert_array_equal(model_params(ws, 2), exact)


def test_a_whole_round_on_postgresql(tmp_path: Path, database: str) -> None:
    clock = FakeClock()
    fed = _federation(tmp_path / "ws", database)
    try:
        assert isinstance(fed.ws.state, PostgresStateStore)
        coord, cohort = _start(fed, clock)
        advertise_all(coord, cohort, MEMBERS)
        share_all(coord, cohort, MEMBERS)
        fetch_shares(coord, cohort, MEMBERS)
        mask_all(coord, cohort, MEMBERS)
        unmask_all(coord, cohort, MEMBERS)
        _closed_with_the_exact_sum(fed.ws, cohort)
    finally:
        fed.ws.close()


def test_a_standby_takes_over_mid_round_and_the_deposed_leader_changes_nothing(
    tmp_path: Path, database: str
) -> None:
    clock = FakeClock()
    fed = _federation(tmp_path / "ws", database)
    standby = Workspace.open(tmp_path / "ws")  # the lease is live: it does not lead
    try:
        leader, cohort = _start(fed, clock)
        advertise_all(leader, cohort, MEMBERS)
        share_all(leader, cohort, MEMBERS)
        fetch_shares(leader, cohort, MEMBERS)
        first = {m: leader.masked_input(m, 1, 0, *cohort.upload(m)) for m in MEMBERS[:2]}

        # the leader is paused past its lease; the standby takes over and resumes
        lease = cast(PostgresStateStore, standby.state).lease
        assert lease.acquire(time.time() + 2 * LEASE_S)
        taken_over = Coordinator(standby, clock=clock)
        assert taken_over.receipt("a0", 1) == first["a0"]  # same answer to a retry

        # the deposed leader wakes up and accepts an input: refused, nothing stored
        with pytest.raises(NotLeader, match="was deposed"):
            leader.masked_input("a2", 1, 0, *cohort.upload("a2"))
        assert standby.state.messages.get(1, 0, "masked_input", "a2") is None
        assert cast(PostgresStateStore, fed.ws.state).lease.refused >= 1

        rest = {m: taken_over.masked_input(m, 1, 0, *cohort.upload(m)) for m in MEMBERS[2:]}
        assert set(rest) == set(MEMBERS[2:])
        unmask_all(taken_over, cohort, MEMBERS)
        _closed_with_the_exact_sum(standby, cohort)
    finally:
        standby.close()
        fed.ws.close()
