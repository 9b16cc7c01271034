"""Pure ε-DP releases (noised data-summary counts) in the privacy ledger."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedsec.agent.ledger import PrivacyLedger
from fedsec.errors import BudgetExhausted, ConfigError


def test_a_pure_release_adds_its_epsilon_and_is_refused_past_the_budget(tmp_path: Path) -> None:
    ledger = PrivacyLedger(tmp_path)
    ledger.set_budget("d", 8.0, 1e-5)
    sgd = ledger.record("d", 1, 1.1, 0.05, 40)
    assert ledger.charge_pure("d", 0.5, "noised counts") == pytest.approx(sgd + 0.5)
    assert ledger.pure_spent("d") == 0.5
    assert PrivacyLedger(tmp_path).spent("d") == pytest.approx(sgd + 0.5)  # durable
    before = (tmp_path / "privacy_ledger.json").read_bytes()
    with pytest.raises(BudgetExhausted, match="noised counts would spend epsilon 10 more"):
        ledger.charge_pure("d", 10.0, "noised counts")
    with pytest.raises(ConfigError, match="finite epsilon > 0"):
        ledger.charge_pure("d", 0.0, "noised counts")
    assert (tmp_path / "privacy_ledger.json").read_bytes() == before
    doc = json.loads(before)
    doc["datasets"]["d"]["pure"][0]["epsilon"] = -1
    (tmp_path / "privacy_ledger.json").write_text(json.dumps(doc))
    with pytest.raises(Exception, match="corrupt"):
        PrivacyLedger(tmp_path)
