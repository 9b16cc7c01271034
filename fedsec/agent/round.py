"""One round attempt as this agent takes part in it: a sans-I/O state machine.

:class:`AgentRound` says what to do next (:meth:`AgentRound.next`, an action of
:mod:`fedsec.agent.actions`) and takes the answer (:meth:`AgentRound.receive`); it
never awaits.  From a round state whose signed spec has us in the cohort::

    verify spec and task ──► the mode's train: charge the ledger (or reuse a retried
        round's update), Train (in the background) ──► privacy report ──► encode and
        keep the update ──► the mode's finish: its stages up to the receipt
        ──► wait for closed (trusted mode: read why the aggregation rule refused us)

What differs by summation mode is a :class:`~fedsec.agent.member_steps.MemberSteps`
object, looked up once in :data:`fedsec.agent.steps.MEMBER_STEPS` (SecAgg+: roster and
key stages while training runs, then masked input, consistency and unmask; HE: encrypt,
commit, upload; plain: upload).  This machine reads the mode nowhere else.

If the mode's stages end the attempt during training, training is still awaited so the
update is kept for a retried attempt and the privacy it cost is not spent twice; if
training fails, the attempt ends at once with training's error.  Where the mode says so
(:attr:`~fedsec.agent.member_steps.MemberSteps.releases_update`), the update is released
to the attempt just before its vector leaves (Release, durable in the ledger): no later
attempt gets it, a retry trains anew on a fresh charge (:mod:`fedsec.agent.charging`).

The steps are generators: each ``yield`` is an action, the value sent back its
answer; a refusal is raised inside the step that asked, and the step decides what it
means (a 409 duplicate: an earlier try landed; a 409 wrong stage on a long-polled
fetch: poll the round state, then fetch).  Attempt-ending answers become the outcome
(``aborted``, ``missed``, ``dropped``); any other error is raised from
:meth:`AgentRound.receive` and ends the agent.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from fedsec.agent.actions import (
    Action,
    AwaitTraining,
    Evaluate,
    Event,
    FetchReceipt,
    FetchStatus,
    Finish,
    KeepUpdate,
    MaskedInputAnswered,
    OutcomeStatus,
    Passed,
    ReceiptFetched,
    Record,
    Refused,
    Release,
    Report,
    ReportTaken,
    RoundOutcome,
    SendMaskedInput,
    StatusFetched,
    Step,
    Train,
    Trained,
    TrainingFailed,
    TrainingStarted,
    UpdateKept,
    ask,
)
from fedsec.agent.attempt import AttemptOver, AttemptTracker, StageMissed
from fedsec.agent.charging import (
    Carryover,
    PrivacyCharge,
    TrainedUpdate,
    check_distributed,
)
from fedsec.agent.contribution import (
    Contribution,
    check_receipt,
    contribution_statement,
    privacy_report,
    round_record,
)
from fedsec.agent.member import Member
from fedsec.agent.refusals import is_round_local
from fedsec.agent.spec import check_spec_task, member_weight, staleness_discount, verify_round_spec
from fedsec.agent.steps import member_steps
from fedsec.crypto.quantize import clip_l2
from fedsec.errors import DuplicateMessage, FedsecError, WrongStage
from fedsec.faults import NO_FAULTS, SeededBytes
from fedsec.protocol.codec_choice import codec_for
from fedsec.protocol.ddp import is_distributed
from fedsec.protocol.ddp import member_weight as ddp_member_weight
from fedsec.protocol.stages import stage_index
from fedsec.protocol.wire import (
    Receipt,
    RoundSpec,
    RoundState,
    UnmaskRequestBody,
)

# one logger for every agent event: operators filter on it (logger=fedsec.agent.runtime)
log = logging.getLogger("fedsec.agent.runtime")

#: How a step ends the attempt: the outcome and the newest state seen (None: poll anew).
Ending = tuple[RoundOutcome, RoundState | None]
T = TypeVar("T")


class AgentRound:
    """This agent's part in one round attempt.

    Args:
        state: the round state that named us in the cohort (its ``spec``).
        member: who we are and what we hold.
        carry: what earlier attempts left (an update, an unused charge); updated here.
        long_poll_s: how long the aggregator may hold an answer for the next stage.
        clock: wall clock for the agent's own records.
        seeded_bytes: the unsafe deterministic test seed's bytes (:mod:`fedsec.faults`);
            in production always None, so rounding randomness comes from the OS.

    Raises:
        SignatureError: the spec is not signed by the pinned aggregator key.
        TaskMismatch: the spec's task, version, schema or model size is not ours.
    """

    def __init__(
        self,
        state: RoundState,
        member: Member,
        carry: Carryover,
        *,
        long_poll_s: float,
        clock: Callable[[], float] = time.time,
        seeded_bytes: SeededBytes = NO_FAULTS.seeded_bytes,
        graph_nonce: bytes = b"",
    ) -> None:
        spec = state.spec
        if spec is None:
            raise WrongStage(f"round {state.round} attempt {state.attempt} has no spec yet")
        self.spec = spec
        self.member = member
        self._carry = carry
        self._clock = clock
        self._seeded_bytes = seeded_bytes
        self._graph_nonce = graph_nonce  # SecAgg+: committed to when joining this attempt
        self._attempt = AttemptTracker(state, long_poll_s)
        self._key = self._attempt.key
        self._mode = member_steps(self)  # the spec's summation mode: its own stages
        self._base = RoundOutcome(*self._key, "dropped", spec.model_version, samples=member.samples)
        self._receipt: Receipt | None = None
        self._residual: npt.NDArray[np.float32] | None = None  # error feedback, once taken
        self._training: PrivacyCharge | None = None  # running on this charge
        self._trained: TrainedUpdate | None = None
        self._failed = False
        self._steps = self._participate()
        self._pending: Action = AwaitTraining()  # replaced below
        first = self._refuse_early(state, spec)
        if first is not None:
            self._pending = first
        else:
            self._advance(None)

    # -- the machine ---------------------------------------------------------------

    def next(self) -> Action:
        """What to do now; the same action until :meth:`receive` answers it.  Train
        runs in the background: while it runs, other actions follow."""
        if self._failed:
            raise WrongStage(f"round {self.spec.round} ended with an error")
        return self._pending

    @property
    def tracker(self) -> AttemptTracker:
        return self._attempt

    @property
    def carry(self) -> Carryover:
        return self._carry

    @property
    def graph_nonce(self) -> bytes:
        return self._graph_nonce

    @property
    def training(self) -> bool:
        """Training is running: Trained or TrainingFailed is still to come."""
        return self._training is not None

    @property
    def finished(self) -> Finish | None:
        return self._pending if isinstance(self._pending, Finish) else None

    def receive(self, event: Event) -> None:
        """Take the answer to :meth:`next`'s action, or training's result at any time.

        An event that answers nothing pending is refused and changes nothing.

        Raises:
            WrongStage: ``event`` answers no pending action.
            FedsecError: an error that ends the agent, not only this attempt (the
                round is then over).
        """
        pending = self.next()
        if isinstance(event, Trained | TrainingFailed):
            if self._training is None:
                raise WrongStage(f"{type(event).__name__} while no training is running")
            if isinstance(event, TrainingFailed):
                self._training = None
                self._steps.close()  # training's error ends the attempt at once
                self._pending = Finish(*self._failing(self._dropped, event.error))
                return
            self._trained = self._carry.trained(self.spec, self._training, event.delta)
            self._training = None
            if not isinstance(pending, AwaitTraining):
                return  # kept until the steps need it
        elif isinstance(pending, Finish) or not isinstance(event, pending.answer | Refused):
            raise WrongStage(
                f"round {self.spec.round}: {type(event).__name__} does not answer "
                f"{type(pending).__name__}"
            )
        self._advance(event)

    def _advance(self, event: Event | None) -> None:
        try:
            self._pending = self._failing(self._steps.send, event)
        except StopIteration as stop:
            self._pending = Finish(*stop.value)

    def _failing(self, step: Callable[[Any], T], arg: Any) -> T:
        """``step(arg)``; an error other than the steps' end ends the round for good."""
        try:
            return step(arg)
        except StopIteration:
            raise
        except BaseException:
            self._failed = True
            raise

    # -- checks before anything is spent ---------------------------------------------

    def _refuse_early(self, state: RoundState, spec: RoundSpec) -> Finish | None:
        """Check the spec; a Finish when this attempt is not ours to take part in."""
        verify_round_spec(spec, self.member.aggregator_public)
        r, a = self._key
        if (spec.federation_id, spec.round, spec.attempt) != (state.federation_id, r, a):
            log.warning(
                "round_spec_mismatch round=%d attempt=%d spec_round=%d spec_attempt=%d",
                r,
                a,
                spec.round,
                spec.attempt,
            )
            return self._early_end("dropped", "spec names another round")
        first_stage = self._mode.first_stage
        if stage_index(state.stage) > stage_index(first_stage):
            # Joined before a restart, back too late: training now would spend privacy
            # on an update that can no longer be sent.
            detail = f"stage {first_stage} already passed (now {state.stage})"
            log.warning("round_missed round=%d attempt=%d reason=%r", r, a, detail)
            return self._early_end("missed", detail)
        check_spec_task(spec, self.member.task, self.member.dim)
        if is_distributed(spec):  # before the roster is fetched or anything is spent
            check_distributed(spec, self.member.allow_distributed, self.member.min_survivors)
        return None

    def _early_end(self, status: OutcomeStatus, detail: str) -> Finish:
        spec = self.spec
        self._steps.close()
        return Finish(
            RoundOutcome(spec.round, spec.attempt, status, spec.model_version, detail=detail)
        )

    # -- the attempt -----------------------------------------------------------------

    def _participate(self) -> Step[Ending]:
        """Take part in the attempt; return its outcome and the newest state seen."""
        spec, member = self.spec, self.member
        weight = member_weight(member.samples, spec, member.id, member.data_summary)
        try:
            trained, reported = yield from self._mode.train()
            self._base = _with(self._base, "dropped", None, trained.epsilon, weight)
            if not reported:
                reported = yield from self._report(trained)
            if reported and trained.index >= 0:
                yield from ask(ReportTaken(trained.index), Passed)
            receipt = yield from self._mode.finish(self._contribution(trained, weight))
            return (yield from self._closed(receipt))
        except AttemptOver as over:
            outcome, now = self._attempt_over(over.state)
            judged = yield from self._judged(outcome)
            if outcome.status == "closed" and now is not None:
                yield from self._evaluated(now)  # the round moved on: our attempt closed
            return judged, now
        except StageMissed as missed:
            log.warning("round_missed round=%d attempt=%d reason=%r", *self._key, str(missed))
            return _with(self._base, "missed", self._receipt, detail=str(missed)), missed.state
        except FedsecError as exc:
            return self._dropped(exc)

    def _closed(self, receipt: Receipt) -> Step[Ending]:
        if self.spec.mode == "buffered":
            self._carry.update = None  # consumed: the next buffer gets a freshly trained update
        if self._attempt.state.round > self.spec.round:
            final = self._attempt.state  # the held unmask answer came once our round had closed
        else:
            final = yield from self._attempt.wait_for(("closed",))
        log.info("round_closed round=%d attempt=%d", *self._key)
        outcome = yield from self._judged(_with(self._base, "closed", receipt))
        yield from self._evaluated(final)
        return outcome, final

    def _evaluated(self, closed: RoundState) -> Step[None]:
        """Federated evaluation: score the model our closed attempt produced and report
        it. A report that fails (no held-out data, a refusal) is logged and costs the
        round nothing: the model and our contribution stand."""
        if not self.spec.federated_evaluation or closed.model_version <= self.spec.model_version:
            return
        r, a = self._key
        try:
            evaluate = Evaluate(
                self.spec.federation_id,
                r,
                a,
                closed.model_version,
                min(self.member.samples, self.spec.max_weight_samples),
            )
            yield from ask(evaluate, Passed)
        except FedsecError as exc:
            log.warning(
                "evaluation_not_reported round=%d attempt=%d version=%d reason=%r",
                r,
                a,
                closed.model_version,
                exc.detail,
            )

    def _judged(self, outcome: RoundOutcome) -> Step[RoundOutcome]:
        """A closed outcome, or ``refused`` with the reason when the trusted-mode round's
        aggregation rule kept our update out."""
        if outcome.status != "closed" or not self._mode.judged_by_rule:
            return outcome
        reason = yield from self._refusal_by_rule()
        if reason is None:
            return outcome
        log.warning("round_refused_by_rule round=%d attempt=%d reason=%r", *self._key, reason)
        return _with(outcome, "refused", outcome.receipt, detail=reason)

    def _refusal_by_rule(self) -> Step[str | None]:
        """Trusted mode: why the round's aggregation rule kept our receipted update out of
        the aggregate, read from the round's summary in ``GET /status``; None when it
        did not.  A status the aggregator does not give leaves the outcome closed (the
        receipt stands; the log's refused entries still say)."""
        try:
            status = (yield from ask(FetchStatus(), StatusFetched)).status
        except FedsecError as exc:
            if not is_round_local(exc):
                raise
            log.warning("round_status_unread round=%d attempt=%d reason=%r", *self._key, exc.detail)
            return None
        for summary in status.history:
            if (summary.round, summary.attempt) == self._key:
                return summary.refused.get(self.member.id)
        return None

    def _attempt_over(self, now: RoundState) -> Ending:
        status: OutcomeStatus = "aborted"
        if self._receipt is not None and now.round > self.spec.round:
            status = "closed"  # the round moved on after taking our contribution
        log.info(
            "round_attempt_over round=%d attempt=%d status=%s now_round=%d now_attempt=%d stage=%s",
            *self._key,
            status,
            now.round,
            now.attempt,
            now.stage,
        )
        return _with(self._base, status, self._receipt), now

    def _dropped(self, exc: FedsecError) -> Ending:
        """A round-local error drops us from the attempt; any other is raised."""
        if not is_round_local(exc):
            raise exc
        log.warning("round_dropped round=%d attempt=%d reason=%r", *self._key, exc.detail)
        return _with(self._base, "dropped", self._receipt, detail=exc.detail), None

    def _contribution(self, trained: TrainedUpdate, weight: float) -> Contribution:
        """The update encoded by the round's codec; with error feedback, what the codec
        drops this time is kept for the round after the receipt (:meth:`send_vector`)."""
        spec = self.spec
        codec = codec_for(spec)
        discount = staleness_discount(spec, self.member.id)
        rounding = self._seeded_bytes(self.member.id, spec.round, "rounding") or os.urandom(32)
        delta = trained.delta * np.float32(discount)
        if codec.kind == "distributed":
            weight = ddp_member_weight(spec, self.member.samples)
        carried = self._carry.residual
        if codec.error_feedback and carried is not None and carried.size == delta.size:
            delta = delta + carried
        encoded = codec.encode(delta, weight, rounding)
        if codec.kind == "compressed":
            self._base = dataclasses.replace(
                self._base, rounded=codec.keep, saturated=encoded.saturated
            )
            if encoded.saturated:
                log.info(
                    "codec_saturated round=%d attempt=%d coordinates=%d of=%d",
                    *self._key,
                    encoded.saturated,
                    codec.keep,
                )
        if encoded.sent is not None:
            clipped = clip_l2(delta, spec.clip_norm).astype(np.float64)
            sent = encoded.sent / weight if weight > 0 else np.zeros_like(clipped)
            self._residual = (clipped - sent).astype(np.float32)
        return Contribution(trained, self.member.samples, weight, encoded.ring)

    # -- privacy and training ------------------------------------------------------

    def start_training(self, charge: TrainedUpdate | PrivacyCharge) -> Step[None]:
        if isinstance(charge, TrainedUpdate):
            self._trained = charge  # a retried attempt's update: nothing to train
            return
        self._training = charge
        yield from ask(Train(self.spec, charge), TrainingStarted)

    def await_training(self) -> Step[TrainedUpdate]:
        while self._trained is None:
            yield AwaitTraining()  # receive() keeps the update, or ends the attempt
        return self._trained

    def _report(self, trained: TrainedUpdate) -> Step[bool]:
        """Send the privacy report on its own; whether the aggregator took this one
        (False: it holds another report of ours for the attempt)."""
        spec = self.spec
        report = privacy_report(spec, self.member, trained)
        try:
            yield from ask(Report(spec.round, spec.attempt, report), Passed)
        except DuplicateMessage:
            return False
        log.info("privacy_reported round=%d epsilon=%.3f", spec.round, trained.epsilon)
        return True

    # -- the contribution ----------------------------------------------------------

    def send_vector(
        self, c: Contribution, vector: bytes, wait: float = 0.0, commitments_sha256: str = ""
    ) -> Step[tuple[Receipt, UnmaskRequestBody | None]]:
        """Keep the update for audits, send ``vector``, check and store the receipt
        (``commitments_sha256``: he, the commitment set's digest our statement binds).

        Returns:
            The receipt, and the unmask request when the answer was held for it
            (``wait`` > 0, SecAgg+).

        Raises:
            IntegrityError: the receipt names another member, round or contribution.
        """
        spec, (r, a) = self.spec, self._key
        salt = (yield from ask(KeepUpdate(r, a, c.quantized), UpdateKept)).salt
        if self._mode.releases_update:
            yield from self._release(c.trained)
        digest = hashlib.sha256(vector).hexdigest()
        statement = contribution_statement(
            spec, self.member, c.quantized, salt, vector, commitments_sha256
        )
        request: UnmaskRequestBody | None = None
        try:
            answer = yield from ask(
                SendMaskedInput(r, a, vector, statement, wait), MaskedInputAnswered
            )
            receipt, request = answer.receipt, answer.unmask
        except DuplicateMessage:
            # A retry after a lost answer: the first try was taken; fetch its receipt.
            receipt = (yield from ask(FetchReceipt(r), ReceiptFetched)).receipt
        check_receipt(receipt, spec, self.member.id, digest)
        self._receipt = receipt
        if self._residual is not None:  # taken: what it left out goes into the next round
            self._carry.residual = self._residual
        record = round_record(spec, self.member, c, receipt, self._clock())
        yield from ask(Record(receipt, record), Passed)
        log.info(
            "contribution_accepted round=%d attempt=%d bytes=%d sha256=%s log_index=%d",
            r,
            a,
            len(vector),
            digest,
            receipt.log_index,
        )
        return receipt, request

    def _release(self, trained: TrainedUpdate) -> Step[None]:
        """Record, durably and before the masked input leaves, that ``trained`` goes
        into this attempt's sum: no later attempt gets it (:mod:`fedsec.agent.charging`).
        The ledger refuses a charge already released to another attempt."""
        r, a = self._key
        yield from ask(Release(r, a, trained.index), Passed)
        self._carry.release(trained, r, a)


def _with(
    base: RoundOutcome,
    status: OutcomeStatus,
    receipt: Receipt | None,
    epsilon: float | None = None,
    weight: float | None = None,
    *,
    detail: str = "",
) -> RoundOutcome:
    return dataclasses.replace(
        base,
        status=status,
        epsilon=epsilon if epsilon is not None else base.epsilon,
        weight=weight if weight is not None else base.weight,
        receipt=receipt,
        detail=detail,
    )
