"""The typed actions the agent's round machines ask for, and the events that answer them.

:class:`fedsec.agent.round.AgentRound` and :class:`fedsec.agent.follow.Follower` never
do I/O: each says what to do next (an action below) and takes the answer (an event).
Every action names the one event type that answers it (``answer``); any action may
instead be answered with :class:`Refused`, carrying the typed error (a 4xx answer,
a ledger refusal) for the machine to judge.  The runtime
(:mod:`fedsec.agent.runtime`) performs the actions through the aggregator client,
the privacy ledger, the vault and the training executor; the stage messages
(:class:`StageUpload`, :class:`StageFetch`, :class:`SendMaskedInput`) through the
member's message seam (:mod:`fedsec.agent.seam`), whatever the topology.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from fedsec.agent.charges import ChargeRequest, PrivacyCharge
from fedsec.agent.vault import RoundRecord
from fedsec.crypto.quantize import RingVector
from fedsec.crypto.secagg import MaskedInput
from fedsec.errors import FedsecError, WrongStage
from fedsec.protocol.wire import (
    Accepted,
    AdvertiseKeysBody,
    CommitBody,
    CommitmentSetBody,
    ConsistencyBody,
    ConsistencyProofBody,
    ContributionStatement,
    FederationStatus,
    JoinRequest,
    JoinResponse,
    KeyListBody,
    PrivacyReport,
    Receipt,
    RoundSpec,
    RoundState,
    ShareKeysBody,
    ShareRelayBody,
    UnmaskRequestBody,
    UnmaskResponseBody,
)

T = TypeVar("T")

#: what a member uploads at a stage, and what a stage answers it
UploadBody = AdvertiseKeysBody | ShareKeysBody | ConsistencyBody | CommitBody | UnmaskResponseBody
StageAnswer = (
    KeyListBody | ShareRelayBody | UnmaskRequestBody | ConsistencyProofBody | CommitmentSetBody
)

OutcomeStatus = Literal["closed", "refused", "aborted", "missed", "dropped"]


@dataclass(frozen=True)
class RoundOutcome:
    """How one round attempt in which this agent was in the cohort ended for it.

    ``status``: ``closed`` (contributed; the round aggregated), ``refused`` (the
    update was accepted and receipted, but the round's aggregation rule kept it out
    of the aggregate: the reason, from the round summary, in ``detail``), ``aborted``
    (the attempt was abandoned; another may follow), ``missed`` (a stage passed
    before the agent was ready), ``dropped`` (a round-local error, in ``detail``).
    """

    round: int
    attempt: int
    status: OutcomeStatus
    model_version: int
    epsilon: float | None = None
    samples: int = 0
    weight: float | None = None
    receipt: Receipt | None = None
    detail: str = ""
    #: coordinates a compressed codec rounded for this attempt, and how many of them it
    #: clamped to its rounding range (a range too narrow for this member's updates)
    rounded: int = 0
    saturated: int = 0


# ------------------------------------------------------------------------------ events


class Event:
    """An answer to an action."""


@dataclass(frozen=True)
class Refused(Event):
    """The action failed with ``error``: a refusal of the aggregator, the ledger or the
    vault.  The machine decides whether it ends the attempt or the agent."""

    error: FedsecError


@dataclass(frozen=True)
class TrainingFailed(Refused):
    """Local training (or the model download before it) failed with ``error``."""


@dataclass(frozen=True)
class RoundObserved(Event):
    state: RoundState


@dataclass(frozen=True)
class Done(Event):
    """No answer expected: there is nothing left to do (the last action is Finish)."""


@dataclass(frozen=True)
class RosterFetched(Event):
    keys: Mapping[str, bytes]  # active agent id -> Ed25519 public key, verified


@dataclass(frozen=True)
class Charged(Event):
    charge: PrivacyCharge


@dataclass(frozen=True)
class BudgetChecked(Event):
    pass


@dataclass(frozen=True)
class TrainingStarted(Event):
    pass


@dataclass(frozen=True, eq=False)
class Trained(Event):
    delta: npt.NDArray[np.float32]  # local model - global model


@dataclass(frozen=True)
class JoinAnswered(Event):
    answer: JoinResponse


@dataclass(frozen=True)
class UploadAnswered(Event):
    answer: Accepted


@dataclass(frozen=True)
class StageData(Event):
    """A stage's answer for this member, through the seam (:mod:`fedsec.agent.seam`):
    a ``kind``, the wire struct that names the stage."""

    kind: ClassVar[type] = object
    body: StageAnswer


@dataclass(frozen=True)
class KeysFetched(StageData):
    kind: ClassVar[type] = KeyListBody
    body: KeyListBody


@dataclass(frozen=True)
class SharesFetched(StageData):
    kind: ClassVar[type] = ShareRelayBody
    body: ShareRelayBody


@dataclass(frozen=True)
class UnmaskFetched(StageData):
    kind: ClassVar[type] = UnmaskRequestBody
    body: UnmaskRequestBody


@dataclass(frozen=True)
class ProofFetched(StageData):
    kind: ClassVar[type] = ConsistencyProofBody
    body: ConsistencyProofBody


@dataclass(frozen=True)
class CommitmentsFetched(StageData):
    kind: ClassVar[type] = CommitmentSetBody
    body: CommitmentSetBody


@dataclass(frozen=True)
class Masked(Event):
    masked: MaskedInput


@dataclass(frozen=True)
class Encrypted(Event):
    body: bytes  # the framed ciphertexts of the quantized update (fedsec.crypto.he)


@dataclass(frozen=True)
class UpdateKept(Event):
    salt: bytes  # the commitment salt the vault keeps with the update


@dataclass(frozen=True)
class MaskedInputAnswered(Event):
    receipt: Receipt
    unmask: UnmaskRequestBody | None = None  # held until unmask (SecAgg+, ``wait`` > 0)


@dataclass(frozen=True)
class ReceiptFetched(Event):
    receipt: Receipt


@dataclass(frozen=True)
class StatusFetched(Event):
    status: FederationStatus


@dataclass(frozen=True)
class Passed(Event):
    """A plain acknowledgement: reported, recorded, a fault point passed."""


@dataclass(frozen=True)
class Participated(Event):
    outcome: RoundOutcome
    following: RoundState | None  # the newest state the round saw, None to poll afresh


# ----------------------------------------------------------------------------- actions


class Action:
    """Something for the runtime to do; ``answer`` is the event it expects back."""

    answer: ClassVar[type[Event]] = Passed


@dataclass(frozen=True)
class Poll(Action):
    """The next round state: at once (``token`` None) or long-polled on ``token``.
    Temporary refusals are outlived by the runtime, which asks again."""

    answer: ClassVar[type[Event]] = RoundObserved
    token: int | None


@dataclass(frozen=True)
class FetchRoster(Action):
    """The admin-signed roster's active agents, verified against the pinned admin key."""

    answer: ClassVar[type[Event]] = RosterFetched
    federation_id: str
    serial: int


@dataclass(frozen=True)
class Charge(Action):
    """Charge the privacy ledger (checked and recorded in one locked step)."""

    answer: ClassVar[type[Event]] = Charged
    request: ChargeRequest


@dataclass(frozen=True)
class ReportTaken(Action):
    """The aggregator took the report of charge ``index``: mark it, and the earlier
    charges it declared, reported in the ledger (answered Passed)."""

    index: int


@dataclass(frozen=True)
class CheckBudget(Action):
    """Refuse (BudgetExhausted) unless the budget could pay ``cost`` for ``round``."""

    answer: ClassVar[type[Event]] = BudgetChecked
    round: int
    cost: tuple[float, float, int]  # noise multiplier, sample rate, steps


@dataclass(frozen=True)
class Train(Action):
    """Start training on ``spec``'s model (downloaded and verified) in the background.
    Answered TrainingStarted at once; Trained or TrainingFailed follows when done."""

    answer: ClassVar[type[Event]] = TrainingStarted
    spec: RoundSpec
    charge: PrivacyCharge


@dataclass(frozen=True)
class AwaitTraining(Action):
    answer: ClassVar[type[Event]] = Trained


@dataclass(frozen=True)
class Join(Action):
    answer: ClassVar[type[Event]] = JoinAnswered
    round: int
    attempt: int
    request: JoinRequest


@dataclass(frozen=True)
class Report(Action):
    """Send the signed privacy report on its own (``POST /report``)."""

    round: int
    attempt: int
    report: PrivacyReport


@dataclass(frozen=True)
class StageUpload(Action):
    """Send this stage's upload through the seam (:mod:`fedsec.agent.seam`); the answer
    may be held ``wait`` seconds and carry the next stage's data."""

    answer: ClassVar[type[Event]] = UploadAnswered
    round: int
    attempt: int
    body: UploadBody
    wait: float


@dataclass(frozen=True)
class StageFetch(Action):
    """Await a stage's answer for this member through the seam, ``wait`` seconds at
    most (a refusal WrongStage: not there yet when the wait ended)."""

    answer: ClassVar[type[StageData]] = StageData
    round: int
    attempt: int
    wait: float


@dataclass(frozen=True)
class Advertise(StageUpload):
    body: AdvertiseKeysBody  # the answer may carry the key list


@dataclass(frozen=True)
class FetchKeys(StageFetch):
    answer: ClassVar[type[StageData]] = KeysFetched


@dataclass(frozen=True)
class SendShares(StageUpload):
    body: ShareKeysBody  # ... our share relay


@dataclass(frozen=True)
class FetchShares(StageFetch):
    answer: ClassVar[type[StageData]] = SharesFetched


@dataclass(frozen=True)
class Mask(Action):
    """Add the SecAgg+ masks: ``compute`` is pure CPU work, which the runtime runs on
    the event loop or in a worker thread depending on ``dim``."""

    answer: ClassVar[type[Event]] = Masked
    dim: int
    compute: Callable[[], MaskedInput] = field(compare=False)


@dataclass(frozen=True, eq=False)
class Encrypt(Action):
    """Homomorphic summation: encrypt the quantized update under the federation's public
    CKKS context, the one ``spec`` names (fetched once, its custodian's statement
    verified against the admin-signed roster)."""

    answer: ClassVar[type[Event]] = Encrypted
    spec: RoundSpec
    quantized: RingVector


@dataclass(frozen=True, eq=False)
class KeepUpdate(Action):
    """Keep the quantized update in the vault for audits (once per attempt)."""

    answer: ClassVar[type[Event]] = UpdateKept
    round: int
    attempt: int
    quantized: RingVector


@dataclass(frozen=True)
class SendMaskedInput(Action):
    answer: ClassVar[type[Event]] = MaskedInputAnswered
    round: int
    attempt: int
    vector: bytes
    statement: ContributionStatement
    wait: float  # SecAgg+: the aggregator may hold the answer for our unmask request


@dataclass(frozen=True)
class FetchReceipt(Action):
    answer: ClassVar[type[Event]] = ReceiptFetched
    round: int


@dataclass(frozen=True)
class Evaluate(Action):
    """Federated evaluation (the spec's ``federated_evaluation``): score model
    ``model_version``, which attempt ``attempt`` of round ``round`` produced, on our
    held-out split and send the signed report (``POST /evaluation``)."""

    federation_id: str
    round: int
    attempt: int
    model_version: int
    max_records: int  # the spec's max_weight_samples: the most records a report may count


@dataclass(frozen=True)
class FetchStatus(Action):
    """``GET /status``: the round summaries, where a refused member reads why."""

    answer: ClassVar[type[Event]] = StatusFetched


@dataclass(frozen=True)
class Release(Action):
    """Record in the ledger, before the masked input is sent, that the update trained
    on charge ``index`` (-1: none) goes into this attempt's SecAgg+ sum."""

    round: int
    attempt: int
    index: int


@dataclass(frozen=True)
class Record(Action):
    """Store the checked receipt and the agent's own record of the contribution."""

    receipt: Receipt
    record: RoundRecord


@dataclass(frozen=True)
class FetchUnmask(StageFetch):
    answer: ClassVar[type[StageData]] = UnmaskFetched


@dataclass(frozen=True)
class SendConsistency(StageUpload):
    body: ConsistencyBody  # ... our consistency proof


@dataclass(frozen=True)
class FetchProof(StageFetch):
    answer: ClassVar[type[StageData]] = ProofFetched


@dataclass(frozen=True)
class SendCommit(StageUpload):
    """Homomorphic summation: commit to our ciphertext's hash before any is sent."""

    body: CommitBody  # ... the attempt's commitment set


@dataclass(frozen=True)
class FetchCommitments(StageFetch):
    answer: ClassVar[type[StageData]] = CommitmentsFetched


@dataclass(frozen=True)
class Unmask(StageUpload):
    body: UnmaskResponseBody  # ... the round state, once the attempt is over


@dataclass(frozen=True)
class RouteStages(Action):
    """Send this attempt's stage messages to ``url`` first: its shard group's server,
    as the verified spec names it (``round.group_servers``)."""

    answer: ClassVar[type[Event]] = Passed
    round: int
    attempt: int
    url: str


@dataclass(frozen=True)
class FaultPoint(Action):
    """A stage is complete: where a chaos test may crash the agent (fedsec.faults)."""

    round: int
    point: str


class RoundMachine(Protocol):
    """One attempt's machine as the runtime drives it
    (:class:`fedsec.agent.round.AgentRound`): named here so that the actions, which
    every machine imports, import no machine."""

    spec: RoundSpec

    @property
    def training(self) -> bool: ...

    @property
    def finished(self) -> Finish | None: ...

    def next(self) -> Action: ...

    def receive(self, event: Event) -> None: ...


@dataclass(frozen=True)
class Participate(Action):
    """Run ``round`` to its end."""

    answer: ClassVar[type[Event]] = Participated
    round: RoundMachine = field(compare=False)


@dataclass(frozen=True)
class AnswerChallenges(Action):
    """Answer pending audit challenges; a failure is logged, not fatal."""

    federation_id: str


@dataclass(frozen=True)
class Finish(Action):
    """Nothing left to do: for a round, its outcome and the newest state it saw; for
    the follower, the federation finished or enough rounds closed."""

    answer: ClassVar[type[Event]] = Done
    outcome: RoundOutcome | None = None
    following: RoundState | None = None


E = TypeVar("E", bound=Event)

#: A round machine's step: yields actions, is sent their answers, returns ``T``.
Step = Generator[Action, Event, T]


def ask(action: Action, answer: type[E]) -> Step[E]:
    """Yield ``action`` and return its answer; a Refused answer raises its error here,
    inside the step, so the step decides what that refusal means.

    Raises:
        FedsecError: the refusal's error.
        WrongStage: the answer is not the ``answer`` expected (a runtime bug).
    """
    event = yield action
    if isinstance(event, Refused):
        raise event.error
    if not isinstance(event, answer):
        raise WrongStage(f"{type(action).__name__} answered with {type(event).__name__}")
    return event
