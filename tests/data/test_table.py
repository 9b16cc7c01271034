"""Rules, schema agreement and encoding of a member's records."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedsec.data.rules import HASH_KEY_BYTES, apply
from fedsec.data.settings import ColumnRules, SourceSpec
from fedsec.data.sources import open_source
from fedsec.data.summary import data_quality, data_summary
from fedsec.data.table import build_table
from fedsec.errors import TaskMismatch
from fedsec.protocol.data_schema import (
    DataSchema,
    ObservedColumn,
    ObservedSchema,
    SchemaColumn,
    schema_differences,
)

SCHEMA = DataSchema(
    label="diagnosis",
    classes=["cold", "flu", "covid"],
    columns=[
        SchemaColumn(name="age", unit="years"),
        SchemaColumn(name="sex", kind="categorical", categories=["F", "M", "X"]),
        SchemaColumn(name="bmi", missing="indicator"),
        SchemaColumn(name="smoker", kind="categorical", categories=["no", "yes"], missing="drop"),
    ],
)
# A hospital export: another column order, a renamed column, an extra sensitive column.
EXPORT = """patient_name,dx,smoker,sex,bmi,age_years
Ann Lee,flu,no,F,22.5,47
Bob Stone,cold,yes,M,,51
Cy Moss,flu,,F,30.1,38
Di Park,,no,M,27.0,60
Ed Hall,cold,yes,M,NA,71
"""
RULES = ColumnRules(rename={"age_years": "age", "dx": "diagnosis"}, exclude=["patient_name"])


def source(tmp_path: Path, text: str = EXPORT) -> list:  # type: ignore[type-arg]
    path = tmp_path / "export.csv"
    path.write_text(text)
    return [open_source(SourceSpec(kind="csv", path=str(path)))]


def test_rules_map_an_export_onto_the_schema_and_encode_it(tmp_path: Path) -> None:
    table = build_table(source(tmp_path), SCHEMA, RULES, None)
    assert SCHEMA.feature_names() == [
        "age",
        "sex=F",
        "sex=M",
        "sex=X",
        "bmi",
        "bmi__missing",
        "smoker=no",
        "smoker=yes",
    ]
    # rows 3 (no smoker: dropped by the schema) and 4 (no label) are left out
    assert table.selection.read == 5 and table.selection.kept == 3
    assert dict(table.selection.dropped) == {
        "label 'diagnosis' missing": 1,
        "'smoker' missing (the schema drops such rows)": 1,
    }
    assert table.y.tolist() == [1, 0, 0]
    mean_bmi = 22.5  # the only kept row with a bmi: the member-local imputation
    np.testing.assert_allclose(
        table.x,
        [
            [47, 1, 0, 0, 22.5, 0, 1, 0],
            [51, 0, 1, 0, mean_bmi, 1, 0, 1],
            [71, 0, 1, 0, mean_bmi, 1, 0, 1],
        ],
    )
    assert table.missing_rate["bmi"] == pytest.approx(2 / 5)
    quality = data_quality(table, SCHEMA)
    assert quality.label_coverage == pytest.approx(2 / 3)  # no covid here: still trains
    summary = data_summary(table, SCHEMA, "h1")
    assert summary.records == 3 and summary.label_counts == {"cold": 2, "flu": 1, "covid": 0}
    assert "patient_name" not in str(summary) and "Ann" not in str(summary)
    assert schema_differences(SCHEMA, summary.observed) == []


def test_every_difference_is_named_with_the_row_of_the_first_bad_value(tmp_path: Path) -> None:
    text = EXPORT.replace("F,22.5,47", "Q,22.5,47").replace("cold,yes,M,,51", "gout,yes,M,,5l")
    with pytest.raises(TaskMismatch) as err:
        build_table(source(tmp_path, text), SCHEMA, RULES, None)
    detail = err.value.detail
    assert (
        "column 'diagnosis': expected classes within ['cold', 'flu', 'covid'], found also ['gout']"
        in detail
    )
    assert "column 'sex': expected categories within ['F', 'M', 'X'], found also ['Q']" in detail
    assert "column 'age': expected numeric, found categorical" in detail
    assert "age: csv:export.csv row 2 holds a non-number" in detail
    assert "sex: csv:export.csv row 1 holds a value outside" in detail
    with pytest.raises(
        TaskMismatch, match="column 'age': expected a numeric column, found no such column"
    ):
        build_table(source(tmp_path), SCHEMA, ColumnRules(rename={"dx": "diagnosis"}), None)


def test_the_aggregator_side_comparison_names_extra_columns_and_units() -> None:
    observed = ObservedSchema(
        label="diagnosis",
        classes=["flu"],
        columns=[
            ObservedColumn(name="age", kind="numeric", unit="months"),
            ObservedColumn(name="sex", kind="categorical", categories=["F"]),
            ObservedColumn(name="bmi", kind="numeric"),
            ObservedColumn(name="smoker", kind="numeric"),
            ObservedColumn(name="zip", kind="categorical"),
        ],
    )
    assert [d.sentence() for d in schema_differences(SCHEMA, observed)] == [
        "column 'age': expected unit 'years', found unit 'months'",
        "column 'smoker': expected categorical, found numeric",
        "column 'zip': expected no such column, found a categorical column",
    ]


def test_keyed_hash_and_generalisation(tmp_path: Path) -> None:
    import pyarrow as pa

    cols = {
        "mrn": pa.array(["A1", "A1", "B2", None]),
        "zip": pa.array(["75011", "10115", "", "x"]),
        "age": pa.array(["47", "51", "9", None]),
        "dob": pa.array(["1980-02-01", None, "1975-12-31", "n/a"]),
    }
    rules = ColumnRules(
        anonymise={
            "mrn": "hash",
            "zip": "generalise:prefix:2",
            "age": "generalise:bucket:10",
            "dob": "generalise:year",
        }
    )
    key1, key2 = b"\x01" * HASH_KEY_BYTES, b"\x02" * HASH_KEY_BYTES
    out1, out2 = apply(rules, cols, key1), apply(rules, cols, key2)
    h = out1["mrn"].to_pylist()
    assert h[0] == h[1] != h[2] and h[3] is None and len(h[0]) == 32
    assert out2["mrn"].to_pylist()[0] != h[0]  # another member's key: unlinkable
    assert out1["zip"].to_pylist() == ["75", "10", None, "x"]
    assert out1["age"].to_pylist() == ["40", "50", "0", None]
    assert out1["dob"].to_pylist() == ["1980", None, "1975", None]


def test_noisy_counts_spread_like_laplace_and_stay_counts(tmp_path: Path) -> None:
    table = build_table(source(tmp_path), SCHEMA, RULES, None)
    noisy = [data_summary(table, SCHEMA, "h1", count_epsilon=0.5).records for _ in range(400)]
    assert min(noisy) >= 0 and all(isinstance(n, int) for n in noisy)
    # Laplace((3 + 5 used columns) / 0.5 = 16) around 3, floored at 0: spread, not the
    # exact count every time
    assert len(set(noisy)) > 5 and noisy.count(3) < 100
    assert data_summary(table, SCHEMA, "h1").records == 3


def _denominator(rates: dict[str, float], largest: int = 10_000) -> int | None:
    """The smallest n for which every rate is some k/n to the summary's six digits: the
    row count an exact rate gives away."""
    for n in range(1, largest + 1):
        if all(abs(rate * n - round(rate * n)) < 1e-6 * n for rate in rates.values()):
            return n
    return None


def test_a_noised_summary_s_rates_do_not_give_back_its_counts(tmp_path: Path) -> None:
    # Five rows read (3 kept), rates 1/5, 2/5, 1/5: exact rates name the row count, and
    # exact label coverage says covid is absent, whatever noise the counts carry.
    table = build_table(source(tmp_path), SCHEMA, RULES, None)
    assert _denominator(table.missing_rate) == table.selection.read == 5
    summaries = [data_summary(table, SCHEMA, "h1", count_epsilon=0.5) for _ in range(100)]
    recovered = [_denominator(s.missing_rate) for s in summaries]
    assert recovered.count(5) < 30, f"the row count came back {recovered.count(5)} times"
    assert len({s.label_coverage for s in summaries}) > 1
    assert len({s.quality_score for s in summaries}) > 1
    for s in summaries:
        assert all(0.0 <= r <= 1.0 for r in s.missing_rate.values())
        assert set(s.missing_rate) == set(table.missing_rate)
        assert 0.0 <= s.label_coverage <= 1.0 and 0.0 <= s.quality_score <= 1.0
        assert s.count_epsilon == 0.5
    # the exact summary is unchanged
    exact = data_summary(table, SCHEMA, "h1")
    assert exact.missing_rate == {k: round(v, 6) for k, v in table.missing_rate.items()}
    assert exact.label_coverage == pytest.approx(2 / 3, abs=1e-6)
