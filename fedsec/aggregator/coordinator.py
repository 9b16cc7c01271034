"""The round coordinator: drives SecAgg+ rounds over the durable state store.

Everything here is synchronous and free of sockets: the HTTP layer
(:mod:`fedsec.aggregator.app`) authenticates a request, then calls one method
with the member's id and the decoded body, and :meth:`Coordinator.tick` is
called periodically to close stages on deadlines.  Tests drive it directly.

Round life (``sync`` mode)::

    open ──(cohort fixed, spec signed)──> advertise ──> share_keys ──> masked_input
         ──> unmask ──(aggregate, new model version)──> closed ──> next round opens
    any stage ──(fewer than needed remain / secrets unrecoverable)──> aborted
         ──> same round, next attempt, opens without the lost members

With ``secure_sum = "none"`` the key stages are skipped: members upload their
quantized update in the clear (still signed) and the aggregator sums it.

Every accepted message is committed to SQLite before the method returns, and
:meth:`Coordinator.resume` rebuilds the round in progress after a restart by
replaying those messages into a fresh :class:`ServerSession`.  A retried
message identical to the one already accepted gets the same answer
(idempotent); a different one is refused as a duplicate.

Refused masked inputs are logged within bounds, so no member can grow the
transparency log by sending requests: only refusals for an attempt that exists
and from a member of its cohort get entries, at most
:data:`REFUSED_ENTRIES_PER_ATTEMPT` of them per member and attempt, an identical
retry none; the rest are counted and logged as one aggregate ``refused`` entry
(with ``suppressed``) when an attempt closes or aborts (docs/audit-log.md).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from fedsec.aggregator.audit_trail import AuditTrail
from fedsec.aggregator.optimizers import ServerOptimizer, make_optimizer
from fedsec.aggregator.workspace import Workspace
from fedsec.crypto.quantize import default_ring_bits, dequantize_one, unpack
from fedsec.crypto.secagg import (
    MaskedInput,
    ServerSession,
    ShareRelay,
    default_neighbors,
)
from fedsec.crypto.secagg.graph import default_threshold
from fedsec.errors import (
    BadVector,
    DuplicateMessage,
    FedsecError,
    NotFound,
    PayloadError,
    ProtocolError,
    RecoveryImpossible,
    RoundAborted,
    StaleUpdate,
    TaskMismatch,
    UnknownMember,
    WrongStage,
)
from fedsec.faults import AGGREGATOR_ENV, crash_point
from fedsec.modelfile import ModelManifest, decode_model, encode_model
from fedsec.protocol import codec, wire
from fedsec.protocol.limits import MAX_ID, MAX_MODEL_BYTES
from fedsec.protocol.replay import feed_accepted
from fedsec.protocol.stages import ACTIVE_STAGES, SECAGG_STAGES, stage_index
from fedsec.tasks import get_task
from fedsec.tasks.evaluation import evaluate
from fedsec.tasks.params import arrays_to_state, flatten_params, load_flat_params, state_to_arrays

log = logging.getLogger(__name__)

# `refused` entries written one by one per (member, round, attempt).  An honest agent meets
# few refusals in an attempt: its client never retries a 4xx answer and an identical resend
# is not logged again, so 4 covers the distinct ones it can meet (too early or too late for
# the stage, a different resend after a local crash, a bad vector from a bug).  A hostile
# member then adds at most 4 + 1 (the aggregate entry) per attempt of which it is in the
# cohort: about its honest footprint there (advertise, share_keys, privacy_report,
# masked_input and unmask entries), not one entry per request.
REFUSED_ENTRIES_PER_ATTEMPT = 4


@dataclass
class _Live:
    """In-memory view of the round attempt in progress (rebuilt from SQLite on resume)."""

    round: int
    attempt: int
    stage: str
    opened_at: float
    stage_started_at: float
    spec: wire.RoundSpec | None = None
    session: ServerSession | None = None
    relays: dict[str, ShareRelay] | None = None
    plain_sum: np.ndarray | None = None  # secure_sum = "none": Σ w·Δ in float64
    plain_weight: float = 0.0
    plain_members: list[str] | None = None
    plan: wire.RoundSpec | None = None  # buffered mode: what members train by before joining
    # SecAgg+: the key list every live member fetches, built once (fixed from share_keys on)
    key_list: wire.KeyListBody | None = None


_RefusalKey = tuple[str, int, int]  # (member, round, attempt)


@dataclass
class _MemberRefusals:
    """One member's refused masked inputs in one attempt: what the log holds of them."""

    logged: set[tuple[str, str, str]] = field(default_factory=set)  # (sha256, code, detail)
    unlogged: dict[str, int] = field(default_factory=dict)  # code -> refusals not yet logged
    last: dict[str, Any] | None = None  # body of the latest of those
    aggregated: bool = False  # its aggregate entry is in the log: nothing more goes there


class _RefusalBudget:
    """Which refused masked inputs get a ``refused`` entry of their own; counts the rest
    for one aggregate entry per member and attempt.  Does no I/O: the coordinator writes
    the entries and reports back which it wrote."""

    def __init__(self) -> None:
        self._books: dict[_RefusalKey, _MemberRefusals] = {}
        self._pending: set[_RefusalKey] = set()  # keys with unlogged refusals

    def load(self, body: dict[str, Any]) -> None:
        """Count a ``refused`` entry already in the log (at start-up)."""
        key = (str(body["member"]), int(body["round"]), int(body["attempt"]))
        book = self._books.setdefault(key, _MemberRefusals())
        if "suppressed" in body:
            book.aggregated = True
        else:
            book.logged.add(_refusal_identity(body))

    def admit(self, key: _RefusalKey, body: dict[str, Any]) -> str | None:
        """Decide on one refusal of a cohort member for an attempt that exists.

        Returns:
            None when ``body`` is to be logged as an entry of its own (then call
            :meth:`logged`); otherwise why not (``repeat``, ``over_cap``: counted for
            the aggregate entry; ``aggregated``: that entry is written, not counted).
        """
        book = self._books.setdefault(key, _MemberRefusals())
        if book.aggregated:
            return "aggregated"
        if _refusal_identity(body) in book.logged:
            reason = "repeat"
        elif len(book.logged) < REFUSED_ENTRIES_PER_ATTEMPT:
            return None
        else:
            reason = "over_cap"
        book.unlogged[body["code"]] = book.unlogged.get(body["code"], 0) + 1
        book.last = body
        self._pending.add(key)
        return reason

    def logged(self, key: _RefusalKey, body: dict[str, Any]) -> None:
        self._books[key].logged.add(_refusal_identity(body))

    def due(self) -> list[tuple[_RefusalKey, dict[str, Any]]]:
        """The aggregate entry body of every member and attempt with unlogged refusals:
        the latest of them, with ``suppressed`` (how many) and ``codes`` (how many each)."""
        due = []
        for key in sorted(self._pending):
            book = self._books[key]
            assert book.last is not None
            counts = dict(sorted(book.unlogged.items()))
            due.append((key, {**book.last, "suppressed": sum(counts.values()), "codes": counts}))
        return due

    def aggregated(self, keys: list[_RefusalKey]) -> None:
        """Their aggregate entries are committed."""
        for key in keys:
            book = self._books[key]
            book.aggregated, book.last = True, None
            book.unlogged.clear()
            self._pending.discard(key)


def _refusal_identity(body: dict[str, Any]) -> tuple[str, str, str]:
    """What makes two refusals the same entry: the bytes refused, and how."""
    return str(body["sha256"]), str(body["code"]), str(body["detail"])


class Coordinator:
    """Drives rounds for one federation workspace.

    Args:
        workspace: the opened workspace.
        clock: time source (tests pass a fake one).
        on_change: called whenever something an agent may be waiting for changed.
    """

    def __init__(
        self,
        workspace: Workspace,
        clock: Callable[[], float] = time.time,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.ws = workspace
        self.cfg = workspace.config
        self.clock = clock
        self.on_change = on_change
        # Agents long-poll "until the token differs from the one I saw".  A restarted
        # aggregator must not hand out tokens its predecessor used, or an agent holding
        # one would sleep through the resumed round; a random start (below 2^53, exact
        # in JSON) makes a repeat across restarts vanishingly unlikely.
        self.token = secrets.randbits(52) + 1
        self._closed_rounds: int | None = None
        fed = self.cfg.federation
        self.task = get_task(fed.task, **fed.task_options)
        self.model = self.task.build_model(seed=0)
        self.dim = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        self._validation = self._load_validation()
        self.optimizer: ServerOptimizer = make_optimizer(self.cfg.server, self.dim, workspace.state)
        self.trail = AuditTrail(
            workspace.root, workspace.state, workspace.signer, fed.id, clock=clock
        )
        self.trail.genesis(
            {
                "federation_id": fed.id,
                "aggregator_public_key": workspace.signer.public_bytes.hex(),
                "admin_public_key": workspace.admin_public.hex(),
                "task": self.task.name,
                "task_version": self.task.version,
                "schema_fingerprint": self.task.schema.fingerprint(),
                "server": msgspec.to_builtins(self.cfg.server),
                "round": msgspec.to_builtins(self.cfg.round),
            }
        )
        self.trail.sync_roster(workspace.roster)
        in_progress = workspace.state.latest_round()
        self.trail.sync_models(
            workspace.models,
            defer_round=(
                in_progress.round
                if in_progress is not None and in_progress.stage not in ("closed", "aborted")
                else None
            ),
        )
        self._roster_serial = workspace.roster.serial
        self.alerts: list[str] = []
        self._report_model_problems()
        # (round, attempt) -> [bytes received, bytes sent], counted by the HTTP layer
        self.traffic: dict[tuple[int, int], list[int]] = {}
        self._refusals = _RefusalBudget()
        self._load_refusals()
        self.live: _Live = self.resume()

    # -- helpers -----------------------------------------------------------------------------

    def alert(self, detail: str) -> None:
        """Raise an operator alert: kept for the dashboard and written to the log."""
        log.warning("event=alert detail=%r", detail)
        self.alerts.append(detail)
        self.trail.append("alert", {"detail": detail, "time": self.clock()})

    def _report_model_problems(self) -> None:
        latest = self.ws.models.latest()
        for problem in self.ws.models.problems():
            self.alert(
                f"model version {problem.version} is unusable ({problem.reason}); "
                f"serving the last good version {latest.version}"
            )

    def _changed(self) -> None:
        self.token += 1
        if self.on_change is not None:
            self.on_change()

    def _load_validation(self) -> tuple[np.ndarray, np.ndarray] | None:
        if not self.cfg.validation.enabled or self.task.name == "csv":
            return None
        data = self.task.load(seed=0)
        return data.x_test, data.y_test

    @property
    def rounds_completed(self) -> int:
        if self._closed_rounds is None:  # counted once, then kept up to date by _apply
            self._closed_rounds = self.ws.state.count_closed_rounds()
        return self._closed_rounds

    @property
    def finished(self) -> bool:
        target = self.cfg.round.rounds
        return target > 0 and self.rounds_completed >= target

    def _expect(self, member: str, round_: int, attempt: int, stage: str) -> _Live:
        live = self.live
        if (round_, attempt) != (live.round, live.attempt):
            raise WrongStage(
                f"{member}: message for round {round_} attempt {attempt}, but the current "
                f"round is {live.round} attempt {live.attempt} (stage {live.stage})"
            )
        if live.stage != stage:
            raise WrongStage(
                f"{member}: {stage} message refused: round {live.round} is in stage {live.stage}"
            )
        return live

    def _in_cohort(self, live: _Live, member: str) -> wire.RoundSpec:
        assert live.spec is not None
        if member not in live.spec.cohort:
            raise UnknownMember(f"{member} is not in the cohort of round {live.round}")
        return live.spec

    def _accepted_before(
        self, member: str, round_: int, attempt: int, stage: str, body: bytes
    ) -> bool:
        """True when this exact message was already durably accepted for that attempt,
        whatever the stage is now: the member's retry after an answer lost to a crash
        (the message that moved the round on, e.g. the last advertise, was stored, then
        the aggregator died before answering) gets the same answer, not wrong_stage."""
        return self.ws.state.message(round_, attempt, stage, member) == body

    def _idempotent(self, live: _Live, stage: str, member: str, body: bytes) -> bool:
        """True when this exact message was already accepted; refuse a different one."""
        stored = self.ws.state.message(live.round, live.attempt, stage, member)
        if stored is None:
            return False
        if stored == body:
            return True
        raise DuplicateMessage(f"{member} already sent a different {stage} message this round")

    # -- state queries -----------------------------------------------------------------------

    def count_traffic(self, key: tuple[int, int], received: int, sent: int) -> None:
        """Add one request's body sizes to the attempt that was current when it arrived."""
        counts = self.traffic.setdefault(key, [0, 0])
        counts[0] += received
        counts[1] += sent

    def round_state(self) -> wire.RoundState:
        live = self.live
        return wire.RoundState(
            federation_id=self.ws.federation_id,
            round=live.round,
            attempt=live.attempt,
            stage=live.stage,  # type: ignore[arg-type]
            token=self.token,
            model_version=self.ws.models.latest().version,
            rounds_completed=self.rounds_completed,
            rounds_target=self.cfg.round.rounds,
            finished=self.finished,
            spec=live.spec,
            mode=self.cfg.round.mode,
            plan=live.plan,
            roster_serial=self.ws.roster.serial,
        )

    # -- open: join ----------------------------------------------------------------------------

    def join(
        self, member: str, round_: int, attempt: int, req: wire.JoinRequest
    ) -> wire.JoinResponse:
        """A member asks to be in this round's cohort."""
        if self.finished:
            raise WrongStage(f"the federation finished its {self.cfg.round.rounds} rounds")
        live = self._expect(member, round_, attempt, "open")
        if req.task_version != self.task.version:
            raise TaskMismatch(
                f"{member} runs task {self.task.name} version {req.task_version}, the federation "
                f"requires version {self.task.version}"
            )
        if req.dataset_schema != self.task.schema.fingerprint():
            raise TaskMismatch(
                f"{member}'s data schema {req.dataset_schema[:16]}… differs from the federation's "
                f"{self.task.schema.fingerprint()[:16]}… (features or classes differ)"
            )
        if req.samples < 1:
            raise PayloadError(f"{member} reports {req.samples} samples; need at least 1")
        if self.buffered:
            self._check_staleness(member, req.base_version)
        joins = self.ws.state.joins(live.round, live.attempt)
        if member in joins:
            return wire.JoinResponse(accepted=True, detail="already joined")
        if len(joins) >= self.cohort_cap:
            return wire.JoinResponse(accepted=False, detail="cohort is full; try the next round")
        self.ws.state.add_join(
            live.round, live.attempt, member, req.samples, self.clock(), req.base_version
        )
        # No _changed(): a join alters nothing a waiting agent reads, and waking every
        # earlier joiner on each join costs O(n²) long-poll answers per round.  Fixing
        # the cohort (when this join completes it) announces itself.
        self._maybe_fix_cohort(live, self.clock())
        return wire.JoinResponse(accepted=True, detail="joined")

    @property
    def buffered(self) -> bool:
        return self.cfg.round.mode == "buffered"

    @property
    def cohort_cap(self) -> int:
        """Members per cohort: max_agents, or the buffer size K in buffered mode."""
        r = self.cfg.round
        return min(r.max_agents, r.buffer_size) if self.buffered else r.max_agents

    def _check_staleness(self, member: str, base: int | None) -> None:
        """Buffered mode: τ = current version − base version must be within max_staleness.

        Raises:
            PayloadError: no base version, or one from the future.
            StaleUpdate: τ > max_staleness (409).
        """
        current = self.ws.models.latest().version
        if base is None or base > current or base < 1:
            raise PayloadError(
                f"{member}: buffered rounds need the model version the update was trained on "
                f"(1..{current}), got {base}"
            )
        tau = current - base
        if tau > self.cfg.round.max_staleness:
            raise StaleUpdate(
                f"{member}'s update was trained on version {base}, {tau} versions behind the "
                f"current {current}; the federation accepts at most "
                f"{self.cfg.round.max_staleness}: train on the newest model"
            )

    def _fix_cohort(self, live: _Live, joins: dict[str, int], now: float) -> None:
        cohort = sorted(list(joins)[: self.cohort_cap])  # the first to join, by arrival
        staleness: dict[str, int] = {}
        if self.buffered:
            current = self.ws.models.latest().version
            bases = self.ws.state.join_bases(live.round, live.attempt)
            staleness = {m: current - (bases.get(m) or current) for m in cohort}
        spec = self._build_spec(live, cohort, staleness)
        self._commit_spec(live, spec, now)

    def _build_spec(
        self, live: _Live, cohort: list[str], staleness: dict[str, int]
    ) -> wire.RoundSpec:
        """The signed spec of this attempt (with an empty cohort: the buffered-mode plan)."""
        cfg = self.cfg.round
        n = len(cohort)
        secure = cfg.secure_sum == "secagg" and n >= 3
        if secure:
            auto_k, auto_t = default_neighbors(n)
            k = min(cfg.neighbors, n - 1) if cfg.neighbors else auto_k
            t = (
                min(cfg.threshold, k)
                if cfg.threshold
                else (auto_t if not cfg.neighbors else default_threshold(k))
            )
        else:
            k, t = 0, 0
        ring_bits = default_ring_bits(cfg.quant_bits, max(n, 1))
        manifest = self.ws.models.latest()
        caps = {}
        for m in cohort:
            entry = self.ws.roster.get(m)
            if entry is not None and entry.max_weight is not None:
                caps[m] = float(entry.max_weight)
        return wire.RoundSpec(
            federation_id=self.ws.federation_id,
            round=live.round,
            attempt=live.attempt,
            secure_sum=cfg.secure_sum,
            model_version=manifest.version,
            model_sha256=manifest.sha256,
            task=self.task.name,
            task_version=self.task.version,
            schema_fingerprint=self.task.schema.fingerprint(),
            cohort=cohort,
            neighbors=k,
            threshold=t,
            quant_bits=cfg.quant_bits,
            ring_bits=ring_bits,
            clip_norm=cfg.clip_norm,
            dim=self.dim,
            seed=os.urandom(32).hex(),
            max_weight_samples=cfg.max_weight_samples,
            weight_caps=caps,
            training=wire.TrainingSpec(
                local_epochs=self.cfg.training.local_epochs,
                batch_size=self.cfg.training.batch_size,
                lr=self.cfg.training.lr,
                optimizer=self.cfg.training.optimizer,
            ),
            dp=wire.DPSpec(
                enabled=self.cfg.dp.enabled,
                noise_multiplier=self.cfg.dp.noise_multiplier,
                max_grad_norm=self.cfg.dp.max_grad_norm,
                delta=self.cfg.dp.delta,
            ),
            deadlines={
                "train_s": cfg.open_s,
                "advertise_s": cfg.advertise_s,
                "share_keys_s": cfg.share_s,
                "masked_input_s": cfg.masked_s,
                "unmask_s": cfg.unmask_s,
            },
            mode=cfg.mode,
            staleness=staleness,
        ).sign(self.ws.signer)

    def _commit_spec(self, live: _Live, spec: wire.RoundSpec, now: float) -> None:
        first = "advertise" if spec.secure_sum == "secagg" else "masked_input"
        self.trail.sync_roster(self.ws.roster)
        self.trail.sync_models(self.ws.models)
        with self.ws.state.transaction():
            self.ws.state.set_stage(live.round, live.attempt, first, now, spec=wire.encode(spec))
            self.trail.append("round_spec", msgspec.to_builtins(spec))
        self._install_spec(live, spec)
        live.stage, live.stage_started_at = first, now
        crash_point(live.round, first, AGGREGATOR_ENV)
        log.info(
            "event=cohort_fixed round=%d attempt=%d members=%d k=%d t=%d secure_sum=%s mode=%s",
            live.round,
            live.attempt,
            len(spec.cohort),
            spec.neighbors,
            spec.threshold,
            spec.secure_sum,
            spec.mode,
        )
        self._changed()

    def _install_spec(self, live: _Live, spec: wire.RoundSpec) -> None:
        live.spec = spec
        if spec.secure_sum == "secagg":
            live.session = ServerSession(spec.secagg_params(), self._roster_keys(spec.cohort))
        else:
            live.plain_sum = np.zeros(spec.dim, dtype=np.float64)
            live.plain_weight = 0.0
            live.plain_members = []

    def _roster_keys(self, cohort: list[str]) -> dict[str, bytes]:
        keys = {}
        for member in cohort:
            entry = self.ws.roster.get(member)
            if entry is not None:
                keys[member] = entry.public_key_bytes
        return keys

    # -- privacy report ------------------------------------------------------------------------

    def report(self, member: str, round_: int, attempt: int, report: wire.PrivacyReport) -> None:
        """Record a member's signed privacy report for this round (any stage after open)."""
        body = self._checked_report(member, round_, attempt, report)
        if body is not None:
            self._store_report(report, body)

    def _checked_report(
        self, member: str, round_: int, attempt: int, report: wire.PrivacyReport
    ) -> bytes | None:
        """Validate a privacy report without changing anything; return its encoding, or
        None when the same report is already stored.

        Raises:
            WrongStage, UnknownMember, PayloadError, SignatureError: as for ``report``.
            DuplicateMessage: a different report is stored for this attempt.
        """
        live = self.live
        if (round_, attempt) != (live.round, live.attempt) or live.spec is None:
            raise WrongStage(f"{member}: privacy report for a round that is not in progress")
        self._in_cohort(live, member)
        if (report.member, report.round, report.attempt, report.federation_id) != (
            member,
            round_,
            attempt,
            self.ws.federation_id,
        ):
            raise PayloadError(
                f"{member}: privacy report names another member, round or federation"
            )
        if not (math.isfinite(report.epsilon) and report.epsilon >= 0):
            raise PayloadError(f"{member}: privacy report epsilon must be a finite number >= 0")
        entry = self.ws.roster.get(member)
        assert entry is not None
        report.verify(entry.public_key_bytes)
        body = wire.encode(report)
        stored = self.ws.state.report(round_, attempt, member)
        if stored is not None:
            if stored == body:
                return None
            raise DuplicateMessage(f"{member} already reported a different epsilon this round")
        return body

    def _store_report(self, report: wire.PrivacyReport, body: bytes) -> None:
        with self.ws.state.transaction():
            self.ws.state.add_report(
                report.round, report.attempt, report.member, report.epsilon, body
            )
            self.trail.append("privacy_report", msgspec.to_builtins(report))

    # -- SecAgg+ stages ------------------------------------------------------------------------

    def advertise(
        self, member: str, round_: int, attempt: int, body: wire.AdvertiseKeysBody
    ) -> None:
        self._accept(member, round_, attempt, "advertise", wire.encode(body))

    def _accept(self, member: str, round_: int, attempt: int, stage: str, raw: bytes) -> None:
        """Accept one SecAgg+ control message (its JSON body): an identical retry gets the
        same answer, even after a restart moved the round on; anything else is validated
        by the session, stored, archived and logged; the stage closes once complete."""
        if self._accepted_before(member, round_, attempt, stage, raw):
            return
        live = self._expect(member, round_, attempt, stage)
        self._in_cohort(live, member)
        if self._idempotent(live, stage, member, raw):
            return
        assert live.session is not None
        feed_accepted(live.session, stage, member, raw)
        self._record(live, stage, member, raw)
        if self._stage_complete(live):
            self._close_stage(self.clock())

    def _record(self, live: _Live, stage: str, member: str, raw: bytes, **extra: Any) -> int:
        """Store an accepted message, archive it and log it, in one transaction; return
        the log index of its entry."""
        digest = self.trail.keep(raw)
        with self.ws.state.transaction():
            self.ws.state.add_message(live.round, live.attempt, stage, member, raw)
            entry = self.trail.append(
                "accepted",
                {
                    "round": live.round,
                    "attempt": live.attempt,
                    "stage": stage,
                    "member": member,
                    "sha256": digest,
                    "bytes": len(raw),
                    **extra,
                },
            )
        self._after_message(live, stage)
        return entry.index

    def _after_message(self, live: _Live, stage: str) -> None:
        if os.environ.get(AGGREGATOR_ENV):  # chaos tests only: off the hot path otherwise
            count = self.ws.state.count_messages(live.round, live.attempt, stage)
            crash_point(live.round, f"{stage}:{count}", AGGREGATOR_ENV)

    def key_list(self, member: str, round_: int, attempt: int) -> wire.KeyListBody:
        live = self._expect_at_least(member, round_, attempt, "share_keys")
        assert live.session is not None
        if member not in live.session.live:
            raise UnknownMember(f"{member} is not a live member of round {live.round}")
        if live.key_list is None:
            live.key_list = codec.key_list_body(
                a for m, a in sorted(live.session.advertised.items()) if m in live.session.live
            )
        return live.key_list

    def share_keys(self, member: str, round_: int, attempt: int, body: wire.ShareKeysBody) -> None:
        """Accept a member's shares and, when they carry one, its privacy report.

        The report is checked first and stored only once the shares are accepted, so a
        refusal of either changes nothing.  The shares are stored without the report.
        """
        raw = wire.encode(wire.ShareKeysBody(shares=body.shares))
        report = body.report
        checked = None
        try:
            if report is not None:
                checked = self._checked_report(member, round_, attempt, report)
        except WrongStage:
            # the attempt is over: _accept answers an identical retry (its report came
            # with the first try) and refuses anything else with the same error
            pass
        except DuplicateMessage:
            # a different report came first (separately): it stands, as it would for a
            # second POST /report; the shares are not refused for it
            log.warning(
                "event=report_kept round=%d attempt=%d member=%s reason=differs_from_stored",
                round_,
                attempt,
                member,
            )
        self._accept(member, round_, attempt, "share_keys", raw)
        if report is not None and checked is not None:
            self._store_report(report, checked)

    def share_relay(self, member: str, round_: int, attempt: int) -> wire.ShareRelayBody:
        live = self._expect_at_least(member, round_, attempt, "masked_input")
        if live.relays is None or member not in live.relays:
            raise UnknownMember(f"{member} is not a participant of round {live.round}")
        return codec.share_relay_body(live.relays[member])

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
        are logged too, within bounds (:meth:`_log_refusal`).
        """
        try:
            return self._masked_input(member, round_, attempt, raw, commitment, signature)
        except FedsecError as exc:
            self._log_refusal(member, round_, attempt, raw, exc)
            raise

    def _masked_input(
        self, member: str, round_: int, attempt: int, raw: bytes, commitment: str, signature: str
    ) -> wire.Receipt:
        if self._accepted_before(member, round_, attempt, "masked_input", raw):
            return self.receipt(member, round_)
        live = self._expect(member, round_, attempt, "masked_input")
        spec = self._in_cohort(live, member)
        if self._idempotent(live, "masked_input", member, raw):
            return self.receipt(member, round_)
        digest = hashlib.sha256(raw).hexdigest()
        statement = wire.ContributionStatement(
            federation_id=self.ws.federation_id,
            round=round_,
            attempt=attempt,
            member=member,
            vector_sha256=digest,
            commitment=commitment,
            signature=signature,
        )
        entry = self.ws.roster.get(member)
        assert entry is not None
        statement.verify(entry.public_key_bytes)
        if live.session is not None:
            live.session.receive_masked_input(MaskedInput(member, raw))
        else:
            self._add_plain(live, spec, member, raw)
        archived = self.trail.keep(raw)
        with self.ws.state.transaction():
            self.ws.state.add_message(live.round, live.attempt, "masked_input", member, raw)
            logged = self.trail.append(
                "accepted",
                {
                    "round": live.round,
                    "attempt": live.attempt,
                    "stage": "masked_input",
                    "member": member,
                    "sha256": archived,
                    "bytes": len(raw),
                    "commitment": commitment,
                    "signature": signature,
                },
            )
            receipt = wire.Receipt(
                federation_id=self.ws.federation_id,
                round=live.round,
                attempt=live.attempt,
                member=member,
                contribution_sha256=digest,
                log_index=logged.index,
                issued_at=self.clock(),
            ).sign(self.ws.signer)
            self.ws.state.add_receipt(live.round, live.attempt, member, wire.encode(receipt))
        self._after_message(live, "masked_input")
        expected = live.session.participants if live.session is not None else spec.cohort
        done = live.session.contributed if live.session is not None else live.plain_members or []
        if len(done) == len(expected):
            self._close_stage(self.clock())
        return receipt

    def _add_plain(self, live: _Live, spec: wire.RoundSpec, member: str, raw: bytes) -> None:
        assert live.plain_members is not None and live.plain_sum is not None
        if member in live.plain_members:
            raise DuplicateMessage(f"{member} already sent its update")
        quant = spec.quant_spec()
        vector = unpack(raw, spec.dim + 1, spec.ring_bits)
        if int(vector.max(initial=0)) > quant.levels:
            raise BadVector(f"{member}'s update has values above {quant.levels} levels")
        update, weight = dequantize_one(vector, quant)
        live.plain_sum += update
        live.plain_weight += weight
        live.plain_members.append(member)

    # -- refusals ------------------------------------------------------------------------------

    def _load_refusals(self) -> None:
        """Rebuild the refusal budget from the log, so a restart grants no new entries."""
        for _, line in self.ws.state.log_lines():
            # canonical JSON: the kind appears exactly so; decode only those lines
            if b'"kind":"refused"' in line:
                doc = msgspec.json.decode(line)
                if doc["kind"] == "refused":
                    self._refusals.load(doc["body"])

    def _log_refusal(
        self, member: str, round_: int, attempt: int, raw: bytes, exc: FedsecError
    ) -> None:
        """Write a ``refused`` entry for a refused masked input, unless it is for an
        attempt that does not exist or has no cohort, from outside the cohort, an
        identical repeat, over :data:`REFUSED_ENTRIES_PER_ATTEMPT`, or after the member's
        aggregate entry for the attempt; those go to the process log only (repeats and
        those over the cap are also counted for the aggregate entry)."""
        key = (member, round_, attempt)
        body = {
            "round": round_,
            "attempt": attempt,
            "stage": "masked_input",
            "member": member,
            "sha256": hashlib.sha256(raw).hexdigest(),
            "code": exc.code,
            "detail": exc.detail,
        }
        reason = self._unloggable(member, round_, attempt)
        if reason is None:
            reason = self._refusals.admit(key, body)
        if reason is None:
            self.trail.append("refused", body)
            self._refusals.logged(key, body)
            return
        log.info(
            "event=refusal_not_logged round=%d attempt=%d member=%s code=%s sha256=%s reason=%s",
            round_,
            attempt,
            member,
            exc.code,
            body["sha256"],
            reason,
        )

    def _unloggable(self, member: str, round_: int, attempt: int) -> str | None:
        """Why a refusal for that attempt gets no entry whatever it is, or None."""
        live = self.live
        if (round_, attempt) == (live.round, live.attempt) and live.spec is not None:
            cohort = live.spec.cohort
        else:
            row = None
            # rounds exist from 1 to the live one; no stored attempt exceeds MAX_ID
            if 1 <= round_ <= live.round and 0 <= attempt <= MAX_ID:
                row = self.ws.state.get_round(round_, attempt)
            if row is None:
                return "no_such_attempt"
            if row.spec is None:
                return "no_cohort"
            cohort = msgspec.json.decode(row.spec, type=wire.RoundSpec).cohort
        return None if member in cohort else "not_in_cohort"

    def _log_unlogged_refusals(self) -> list[_RefusalKey]:
        """Inside a round close's transaction, before its head: one aggregate entry per
        member and attempt with refusals not logged one by one.  Returns their keys, for
        :meth:`_RefusalBudget.aggregated` once the transaction is committed."""
        due = self._refusals.due()
        for _, body in due:
            self.trail.append("refused", body)
        return [key for key, _ in due]

    def unmask_request(self, member: str, round_: int, attempt: int) -> wire.UnmaskRequestBody:
        live = self._expect_at_least(member, round_, attempt, "unmask")
        assert live.session is not None
        if member not in live.session.survivors:
            raise UnknownMember(f"{member} is not a survivor of round {live.round}")
        return wire.UnmaskRequestBody(
            survivors=sorted(live.session.survivors),
            dropped=sorted(live.session.dropped),
            state_token=self.token,
        )

    def unmask(self, member: str, round_: int, attempt: int, body: wire.UnmaskResponseBody) -> bool:
        """Take a survivor's unmask answer; False when it came after the attempt closed
        without needing it (the other answers already decided the sum, see
        ``ServerSession.ready_to_finalize``): nothing is stored or logged then."""
        if self._closed_without(member, round_, attempt):
            log.info(
                "event=unmask_not_needed round=%d attempt=%d member=%s", round_, attempt, member
            )
            return False
        self._accept(member, round_, attempt, "unmask", wire.encode(body))
        return True

    def _closed_without(self, member: str, round_: int, attempt: int) -> bool:
        """True for the late unmask answer of a member whose masked input the attempt,
        now closed, summed without waiting for that answer."""
        live = self.live
        if (round_, attempt) == (live.round, live.attempt):
            return False
        state = self.ws.state
        row = state.get_round(round_, attempt)
        return (
            row is not None
            and row.stage == "closed"
            and state.message(round_, attempt, "masked_input", member) is not None
            and state.message(round_, attempt, "unmask", member) is None
        )

    def receipt(self, member: str, round_: int) -> wire.Receipt:
        stored = self.ws.state.receipt(round_, member)
        if stored is None:
            raise NotFound(f"no accepted contribution from {member} in round {round_}")
        return msgspec.json.decode(stored, type=wire.Receipt)

    def before_stage(self, round_: int, attempt: int, stage: str) -> bool:
        """True while attempt (round_, attempt) is in progress and has not yet reached
        ``stage``: what a request long-polling for that stage's data waits on.  False
        once it has, or once the attempt is over (aborted, closed, superseded)."""
        live = self.live
        if (round_, attempt) != (live.round, live.attempt) or live.stage not in ACTIVE_STAGES:
            return False
        return stage_index(live.stage) < stage_index(stage)

    def _expect_at_least(self, member: str, round_: int, attempt: int, stage: str) -> _Live:
        live = self.live
        if (round_, attempt) != (live.round, live.attempt):
            raise WrongStage(
                f"{member}: request for round {round_} attempt {attempt}, but the current round "
                f"is {live.round} attempt {live.attempt}"
            )
        if live.stage not in ACTIVE_STAGES or stage_index(live.stage) < stage_index(stage):
            raise WrongStage(f"{member}: round {live.round} has not reached stage {stage} yet")
        return live

    # -- deadlines and stage transitions -------------------------------------------------------

    def _deadline(self, live: _Live) -> float:
        r = self.cfg.round
        spent = {
            # Buffered members trained before joining; sync members train now, while
            # (SecAgg+) they advertise and share keys, so training time is part of the
            # masked-input stage in both modes.
            "advertise": r.advertise_s,
            "share_keys": r.share_s,
            "masked_input": r.masked_s + (0.0 if self.buffered else r.open_s),
            "unmask": r.unmask_s,
        }.get(live.stage, math.inf)
        return live.stage_started_at + spent

    def tick(self) -> None:
        """Close the current stage if its deadline passed (or, for open, the cohort is ready)."""
        if self.finished:
            return
        if self.ws.roster.serial != self._roster_serial:
            self._roster_serial = self.ws.roster.serial
            self.trail.sync_roster(self.ws.roster)
        now = self.clock()
        live = self.live
        if live.stage == "open":
            self._maybe_fix_cohort(live, now)
            return
        if now >= self._deadline(live) or self._stage_complete(live):
            self._close_stage(now)

    def _stage_complete(self, live: _Live) -> bool:
        """Everyone expected in this stage has answered (e.g. just before a restart), or,
        at unmask, enough of them to decide the sum."""
        session = live.session
        if session is None:
            spec = live.spec
            return (
                live.stage == "masked_input"
                and spec is not None
                and len(live.plain_members or []) == len(spec.cohort)
            )
        if live.stage == "advertise":
            return len(session.advertised) == len(session.params.cohort)
        if live.stage == "share_keys":
            return session.shared == session.live
        if live.stage == "masked_input":
            return len(session.contributed) == len(session.participants)
        if live.stage == "unmask":
            # every survivor answered, or the answers so far already decide the sum
            return session.answered == session.survivors or session.ready_to_finalize()
        return False

    def _maybe_fix_cohort(self, live: _Live, now: float) -> None:
        """Fix the cohort when every active member joined, the cohort is full, or the
        join window (``advertise_s``, counted from the ``min_agents``-th join) passed."""
        cfg = self.cfg.round
        joins = self.ws.state.joins(live.round, live.attempt)
        if len(joins) < cfg.min_agents:
            return
        active = {e.agent_id for e in self.ws.roster.active_agents()}
        quorum_at = self.ws.state.join_time(live.round, live.attempt, cfg.min_agents)
        if (
            len(joins) >= self.cohort_cap
            or active <= joins.keys()
            or now >= quorum_at + cfg.advertise_s
        ):
            self._fix_cohort(live, joins, now)

    def _close_stage(self, now: float) -> None:
        live = self.live
        try:
            if live.stage == "advertise":
                assert live.session is not None
                live.session.close_advertise()
                self._enter(live, "share_keys", now)
            elif live.stage == "share_keys":
                assert live.session is not None
                live.relays = live.session.close_share_keys()
                self._enter(live, "masked_input", now)
            elif live.stage == "masked_input":
                if live.session is not None:
                    live.session.close_masked_input()
                    self._enter(live, "unmask", now)
                else:
                    self._aggregate_plain(live, now)
            elif live.stage == "unmask":
                assert live.session is not None
                log.info(
                    "event=unmask_closed round=%d attempt=%d answered=%d survivors=%d",
                    live.round,
                    live.attempt,
                    len(live.session.answered),
                    len(live.session.survivors),
                )
                self._aggregate_secure(live, now)
        except (RoundAborted, RecoveryImpossible) as exc:
            self._abort(live, now, exc.detail)
        except ProtocolError as exc:
            if live.stage != "unmask":
                raise
            # A survivor's shares are off the polynomial or rebuild another mask key than it
            # advertised: the sum cannot be unmasked.  Abort (and retry) rather than leave
            # the round stuck for every later tick: one lying member must not wedge it.
            self._abort(live, now, f"round {live.round} aborted at unmask: {exc.detail}")

    def _enter(self, live: _Live, stage: str, now: float) -> None:
        self.ws.state.set_stage(live.round, live.attempt, stage, now)
        live.stage, live.stage_started_at = stage, now
        log.info("event=stage round=%d attempt=%d stage=%s", live.round, live.attempt, stage)
        crash_point(live.round, stage, AGGREGATOR_ENV)
        self._changed()

    def _abort(self, live: _Live, now: float, detail: str) -> None:
        log.warning(
            "event=round_aborted round=%d attempt=%d reason=%r", live.round, live.attempt, detail
        )
        summary = self._summary(live, "aborted", None, None, None, now, detail)
        with self.ws.state.transaction():
            self.ws.state.close_round(
                live.round,
                live.attempt,
                "aborted",
                now,
                model_version=None,
                summary=wire.encode(summary),
                detail=detail,
            )
            aggregated = self._log_unlogged_refusals()
            self.trail.append(
                "round_aborted", {"round": live.round, "attempt": live.attempt, "detail": detail}
            )
            self.trail.sign_head()
        self._refusals.aggregated(aggregated)
        self.alert(f"round {live.round} attempt {live.attempt} aborted: {detail}")
        self.live = self._open(live.round, live.attempt + 1, now)
        self._changed()

    # -- aggregation -----------------------------------------------------------------------------

    def _aggregate_secure(self, live: _Live, now: float) -> None:
        assert live.session is not None
        start = time.perf_counter()
        result = live.session.finalize()
        self._apply(
            live,
            result.weighted_sum,
            result.weight_sum,
            list(result.survivors),
            list(result.dropped),
            start,
            now,
            hashlib.sha256(result.ring_sum.tobytes()).hexdigest(),
        )

    def _aggregate_plain(self, live: _Live, now: float) -> None:
        assert live.spec is not None and live.plain_sum is not None
        members = live.plain_members or []
        dropped = sorted(set(live.spec.cohort) - set(members))
        if len(members) < self.cfg.round.min_agents:
            raise RoundAborted(
                f"round {live.round}: {len(members)} updates arrived, need "
                f"{self.cfg.round.min_agents}; missing: {dropped}"
            )
        start = time.perf_counter()
        total = live.plain_sum.astype("<f8")
        self._apply(
            live,
            live.plain_sum,
            live.plain_weight,
            sorted(members),
            dropped,
            start,
            now,
            hashlib.sha256(total.tobytes()).hexdigest(),
        )

    def _apply(
        self,
        live: _Live,
        weighted_sum: np.ndarray,
        weight_sum: float,
        survivors: list[str],
        dropped: list[str],
        start: float,
        now: float,
        sum_sha256: str,
    ) -> None:
        if weight_sum <= 0:
            raise RoundAborted(f"round {live.round}: the survivors' total weight is zero")
        mean = (weighted_sum / weight_sum).astype(np.float32)
        parent = self._parent_model(live.round)
        arrays = decode_model(self.ws.models.read(parent.version), max_bytes=MAX_MODEL_BYTES)
        arrays_to_state(self.model, arrays)
        current = flatten_params(self.model)
        load_flat_params(self.model, self.optimizer.step(current, mean))
        metrics: dict[str, float] = {}
        if self._validation is not None:
            acc, loss = evaluate(self.model, *self._validation)
            metrics = {"accuracy": acc, "loss": loss}
        arrays_out = state_to_arrays(self.model)
        manifest = self._written_before(
            arrays_out, parent.version, live.round
        ) or self.ws.models.put(
            arrays_out,
            parent=parent.version,
            round=live.round,
            kind="aggregate",
            metrics=metrics,
        )
        crash_point(live.round, "model_write", AGGREGATOR_ENV)
        aggregation_s = time.perf_counter() - start
        summary = self._summary(
            live,
            "closed",
            manifest.version,
            metrics,
            aggregation_s,
            now,
            "",
            survivors=len(survivors),
            dropped=dropped,
        )
        with self.ws.state.transaction():
            self.optimizer.save()
            self.ws.state.close_round(
                live.round,
                live.attempt,
                "closed",
                now,
                model_version=manifest.version,
                summary=wire.encode(summary),
                detail="",
            )
            aggregated = self._log_unlogged_refusals()
            self.trail.append(
                "aggregate",
                {
                    "round": live.round,
                    "attempt": live.attempt,
                    "survivors": survivors,
                    "dropped": dropped,
                    "sum_sha256": sum_sha256,
                    "weight_sum": weight_sum,
                    "parent_version": parent.version,
                    "optimizer": self.cfg.server.optimizer,
                    "server_lr": self.cfg.server.server_lr,
                },
            )
            self.trail.sync_models(self.ws.models)
            self.trail.prune_archive(self.cfg.audit.archive_retention_rounds)
            self.trail.sign_head()
        self._refusals.aggregated(aggregated)
        self._closed_rounds = None  # one more closed round: recount on next use
        log.info(
            "event=round_closed round=%d attempt=%d survivors=%d dropped=%s version=%d "
            "accuracy=%s aggregation_s=%.4f",
            live.round,
            live.attempt,
            len(survivors),
            dropped,
            manifest.version,
            metrics.get("accuracy"),
            aggregation_s,
        )
        self.live = self._open(live.round + 1, 0, now)
        self._changed()

    def _parent_model(self, round_: int) -> ModelManifest:
        """The version this round's aggregate applies to: the newest one, unless that is
        this round's own aggregate, written by an incarnation that died before recording
        the round as closed (applying the mean to it again would count the round twice)."""
        latest = self.ws.models.latest()
        if latest.kind == "aggregate" and latest.round == round_ and latest.parent is not None:
            return self.ws.models.get(latest.parent)
        return latest

    def _written_before(
        self, arrays: dict[str, np.ndarray], parent: int, round_: int
    ) -> ModelManifest | None:
        """The version a previous incarnation already wrote for this round, if it crashed
        after writing the model but before recording the round as closed."""
        versions = self.ws.models.versions_on_disk()
        if not versions:
            return None
        try:
            newest = self.ws.models.get(versions[-1])
        except FedsecError:
            return None
        if newest.kind != "aggregate" or newest.parent != parent or newest.round != round_:
            return None
        if newest.sha256 != hashlib.sha256(encode_model(arrays)).hexdigest():
            return None
        log.info("event=model_reused version=%d round=%d", newest.version, round_)
        return newest

    def _summary(
        self,
        live: _Live,
        stage: str,
        version: int | None,
        metrics: dict[str, float] | None,
        aggregation_s: float | None,
        now: float,
        detail: str,
        survivors: int = 0,
        dropped: list[str] | None = None,
    ) -> wire.RoundSummary:
        cohort = len(live.spec.cohort) if live.spec is not None else 0
        if live.session is not None:
            participants = len(live.session.participants)
        else:
            participants = len(live.plain_members or [])
        return wire.RoundSummary(
            round=live.round,
            attempt=live.attempt,
            stage=stage,  # type: ignore[arg-type]
            cohort=cohort,
            participants=participants,
            survivors=survivors,
            dropped=dropped or [],
            model_version=version,
            accuracy=(metrics or {}).get("accuracy"),
            loss=(metrics or {}).get("loss"),
            aggregation_s=aggregation_s,
            duration_s=now - live.opened_at,
            epsilon_max=self.ws.state.epsilon_max(live.round, live.attempt),
            detail=detail,
            bytes_up=self.traffic.get((live.round, live.attempt), [0, 0])[0],
            bytes_down=self.traffic.get((live.round, live.attempt), [0, 0])[1],
        )

    # -- opening and resuming --------------------------------------------------------------------

    def _open(self, round_: int, attempt: int, now: float) -> _Live:
        if not self.finished:
            with self.ws.state.transaction():
                self.ws.state.open_round(round_, attempt, now)
                self.trail.append("round_open", {"round": round_, "attempt": attempt})
            log.info("event=round_open round=%d attempt=%d", round_, attempt)
        live = _Live(round_, attempt, "open" if not self.finished else "closed", now, now)
        if self.buffered:
            live.plan = self._build_spec(live, [], {})
        return live

    def resume(self) -> _Live:
        """Rebuild the round in progress from the state store (or open the first one)."""
        now = self.clock()
        row = self.ws.state.latest_round()
        if row is None:
            return self._open(1, 0, now)
        if row.stage == "closed":
            return (
                self._open(row.round + 1, 0, now)
                if not self.finished
                else _Live(row.round, row.attempt, "closed", row.opened_at, row.stage_started_at)
            )
        if row.stage == "aborted":
            return self._open(row.round, row.attempt + 1, now)
        live = _Live(row.round, row.attempt, "open", row.opened_at, row.stage_started_at)
        if row.spec is None:
            return live
        spec = msgspec.json.decode(row.spec, type=wire.RoundSpec)
        self._install_spec(live, spec)
        reached = stage_index(row.stage)
        replay = SECAGG_STAGES if spec.secure_sum == "secagg" else ("masked_input",)
        for stage in replay:
            live.stage = stage
            for member, body in self.ws.state.messages(row.round, row.attempt, stage):
                self._replay(live, spec, stage, member, body)
            if stage_index(stage) >= reached:
                break
            if live.session is not None:
                if stage == "advertise":
                    live.session.close_advertise()
                elif stage == "share_keys":
                    live.relays = live.session.close_share_keys()
                elif stage == "masked_input":
                    live.session.close_masked_input()
        live.stage, live.stage_started_at = row.stage, row.stage_started_at
        log.info("event=resumed round=%d attempt=%d stage=%s", live.round, live.attempt, live.stage)
        return live

    def _replay(
        self, live: _Live, spec: wire.RoundSpec, stage: str, member: str, body: bytes
    ) -> None:
        try:
            if live.session is not None:
                feed_accepted(live.session, stage, member, body)
            elif stage == "masked_input":
                self._add_plain(live, spec, member, body)
        except FedsecError as exc:  # pragma: no cover - stored messages were accepted once
            raise ProtocolError(
                f"state database holds a {stage} message from {member} that no longer "
                f"verifies: {exc.detail}"
            ) from None
