"""Sharded summation: a cohort split into groups, each summed by its own SecAgg+ session
(fedsec.summation.sharded), gives the model of one session over the same members, bit
for bit; the session contract holds for the sharded session as for one session; masks
and shares never cross groups."""

from __future__ import annotations

import dataclasses
import os
import signal

import msgspec
import numpy as np
import pytest

from fedsec.bench.scale_shards import shards_rows
from fedsec.config import RoundSection
from fedsec.crypto.quantize import default_ring_bits
from fedsec.crypto.secagg import MaskedInput
from fedsec.errors import (
    DuplicateMessage,
    MisaddressedShare,
    ProtocolError,
    RoundAborted,
    UnknownMember,
)
from fedsec.protocol import codec, wire
from fedsec.protocol.shards import ShardGroup, split_cohort
from fedsec.summation import StoredAttempt, SummationResult, open_session, replay
from fedsec.summation.group_worker import GroupWorker
from fedsec.summation.secagg import SECAGG, SecAggPlusSession
from fedsec.summation.sharded import ShardedSession
from tests.aggregator.test_summation import Members, _expected, _run, _spec


def _cohort(n: int) -> tuple[str, ...]:
    return tuple(f"m{i:02d}" for i in range(n))


def sharded(spec: wire.RoundSpec, shards: int) -> wire.RoundSpec:
    """``spec`` with its cohort split into ``shards`` groups, each with SecAgg+'s k, t."""
    groups = []
    for members in split_cohort(spec.cohort, spec.seed, shards):
        k, t = SECAGG.graph(len(members), RoundSection())
        groups.append(ShardGroup(members, k, t))
    return msgspec.structs.replace(spec, groups=groups)


COHORT = _cohort(10)


@pytest.fixture(params=[1, 2], ids=["one-session", "two-groups"])
def spec(request: pytest.FixtureRequest) -> wire.RoundSpec:
    """The same contract, over one session and over a sharded one."""
    base = _spec("secagg", COHORT)
    return base if request.param == 1 else sharded(base, int(request.param))


def _group_of(spec: wire.RoundSpec, member: str) -> list[str]:
    return next(g.members for g in spec.groups if member in g.members)


def test_four_groups_give_one_sessions_model_bit_for_bit() -> None:
    whole = _spec("secagg", _cohort(16))
    one = Members(whole)
    single = _run(one.session(), one, whole.cohort)
    four = Members(sharded(whole, 4))
    session = four.session()
    assert isinstance(session, ShardedSession) and len(session.groups) == 4
    result = _run(session, four, whole.cohort)
    assert result.sum_sha256 == single.sum_sha256  # the same ring sum
    np.testing.assert_array_equal(result.weighted_sum, single.weighted_sum)
    assert result.weight_sum == single.weight_sum
    assert (result.survivors, result.dropped) == (single.survivors, single.dropped)
    assert [sorted(g.survivors) for g in result.groups] == [g.members for g in four.spec.groups]
    assert len({g.sum_sha256 for g in result.groups}) == 4
    again = replay(four.spec, StoredAttempt(four.inputs(), list(four.stored)))
    assert again.groups == result.groups and again.sum_sha256 == result.sum_sha256


def test_the_sum_of_every_member_is_exact(spec: wire.RoundSpec) -> None:
    members = Members(spec)
    result = _run(members.session(), members, COHORT)
    total, weight = _expected(spec, COHORT)
    assert result.survivors == list(COHORT) and result.dropped == []
    np.testing.assert_allclose(result.weighted_sum, total, rtol=0, atol=1e-9)
    assert result.weight_sum == pytest.approx(weight, abs=1e-9)
    assert len(result.groups) == len(spec.groups)


def test_a_stage_is_complete_once_every_expected_member_answered(spec: wire.RoundSpec) -> None:
    members = Members(spec)
    session = members.session()
    for stage in session.stages:
        for member in COHORT:
            # unmask may complete early: the answers so far already decide the sum
            assert stage == "unmask" or not session.complete(stage)
            session.receive(stage, members.message(session, stage, member))
        assert session.complete(stage)
        if session.next_stage(stage) is not None:
            session.close(stage)
    assert session.participant_count() == len(COHORT)


def test_a_dropout_inside_one_group_is_that_groups_unmask(spec: wire.RoundSpec) -> None:
    members = Members(spec)
    result = _run(members.session(), members, COHORT, lost_at={"m02": "masked_input"})
    kept = [m for m in COHORT if m != "m02"]
    total, weight = _expected(spec, kept)
    assert result.survivors == kept and result.dropped == ["m02"]
    np.testing.assert_allclose(result.weighted_sum, total, rtol=0, atol=1e-9)
    assert result.weight_sum == pytest.approx(weight, abs=1e-9)
    if spec.groups:
        assert [list(g.dropped) for g in result.groups] == [
            ["m02"] if "m02" in g.members else [] for g in spec.groups
        ]


def test_a_group_left_too_small_aborts_instead_of_summing(spec: wire.RoundSpec) -> None:
    members = Members(spec)
    group = _group_of(spec, "m00") if spec.groups else list(COHORT)
    lost = dict.fromkeys(group[1:], "masked_input")  # one member of its group is left
    with pytest.raises(RoundAborted):
        _run(members.session(), members, COHORT, lost_at=lost)


def test_a_second_contribution_is_refused_and_changes_nothing(spec: wire.RoundSpec) -> None:
    members = Members(spec)
    session = members.session()
    result: SummationResult | None = None
    for stage in session.stages:
        for member in COHORT:
            session.receive(stage, members.message(session, stage, member))
            if (stage, member) == ("masked_input", "m01"):
                with pytest.raises(DuplicateMessage):
                    session.receive(stage, MaskedInput("m01", b"\0" * 8))
        if session.next_stage(stage) is None:
            result = session.finalize()
        else:
            session.close(stage)
    assert result is not None
    total, _ = _expected(spec, COHORT)
    np.testing.assert_allclose(result.weighted_sum, total, rtol=0, atol=1e-9)


def test_the_modes_replay_recomputes_the_sum(spec: wire.RoundSpec) -> None:
    members = Members(spec)
    result = _run(members.session(), members, COHORT, lost_at={"m05": "masked_input"})
    again = replay(spec, StoredAttempt(members.inputs(), list(members.stored)))
    assert again.sum_sha256 == result.sum_sha256 and again.groups == result.groups
    np.testing.assert_array_equal(again.weighted_sum, result.weighted_sum)
    stored = list(members.stored)
    at = next(i for i, m in enumerate(stored) if m.stage == "masked_input" and m.member == "m01")
    stored[at] = stored[at]._replace(raw=stored[at].raw[:-8])
    with pytest.raises(ProtocolError, match="stored masked_input message from m01 no longer"):
        replay(spec, StoredAttempt(members.inputs(), stored))


def test_stage_data_is_refused_to_a_member_outside_the_stage(spec: wire.RoundSpec) -> None:
    members = Members(spec)
    session = members.session()
    with pytest.raises(UnknownMember, match="not a live member of round 3"):
        session.key_list("m00")
    _run(session, members, COHORT)
    for ask in (session.share_relay, session.key_list):
        with pytest.raises(UnknownMember):
            ask("outsider")


# -- masks never cross groups (attack tests) -----------------------------------------------


def _advertised(members: Members) -> ShardedSession:
    session = members.session()
    assert isinstance(session, ShardedSession)
    for member in COHORT:
        session.receive("advertise", members.message(session, "advertise", member))
    session.close("advertise")
    return session


def test_a_member_is_told_only_its_own_groups_keys() -> None:
    members = Members(sharded(_spec("secagg", COHORT), 2))
    session = _advertised(members)
    for member in COHORT:
        listed = {a.member for a in session.key_list(member).entries}
        assert listed == set(_group_of(members.spec, member))


def test_a_share_addressed_across_groups_is_refused_and_changes_nothing() -> None:
    """An attacker in group 0 sends a share of its mask seed to a member of group 1 (so
    that its masks would need group 1 to unmask, or to leak its secret there)."""
    spec = sharded(_spec("secagg", COHORT), 2)
    members = Members(spec)
    session = _advertised(members)
    attacker = spec.groups[0].members[0]
    outsider = spec.groups[1].members[0]
    honest = members.message(session, "share_keys", attacker)
    body = members.cohort.share_keys(attacker, session.key_list(attacker))  # type: ignore[union-attr]
    forged = msgspec.structs.replace(
        body,
        shares=[
            msgspec.structs.replace(body.shares[0], recipient=outsider),
            *body.shares[1:],
        ],
    )
    group0 = session.groups[0]
    assert isinstance(group0, SecAggPlusSession)
    before = dict(group0.server._shares)
    with pytest.raises(MisaddressedShare, match=f"to '{outsider}', not a live neighbour"):
        session.receive("share_keys", codec.share_keys_message(attacker, forged))
    assert group0.server._shares == before  # nothing taken in
    session.receive("share_keys", honest)  # the honest message is still taken


def test_a_message_handed_to_another_groups_session_is_refused() -> None:
    spec = sharded(_spec("secagg", COHORT), 2)
    members = Members(spec)
    session = members.session()
    assert isinstance(session, ShardedSession)
    stranger = spec.groups[1].members[0]
    message = members.message(session, "advertise", stranger)
    with pytest.raises(UnknownMember):
        session.groups[0].receive("advertise", message)
    session.receive("advertise", message)  # routed to its own group, it is taken


def test_groups_the_seed_does_not_give_are_refused_by_every_member() -> None:
    """An aggregator placing a member in a chosen group (say, with its sybils)."""
    spec = sharded(_spec("secagg", COHORT), 2)
    a, b = spec.groups[0].members[0], spec.groups[1].members[0]

    def swap(m: str) -> str:
        return b if m == a else a if m == b else m

    swapped = [
        msgspec.structs.replace(g, members=sorted(swap(m) for m in g.members)) for g in spec.groups
    ]
    forged = msgspec.structs.replace(spec, groups=swapped)
    with pytest.raises(ProtocolError, match="not the one the round's seed gives"):
        forged.member_params(a)
    with pytest.raises(ProtocolError, match="not the one the round's seed gives"):
        Members(forged).session()


def test_bench_scale_shards_rows_have_one_sessions_sum() -> None:
    rows = shards_rows(12, [1, 2], dim=16, dropout=0.1, seed=0)
    assert [r["shards"] for r in rows] == [1, 2]
    assert all(r["same_sum_as_one_session"] for r in rows)
    assert [r["survivors"] for r in rows] == [11, 11]
    assert len(rows[1]["group_sum_sha256"]) == 2


# -- groups in worker processes ------------------------------------------------------------


def _worker_session(members: Members) -> ShardedSession:
    session = open_session(members.spec, dataclasses.replace(members.inputs(), shard_workers=True))
    assert isinstance(session, ShardedSession)
    assert all(isinstance(g, GroupWorker) for g in session.groups)
    return session


def test_groups_in_worker_processes_give_the_same_sum_and_survive_a_killed_worker() -> None:
    """A group's worker killed mid-round (after the masked inputs) is started again and fed
    what it had taken: the round closes, with the sum of the in-process groups."""
    spec = sharded(_spec("secagg", COHORT), 2)
    here = Members(spec)
    expected = _run(here.session(), here, COHORT, lost_at={"m03": "masked_input"})
    members = Members(spec)
    session = _worker_session(members)
    worker = session.groups[1]
    assert isinstance(worker, GroupWorker) and worker.pid != os.getpid()
    lost = {"m03"}
    for stage in session.stages:
        for member in COHORT:
            if member not in lost or stage in ("advertise", "share_keys"):
                session.receive(stage, members.message(session, stage, member))
        if stage == "masked_input":
            assert worker.pid is not None
            os.kill(worker.pid, signal.SIGKILL)
        if session.next_stage(stage) is not None:
            session.close(stage)
    result = session.finalize()
    assert worker.restarts == 1
    assert result.sum_sha256 == expected.sum_sha256 and result.groups == expected.groups
    np.testing.assert_array_equal(result.weighted_sum, expected.weighted_sum)


def test_a_worker_refuses_as_its_group_session_does_and_changes_nothing() -> None:
    spec = sharded(_spec("secagg", COHORT), 2)
    members = Members(spec)
    session = _worker_session(members)
    stranger = spec.groups[1].members[0]
    message = members.message(session, "advertise", stranger)
    with pytest.raises(UnknownMember):
        session.groups[0].receive("advertise", message)
    assert not session.groups[0].complete("advertise")
    session.receive("advertise", message)


def test_a_group_short_of_its_noise_survivors_aborts_before_unmasking() -> None:
    """Distributed DP: each group's sum is revealed, so each must carry the full noise on
    its own: a group with fewer masked inputs than ``dp.min_survivors`` ends the attempt
    before anything is unmasked, though the other group and the total have enough."""
    dp = wire.DPSpec(
        enabled=True,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        delta=1e-5,
        mode="distributed",
        unit="member",
        min_survivors=5,  # the whole of a group of 5
    )
    base = _spec("secagg", COHORT)
    ring = default_ring_bits(16, len(COHORT))
    spec = sharded(msgspec.structs.replace(base, dim=16, quant_bits=16, ring_bits=ring, dp=dp), 2)
    members = Members(spec)
    victim = spec.groups[1].members[0]
    with pytest.raises(RoundAborted, match=r"shard group 1: .* 4 masked inputs arrived, fewer"):
        _run(members.session(), members, COHORT, lost_at={victim: "masked_input"})
    assert not any(m.stage in ("consistency", "unmask") for m in members.stored)
