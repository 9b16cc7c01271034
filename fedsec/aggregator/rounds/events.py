"""What the round engine tells whoever listens: typed events, emitted after the change
they describe is committed.

The engine stays free of operations concerns: metrics, alert rules and the dashboard
(:mod:`fedsec.aggregator.ops`) subscribe to :class:`EventBus` and derive what they show
from these events and the state store.  A listener must not raise and must not block:
it runs inside the engine's call, on the event loop.  One that raises is logged and
skipped, never allowed to fail the round (an operations bug must not stop training).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from fedsec.aggregator.storage.interfaces import AlertRow
from fedsec.protocol import wire

log = logging.getLogger("fedsec.aggregator.coordinator")


@dataclass(frozen=True, slots=True)
class RoundOpened:
    round: int
    attempt: int
    time: float


@dataclass(frozen=True, slots=True)
class StageEntered:
    """The attempt moved from ``previous`` (which lasted ``previous_s``) to ``stage``."""

    round: int
    attempt: int
    stage: str
    previous: str
    previous_s: float
    time: float


@dataclass(frozen=True, slots=True)
class CohortFixed:
    round: int
    attempt: int
    members: tuple[str, ...]
    time: float


@dataclass(frozen=True, slots=True)
class ContributionAccepted:
    round: int
    attempt: int
    member: str
    bytes: int


@dataclass(frozen=True, slots=True)
class ContributionRefused:
    """A masked input refused with error ``code`` (every refusal, logged or not).
    ``in_cohort``: the attempt exists and ``member`` is in its cohort (what the
    transparency log records, within bounds); False for a made-up round or an outsider."""

    round: int
    attempt: int
    member: str
    code: str
    time: float
    in_cohort: bool


@dataclass(frozen=True, slots=True)
class PrivacyReported:
    round: int
    attempt: int
    member: str
    epsilon: float
    epsilon_budget: float | None  # what the member declared in its signed report


@dataclass(frozen=True, slots=True)
class RoundEnded:
    """An attempt closed (``summary.stage == "closed"``, a new model version) or aborted.

    ``last_stage`` lasted ``last_stage_s``; ``reason`` is the abort's error code (empty
    for a close); ``survivors`` are the members whose inputs are in the sum.
    """

    summary: wire.RoundSummary
    last_stage: str
    last_stage_s: float
    reason: str
    survivors: tuple[str, ...]
    time: float

    @property
    def dropped(self) -> int:
        """Cohort members whose input is not in the attempt's sum (all of an aborted one)."""
        s = self.summary
        return max(s.cohort - s.survivors, 0) if s.stage == "closed" else s.cohort


@dataclass(frozen=True, slots=True)
class ModelEvaluated:
    """Members' federated evaluation of the model ``round``.``attempt`` produced: each
    metric's value pooled over the ``members`` who reported so far (``records``
    held-out records in all); ``complete`` once every survivor of the round reported."""

    round: int
    attempt: int
    model_version: int
    metrics: dict[str, float]
    members: int
    records: int
    complete: bool


@dataclass(frozen=True, slots=True)
class ModelProblem:
    """A stored model version is unusable; the last good one is served."""

    version: int
    reason: str
    serving: int


@dataclass(frozen=True, slots=True)
class MemberQuarantined:
    """A member is suspended from future cohorts: the control-sample audit failed its
    contribution to ``round``.``attempt``; ``rollback_to`` is the last model before it."""

    member: str
    round: int
    attempt: int
    issuer: str
    rollback_to: int


#: Events kept from before the first listener subscribed (a coordinator's start-up: the
#: attempt it opens, the unusable models it finds); start-up emits a handful.
STARTUP_BACKLOG = 100


class EventBus:
    """Delivers each event to every listener, in subscription order.

    What is emitted before anyone listens (the coordinator's start-up, when operations
    are attached to an already built coordinator) is kept, up to
    :data:`STARTUP_BACKLOG` events, and handed to listeners that ask for it.
    """

    def __init__(self) -> None:
        self._listeners: list[Listener] = []
        self._backlog: list[Event] = []

    def subscribe(self, listener: Listener, *, replay: bool = False) -> None:
        """Call ``listener`` with every event from now on; with ``replay``, first with
        those emitted before the first listener subscribed."""
        if replay:
            for event in self._backlog:
                self._deliver(listener, event)
        self._listeners.append(listener)

    def emit(self, event: Event) -> None:
        if not self._listeners and len(self._backlog) < STARTUP_BACKLOG:
            self._backlog.append(event)
        for listener in self._listeners:
            self._deliver(listener, event)

    @staticmethod
    def _deliver(listener: Listener, event: Event) -> None:
        try:
            listener(event)
        except Exception:
            log.exception("event=listener_failed event_type=%s", type(event).__name__)


@dataclass(frozen=True, slots=True)
class AlertRaised:
    """A new operator alert.  ``ack_token`` is the capability its webhook deliveries
    carry for acknowledging it; it exists only in this event (the store keeps its hash)."""

    alert: AlertRow
    ack_token: str


Event = (
    RoundOpened
    | StageEntered
    | CohortFixed
    | ContributionAccepted
    | ContributionRefused
    | PrivacyReported
    | RoundEnded
    | ModelEvaluated
    | ModelProblem
    | AlertRaised
    | MemberQuarantined
)
Listener = Callable[[Event], None]
