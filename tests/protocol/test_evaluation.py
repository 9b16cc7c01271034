"""The evaluation report's stateless rules and its pooling: sums pool exactly, in any
order, into the value the union of the members' records gives; an unsound set of sums is
refused naming the rule."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedsec.errors import PayloadError
from fedsec.protocol import wire
from fedsec.protocol.evaluation import check_report, pool

KNOWN = {"accuracy": (0.0, 1.0), "loss": (-math.inf, math.inf)}
COUNTED = ("accuracy", "loss")


def _report(member: str, records: int, correct: int, loss: float) -> wire.EvaluationReport:
    return wire.EvaluationReport(
        federation_id="fed",
        round=1,
        attempt=0,
        member=member,
        model_version=2,
        records=records,
        metrics=[
            wire.MetricSum("accuracy", float(correct), float(records)),
            wire.MetricSum("loss", loss, float(records)),
        ],
    )


members = st.lists(
    st.tuples(
        st.integers(1, 10_000),
        st.floats(0, 1),
        st.floats(0, 50, allow_nan=False),
    ),
    min_size=1,
    max_size=8,
)


@given(members, st.randoms())
def test_pooled_values_are_the_unions_in_any_order(parts: list, rnd: object) -> None:
    reports = [
        _report(f"m{i}", n, int(share * n), mean_loss * n)
        for i, (n, share, mean_loss) in enumerate(parts)
    ]
    for r in reports:
        check_report(r, KNOWN, COUNTED)
    shuffled = list(reports)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    whole, again = pool(reports), pool(shuffled)
    records = sum(n for n, _, _ in parts)
    correct = sum(int(share * n) for n, share, _ in parts)
    assert whole.records == again.records == records
    assert whole.values()["accuracy"] == pytest.approx(correct / records)
    assert whole.values() == pytest.approx(again.values())
    assert whole.members == {f"m{i}" for i in range(len(parts))}


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ({"metrics": []}, "missing"),
        ({"metrics": [wire.MetricSum("accuracy", 1.0, 10.0)] * 2}, "repeats a metric"),
        ({"records": 5}, "weight 10 for 5 records"),
    ],
)
def test_unsound_reports_are_refused_naming_the_rule(change: dict, refusal: str) -> None:
    report = msgspec.structs.replace(_report("m", 10, 7, 3.0), **change)
    with pytest.raises(PayloadError, match=refusal):
        check_report(report, KNOWN, COUNTED)


def test_a_weightless_metric_has_no_value_and_must_total_zero() -> None:
    base = _report("m", 10, 7, 3.0)
    known = {**KNOWN, "micro_f1": (0.0, 1.0)}
    empty = msgspec.structs.replace(
        base, metrics=[*base.metrics, wire.MetricSum("micro_f1", 0.0, 0.0)]
    )
    check_report(empty, known, COUNTED)
    assert "micro_f1" not in pool([empty]).values()
    forged = msgspec.structs.replace(
        base, metrics=[*base.metrics, wire.MetricSum("micro_f1", 3.0, 0.0)]
    )
    with pytest.raises(PayloadError, match="has no weight"):
        check_report(forged, known, COUNTED)
