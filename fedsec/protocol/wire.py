"""Message schemas of the aggregator's HTTP API, shared by agent and aggregator.

Control messages are JSON decoded into msgspec Structs that refuse unknown
fields; binary values travel as lowercase hex (keys, signatures, shares) or
as raw request bodies (masked input vectors, model files).  The request
signature (RFC 9421, :mod:`fedsec.crypto.httpsig`) authenticates every agent
request; objects that must stay verifiable after the request (round specs,
privacy reports, receipts, key advertisements) carry their own Ed25519
signature with a domain of their own.

The endpoints that carry these messages (method, path, body and answer, roles,
body limit) are declared once, in :mod:`fedsec.protocol.endpoints`; ``docs/api.md``
holds the table generated from it.

This module is the one name every party imports messages by.  Their definitions sit
by concern and are re-exported here: the field types, the decoder and the signed base
in :mod:`fedsec.protocol.body` (its *Numbers* says which floats a message may hold),
the round spec in :mod:`fedsec.protocol.spec`, and the operator's views and orders in
:mod:`fedsec.protocol.oversight`.

Errors: 4xx with ErrorBody ``{"error": code, "detail": sentence}``.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Iterable
from typing import Annotated, ClassVar, Literal

import msgspec

from fedsec.crypto.identity import canonical_json
from fedsec.errors import PayloadError
from fedsec.protocol.body import (
    Count,
    HexDigest,
    Id,
    MemberId,
    NonNegative,
    Probability,
    _Signed,
    check_finite,
    decode,
    encode,
    non_finite,
    parse_uint,
    unhex,
)
from fedsec.protocol.data_schema import ObservedSchema
from fedsec.protocol.evaluation import (
    EVALUATION_REPORT_DOMAIN,
    EvaluationReport,
    MetricSum,
)
from fedsec.protocol.he_messages import (
    HE_CONTEXT_DOMAIN,
    HE_DECRYPTION_DOMAIN,
    DecryptionStatement,
    HeContext,
    HeContextStatement,
    HeSumOffer,
)
from fedsec.protocol.limits import MAX_COHORT, MAX_COUNT, MAX_ID, MAX_UNREPORTED_CHARGES
from fedsec.protocol.oversight import (
    QUARANTINE_DOMAIN,
    AlertAck,
    AlertView,
    AuditVerdict,
    CheckName,
    DashboardSnapshot,
    FederationStatus,
    LiveAttempt,
    MemberView,
    ModelView,
    QuarantineAnswer,
    QuarantineOrder,
    RoundSummary,
    VerdictReceipt,
    VerdictSubmission,
)
from fedsec.protocol.spec import (
    PLAIN_CODEC,
    ROUND_SPEC_DOMAIN,
    AggregationRule,
    AggregationSpec,
    CodecSpec,
    DPSpec,
    RoundSpec,
    SecureSum,
    TaskPin,
    TrainingSpec,
)
from fedsec.protocol.stages import Stage

# Defined by concern in the modules above; every party imports them from here.
__all__ = [
    "EVALUATION_REPORT_DOMAIN",
    "HE_CONTEXT_DOMAIN",
    "HE_DECRYPTION_DOMAIN",
    "PLAIN_CODEC",
    "QUARANTINE_DOMAIN",
    "ROUND_SPEC_DOMAIN",
    "AggregationRule",
    "AggregationSpec",
    "AlertAck",
    "AlertView",
    "AuditVerdict",
    "CheckName",
    "CodecSpec",
    "Count",
    "DPSpec",
    "DashboardSnapshot",
    "DecryptionStatement",
    "EvaluationReport",
    "FederationStatus",
    "HeContext",
    "HeContextStatement",
    "HeSumOffer",
    "HexDigest",
    "Id",
    "LiveAttempt",
    "MemberId",
    "MemberView",
    "MetricSum",
    "ModelView",
    "NonNegative",
    "Probability",
    "QuarantineAnswer",
    "QuarantineOrder",
    "RoundSpec",
    "RoundSummary",
    "SecureSum",
    "TaskPin",
    "TrainingSpec",
    "VerdictReceipt",
    "VerdictSubmission",
    "check_finite",
    "decode",
    "encode",
    "non_finite",
    "parse_uint",
    "unhex",
]

API_PREFIX = "/v1"

#: The error code of a replica that does not lead (a standby, or a deposed leader), and
#: the header of that answer naming the URL the leader advertised.  A client follows
#: the header only to an aggregator URL it was configured with.
NOT_LEADER = "not_leader"
LEADER_HEADER = "Fedsec-Leader"

PRIVACY_REPORT_DOMAIN = "privacy-report"
RECEIPT_DOMAIN = "contribution-receipt"
CONTRIBUTION_DOMAIN = "contribution-statement"
HE_COMMITMENT_DOMAIN = "he-ciphertext-commitment"
DATA_SUMMARY_DOMAIN = "data-summary"


class RoundState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What an agent polls: the current round, its stage and, once fixed, its spec."""

    federation_id: str
    round: Id
    attempt: Id
    stage: Stage
    token: Count  # changes whenever anything an agent waits for changes
    model_version: Id
    rounds_completed: Count
    rounds_target: Count  # 0 = run until stopped
    finished: bool
    spec: RoundSpec | None = None
    detail: str = ""
    mode: Literal["sync", "buffered"] = "sync"
    # buffered mode: the signed plan members train by before joining (no cohort yet)
    plan: RoundSpec | None = None
    # changes whenever the roster does: members refetch the roster only then
    roster_serial: Count = 0
    # audit challenges issued so far (it only grows): members fetch their open
    # challenges only when it changed, not with a signed request every round
    challenges_issued: Count = 0


class DataSummary(_Signed, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """What leaves a member about its data: counts and rates, never a record.

    Made by ``fedsec.data.summary.data_summary`` and signed by the member, so the
    aggregator's check at join and the auditor's reading of the log rest on the member's
    own statement.  With ``count_epsilon`` > 0 the counts carry Laplace noise of that
    epsilon (charged to the member's ledger); 0 means exact counts.
    """

    DOMAIN: ClassVar[str] = DATA_SUMMARY_DOMAIN

    federation_id: str
    member: MemberId
    records: Count
    label_counts: dict[str, Count]
    missing_rate: dict[str, float]  # used column -> share of rows missing it, before rules
    schema_fingerprint: str  # of the federation schema the member encoded with
    observed: ObservedSchema
    label_coverage: float  # share of the federation's classes present locally
    quality_score: float  # label_coverage x (1 - mean missing rate), in [0, 1]
    count_epsilon: float = 0.0
    signature: str = ""


class JoinRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    dataset_schema: str  # schema fingerprint of the agent's local data
    task_version: str
    samples: Count
    base_version: Id | None = None  # buffered mode: the model version the update is from
    # federations with a [schema]: the member's signed data summary
    data_summary: DataSummary | None = None
    # SecAgg+: hex SHA-256 commitment to the member's graph nonce (secagg.messages)
    graph_commitment: Annotated[str, msgspec.Meta(pattern=r"^([0-9a-f]{64})?$")] = ""
    # the task package the member installed (fedsec.task.digest); the aggregator refuses
    # a join whose pin is not its own. Optional on the wire only so that the message
    # decodes the same everywhere; a join without one is refused (cohort.py)
    task_pin: TaskPin | None = None


class JoinResponse(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    accepted: bool
    detail: str


class ChargeRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One training the member's ledger was charged for: its place in the dataset's
    charge history, the round it was charged for, and what the accountant composes."""

    index: Id
    round: Id
    noise_multiplier: Annotated[float, msgspec.Meta(gt=0)]
    sample_rate: Annotated[float, msgspec.Meta(gt=0, le=1)]
    steps: Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)]


class PrivacyReport(_Signed, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """The agent's signed account of the privacy it spends in this round."""

    DOMAIN: ClassVar[str] = PRIVACY_REPORT_DOMAIN

    federation_id: str
    round: Id
    attempt: Id
    member: str
    dataset_id: str
    epsilon: NonNegative  # total spent on this dataset after this round, all rounds included
    delta: Annotated[float, msgspec.Meta(ge=0, lt=1)]
    noise_multiplier: NonNegative  # 0: trained without DP
    sample_rate: Probability
    steps: Count
    samples: Count
    signature: str = ""
    # the round whose training this reports (buffered members train before the round
    # they contribute to; a retried attempt reuses its training); -1 = ``round``
    trained_round: Annotated[int, msgspec.Meta(ge=-1, le=MAX_ID)] = -1
    # the member's total budget for this dataset (privacy.epsilon); 0 = not said.  Lets
    # the operator see a member nearing its budget before it stops contributing.
    epsilon_budget: NonNegative = 0.0
    # the part of ``epsilon`` spent on pure ε-DP releases of the dataset (noised counts of
    # its data summaries), added by basic composition; the rest is DP-SGD's
    extra_epsilon: NonNegative = 0.0
    # the mode ``epsilon`` holds in, and, distributed, the fewest members who must add
    # their noise share honestly for it to hold against the aggregator
    dp_mode: Literal["local", "distributed"] = "local"
    honest_survivors: Count = 0
    # the place of this report's training in the dataset's charge history (0 = the
    # first training ever charged); -1 = not said (keyed by ``trained_round`` instead)
    charge: Annotated[int, msgspec.Meta(ge=-1, le=MAX_ID)] = -1
    # earlier charges whose reports the aggregator never took, so that ``epsilon``,
    # which composes them too, can be recomputed from the log alone
    unreported: Annotated[list[ChargeRecord], msgspec.Meta(max_length=MAX_UNREPORTED_CHARGES)] = (
        msgspec.field(default_factory=list)
    )

    def check_charges(self) -> None:
        """Raises PayloadError: the declared charges are not distinct earlier ones, in
        order, with finite noise; or are declared without this report's own charge."""
        indexes = [c.index for c in self.unreported]
        if indexes and self.charge < 0:
            raise PayloadError(
                f"{self.member}: privacy report declares earlier charges but not its own"
            )
        if any(b <= a for a, b in itertools.pairwise(indexes)) or any(
            i >= self.charge for i in indexes
        ):
            raise PayloadError(
                f"{self.member}: privacy report's unreported charges must be distinct, "
                f"ascending and before its own charge {self.charge}"
            )
        if not all(math.isfinite(c.noise_multiplier) for c in self.unreported):
            raise PayloadError(
                f"{self.member}: privacy report's unreported charges need a finite noise"
            )


class AdvertiseKeysBody(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True
):
    enc_public: str
    mask_public: str
    signature: str
    graph_nonce: str = ""  # hex: opens the member's graph commitment in the spec


class KeyEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    member: str
    enc_public: str
    mask_public: str
    signature: str
    graph_nonce: str = ""


class KeyListBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    entries: list[KeyEntry]


class OutgoingShare(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    recipient: str
    ciphertext: str


class ShareKeysBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    shares: list[OutgoingShare]
    # The member's privacy report for this attempt, carried instead of a separate
    # POST /report: the privacy is charged before training, so the report is ready
    # when the shares go out.  Stored and logged as its own entry, never as part of
    # the shares message.
    report: PrivacyReport | None = None


class IncomingShare(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    sender: str
    ciphertext: str


class ShareRelayBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    participants: list[str]
    shares: list[IncomingShare]


class UnmaskRequestBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    survivors: list[str]
    dropped: list[str]
    # the round-state token when this was answered: long-poll GET /round with it to
    # wait for the round to close without first fetching the unmask state again
    state_token: Count | None = None


class ConsistencyBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A survivor's signature (hex) on the survivor sets of its unmask request."""

    signature: str


class MemberSignature(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    member: MemberId
    signature: str


class ConsistencyProofBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The survivor sets and the caller's neighbours' signatures on them: a survivor
    unmasks only on ``threshold`` valid ones for the sets it signed itself."""

    survivors: Annotated[list[MemberId], msgspec.Meta(max_length=MAX_COHORT)]
    dropped: Annotated[list[MemberId], msgspec.Meta(max_length=MAX_COHORT)]
    signatures: Annotated[list[MemberSignature], msgspec.Meta(max_length=MAX_COHORT)]
    # as in UnmaskRequestBody: the round-state token when this was answered
    state_token: Count | None = None


class Accepted(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Answer to a SecAgg+ upload: accepted, and, when the request asked to ``wait``
    and the round reached the next stage in time, that stage's data for the caller
    (one request instead of long-polling the round and then fetching it)."""

    accepted: bool
    keys: KeyListBody | None = None  # POST advertise: the relayed key list
    relay: ShareRelayBody | None = None  # POST shares: the shares addressed to the caller
    proof: ConsistencyProofBody | None = None  # POST consistency: the caller's proof
    # POST commit (homomorphic summation): the attempt's commitment set, once fixed
    commitments: CommitmentSetBody | None = None
    state: RoundState | None = None  # POST unmask: the round state once the attempt is over


class UnmaskResponseBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    seed_shares: dict[str, str]
    key_shares: dict[str, str]


class ContributionStatement(_Signed, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A member's signed statement of what it contributed to a round attempt.

    Binds the exact bytes uploaded (``vector_sha256``) to the commitment
    H(salt ‖ quantized update) the auditor may later ask it to open.  Sent as the
    ``commitment`` and ``signature`` query parameters of the masked-input upload
    (covered by the request signature) and written into the transparency log.
    """

    DOMAIN: ClassVar[str] = CONTRIBUTION_DOMAIN

    federation_id: str
    round: Id
    attempt: Id
    member: str
    vector_sha256: str
    commitment: str
    signature: str = ""
    # homomorphic summation: the digest of the attempt's commitment set the member was
    # shown (:func:`commitments_digest`); empty, and so omitted, in the other modes
    commitments_sha256: str = ""

    def verify(self, public_key: bytes) -> None:
        """Raises SignatureError (or PayloadError for a malformed commitment)."""
        unhex(self.commitment, "commitment", 32)
        if self.commitments_sha256:
            unhex(self.commitments_sha256, "commitments_sha256", 32)
        super().verify(public_key)


class CiphertextCommitment(_Signed, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A member's signed commitment, in stage ``commit`` of a homomorphic attempt, to the
    SHA-256 of the exact ciphertext bytes it will upload in ``masked_input``.

    Every commitment is fixed before any ciphertext is accepted or served, so no member
    can upload a ciphertext made from another's (``Enc(c) − Σ others`` cancels them).
    Logged as the ``commit`` accepted entry's ``commitment`` and ``signature``.
    """

    DOMAIN: ClassVar[str] = HE_COMMITMENT_DOMAIN

    federation_id: str
    round: Id
    attempt: Id
    member: str
    vector_sha256: str
    signature: str = ""

    def verify(self, public_key: bytes) -> None:
        """Raises SignatureError (or PayloadError for a malformed hash)."""
        unhex(self.vector_sha256, "vector_sha256", 32)
        super().verify(public_key)


class CommitBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``POST commit``: the SHA-256 (hex) of the ciphertext the member will upload and
    its signature (hex) of the :class:`CiphertextCommitment` binding it."""

    vector_sha256: str
    signature: str


class MemberCommitment(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    member: MemberId
    vector_sha256: str
    signature: str


class CommitmentSetBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An attempt's commitments once stage commit closed, sorted by member: each member
    binds their :func:`commitments_digest` into its contribution statement."""

    commitments: Annotated[list[MemberCommitment], msgspec.Meta(max_length=MAX_COHORT)]


def commitments_digest(commitments: Iterable[tuple[str, str]]) -> str:
    """SHA-256 (hex) of a commitment set: the canonical JSON of its (member,
    vector_sha256) pairs, sorted.  The same for every member shown the same set, so an
    aggregator that shows members different sets makes their statements disagree."""
    pairs = sorted([member, digest] for member, digest in commitments)
    return hashlib.sha256(canonical_json({"commitments": pairs})).hexdigest()


class Receipt(_Signed, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """The aggregator's signed acknowledgement that a contribution was accepted."""

    DOMAIN: ClassVar[str] = RECEIPT_DOMAIN

    federation_id: str
    round: Id
    attempt: Id
    member: str
    contribution_sha256: str
    log_index: Count
    issued_at: float
    signature: str = ""


class MaskedInputAnswer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Answer to ``POST masked-input?wait=S`` (without ``wait`` the answer is the bare
    Receipt): the receipt, held until the round reaches the unmask stage, with the
    caller's unmask request when it is a survivor."""

    receipt: Receipt
    unmask: UnmaskRequestBody | None = None


class ChallengeRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An auditor asks a member to open its committed update of one round attempt.

    ``beacon_index`` names a signed log head written after the round closed; its
    hash decides, with ``rate``, which members are challenged (fedsec.crypto.commitment
    ``challenged``), so no member can know in advance.
    """

    round: Id
    attempt: Id
    member: str
    beacon_index: Count
    rate: Probability


class Challenge(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    round: Id
    attempt: Id
    member: str
    auditor: str
    beacon_index: Count
    beacon: str
    rate: Probability
    log_index: Count


class ChallengeList(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    challenges: list[Challenge]


class RevealBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A member's answer: its quantized update and salt, sealed to the auditor's key."""

    round: Id
    attempt: Id
    auditor: str
    sealed: str  # hex


class Reveal(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    round: Id
    attempt: Id
    member: str
    auditor: str
    sealed: str
    log_index: Count


class RevealList(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    reveals: list[Reveal]


class RevealPayload(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a reveal holds once opened by the auditor."""

    federation_id: str
    round: Id
    attempt: Id
    member: str
    update: str  # hex of the quantized vector, little-endian in the round's ring dtype
    salt: str  # hex, 32 bytes


class ErrorBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    error: str
    detail: str
