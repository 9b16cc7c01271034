"""The ledger's releases: a charge's update goes into one SecAgg+ sum at most, and
the record of it is durable (the agent refuses reuse after a restart too)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedsec.agent.ledger import LEDGER_FILENAME, PrivacyLedger
from fedsec.errors import ConfigError, IntegrityError

DATASET = "breast_cancer-part0"


def ledger(tmp_path: Path) -> PrivacyLedger:
    book = PrivacyLedger(tmp_path)
    book.set_budget(DATASET, 50.0, 1e-5)
    return book


# -- the ledger: one release per charge, durable ---------------------------------------------


def test_a_release_is_durable_and_the_same_attempt_again_changes_nothing(tmp_path: Path) -> None:
    book = ledger(tmp_path)
    book.charge(DATASET, 1, 1.0, 0.25, 1)
    book.record_release(DATASET, 0, 1, 0)
    before = (tmp_path / LEDGER_FILENAME).read_bytes()
    book.record_release(DATASET, 0, 1, 0)  # a retried upload of the same attempt

    assert (tmp_path / LEDGER_FILENAME).read_bytes() == before
    reopened = PrivacyLedger(tmp_path)  # as after a restart
    assert reopened.releases(DATASET) == {0: (1, 0)}
    assert reopened.history(DATASET)[0].released_to == (1, 0)


def test_a_charge_is_never_released_to_a_second_attempt(tmp_path: Path) -> None:
    book = ledger(tmp_path)
    book.charge(DATASET, 1, 1.0, 0.25, 1)
    book.record_release(DATASET, 0, 1, 0)
    before = (tmp_path / LEDGER_FILENAME).read_bytes()

    with pytest.raises(IntegrityError) as err:
        book.record_release(DATASET, 0, 1, 1)
    assert "already released to round 1 attempt 0" in str(err.value)
    assert "refused" in str(err.value)
    assert (tmp_path / LEDGER_FILENAME).read_bytes() == before
    assert PrivacyLedger(tmp_path).releases(DATASET) == {0: (1, 0)}


def test_a_release_names_a_charge_of_its_round_or_an_earlier_one(tmp_path: Path) -> None:
    book = ledger(tmp_path)
    book.charge(DATASET, 2, 1.0, 0.25, 1)
    before = (tmp_path / LEDGER_FILENAME).read_bytes()
    with pytest.raises(IntegrityError, match="paid for round 2, after round 1"):
        book.record_release(DATASET, 0, 1, 0)
    with pytest.raises(ConfigError, match="no charge 3 to release"):
        book.record_release(DATASET, 3, 1, 0)
    assert (tmp_path / LEDGER_FILENAME).read_bytes() == before
    assert book.releases(DATASET) == {}
    # buffered mode: an update trained for round 2 may go into round 3's sum, once
    book.record_release(DATASET, 0, 3, 0)
    assert book.releases(DATASET) == {0: (3, 0)}


def test_a_ledger_whose_release_names_an_earlier_round_is_refused(tmp_path: Path) -> None:
    book = ledger(tmp_path)
    book.charge(DATASET, 2, 1.0, 0.25, 1)
    path = tmp_path / LEDGER_FILENAME
    path.write_text(path.read_text().replace('"round": 2,', '"released_to": [1, 0], "round": 2,'))
    with pytest.raises(IntegrityError, match="corrupt"):
        PrivacyLedger(tmp_path)
