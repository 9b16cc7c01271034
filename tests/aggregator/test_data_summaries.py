"""Schema agreement at join: the member's signed data summary, checked and logged."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

from fedsec.aggregator.cli import aggregator
from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.ops.dashboard import SnapshotBuilder
from fedsec.aggregator.ops.live import LiveView
from fedsec.audit.report import build_report
from fedsec.errors import FedsecError, PayloadError, SignatureError, TaskMismatch
from fedsec.protocol import wire
from fedsec.protocol.data_schema import DataSchema, ObservedColumn, ObservedSchema
from fedsec.task.digest import loaded_task_pin
from fedsec.tasks import get_task
from tests.support.aggregator import (
    FED,
    FakeClock,
    Federation,
    identity_for,
    log_entries,
    make_federation,
    snapshot,
)

SCHEMA = {
    "label": "diagnosis",
    "classes": ["cold", "flu", "covid"],
    "columns": [
        {"name": "age", "unit": "years"},
        {"name": "sex", "kind": "categorical", "categories": ["F", "M"]},
        {"name": "bmi", "missing": "indicator"},
    ],
}


@pytest.fixture
def fed(tmp_path: Path) -> Federation:
    return make_federation(
        tmp_path / "ws",
        agents=("a0", "a1", "a2"),
        validation=False,
        sections={"federation": {"task": "table"}, "schema": SCHEMA},
    )


def summary(member: str, **changes: object) -> wire.DataSummary:
    schema = msgspec.convert(SCHEMA, DataSchema)
    observed = ObservedSchema(
        label="diagnosis",
        classes=["cold", "flu"],
        columns=[
            ObservedColumn(name="age", kind="numeric", unit="years"),
            ObservedColumn(name="sex", kind="categorical", categories=["F"]),
            ObservedColumn(name="bmi", kind="numeric"),
        ],
    )
    base = wire.DataSummary(
        federation_id=FED,
        member=member,
        records=120,
        label_counts={"cold": 70, "flu": 50, "covid": 0},
        missing_rate={"age": 0.0, "sex": 0.0, "bmi": 0.25, "diagnosis": 0.0},
        schema_fingerprint=schema.fingerprint(),
        observed=observed,
        label_coverage=2 / 3,
        quality_score=0.5,
    )
    return msgspec.structs.replace(base, **changes).sign(identity_for(member))  # type: ignore[arg-type]


def join(member: str, data: wire.DataSummary | None) -> wire.JoinRequest:
    task = get_task(
        "table",
        features=["age", "sex=F", "sex=M", "bmi", "bmi__missing"],
        classes=SCHEMA["classes"],
    )
    return wire.JoinRequest(
        dataset_schema=task.schema.fingerprint(),
        task_version=task.version,
        samples=96,
        data_summary=data,
        graph_commitment="00" * 32,
        task_pin=loaded_task_pin("table"),
    )


def refused(
    fed: Federation, coord: Coordinator, exc: type[FedsecError], req: wire.JoinRequest
) -> str:
    before, logged = snapshot(fed.ws, coord), len(log_entries(fed.ws))
    with pytest.raises(exc) as info:
        coord.join("a0", 1, 0, req)
    assert snapshot(fed.ws, coord) == before and len(log_entries(fed.ws)) == logged
    return info.value.detail


def test_join_is_refused_naming_each_difference_and_changes_nothing(
    fed: Federation,
) -> None:
    coord = Coordinator(fed.ws, clock=FakeClock())
    detail = refused(fed, coord, TaskMismatch, join("a0", None))
    assert "must carry the member's signed data summary" in detail
    bad = summary(
        "a0",
        observed=ObservedSchema(
            label="diagnosis",
            classes=["cold", "gout"],
            columns=[
                ObservedColumn(name="age", kind="numeric", unit="months"),
                ObservedColumn(name="sex", kind="categorical", categories=["F", "U"]),
                ObservedColumn(name="zip", kind="categorical"),
            ],
        ),
    )
    detail = refused(fed, coord, TaskMismatch, join("a0", bad))
    assert detail == (
        "a0's data does not match the federation schema: "
        "column 'diagnosis': expected classes within ['cold', 'flu', 'covid'], "
        "found also ['gout']; "
        "column 'age': expected unit 'years', found unit 'months'; "
        "column 'sex': expected categories within ['F', 'M'], found also ['U']; "
        "column 'bmi': expected a numeric column, found no such column; "
        "column 'zip': expected no such column, found a categorical column"
    )
    assert "another member" in refused(fed, coord, PayloadError, join("a0", summary("a1")))
    forged = msgspec.structs.replace(summary("a0"), records=10_000)  # signature no longer fits
    refused(fed, coord, SignatureError, join("a0", forged))
    out_of_range = summary("a0", quality_score=1.5)
    refused(fed, coord, PayloadError, join("a0", out_of_range))
    inconsistent = summary("a0", records=500)
    assert "add up to 120, not its 500" in refused(
        fed, coord, PayloadError, join("a0", inconsistent)
    )
    junk = summary("a0", missing_rate={"\x1b[2J": 0.0})
    assert "unknown columns" in refused(fed, coord, PayloadError, join("a0", junk))
    other_schema = summary("a0", schema_fingerprint="0" * 64)
    assert "[data.schema] copy differs" in refused(
        fed, coord, TaskMismatch, join("a0", other_schema)
    )


def test_an_accepted_summary_is_logged_once_listed_and_reported(
    fed: Federation, tmp_path: Path
) -> None:
    coord = Coordinator(fed.ws, clock=FakeClock())
    good = summary("a0")
    assert coord.join("a0", 1, 0, join("a0", good)).detail == "joined"
    assert coord.join("a0", 1, 0, join("a0", good)).detail == "already joined"
    a1 = summary("a1", records=80, label_counts={"cold": 50, "flu": 30, "covid": 0})
    coord.join("a1", 1, 0, join("a1", a1))
    live = LiveView(lambda: (1, 0, "open", 0, 1, None), lambda: 3, dict, {})
    members = {m.id: m for m in SnapshotBuilder(coord, live, 0.0).build().members}
    assert (members["a0"].records, members["a0"].quality) == (120, 0.5)
    assert members["a2"].records is None  # no summary yet
    logged = [e["body"] for e in log_entries(fed.ws) if e["kind"] == "data_summary"]
    assert [b["member"] for b in logged] == ["a0", "a1"]
    assert logged[0]["label_counts"] == {"cold": 70, "flu": 50, "covid": 0}
    fed.ws.close()

    result = CliRunner().invoke(aggregator, ["inventory", "--workspace", str(fed.root), "--json"])
    assert result.exit_code == 0, result.output
    listed = json.loads(result.output)
    assert [(d["member"], d["records"]) for d in listed] == [("a0", 120), ("a1", 80)]
    text = CliRunner().invoke(aggregator, ["inventory", "--workspace", str(fed.root)]).output
    assert "a0: 120 records" in text and "worst missing rate 25.0% (bmi)" in text

    page, verified = build_report(fed.root / "audit" / "log.jsonl")
    assert verified.data_summaries == 2
    assert "<h2>Data summaries</h2>" in page and "a1</td><td class='n'>80" in page
