"""Operator alerts: raised by the round engine and the alert rules
(:mod:`fedsec.aggregator.ops.rules`), stored, written to the transparency log, and
announced on the event bus (the webhooks, metrics and dashboard listen there).

:data:`ALERT_KINDS` is the one list of kinds, each with what it means and what the
operator does about it; ``docs/runbook.md`` and ``docs/monitoring.md`` are checked
against it.  An alert stays open until acknowledged (``fedsec aggregator alerts ack``,
or a webhook receiver's acknowledgement with the alert's capability); while one of a
kind and subject is open, the same is not raised again.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from collections.abc import Callable, Mapping
from typing import Final, Literal

from fedsec.aggregator.rounds.events import AlertRaised, EventBus
from fedsec.aggregator.storage.audit_trail import AuditTrail
from fedsec.aggregator.storage.interfaces import AlertRow, AlertStore
from fedsec.errors import ForbiddenError, NotFound, PayloadError
from fedsec.protocol import wire
from fedsec.protocol.log_entries import AlertEntry

log = logging.getLogger("fedsec.aggregator.coordinator")

AlertKind = Literal[
    "round_stalled",
    "round_aborted",
    "validation_degraded",
    "participation_dropped",
    "ring_wrapped",
    "member_refused",
    "member_near_budget",
    "audit_failed",
    "member_quarantined",
    "model_unusable",
    "leader_changed",
]

#: Every alert kind: (what it means, what to do).
ALERT_KINDS: Final[Mapping[AlertKind, tuple[str, str]]] = {
    "round_stalled": (
        "the attempt in progress has not changed stage for alerts.stall_s seconds",
        "check that enough members are online (dashboard: members, last seen); a cohort "
        "that never fills keeps a round open; restart the aggregator if its log shows "
        "tick_failed",
    ),
    "round_aborted": (
        "an attempt ended without a model: too few members left, or its masks could not "
        "be removed; the round is retried without the lost members",
        "nothing when rare; when repeated, look at which members drop (rounds view) and "
        "at their agents' logs",
    ),
    "validation_degraded": (
        "the newest model's primary metric is alerts.accuracy_drop worse (in the metric's "
        "direction) than the best of the last "
        "alerts.degradation_window versions, or its loss rose by alerts.loss_rise",
        "look for a member with failed audit verdicts or many refusals; roll back with "
        "`fedsec aggregator rollback --to VERSION` (the dashboard's models view) if it "
        "persists",
    ),
    "participation_dropped": (
        "an attempt ended with fewer accepted contributions than alerts.participation_min "
        "of its cohort",
        "find the members that dropped (rounds view) and ask their IT teams; lengthen the "
        "stage deadlines if links are slow",
    ),
    "ring_wrapped": (
        "more than alerts.wrap_rate_max of the coordinates of a closed distributed-DP "
        "round's ring sum lay at the ring's edge: they likely wrapped around the ring, "
        "which corrupts them in that round's model",
        "raise round.quant_bits (it sizes the ring; a smaller cohort does not help, as the "
        "ring shrinks with it); roll back to the version before the round if the model "
        "degraded",
    ),
    "member_refused": (
        "one member's contributions were refused alerts.refusals_per_member times within "
        "alerts.refusals_window_s",
        "the refusal codes (metrics: fedsec_contributions_refused_total) say why: an old "
        "agent version, a broken clock, or a hostile member; revoke it from the roster if "
        "hostile",
    ),
    "member_near_budget": (
        "a member's signed reports put its privacy spend at alerts.budget_fraction of its "
        "budget; it will stop contributing soon",
        "plan for fewer members, or a new dataset id at that member (a new budget); never "
        "raise a member's budget on its behalf",
    ),
    "audit_failed": (
        "an auditor's control-sample check failed a member's contribution",
        "read the verdict (dashboard: members) and the auditor's report; revoke the member "
        "and roll back to the version before its first failed round if the auditor "
        "confirms",
    ),
    "member_quarantined": (
        "a member was suspended from future cohorts after the control-sample audit failed "
        "one of its contributions (an admin's or auditor's order, or audit."
        "quarantine_on_failure); the detail names its first failed round and the last "
        "model version before it",
        "roll back to that version with `fedsec aggregator rollback --to VERSION` if the "
        "model degraded since; revoke the member from the roster if the auditor confirms "
        "it was hostile (docs/runbook.md)",
    ),
    "model_unusable": (
        "a stored model version failed its hash or signature check; the last good "
        "version is served",
        "restore the models/ directory from backup, or roll back; then find out who could "
        "write to the workspace",
    ),
    "leader_changed": (
        "a standby replica took the leader lease over (the leader stopped renewing it: "
        "killed, paused or cut off from the database) and resumed the round",
        "find out why the old leader stopped (its log, its machine); restart it as a "
        "standby; a replica logging 'fenced write refused' was deposed while running",
    ),
}

# The capability a webhook delivery carries for acknowledging its alert: 256 bits.
ACK_TOKEN_BYTES = 32


class AlertDesk:
    """Raises and acknowledges alerts.

    Args:
        store: where alerts are kept.
        trail: the transparency log (every alert gets an ``alert`` entry).
        clock: time source.
        events: where :class:`AlertRaised` is announced.
    """

    def __init__(
        self,
        store: AlertStore,
        trail: AuditTrail,
        clock: Callable[[], float],
        events: EventBus,
    ) -> None:
        self._store = store
        self._trail = trail
        self._clock = clock
        self._events = events

    def raise_alert(self, kind: AlertKind, subject: str, detail: str) -> AlertRow | None:
        """Raise an alert unless one of the same kind and subject is open.

        Returns:
            The new alert, or None when an open one already says so.
        """
        if self._store.open_of(kind, subject) is not None:
            return None
        now = self._clock()
        token = secrets.token_hex(ACK_TOKEN_BYTES)
        alert_id = self._store.add(kind, subject, detail, now, _digest(token))
        log.warning(
            "event=alert id=%d kind=%s subject=%r detail=%r", alert_id, kind, subject, detail
        )
        self._trail.append(AlertEntry(detail=detail, time=now, kind=kind))
        row = self._store.get(alert_id)
        assert row is not None
        self._events.emit(AlertRaised(row, token))
        return row

    def get(self, alert_id: int) -> AlertRow:
        """The alert with that id.

        Raises:
            NotFound: there is none.
        """
        row = self._store.get(alert_id)
        if row is None:
            raise NotFound(f"no alert {alert_id}")
        return row

    def ack(self, alert_id: int, by: str) -> AlertRow:
        """Acknowledge alert ``alert_id`` as ``by``; acknowledging twice changes nothing.

        Raises:
            NotFound: there is no such alert.
        """
        self.get(alert_id)
        if self._store.ack(alert_id, by, self._clock()):
            log.info("event=alert_acknowledged id=%d by=%s", alert_id, by)
        return self.get(alert_id)

    def ack_with_token(self, alert_id: int, token: str) -> AlertRow:
        """Acknowledge on a webhook receiver's behalf, with the capability the alert's
        deliveries carried.

        Raises:
            PayloadError: ``token`` is not 64 hex digits.
            ForbiddenError: ``token`` is not this alert's, or there is no such alert
                (the same answer, so guessing ids tells nothing).
        """
        if len(token) != 2 * ACK_TOKEN_BYTES or not _is_hex(token):
            raise PayloadError("an acknowledgement token is 64 hex digits")
        row = self._store.get(alert_id)
        expected = row.ack_sha256 if row is not None else "0" * 64
        if not hmac.compare_digest(_digest(token), expected) or row is None:
            raise ForbiddenError(f"that token does not acknowledge alert {alert_id}")
        return self.ack(alert_id, "webhook")

    def recent(self, limit: int = 200) -> list[AlertRow]:
        """The newest ``limit`` alerts, newest first."""
        return self._store.recent(limit)


def alert_view(row: AlertRow) -> wire.AlertView:
    """The wire form of a stored alert (without its acknowledgement hash)."""
    return wire.AlertView(
        id=row.id,
        kind=row.kind,
        subject=row.subject,
        detail=row.detail,
        raised_at=row.raised_at,
        acked_at=row.acked_at,
        acked_by=row.acked_by,
    )


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)
