"""What the dashboard shows: :class:`SnapshotBuilder` turns the coordinator and the
state store into a :class:`~fedsec.protocol.wire.DashboardSnapshot`.

Only aggregates leave here: round summaries, per-member counts and ε, alerts, model
manifests.  No masked input, key, share or individual update is ever read.

Building is cheap enough to run once a second per federation: the parts that change
only when an attempt ends (round history, members' contributions and verdicts, model
versions) are cached under a key that changes when they can, and every viewer of one
aggregator shares one snapshot per change (:meth:`SnapshotBuilder.snapshot`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Final

import msgspec

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.ops.live import LiveView
from fedsec.aggregator.rounds.alerts import alert_view
from fedsec.errors import FedsecError
from fedsec.protocol import wire
from fedsec.protocol.stages import stage_index

#: Attempts the rounds view shows (newest); older ones stay in state.db and the log.
ROUNDS_SHOWN: Final = 500
#: Alerts the alerts view shows (newest, open ones first).
ALERTS_SHOWN: Final = 200
#: Model versions the models view shows (newest).
MODELS_SHOWN: Final = 200


class SnapshotBuilder:
    """Builds dashboard snapshots for one coordinator.

    Args:
        coord: the round engine.
        live: the values events keep current (last seen, refusals, ε, budgets).
        default_budget: the ε budget assumed for members that declare none (0: none).
        clock: wall-clock time (snapshots are stamped with it).
    """

    def __init__(
        self,
        coord: Coordinator,
        live: LiveView,
        default_budget: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._coord = coord
        self._ws = coord.ws
        self._view = live
        self._default_budget = default_budget
        self._clock = clock
        self._history_key: object = None
        self._rounds: list[wire.RoundSummary] = []
        self._members_key: object = None
        self._contributed: dict[str, int] = {}
        self._verdicts: dict[str, tuple[int, int, str]] = {}
        self._models_key: object = None
        self._models: list[wire.ModelView] = []
        self._snapshot_key: object = None
        self._snapshot: bytes = b""
        self.builds = 0  # snapshots built (not served from the cache)
        self.build_seconds = 0.0  # time spent building them

    def invalidate(self) -> None:
        """Forget every cached part: the next build reads everything afresh."""
        self._history_key = self._members_key = self._models_key = self._snapshot_key = None

    # -- the snapshot ----------------------------------------------------------------------------

    def snapshot(self, change: object) -> bytes:
        """The encoded snapshot; rebuilt only when ``change`` (the federation's change
        token, alert count, ...) differs from the last call's or a second has passed."""
        key = (change, math.floor(self._clock()))
        if key != self._snapshot_key:
            start = time.perf_counter()
            self._snapshot = wire.encode(self.build())
            self.build_seconds += time.perf_counter() - start
            self.builds += 1
            self._snapshot_key = key
        return self._snapshot

    def build(self) -> wire.DashboardSnapshot:
        """Everything the dashboard shows, now."""
        ended_key = (self._coord.rounds_completed, self._coord.current_attempt())
        role = self._view.leadership()
        return wire.DashboardSnapshot(
            federation_id=self._ws.federation_id,
            generated_at=self._clock(),
            now=self._live(),
            rounds=self._history(ended_key),
            members=self._members(ended_key),
            alerts=self._alerts(),
            models=self._model_versions(),
            role=role.role,
            fencing=role.token,
        )

    def _live(self) -> wire.LiveAttempt:
        coord, ws = self._coord, self._ws
        live = coord.live
        state = coord.round_state()
        deadline = coord.deadline()
        cohort = len(live.spec.cohort) if live.spec is not None else 0
        session = live.summation
        accepted = ws.state.messages.count(live.round, live.attempt, "masked_input")
        dropped = 0
        if session is not None and live.stage in session.stages:
            # members of the cohort missing from a stage that has closed already
            passed = [s for s in session.stages if stage_index(s) < stage_index(live.stage)]
            answered = [ws.state.messages.count(live.round, live.attempt, s) for s in passed]
            if answered:
                dropped = max(cohort - min(answered), 0)
        return wire.LiveAttempt(
            round=live.round,
            attempt=live.attempt,
            stage=live.stage,  # type: ignore[arg-type]
            opened_at=live.opened_at,
            stage_started_at=live.stage_started_at,
            deadline_at=deadline if math.isfinite(deadline) else None,
            cohort=cohort,
            joined=len(ws.state.joins.samples(live.round, live.attempt)),
            accepted=accepted,
            refused=self._view.refused.get((live.round, live.attempt), 0),
            dropped=dropped,
            rounds_completed=state.rounds_completed,
            rounds_target=state.rounds_target,
            finished=state.finished,
            secure_sum=live.spec.secure_sum
            if live.spec is not None
            else ws.config.round.secure_sum,
            mode=state.mode,
            model_version=state.model_version,
        )

    def _history(self, key: object) -> list[wire.RoundSummary]:
        if key != self._history_key:
            self._rounds = [
                msgspec.json.decode(r.summary, type=wire.RoundSummary)
                for r in self._ws.state.rounds.history(ROUNDS_SHOWN)
                if r.summary is not None
            ]
            self._history_key = key
        return self._rounds

    def _members(self, key: object) -> list[wire.MemberView]:
        verdict_key = (key, self._ws.roster.serial, self._ws.state.verdicts.count())
        if verdict_key != self._members_key:
            self._contributed = self._ws.state.receipts.contributions()
            self._verdicts = {}
            for member, rows in self._ws.state.verdicts.by_member().items():
                fails = [r for r in rows if not r.passed]
                last = (
                    f"round {fails[-1].round}.{fails[-1].attempt}: {fails[-1].failed}"
                    if fails
                    else ""
                )
                self._verdicts[member] = (len(rows) - len(fails), len(fails), last)
            self._members_key = verdict_key
        view = self._view
        summaries = self._coord.data_summaries()
        out = []
        for entry in self._ws.roster.entries():
            passed, failed, last = self._verdicts.get(entry.agent_id, (0, 0, ""))
            data = summaries.get(entry.agent_id)
            budget = view.budgets.get(entry.agent_id) or self._default_budget or None
            out.append(
                wire.MemberView(
                    id=entry.agent_id,
                    role=entry.role,
                    active=entry.is_active,
                    last_seen=view.last_seen.get(entry.agent_id),
                    rounds_contributed=self._contributed.get(entry.agent_id, 0),
                    epsilon=view.epsilon.get(entry.agent_id),
                    epsilon_budget=budget if entry.role == "agent" else None,
                    audits_passed=passed,
                    audits_failed=failed,
                    last_failure=last,
                    records=None if data is None else data.records,
                    quality=None if data is None else data.quality_score,
                )
            )
        return out

    def _alerts(self) -> list[wire.AlertView]:
        rows = self._ws.state.alerts.recent(ALERTS_SHOWN)
        rows.sort(key=lambda r: (r.acked_at is not None, -r.id))
        return [alert_view(r) for r in rows]

    def _model_versions(self) -> list[wire.ModelView]:
        models = self._ws.models
        versions = models.versions_on_disk()
        evaluated = self._view.evaluations
        # members' evaluation reports arrive after their version: they change the view too
        reported = tuple(sorted((v, n) for v, (_, n) in evaluated.items()))
        key = (versions[-1] if versions else None, len(versions), reported)
        if key != self._models_key:
            latest = models.latest().version
            shown = []
            for version in versions[-MODELS_SHOWN:]:
                try:
                    m = models.get(version)
                except FedsecError:
                    continue  # unusable: reported by the model_unusable alert
                shown.append(
                    wire.ModelView(
                        version=m.version,
                        parent=m.parent,
                        round=m.round,
                        kind=m.kind,
                        sha256=m.sha256,
                        created=m.created,
                        accuracy=m.metrics.get("accuracy"),
                        loss=m.metrics.get("loss"),
                        note=m.note,
                        rollback=m.kind == "rollback",
                        latest=m.version == latest,
                        primary_metric=self._coord.task.primary_metric,
                        metrics=dict(m.metrics),
                        evaluated=evaluated.get(m.version, ({}, 0))[0],
                        evaluators=evaluated.get(m.version, ({}, 0))[1],
                    )
                )
            self._models = list(reversed(shown))
            self._models_key = key
        return self._models
