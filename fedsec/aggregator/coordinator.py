"""The round coordinator: the one entry point of the round engine.

Everything here is synchronous and free of sockets: the HTTP layer
(:mod:`fedsec.aggregator.http`) authenticates a request, then calls one method
with the member's id and the decoded body, and :meth:`Coordinator.tick` is
called periodically to close stages on deadlines.  Tests drive it directly.

The engine is split by concern under :mod:`fedsec.aggregator.rounds` (lifecycle as a
stage table, cohort, intake and receipts, privacy reports, refusals, model
application, resume) over the summation-session interface of
:mod:`fedsec.summation`; this facade holds only what the HTTP layer, the
audit-challenge desk and the CLI call, and answers their questions about the attempt
in progress (:meth:`current_attempt`, :meth:`before_stage`, :meth:`has_reached`, ...).

Every accepted message is committed to SQLite before the method returns, and a
restarted coordinator resumes the round in progress (:mod:`.rounds.resume`).
"""

from __future__ import annotations

import itertools
import re
import secrets
import time
from collections.abc import Callable
from typing import Final

import msgspec
import numpy as np

from fedsec.aggregator.groups.hosts import share_store
from fedsec.aggregator.optimizers import make_optimizer
from fedsec.aggregator.rounds.alerts import AlertDesk
from fedsec.aggregator.rounds.apply import ModelApplier
from fedsec.aggregator.rounds.attempt import Attempt
from fedsec.aggregator.rounds.cohort import CohortDesk
from fedsec.aggregator.rounds.context import RoundContext
from fedsec.aggregator.rounds.evaluation import FederatedEvaluation
from fedsec.aggregator.rounds.events import EventBus, ModelEvaluated, ModelProblem
from fedsec.aggregator.rounds.he_context import HeContextDesk
from fedsec.aggregator.rounds.intake import Intake
from fedsec.aggregator.rounds.lifecycle import Lifecycle
from fedsec.aggregator.rounds.open_archive import OpenAttemptObjects
from fedsec.aggregator.rounds.quarantine import QuarantineDesk
from fedsec.aggregator.rounds.refusals import REFUSED_ENTRIES_PER_ATTEMPT, RefusalLog
from fedsec.aggregator.rounds.reports import PrivacyReports
from fedsec.aggregator.storage.audit_trail import AuditTrail
from fedsec.aggregator.workspace import Workspace, check_model_size
from fedsec.errors import ForbiddenError, PayloadError, WrongStage
from fedsec.faults import NO_FAULTS, Faults
from fedsec.protocol import wire
from fedsec.protocol.log_entries import GenesisEntry
from fedsec.protocol.stages import ACTIVE_STAGES, Stage
from fedsec.summation import mode_named, mode_of
from fedsec.task.digest import loaded_task_pin
from fedsec.tasks.base import Task

__all__ = ["LOG_LINES_PER_READ", "REFUSED_ENTRIES_PER_ATTEMPT", "Coordinator"]

#: Most transparency-log lines one ``GET /audit/log`` answers: a line is a few hundred
#: bytes (at most 1 MiB), so 10,000 is a few MB per answer in practice, and a reader
#: (the custodian, an auditor) goes on from the index after the last line it got.
LOG_LINES_PER_READ: Final = 10_000
_SHA256_HEX: Final = re.compile(r"[0-9a-f]{64}")


def _trail(workspace: Workspace, clock: Callable[[], float], faults: Faults) -> AuditTrail:
    """The workspace's transparency log, archive and log file (their durable copies in
    its state database)."""
    return AuditTrail(
        workspace.root,
        workspace.state.log,
        workspace.signer,
        workspace.config.federation.id,
        clock=clock,
        faults=faults,
        store=workspace.state,
    )


class Coordinator:
    """Drives rounds for one federation workspace.

    Args:
        workspace: the opened workspace.
        clock: time source (tests pass a fake one).
        on_change: called whenever something an agent may be waiting for changed.
        faults: crash points for chaos tests (:mod:`fedsec.faults`); none in production.
        events: the event bus to announce on; listeners subscribed before construction
            also hear what start-up finds (e.g. an unusable stored model).

    Attributes:
        token: changes whenever something an agent may be waiting for changed.

    Raises:
        ConfigError: the summation mode cannot sum the task's model (see
            :func:`fedsec.aggregator.workspace.check_model_size`).
    """

    def __init__(
        self,
        workspace: Workspace,
        clock: Callable[[], float] = time.time,
        on_change: Callable[[], None] | None = None,
        *,
        faults: Faults = NO_FAULTS,
        events: EventBus | None = None,
    ) -> None:
        self.ws = workspace
        self.on_change = on_change
        if workspace.config.round.group_servers:  # their writes are ordered with ours
            share_store(workspace.state, follower=False)
        # Agents long-poll "until the token differs from the one I saw".  A restarted
        # aggregator must not hand out tokens its predecessor used, or an agent holding
        # one would sleep through the resumed round; a random start (below 2^53, exact
        # in JSON) makes a repeat across restarts vanishingly unlikely.
        self.token = secrets.randbits(52) + 1
        fed = workspace.config.federation
        self.task = workspace.served_task()
        model = self.task.build_model(seed=0)
        dim = sum(p.numel() for p in model.parameters() if p.requires_grad)
        # a config edited after init (e.g. to secure_sum = "he") meets the same refusal
        check_model_size(workspace.config, dim)
        self.trail = _trail(workspace, clock, faults)
        ctx = RoundContext(
            workspace,
            clock,
            self.trail,
            self.task,
            dim,
            self._changed,
            faults,
            events or EventBus(),
            task_pin=loaded_task_pin(fed.task),
        )
        self._ctx = ctx
        self._mode = mode_named(workspace.config.round.secure_sum)
        _start_log(self.trail, workspace, self.task)
        self._roster_serial = workspace.roster.serial
        _report_model_problems(ctx)
        optimizer = make_optimizer(workspace.config.server, dim, workspace.state)
        applier = ModelApplier(ctx, model, optimizer, _validation_data(workspace, self.task))
        self._he = HeContextDesk(ctx)
        self._cohort = CohortDesk(ctx, self._he)
        self._refusals = RefusalLog(ctx.ws.state, ctx.trail.append, lambda: self._lifecycle.live)
        self._lifecycle = Lifecycle(ctx, self._cohort, applier, self._refusals, self._he)
        self._reports = PrivacyReports(ctx)
        self._evaluation = FederatedEvaluation(ctx)
        self._intake = Intake(ctx, self._lifecycle, self._refusals, self._reports)
        self._quarantine = QuarantineDesk(ctx)
        self._open_objects = OpenAttemptObjects(workspace.state)
        self._lifecycle.resume()

    def _changed(self) -> None:
        self.token += 1
        if self.on_change is not None:
            self.on_change()

    # -- what the HTTP layer and operators ask ----------------------------------------------------

    @property
    def events(self) -> EventBus:
        """Where the engine announces rounds, stages, contributions and alerts."""
        return self._ctx.events

    @property
    def alert_desk(self) -> AlertDesk:
        """Raising and acknowledging operator alerts."""
        return self._ctx.alerts

    @property
    def alerts(self) -> list[str]:
        """The details of the newest 50 alerts, oldest first (``GET /v1/status``)."""
        return [row.detail for row in reversed(self._ctx.alerts.recent(50))]

    @property
    def context(self) -> RoundContext:
        """The engine's shared context (operations read the clock, config and state)."""
        return self._ctx

    def deadline(self) -> float:
        """When the stage in progress closes at the latest: for open, when the join
        window closes (inf until ``min_agents`` joined); inf once the attempt ended."""
        live = self.live
        if live.stage == "open" and not self.finished:
            return self._cohort.join_deadline(live)
        return self._lifecycle.deadline(live)

    @property
    def rounds_completed(self) -> int:
        return self._lifecycle.rounds_completed

    @property
    def live(self) -> Attempt:
        """The attempt in progress (a read-only view for tests and debugging)."""
        return self._lifecycle.live

    @property
    def finished(self) -> bool:
        """True once the federation ran its configured number of rounds."""
        return self._lifecycle.finished

    def count_traffic(self, key: tuple[int, int], received: int, sent: int) -> None:
        """Add one request's body sizes to the attempt that was current when it arrived."""
        self._ctx.count_traffic(key, received, sent)

    def current_attempt(self) -> tuple[int, int]:
        """(round, attempt) of the attempt in progress."""
        live = self.live
        return live.round, live.attempt

    def in_stage(self, round_: int, attempt: int, stage: str) -> bool:
        """True while attempt (round_, attempt) is in progress in ``stage``."""
        live = self.live
        return live.is_current(round_, attempt) and live.stage == stage

    def before_stage(self, round_: int, attempt: int, stage: str) -> bool:
        """True while attempt (round_, attempt) is in progress and has not yet reached
        ``stage``: what a request long-polling for that stage's data waits on.  False
        once it has, or once the attempt is over (aborted, closed, superseded)."""
        live = self.live
        return (
            live.is_current(round_, attempt)
            and live.stage in ACTIVE_STAGES
            and live.precedes(live.stage, stage)
        )

    def has_reached(self, round_: int, attempt: int, stage: str) -> bool:
        """True when attempt (round_, attempt) is the one in progress (not aborted) and
        has reached (or passed) ``stage``: what a held request is answered with."""
        live = self.live
        return (
            live.is_current(round_, attempt)
            and live.stage != "aborted"
            and not self.before_stage(round_, attempt, stage)
        )

    def has_stage(self, stage: str) -> bool:
        """True when the attempt in progress has a summation that passes through
        ``stage`` (e.g. unmask: SecAgg+ does, a plain sum does not)."""
        session = self.live.summation
        return session is not None and stage in session.stages

    def held_answer_stage(self, upload: str) -> Stage | None:
        """The stage whose data the answer to an ``upload`` stage's message may wait for
        in the attempt in progress (its mode's ``held_answers``: SecAgg+ holds a masked
        input's answer for the unmask request of stage consistency); None: answered at
        once."""
        spec = self.live.spec
        return None if spec is None else mode_of(spec).held_answers.get(upload)

    def round_state(self) -> wire.RoundState:
        live, ws = self.live, self.ws
        return wire.RoundState(
            federation_id=ws.federation_id,
            round=live.round,
            attempt=live.attempt,
            stage=live.stage,  # type: ignore[arg-type]
            token=self.token,
            model_version=ws.models.latest().version,
            rounds_completed=self._lifecycle.rounds_completed,
            rounds_target=ws.config.round.rounds,
            finished=self.finished,
            spec=live.spec,
            mode=ws.config.round.mode,
            plan=live.plan,
            roster_serial=ws.roster.serial,
            challenges_issued=ws.state.challenges.count(),
        )

    # -- members' requests -----------------------------------------------------------------------

    def join(
        self, member: str, round_: int, attempt: int, req: wire.JoinRequest
    ) -> wire.JoinResponse:
        """A member asks to be in this round's cohort."""
        if self.finished:
            raise WrongStage(f"the federation finished its {self.ws.config.round.rounds} rounds")
        self._quarantine.check_join(member)
        live = self.live
        live.expect(member, round_, attempt, "open")
        answer, joined = self._cohort.join(live, member, req)
        if joined:
            # No change signal: a join alters nothing a waiting agent reads, and waking
            # every earlier joiner on each join costs O(n²) long-poll answers per round.
            # Fixing the cohort (when this join completes it) announces itself.
            self._lifecycle.fix_cohort_if_ready(self._ctx.clock())
        return answer

    def report(self, member: str, round_: int, attempt: int, report: wire.PrivacyReport) -> None:
        """Record a member's signed privacy report for this round (any stage after open)."""
        body = self._reports.check(self.live, member, round_, attempt, report)
        if body is not None:
            self._reports.store(report, body)

    def evaluation(
        self, member: str, round_: int, attempt: int, report: wire.EvaluationReport
    ) -> None:
        """Record a member's signed evaluation of the model closed attempt
        ``round_``.``attempt`` produced (:mod:`fedsec.aggregator.rounds.evaluation`)."""
        body = self._evaluation.check(member, round_, attempt, report)
        if body is not None:
            self._evaluation.store(report, body)

    def evaluated(self, round_: int, attempt: int) -> ModelEvaluated | None:
        """The members' pooled evaluation of a closed attempt's model, if any reported."""
        return self._evaluation.pooled(round_, attempt)

    def advertise(
        self, member: str, round_: int, attempt: int, body: wire.AdvertiseKeysBody
    ) -> None:
        self._intake.advertise(member, round_, attempt, body)

    def share_keys(self, member: str, round_: int, attempt: int, body: wire.ShareKeysBody) -> None:
        """Accept a member's shares and, when they carry one, its privacy report."""
        self._intake.share_keys(member, round_, attempt, body)

    def masked_input(
        self,
        member: str,
        round_: int,
        attempt: int,
        raw: bytes,
        commitment: str,
        signature: str,
    ) -> wire.Receipt:
        """Accept a masked (or, without secure summation, plain quantized) input.

        ``commitment`` (hex, H(salt ‖ quantized update), for the auditor) and
        ``signature`` (the member's Ed25519 signature of the
        :class:`wire.ContributionStatement` binding round, vector hash and
        commitment) make the contribution attributable and auditable.  Refusals
        are logged too, within bounds (:mod:`fedsec.aggregator.rounds.refusals`).
        """
        return self._intake.masked_input(member, round_, attempt, raw, commitment, signature)

    def unmask(self, member: str, round_: int, attempt: int, body: wire.UnmaskResponseBody) -> bool:
        """Take a survivor's unmask answer; False when it came after the attempt closed
        without needing it: nothing is stored or logged then."""
        return self._intake.unmask(member, round_, attempt, body)

    def receipt(self, member: str, round_: int) -> wire.Receipt:
        return self._intake.receipt(member, round_)

    def key_list(self, member: str, round_: int, attempt: int) -> wire.KeyListBody:
        self.live.expect_at_least(member, round_, attempt, "share_keys")
        return self.live.summing().key_list(member)

    def share_relay(self, member: str, round_: int, attempt: int) -> wire.ShareRelayBody:
        self.live.expect_at_least(member, round_, attempt, "masked_input")
        return self.live.summing().share_relay(member)

    def unmask_request(self, member: str, round_: int, attempt: int) -> wire.UnmaskRequestBody:
        self.live.expect_at_least(member, round_, attempt, "consistency")
        return self.live.summing().unmask_request(member, self.token)

    def consistency(
        self, member: str, round_: int, attempt: int, body: wire.ConsistencyBody
    ) -> None:
        """Take a survivor's signature on the survivor sets it was told."""
        self._intake.consistency(member, round_, attempt, body)

    def consistency_proof(
        self, member: str, round_: int, attempt: int
    ) -> wire.ConsistencyProofBody:
        self.live.expect_at_least(member, round_, attempt, "unmask")
        return self.live.summing().consistency_proof(member, self.token)

    # -- homomorphic summation ---------------------------------------------------------------

    def commit(self, member: str, round_: int, attempt: int, body: wire.CommitBody) -> None:
        """Take a member's signed commitment to the hash of the ciphertext it will send."""
        self._intake.commit(member, round_, attempt, body)

    def commitment_set(self, member: str, round_: int, attempt: int) -> wire.CommitmentSetBody:
        """The attempt's commitments, once commit closed, for a member that committed."""
        self.live.expect_at_least(member, round_, attempt, "masked_input")
        return self.live.summing().commitment_set(member)

    def publish_he_context(self, member: str, published: wire.HeContext) -> bool:
        """The key custodian publishes the federation's public CKKS context (once; an
        identical repeat is accepted, returning False).  See
        :meth:`fedsec.aggregator.rounds.he_context.HeContextDesk.publish`."""
        return self._he.publish(member, published)

    def he_context(self) -> wire.HeContext:
        """Raises NotFound: not published yet (or not a homomorphic federation)."""
        return self._he.served()

    def he_sum(self, member: str, round_: int, attempt: int) -> wire.HeSumOffer:
        """What the custodian is asked to decrypt, once the attempt is in decrypt.

        Raises:
            WrongStage: not that attempt, or not in decrypt yet.
            UnknownMember: ``member`` is not its custodian (or not a homomorphic attempt).
        """
        session = self._intake.he_session(member, round_, attempt, "decrypt")
        tail = self.ws.state.log.log_tail()
        return session.offer(0 if tail is None else tail[0] + 1)

    def decryption(self, member: str, round_: int, attempt: int, raw: bytes) -> None:
        """Take the custodian's decryption (:meth:`Intake.decryption`); the round closes."""
        self._intake.decryption(member, round_, attempt, raw)

    # -- the transparency log and its archive, for its checkers ---------------------------------

    def log_lines(self, start: int) -> bytes:
        """Committed log lines from index ``start`` on, at most :data:`LOG_LINES_PER_READ`,
        each ending in a newline (empty past the tail)."""
        lines = itertools.islice(self.ws.state.log.log_lines(start), LOG_LINES_PER_READ)
        return b"".join(line + b"\n" for _, line in lines)

    def archived(self, member: str, sha256: str) -> bytes:
        """The archived object named ``sha256``, for ``member`` (an auditor or the key
        custodian).

        The archive holds every accepted message, plain updates of ``secure_sum = "none"``
        included; a custodian reads it only in a homomorphic federation, where what it
        needs (the ciphertexts it re-adds) is there.

        An auditor reads it only where members' updates are not in the clear there
        (SecAgg+ masked inputs, HE ciphertexts): in a ``secure_sum = "none"`` federation it
        sees an update only through a reveal it challenged, and audits a copy of the
        workspace for the rest.

        The messages of the attempt in progress are withheld until it ends
        (:mod:`.rounds.open_archive`), except from the key custodian in stage decrypt.

        Raises:
            ForbiddenError: a custodian, and the federation does not sum homomorphically;
                an auditor, and the federation sums in the clear.
            PayloadError: not a lowercase SHA-256 hex digest.
            WrongStage: a message of the attempt in progress (409).
            NotFound: not in the archive (never archived, or pruned past retention).
        """
        entry = self.ws.roster.get(member)
        if entry is not None and entry.role == "custodian" and not self._he.custodian:
            raise ForbiddenError(
                f"{member}: a key custodian reads the archive only where round.secure_sum = he"
            )
        if entry is not None and entry.role == "auditor" and self._mode.sums_in_clear:
            raise ForbiddenError(
                f"{member}: the archive of a federation without secure summation holds members' "
                "updates in the clear; an auditor sees one through a reveal it challenged, "
                "or audits a copy of the workspace"
            )
        if not _SHA256_HEX.fullmatch(sha256):
            raise PayloadError(f"{sha256[:70]!r} is not a SHA-256 hex digest")
        live = self.live
        custodian_reads = entry is not None and entry.role == "custodian"
        if (
            live.stage in ACTIVE_STAGES
            and not (custodian_reads and live.stage == "decrypt")
            and self._open_objects.holds(live.round, live.attempt, sha256)
        ):
            raise WrongStage(
                f"{sha256[:16]}… is a message of round {live.round} attempt {live.attempt}, "
                f"which is still open (stage {live.stage}): an attempt's messages are served "
                "once it has ended"
            )
        return self.trail.archive.get(sha256)

    # -- quarantine ------------------------------------------------------------------------------

    def quarantine(self, caller: str, order: wire.QuarantineOrder) -> wire.QuarantineAnswer:
        """An auditor posts a signed quarantine order (:mod:`.rounds.quarantine`)."""
        return self._quarantine.order(caller, order)

    def quarantine_failed(
        self, auditor: str, verdicts: list[wire.AuditVerdict]
    ) -> list[wire.QuarantineAnswer]:
        """An auditor's stored verdicts: with ``audit.quarantine_on_failure``, each failed
        member is quarantined (:mod:`.rounds.quarantine`)."""
        return self._quarantine.failed_verdicts(auditor, verdicts)

    def data_summaries(self) -> dict[str, wire.DataSummary]:
        """Members' latest signed data summaries (:mod:`.rounds.data_summaries`)."""
        return self._cohort.summaries.latest()

    # -- time ------------------------------------------------------------------------------------

    def tick(self) -> None:
        """Close the current stage if its deadline passed (or, for open, the cohort is ready)."""
        if self.finished:
            return
        if self.ws.roster.serial != self._roster_serial:
            self._roster_serial = self.ws.roster.serial
            self.trail.sync_roster(self.ws.roster)
        self._quarantine.poll_orders()
        self._lifecycle.tick()


# -- start-up ------------------------------------------------------------------------------------


def _start_log(trail: AuditTrail, ws: Workspace, task: Task) -> None:
    """The log's genesis (once), then the roster and model entries it lacks."""
    cfg = ws.config
    trail.genesis(
        GenesisEntry(
            federation_id=cfg.federation.id,
            aggregator_public_key=ws.signer.public_bytes.hex(),
            admin_public_key=ws.admin_public.hex(),
            task=task.name,
            task_version=task.version,
            schema_fingerprint=task.schema.fingerprint(),
            server=msgspec.to_builtins(cfg.server),
            round=msgspec.to_builtins(cfg.round),
        )
    )
    trail.sync_roster(ws.roster)
    in_progress = ws.state.rounds.latest()
    trail.sync_models(
        ws.models,
        defer_round=(
            in_progress.round
            if in_progress is not None and in_progress.stage not in ("closed", "aborted")
            else None
        ),
    )


def _report_model_problems(ctx: RoundContext) -> None:
    latest = ctx.ws.models.latest()
    for problem in ctx.ws.models.problems():
        ctx.emit(ModelProblem(problem.version, problem.reason, latest.version))
        ctx.alert(
            "model_unusable",
            f"model {problem.version}",
            f"model version {problem.version} is unusable ({problem.reason}); "
            f"serving the last good version {latest.version}",
        )


def _validation_data(ws: Workspace, task: Task) -> tuple[np.ndarray, np.ndarray] | None:
    """Held-out data to score each new model version on, when validation is on."""
    if not ws.config.validation.enabled or task.name in ("csv", "table"):
        return None
    data = task.load(seed=0)
    return data.x_test, data.y_test
