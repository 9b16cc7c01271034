"""The life of a round attempt, as a stage table::

    open ──(cohort fixed, spec signed)──> <the summation's stages> ──(finalize, apply)──>
         closed ──> next round opens
    any stage ──(fewer than needed remain / secrets unrecoverable)──> aborted
         ──> same round, next attempt, opens without the lost members

======================  ==========================  ==========================================
stage                   complete when               on close
======================  ==========================  ==========================================
open                    :meth:`CohortDesk.ready`    spec signed, the summation's first stage
each summation stage    ``session.complete(stage)`` ``session.close(stage)``, its next stage
                        or its deadline             (the last: ``finalize``, apply, closed)
======================  ==========================  ==========================================

Each summation mode owns its stages and their deadlines (:mod:`fedsec.summation`):
SecAgg+ passes through advertise, share_keys, masked_input, consistency and unmask;
homomorphic summation through commit, masked_input and decrypt; a round without secure
summation through masked_input only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from fedsec.aggregator.groups.hosts import StoreGroupHosts, stored_traffic
from fedsec.aggregator.rounds.apply import ModelApplier, NewVersion
from fedsec.aggregator.rounds.attempt import Attempt
from fedsec.aggregator.rounds.cohort import CohortDesk
from fedsec.aggregator.rounds.context import RoundContext, log
from fedsec.aggregator.rounds.events import (
    CohortFixed,
    ContributionRefused,
    RoundEnded,
    RoundOpened,
    StageEntered,
)
from fedsec.aggregator.rounds.he_context import HeContextDesk
from fedsec.aggregator.rounds.reference import RootReference
from fedsec.aggregator.rounds.refusals import RefusalLog
from fedsec.aggregator.rounds.reports import privacy_reported
from fedsec.aggregator.rounds.resume import rebuild
from fedsec.errors import ProtocolError, RecoveryImpossible, RefusedByRule, RoundAborted
from fedsec.protocol import wire
from fedsec.protocol.codec_choice import codec_for
from fedsec.protocol.ddp import realised_noise_multiplier
from fedsec.protocol.log_entries import (
    AggregateEntry,
    GroupSumEntry,
    RoundAbortedEntry,
    RoundOpenEntry,
)
from fedsec.summation import (
    SessionInputs,
    StoredMessage,
    SummationResult,
    SummationSession,
    mode_of,
    open_session,
)


class Lifecycle:
    """Moves the attempt in progress through its stages; owns it (:attr:`live`).

    Args:
        ctx: the round engine's shared context.
        cohort: joins and specs.
        applier: model application.
        refusals: the refusal log, whose aggregate entries go with each close.
        he: the published CKKS context a homomorphic attempt sums under.
    """

    def __init__(
        self,
        ctx: RoundContext,
        cohort: CohortDesk,
        applier: ModelApplier,
        refusals: RefusalLog,
        he: HeContextDesk,
    ) -> None:
        self._ctx = ctx
        self._he = he
        self._cohort = cohort
        self._applier = applier
        self._refusals = refusals
        self._reference = RootReference(ctx)  # fltrust's, trained only when a round asks
        self._closed_rounds: int | None = None
        self.live: Attempt = Attempt(0, 0, "open", 0.0, 0.0)  # until resume()

    # -- progress ------------------------------------------------------------------------------

    @property
    def rounds_completed(self) -> int:
        if self._closed_rounds is None:  # counted once, then kept up to date at each close
            self._closed_rounds = self._ctx.ws.state.rounds.count_closed()
        return self._closed_rounds

    @property
    def finished(self) -> bool:
        target = self._ctx.cfg.round.rounds
        return target > 0 and self.rounds_completed >= target

    def deadline(self, live: Attempt) -> float:
        """When ``live``'s stage closes at the latest (its mode's window for the stage)."""
        if live.spec is None:
            return math.inf
        seconds = mode_of(live.spec).stage_seconds(
            live.stage, self._ctx.cfg.round, self._ctx.buffered
        )
        return live.stage_started_at + seconds

    def tick(self) -> None:
        """Close the current stage if its deadline passed (or, for open, the cohort is ready)."""
        now = self._ctx.clock()
        live = self.live
        if live.stage == "open":
            self.fix_cohort_if_ready(now)
            return
        if now >= self.deadline(live) or self.stage_complete(live):
            self.close_stage(now)

    def stage_complete(self, live: Attempt) -> bool:
        """Everyone expected in this stage has answered (e.g. just before a restart), or,
        at the last stage, enough of them to decide the sum."""
        session = live.summation
        return session is not None and session.complete(live.stage)

    def close_if_complete(self) -> None:
        """After an accepted message: close its stage once complete."""
        if self.stage_complete(self.live):
            self.close_stage(self._ctx.clock())

    # -- open: the cohort ----------------------------------------------------------------------

    def fix_cohort_if_ready(self, now: float) -> None:
        live = self.live
        if live.stage == "open" and self._cohort.ready(live, now):
            self._commit_spec(live, self._cohort.fixed_spec(live), now)

    def _commit_spec(self, live: Attempt, spec: wire.RoundSpec, now: float) -> None:
        ctx = self._ctx
        session = self._open_summation(spec)
        first = session.stages[0]
        ctx.trail.sync_roster(ctx.ws.roster)
        ctx.trail.sync_models(ctx.ws.models)
        with ctx.ws.state.transaction():
            ctx.ws.state.rounds.set_stage(
                live.round, live.attempt, first, now, spec=wire.encode(spec)
            )
            ctx.trail.append(spec)
        live.spec, live.summation = spec, session
        opened_for = now - live.stage_started_at
        live.stage, live.stage_started_at = first, now
        ctx.emit(CohortFixed(live.round, live.attempt, tuple(spec.cohort), now))
        ctx.emit(StageEntered(live.round, live.attempt, first, "open", opened_for, now))
        ctx.faults.crash(live.round, first)
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
        ctx.changed()

    def _open_summation(self, spec: wire.RoundSpec) -> SummationSession:
        members = [*spec.cohort, spec.custodian] if spec.custodian else spec.cohort
        inputs = SessionInputs(
            keys=self._cohort.roster_keys(members),
            min_agents=self._ctx.cfg.round.min_agents,
            he_context=self._he.public_context,
            he_context_sha256=self._he.sha256,
            max_json_bytes=self._ctx.cfg.server.max_json_bytes,
            reference=self._reference,
            shard_workers=self._ctx.cfg.round.shard_workers,
            stored=lambda stages: self._stored(spec, stages),
            # groups that group servers take: read from the store (round.group_servers)
            group_hosts=StoreGroupHosts(
                self._ctx.ws.state,
                spec.round,
                spec.attempt,
                keep=self._ctx.trail.keep_message,
                reported=lambda report: self._ctx.emit(privacy_reported(report)),
            ),
        )
        return open_session(spec, inputs)

    def _stored(self, spec: wire.RoundSpec, stages: Sequence[str]) -> list[StoredMessage]:
        """``spec``'s attempt's accepted messages of ``stages``, as the store holds them
        (a shard group's worker started again is rebuilt from them)."""
        store = self._ctx.ws.state.messages
        return [
            StoredMessage(stage, member, body)
            for stage in stages
            for member, body in store.of_stage(spec.round, spec.attempt, stage)
        ]

    # -- stage transitions ---------------------------------------------------------------------

    def close_stage(self, now: float) -> None:
        live = self.live
        session = live.summation
        assert session is not None
        following = session.next_stage(live.stage)
        try:
            if following is not None:
                session.close(live.stage)
                self._enter(live, following, now)
                return
            start = time.perf_counter()
            result = self._finalize(live, session)
            self._close(live, result, start, now)
        except (RoundAborted, RecoveryImpossible) as exc:
            self._abort(live, now, exc.detail, exc.code)

    @staticmethod
    def _finalize(live: Attempt, session: SummationSession) -> SummationResult:
        try:
            return session.finalize()
        except (RoundAborted, RecoveryImpossible):
            raise
        except ProtocolError as exc:
            # E.g. a survivor's shares are off the polynomial or rebuild another mask key
            # than it advertised: the sum cannot be computed.  Abort (and retry) rather
            # than leave the round stuck for every later tick: one lying member must not
            # wedge it.
            raise RoundAborted(
                f"round {live.round} aborted at {live.stage}: {exc.detail}"
            ) from None

    def _enter(self, live: Attempt, stage: str, now: float) -> None:
        self._ctx.ws.state.rounds.set_stage(live.round, live.attempt, stage, now)
        previous, lasted = live.stage, now - live.stage_started_at
        live.stage, live.stage_started_at = stage, now
        self._ctx.emit(StageEntered(live.round, live.attempt, stage, previous, lasted, now))
        log.info("event=stage round=%d attempt=%d stage=%s", live.round, live.attempt, stage)
        self._ctx.faults.crash(live.round, stage)
        self._ctx.changed()

    def _abort(self, live: Attempt, now: float, detail: str, reason: str) -> None:
        ctx = self._ctx
        log.warning(
            "event=round_aborted round=%d attempt=%d reason=%r", live.round, live.attempt, detail
        )
        summary = self._summary(live, "aborted", now, detail)
        refusals = self._refusals
        with ctx.ws.state.transaction():
            ctx.ws.state.rounds.close(
                live.round,
                live.attempt,
                "aborted",
                now,
                model_version=None,
                summary=wire.encode(summary),
                detail=detail,
            )
            aggregated = refusals.write_aggregates()
            ctx.trail.append(
                RoundAbortedEntry(round=live.round, attempt=live.attempt, detail=detail)
            )
            ctx.trail.sign_head()
        refusals.committed(aggregated)
        ctx.emit(RoundEnded(summary, live.stage, now - live.stage_started_at, reason, (), now))
        ctx.alert(
            "round_aborted",
            f"round {live.round}.{live.attempt}",
            f"round {live.round} attempt {live.attempt} aborted: {detail}",
        )
        self.live = self.open(live.round, live.attempt + 1, now)
        ctx.changed()

    # -- close: a new model version ------------------------------------------------------------

    def _close(self, live: Attempt, result: SummationResult, start: float, now: float) -> None:
        ctx = self._ctx
        if result.sealed is not None:
            assert result.parent_version is not None  # a sealed result names its parent
            new = self._applier.apply_sealed(live.round, result.sealed, result.parent_version)
        else:
            new = self._applier.apply(live.round, result.weighted_sum, result.weight_sum)
        aggregation_s = time.perf_counter() - start
        summary = self._summary(
            live,
            "closed",
            now,
            _refusal_summary(result),
            version=new.manifest.version,
            metrics=new.metrics,
            aggregation_s=aggregation_s,
            result=result,
        )
        refusals = self._refusals
        with ctx.ws.state.transaction():
            self._applier.save()
            ctx.ws.state.rounds.close(
                live.round,
                live.attempt,
                "closed",
                now,
                model_version=new.manifest.version,
                summary=wire.encode(summary),
                detail="",
            )
            refusals.rule_refused(live.round, live.attempt, result.refused)
            aggregated = refusals.write_aggregates()
            ctx.trail.append(self._aggregate_entry(live, result, new))
            ctx.trail.sync_models(ctx.ws.models)
            ctx.trail.prune_archive(ctx.cfg.audit.archive_retention_rounds)
            ctx.trail.sign_head()
        refusals.committed(aggregated)
        self._closed_rounds = None  # one more closed round: recount on next use
        for refusal in result.refused:
            ctx.emit(
                ContributionRefused(
                    live.round, live.attempt, refusal.member, RefusedByRule.code, now, True
                )
            )
        lasted = now - live.stage_started_at
        ctx.emit(RoundEnded(summary, live.stage, lasted, "", tuple(result.survivors), now))
        log.info(
            "event=round_closed round=%d attempt=%d survivors=%d dropped=%s version=%d "
            "%s=%s aggregation_s=%.4f",
            live.round,
            live.attempt,
            len(result.survivors),
            result.dropped,
            new.manifest.version,
            ctx.task.primary_metric,
            new.metrics.get(ctx.task.primary_metric),
            aggregation_s,
        )
        self.live = self.open(live.round + 1, 0, now)
        ctx.changed()

    def _aggregate_entry(
        self, live: Attempt, result: SummationResult, new: NewVersion
    ) -> AggregateEntry:
        """The log's ``aggregate`` entry: what was summed, from whom, applied to what."""
        server = self._ctx.cfg.server
        groups = live.spec.groups if live.spec is not None else []
        return AggregateEntry(
            round=live.round,
            attempt=live.attempt,
            survivors=result.survivors,
            dropped=result.dropped,
            sum_sha256=result.sum_sha256,
            weight_sum=result.weight_sum,
            parent_version=new.parent.version,
            optimizer=server.optimizer,
            server_lr=server.server_lr,
            noise_multiplier=realised_noise_multiplier(live.spec, len(result.survivors)),
            edge_count=result.edge_count,
            groups=[
                GroupSumEntry(group.members, list(part.survivors), part.sum_sha256)
                for group, part in zip(groups, result.groups, strict=True)
            ],
        )

    def _summary(
        self,
        live: Attempt,
        stage: str,
        now: float,
        detail: str,
        version: int | None = None,
        metrics: dict[str, float] | None = None,
        aggregation_s: float | None = None,
        result: SummationResult | None = None,
    ) -> wire.RoundSummary:
        session = live.summation
        up, down = self._traffic(live)
        noise = (
            realised_noise_multiplier(live.spec, len(result.survivors))
            if result is not None and live.spec is not None
            else 0.0
        )
        return wire.RoundSummary(
            round=live.round,
            attempt=live.attempt,
            stage=stage,  # type: ignore[arg-type]
            cohort=len(live.spec.cohort) if live.spec is not None else 0,
            participants=session.participant_count() if session is not None else 0,
            survivors=len(result.survivors) if result is not None else 0,
            # everyone of the cohort whose input is not in the sum, those lost before
            # they advertised included (the summation names only those it expected)
            dropped=(
                sorted(set(live.spec.cohort) - set(result.survivors))
                if result is not None and live.spec is not None
                else []
            ),
            model_version=version,
            accuracy=(metrics or {}).get("accuracy"),
            loss=(metrics or {}).get("loss"),
            primary_metric=self._ctx.task.primary_metric,
            higher_is_better=self._ctx.task.higher_is_better,
            metrics=dict(metrics or {}),
            aggregation_s=aggregation_s,
            duration_s=now - live.opened_at,
            epsilon_max=self._ctx.ws.state.reports.epsilon_max(live.round, live.attempt),
            detail=detail,
            bytes_up=up,
            bytes_down=down,
            refused={r.member: r.reason for r in result.refused} if result is not None else {},
            noise_multiplier=noise,
            coordinates=_wrappable_coordinates(live.spec, result),
            edge_count=result.edge_count if result is not None else 0,
        )

    def _traffic(self, live: Attempt) -> tuple[int, int]:
        """(bytes received, bytes sent) of the attempt's signed requests: those this
        process served and those its group servers stored (``round.group_servers``,
        and the servers the spec named if the list changed since)."""
        ctx = self._ctx
        up, down = ctx.traffic_of(live.round, live.attempt)
        urls = [u.rstrip("/") for u in ctx.cfg.round.group_servers]
        if live.spec is not None:
            urls += [g.url for g in live.spec.groups if g.url]
        if not urls:
            return up, down
        served_up, served_down = stored_traffic(ctx.ws.state, live.round, live.attempt, urls)
        return up + served_up, down + served_down

    # -- opening and resuming --------------------------------------------------------------------

    def open(self, round_: int, attempt: int, now: float) -> Attempt:
        ctx = self._ctx
        finished = self.finished
        if not finished:
            with ctx.ws.state.transaction():
                ctx.ws.state.rounds.open(round_, attempt, now)
                ctx.trail.append(RoundOpenEntry(round=round_, attempt=attempt))
            log.info("event=round_open round=%d attempt=%d", round_, attempt)
            ctx.emit(RoundOpened(round_, attempt, now))
        live = Attempt(round_, attempt, "open" if not finished else "closed", now, now)
        if ctx.buffered:
            live.plan = self._cohort.build_spec(live, [], {})
        return live

    def resume(self) -> None:
        """Rebuild the round in progress from the state store (or open the first one)."""
        now = self._ctx.clock()
        row = self._ctx.ws.state.rounds.latest()
        if row is None:
            self.live = self.open(1, 0, now)
        elif row.stage == "closed":
            self.live = (
                self.open(row.round + 1, 0, now)
                if not self.finished
                else Attempt(row.round, row.attempt, "closed", row.opened_at, row.stage_started_at)
            )
        elif row.stage == "aborted":
            self.live = self.open(row.round, row.attempt + 1, now)
        else:
            self.live = rebuild(row, self._ctx.ws.state.messages, self._open_summation)


# The refusals a closed round's summary names (GET /v1/status, where a refused member
# reads why); the log's refused entries hold every one.
_SUMMARY_REFUSALS = 8


def _wrappable_coordinates(spec: wire.RoundSpec | None, result: SummationResult | None) -> int:
    """A closed sum's coordinates that could wrap the ring (distributed DP, fewer codec
    headroom bits), the wrap rate's denominator; 0 where no sum can wrap."""
    if spec is None or result is None:
        return 0
    codec = codec_for(spec)
    return codec.keep if codec.may_wrap else 0


def _refusal_summary(result: SummationResult) -> str:
    """The round summary's detail: who the aggregation rule refused, and why."""
    if not result.refused:
        return ""
    shown = "; ".join(f"{r.member}: {r.reason}" for r in result.refused[:_SUMMARY_REFUSALS])
    more = len(result.refused) - _SUMMARY_REFUSALS
    rest = f"; and {more} more (the log's refused entries)" if more > 0 else ""
    return f"aggregation rule {result.refused[0].rule} refused {shown}{rest}"
