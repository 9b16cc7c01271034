"""A peer charges the member's privacy ledger as the agent does: the same ε for the same
settings, before training; it refuses to train or send once the budget is spent; and a
peer killed after charging does not pay twice when it comes back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from fedsec.agent.charging import plan_charge
from fedsec.agent.ledger import PrivacyLedger
from fedsec.agent.spec import training_params
from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import BudgetExhausted, ConfigError, IntegrityError
from fedsec.learning.training import DPParams
from fedsec.peer.gossip import GossipPeer, GossipSettings
from fedsec.peer.http import ARRIVED, peer_app
from fedsec.peer.journal import PeerJournal
from fedsec.peer.loopback import LoopbackMember, run_loopback
from fedsec.peer.messages import Vector
from fedsec.peer.privacy import PeerCharging, holder_of, plan_peer_charge
from fedsec.peer.runner import Timing, run_rounds
from fedsec.peer.topology import sign_topology
from fedsec.task.defaults import TrainingParams
from fedsec.tasks import get_task
from tests.support.agent import signed_spec

FED = "fed-ledger"
DATASET = "breast_cancer:iid:0:0/3"
PARAMS = TrainingParams(lr=0.05, batch_size=32, local_epochs=1)
DP = DPParams(1.0, 1.0, 1e-5)
SAMPLES = 150
DIM = 4


def _charging(state: Path, epsilon: float = 50.0) -> PeerCharging:
    """The member's ledger in ``state`` as a restarted process opens it."""
    ledger = PrivacyLedger(state)
    ledger.ensure_budget(DATASET, epsilon, DP.delta)
    return PeerCharging(ledger, DATASET, holder_of(FED), SAMPLES, PARAMS, DP)


def _step(model: Vector, round_: int) -> Vector:
    stepped: Vector = model + 0.1
    return stepped


def test_a_peer_charges_the_epsilon_the_agent_charges_for_the_same_settings(
    tmp_path: Path,
) -> None:
    task = get_task("breast_cancer")
    spec = signed_spec(
        SigningIdentity.generate(),
        task,
        federation_id=FED,
        model_sha256="ab" * 32,
        dim=DIM,
        cohort=("alice",),
        round=3,
    )
    agent = plan_charge(spec, task, SAMPLES, require_dp=True)
    peer = plan_peer_charge(3, SAMPLES, training_params(spec, task), DP)
    assert peer.cost == agent.cost and peer.dp_enabled
    agents = PrivacyLedger(tmp_path / "agent")
    agents.set_budget(DATASET, 50.0, DP.delta)
    by_agent = agents.charge(DATASET, 3, *agent.cost).epsilon
    by_peer = _charging(tmp_path / "peer").charge(3).epsilon
    assert by_peer == pytest.approx(by_agent, rel=1e-12) and by_peer > 0
    # the same file format: the agent's ledger reads the peer's charge
    assert PrivacyLedger(tmp_path / "peer").history(DATASET)[0].holder == holder_of(FED)


def test_a_peer_without_dp_is_refused_unless_the_member_allows_it(tmp_path: Path) -> None:
    ledger = PrivacyLedger(tmp_path)
    with pytest.raises(ConfigError, match="require_dp"):
        PeerCharging(ledger, DATASET, holder_of(FED), SAMPLES, PARAMS, None)
    allowed = PeerCharging(ledger, DATASET, holder_of(FED), SAMPLES, PARAMS, None, False)
    ledger.ensure_budget(DATASET, 1.0, DP.delta)
    assert allowed.charge(0).index == -1 and ledger.history(DATASET) == []


@pytest.mark.asyncio
async def test_a_peer_whose_budget_is_spent_refuses_to_train_or_send(tmp_path: Path) -> None:
    me, other = SigningIdentity.generate(), SigningIdentity.generate()
    roster = {i.key_id: i.public_bytes for i in (me, other)}
    one_round = _charging(tmp_path / "probe").ledger.projected(
        DATASET, *plan_peer_charge(0, SAMPLES, PARAMS, DP).cost
    )
    charging = _charging(tmp_path, epsilon=1.01 * one_round)
    charging.release(charging.charge(0), 0)  # the round it could afford
    before = charging.ledger.path.read_bytes()
    neighbour = GossipPeer(
        FED, other.key_id, [me.key_id], np.zeros(DIM), 10, PeerJournal(FED, other)
    )
    peer = GossipPeer(FED, me.key_id, [other.key_id], np.zeros(DIM), 10, PeerJournal(FED, me))
    trained: list[int] = []

    def trainer(model: Vector, round_: int) -> Vector:
        trained.append(round_)
        return _step(model, round_)

    runner = web.AppRunner(peer_app(neighbour, roster, other))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    own = peer_app(peer, roster, me)
    try:
        with pytest.raises(BudgetExhausted, match=r"round 0 would spend epsilon .* > budget"):
            await run_rounds(
                peer,
                me,
                {other.key_id: url},
                trainer,
                1,
                own[ARRIVED],
                Timing(5.0, 5.0),
                charging=charging,
            )
    finally:
        await runner.cleanup()
    assert trained == []  # refused before training
    assert (peer.round, peer.model.tolist(), peer.journal.entries) == (0, [0.0] * DIM, [])
    assert neighbour.journal.entries == []  # nothing was sent
    assert charging.ledger.path.read_bytes() == before


class _Killed(Exception):
    """The process dies here."""


@pytest.mark.asyncio
async def test_a_peer_killed_after_charging_does_not_charge_again_when_restarted(
    tmp_path: Path,
) -> None:
    admin = SigningIdentity.generate()
    ids = [SigningIdentity.generate() for _ in range(3)]
    me = ids[0]

    def killed(model: Vector, round_: int) -> Vector:
        raise _Killed  # after the charge, before the update exists

    first = GossipPeer(
        FED, me.key_id, [ids[1].key_id], np.zeros(DIM), SAMPLES, PeerJournal(FED, me)
    )
    app = peer_app(first, {i.key_id: i.public_bytes for i in ids}, me)
    with pytest.raises(_Killed):
        await run_rounds(first, me, {}, killed, 1, app[ARRIVED], charging=_charging(tmp_path))
    (charge,) = PrivacyLedger(tmp_path).history(DATASET)
    assert charge.released_to is None and charge.round == 0

    # restarted: a new process opens the ledger from its file and runs the round
    members = [LoopbackMember(me, _step, SAMPLES, _charging(tmp_path))]
    members += [LoopbackMember(i, _step, SAMPLES) for i in ids[1:]]
    topology = sign_topology(admin, FED, bytes(32), 2)
    settings = GossipSettings(exchanges=1)
    results = await run_loopback(
        FED, admin.public_bytes, topology, members, np.zeros(DIM), 1, settings, Timing(20.0, 10.0)
    )
    assert all(len(r.outcomes[0].accepted) == 2 for r in results.values())
    (kept,) = PrivacyLedger(tmp_path).history(DATASET)  # still one charge
    assert kept.released_to == (0, 0)
    # a second restart trains round 0 again: that charge's update left, so it pays anew
    again = _charging(tmp_path)
    assert again.charge(0).index == 1


def test_a_released_charge_is_never_reused_or_released_twice(tmp_path: Path) -> None:
    charging = _charging(tmp_path)
    charge = charging.charge(2)
    charging.release(charge, 2)
    restarted = _charging(tmp_path)
    fresh = restarted.charge(2)
    assert (charge.index, fresh.index) == (0, 1)
    before = restarted.ledger.path.read_bytes()
    with pytest.raises(IntegrityError, match="already released"):
        restarted.release(charge, 3)
    assert restarted.ledger.path.read_bytes() == before
    # an unreleased charge of a later round does not pay for an earlier one
    assert _charging(tmp_path).charge(1).index == 2
