"""What every part of the round engine shares: the workspace, the clock, the
transparency log, the task, the event bus, operator alerts and the change signal agents
long-poll on."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from fedsec.aggregator.rounds.alerts import AlertDesk, AlertKind
from fedsec.aggregator.rounds.events import Event, EventBus
from fedsec.aggregator.storage.audit_trail import AuditTrail
from fedsec.aggregator.workspace import Workspace
from fedsec.config import FederationConfig
from fedsec.errors import DuplicateMessage
from fedsec.faults import NO_FAULTS, Faults
from fedsec.protocol import wire
from fedsec.protocol.log_entries import QuarantineEntry
from fedsec.protocol.spec import TaskPin
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
        events: where the engine announces what it did (operations listen there).
        task_pin: the task package installed here (:func:`fedsec.task.digest.loaded_task_pin`),
            pinned in every spec and required of every join.
    """

    ws: Workspace
    clock: Callable[[], float]
    trail: AuditTrail
    task: Task
    dim: int
    changed: Callable[[], None]
    faults: Faults = NO_FAULTS
    events: EventBus = field(default_factory=EventBus)
    # (round, attempt) -> [bytes received, bytes sent], counted by the HTTP layer
    traffic: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    # member -> its quarantine log entry: no cohort takes it (rounds.quarantine keeps it)
    quarantined: dict[str, QuarantineEntry] = field(default_factory=dict)
    task_pin: TaskPin = field(kw_only=True)

    @property
    def cfg(self) -> FederationConfig:
        return self.ws.config

    @property
    def buffered(self) -> bool:
        return self.cfg.round.mode == "buffered"

    def __post_init__(self) -> None:
        self.alerts = AlertDesk(self.ws.state.alerts, self.trail, self.clock, self.events)

    def alert(self, kind: AlertKind, subject: str, detail: str) -> None:
        """Raise an operator alert (:class:`AlertDesk`): stored, logged, announced."""
        self.alerts.raise_alert(kind, subject, detail)

    def emit(self, event: Event) -> None:
        """Announce ``event`` on the bus (after the change it describes is committed)."""
        self.events.emit(event)

    def count_traffic(self, key: tuple[int, int], received: int, sent: int) -> None:
        """Add one request's body sizes to the attempt that was current when it arrived."""
        counts = self.traffic.setdefault(key, [0, 0])
        counts[0] += received
        counts[1] += sent

    def traffic_of(self, round_: int, attempt: int) -> tuple[int, int]:
        """(bytes received, bytes sent) for that attempt."""
        up, down = self.traffic.get((round_, attempt), [0, 0])
        return up, down

    def signed_once(
        self,
        member: str,
        report: wire.PrivacyReport | wire.EvaluationReport,
        stored: Callable[[], bytes | None],
        duplicate: str,
    ) -> bytes | None:
        """``report``'s encoding once its signature by ``member``'s roster key verifies;
        None when ``stored()`` is that same encoding (an idempotent retry).

        Raises:
            SignatureError: the report is not signed by the member's key.
            DuplicateMessage: a different report is stored (``duplicate`` says what).
        """
        entry = self.ws.roster.get(member)
        assert entry is not None  # authenticated requests come from roster members
        report.verify(entry.public_key_bytes)
        body = wire.encode(report)
        existing = stored()
        if existing is None:
            return body
        if existing == body:
            return None
        raise DuplicateMessage(duplicate)
