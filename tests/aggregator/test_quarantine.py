"""Quarantine: a member the control-sample audit failed is suspended from future cohorts.

An auditor's or the admin's signed order (or, with ``audit.quarantine_on_failure``, a
failed verdict) writes a ``quarantine`` log entry, raises a ``member_quarantined`` alert
offering the rollback to the version before the member's first failed round, and from
then on the member's join is refused with a 403 ``quarantined`` and a sentence; the
cohort no longer waits for it.  Refused orders change nothing; the audit verifies the
order's signature and the report lists the quarantine."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.ops import Operations
from fedsec.aggregator.rounds.quarantine import ADMIN, ORDERS_DIR
from fedsec.aggregator.workspace import Workspace
from fedsec.aggregator_client.refusals import error_from_response, for_operator
from fedsec.audit.report import build_report
from fedsec.audit.verify import verify_log
from fedsec.cli import main
from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import ForbiddenError, NotFound, Quarantined, SignatureError
from fedsec.protocol import wire
from tests.support.aggregator import (
    FED,
    FakeClock,
    Federation,
    join_request,
    log_entries,
    make_federation,
    plain_upload,
)
from tests.support.hostile import exchange, serve, signed_request

AGENTS = ("a0", "a1", "a2", "a3")
AUDITOR = "aud"


def _federation(tmp_path: Path, **audit: object) -> Federation:
    return make_federation(
        tmp_path / "ws",
        agents=AGENTS,
        auditors=(AUDITOR,),
        round={"secure_sum": "none", "min_agents": 3, "rounds": 3},
        sections={"audit": dict(audit)} if audit else None,
    )


def _round(fed: Federation, coord: Coordinator, members: tuple[str, ...]) -> None:
    """Run the current round with ``members`` to its close."""
    live = coord.live
    for m in members:
        coord.join(m, live.round, live.attempt, join_request(m, live.round))
    coord.tick()
    spec = coord.live.spec
    assert spec is not None and coord.live.stage == "masked_input"
    for m in members:
        coord.masked_input(m, spec.round, spec.attempt, *plain_upload(m, spec, fed.identities))
    assert coord.live.round == spec.round + 1, coord.live.stage


def _order(
    fed: Federation, signer: SigningIdentity, issuer: str = AUDITOR, **changes: object
) -> wire.QuarantineOrder:
    fields: dict[str, object] = {
        "federation_id": FED,
        "member": "a3",
        "round": 1,
        "attempt": 0,
        "issuer": issuer,
        "failed": ["direction", "signal"],
        "reason": "sign-flipped update",
        "issued_at": 1.0,
    }
    fields.update(changes)
    return wire.QuarantineOrder(**fields).sign(signer)  # type: ignore[arg-type]


def _two_rounds(
    tmp_path: Path, clock: FakeClock, **audit: object
) -> tuple[Federation, Coordinator]:
    fed = _federation(tmp_path, **audit)
    coord = Coordinator(fed.ws, clock=clock)
    _round(fed, coord, AGENTS)
    _round(fed, coord, AGENTS)
    return fed, coord


def test_an_auditor_order_suspends_the_member_logs_alerts_and_offers_the_rollback(
    tmp_path: Path, clock: FakeClock
) -> None:
    fed, coord = _two_rounds(tmp_path, clock)
    ops = Operations(coord)
    before = len(log_entries(fed.ws))

    answer = coord.quarantine(AUDITOR, _order(fed, fed.identities[AUDITOR]))
    # round 1 started from version 1: the last model before the first failed round
    assert (answer.quarantined, answer.since_round, answer.rollback_to) == (True, 1, 1)
    assert "rollback --to 1" in answer.detail

    new = log_entries(fed.ws, before)
    kinds = [e["kind"] for e in new]
    assert kinds[0] == "quarantine"
    body = new[0]["body"]
    assert (body["member"], body["round"], body["issuer"], body["rollback_to"]) == (
        "a3",
        1,
        AUDITOR,
        1,
    )
    assert body["failed"] == ["direction", "signal"] and body["order"]["signature"]
    alert = [e["body"] for e in new if e["kind"] == "alert"]
    assert len(alert) == 1 and alert[0]["kind"] == "member_quarantined"
    assert "--to 1" in alert[0]["detail"]
    assert ops.coord.alert_desk.recent(5)[0].kind == "member_quarantined"

    # round 3: a3's join is refused with a sentence; the others' cohort does not wait
    live = coord.live
    with pytest.raises(Quarantined, match="a3 is quarantined: the control-sample audit failed"):
        coord.join("a3", live.round, live.attempt, join_request("a3", live.round))
    assert Quarantined.http_status == 403 and Quarantined.code == "quarantined"
    for m in AGENTS[:3]:
        coord.join(m, live.round, live.attempt, join_request(m, live.round))
    coord.tick()
    spec = coord.live.spec
    assert spec is not None and spec.cohort == list(AGENTS[:3])

    # a second order changes nothing
    again = coord.quarantine(AUDITOR, _order(fed, fed.identities[AUDITOR], round=2))
    assert again.quarantined is False and again.since_round == 1
    assert [e["kind"] for e in log_entries(fed.ws, before)].count("quarantine") == 1

    # a restarted aggregator still refuses it: the log is the record
    fed.ws.close()
    ws = Workspace.open(fed.root)
    restarted = Coordinator(ws, clock=clock)
    live = restarted.live
    with pytest.raises(Quarantined):
        restarted.join("a3", live.round, live.attempt, join_request("a3", live.round))

    # the audit checks the order's signature and the report lists the quarantine
    audit = fed.root / "audit"
    verified = verify_log(audit / "log.jsonl", audit / "archive", fed.root)
    assert verified.ok, verified.problem
    html, _ = build_report(audit / "log.jsonl", audit / "archive", fed.root)
    assert "Quarantined members" in html and "a3" in html and "direction, signal" in html
    ws.close()


@pytest.mark.parametrize(
    ("changes", "signer", "error", "match"),
    [
        ({"federation_id": "other"}, AUDITOR, ForbiddenError, "for federation 'other'"),
        ({"issuer": "a0"}, "a0", ForbiddenError, "signed by the admin or by the auditor"),
        ({}, "a0", SignatureError, "quarantine-order: signature .* does not verify"),
        ({"member": "nobody"}, AUDITOR, NotFound, "not an agent of the roster"),
        ({"member": AUDITOR}, AUDITOR, NotFound, "not an agent of the roster"),
        ({"round": 7}, AUDITOR, NotFound, "made no accepted contribution"),
    ],
)
def test_a_refused_order_changes_nothing(
    tmp_path: Path,
    clock: FakeClock,
    changes: dict[str, object],
    signer: str,
    error: type[Exception],
    match: str,
) -> None:
    fed = _federation(tmp_path)
    coord = Coordinator(fed.ws, clock=clock)
    _round(fed, coord, AGENTS)
    before = log_entries(fed.ws)
    with pytest.raises(error, match=match):
        coord.quarantine(AUDITOR, _order(fed, fed.identities[signer], **changes))
    assert log_entries(fed.ws) == before
    assert coord.context.quarantined == {}
    live = coord.live
    coord.join("a3", live.round, live.attempt, join_request("a3", live.round))  # still welcome


def test_an_admin_order_dropped_in_the_workspace_is_carried_out_at_the_next_tick(
    tmp_path: Path, clock: FakeClock
) -> None:
    fed, coord = _two_rounds(tmp_path, clock)
    folder = fed.root / ORDERS_DIR
    folder.mkdir()
    # one forged (signed by the auditor in the admin's name), one good
    (folder / "forged.json").write_bytes(
        msgspec.json.encode(_order(fed, fed.identities[AUDITOR], issuer=ADMIN, member="a2"))
    )
    # the good one as the operator writes it: signed with the workspace's admin key
    args = ["aggregator", "quarantine", "--workspace", str(fed.root), "--member", "a3"]
    done = CliRunner().invoke(main, [*args, "--round", "2", "--failed", "direction,signal"])
    assert done.exit_code == 0, done.output
    assert "quarantine order for a3 written to" in done.output
    bad = CliRunner().invoke(main, [*args[:-1], "../a3", "--round", "2"])
    assert bad.exit_code != 0 and "is not a roster id" in bad.output
    coord.tick()
    assert sorted(coord.context.quarantined) == ["a3"]
    entry = coord.context.quarantined["a3"]
    assert (entry.issuer, entry.round, entry.rollback_to) == (ADMIN, 2, 2)
    live = coord.live
    with pytest.raises(Quarantined, match="ordered by admin"):
        coord.join("a3", live.round, live.attempt, join_request("a3", live.round))
    coord.join("a2", live.round, live.attempt, join_request("a2", live.round))
    audit = fed.root / "audit"
    assert verify_log(audit / "log.jsonl", audit / "archive", fed.root).ok


def _failed(member: str, round_: int) -> wire.AuditVerdict:
    return wire.AuditVerdict(
        round=round_, attempt=0, member=member, passed=False, failed=["magnitude"]
    )


def test_a_failed_verdict_quarantines_only_where_the_federation_enables_it(
    tmp_path: Path, clock: FakeClock
) -> None:
    fed, coord = _two_rounds(tmp_path / "off", clock)
    ops = Operations(coord)
    verdicts = [_failed("a3", 2)]
    assert ops.submit_verdicts(AUDITOR, verdicts).alerts == 1
    assert coord.quarantine_failed(AUDITOR, verdicts) == []
    assert coord.context.quarantined == {}

    fed, coord = _two_rounds(tmp_path / "on", clock, quarantine_on_failure=True)
    ops = Operations(coord)
    # round 1's failure arrives first, round 2's in a later batch: the first failed
    # round decides the rollback offered
    ops.submit_verdicts(AUDITOR, [_failed("a3", 1)])
    (answer,) = coord.quarantine_failed(AUDITOR, [_failed("a3", 1)])
    assert (answer.since_round, answer.rollback_to) == (1, 1)
    assert coord.quarantine_failed(AUDITOR, [_failed("a3", 2)]) == []
    entries = [e["body"] for e in log_entries(fed.ws) if e["kind"] == "quarantine"]
    assert len(entries) == 1 and "order" not in entries[0]
    assert entries[0]["issuer"] == AUDITOR and entries[0]["failed"] == ["magnitude"]


def test_an_order_naming_a_later_round_rolls_back_before_the_first_failed_verdict(
    tmp_path: Path, clock: FakeClock
) -> None:
    fed, coord = _two_rounds(tmp_path, clock)
    Operations(coord).submit_verdicts(AUDITOR, [_failed("a3", 1)])
    answer = coord.quarantine(AUDITOR, _order(fed, fed.identities[AUDITOR], round=2))
    assert (answer.since_round, answer.rollback_to) == (1, 1)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_over_http_the_order_is_answered_and_the_join_refused_with_code_and_sentence(
    tmp_path: Path, clock: FakeClock
) -> None:
    fed, coord = _two_rounds(tmp_path, clock)
    srv = await serve(fed.ws, coord)
    try:
        order = wire.encode(_order(fed, fed.identities[AUDITOR]))
        answer = await exchange(
            srv.port,
            signed_request(fed.identities[AUDITOR], "POST", "/v1/audit/quarantine", order),
        )
        assert answer.status == 200, answer.json()
        assert answer.json()["quarantined"] is True and answer.json()["rollback_to"] == 1
        # an agent may not order one
        refused = await exchange(
            srv.port, signed_request(fed.identities["a0"], "POST", "/v1/audit/quarantine", order)
        )
        assert refused.status == 403
        live = coord.live
        join = wire.encode(join_request("a3", live.round))
        target = f"/v1/rounds/{live.round}/join?attempt={live.attempt}"
        answer = await exchange(
            srv.port, signed_request(fed.identities["a3"], "POST", target, join)
        )
        assert answer.status == 403
        body = answer.json()
        assert body["error"] == "quarantined"
        assert body["detail"].startswith("a3 is quarantined: the control-sample audit failed")
        assert "round 1 attempt 0 (direction, signal)" in body["detail"]
    finally:
        await srv.stop()


def test_the_agent_reads_the_refusal_as_quarantined_with_the_servers_sentence() -> None:
    detail = "a3 is quarantined: the control-sample audit failed its contribution to round 1"
    raw = msgspec.json.encode({"error": "quarantined", "detail": detail})
    exc = error_from_response(403, raw, "POST /v1/rounds/3/join")
    assert isinstance(exc, Quarantined) and exc.detail == detail
    # not reworded as a key problem: the sentence already says what happened
    assert for_operator("POST /v1/rounds/3/join", exc, "ed25519:00") is exc
