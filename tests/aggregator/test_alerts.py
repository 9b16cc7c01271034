"""Operator alerts (issue 14): every rule raises its kind with a detail that says what
happened; each alert is stored, written to the transparency log as an ``alert`` entry,
announced on the event bus and counted in the metrics; an open alert is not raised
twice and an acknowledged one can be; refusals about made-up rounds raise nothing and
log nothing; the operator lists and acknowledges alerts from the command line.

The round engine is driven directly (real SQLite, real transparency log, a fake clock),
with :class:`~fedsec.aggregator.ops.Operations` listening on its event bus as it does
in the served aggregator; auditors' verdicts go over a real loopback socket.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from click.testing import CliRunner

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.http import make_app
from fedsec.aggregator.http.keys import NONCES, OPS
from fedsec.aggregator.ops import Operations
from fedsec.aggregator.ops.rules import AlertRules
from fedsec.aggregator.rounds.alerts import ALERT_KINDS
from fedsec.aggregator.rounds.events import AlertRaised, ContributionRefused, Event, RoundEnded
from fedsec.aggregator.storage.interfaces import AlertRow
from fedsec.audit.verify import verify_log
from fedsec.cli import main
from fedsec.errors import FedsecError, SignatureError, WrongStage
from fedsec.protocol import wire
from tests.support.aggregator import (
    FAST_ROUND,
    Cohort,
    FakeClock,
    Federation,
    fetch_shares,
    join_request,
    log_entries,
    make_federation,
    mask_all,
    privacy_report,
    share_all,
)
from tests.support.aggregator import (
    advertise_all as _advertise,
)
from tests.support.aggregator import (
    attempt_of as _ra,
)
from tests.support.aggregator import (
    unmask_all as _unmask,
)
from tests.support.hostile import (
    Served,
    assert_unchanged,
    durable_state,
    exchange,
    serve,
    signed_request,
)

pytestmark = pytest.mark.timeout(60)

MEMBERS = ("a0", "a1", "a2", "a3", "a4")
VERDICTS = "/v1/audit/verdicts"


# -- a federation with [alerts] settings, and what listens to it -----------------------------------


def _federation(
    root: Path,
    *,
    alerts: Mapping[str, Any] | None = None,
    round: Mapping[str, Any] | None = None,
    agents: tuple[str, ...] = MEMBERS,
    auditors: tuple[str, ...] = (),
) -> Federation:
    """A fresh workspace whose federation.toml also carries ``[alerts]`` overrides."""
    return make_federation(
        root,
        agents,
        auditors=auditors,
        round=round,
        validation=False,
        sections={"alerts": dict(alerts or {})},
    )


@dataclass
class Desk:
    """A coordinator, its operations, and every event its bus announced."""

    fed: Federation
    coord: Coordinator
    ops: Operations
    heard: list[Event] = field(default_factory=list)

    @property
    def raised(self) -> list[AlertRaised]:
        return [e for e in self.heard if isinstance(e, AlertRaised)]

    def refusals(self) -> list[ContributionRefused]:
        return [e for e in self.heard if isinstance(e, ContributionRefused)]


def _desk(fed: Federation, clock: FakeClock) -> Desk:
    coord = Coordinator(fed.ws, clock=clock)
    desk = Desk(fed, coord, Operations(coord))
    coord.events.subscribe(desk.heard.append)
    return desk


def _counted(ops: Operations, kind: str) -> float:
    """fedsec_alerts_raised_total{kind} as the scrape shows it."""
    value = ops.metrics.registry.get_sample_value("fedsec_alerts_raised_total", {"kind": kind})
    return value or 0.0


def _alerts(fed: Federation) -> list[AlertRow]:
    return fed.ws.state.alerts.recent(10_000)


def _alert_entries(fed: Federation) -> list[dict[str, Any]]:
    return [e["body"] for e in log_entries(fed.ws) if e["kind"] == "alert"]


def _assert_raised(
    desk: Desk, kind: str, subject: str, *fragments: str, count: int = 1
) -> AlertRow:
    """The one open ``kind`` alert about ``subject``: its detail says each of
    ``fragments``; it is in the state, in the transparency log, on the bus (with the
    capability whose hash is stored) and in fedsec_alerts_raised_total{kind}, which now
    counts ``count`` alerts of that kind."""
    fed = desk.fed
    (row,) = [
        r for r in _alerts(fed) if (r.kind, r.subject) == (kind, subject) and r.acked_at is None
    ]
    assert kind in ALERT_KINDS
    for fragment in fragments:
        assert fragment in row.detail, (fragment, row.detail)
    assert row.raised_at == desk.coord.context.clock()
    logged = [b for b in _alert_entries(fed) if b.get("kind") == kind and b["detail"] == row.detail]
    assert logged == [{"detail": row.detail, "time": row.raised_at, "kind": kind}]
    (event,) = [e for e in desk.raised if e.alert.id == row.id]
    assert event.alert == row
    assert len(event.ack_token) == 64
    assert hashlib.sha256(event.ack_token.encode()).hexdigest() == row.ack_sha256
    assert _counted(desk.ops, kind) == count
    return row


def _verifies(fed: Federation) -> None:
    audit = fed.root / "audit"
    result = verify_log(audit / "log.jsonl", audit / "archive", fed.root)
    assert result.ok, result.problem


# -- driving a round -------------------------------------------------------------------------------


def _start(desk: Desk, members: tuple[str, ...] = MEMBERS) -> Cohort:
    coord = desk.coord
    r, a = coord.live.round, coord.live.attempt
    for m in members:
        assert coord.join(m, r, a, join_request(m, r)).accepted
    coord.tick()
    assert coord.live.spec is not None and coord.live.stage == "advertise"
    return Cohort(coord.live.spec, desk.fed.identities)


def _share(coord: Coordinator, cohort: Cohort, members: tuple[str, ...]) -> None:
    share_all(coord, cohort, members)
    fetch_shares(coord, cohort, members)


def _masked(coord: Coordinator, cohort: Cohort, members: tuple[str, ...]) -> None:
    mask_all(coord, cohort, members)


def _to_masked_input(desk: Desk) -> Cohort:
    cohort = _start(desk)
    _advertise(desk.coord, cohort, MEMBERS)
    _share(desk.coord, cohort, MEMBERS)
    assert desk.coord.live.stage == "masked_input"
    return cohort


def _refuse(coord: Coordinator, exc: type[FedsecError], member: str, *args: Any) -> None:
    with pytest.raises(exc):
        coord.masked_input(member, *args)


def _tampered(cohort: Cohort, member: str, i: int) -> tuple[bytes, str, str]:
    """``member``'s genuine statement over bytes it did not sign (distinct for each i)."""
    raw, commitment, signature = cohort.upload(member)
    changed = bytearray(raw)
    changed[i] ^= 1
    return bytes(changed), commitment, signature


# -- each rule -------------------------------------------------------------------------------------


def test_a_stage_unchanged_for_stall_s_raises_round_stalled_once(
    tmp_path: Path, clock: FakeClock
) -> None:
    fed = _federation(
        tmp_path / "ws",
        alerts={"stall_s": 120.0},
        round={"open_s": 3600.0, "advertise_s": 3600.0},
    )
    desk = _desk(fed, clock)
    coord, ops = desk.coord, desk.ops
    assert coord.join("a0", 1, 0, join_request("a0", 1)).accepted  # one of three: no cohort yet
    clock.advance(119.0)
    coord.tick()
    ops.tick()
    assert _alerts(fed) == [] and _counted(ops, "round_stalled") == 0
    clock.advance(1.0)
    coord.tick()
    ops.tick()
    assert coord.live.stage == "open"
    first = _assert_raised(
        desk,
        "round_stalled",
        "round 1.0 open",
        "round 1 attempt 0 has been in stage open for 120 s",
        "alerts.stall_s = 120",
    )
    clock.advance(300.0)  # still stalled in the same stage: one alert, not one per tick
    for _ in range(3):
        coord.tick()
        ops.tick()
    assert [r.id for r in _alerts(fed)] == [first.id]

    # the stage moves on, and stalls again: a new alert about the new stage
    for m in MEMBERS[1:]:
        coord.join(m, 1, 0, join_request(m, 1))
    coord.tick()
    assert coord.live.stage == "advertise"
    clock.advance(60.0)
    ops.tick()
    assert len(_alerts(fed)) == 1
    clock.advance(60.0)
    ops.tick()
    _assert_raised(
        desk, "round_stalled", "round 1.0 advertise", "in stage advertise for 120 s", count=2
    )
    _verifies(fed)


def test_an_aborted_attempt_raises_round_aborted_naming_the_lost_members(
    tmp_path: Path, clock: FakeClock
) -> None:
    fed = _federation(tmp_path / "ws")
    desk = _desk(fed, clock)
    coord = desk.coord
    cohort = _start(desk)
    _advertise(coord, cohort, MEMBERS[:2])  # threshold 3 of 5: too few to go on
    clock.advance(FAST_ROUND["advertise_s"])
    coord.tick()
    assert _ra(coord) == (1, 1)
    row = _assert_raised(
        desk, "round_aborted", "round 1.0", "round 1 attempt 0 aborted", "'a2'", "'a4'"
    )
    # an aborted attempt is not a closed one with low participation
    assert [r.kind for r in _alerts(fed)] == ["round_aborted"]

    # the retried attempt aborts too: its own alert
    _start(desk, MEMBERS)
    clock.advance(FAST_ROUND["advertise_s"])
    coord.tick()
    assert _ra(coord) == (1, 2)
    again = _assert_raised(desk, "round_aborted", "round 1.1", "round 1 attempt 1", count=2)
    assert again.id > row.id
    assert [b["kind"] for b in _alert_entries(fed)] == ["round_aborted", "round_aborted"]
    _verifies(fed)


def test_an_attempt_closed_with_too_few_of_its_cohort_raises_participation_dropped(
    tmp_path: Path, clock: FakeClock
) -> None:
    fed = _federation(tmp_path / "ws", alerts={"participation_min": 1.0})
    desk = _desk(fed, clock)
    coord = desk.coord
    cohort = _to_masked_input(desk)
    survivors = MEMBERS[:4]
    _masked(coord, cohort, survivors)  # a4 is lost after sharing its keys
    clock.advance(FAST_ROUND["masked_s"] + FAST_ROUND["open_s"])  # training time included
    coord.tick()
    assert coord.live.stage == "consistency"
    _unmask(coord, cohort, survivors)
    assert _ra(coord) == (2, 0)  # the round closed, with a new model
    assert fed.ws.models.latest().version == 2
    _assert_raised(
        desk,
        "participation_dropped",
        "round 1.0",
        "round 1 attempt 0 closed with 4 of its 5 members' contributions",
        "below 100%",
        "dropped: a4",
    )

    # a full round at the same threshold raises nothing more
    cohort = _to_masked_input(desk)
    _masked(coord, cohort, MEMBERS)
    _unmask(coord, cohort, MEMBERS)
    assert _ra(coord) == (3, 0)
    assert [r.kind for r in _alerts(fed)] == ["participation_dropped"]
    _verifies(fed)


def test_a_drop_within_participation_min_raises_nothing(tmp_path: Path, clock: FakeClock) -> None:
    fed = _federation(tmp_path / "ws", alerts={"participation_min": 0.8})
    desk = _desk(fed, clock)
    coord = desk.coord
    cohort = _to_masked_input(desk)
    _masked(coord, cohort, MEMBERS[:4])  # 4 of 5 = 80%: not below the minimum
    clock.advance(FAST_ROUND["masked_s"] + FAST_ROUND["open_s"])  # training time included
    coord.tick()
    _unmask(coord, cohort, MEMBERS[:4])
    assert _ra(coord) == (2, 0)
    assert _alerts(fed) == [] and _alert_entries(fed) == []


def test_repeated_refusals_of_a_cohort_member_raise_member_refused(
    tmp_path: Path, clock: FakeClock
) -> None:
    fed = _federation(
        tmp_path / "ws",
        alerts={"refusals_per_member": 3, "refusals_window_s": 60.0},
        round={"masked_s": 3600.0},
    )
    desk = _desk(fed, clock)
    coord, ops = desk.coord, desk.ops
    cohort = _to_masked_input(desk)

    # two refusals, then the window passes: they no longer count
    _refuse(coord, SignatureError, "a1", 1, 0, *_tampered(cohort, "a1", 0))
    _refuse(coord, FedsecError, "a1", 1, 0, b"\x00" * 3, *cohort.upload("a1")[1:])
    clock.advance(61.0)
    _refuse(coord, SignatureError, "a1", 1, 0, *_tampered(cohort, "a1", 1))
    _refuse(coord, SignatureError, "a1", 1, 0, *_tampered(cohort, "a1", 2))
    assert _alerts(fed) == []
    # another member's refusals are its own
    _refuse(coord, SignatureError, "a2", 1, 0, *_tampered(cohort, "a2", 0))
    _refuse(coord, SignatureError, "a2", 1, 0, *_tampered(cohort, "a2", 1))
    assert _alerts(fed) == []
    # the third within the window
    _refuse(coord, SignatureError, "a1", 1, 0, *_tampered(cohort, "a1", 3))
    row = _assert_raised(
        desk,
        "member_refused",
        "member a1",
        "a1: 3 contributions refused within 60 s",
        "latest: bad_signature, round 1.0",
    )
    assert all(e.in_cohort for e in desk.refusals())
    assert ops.metrics.registry.get_sample_value(
        "fedsec_contributions_refused_total", {"code": "bad_signature"}
    ) == len([e for e in desk.refusals() if e.code == "bad_signature"])

    # while it is open, more refusals raise nothing
    for i in range(4, 8):
        _refuse(coord, SignatureError, "a1", 1, 0, *_tampered(cohort, "a1", i))
    assert [r.id for r in _alerts(fed)] == [row.id]
    assert len(desk.raised) == 1 and _counted(ops, "member_refused") == 1

    # acknowledged, it is raised again by the next burst
    coord.alert_desk.ack(row.id, "operator")
    _refuse(coord, SignatureError, "a1", 1, 0, *_tampered(cohort, "a1", 9))
    again = _assert_raised(desk, "member_refused", "member a1", "a1:", count=2)
    assert again.id != row.id and again.ack_sha256 != row.ack_sha256
    assert [b["kind"] for b in _alert_entries(fed)] == ["member_refused", "member_refused"]

    # the refused member still contributes: alerts change nothing in the round
    _masked(coord, cohort, MEMBERS)
    _unmask(coord, cohort, MEMBERS)
    assert _ra(coord) == (2, 0)
    _verifies(fed)


def test_refusals_for_made_up_rounds_raise_no_alert_and_write_nothing(
    tmp_path: Path, clock: FakeClock
) -> None:
    fed = _federation(
        tmp_path / "ws",
        agents=(*MEMBERS, "a5"),
        alerts={"refusals_per_member": 1},
        round={"max_agents": 5},
    )
    desk = _desk(fed, clock)
    coord, ops = desk.coord, desk.ops
    cohort = _to_masked_input(desk)
    assert "a5" not in cohort.spec.cohort
    upload = cohort.upload("a1")
    junk = (b"\x00" * 16, "00" * 32, "00" * 64)
    before = durable_state(fed.ws)
    # made-up rounds and attempts, a member outside the cohort: refused, but not about an
    # attempt the member is part of
    for r, a in [(2, 0), (99, 0), (1, 1), (1, 7), (0, 0)]:
        _refuse(coord, WrongStage, "a1", r, a, *upload)
        _refuse(coord, WrongStage, "a1", r, a, *junk)
    _refuse(coord, FedsecError, "a5", 1, 0, *junk)
    assert len(desk.refusals()) == 11
    assert not any(e.in_cohort for e in desk.refusals())
    assert_unchanged(before, durable_state(fed.ws))
    assert _alerts(fed) == [] and desk.raised == [] and _counted(ops, "member_refused") == 0
    # the scrape still counts them
    assert (
        ops.metrics.registry.get_sample_value(
            "fedsec_contributions_refused_total", {"code": "wrong_stage"}
        )
        == 10
    )

    # one refusal about the live attempt is enough at refusals_per_member = 1
    _refuse(coord, SignatureError, "a1", 1, 0, *_tampered(cohort, "a1", 0))
    _assert_raised(desk, "member_refused", "member a1", "a1: 1 contributions refused")


_report = privacy_report


def test_a_report_near_the_members_budget_raises_member_near_budget(
    tmp_path: Path, clock: FakeClock
) -> None:
    fed = _federation(tmp_path / "ws", alerts={"budget_fraction": 0.9, "epsilon_budget": 5.0})
    desk = _desk(fed, clock)
    coord = desk.coord
    _start(desk)
    ids = fed.identities
    # under the fraction of the budget the member declared, or of the configured one
    coord.report("a0", 1, 0, _report("a0", 8.9, epsilon_budget=10.0).sign(ids["a0"]))
    coord.report("a1", 1, 0, _report("a1", 4.4).sign(ids["a1"]))
    # a declared budget replaces the configured one: 6 is far under 90% of 100
    coord.report("a3", 1, 0, _report("a3", 6.0, epsilon_budget=100.0).sign(ids["a3"]))
    assert _alerts(fed) == []

    coord.report("a2", 1, 0, _report("a2", 9.0, epsilon_budget=10.0).sign(ids["a2"]))
    _assert_raised(
        desk,
        "member_near_budget",
        "member a2",
        "a2 has spent epsilon 9.000 of its budget 10 (90%) by round 1",
    )
    # no budget declared: alerts.epsilon_budget
    coord.report("a4", 1, 0, _report("a4", 4.5).sign(ids["a4"]))
    _assert_raised(
        desk, "member_near_budget", "member a4", "epsilon 4.500 of its budget 5 (90%)", count=2
    )
    assert len(_alerts(fed)) == 2


def _summary(version: int, accuracy: float | None, loss: float | None) -> wire.RoundSummary:
    return wire.RoundSummary(
        round=version - 1,
        attempt=0,
        stage="closed",
        cohort=5,
        participants=5,
        survivors=5,
        dropped=[],
        model_version=version,
        accuracy=accuracy,
        loss=loss,
        aggregation_s=0.01,
        duration_s=1.0,
        epsilon_max=None,
        detail="",
    )


def _ended(summary: wire.RoundSummary) -> RoundEnded:
    return RoundEnded(summary, "unmask", 0.5, "", tuple(MEMBERS), 1_700_000_000.0)


def test_a_model_scoring_below_the_recent_best_raises_validation_degraded(
    tmp_path: Path, clock: FakeClock
) -> None:
    fed = _federation(
        tmp_path / "ws",
        alerts={"degradation_window": 3, "accuracy_drop": 0.05, "loss_rise": 0.5},
    )
    desk = _desk(fed, clock)
    cfg = fed.ws.config.alerts
    rules = AlertRules(cfg, desk.coord.alert_desk, fed.ws.state.rounds)

    # within accuracy_drop of the best of the previous 3; 0.895 would be more than 0.05
    # below 0.95, which has left the window by then
    scores = [(2, 0.95, 0.30), (3, 0.90, 0.30), (4, 0.92, 0.25), (5, 0.91, 0.30)]
    for version, accuracy, loss in [*scores, (6, 0.895, 0.30)]:
        rules.on_event(_ended(_summary(version, accuracy, loss)))
    rules.on_event(_ended(_summary(7, None, None)))  # not scored: not compared
    aborted = msgspec.structs.replace(_summary(8, 0.10, 9.0), stage="aborted")
    rules.on_event(RoundEnded(aborted, "masked_input", 1.0, "aborted", (), 0.0))
    assert _alerts(fed) == []

    rules.on_event(_ended(_summary(9, 0.86, 0.30)))  # 0.92 - 0.86 = 0.06 > 0.05
    _assert_raised(
        desk,
        "validation_degraded",
        "model 9",
        "model version 9 (round 8): accuracy 0.8600 is 0.0600 below the best (0.9200) "
        "of the previous 3 versions",
    )
    # the loss rising more than loss_rise above the window's lowest (0.30 * 1.5)
    rules.on_event(_ended(_summary(10, 0.90, 0.50)))
    row = _assert_raised(
        desk,
        "validation_degraded",
        "model 10",
        "loss 0.5000 is 67% above the lowest (0.3000) of the previous 3 versions",
        count=2,
    )
    assert "accuracy" not in row.detail
    assert len(_alerts(fed)) == 2


def _scored(version: int, metric: str, higher_is_better: bool, value: float) -> RoundEnded:
    summary = msgspec.structs.replace(
        _summary(version, None, 0.30),
        primary_metric=metric,
        higher_is_better=higher_is_better,
        metrics={metric: value, "loss": 0.30},
    )
    return _ended(summary)


def test_validation_degraded_follows_the_primary_metrics_direction(
    tmp_path: Path, clock: FakeClock
) -> None:
    fed = _federation(
        tmp_path / "ws",
        alerts={"degradation_window": 3, "accuracy_drop": 0.05, "loss_rise": 0.0},
    )
    desk = _desk(fed, clock)
    rules = AlertRules(fed.ws.config.alerts, desk.coord.alert_desk, fed.ws.state.rounds)
    # a lower-is-better metric (mae): falling is improving, whatever the amount
    for version, mae in [(2, 0.60), (3, 0.50), (4, 0.30)]:
        rules.on_event(_scored(version, "mae", False, mae))
    assert _alerts(fed) == []
    rules.on_event(_scored(5, "mae", False, 0.36))  # 0.06 above the lowest (0.30)
    _assert_raised(
        desk,
        "validation_degraded",
        "model 5",
        "model version 5 (round 4): mae 0.3600 is 0.0600 above the best (0.3000) "
        "of the previous 3 versions",
    )
    # a higher-is-better metric (r2, another federation's) rising raises nothing; falling does
    rules = AlertRules(fed.ws.config.alerts, desk.coord.alert_desk, fed.ws.state.rounds)
    for version, r2 in [(6, 0.20), (7, 0.45)]:
        rules.on_event(_scored(version, "r2", True, r2))
    assert len(_alerts(fed)) == 1
    rules.on_event(_scored(8, "r2", True, 0.39))
    _assert_raised(
        desk, "validation_degraded", "model 8", "r2 0.3900 is 0.0600 below the best (0.4500)",
        count=2,
    )  # fmt: skip


def _ddp_closed(
    version: int, coordinates: int, edge_count: int, noise_multiplier: float = 1.1
) -> RoundEnded:
    """Round ``version - 1`` closed with a sum of ``coordinates``, ``edge_count`` of them
    at the ring's edge (0 coordinates: no sum that can wrap), with distributed-DP noise
    (``noise_multiplier`` 0: a compressed round with fewer headroom bits)."""
    summary = msgspec.structs.replace(
        _summary(version, None, None),
        coordinates=coordinates,
        edge_count=edge_count,
        noise_multiplier=noise_multiplier if coordinates else 0.0,
    )
    return _ended(summary)


def test_a_distributed_round_with_coordinates_at_the_ring_edge_raises_ring_wrapped(
    tmp_path: Path, clock: FakeClock
) -> None:
    fed = _federation(tmp_path / "ws", alerts={"wrap_rate_max": 0.0})  # any wrap
    desk = _desk(fed, clock)
    bus = desk.coord.events  # the served aggregator's rules listen here (Operations)

    bus.emit(_ddp_closed(2, 5211, 0))  # distributed, nothing at the edge
    bus.emit(_ddp_closed(3, 0, 0))  # not distributed: no ring sum was counted
    bus.emit(_ddp_closed(4, 0, 7))  # no coordinates summed: no rate, whatever the count
    aborted = msgspec.structs.replace(
        _summary(5, None, None), stage="aborted", coordinates=5211, edge_count=9
    )
    bus.emit(RoundEnded(aborted, "unmask", 1.0, "aborted", (), 0.0))  # no model from it
    assert _alerts(fed) == [] and desk.raised == [] and _counted(desk.ops, "ring_wrapped") == 0

    bus.emit(_ddp_closed(6, 5211, 3))
    row = _assert_raised(
        desk,
        "ring_wrapped",
        "round 5.0",
        "round 5 attempt 0 closed with 3 of the 5211 coordinates of its distributed-DP sum "
        "at the ring's edge (wrap rate 0.000576, above alerts.wrap_rate_max = 0)",
        "corrupted in model version 6",
        "raise round.quant_bits",
    )
    # the alert and the scrape count the same wraps: the closed distributed rounds' only
    wrapped = desk.ops.metrics.registry.get_sample_value("fedsec_ddp_wrapped_coordinates_total")
    assert wrapped == 3
    # a single wrap is enough at 0, and each round is its own alert
    bus.emit(_ddp_closed(7, 5211, 1))
    again = _assert_raised(
        desk, "ring_wrapped", "round 6.0", "1 of the 5211 coordinates", "0.000192", count=2
    )
    assert again.id > row.id
    assert [b["kind"] for b in _alert_entries(fed)] == ["ring_wrapped", "ring_wrapped"]
    # a compressed round whose codec has fewer headroom bits names its own remedy
    bus.emit(_ddp_closed(8, 2605, 40, noise_multiplier=0.0))
    _assert_raised(
        desk,
        "ring_wrapped",
        "round 7.0",
        "40 of the 2605 coordinates of its compressed sum at the ring's edge",
        "raise codec.headroom_bits",
        count=3,
    )


def test_ring_wrapped_respects_alerts_wrap_rate_max(tmp_path: Path, clock: FakeClock) -> None:
    fed = _federation(tmp_path / "ws", alerts={"wrap_rate_max": 0.001})
    desk = _desk(fed, clock)
    rules = AlertRules(fed.ws.config.alerts, desk.coord.alert_desk, fed.ws.state.rounds)

    rules.on_event(_ddp_closed(2, 5211, 5))  # 0.00096: under
    rules.on_event(_ddp_closed(3, 1000, 1))  # 0.001: at the threshold, not above it
    rules.on_event(_ddp_closed(4, 0, 3))  # no coordinates summed: no rate (and no error)
    assert _alerts(fed) == []

    rules.on_event(_ddp_closed(5, 1000, 2))  # 0.002: above
    _assert_raised(
        desk,
        "ring_wrapped",
        "round 4.0",
        "2 of the 1000 coordinates",
        "wrap rate 0.002, above alerts.wrap_rate_max = 0.001",
    )

    # 1 turns the alert off: no rate exceeds it, not even every coordinate at the edge
    off = AlertRules(
        msgspec.structs.replace(fed.ws.config.alerts, wrap_rate_max=1.0),
        desk.coord.alert_desk,
        fed.ws.state.rounds,
    )
    off.on_event(_ddp_closed(6, 1000, 1000))
    assert [r.subject for r in _alerts(fed)] == ["round 4.0"]


def _damage_newest_model(fed: Federation, clock: FakeClock) -> int:
    """Close a round (version 2), then damage version 2's file; returns 2."""
    desk = _desk(fed, clock)
    cohort = _start(desk, MEMBERS[:3])
    _advertise(desk.coord, cohort, MEMBERS[:3])
    _share(desk.coord, cohort, MEMBERS[:3])
    _masked(desk.coord, cohort, MEMBERS[:3])
    _unmask(desk.coord, cohort, MEMBERS[:3])
    newest = fed.ws.models.latest()
    assert newest.version == 2
    path = fed.root / "models" / f"{newest.sha256}.safetensors"
    path.write_bytes(path.read_bytes()[:-7] + b"garbage")
    return newest.version


def test_a_damaged_stored_model_raises_model_unusable_at_start_up(
    tmp_path: Path, clock: FakeClock
) -> None:
    fed = _federation(tmp_path / "ws", agents=MEMBERS[:3])
    _damage_newest_model(fed, clock)
    restarted = Coordinator(fed.ws, clock=clock)
    # what start-up found is replayed to operations subscribing after it
    later = Desk(fed, restarted, Operations(restarted))
    restarted.events.subscribe(later.heard.append, replay=True)
    row = _assert_raised(
        later,
        "model_unusable",
        "model 2",
        "model version 2 is unusable",
        "does not match",
        "serving the last good version 1",
    )
    assert restarted.round_state().model_version == 1
    assert (
        later.ops.metrics.registry.get_sample_value(
            "fedsec_alerts_open", {"kind": "model_unusable"}
        )
        == 1
    )
    # a second restart while it is open raises nothing new
    again = Coordinator(fed.ws, clock=clock)
    assert [r.id for r in _alerts(fed)] == [row.id]
    assert [b["kind"] for b in _alert_entries(fed)] == ["model_unusable"]
    assert again.round_state().model_version == 1
    # and an auditor replaying the log finds the same damage
    audit = fed.root / "audit"
    result = verify_log(audit / "log.jsonl", audit / "archive", fed.root)
    assert not result.ok and "does not match manifest v2" in result.problem


def test_the_served_aggregator_counts_a_model_unusable_alert_raised_at_start_up(
    tmp_path: Path, clock: FakeClock
) -> None:
    fed = _federation(tmp_path / "ws", agents=MEMBERS[:3])
    _damage_newest_model(fed, clock)
    app = make_app(fed.ws)  # as `fedsec aggregator serve` builds it
    try:
        assert [r.kind for r in _alerts(fed)] == ["model_unusable"]
        assert _counted(app[OPS], "model_unusable") == 1
        assert app[OPS].live.last_alert == _alerts(fed)[0].id
    finally:
        app[NONCES].close()


# -- acknowledging ---------------------------------------------------------------------------------


def test_an_acknowledged_alert_can_be_raised_again(tmp_path: Path, clock: FakeClock) -> None:
    fed = _federation(tmp_path / "ws")
    desk = _desk(fed, clock)
    alerts = desk.coord.alert_desk
    first = alerts.raise_alert("round_stalled", "round 1.0 open", "stalled for a while")
    assert first is not None
    assert alerts.raise_alert("round_stalled", "round 1.0 open", "stalled still") is None
    other = alerts.raise_alert("round_stalled", "round 1.0 advertise", "another stage")
    assert other is not None
    before = len(log_entries(fed.ws))
    clock.advance(5.0)
    acked = alerts.ack(first.id, "operator")
    assert (acked.acked_by, acked.acked_at) == ("operator", clock.now)
    assert alerts.ack(first.id, "someone else") == acked  # twice changes nothing
    assert len(log_entries(fed.ws)) == before  # acknowledging writes no log entry
    again = alerts.raise_alert("round_stalled", "round 1.0 open", "stalled once more")
    assert again is not None and again.id > other.id
    assert _assert_raised(desk, "round_stalled", "round 1.0 open", "once more", count=3) == again
    assert [e.alert.id for e in desk.raised] == [first.id, other.id, again.id]


# -- auditors' verdicts over HTTP ------------------------------------------------------------------


def _full_round(coord: Coordinator, fed: Federation) -> None:
    """Round ``coord.live.round`` closed with every member's contribution."""
    r, a = _ra(coord)
    for m in MEMBERS:
        assert coord.join(m, r, a, join_request(m, r)).accepted
    coord.tick()
    assert coord.live.spec is not None
    cohort = Cohort(coord.live.spec, fed.identities)
    _advertise(coord, cohort, MEMBERS)
    _share(coord, cohort, MEMBERS)
    _masked(coord, cohort, MEMBERS)
    _unmask(coord, cohort, MEMBERS)
    assert _ra(coord) == (r + 1, 0)


@pytest_asyncio.fixture
async def served(tmp_path: Path, clock: FakeClock) -> AsyncIterator[tuple[Federation, Served]]:
    """Rounds 1 and 2 closed with every member's contribution (what auditors judge)."""
    fed = _federation(tmp_path / "ws", auditors=("aud", "aud2"))
    coord = Coordinator(fed.ws, clock=clock)
    _full_round(coord, fed)
    _full_round(coord, fed)
    srv = await serve(fed.ws, coord)
    try:
        yield fed, srv
    finally:
        await srv.stop()
        fed.ws.close()


async def _submit(
    fed: Federation, srv: Served, who: str, *verdicts: wire.AuditVerdict
) -> tuple[int, Any]:
    body = wire.encode(wire.VerdictSubmission(verdicts=list(verdicts)))
    answer = await exchange(
        srv.port, signed_request(fed.identities[who], "POST", VERDICTS, body), timeout=5.0
    )
    return answer.status, answer.json()


def _verdict(member: str, passed: bool, *failed: str, round_: int = 1) -> wire.AuditVerdict:
    return wire.AuditVerdict(
        round=round_, attempt=0, member=member, passed=passed, failed=list(failed)
    )


@pytest.mark.asyncio
async def test_a_failed_audit_verdict_raises_audit_failed(
    served: tuple[Federation, Served],
) -> None:
    fed, srv = served
    ops = srv.app[OPS]
    fail = _verdict("a0", False, "control_accuracy", "norm_bound")
    status, receipt = await _submit(fed, srv, "aud", fail, _verdict("a1", True))
    assert status == 200, receipt
    assert receipt == {"stored": 2, "already": 0, "alerts": 1, "quarantined": 0}
    (row,) = _alerts(fed)
    assert (row.kind, row.subject) == ("audit_failed", "member a0 round 1.0")
    assert row.detail == (
        "aud's control-sample check failed a0's contribution to round 1 attempt 0: "
        "control_accuracy,norm_bound"
    )
    assert _alert_entries(fed) == [
        {"detail": row.detail, "time": row.raised_at, "kind": "audit_failed"}
    ]
    assert _counted(ops, "audit_failed") == 1
    assert fed.ws.state.verdicts.count() == 2

    # the same verdicts again: already held, nothing raised
    status, receipt = await _submit(fed, srv, "aud", fail, _verdict("a1", True))
    assert (status, receipt) == (200, {"stored": 0, "already": 2, "alerts": 0, "quarantined": 0})
    # a second auditor failing the same contribution: its verdict is kept, one open alert
    status, receipt = await _submit(fed, srv, "aud2", _verdict("a0", False, "norm_bound"))
    assert (status, receipt) == (200, {"stored": 1, "already": 0, "alerts": 0, "quarantined": 0})
    # a passed verdict raises nothing; a failure in another round is another alert
    status, receipt = await _submit(fed, srv, "aud2", _verdict("a2", True))
    assert (status, receipt) == (200, {"stored": 1, "already": 0, "alerts": 0, "quarantined": 0})
    status, receipt = await _submit(fed, srv, "aud", _verdict("a0", False, round_=2))
    assert (status, receipt) == (200, {"stored": 1, "already": 0, "alerts": 1, "quarantined": 0})
    assert [r.subject for r in _alerts(fed)] == ["member a0 round 2.0", "member a0 round 1.0"]
    assert "unspecified" in _alerts(fed)[0].detail
    assert fed.ws.state.verdicts.count() == 5
    assert _counted(ops, "audit_failed") == 2


@pytest.mark.asyncio
async def test_a_verdict_naming_someone_outside_the_roster_stores_nothing(
    served: tuple[Federation, Served],
) -> None:
    fed, srv = served
    refused = [
        (_verdict("nobody", False), "nobody, who is not in the roster"),
        # a member of the roster, but no contribution of it was accepted in round 3
        (_verdict("a1", False, round_=3), "round 3 attempt 0 of a1, which holds no accepted"),
    ]
    for bad, says in refused:
        before = durable_state(fed.ws)
        status, body = await _submit(fed, srv, "aud", _verdict("a0", False, "norm_bound"), bad)
        assert status == 404, body
        assert body["error"] == "not_found" and says in body["detail"], body
        # the signature verified: only its nonce is new; the good verdict is not kept
        assert_unchanged(before, durable_state(fed.ws), nonces_may_grow_by=1)
        assert fed.ws.state.verdicts.count() == 0 and _alerts(fed) == []

    # an agent may not submit verdicts
    before = durable_state(fed.ws)
    status, body = await _submit(fed, srv, "a1", _verdict("a0", False, "norm_bound"))
    assert status == 403, body
    assert_unchanged(before, durable_state(fed.ws), nonces_may_grow_by=1)
    assert fed.ws.state.verdicts.count() == 0 and _alerts(fed) == []


# -- the command line ------------------------------------------------------------------------------


def _cli(*args: str) -> Any:
    return CliRunner().invoke(main, ["aggregator", "alerts", *args])


def test_alerts_are_listed_and_acknowledged_from_the_command_line(
    tmp_path: Path, clock: FakeClock
) -> None:
    fed = _federation(tmp_path / "ws")
    desk = _desk(fed, clock)
    alerts = desk.coord.alert_desk
    ws = str(fed.root)
    result = _cli("list", "--workspace", ws)
    assert (result.exit_code, result.output) == (0, "no open alerts\n")

    first = alerts.raise_alert("round_aborted", "round 1.0", "round 1 attempt 0 aborted: x")
    clock.advance(60.0)
    second = alerts.raise_alert("member_refused", "member a1", "a1: 10 contributions refused")
    assert first is not None and second is not None

    result = _cli("list", "--workspace", ws)
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        f"#{second.id}  2023-11-14 22:14:20 UTC  member_refused  OPEN",
        "    a1: 10 contributions refused",
        f"#{first.id}  2023-11-14 22:13:20 UTC  round_aborted  OPEN",
        "    round 1 attempt 0 aborted: x",
    ]

    result = _cli("ack", "--workspace", ws, "--id", str(first.id))
    assert result.exit_code == 0, result.output
    assert f"acknowledged #{first.id} (round_aborted: round 1 attempt 0 aborted: x)" in (
        result.output
    )
    row = fed.ws.state.alerts.get(first.id)
    assert row is not None and row.acked_by == "operator" and row.acked_at is not None
    result = _cli("ack", "--workspace", ws, "--id", str(first.id), "--by", "someone")
    assert result.exit_code == 0
    assert "already acknowledged by operator" in result.output
    assert fed.ws.state.alerts.get(first.id) == row

    result = _cli("list", "--workspace", ws)
    assert [line for line in result.output.splitlines() if line.startswith("#")] == [
        f"#{second.id}  2023-11-14 22:14:20 UTC  member_refused  OPEN"
    ]
    result = _cli("list", "--workspace", ws, "--all")
    assert "round_aborted  acknowledged by operator" in result.output
    assert "member_refused  OPEN" in result.output

    result = _cli("list", "--workspace", ws, "--all", "--json")
    assert result.exit_code == 0, result.output
    views = msgspec.json.decode(result.output, type=list[wire.AlertView])
    assert [(v.id, v.kind, v.acked_by) for v in views] == [
        (second.id, "member_refused", None),
        (first.id, "round_aborted", "operator"),
    ]
    assert "ack_sha256" not in result.output and first.ack_sha256 not in result.output
    result = _cli("list", "--workspace", ws, "--json")
    assert [v["id"] for v in json.loads(result.output)] == [second.id]

    # acknowledged from the command line, the same alert may be raised again
    assert alerts.raise_alert("round_aborted", "round 1.0", "aborted again") is not None


def test_acknowledging_an_unknown_alert_fails_and_changes_nothing(
    tmp_path: Path, clock: FakeClock
) -> None:
    fed = _federation(tmp_path / "ws")
    desk = _desk(fed, clock)
    row = desk.coord.alert_desk.raise_alert("round_stalled", "round 1.0 open", "stalled")
    assert row is not None
    before = durable_state(fed.ws)
    result = _cli("ack", "--workspace", str(fed.root), "--id", str(row.id + 1))
    assert result.exit_code == 1
    assert f"no alert #{row.id + 1}" in result.output
    assert "Traceback" not in result.output
    assert_unchanged(before, durable_state(fed.ws))
    assert fed.ws.state.alerts.get(row.id) == row
