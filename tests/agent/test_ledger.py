"""The privacy ledger: composition, refusal past the budget, durability, corruption."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from opacus.accountants import RDPAccountant

from fedsec.agent.ledger import LEDGER_FILENAME, PrivacyLedger, noise_for_budget, rdp_epsilon
from fedsec.audit.accountant import pld_epsilon
from fedsec.errors import BudgetExhausted, ConfigError, FedsecError, IntegrityError

Q = 0.02  # sample rate of a batch of 20 out of 1000 records
STEPS = 50  # one local epoch


def _ledger(tmp_path: Path, epsilon: float = 8.0, delta: float = 1e-5) -> PrivacyLedger:
    ledger = PrivacyLedger(tmp_path)
    ledger.set_budget("clinic", epsilon, delta)
    return ledger


def test_new_dataset_has_spent_nothing(tmp_path: Path) -> None:
    ledger = _ledger(tmp_path)
    assert ledger.spent("clinic") == 0.0
    assert ledger.history("clinic") == []
    assert ledger.datasets() == ["clinic"]


def test_spent_composes_history_not_by_adding(tmp_path: Path) -> None:
    ledger = _ledger(tmp_path, epsilon=100.0)
    one_round = ledger.projected("clinic", 1.1, Q, STEPS)
    for rnd in range(1, 5):
        ledger.record("clinic", rnd, 1.1, Q, STEPS)
    accountant = RDPAccountant()
    accountant.history = [(1.1, Q, STEPS)] * 4
    rdp = accountant.get_epsilon(1e-5)
    assert rdp_epsilon([(1.1, Q, STEPS)] * 4, 1e-5) == pytest.approx(rdp)
    # PRV is spent: tighter than the RDP cross-check, which caps it
    assert 0.75 * rdp < ledger.spent("clinic") < rdp
    assert one_round < ledger.spent("clinic") < 4 * one_round


@pytest.mark.parametrize(
    ("sigma", "q", "steps"),
    [(2.3, 0.25, 200), (1.1, Q, 4 * STEPS), (0.8, 0.01, 1000), (5.0, 1.0, 10), (1.0, 0.1, 30)],
)
def test_spent_agrees_with_an_independent_pld_accountant(
    tmp_path: Path, sigma: float, q: float, steps: int
) -> None:
    # dp-accounting's PLD accountant: another implementation of another numerical method
    ledger = _ledger(tmp_path, epsilon=1000.0)
    ledger.record("clinic", 1, sigma, q, steps)
    independent = pld_epsilon([(sigma, q, steps)], 1e-5)
    assert ledger.spent("clinic") == pytest.approx(independent, rel=0.01)
    assert ledger.spent("clinic") <= rdp_epsilon([(sigma, q, steps)], 1e-5)


def test_noise_for_budget_lasts_exactly_the_planned_rounds(tmp_path: Path) -> None:
    ledger = _ledger(tmp_path, epsilon=3.0)
    sigma = noise_for_budget(3.0, 1e-5, Q, STEPS, rounds=5)
    for rnd in range(1, 6):
        ledger.charge("clinic", rnd, sigma, Q, STEPS)
    assert 2.9 <= ledger.spent("clinic") <= 3.0
    ledger_file = tmp_path / LEDGER_FILENAME
    before = ledger_file.read_bytes()
    with pytest.raises(BudgetExhausted) as err:
        ledger.charge("clinic", 6, sigma, Q, STEPS)
    assert str(err.value).startswith("dataset 'clinic': training round 6 would spend epsilon ")
    assert "> budget 3 (spent 2.9" in str(err.value)
    assert str(err.value).endswith("refusing to train")
    assert ledger_file.read_bytes() == before
    assert len(PrivacyLedger(tmp_path).history("clinic")) == 5


def test_check_can_train_refuses_without_writing(tmp_path: Path) -> None:
    ledger = _ledger(tmp_path, epsilon=1.0)
    before = (tmp_path / LEDGER_FILENAME).read_bytes()
    with pytest.raises(BudgetExhausted, match="training round 1 would spend"):
        ledger.check_can_train("clinic", 1, 0.5, Q, STEPS)
    assert (tmp_path / LEDGER_FILENAME).read_bytes() == before
    assert ledger.check_can_train("clinic", 1, 5.0, Q, STEPS) < 1.0


def test_ledger_survives_reload(tmp_path: Path) -> None:
    ledger = _ledger(tmp_path)
    ledger.record("clinic", 1, 1.0, Q, STEPS)
    ledger.record("clinic", 2, 1.2, Q, 2 * STEPS)
    reopened = PrivacyLedger(tmp_path)
    assert reopened.spent("clinic") == pytest.approx(ledger.spent("clinic"))
    assert [(h.round, h.noise_multiplier, h.steps) for h in reopened.history("clinic")] == [
        (1, 1.0, STEPS),
        (2, 1.2, 2 * STEPS),
    ]
    assert reopened.budget("clinic").epsilon == 8.0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        LEDGER_FILENAME,
        LEDGER_FILENAME + ".lock",
    ]  # no temp files left behind


def test_two_handles_on_one_state_dir_lose_no_round(tmp_path: Path) -> None:
    first = _ledger(tmp_path)
    second = PrivacyLedger(tmp_path)  # opened before first records anything
    first.record("clinic", 1, 1.0, Q, STEPS)
    second.record("clinic", 2, 1.0, Q, STEPS)
    assert [h.round for h in PrivacyLedger(tmp_path).history("clinic")] == [1, 2]


def test_each_charge_declares_the_earlier_charges_no_report_was_taken_for(
    tmp_path: Path,
) -> None:
    ledger = _ledger(tmp_path)
    first = ledger.charge("clinic", 1, 1.0, Q, STEPS)
    assert (first.index, first.unreported) == (0, ())
    assert first.epsilon == pytest.approx(ledger.spent("clinic"))
    # round 1's report never reached the aggregator (the member dropped out): round 2's
    # report must declare it, and keeps declaring it until a report is taken
    second = ledger.charge("clinic", 2, 1.2, Q, STEPS)
    assert second.index == 1
    assert [(i, c.round, c.noise_multiplier) for i, c in second.unreported] == [(0, 1, 1.0)]
    ledger.mark_reported("clinic", 1)
    third = PrivacyLedger(tmp_path).charge("clinic", 3, 1.0, Q, STEPS)  # durable
    assert (third.index, third.unreported) == (2, ())
    ledger.mark_reported("clinic", 0)  # an older report taken late: nothing moves back
    assert PrivacyLedger(tmp_path).unreported("clinic", 3) == [(2, ledger.history("clinic")[2])]
    with pytest.raises(ConfigError, match="no charge 3 to mark"):
        ledger.mark_reported("clinic", 3)


def test_reported_through_past_the_history_is_refused(tmp_path: Path) -> None:
    _ledger(tmp_path).charge("clinic", 1, 1.0, Q, STEPS)
    path = tmp_path / LEDGER_FILENAME
    document = json.loads(path.read_text())
    document["datasets"]["clinic"]["reported_through"] = 2
    path.write_text(json.dumps(document))
    with pytest.raises(IntegrityError, match="reported_through"):
        PrivacyLedger(tmp_path)


@pytest.mark.parametrize(
    "content",
    [b"{not json", b"[]", b'{"format": "other", "version": 1, "datasets": {}}', b""],
)
def test_corrupt_ledger_is_an_error_naming_the_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / LEDGER_FILENAME
    path.write_bytes(content)
    with pytest.raises(IntegrityError) as err:
        PrivacyLedger(tmp_path)
    assert str(path) in str(err.value)
    assert isinstance(err.value, FedsecError)
    assert path.read_bytes() == content


def test_tampered_history_entry_is_refused(tmp_path: Path) -> None:
    _ledger(tmp_path).record("clinic", 1, 1.0, Q, STEPS)
    path = tmp_path / LEDGER_FILENAME
    document = json.loads(path.read_text())
    document["datasets"]["clinic"]["history"][0]["steps"] = "many"
    path.write_text(json.dumps(document))
    with pytest.raises(IntegrityError, match="is corrupt"):
        PrivacyLedger(tmp_path)


def test_unknown_dataset_and_bad_values_are_refused(tmp_path: Path) -> None:
    ledger = _ledger(tmp_path)
    with pytest.raises(ConfigError, match="dataset 'bank' has no privacy budget"):
        ledger.record("bank", 1, 1.0, Q, STEPS)
    with pytest.raises(ConfigError, match="sample_rate"):
        ledger.record("clinic", 1, 1.0, 1.5, STEPS)
    with pytest.raises(ConfigError, match="epsilon"):
        ledger.set_budget("clinic", 0.0, 1e-5)
    assert ledger.history("clinic") == []


def test_budget_delta_is_fixed_once_rounds_are_recorded(tmp_path: Path) -> None:
    ledger = _ledger(tmp_path)
    ledger.set_budget("clinic", 8.0, 1e-6)  # allowed before any spending
    ledger.record("clinic", 1, 1.0, Q, STEPS)
    with pytest.raises(ConfigError, match="delta cannot change"):
        ledger.set_budget("clinic", 8.0, 1e-5)
    ledger.set_budget("clinic", 4.0, 1e-6)  # epsilon is the owner's call
    assert PrivacyLedger(tmp_path).budget("clinic").epsilon == 4.0


def test_noise_for_budget_rejects_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="rounds"):
        noise_for_budget(1.0, 1e-5, Q, STEPS, rounds=0)
    more_rounds = noise_for_budget(1.0, 1e-5, Q, STEPS, rounds=20)
    assert more_rounds > noise_for_budget(1.0, 1e-5, Q, STEPS, rounds=2)


def test_ledger_is_written_owner_only_and_leaves_no_temp_file(tmp_path: Path) -> None:
    import stat

    ledger = _ledger(tmp_path)
    ledger.record("clinic", 1, 1.0, Q, STEPS)
    assert stat.S_IMODE((tmp_path / LEDGER_FILENAME).stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        LEDGER_FILENAME,
        LEDGER_FILENAME + ".lock",
    ]
