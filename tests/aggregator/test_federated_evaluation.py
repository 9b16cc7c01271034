"""Federated evaluation over HTTP: cohort members' signed metric reports on the model a
closed round produced are pooled into the federation's value (what ``/metrics`` and the
alerts follow); a report that is not sound, not the caller's, for a round the caller
was not in, or a second different one, is refused with a 4xx and changes nothing, the
pooled value included."""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.http import make_app
from fedsec.aggregator.ops.rules import AlertRules
from fedsec.aggregator.rounds.evaluation import EVALUATION_STAGE
from fedsec.aggregator.rounds.events import ModelEvaluated
from fedsec.crypto.identity import SigningIdentity
from fedsec.protocol import wire
from tests.support.aggregator import (
    FED,
    FakeClock,
    Federation,
    join_request,
    make_federation,
    plain_upload,
)
from tests.support.http import Api

pytestmark = pytest.mark.asyncio

COHORT = ("a0", "a1", "a2")
PATH = "/v1/rounds/1/evaluation?attempt=0"
# what each member's held-out split scores: (records, correct, loss sum)
HONEST = {"a0": (40, 30, 20.0), "a1": (10, 9, 2.0), "a2": (50, 40, 15.0)}
VERSION = 2  # round 1's model (version 1 is the initial one)


@pytest.fixture
def fed(tmp_path: Path) -> Federation:
    # a3 is enrolled but never joins round 1: it was not in its cohort
    return make_federation(
        tmp_path / "ws",
        agents=(*COHORT, "a3"),
        # members declare 100 records, above max_weight_samples: the cap bounds a report
        round={
            "secure_sum": "none",
            "min_agents": 3,
            "max_agents": 3,
            "rounds": 2,
            "max_weight_samples": 60,
        },
        validation=False,
        sections={"validation": {"federated": True}},
    )


@pytest_asyncio.fixture
async def api(
    fed: Federation, clock: FakeClock, aiohttp_client: Callable[..., Awaitable[TestClient]]
) -> Api:
    coord = Coordinator(fed.ws, clock=clock)
    for m in COHORT:
        coord.join(m, 1, 0, join_request(m, 1, samples=100))
    coord.tick()
    spec = coord.live.spec
    assert spec is not None and spec.federated_evaluation  # signed into the spec
    for m in COHORT:
        coord.masked_input(m, 1, 0, *plain_upload(m, spec, fed.identities))
    assert coord.live.round == 2  # round 1 closed
    row = fed.ws.state.rounds.get(1, 0)
    assert row is not None and row.model_version == VERSION
    client = await aiohttp_client(make_app(fed.ws, coord))
    return Api(client, fed, coord)


def _report(
    member: str, *, version: int = VERSION, round_: int = 1, **changes: Any
) -> wire.EvaluationReport:
    records, correct, loss = HONEST.get(member, (10, 5, 5.0))
    sums = {
        "accuracy": (correct, records),
        "cross_entropy": (loss, records),
        "loss": (loss, records),
    }
    report = wire.EvaluationReport(
        federation_id=FED,
        round=round_,
        attempt=0,
        member=member,
        model_version=version,
        records=records,
        metrics=[wire.MetricSum(n, float(t), float(w)) for n, (t, w) in sorted(sums.items())],
    )
    return msgspec.structs.replace(report, **changes)


def _signed(api: Api, report: wire.EvaluationReport, signer: str | None = None) -> bytes:
    return wire.encode(report.sign(api.fed.identities[signer or report.member]))


def _with_metric(report: wire.EvaluationReport, name: str, **changes: Any) -> wire.EvaluationReport:
    metrics = [
        msgspec.structs.replace(m, **changes) if m.name == name else m for m in report.metrics
    ]
    return msgspec.structs.replace(report, metrics=metrics)


async def _post(api: Api, who: str, body: bytes, path: str = PATH) -> tuple[int, bytes, str]:
    return await api.call(who, "POST", path, body)


def _pooled(api: Api) -> tuple[int, dict[str, float]] | None:
    evaluated = api.coord.evaluated(1, 0)
    return None if evaluated is None else (evaluated.members, evaluated.metrics)


async def test_reports_pool_into_the_weighted_mean_that_metrics_and_alerts_follow(
    api: Api,
) -> None:
    heard: list[ModelEvaluated] = []
    api.coord.events.subscribe(lambda e: heard.append(e) if isinstance(e, ModelEvaluated) else None)
    for m in ("a0", "a1"):
        assert await api.ok(m, "POST", PATH, _signed(api, _report(m))) == {"accepted": True}
    assert _pooled(api) == (2, {"accuracy": 39 / 50, "cross_entropy": 22 / 50, "loss": 22 / 50})
    assert [e.complete for e in heard] == [False, False]  # a2 survived and has not reported
    # the same report again is taken once: idempotent, nothing changes
    before = _pooled(api)
    assert await api.ok("a0", "POST", PATH, _signed(api, _report("a0"))) == {"accepted": True}
    assert _pooled(api) == before and len(heard) == 2
    await api.ok("a2", "POST", PATH, _signed(api, _report("a2")))
    assert heard[-1].complete and heard[-1].members == 3 and heard[-1].records == 100
    assert heard[-1].metrics["accuracy"] == pytest.approx(79 / 100)
    # the reports are kept signed, one per member
    stored = list(api.fed.ws.state.messages.of_stage(1, 0, EVALUATION_STAGE))
    assert sorted(m for m, _ in stored) == list(COHORT)
    for member, body in stored:
        decoded = msgspec.json.decode(body, type=wire.EvaluationReport)
        decoded.verify(api.fed.identities[member].public_bytes)

    # /metrics shows the members' pooled values (loopback scrape)
    async with api.client.get("/metrics") as answer:
        text = await answer.text()
    assert "fedsec_model_evaluation_members 3.0" in text
    assert 'fedsec_model_primary_metric{higher_is_better="true",metric="accuracy"} 0.79' in text


@pytest.mark.parametrize(
    ("attack", "status", "code", "fragment"),
    [
        # numbers that are not finite never decode (JSON has no NaN; 1e999 overflows)
        ("nan_total", 400, "bad_request", "not valid JSON"),
        ("overflowing_weight", 400, "bad_request", "evaluation report"),
        # a huge record count would outweigh every honest member in the pooled mean
        ("huge_count", 400, "bad_request", "more than 60 (the 100 it declared"),
        # more than the round's max_weight_samples, even within what it declared
        ("above_the_weight_cap", 400, "bad_request", "round.max_weight_samples = 60"),
        ("weight_above_records", 400, "bad_request", "weight 41 for 40 records"),
        ("accuracy_above_one", 400, "bad_request", "outside its range [0, 1]"),
        ("unknown_metric", 400, "bad_request", "unknown ['auc']"),
        ("missing_metric", 400, "bad_request", "missing ['accuracy']"),
        # a report for another member, signed by the caller or replayed from that member
        ("names_another_member", 400, "bad_request", "names another member"),
        ("another_members_report", 400, "bad_request", "names another member"),
        ("signed_by_another_key", 401, "bad_signature", ""),
        # a round the caller was not in, one that has not closed, another model version
        ("not_in_the_cohort", 403, "unknown_member", "not in the cohort of round 1"),
        ("round_in_progress", 409, "wrong_stage", "has not closed"),
        ("another_version", 409, "wrong_stage", "not v1"),
        # a second, different report of the same member for the same round
        ("second_different_report", 409, "duplicate", "already reported"),
    ],
)
async def test_unsound_reports_are_refused_and_change_nothing(
    api: Api, attack: str, status: int, code: str, fragment: str
) -> None:
    await api.ok("a1", "POST", PATH, _signed(api, _report("a1")))
    if attack == "second_different_report":
        await api.ok("a0", "POST", PATH, _signed(api, _report("a0")))
    pooled = _pooled(api)
    who, path = "a0", PATH
    honest = _report("a0")
    body: bytes
    match attack:
        case "nan_total":
            raw = json.loads(_signed(api, honest))
            raw["metrics"][0]["total"] = "NaN"
            body = json.dumps(raw).replace('"NaN"', "NaN").encode()
        case "overflowing_weight":
            body = _signed(api, honest).replace(b'"weight":40.0', b'"weight":1e999', 1)
            assert b"1e999" in body
        case "huge_count":
            huge = 10**12
            forged = msgspec.structs.replace(honest, records=huge)
            forged = _with_metric(
                _with_metric(forged, "accuracy", total=float(huge), weight=float(huge)),
                "loss",
                weight=float(huge),
            )
            body = _signed(api, _with_metric(forged, "cross_entropy", weight=float(huge)))
        case "above_the_weight_cap":
            forged = msgspec.structs.replace(honest, records=70)
            for name, total in (("accuracy", 50.0), ("cross_entropy", 30.0), ("loss", 30.0)):
                forged = _with_metric(forged, name, total=total, weight=70.0)
            body = _signed(api, forged)
        case "weight_above_records":
            body = _signed(api, _with_metric(honest, "accuracy", total=41.0, weight=41.0))
        case "accuracy_above_one":
            body = _signed(api, _with_metric(honest, "accuracy", total=45.0))
        case "unknown_metric":
            extra = [*honest.metrics, wire.MetricSum("auc", 1.0, 40.0)]
            body = _signed(api, msgspec.structs.replace(honest, metrics=extra))
        case "missing_metric":
            body = _signed(api, msgspec.structs.replace(honest, metrics=honest.metrics[1:]))
        case "names_another_member":
            body = _signed(api, _report("a2"), signer="a0")
        case "another_members_report":
            body = _signed(api, _report("a2"))  # a2's genuine report, sent by a0
        case "signed_by_another_key":
            body = wire.encode(honest.sign(SigningIdentity.generate()))
        case "not_in_the_cohort":
            who = "a3"
            body = _signed(api, _report("a3"))
        case "round_in_progress":
            path = "/v1/rounds/2/evaluation?attempt=0"
            body = _signed(api, _report("a0", round_=2))
        case "another_version":
            body = _signed(api, _report("a0", version=1))
        case "second_different_report":
            body = _signed(api, _with_metric(honest, "accuracy", total=10.0))
        case _:
            raise AssertionError(attack)
    detail = await api.refused(status, code, lambda: _post(api, who, body, path))
    assert fragment in detail, detail
    assert _pooled(api) == pooled  # the federation's value did not move


async def test_reports_are_refused_while_federated_evaluation_is_off(
    tmp_path: Path, clock: FakeClock, aiohttp_client: Callable[..., Awaitable[TestClient]]
) -> None:
    fed = make_federation(
        tmp_path / "off",
        agents=COHORT,
        round={"secure_sum": "none", "min_agents": 3, "max_agents": 3, "rounds": 2},
    )
    coord = Coordinator(fed.ws, clock=clock)
    for m in COHORT:
        coord.join(m, 1, 0, join_request(m, 1, samples=50))
    coord.tick()
    assert coord.live.spec is not None and not coord.live.spec.federated_evaluation
    for m in COHORT:
        coord.masked_input(m, 1, 0, *plain_upload(m, coord.live.spec, fed.identities))
    api = Api(await aiohttp_client(make_app(fed.ws, coord)), fed, coord)
    detail = await api.refused(
        409, "wrong_stage", lambda: _post(api, "a0", _signed(api, _report("a0")))
    )
    assert "validation.federated" in detail


async def test_degradation_follows_complete_federated_scores() -> None:
    """The degradation rule judges a version once all its survivors reported, in the
    primary metric's direction, and each version once."""
    raised: list[tuple[str, str, str]] = []

    class Desk:
        def raise_alert(self, kind: str, subject: str, detail: str) -> object:
            raised.append((kind, subject, detail))
            return object()

    class NoRounds:
        def history(self, limit: int = 1000) -> list[Any]:
            return []

    from fedsec.config import AlertsSection

    rules = AlertRules(
        AlertsSection(degradation_window=3, accuracy_drop=0.05, loss_rise=0.0),
        Desk(),  # type: ignore[arg-type]
        NoRounds(),  # type: ignore[arg-type]
        federated=("mae", False),
    )

    def evaluated(version: int, mae: float, complete: bool) -> ModelEvaluated:
        return ModelEvaluated(version, 0, version, {"mae": mae, "loss": 1.0}, 3, 90, complete)

    for version, mae in [(1, 0.50), (2, 0.40)]:
        rules.on_event(evaluated(version, mae, True))
    rules.on_event(evaluated(3, 0.90, False))  # partial: not judged yet
    assert raised == []
    rules.on_event(evaluated(3, 0.47, True))  # 0.07 above the lowest (0.40)
    rules.on_event(evaluated(3, 0.47, True))  # a late report of a dropped member: once
    assert len(raised) == 1
    kind, subject, detail = raised[0]
    assert (kind, subject) == ("validation_degraded", "model 3")
    assert "mae 0.4700 is 0.0700 above the best (0.4000)" in detail
    assert math.isclose(0.47 - 0.40, 0.07)


async def test_a_restarted_aggregator_shows_the_members_scores_it_stored(api: Api) -> None:
    from fedsec.aggregator.ops import Operations

    for m in COHORT:
        await api.ok(m, "POST", PATH, _signed(api, _report(m)))
    # a fresh coordinator over the same state, as at start-up: rebuilt from the store
    ops = Operations(Coordinator(api.fed.ws, clock=FakeClock()))
    assert ops.live.federated and ops.live.evaluators == 3
    assert ops.live.metrics["accuracy"] == pytest.approx(79 / 100)
    assert ops.live.evaluations[VERSION][1] == 3
    # the dashboard's models view carries them next to the manifest's (empty) metrics
    snapshot = ops.dashboard.build()
    (view,) = [m for m in snapshot.models if m.version == VERSION]
    assert view.evaluators == 3 and view.evaluated["accuracy"] == pytest.approx(0.79)
    assert view.metrics == {}  # validation.enabled = false: the aggregator scored nothing
