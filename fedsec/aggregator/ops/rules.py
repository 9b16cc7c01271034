"""The alert rules: what turns round events into operator alerts.

Every threshold is the federation's ``[alerts]`` section (``docs/config.md``).  The
rules hold only small windows in memory, rebuilt from the state store at start-up where
the state has them (validation scores of recent rounds); a refusal burst or a stall in
progress when the aggregator restarts starts counting again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import msgspec

from fedsec.aggregator.rounds.alerts import AlertDesk
from fedsec.aggregator.rounds.events import (
    ContributionRefused,
    Event,
    ModelEvaluated,
    PrivacyReported,
    RoundEnded,
)
from fedsec.aggregator.storage.interfaces import RoundStore, VerdictRow
from fedsec.config import AlertsSection
from fedsec.protocol import wire


class AlertRules:
    """Raises alerts from events (:meth:`on_event`) and time (:meth:`tick`).

    Args:
        cfg: the ``[alerts]`` thresholds.
        desk: where alerts are raised.
        rounds: the state's round attempts (for the validation window at start-up).
    """

    def __init__(
        self,
        cfg: AlertsSection,
        desk: AlertDesk,
        rounds: RoundStore,
        *,
        federated: tuple[str, bool] | None = None,
        evaluated: Callable[[int, int], ModelEvaluated | None] | None = None,
    ) -> None:
        self._cfg = cfg
        self._desk = desk
        # validation.federated: (primary metric, higher is better); the degradation rule
        # then follows the members' pooled scores, once every survivor reported
        self._federated = federated
        self._judged: set[int] = set()  # versions whose federated scores were compared
        # (primary metric, loss) of the newest scored versions, oldest first
        self._scores: deque[tuple[float, float | None]] = deque(maxlen=cfg.degradation_window + 1)
        for row in rounds.history(4 * cfg.degradation_window + 4):
            if row.stage != "closed" or row.summary is None:
                continue
            if federated is None:
                s = msgspec.json.decode(row.summary, type=wire.RoundSummary)
                if s.score is not None:
                    self._scores.append((s.score, s.loss))
            elif evaluated is not None:
                pooled = evaluated(row.round, row.attempt)
                if pooled is not None and pooled.complete and federated[0] in pooled.metrics:
                    self._judged.add(pooled.model_version)
                    self._scores.append((pooled.metrics[federated[0]], pooled.metrics.get("loss")))
        self._refusals: dict[str, deque[float]] = {}
        self._stalled: str | None = None  # the stall already alerted on

    # -- events ----------------------------------------------------------------------------------

    def on_event(self, event: Event) -> None:
        """The event-bus listener."""
        match event:
            case RoundEnded(summary=s) if s.stage == "closed":
                self._participation(s)
                self._wrapped(s)
                if s.score is not None and self._federated is None:
                    self._degradation(s)
            case ModelEvaluated(complete=True) if self._federated is not None:
                self._evaluated(event, *self._federated)
            case ContributionRefused():
                self._refused(event)
            case PrivacyReported():
                self._budget(event)
            case _:
                pass

    def _participation(self, s: wire.RoundSummary) -> None:
        if s.cohort and s.survivors < self._cfg.participation_min * s.cohort:
            self._desk.raise_alert(
                "participation_dropped",
                f"round {s.round}.{s.attempt}",
                f"round {s.round} attempt {s.attempt} closed with {s.survivors} of its "
                f"{s.cohort} members' contributions (below {self._cfg.participation_min:.0%}); "
                f"dropped: {', '.join(s.dropped) or 'none'}",
            )

    def _wrapped(self, s: wire.RoundSummary) -> None:
        # Only distributed-DP sums (noise in a ring that can wrap) and sums in a ring with
        # fewer codec headroom bits can wrap: every other round reports 0 coordinates, and
        # 0 wraps of them is no rate at all.
        if s.coordinates <= 0:
            return
        rate = s.edge_count / s.coordinates
        if rate <= self._cfg.wrap_rate_max:
            return
        model = "its model" if s.model_version is None else f"model version {s.model_version}"
        kind, remedy = (
            ("distributed-DP", "round.quant_bits (it sizes the ring)")
            if s.noise_multiplier > 0
            else ("compressed", "codec.headroom_bits (or set 0: sums that never wrap)")
        )
        self._desk.raise_alert(
            "ring_wrapped",
            f"round {s.round}.{s.attempt}",
            f"round {s.round} attempt {s.attempt} closed with {s.edge_count} of the "
            f"{s.coordinates} coordinates of its {kind} sum at the ring's edge "
            f"(wrap rate {rate:.3g}, above alerts.wrap_rate_max = "
            f"{self._cfg.wrap_rate_max:g}): they likely wrapped around the ring and are "
            f"corrupted in {model}; raise {remedy}, and roll back to the version before "
            "this round if the model degraded",
        )

    def _evaluated(self, event: ModelEvaluated, metric: str, higher_is_better: bool) -> None:
        """The members' pooled scores of a version, compared once all survivors reported,
        as the aggregator's own validation is (its summary, with the pooled metrics)."""
        if event.model_version in self._judged or metric not in event.metrics:
            return
        self._judged.add(event.model_version)
        scored = wire.RoundSummary(
            round=event.round,
            attempt=event.attempt,
            stage="closed",
            cohort=0,
            participants=0,
            survivors=0,
            dropped=[],
            model_version=event.model_version,
            accuracy=event.metrics.get("accuracy"),
            loss=event.metrics.get("loss"),
            aggregation_s=None,
            duration_s=None,
            epsilon_max=None,
            detail="",
            primary_metric=metric,
            higher_is_better=higher_is_better,
            metrics=dict(event.metrics),
        )
        self._degradation(scored)

    def _degradation(self, s: wire.RoundSummary) -> None:
        score = s.score
        assert score is not None
        window = list(self._scores)[-self._cfg.degradation_window :]
        self._scores.append((score, s.loss))
        if not window:
            return
        problems = []
        worse = _worse_by(score, [v for v, _ in window], s.higher_is_better)
        if worse > self._cfg.accuracy_drop:
            side = "below" if s.higher_is_better else "above"
            best = score - worse if not s.higher_is_better else score + worse
            problems.append(
                f"{s.primary_metric} {score:.4f} is {worse:.4f} {side} the best "
                f"({best:.4f}) of the previous {len(window)} versions"
            )
        losses = [loss for _, loss in window if loss is not None]
        if self._cfg.loss_rise > 0 and s.loss is not None and losses:
            lowest = min(losses)
            if lowest > 0 and s.loss > lowest * (1 + self._cfg.loss_rise):
                problems.append(
                    f"loss {s.loss:.4f} is {s.loss / lowest - 1:.0%} above the lowest "
                    f"({lowest:.4f}) of the previous {len(losses)} versions"
                )
        if problems:
            self._desk.raise_alert(
                "validation_degraded",
                f"model {s.model_version}",
                f"model version {s.model_version} (round {s.round}): " + "; ".join(problems),
            )

    def _refused(self, event: ContributionRefused) -> None:
        # Only refusals about a real attempt of the member's cohort count: an alert is a
        # log entry, and requests naming made-up rounds must not grow the log (they are
        # in fedsec_http_requests_total, and the member's rate limit bounds them).
        if not event.in_cohort:
            return
        times = self._refusals.setdefault(event.member, deque())
        times.append(event.time)
        while times and times[0] < event.time - self._cfg.refusals_window_s:
            times.popleft()
        if len(times) >= self._cfg.refusals_per_member:
            raised = self._desk.raise_alert(
                "member_refused",
                f"member {event.member}",
                f"{event.member}: {len(times)} contributions refused within "
                f"{self._cfg.refusals_window_s:g} s (latest: {event.code}, round "
                f"{event.round}.{event.attempt})",
            )
            if raised is not None:
                times.clear()

    def _budget(self, event: PrivacyReported) -> None:
        budget = event.epsilon_budget or self._cfg.epsilon_budget
        if budget <= 0 or event.epsilon < self._cfg.budget_fraction * budget:
            return
        self._desk.raise_alert(
            "member_near_budget",
            f"member {event.member}",
            f"{event.member} has spent epsilon {event.epsilon:.3f} of its budget "
            f"{budget:g} ({event.epsilon / budget:.0%}) by round {event.round}",
        )

    # -- verdicts and time -----------------------------------------------------------------------

    def verdict(self, row: VerdictRow) -> bool:
        """An auditor's new verdict: alert when it failed.  True when an alert was raised."""
        if row.passed:
            return False
        raised = self._desk.raise_alert(
            "audit_failed",
            f"member {row.member} round {row.round}.{row.attempt}",
            f"{row.auditor}'s control-sample check failed {row.member}'s contribution to "
            f"round {row.round} attempt {row.attempt}: {row.failed or 'unspecified'}",
        )
        return raised is not None

    def tick(
        self, now: float, attempt: Callable[[], tuple[int, int, str, float]], finished: bool
    ) -> None:
        """Check for a stalled round: ``attempt()`` gives (round, attempt, stage, when
        the stage started)."""
        if finished:
            return
        round_, attempt_, stage, since = attempt()
        stalled = now - since
        subject = f"round {round_}.{attempt_} {stage}"
        if stalled >= self._cfg.stall_s and subject != self._stalled:
            self._stalled = subject
            self._desk.raise_alert(
                "round_stalled",
                subject,
                f"round {round_} attempt {attempt_} has been in stage {stage} for "
                f"{stalled:.0f} s (alerts.stall_s = {self._cfg.stall_s:g})",
            )


def _worse_by(score: float, previous: list[float], higher_is_better: bool) -> float:
    """How far ``score`` is from the best of ``previous`` in the metric's wrong direction
    (0 or less when it is at least as good)."""
    if higher_is_better:
        return max(previous) - score
    return score - min(previous)
