"""Sensitive-field detection on the labelled 44-column fixture, through the data map."""

from __future__ import annotations

import json
from pathlib import Path

from fedsec.data.inventory import build_map
from fedsec.data.sensitive import by_name, by_values, name_tokens
from fedsec.data.settings import SourceSpec
from fedsec.data.sources import open_source

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "data"


def test_recall_on_the_labelled_fixture_is_at_least_095_and_false_positives_are_known() -> None:
    labels = json.loads((FIXTURES / "sensitive_columns.labels.json").read_text())["labels"]
    source = open_source(SourceSpec(kind="csv", path=str(FIXTURES / "sensitive_columns.csv")))
    columns = build_map([source])["sources"][0]["columns"]
    assert len(columns) >= 40
    found = {c["name"]: c["sensitive"] for c in columns}
    sensitive = [name for name, category in labels.items() if category]
    caught = [name for name in sensitive if found[name] is not None]
    assert len(caught) / len(sensitive) >= 0.95, sorted(set(sensitive) - set(caught))
    false_positives = sorted(n for n, f in found.items() if f is not None and not labels[n])
    # drug_name: "name" in a column name is a strong hint, and here a wrong one
    assert false_positives == ["drug_name"]
    # disguised and neutral names are caught for the right reason
    assert found["pt_nm"] == {"category": "name", "by": "name", "evidence": "nm"}
    assert found["c1"]["category"] == "email" and found["c1"]["by"] == "values"
    assert found["x7"]["category"] == "phone" and found["ident"]["category"] == "national_id"
    assert found["d2"]["category"] == "birth_date" and found["admit_date"]["category"] == "date"


def test_name_tokens_and_plain_numbers() -> None:
    assert name_tokens("DateOfBirth") == ["date", "of", "birth"]
    assert by_name("patient_id") is None and by_name("pt_name") is not None
    assert by_values("bmi", ["22.5", "1234567.25", "18"]) is None  # numbers are not phones
