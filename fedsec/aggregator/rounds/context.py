"""What every part of the round engine shares: the workspace, the clock, the
transparency log, the task, operator alerts and the change signal agents long-poll on."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from fedsec.aggregator.storage.audit_trail import AuditTrail
from fedsec.aggregator.workspace import Workspace
from fedsec.config import FederationConfig
from fedsec.faults import NO_FAULTS, Faults
from fedsec.protocol.log_entries import AlertEntry
from fedsec.tasks.base import Task

# The whole round engine logs under the coordinator's name: operators (and `fedsec
# aggregator --log-level`) filter on it.
log = logging.getLogger("fedsec.aggregator.coordinator")


@dataclass
class RoundContext:
    """The federation's rounds as every engine part sees them.

    Args:
        ws: the opened workspace.
        clock: time source (tests pass a fake one).
        trail: the transparency log.
        task: the federation's task.
        dim: trainable parameters of the task's model.
        changed: to call whenever something an agent may be waiting for changed.
        faults: crash points for chaos tests (:mod:`fedsec.faults`); none in production.
    """

    ws: Workspace
    clock: Callable[[], float]
    trail: AuditTrail
    task: Task
    dim: int
    changed: Callable[[], None]
    faults: Faults = NO_FAULTS
    alerts: list[str] = field(default_factory=list)
    # (round, attempt) -> [bytes received, bytes sent], counted by the HTTP layer
    traffic: dict[tuple[int, int], list[int]] = field(default_factory=dict)

    @property
    def cfg(self) -> FederationConfig:
        return self.ws.config

    @property
    def buffered(self) -> bool:
        return self.cfg.round.mode == "buffered"

    def alert(self, detail: str) -> None:
        """Raise an operator alert: kept for the dashboard and written to the log."""
        log.warning("event=alert detail=%r", detail)
        self.alerts.append(detail)
        self.trail.append(AlertEntry(detail=detail, time=self.clock()))

    def count_traffic(self, key: tuple[int, int], received: int, sent: int) -> None:
        """Add one request's body sizes to the attempt that was current when it arrived."""
        counts = self.traffic.setdefault(key, [0, 0])
        counts[0] += received
        counts[1] += sent

    def traffic_of(self, round_: int, attempt: int) -> tuple[int, int]:
        """(bytes received, bytes sent) for that attempt."""
        up, down = self.traffic.get((round_, attempt), [0, 0])
        return up, down
