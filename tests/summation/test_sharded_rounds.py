"""A sharded round through the real coordinator: the spec carries the seed's groups, each
member is relayed its group's data only, the model is the exact sum of every member's
input (one session's model), a restart mid-round resumes every group, the log names each
group's members and sum hash, and ``fedsec audit verify`` unmasks each group again."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.workspace import Workspace
from fedsec.audit.verify import verify_log
from fedsec.errors import ConfigError
from fedsec.protocol.log_entries import GroupSumEntry
from fedsec.protocol.shards import split_cohort
from fedsec.summation.group_worker import GroupWorker
from fedsec.summation.sharded import ShardedSession
from tests.aggregator.test_robust_rounds import _rewrite_aggregate
from tests.support.aggregator import (
    Cohort,
    FakeClock,
    Federation,
    advertise_all,
    attempt_of,
    expected_params,
    fetch_shares,
    fix_cohort,
    join_request,
    log_entries,
    make_federation,
    mask_all,
    model_params,
    share_all,
)

MEMBERS = tuple(f"a{i}" for i in range(8))
SHARDED = {"min_agents": 8, "shards": 2, "min_shard_members": 4}


def _start(
    root: Path, clock: FakeClock, workers: bool = False
) -> tuple[Federation, Coordinator, Cohort]:
    round_ = {**SHARDED, "shard_workers": workers}
    fed = make_federation(root, agents=MEMBERS, round=round_, validation=False)
    coord = Coordinator(fed.ws, clock=clock)
    return fed, coord, fix_cohort(coord, fed.identities, MEMBERS)


def _finish(coord: Coordinator, cohort: Cohort) -> None:
    r, a = attempt_of(coord)
    for m in MEMBERS:
        coord.consistency(m, r, a, cohort.sign(m, coord.unmask_request(m, r, a)))
    for m in MEMBERS:
        coord.unmask(m, r, a, cohort.unmask(m, coord.consistency_proof(m, r, a)))


@pytest.mark.parametrize(
    "workers",
    [False, pytest.param(True, marks=pytest.mark.slow)],  # four worker processes start
    ids=["in-process", "worker-processes"],
)
def test_a_sharded_round_closes_with_one_sessions_model_and_verifies(
    tmp_path: Path, workers: bool
) -> None:
    clock = FakeClock()
    fed, coord, cohort = _start(tmp_path / "ws", clock, workers)
    spec = cohort.spec
    assert [g.members for g in spec.groups] == split_cohort(spec.cohort, spec.seed, 2)
    session = coord.live.summation
    assert isinstance(session, ShardedSession)
    assert all(isinstance(g, GroupWorker) == workers for g in session.groups)
    advertise_all(coord, cohort, MEMBERS)
    r, a = attempt_of(coord)
    for m in MEMBERS:  # each member is told only its group's keys
        group = next(g.members for g in spec.groups if m in g.members)
        assert [e.member for e in coord.key_list(m, r, a).entries] == group
    share_all(coord, cohort, MEMBERS)
    fetch_shares(coord, cohort, MEMBERS)
    mask_all(coord, cohort, MEMBERS)
    assert coord.live.stage == "consistency"

    # the aggregator restarts mid-round: every group's session is rebuilt from the store
    fed.ws.close()
    fed = Federation(Workspace.open(fed.root), fed.identities)
    coord = Coordinator(fed.ws, clock=clock)
    session = coord.live.summation
    assert isinstance(session, ShardedSession) and coord.live.stage == "consistency"
    if workers:  # a group's worker killed: rebuilt from the store on the next call
        worker = session.groups[1]
        assert isinstance(worker, GroupWorker) and worker.pid is not None
        os.kill(worker.pid, signal.SIGKILL)
    _finish(coord, cohort)
    if workers:
        assert worker.restarts == 1
    assert coord.live.round == 2

    old, new = model_params(fed.ws, 1), model_params(fed.ws, 2)
    np.testing.assert_array_equal(
        new, expected_params(old, [cohort.quantized[m] for m in MEMBERS], spec)
    )
    (aggregate,) = [e["body"] for e in log_entries(fed.ws) if e["kind"] == "aggregate"]
    assert [g["members"] for g in aggregate["groups"]] == [g.members for g in spec.groups]
    assert [g["survivors"] for g in aggregate["groups"]] == [g.members for g in spec.groups]

    audit = fed.root / "audit"
    verified = verify_log(audit / "log.jsonl", audit / "archive", fed.root)
    assert verified.ok, verified.problem
    assert (verified.rounds_verified, verified.models_verified) == (1, 1)

    # an operator who re-signs the log with another group sum is caught by the re-unmasking
    groups = [dict(g) for g in aggregate["groups"]]
    groups[1]["sum_sha256"] = "00" * 32
    _rewrite_aggregate(fed, groups=_group_entries(groups))
    tampered = verify_log(audit / "log.jsonl", audit / "archive", fed.root)
    assert not tampered.ok
    assert "shard group 1's sum recomputed from the archived inputs" in str(tampered.problem)


def _group_entries(groups: list[dict[str, Any]]) -> list[GroupSumEntry]:
    return [GroupSumEntry(**g) for g in groups]


def test_a_configuration_whose_groups_would_be_too_small_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"round.min_agents: expected >= shards × "):
        make_federation(tmp_path / "ws", agents=MEMBERS, round={**SHARDED, "min_agents": 7})
    with pytest.raises(ConfigError, match=r"round.shards: expected 1 with secure_sum = 'none'"):
        make_federation(tmp_path / "ws2", agents=MEMBERS, round={**SHARDED, "secure_sum": "none"})
    with pytest.raises(ConfigError, match=r"round.shards: expected 1 with round.mode = 'buff"):
        make_federation(tmp_path / "ws3", agents=MEMBERS, round={**SHARDED, "mode": "buffered"})


def test_distributed_noise_is_sized_for_each_groups_survivors(tmp_path: Path) -> None:
    """Each group's sum is revealed to the aggregator, so it must carry all the noise:
    the spec sizes the shares for ⌈0.8 × 4⌉ = 4 survivors of a group, not 7 of the 8."""
    fed = make_federation(
        tmp_path / "ws",
        agents=MEMBERS,
        round={**SHARDED, "quant_bits": 16},
        validation=False,
        sections={"dp": {"mode": "distributed", "unit": "member"}},
    )
    coord = Coordinator(fed.ws, clock=FakeClock())
    for m in MEMBERS:
        assert coord.join(m, 1, 0, join_request(m, 1)).accepted
    coord.tick()
    spec = coord.live.spec
    assert spec is not None and [len(g.members) for g in spec.groups] == [4, 4]
    assert spec.dp.min_survivors == 4


def test_a_group_noise_share_of_one_survivor_is_refused_with_the_numbers(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"⌈0.2 × 4⌉ = 1 survivor\(s\)"):
        make_federation(
            tmp_path / "ws",
            agents=MEMBERS,
            round=SHARDED,
            sections={
                "dp": {"mode": "distributed", "unit": "member", "min_survivors_fraction": 0.2}
            },
        )
