"""Retries after a release: an update that went into one SecAgg+ attempt's sum is
never sent to another; the later attempt trains anew and is charged again, also after
a restart.  The attack this closes is run against the real aggregator in
test_reuse_attack.py; the ledger's side is test_ledger_release.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from fedsec.agent import actions as act
from fedsec.agent.charging import Carryover, PrivacyCharge, TrainedUpdate, charge_step
from fedsec.agent.ledger import PrivacyLedger, epsilon_of
from fedsec.agent.spec import update_key
from fedsec.protocol.wire import RoundSpec
from tests.agent.test_distributed_floor import DATASET, DELTA, member, spec


def ledger(tmp_path: Path) -> PrivacyLedger:
    book = PrivacyLedger(tmp_path)
    book.set_budget(DATASET, 50.0, 1e-5)
    return book


# -- retries after a release: trained anew and charged, after a restart too -----------------


def _charge(book: PrivacyLedger, s: RoundSpec, carry: Carryover) -> PrivacyCharge | TrainedUpdate:
    """charge_step, its Charge answered by the real ledger."""
    step = charge_step(s, carry, member())
    try:
        action = next(step)
        assert isinstance(action, act.Charge)
        r = action.request
        charged = book.charge(DATASET, r.round, *r.cost)
        answer = PrivacyCharge(
            r.key, charged.epsilon, r.steps, r.sample_rate, r.round, charged.index
        )
        step.send(act.Charged(answer))
    except StopIteration as stop:
        result: PrivacyCharge | TrainedUpdate = stop.value
        return result
    raise AssertionError("charge_step asked for more than one charge")


def test_k_released_attempts_are_k_charges(tmp_path: Path) -> None:
    """Distributed DP: every sum carries fresh noise shares; each is charged."""
    book, carry = ledger(tmp_path), Carryover()
    for attempt in range(3):
        s = spec(attempt)
        charge = _charge(book, s, carry)
        assert isinstance(charge, PrivacyCharge), attempt  # never the released update
        update = carry.trained(s, charge, DELTA)
        book.record_release(DATASET, update.index, s.round, attempt)
        carry.release(update, s.round, attempt)

    history = book.history(DATASET)
    assert [c.released_to for c in history] == [(1, 0), (1, 1), (1, 2)]
    assert book.spent(DATASET) == pytest.approx(epsilon_of([(1.0, 0.25, 1)] * 3, 1e-5))
    # one charge for all three would have reported epsilon_of(one step): 2.71, not 3.81
    assert book.spent(DATASET) > epsilon_of([(1.0, 0.25, 1)] * 2, 1e-5)


def test_an_update_not_yet_released_is_still_reused(tmp_path: Path) -> None:
    """An attempt aborted before its masked input: the next one reuses the update."""
    book, carry = ledger(tmp_path), Carryover()
    first = _charge(book, spec(0), carry)
    assert isinstance(first, PrivacyCharge)
    update = carry.trained(spec(0), first, DELTA)
    assert _charge(book, spec(1), carry) is update
    assert len(book.history(DATASET)) == 1


def test_a_restarted_agent_does_not_reuse_a_released_update(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    book = ledger(tmp_path)
    book.charge(DATASET, 1, 1.0, 0.25, 1)
    book.record_release(DATASET, 0, 1, 0)
    # a restarted agent: its carry-over is rebuilt from the ledger; even were the update
    # (or its charge) kept across the restart, it is not sent to attempt 1
    carry = Carryover(PrivacyLedger(tmp_path).releases(DATASET))
    key = update_key(spec(1))
    carry.update = TrainedUpdate(key, DELTA, 1.0, 1, 0.25, 1, trained_round=1, index=0)
    carry.unused_charge = PrivacyCharge(key, 1.0, 1, 0.25, 1, index=0)
    caplog.set_level(logging.INFO, logger="fedsec.agent.runtime")

    charge = _charge(book, spec(1), carry)
    assert isinstance(charge, PrivacyCharge) and charge.index == 1
    assert carry.update is None
    logged = [r.getMessage() for r in caplog.records if "round_update_not_reused" in r.message]
    assert logged and all("released_round=1 released_attempt=0" in m for m in logged)
