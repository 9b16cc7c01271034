"""What the operator and the auditors see and order: round history, the federation's
status, alerts, audit verdicts, quarantine orders and the live dashboard."""

from __future__ import annotations

from typing import Annotated, ClassVar

import msgspec

from fedsec.protocol.body import Count, Id, MemberId, _Signed
from fedsec.protocol.stages import Stage

QUARANTINE_DOMAIN = "quarantine-order"


class RoundSummary(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    round: Id
    attempt: Id
    stage: Stage
    cohort: Count
    participants: Count
    survivors: Count
    dropped: list[str]
    model_version: Id | None
    accuracy: float | None
    loss: float | None
    aggregation_s: float | None
    duration_s: float | None
    epsilon_max: float | None
    detail: str
    bytes_up: Count = 0  # request bodies received from members during this attempt
    bytes_down: Count = 0  # response bodies sent to members during this attempt
    # trusted mode: member -> why the aggregation rule kept its accepted update out of
    # the aggregate (each is also in ``dropped`` and in the log's refused entries); the
    # member reads its own line here (at most the cohort, round.max_agents, entries)
    refused: dict[str, str] = msgspec.field(default_factory=dict)
    # distributed DP: the sum's realised noise multiplier; distributed DP or fewer codec
    # headroom bits: the sum's coordinates and those at the ring's edge (likely wraps:
    # wrap rate = edge_count / coordinates)
    noise_multiplier: float = 0.0
    coordinates: Count = 0
    edge_count: Count = 0
    # the task's primary metric (what dashboards and the degradation alert follow), its
    # direction, and every metric of the closed round's model where it was scored (the
    # loss as ``loss``); ``accuracy`` and ``loss`` above repeat two of them
    primary_metric: str = "accuracy"
    higher_is_better: bool = True
    metrics: dict[str, float] = msgspec.field(default_factory=dict)

    @property
    def score(self) -> float | None:
        """The primary metric's value, when the model was scored (a summary written
        before metrics were named has only ``accuracy``)."""
        if self.primary_metric in self.metrics:
            return self.metrics[self.primary_metric]
        return self.accuracy if self.primary_metric == "accuracy" else None


class FederationStatus(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    federation_id: str
    round: Id
    attempt: Id
    stage: Stage
    model_version: Id
    rounds_completed: Count
    rounds_target: Count
    finished: bool
    agents_active: Count
    history: list[RoundSummary]
    alerts: list[str]


# An audit check's name (``weights``, ``loss``, ...): short, so a list of them is bounded.
CheckName = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[a-z0-9_]+$")]


class AlertAck(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A webhook receiver acknowledges an alert with the capability its delivery carried."""

    token: Annotated[str, msgspec.Meta(min_length=64, max_length=64, pattern=r"^[0-9a-f]{64}$")]


class AlertView(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    id: Count
    kind: str
    subject: str
    detail: str
    raised_at: float
    acked_at: float | None
    acked_by: str | None


class AuditVerdict(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An auditor's control-sample verdict on one member's contribution to one attempt
    (what ``fedsec audit check`` decides); ``failed`` names the failed checks."""

    round: Id
    attempt: Id
    member: MemberId
    passed: bool
    failed: Annotated[list[CheckName], msgspec.Meta(max_length=32)] = msgspec.field(
        default_factory=list
    )

    def __post_init__(self) -> None:
        # one reading for the dashboard, the alerts and the quarantine rules alike
        if self.passed and self.failed:
            raise ValueError(
                f"verdict on {self.member} round {self.round}.{self.attempt} says passed but "
                f"lists failed checks: {', '.join(self.failed)}"
            )


class QuarantineOrder(_Signed, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """An order to suspend a member from future cohorts after the control-sample audit
    failed its contribution to ``round`` (its first failed round), signed by its
    ``issuer``: ``admin`` (the federation's admin key, as roster entries are) or the
    auditor who judged it (its roster key)."""

    DOMAIN: ClassVar[str] = QUARANTINE_DOMAIN

    federation_id: str
    member: MemberId
    round: Id
    attempt: Id
    issuer: MemberId  # "admin", or the auditor's roster id
    failed: Annotated[list[CheckName], msgspec.Meta(max_length=32)] = msgspec.field(
        default_factory=list
    )
    reason: Annotated[str, msgspec.Meta(max_length=1000)] = ""
    issued_at: float = 0.0
    signature: str = ""


class QuarantineAnswer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the aggregator made of a quarantine order."""

    member: str
    quarantined: bool  # True: suspended by this order; False: it already was
    since_round: Id  # the failed round the quarantine names
    rollback_to: Id  # the last model version before that round
    detail: str


class VerdictSubmission(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    verdicts: Annotated[list[AuditVerdict], msgspec.Meta(max_length=10_000)]


class VerdictReceipt(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    stored: Count  # verdicts new to the aggregator
    already: Count  # verdicts it held already (same auditor, member and attempt)
    alerts: Count  # audit_failed alerts raised
    quarantined: Count = 0  # members quarantined by them (audit.quarantine_on_failure)


class LiveAttempt(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The attempt in progress, as the dashboard shows it."""

    round: Id
    attempt: Id
    stage: Stage
    opened_at: float
    stage_started_at: float
    deadline_at: float | None  # when the stage closes at the latest; None: no deadline
    cohort: Count  # members in the fixed cohort (0 while open)
    joined: Count  # members that joined this attempt
    accepted: Count  # contributions accepted so far
    refused: Count  # contributions refused so far
    dropped: Count  # cohort members that missed a stage already closed
    rounds_completed: Count
    rounds_target: Count
    finished: bool
    secure_sum: str
    mode: str
    model_version: Id


class MemberView(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    id: str
    role: str
    active: bool
    last_seen: float | None  # its last authenticated request since the aggregator started
    rounds_contributed: Count
    epsilon: float | None  # the largest epsilon it reported
    epsilon_budget: float | None  # the budget its reports declare (or [alerts] assumes)
    audits_passed: Count
    audits_failed: Count
    last_failure: str  # "round R.A: check,check" of its latest failed verdict, or ""
    # its latest signed data summary (task table): records and quality score
    records: Count | None = None
    quality: float | None = None


class ModelView(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    version: Id
    parent: Id | None
    round: Id | None
    kind: str
    sha256: str
    created: float
    accuracy: float | None
    loss: float | None
    note: str
    rollback: bool  # a rollback version (it holds an earlier version's weights)
    latest: bool  # the version served now
    # the task's primary metric and every metric recorded in the version's manifest
    primary_metric: str = "accuracy"
    metrics: dict[str, float] = msgspec.field(default_factory=dict)
    # validation.federated: the members' pooled metrics of this version, and how many
    # members they pool (0: none reported yet)
    evaluated: dict[str, float] = msgspec.field(default_factory=dict)
    evaluators: Count = 0


class DashboardSnapshot(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything the dashboard shows, at ``generated_at``.  Aggregates only: no update,
    key or share of any member."""

    federation_id: str
    generated_at: float
    now: LiveAttempt
    rounds: list[RoundSummary]
    members: list[MemberView]
    alerts: list[AlertView]
    models: list[ModelView]
    # this process's part among replicas sharing one database (leader, standby, or
    # single on SQLite) and, while it leads, its lease's fencing token (a counter, not
    # a secret), as it knows them
    role: str = "single"
    fencing: int | None = None
