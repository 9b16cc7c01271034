"""The agent's round machines driven with plain values: no sockets, no ledger, no files.

:class:`AgentRound` and :class:`Follower` say what to do next and take the answers;
each test answers their actions by hand (other SecAgg+ members are real crypto
sessions, the aggregator a real :class:`ServerSession`) and checks every decision:
join or skip, charge, reuse a retried round's update, each 4xx answer, a missed
stage, an aborted attempt, training failing.  Each negative case checks the error
and that nothing else was asked (no charge, no training, no upload).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from fedsec.agent import actions as act
from fedsec.agent.charging import Carryover, PrivacyCharge, TrainedUpdate
from fedsec.agent.follow import Follower
from fedsec.agent.member import Member
from fedsec.agent.round import AgentRound
from fedsec.agent.spec import update_key
from fedsec.crypto.identity import SigningIdentity
from fedsec.crypto.quantize import quantize, unpack
from fedsec.crypto.secagg import ClientSession, KeyList, MaskedInput, ServerSession, UnmaskRequest
from fedsec.errors import (
    AggregatorRefused,
    AuthError,
    BudgetExhausted,
    ClockSkewError,
    ConfigError,
    DuplicateMessage,
    FedsecError,
    ForbiddenError,
    IntegrityError,
    NotFound,
    QuantizationError,
    RateLimited,
    ServerBusy,
    SignatureError,
    StaleUpdate,
    TaskMismatch,
    WrongStage,
)
from fedsec.protocol import codec
from fedsec.protocol.data_schema import ObservedSchema
from fedsec.protocol.wire import (
    Accepted,
    ChargeRecord,
    CommitmentSetBody,
    DataSummary,
    DPSpec,
    FederationStatus,
    JoinResponse,
    MemberCommitment,
    Receipt,
    RoundSpec,
    RoundState,
    RoundSummary,
    UnmaskRequestBody,
)
from fedsec.tasks import get_task
from fedsec.tasks.params import param_count
from tests.support.agent import signed_spec

AGGREGATOR = SigningIdentity(bytes(range(32, 64)))
STRANGER = SigningIdentity(bytes(range(64, 96)))
MEMBERS = ("alice", "bob", "carol")
IDENTITIES = {m: SigningIdentity(bytes([i + 1]) * 32) for i, m in enumerate(MEMBERS)}
TASK = get_task("breast_cancer")
DIM = param_count(TASK.build_model(0))
SAMPLES = 120
POLL_S = 5.0
NOW = 1_700_000_000.0
NO_DP = DPSpec(enabled=False, noise_multiplier=0.0, max_grad_norm=1.0, delta=1e-5)


def member(require_dp: bool = True, allow_distributed: bool = False) -> Member:
    return Member(
        id="alice",
        identity=IDENTITIES["alice"],
        aggregator_public=AGGREGATOR.public_bytes,
        dataset_id="breast_cancer-part0",
        task=TASK,
        samples=SAMPLES,
        dim=DIM,
        privacy_delta=1e-5,
        require_dp=require_dp,
        allow_distributed=allow_distributed,
    )


def make_spec(cohort: tuple[str, ...] = ("alice",), **changes: Any) -> RoundSpec:
    return signed_spec(
        AGGREGATOR,
        TASK,
        federation_id="fed",
        model_sha256="ab" * 32,
        dim=DIM,
        cohort=cohort,
        **changes,
    )


def state(stage: str, spec: RoundSpec | None = None, token: int = 1, **changes: Any) -> RoundState:
    fields: dict[str, Any] = {
        "federation_id": "fed",
        "round": 1,
        "attempt": 1,
        "stage": stage,
        "token": token,
        "model_version": 1,
        "rounds_completed": 0,
        "rounds_target": 3,
        "finished": False,
        "spec": spec,
    }
    fields.update(changes)
    return RoundState(**fields)


def start(spec: RoundSpec, stage: str = "advertise", carry: Carryover | None = None) -> AgentRound:
    return AgentRound(
        state(stage, spec), member(), carry or Carryover(), long_poll_s=POLL_S, clock=lambda: NOW
    )


def receipt_for(a: act.SendMaskedInput, member_id: str = "alice") -> Receipt:
    return Receipt(
        federation_id="fed",
        round=a.round,
        attempt=a.attempt,
        member=member_id,
        contribution_sha256=hashlib.sha256(a.vector).hexdigest(),
        log_index=7,
        issued_at=NOW,
    ).sign(AGGREGATOR)


def summary(round_: int = 1, attempt: int = 1, **refused: str) -> RoundSummary:
    return RoundSummary(
        round=round_, attempt=attempt, stage="closed", cohort=3, participants=3,
        survivors=3 - len(refused), dropped=sorted(refused), model_version=2, accuracy=0.9,
        loss=0.3, aggregation_s=0.1, duration_s=2.0, epsilon_max=1.25, detail="",
        refused=refused,
    )  # fmt: skip


def status_with(*summaries: RoundSummary) -> FederationStatus:
    """``GET /status`` as the aggregator answers it once our round closed."""
    return FederationStatus(
        federation_id="fed", round=2, attempt=0, stage="open", model_version=2,
        rounds_completed=1, rounds_target=3, finished=False, agents_active=3,
        history=list(summaries), alerts=[],
    )  # fmt: skip


DELTA = np.full(DIM, 0.001, dtype=np.float32)
SALT = b"\x05" * 32

Answer = Callable[[Any], act.Event]


def answer_plain(action: act.Action) -> act.Event:
    """The aggregator, ledger and vault answering a plain round's actions without fault."""
    if isinstance(action, act.Charge):
        r = action.request
        return act.Charged(PrivacyCharge(r.key, 1.25, r.steps, r.sample_rate, r.round))
    if isinstance(action, act.Train):
        return act.TrainingStarted()
    if isinstance(action, act.AwaitTraining):
        return act.Trained(DELTA)
    if isinstance(action, act.KeepUpdate):
        return act.UpdateKept(SALT)
    if isinstance(action, act.SendMaskedInput):
        return act.MaskedInputAnswered(receipt_for(action))
    if isinstance(action, act.FetchStatus):
        return act.StatusFetched(status_with())
    passing = act.Report | act.ReportTaken | act.Record | act.FaultPoint | act.Release
    if isinstance(action, passing):
        return act.Passed()
    raise AssertionError(f"no default answer to {action}")


def drive(
    round_: AgentRound,
    polls: list[RoundState],
    answers: dict[type[act.Action], Answer] | None = None,
    until: type[act.Action] | None = None,
) -> list[act.Action]:
    """Answer ``round_``'s actions (Poll with the next of ``polls``, the others with
    ``answers`` or :func:`answer_plain`) until it finishes or asks for ``until``;
    return every action asked, the last one unanswered."""
    asked: list[act.Action] = []
    while True:
        action = round_.next()
        asked.append(action)
        if isinstance(action, act.Finish) or (until is not None and isinstance(action, until)):
            return asked
        if isinstance(action, act.Poll):
            assert polls, f"unexpected poll after {asked[:-1]}"
            event: act.Event = act.RoundObserved(polls.pop(0))
        else:
            event = (answers or {}).get(type(action), answer_plain)(action)
        round_.receive(event)


def kinds(asked: list[act.Action]) -> list[str]:
    return [type(a).__name__ for a in asked]


def finish(asked: list[act.Action]) -> act.Finish:
    last = asked[-1]
    assert isinstance(last, act.Finish), kinds(asked)
    return last


# ------------------------------------------------------------------ a plain round


def test_plain_round_charges_trains_reports_sends_and_records() -> None:
    spec = make_spec()
    carry = Carryover()
    round_ = start(spec, "advertise", carry)
    closed = state("closed", spec, token=4)
    asked = drive(round_, [state("masked_input", spec, token=3), closed])

    assert kinds(asked) == [
        "Charge", "Train", "AwaitTraining", "Report", "Poll", "KeepUpdate",
        "SendMaskedInput", "Record", "Poll", "FetchStatus", "Finish",
    ]  # fmt: skip
    charge, train = asked[0], asked[1]
    assert isinstance(charge, act.Charge) and isinstance(train, act.Train)
    assert charge.request.round == 1 and charge.request.noise_multiplier == 1.0
    assert carry.last_cost == charge.request.cost
    report = asked[3]
    assert isinstance(report, act.Report)
    assert (report.report.member, report.report.epsilon, report.report.samples) == (
        "alice",
        1.25,
        SAMPLES,
    )
    report.report.verify(IDENTITIES["alice"].public_bytes)
    sent = asked[6]
    assert isinstance(sent, act.SendMaskedInput) and sent.wait == 0.0
    sent.statement.verify(IDENTITIES["alice"].public_bytes)
    assert sent.statement.vector_sha256 == hashlib.sha256(sent.vector).hexdigest()
    q = unpack(sent.vector, DIM + 1, spec.ring_bits)
    kept = asked[5]
    assert isinstance(kept, act.KeepUpdate) and np.array_equal(kept.quantized, q)
    record = asked[7]
    assert isinstance(record, act.Record)
    assert (record.record.recorded_at, record.record.epsilon, record.record.samples) == (
        NOW,
        1.25,
        SAMPLES,
    )
    done = finish(asked)
    assert done.outcome is not None and done.outcome.status == "closed"
    assert done.outcome.receipt == record.receipt and done.outcome.epsilon == 1.25
    assert done.outcome.weight == pytest.approx(SAMPLES / 1000)
    assert done.following == closed
    # the update stays for a retried attempt; the charge was spent on it
    assert carry.update is not None and carry.update.key == update_key(spec)
    assert carry.unused_charge is None


def test_an_event_that_answers_nothing_pending_is_refused_and_changes_nothing() -> None:
    round_ = start(make_spec())
    pending = round_.next()
    assert isinstance(pending, act.Charge)
    with pytest.raises(WrongStage, match="does not answer Charge"):
        round_.receive(act.Passed())
    with pytest.raises(WrongStage, match="no training is running"):
        round_.receive(act.Trained(DELTA))
    assert round_.next() is pending and not round_.training


# --------------------------------------------------------------- before anything is spent


def test_spec_not_signed_by_the_pinned_aggregator_is_refused() -> None:
    with pytest.raises(SignatureError, match="round spec signature does not verify"):
        start(make_spec().sign(STRANGER))


def test_spec_of_another_task_version_is_refused() -> None:
    with pytest.raises(TaskMismatch, match="version '9'"):
        start(make_spec(task_version="9"))


def test_round_without_dp_is_refused_before_any_charge() -> None:
    carry = Carryover()
    with pytest.raises(ConfigError, match="without differential privacy"):
        start(make_spec(dp=NO_DP), carry=carry)
    assert carry.last_cost is None and carry.unused_charge is None


def test_round_without_dp_is_trained_uncharged_only_where_allowed() -> None:
    round_ = AgentRound(
        state("advertise", make_spec(dp=NO_DP)), member(require_dp=False), Carryover(),
        long_poll_s=POLL_S,
    )  # fmt: skip
    charge = round_.next()
    assert isinstance(charge, act.Charge) and not charge.request.dp_enabled


DISTRIBUTED = DPSpec(
    enabled=True,
    noise_multiplier=1.0,
    max_grad_norm=1.0,
    delta=1e-5,
    mode="distributed",
    sample_rate=0.25,
    min_survivors=2,
)


def _start_distributed(allow: bool, carry: Carryover, **changes: Any) -> None:
    """Start (and step) a round whose spec asks for distributed DP."""
    fields: dict[str, Any] = {"secure_sum": "secagg", "dp": DISTRIBUTED, "ring_bits": 24}
    fields.update(changes)
    spec = make_spec(cohort=MEMBERS, **fields)
    AgentRound(
        state("advertise", spec), member(allow_distributed=allow), carry, long_poll_s=POLL_S
    ).next()


def test_distributed_dp_is_refused_unless_agent_toml_allows_it() -> None:
    with pytest.raises(ConfigError) as err:
        _start_distributed(False, Carryover())
    assert "asks for distributed DP" in str(err.value)
    assert "rest on at least 2 other members adding theirs" in str(err.value)
    assert "(privacy.allow_distributed = false), so it refuses" in str(err.value)


def test_refused_distributed_rounds_charge_nothing() -> None:
    carry = Carryover()
    with pytest.raises(ConfigError, match="does not allow"):
        _start_distributed(False, carry)
    assert carry.last_cost is None and carry.unused_charge is None


def test_an_allowed_distributed_round_charges_one_step_at_the_spec_rate() -> None:
    spec = make_spec(cohort=MEMBERS, secure_sum="secagg", dp=DISTRIBUTED, ring_bits=24)
    round_ = AgentRound(
        state("advertise", spec), member(allow_distributed=True), Carryover(),
        long_poll_s=POLL_S,
    )  # fmt: skip
    world = OtherMembers(spec)
    asked = drive(round_, [], world.answers(), until=act.Charge)
    charge = asked[-1]
    assert isinstance(charge, act.Charge)
    assert charge.request.cost == (1.0, 0.25, 1) and charge.request.dp_enabled


def test_an_allowed_distributed_round_with_an_impossible_bit_budget_is_refused() -> None:
    carry = Carryover()
    with pytest.raises(QuantizationError, match="bit budget cannot be met"):
        _start_distributed(True, carry, quant_bits=2, ring_bits=4)
    assert carry.last_cost is None


def test_spec_naming_another_attempt_is_dropped_without_charging() -> None:
    round_ = AgentRound(
        state("advertise", make_spec(attempt=2)), member(), Carryover(), long_poll_s=POLL_S
    )
    done = finish([round_.next()])
    assert done.outcome is not None
    assert (done.outcome.status, done.outcome.detail) == ("dropped", "spec names another round")


@pytest.mark.parametrize(
    ("secure_sum", "stage", "first"),
    [
        ("secagg", "share_keys", "advertise"),
        ("none", "unmask", "masked_input"),
        # he: too late to commit to a ciphertext is too late to send one
        ("he", "masked_input", "commit"),
    ],
)
def test_back_too_late_for_the_first_stage_misses_without_charging(
    secure_sum: str, stage: str, first: str
) -> None:
    carry = Carryover()
    round_ = start(make_spec(MEMBERS, secure_sum=secure_sum), stage, carry)
    done = finish([round_.next()])
    assert done.outcome is not None and done.outcome.status == "missed"
    assert done.outcome.detail == f"stage {first} already passed (now {stage})"
    assert done.following is None and carry.last_cost is None


def test_budget_exhausted_ends_the_agent_before_training() -> None:
    round_ = start(make_spec())
    assert isinstance(round_.next(), act.Charge)
    with pytest.raises(BudgetExhausted, match="would spend"):
        round_.receive(act.Refused(BudgetExhausted("would spend epsilon 9 > budget 8")))
    with pytest.raises(WrongStage, match="ended with an error"):
        round_.next()  # and nothing was trained


# ----------------------------------------------------------------- retried attempts


def test_a_retried_attempt_reuses_the_update_without_charging_or_training() -> None:
    spec = make_spec()
    carry = Carryover()
    carry.update = TrainedUpdate(update_key(spec), DELTA, 2.5, 9, 0.25, 1, trained_round=1)
    retry = make_spec(attempt=2)  # same round, model and settings
    round_ = AgentRound(
        state("masked_input", retry, attempt=2), member(), carry, long_poll_s=POLL_S
    )
    asked = drive(round_, [state("closed", retry, attempt=2)])

    assert "Charge" not in kinds(asked) and "Train" not in kinds(asked)
    report = asked[0]
    assert isinstance(report, act.Report)
    assert (report.report.epsilon, report.report.steps, report.report.attempt) == (2.5, 9, 2)
    outcome = finish(asked).outcome
    assert outcome is not None and (outcome.status, outcome.epsilon) == ("closed", 2.5)


def test_a_charge_not_yet_trained_on_is_reused_not_charged_again() -> None:
    spec = make_spec()
    carry = Carryover()
    carry.unused_charge = PrivacyCharge(update_key(spec), 3.0, 8, 0.2, trained_round=1)
    round_ = AgentRound(
        state("advertise", make_spec(attempt=2), attempt=2), member(), carry, long_poll_s=POLL_S
    )
    train = round_.next()
    assert isinstance(train, act.Train) and train.charge == carry.unused_charge


def test_an_update_for_another_model_is_not_reused() -> None:
    old = make_spec(model_version=1)
    carry = Carryover()
    carry.update = TrainedUpdate(update_key(old), DELTA, 2.5, 9, 0.25, 1, trained_round=1)
    round_ = AgentRound(
        state("advertise", make_spec(model_version=2, round=2), round=2),
        member(),
        carry,
        long_poll_s=POLL_S,
    )
    assert isinstance(round_.next(), act.Charge)


# ------------------------------------------------------------------ refusals (4xx)


def _up_to(round_: AgentRound, until: type[act.Action], polls: list[RoundState]) -> None:
    asked = drive(round_, polls, until=until)
    assert isinstance(asked[-1], until), kinds(asked)


def test_a_duplicate_report_means_an_earlier_try_landed() -> None:
    spec = make_spec()
    round_ = start(spec)
    _up_to(round_, act.Report, [])
    round_.receive(act.Refused(DuplicateMessage("already reported")))
    assert isinstance(round_.next(), act.Poll)


EARLIER = (ChargeRecord(1, 1, 1.0, 0.25, 9), ChargeRecord(2, 2, 1.0, 0.25, 9))


def _charged_with_earlier(action: act.Charge) -> act.Charged:
    """The ledger's answer when charges 1 and 2 were never reported (the member dropped
    out of those rounds after training): this is charge 3."""
    r = action.request
    charge = PrivacyCharge(r.key, 2.5, r.steps, r.sample_rate, r.round, 3, EARLIER)
    return act.Charged(charge)


def test_a_report_declares_the_unreported_charges_and_marks_them_once_taken() -> None:
    asked = drive(
        start(make_spec()),
        [state("masked_input", make_spec(), token=3), state("closed", make_spec(), token=4)],
        {act.Charge: _charged_with_earlier},
    )
    assert kinds(asked)[3:6] == ["Report", "ReportTaken", "Poll"]
    report, taken = asked[3], asked[4]
    assert isinstance(report, act.Report) and isinstance(taken, act.ReportTaken)
    assert (report.report.charge, report.report.unreported) == (3, list(EARLIER))
    report.report.check_charges()
    report.report.verify(IDENTITIES["alice"].public_bytes)
    assert taken.index == 3


def test_a_report_refused_as_a_duplicate_marks_nothing_reported() -> None:
    round_ = start(make_spec())
    drive(round_, [], {act.Charge: _charged_with_earlier}, until=act.Report)
    round_.receive(act.Refused(DuplicateMessage("already reported")))
    assert isinstance(round_.next(), act.Poll)  # no ReportTaken: declared again next time


def test_a_duplicate_masked_input_fetches_the_receipt_of_the_first_try() -> None:
    spec = make_spec()
    round_ = start(spec)
    _up_to(round_, act.SendMaskedInput, [state("masked_input", spec)])
    sent = round_.next()
    assert isinstance(sent, act.SendMaskedInput)
    round_.receive(act.Refused(DuplicateMessage("already sent")))
    fetch = round_.next()
    assert isinstance(fetch, act.FetchReceipt) and fetch.round == 1
    round_.receive(act.ReceiptFetched(receipt_for(sent)))
    assert isinstance(round_.next(), act.Record)


def test_a_receipt_for_something_else_ends_the_agent() -> None:
    spec = make_spec()
    round_ = start(spec)
    _up_to(round_, act.SendMaskedInput, [state("masked_input", spec)])
    sent = round_.next()
    assert isinstance(sent, act.SendMaskedInput)
    wrong = receipt_for(sent, member_id="bob")
    with pytest.raises(IntegrityError, match="does not acknowledge what was sent"):
        round_.receive(act.MaskedInputAnswered(wrong))


@pytest.mark.parametrize(
    "error",
    [
        AggregatorRefused("gone", code="gone", http_status=410),
        AggregatorRefused("too early", code="too_early", http_status=425),
        AggregatorRefused("conflict", code="conflict", http_status=409),
        NotFound("no such round"),
        WrongStage("round is in stage unmask"),
        RateLimited("still refused after 2 tries"),
        ServerBusy("still refused after 2 tries"),
    ],
    ids=lambda e: f"{e.http_status}-{e.code}",
)
def test_round_local_refusals_drop_the_attempt_and_keep_the_update(error: FedsecError) -> None:
    spec = make_spec()
    carry = Carryover()
    round_ = start(spec, carry=carry)
    _up_to(round_, act.Report, [])
    round_.receive(act.Refused(error))
    done = finish([round_.next()])
    assert done.outcome is not None
    assert (done.outcome.status, done.outcome.detail) == ("dropped", error.detail)
    assert done.outcome.epsilon == 1.25 and done.following is None
    assert carry.update is not None  # a retried attempt reuses it, charged once


@pytest.mark.parametrize(
    "error",
    [
        AuthError("not on the roster"),
        ForbiddenError("role auditor"),
        ClockSkewError("still skewed after correcting"),
        AggregatorRefused("bad request", code="bad_request", http_status=400),
    ],
    ids=lambda e: f"{e.http_status}-{e.code}",
)
def test_other_refusals_end_the_agent(error: FedsecError) -> None:
    round_ = start(make_spec())
    _up_to(round_, act.Report, [])
    with pytest.raises(type(error)):
        round_.receive(act.Refused(error))


def test_a_temporary_refusal_of_the_model_download_drops_the_attempt_keeping_the_charge() -> None:
    spec = make_spec()
    carry = Carryover()
    round_ = start(spec, carry=carry)
    _up_to(round_, act.AwaitTraining, [])
    round_.receive(act.TrainingFailed(ServerBusy("model download still refused")))
    done = finish([round_.next()])
    assert done.outcome is not None and done.outcome.status == "dropped"
    assert done.outcome.epsilon is None  # nothing trained
    assert carry.update is None and carry.unused_charge is not None  # reused by the retry


def test_a_model_that_does_not_verify_ends_the_agent() -> None:
    round_ = start(make_spec())
    _up_to(round_, act.AwaitTraining, [])
    with pytest.raises(IntegrityError):
        round_.receive(act.TrainingFailed(IntegrityError("manifest says another sha256")))


# ----------------------------------------------------------- attempts ending early


def test_an_aborted_attempt_ends_aborted_with_the_newest_state() -> None:
    spec = make_spec()
    round_ = start(spec)
    aborted = state("aborted", spec, token=3)
    asked = drive(round_, [aborted])
    done = finish(asked)
    assert done.outcome is not None and done.outcome.status == "aborted"
    assert done.following == aborted and "SendMaskedInput" not in kinds(asked)


def test_a_stage_passed_while_waiting_is_missed() -> None:
    spec = make_spec()
    round_ = start(spec)
    later = state("unmask", spec, token=3)
    done = finish(drive(round_, [later]))
    assert done.outcome is not None and done.outcome.status == "missed"
    assert done.outcome.detail == "stage masked_input already passed (now unmask)"
    assert done.following == later


def test_a_round_that_moved_on_after_taking_our_contribution_counts_as_closed() -> None:
    spec = make_spec()
    round_ = start(spec)
    next_round = state("open", None, token=9, round=2)
    done = finish(drive(round_, [state("masked_input", spec), next_round]))
    assert done.outcome is not None and done.outcome.status == "closed"
    assert done.outcome.receipt is not None and done.following == next_round


# ------------------------------------------- trusted mode: refused by the aggregation rule

REASON = "multi_krum (byzantine=1, selected 2 of 3): its score 9.1 is not among the 2 lowest"


def test_an_update_the_rule_refused_ends_refused_with_the_summary_reason() -> None:
    spec = make_spec()
    round_ = start(spec)
    ours = summary(1, 1, alice=REASON, bob="bob's own reason")
    answers: dict[type[act.Action], Answer] = {
        act.FetchStatus: lambda a: act.StatusFetched(
            status_with(summary(1, 0, alice="an earlier attempt's reason"), ours)
        )
    }
    asked = drive(round_, [state("masked_input", spec), state("closed", spec, token=4)], answers)
    done = finish(asked)
    assert done.outcome is not None and done.outcome.status == "refused"
    assert done.outcome.detail == REASON
    assert done.outcome.receipt is not None  # accepted and receipted all the same


def test_a_summary_not_naming_us_leaves_the_round_closed() -> None:
    spec = make_spec()
    answers: dict[type[act.Action], Answer] = {
        act.FetchStatus: lambda a: act.StatusFetched(
            status_with(summary(1, 0, alice=REASON), summary(1, 1, bob=REASON))
        )
    }
    asked = drive(start(spec), [state("masked_input", spec), state("closed", spec)], answers)
    done = finish(asked)
    assert done.outcome is not None and done.outcome.status == "closed"
    assert done.outcome.detail == ""


def test_a_round_that_moved_on_still_reads_whether_the_rule_refused_us() -> None:
    spec = make_spec()
    answers: dict[type[act.Action], Answer] = {
        act.FetchStatus: lambda a: act.StatusFetched(status_with(summary(1, 1, alice=REASON)))
    }
    next_round = state("open", None, token=9, round=2)
    asked = drive(start(spec), [state("masked_input", spec), next_round], answers)
    done = finish(asked)
    assert done.outcome is not None and done.outcome.status == "refused"
    assert done.outcome.detail == REASON and done.following == next_round


def test_a_status_refused_for_now_leaves_the_round_closed() -> None:
    spec = make_spec()
    answers: dict[type[act.Action], Answer] = {
        act.FetchStatus: lambda a: act.Refused(RateLimited("still refused after 2 tries"))
    }
    asked = drive(start(spec), [state("masked_input", spec), state("closed", spec)], answers)
    assert kinds(asked)[-2:] == ["FetchStatus", "Finish"]
    done = finish(asked)
    assert done.outcome is not None and done.outcome.status == "closed"


# ---------------------------------------------------------------------- SecAgg+


class OtherMembers:
    """The aggregator's SecAgg+ session and bob's and carol's crypto sessions."""

    def __init__(self, spec: RoundSpec) -> None:
        self.spec = spec
        params = spec.secagg_params()
        roster = {m: IDENTITIES[m].public_bytes for m in MEMBERS}
        self.roster = roster
        self.server = ServerSession(params, roster)
        self.others = {m: ClientSession(params, m, IDENTITIES[m], roster) for m in MEMBERS[1:]}
        self.inputs = {
            m: quantize(np.full(DIM, 0.002 * i, np.float32), 0.5, spec.quant_spec(), os.urandom(32))
            for i, m in enumerate(MEMBERS[1:], start=1)
        }
        self.key_list: KeyList | None = None
        self.relays: dict[str, Any] = {}
        self.request: UnmaskRequest | None = None
        self.proofs: dict[str, Any] = {}
        self.alice_input: Any = None

    def advertise(self, a: act.Advertise) -> act.Event:
        self.server.receive_advertise(codec.advertise_message("alice", a.body))
        for s in self.others.values():
            self.server.receive_advertise(s.advertise())
        self.key_list = self.server.close_advertise()
        return act.UploadAnswered(Accepted(True, keys=codec.key_list_body(self.key_list.entries)))

    def shares(self, a: act.SendShares) -> act.Event:
        assert self.key_list is not None
        self.server.receive_share_keys(codec.share_keys_message("alice", a.body))
        for s in self.others.values():
            self.server.receive_share_keys(s.share_keys(self.key_list))
        self.relays = self.server.close_share_keys()
        return act.UploadAnswered(
            Accepted(True, relay=codec.share_relay_body(self.relays["alice"]))
        )

    def masked_input(self, a: act.SendMaskedInput) -> act.Event:
        self.server.receive_masked_input(MaskedInput("alice", a.vector))
        for m, s in self.others.items():
            s.receive_shares(self.relays[m])
            self.server.receive_masked_input(s.masked_input(self.inputs[m]))
        self.request = self.server.close_masked_input()
        body = UnmaskRequestBody(list(self.request.survivors), list(self.request.dropped), 5)
        return act.MaskedInputAnswered(receipt_for(a), body)

    def consistency(self, a: act.SendConsistency) -> act.Event:
        assert self.request is not None
        self.server.receive_consistency(codec.consistency_message("alice", a.body))
        for s in self.others.values():
            self.server.receive_consistency(s.sign_survivors(self.request))
        self.proofs = self.server.close_consistency()
        proof = codec.consistency_proof_body(self.proofs["alice"], 6)
        return act.UploadAnswered(Accepted(True, proof=proof))

    def unmask(self, a: act.Unmask) -> act.Event:
        self.server.receive_unmask(codec.unmask_message("alice", a.body))
        for m, s in self.others.items():
            self.server.receive_unmask(s.unmask(self.proofs[m]))
        return act.UploadAnswered(Accepted(True, state=state("closed", self.spec, token=7)))

    def keep(self, a: act.KeepUpdate) -> act.Event:
        self.alice_input = a.quantized
        return act.UpdateKept(SALT)

    def answers(self) -> dict[type[act.Action], Answer]:
        return {
            act.FetchRoster: lambda a: act.RosterFetched(self.roster),
            act.Advertise: self.advertise,
            act.SendShares: self.shares,
            act.Mask: lambda a: act.Masked(a.compute()),
            act.KeepUpdate: self.keep,
            act.SendMaskedInput: self.masked_input,
            act.SendConsistency: self.consistency,
            act.Unmask: self.unmask,
        }


def secagg_spec(**changes: Any) -> RoundSpec:
    return make_spec(MEMBERS, secure_sum="secagg", **changes)


def test_secagg_round_trains_during_key_stages_and_sums_exactly() -> None:
    spec = secagg_spec()
    world = OtherMembers(spec)
    round_ = start(spec, "advertise")
    asked = drive(round_, [], world.answers(), until=act.AwaitTraining)

    # training starts before the key stages, which proceed while it runs; the report
    # rides with the shares
    assert kinds(asked) == [
        "FetchRoster", "Charge", "Train", "Advertise", "FaultPoint", "SendShares",
        "FaultPoint", "AwaitTraining",
    ]  # fmt: skip
    shares = asked[5]
    assert isinstance(shares, act.SendShares) and shares.body.report is not None
    assert shares.wait == POLL_S and round_.training
    round_.receive(act.Trained(DELTA))
    asked = drive(round_, [], world.answers())
    assert "Report" not in kinds(asked)
    # the update is recorded as released to this attempt before its masked input leaves
    assert kinds(asked)[:4] == ["Mask", "KeepUpdate", "Release", "SendMaskedInput"]
    outcome = finish(asked).outcome
    assert outcome is not None and outcome.status == "closed"

    result = world.server.finalize()
    ring = (1 << spec.ring_bits) - 1
    expected = world.alice_input.astype(np.int64) + sum(
        q.astype(np.int64) for q in world.inputs.values()
    )
    assert np.array_equal(result.ring_sum.astype(np.int64), expected & ring)


def test_training_that_ends_during_the_key_stages_is_kept_until_needed() -> None:
    spec = secagg_spec()
    world = OtherMembers(spec)
    carry = Carryover()
    round_ = start(spec, "advertise", carry)
    drive(round_, [], world.answers(), until=act.Advertise)
    round_.receive(act.Trained(DELTA))  # while the advertisement is in flight
    assert not round_.training and carry.update is not None
    assert isinstance(round_.next(), act.Advertise)  # still waiting for its answer
    asked = drive(round_, [], world.answers())
    assert "AwaitTraining" not in kinds(asked)
    outcome = finish(asked).outcome
    assert outcome is not None and outcome.status == "closed"


def test_a_duplicate_advertisement_falls_back_to_fetching_the_key_list() -> None:
    spec = secagg_spec()
    world = OtherMembers(spec)
    round_ = start(spec, "advertise")
    drive(round_, [], world.answers(), until=act.Advertise)
    world.advertise(round_.next())  # type: ignore[arg-type]  # the first try landed
    round_.receive(act.Refused(DuplicateMessage("already advertised")))
    assert isinstance(round_.next(), act.FaultPoint)
    round_.receive(act.Passed())
    fetch = round_.next()
    assert isinstance(fetch, act.FetchKeys) and fetch.wait == POLL_S
    # the long poll answered before the stage: poll the round state, then fetch at once
    round_.receive(act.Refused(WrongStage("round has not reached share_keys yet")))
    poll = round_.next()
    assert isinstance(poll, act.Poll) and poll.token == 1
    round_.receive(act.RoundObserved(state("share_keys", spec, token=2)))
    again = round_.next()
    assert isinstance(again, act.FetchKeys) and again.wait == 0.0
    assert world.key_list is not None
    round_.receive(act.KeysFetched(codec.key_list_body(world.key_list.entries)))
    assert isinstance(round_.next(), act.SendShares)


def test_a_forged_key_list_drops_the_attempt_after_training_finishes() -> None:
    spec = secagg_spec()
    world = OtherMembers(spec)
    carry = Carryover()
    round_ = start(spec, "advertise", carry)
    drive(round_, [], world.answers(), until=act.Advertise)
    world.advertise(round_.next())  # type: ignore[arg-type]
    assert world.key_list is not None
    entries = list(world.key_list.entries)
    bob = entries[1]
    entries[1] = type(bob)(bob.member, bob.enc_public, bob.mask_public, bytes(64))
    body = codec.key_list_body(entries)
    round_.receive(act.UploadAnswered(Accepted(True, keys=body)))
    round_.receive(act.Passed())  # the fault point
    # the attempt is over, but training is still awaited so its update is kept
    assert isinstance(round_.next(), act.AwaitTraining)
    round_.receive(act.Trained(DELTA))
    done = finish([round_.next()])
    assert done.outcome is not None and done.outcome.status == "dropped"
    assert "does not verify" in done.outcome.detail
    assert carry.update is not None


def test_an_attempt_aborted_during_key_stages_waits_for_training_then_ends() -> None:
    spec = secagg_spec()
    round_ = start(spec, "open")  # joined; the cohort is still forming
    drive(round_, [], OtherMembers(spec).answers(), until=act.Poll)
    assert round_.training
    aborted = state("aborted", spec, token=2)
    round_.receive(act.RoundObserved(aborted))
    assert isinstance(round_.next(), act.AwaitTraining)
    round_.receive(act.Trained(DELTA))
    done = finish([round_.next()])
    assert done.outcome is not None and done.outcome.status == "aborted"
    assert done.outcome.epsilon is None and done.following == aborted


def test_training_failing_during_key_stages_ends_the_attempt_at_once() -> None:
    spec = secagg_spec()
    world = OtherMembers(spec)
    round_ = start(spec, "advertise")
    drive(round_, [], world.answers(), until=act.Advertise)
    round_.receive(act.TrainingFailed(ServerBusy("model download still refused")))
    done = finish([round_.next()])  # the advertisement in flight is dropped
    assert done.outcome is not None and done.outcome.status == "dropped"
    assert done.outcome.detail == "model download still refused"


# ------------------------------------------------------------------------ Follower


def follower(carry: Carryover | None = None, max_rounds: int | None = None) -> Follower:
    return Follower(member(), carry or Carryover(), long_poll_s=POLL_S, max_rounds=max_rounds)


def test_follower_joins_an_open_attempt_once() -> None:
    f = follower()
    assert f.next() == act.Poll(None)
    f.receive(act.RoundObserved(state("open")))
    join = f.next()
    assert isinstance(join, act.Join) and (join.round, join.attempt) == (1, 1)
    assert (join.request.samples, join.request.base_version) == (SAMPLES, None)
    assert join.request.dataset_schema == TASK.schema.fingerprint()
    f.receive(act.JoinAnswered(JoinResponse(True, "joined")))
    assert f.next() == act.Poll(1)
    f.receive(act.RoundObserved(state("open", token=2)))
    assert f.next() == act.Poll(2)  # not joined twice


def test_follower_skips_rounds_whose_cohort_does_not_name_it() -> None:
    f = follower()
    f.receive(act.RoundObserved(state("advertise", make_spec(("bob",)))))
    assert f.next() == act.Poll(1)


def test_follower_takes_part_then_answers_challenges_and_stops_after_max_rounds() -> None:
    spec = make_spec()
    f = follower(max_rounds=1)
    f.receive(act.RoundObserved(state("advertise", spec)))
    part = f.next()
    assert isinstance(part, act.Participate) and part.round.spec == spec
    outcome = act.RoundOutcome(1, 1, "closed", 1)
    f.receive(act.Participated(outcome, None))
    assert f.next() == act.AnswerChallenges("fed")
    f.receive(act.Passed())
    assert f.next() == act.Finish() and f.outcomes == [outcome]


def test_follower_looks_for_challenges_only_when_one_was_issued() -> None:
    f = follower()
    issued = 0
    for round_, looks in ((1, True), (2, False), (3, True)):
        spec = make_spec(round=round_)
        f.receive(act.RoundObserved(state("advertise", spec, round=round_)))
        assert isinstance(f.next(), act.Participate)
        issued += round_ == 3  # an auditor challenged someone during round 3
        after = state("closed", spec, round=round_, token=round_, challenges_issued=issued)
        f.receive(act.Participated(act.RoundOutcome(round_, 1, "closed", 1), after))
        if looks:  # the first time this run, then once the count moved
            assert f.next() == act.AnswerChallenges("fed")
            f.receive(act.Passed())
        assert f.next() == act.Poll(round_)


def test_follower_finishes_with_the_federation() -> None:
    f = follower()
    f.receive(act.RoundObserved(state("closed", finished=True)))
    assert f.next() == act.Finish()


@pytest.mark.parametrize(
    "error",
    [
        DuplicateMessage("already joined"),
        AggregatorRefused("cohort full", code="conflict", http_status=409),
        NotFound("no such attempt"),
        RateLimited("still refused"),
    ],
    ids=lambda e: f"{e.http_status}-{e.code}",
)
def test_follower_outlives_round_local_join_refusals(error: FedsecError) -> None:
    f = follower()
    f.receive(act.RoundObserved(state("open")))
    assert isinstance(f.next(), act.Join)
    f.receive(act.Refused(error))
    assert f.next() == act.Poll(1)  # waits for the next change, not joining again


def test_follower_refused_as_stale_retrains_before_joining_again() -> None:
    carry = Carryover()
    carry.update = TrainedUpdate(("old",), DELTA, 1.0, 3, 0.1, base_version=1)
    f = follower(carry)
    f.receive(act.RoundObserved(state("open", mode="buffered")))
    assert f.next() == act.Poll(None)  # an update is waiting: nothing to train first
    f.receive(act.RoundObserved(state("open", mode="buffered")))
    join = f.next()
    assert isinstance(join, act.Join) and join.request.base_version == 1
    f.receive(act.Refused(StaleUpdate("base version 1 is 5 versions old")))
    assert carry.update is None
    assert f.next() == act.Poll(None)  # at once, to train on the newest plan


def test_follower_ends_on_a_permanent_join_refusal() -> None:
    f = follower()
    f.receive(act.RoundObserved(state("open")))
    with pytest.raises(AuthError):
        f.receive(act.Refused(AuthError("not on the roster")))


def test_follower_checks_the_budget_before_taking_a_seat() -> None:
    carry = Carryover()
    carry.last_cost = (1.0, 0.25, 8)
    f = follower(carry)
    f.receive(act.RoundObserved(state("open")))
    assert f.next() == act.CheckBudget(1, (1.0, 0.25, 8))
    with pytest.raises(BudgetExhausted):
        f.receive(act.Refused(BudgetExhausted("would spend epsilon 9 > budget 8")))


def test_buffered_follower_trains_on_the_plan_before_joining() -> None:
    plan = make_spec(cohort=(), mode="buffered")
    carry = Carryover()
    f = follower(carry)
    f.receive(act.RoundObserved(state("open", mode="buffered", plan=plan)))
    charge = f.next()
    assert isinstance(charge, act.Charge)
    f.receive(answer_plain(charge))
    assert isinstance(f.next(), act.Train)
    f.receive(act.TrainingStarted())
    assert isinstance(f.next(), act.AwaitTraining)
    f.receive(act.Trained(DELTA))
    assert carry.update is not None and carry.update.base_version == 1
    assert f.next() == act.Poll(None)  # training took a while
    f.receive(act.RoundObserved(state("open", mode="buffered", plan=plan, token=2)))
    check = f.next()  # the cost just charged is the best guess of the next one's
    assert isinstance(check, act.CheckBudget) and check.cost == carry.last_cost
    f.receive(act.BudgetChecked())
    join = f.next()
    assert isinstance(join, act.Join) and join.request.base_version == 1


def test_buffered_training_deferred_by_a_temporary_refusal_keeps_its_charge() -> None:
    plan = make_spec(cohort=(), mode="buffered")
    carry = Carryover()
    f = follower(carry)
    f.receive(act.RoundObserved(state("open", mode="buffered", plan=plan)))
    f.receive(answer_plain(f.next()))
    f.receive(act.TrainingStarted())
    f.receive(act.TrainingFailed(ServerBusy("model download still refused")))
    assert f.next() == act.Poll(1)  # not joined untrained
    assert carry.unused_charge is not None and carry.update is None
    f.receive(act.RoundObserved(state("open", mode="buffered", plan=plan, token=2)))
    train = f.next()  # the retry trains on the same charge
    assert isinstance(train, act.Train) and train.charge == carry.unused_charge


def test_clock_default_is_wall_time() -> None:
    spec = make_spec()
    round_ = AgentRound(state("advertise", spec), member(), Carryover(), long_poll_s=POLL_S)
    asked = drive(round_, [state("masked_input", spec), state("closed", spec)])
    record = next(a for a in asked if isinstance(a, act.Record))
    assert abs(record.record.recorded_at - time.time()) < 60


def test_a_data_summary_scales_the_weight_by_its_quality() -> None:
    summary = DataSummary(
        federation_id="fed", member="alice", records=SAMPLES, label_counts={"0": 60, "1": 60},
        missing_rate={}, schema_fingerprint="ab" * 32,
        observed=ObservedSchema(label="y", classes=["0", "1"], columns=[]),
        label_coverage=1.0, quality_score=0.5,
    )  # fmt: skip
    spec = make_spec()
    round_ = AgentRound(
        state("advertise", spec),
        dataclasses.replace(member(), data_summary=summary),
        Carryover(),
        long_poll_s=POLL_S,
        clock=lambda: NOW,
    )
    asked = drive(round_, [state("masked_input", spec), state("closed", spec)])
    done = finish(asked)
    # volume 120 / 1000, times quality 0.5: the weight the update is scaled by and sent with
    assert done.outcome is not None and done.outcome.weight == pytest.approx(0.06)
    sent = next(a for a in asked if isinstance(a, act.SendMaskedInput))
    q = unpack(sent.vector, DIM + 1, spec.ring_bits)
    assert abs(int(q[-1]) / spec.quant_spec().levels - 0.06) <= 1 / spec.quant_spec().levels


def test_an_he_member_releases_its_update_before_its_ciphertext_leaves() -> None:
    """A retry of an HE attempt must not get the same update: the aggregator holds the
    first attempt's ciphertexts, which a colluder's ``Enc(c) − Σ`` could cancel in the
    retry's sum.  So the update is released (one attempt only) before it is sent."""
    spec = make_spec(MEMBERS, secure_sum="he", he_context_sha256="cd" * 32, custodian="keys")
    carry = Carryover()
    round_ = start(spec, "commit", carry)
    cipher = b"ciphertext"
    digest = hashlib.sha256(cipher).hexdigest()

    def commit(a: act.SendCommit) -> act.Event:
        mine = MemberCommitment("alice", digest, a.body.signature)
        return act.UploadAnswered(Accepted(True, commitments=CommitmentSetBody([mine])))

    answers: dict[type[act.Action], Answer] = {
        act.Encrypt: lambda a: act.Encrypted(cipher),
        act.SendCommit: commit,
    }
    asked = drive(round_, [state("closed", spec)], answers)
    names = kinds(asked)
    assert names.index("Release") < names.index("SendMaskedInput"), names
    released = next(a for a in asked if isinstance(a, act.Release))
    assert (released.round, released.attempt) == (spec.round, spec.attempt)
    assert carry.update is None and carry.last_release == (spec.round, spec.attempt)
