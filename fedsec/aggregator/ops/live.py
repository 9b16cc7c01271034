"""The federation as operations see it between two looks at the state store: small
values kept current by the round engine's events, shared by the metrics collector and
the dashboard so that neither scans the state on every scrape or push."""

from __future__ import annotations

from collections.abc import Callable

from fedsec.aggregator.rounds.events import (
    AlertRaised,
    CohortFixed,
    ContributionRefused,
    Event,
    ModelEvaluated,
    PrivacyReported,
    RoundEnded,
)
from fedsec.aggregator.storage.leadership import LocalRole
from fedsec.protocol.oversight import RoundSummary

#: Model versions whose federated evaluations are kept for the dashboard's models view
#: (which shows the newest few); older ones stay in the state store.
EVALUATIONS_KEPT = 64


class LiveView:
    """What the collector and the dashboard read, kept current by :meth:`on_event`.

    Args:
        attempt: () -> (round, attempt, stage, rounds completed, model version,
            seconds to the stage's deadline or None); read from the coordinator.
        active_members: () -> active agents in the roster.
        open_alerts: () -> kind -> unacknowledged alerts.
        epsilons: member -> the largest ε it reported, as stored (the starting point).
    """

    def __init__(
        self,
        attempt: Callable[[], tuple[int, int, str, int, int, float | None]],
        active_members: Callable[[], int],
        open_alerts: Callable[[], dict[str, int]],
        epsilons: dict[str, float] | None = None,
    ) -> None:
        self.attempt = attempt
        self.active_members = active_members
        self.open_alerts = open_alerts
        self.accuracy: float | None = None
        self.loss: float | None = None
        # the task's primary metric and its direction, and every metric (the loss
        # included) of the newest scored model: set by Operations from the task
        self.primary_metric = "accuracy"
        self.higher_is_better = True
        self.metrics: dict[str, float] = {}
        # validation.federated: the newest scores are the members' pooled reports, not
        # the aggregator's; version -> (pooled metrics, members who reported)
        self.federated = False
        self.evaluators = 0  # members pooled in the newest federated scores
        self.evaluations: dict[int, tuple[dict[str, float], int]] = {}
        self.epsilon: dict[str, float] = dict(epsilons or {})
        self.budgets: dict[str, float] = {}  # member -> ε budget its reports declare
        self.last_seen: dict[str, float] = {}  # member -> its last authenticated request
        self.refused: dict[tuple[int, int], int] = {}  # attempt -> refused contributions
        # this process's role among replicas; set by Operations from the state store
        self.leadership: Callable[[], LocalRole] = lambda: LocalRole("single")
        self.joined = 0  # members in the latest fixed cohort
        self.dropped = 0  # members of the latest ended attempt whose input is not in it
        self.last_alert = 0  # id of the newest alert raised since start-up

    def scored(self, metrics: dict[str, float]) -> None:
        """The newest model's metrics (by the aggregator's validation or the members'
        federated evaluation), which the scrape and the dashboard show."""
        self.metrics = dict(metrics)
        self.accuracy, self.loss = metrics.get("accuracy"), metrics.get("loss")

    def seen(self, member: str, now: float) -> None:
        """``member`` made an authenticated request at ``now``."""
        self.last_seen[member] = now

    def on_event(self, event: Event) -> None:
        """The event-bus listener."""
        match event:
            case CohortFixed(members=members):
                self.joined = len(members)
            case ContributionRefused(round=r, attempt=a):
                self.refused[(r, a)] = self.refused.get((r, a), 0) + 1
            case PrivacyReported(member=member, epsilon=epsilon, epsilon_budget=budget):
                if epsilon > self.epsilon.get(member, -1.0):
                    self.epsilon[member] = epsilon
                if budget is not None:
                    self.budgets[member] = budget
            case RoundEnded(summary=s):
                self.dropped = event.dropped
                if s.stage == "closed" and s.score is not None and not self.federated:
                    self.scored(s.metrics or _legacy_metrics(s))
                # only the attempt in progress is shown live; keep the map small
                self.refused = {k: v for k, v in self.refused.items() if k > (s.round, s.attempt)}
            case ModelEvaluated(model_version=version, metrics=metrics, members=members):
                self.evaluations[version] = (dict(metrics), members)
                newest = max(self.evaluations)
                self.evaluations = {
                    v: e for v, e in self.evaluations.items() if v > newest - EVALUATIONS_KEPT
                }
                if self.federated and version == newest:
                    self.scored(metrics)
                    self.evaluators = members
            case AlertRaised(alert=alert):
                self.last_alert = alert.id
            case _:
                pass


def _legacy_metrics(s: RoundSummary) -> dict[str, float]:
    """The metrics of a summary written before they were named: accuracy and loss."""
    pairs = (("accuracy", s.accuracy), ("loss", s.loss))
    return {name: value for name, value in pairs if value is not None}
