"""Operations: what the consortium operator sees of a running federation.

- :mod:`.live`: small values kept current by the round engine's events;
- :mod:`.metrics`: Prometheus metrics (``GET /metrics``);
- :mod:`.rules`: the alert rules (:data:`fedsec.aggregator.rounds.alerts.ALERT_KINDS`);
- :mod:`.webhooks`: signed alert deliveries;
- :mod:`.dashboard`: the dashboard's snapshots (``/dashboard``);
- :mod:`.tokens`: observers' bearer tokens for the dashboard and the scrape.

:class:`Operations` wires them to one coordinator's event bus.  Everything here
listens; nothing here changes a round (an operations bug is logged and skipped by the
bus, never allowed to fail a round).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.ops.dashboard import SnapshotBuilder
from fedsec.aggregator.ops.live import LiveView
from fedsec.aggregator.ops.metrics import FederationMetrics
from fedsec.aggregator.ops.rules import AlertRules
from fedsec.aggregator.ops.webhooks import WebhookSender
from fedsec.aggregator.storage.interfaces import VerdictRow
from fedsec.aggregator.storage.leadership import local_role
from fedsec.errors import NotFound
from fedsec.protocol import wire

__all__ = ["Operations"]


class Operations:
    """Metrics, alert rules, webhooks and the dashboard of one coordinator.

    Args:
        coord: the round engine; its event bus is subscribed to.
        clock: time source; the coordinator's by default (deadlines and stage times are
            on it).
    """

    def __init__(self, coord: Coordinator, clock: Callable[[], float] | None = None) -> None:
        ws = coord.ws
        cfg = ws.config
        self.coord = coord
        self._clock = clock = clock or coord.context.clock
        self.live = LiveView(
            self._attempt,
            lambda: len(ws.roster.active_agents()),
            ws.state.alerts.count_open,
            ws.state.reports.epsilons(),
        )
        self.live.leadership = lambda: local_role(ws.state)
        self.live.federated = cfg.validation.federated
        self.metrics = FederationMetrics(self.live, member_labels=cfg.metrics.member_labels)
        self.rules = AlertRules(
            cfg.alerts,
            coord.alert_desk,
            ws.state.rounds,
            federated=(coord.task.primary_metric, coord.task.higher_is_better)
            if cfg.validation.federated
            else None,
            evaluated=coord.evaluated,
        )
        self.webhooks = WebhookSender(cfg.alerts, ws.signer, ws.federation_id)
        self.dashboard = SnapshotBuilder(coord, self.live, cfg.alerts.epsilon_budget, clock)
        for listener in (
            self.live.on_event,
            self.metrics.on_event,
            self.rules.on_event,
            self.webhooks.on_event,
        ):
            coord.events.subscribe(listener, replay=True)  # start-up's events too
        self.streams = 0  # live dashboard streams open now
        self.streams_of: Counter[str] = Counter()  # viewer (observer, loopback) -> its streams
        self.closing = False  # the server is shutting down: live streams end
        self.live.primary_metric = coord.task.primary_metric
        self.live.higher_is_better = coord.task.higher_is_better
        self.live.scored(dict(ws.models.latest().metrics))
        if cfg.validation.federated:
            self._rescore_federated()

    def _rescore_federated(self) -> None:
        """At start-up: the members' pooled scores of the newest closed round's model,
        the newest there are (none yet: nothing is shown rather than another source)."""
        self.live.metrics, self.live.accuracy, self.live.loss = {}, None, None
        for row in reversed(self.coord.ws.state.rounds.history(1000)):
            if row.stage == "closed":
                evaluated = self.coord.evaluated(row.round, row.attempt)
                if evaluated is not None:
                    self.live.on_event(evaluated)
                return

    def _attempt(self) -> tuple[int, int, str, int, int, float | None]:
        coord = self.coord
        live = coord.live
        deadline = coord.deadline()
        left = max(deadline - self._clock(), 0.0) if deadline != float("inf") else None
        return (
            live.round,
            live.attempt,
            live.stage,
            coord.rounds_completed,
            coord.ws.models.latest().version,
            left,
        )

    def tick(self) -> None:
        """Time-driven rules (a stalled round); called with the coordinator's tick."""
        live = self.coord.live
        self.rules.tick(
            self._clock(),
            lambda: (live.round, live.attempt, live.stage, live.stage_started_at),
            self.coord.finished,
        )

    def submit_verdicts(
        self, auditor: str, verdicts: list[wire.AuditVerdict]
    ) -> wire.VerdictReceipt:
        """Store an auditor's verdicts; a new failed one raises ``audit_failed``.

        Raises:
            NotFound: a verdict names a member that is not in the roster, or a
                contribution that was never accepted (no receipt for that member and
                attempt); nothing is stored then.
        """
        ws = self.coord.ws
        for v in verdicts:
            if ws.roster.get(v.member) is None:
                raise NotFound(f"verdict for {v.member}, who is not in the roster")
            if not ws.state.receipts.has(v.round, v.attempt, v.member):
                raise NotFound(
                    f"verdict on round {v.round} attempt {v.attempt} of {v.member}, which "
                    "holds no accepted contribution of it"
                )
        stored = already = alerts = 0
        now = self._clock()
        for v in verdicts:
            row = VerdictRow(
                v.round, v.attempt, v.member, auditor, v.passed, ",".join(v.failed), now
            )
            if not ws.state.verdicts.add(row):
                already += 1
                continue
            stored += 1
            alerts += self.rules.verdict(row)
        return wire.VerdictReceipt(stored=stored, already=already, alerts=alerts)
