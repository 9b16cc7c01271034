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

Numbers: every float of every message is finite, whichever the encoding.  JSON has
no NaN or infinity (msgspec refuses them, and literals that overflow), msgpack
(:mod:`fedsec.protocol.compact`) carries both, and the transparency log that stores
members' signed objects is standard JSON (``docs/audit-log.md``).  :func:`check_finite`
is the one check: every decoder of outside input runs it (:func:`decode`,
:func:`fedsec.protocol.compact.to_body`, :func:`fedsec.protocol.log_entries.decode_body`),
so a new ``float`` field is covered by declaring it.  A field's range beyond that is
declared with its type (:data:`NonNegative`, :data:`Probability`, or a ``msgspec.Meta``);
a rule between fields is the struct's ``__post_init__`` (it runs on decoding too, and
its ``ValueError`` becomes the decoder's refusal).

Errors: 4xx with ErrorBody ``{"error": code, "detail": sentence}``.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import re
from collections.abc import Iterable
from typing import Annotated, Any, ClassVar, Final, Literal, TypeVar

import msgspec

from fedsec.crypto.identity import PublicIdentity, SigningIdentity, canonical_json
from fedsec.crypto.quantize import QuantSpec
from fedsec.crypto.secagg.messages import SecAggParams
from fedsec.errors import PayloadError, PayloadTooLarge
from fedsec.protocol.data_schema import ObservedSchema
from fedsec.protocol.limits import MAX_COHORT, MAX_COUNT, MAX_ID, MAX_UNREPORTED_CHARGES
from fedsec.protocol.stages import Stage

API_PREFIX = "/v1"

#: A round, attempt or model version.
Id = Annotated[int, msgspec.Meta(ge=0, le=MAX_ID)]
#: A count, index or token.
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
MemberId = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
#: A float >= 0 (finite, as every float: :func:`check_finite`).
NonNegative = Annotated[float, msgspec.Meta(ge=0)]
#: A float in [0, 1]: a rate, share or probability.
Probability = Annotated[float, msgspec.Meta(ge=0, le=1)]
# Canonical ASCII decimal only: int() also takes "+1", " 1", "1_0" and non-ASCII digits,
# which would give one resource many spellings.
_UINT_RE: Final = re.compile(r"0|[1-9][0-9]{0,15}")

ROUND_SPEC_DOMAIN = "round-spec"
PRIVACY_REPORT_DOMAIN = "privacy-report"
RECEIPT_DOMAIN = "contribution-receipt"
CONTRIBUTION_DOMAIN = "contribution-statement"
HE_COMMITMENT_DOMAIN = "he-ciphertext-commitment"

SecureSum = Literal["secagg", "none", "he"]
#: How a trusted-mode attempt combines its members' updates (fedsec.learning.robust).
AggregationRule = Literal[
    "fedavg", "trimmed_mean", "median", "multi_krum", "centered_clipping", "dnc", "fltrust"
]
DATA_SUMMARY_DOMAIN = "data-summary"
HE_CONTEXT_DOMAIN = "he-context"
HE_DECRYPTION_DOMAIN = "he-decryption"
QUARANTINE_DOMAIN = "quarantine-order"


class TrainingSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    local_epochs: Count
    batch_size: Count
    lr: float
    optimizer: str


class DPSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A round's DP-SGD settings.  Fields holding their default are omitted, so specs
    of local-DP rounds keep the bytes, and the signatures, they had before the mode."""

    enabled: bool
    noise_multiplier: float
    max_grad_norm: float
    delta: float
    # "distributed": each member adds only a share of the noise, inside the SecAgg+ ring,
    # and the sum carries it all (fedsec.protocol.ddp, docs/privacy.md)
    mode: Literal["local", "distributed"] = "local"
    # distributed: every member's Poisson sampling rate q (one DP-SGD step per round)
    sample_rate: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0
    # distributed: the fewest survivors the round may close with; the noise is sized so
    # that this many shares already make the full noise
    min_survivors: Count = 0
    # distributed: the unit of privacy, one record (one DP-SGD step per round) or a
    # member's whole clipped update (DP-FedAvg)
    unit: Literal["record", "member"] = "record"


class AggregationSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """The aggregation rule of a trusted-mode attempt (``secure_sum = "none"``), as the
    federation's ``[aggregation]`` section sets it: the rule, its parameters and the
    acceptance thresholds.  Signed within the spec, so the auditor re-derives the
    aggregate with exactly these; a spec without it aggregates by plain FedAvg.  The
    valid ranges are :data:`fedsec.learning.robust.PARAMETERS`'.  Fields holding their
    default are omitted, as in every signed object."""

    rule: AggregationRule = "fedavg"
    trim_fraction: float = 0.1  # trimmed_mean: β, cut at each end of every coordinate
    byzantine: int = 1  # multi_krum, dnc: f, members assumed Byzantine
    krum_selected: int = 0  # multi_krum: m, updates averaged (0 = n − f)
    clip_radius: float = 0.5  # centered_clipping: τ
    clip_iterations: int = 3  # centered_clipping
    root_records: int = 100  # fltrust: records of the aggregator's root dataset
    min_trust_score: float = 0.0  # fltrust: refuse updates trusted less than this
    max_norm_ratio: float = 0.0  # any rule: refuse ‖Δ‖ over this × the median (0 = off)


class CodecSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """How a member encodes its update between clipping and masking, beyond the round's
    ``quant_bits`` rounding; every member and the aggregator derive the same stages from
    it (``fedsec.protocol.update_codec``).  The defaults are the plain pipeline: each
    coordinate rounded over [−clip, clip], every coordinate sent."""

    rotation: Literal["none", "hadamard"] = "none"  # shared randomised Hadamard rotation
    keep: float = 1.0  # fraction of coordinates sent: a shared random subset, from the seed
    # rounding range of a coordinate, ± this many × clip/√N (rotated coordinates are close
    # to N(0, ‖x‖²/N)); 0 = ±clip, the range no coordinate can leave
    range_stddevs: float = 0.0
    error_feedback: bool = False  # members carry what the codec dropped into the next round
    # with rotation: ring bits above quant_bits; 0 = ⌈log₂ n⌉, where no sum can wrap.  Fewer
    # let a coordinate's sum wrap: it is decoded centred and likely wraps are counted
    headroom_bits: int = 0

    @property
    def compresses(self) -> bool:
        """Whether any stage beyond plain rounding is on (the codec's compressed kind;
        error feedback alone keeps plain rounding)."""
        return (
            self.rotation != "none"
            or self.keep < 1.0
            or self.range_stddevs > 0
            or self.headroom_bits > 0
        )


#: The plain pipeline.  RoundSpec's default is this very object: msgspec omits a struct
#: field holding its default only when it *is* the default, so a spec built from an
#: all-default ``[codec]`` section passes this object, and keeps the bytes (and the
#: signatures) of specs made before the codec existed.
PLAIN_CODEC: Final = CodecSpec()


S = TypeVar("S", bound="_Signed")


class _Signed(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """An object that stays verifiable after its request: Ed25519 over its canonical JSON
    without the ``signature`` field, in a domain of its own (``DOMAIN``).  Fields holding
    their default are omitted, so adding an optional field later keeps old signatures
    valid."""

    DOMAIN: ClassVar[str] = ""

    def signed_bytes(self) -> bytes:
        fields = msgspec.to_builtins(self)
        fields.pop("signature", None)
        return canonical_json(fields)

    def sign(self: S, signer: SigningIdentity) -> S:
        return msgspec.structs.replace(
            self, signature=signer.sign(self.DOMAIN, self.signed_bytes()).hex()
        )

    def verify(self, public_key: bytes) -> None:
        """Raises SignatureError unless signed by ``public_key`` (PayloadError: not hex)."""
        signature = _unhex(str(getattr(self, "signature", "")), "signature")
        PublicIdentity(public_key).verify(self.DOMAIN, self.signed_bytes(), signature)


class RoundSpec(_Signed, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """The signed contract of one round attempt; fixed when the cohort is.

    Signed objects omit fields that hold their default, so adding an optional field
    later leaves every earlier signature valid.
    """

    DOMAIN: ClassVar[str] = ROUND_SPEC_DOMAIN

    federation_id: str
    round: Id
    attempt: Id
    secure_sum: SecureSum
    model_version: Id
    model_sha256: str
    task: str
    task_version: str
    schema_fingerprint: str
    cohort: list[str]
    neighbors: Count
    threshold: Count
    quant_bits: Count
    ring_bits: Count
    clip_norm: float
    dim: Count
    seed: str  # hex, 32 bytes: the neighbour graph
    max_weight_samples: Count  # sample count at which a member's weight reaches 1
    weight_caps: dict[str, float]  # member -> cap on its weight w (roster max-weight)
    training: TrainingSpec
    dp: DPSpec
    deadlines: dict[str, float]  # stage -> seconds it may last
    signature: str = ""
    mode: Literal["sync", "buffered"] = "sync"
    # buffered mode: member -> staleness τ (current version − the version it trained on);
    # the member scales its weight by (1 + τ)^-½ before masking
    staleness: dict[str, Count] = msgspec.field(default_factory=dict)
    # homomorphic summation: the SHA-256 of the custodian-signed public CKKS context every
    # member encrypts under, and the custodian's roster id (empty in other modes)
    he_context_sha256: str = ""
    custodian: str = ""
    # he.model_visible_to_aggregator = false: the custodian derives the model and seals it
    # (with the sum) to the members, auditors and itself; the aggregator stores it unread
    he_model_hidden: bool = False
    # trusted mode: the robust aggregation rule and its thresholds; None = plain FedAvg
    aggregation: AggregationSpec | None = None
    # the update codec between clipping and masking; the default is the plain pipeline
    codec: CodecSpec = PLAIN_CODEC
    # SecAgg+: each cohort member's commitment (hex) to its graph nonce, in cohort order;
    # the neighbour graph comes from the nonces they reveal when they advertise
    graph_commitments: list[str] = msgspec.field(default_factory=list)

    def quant_spec(self) -> QuantSpec:
        """The quantization this round prescribes."""
        return QuantSpec(self.quant_bits, self.clip_norm, self.ring_bits)

    def encoded_dim(self) -> int:
        """Elements of an encoded update but one (the masked vector has this + 1):
        ``dim`` in the plain codec, fewer or more after sparsification, rotation or a
        weight sent as digits (``fedsec.protocol.update_codec``).

        Raises:
            ProtocolError / QuantizationError: a codec the spec cannot carry.
        """
        from fedsec.protocol.update_codec import codec_for  # it builds on this module

        return codec_for(self).length - 1

    def secagg_params(self) -> SecAggParams:
        """SecAgg+ parameters of this attempt, identical for aggregator and members.

        Each attempt has a fresh seed, so its digest, and hence every signature,
        share and mask bound to it, differs from any other attempt's.

        Raises:
            ProtocolError / QuantizationError / PayloadError: invalid values in the spec.
        """
        return SecAggParams(
            federation_id=self.federation_id,
            round=self.round,
            cohort=tuple(self.cohort),
            neighbors=self.neighbors,
            threshold=self.threshold,
            quant=self.quant_spec(),
            dim=self.encoded_dim(),
            seed=unhex(self.seed, "round seed", 32),
            wraps=self.codec.headroom_bits > 0,
            graph_commitments=tuple(
                unhex(c, "graph commitment", 32) for c in self.graph_commitments
            ),
        )


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


# -- homomorphic summation ----------------------------------------------------------------------

HexDigest = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]


class HeContextStatement(_Signed, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """The key custodian's signed statement of the public CKKS context of a federation:
    its parameters and the SHA-256 of its serialisation.  Members encrypt only under a
    context whose statement verifies against the custodian's roster key."""

    DOMAIN: ClassVar[str] = HE_CONTEXT_DOMAIN

    federation_id: str
    custodian: MemberId
    poly_modulus_degree: Count
    coeff_mod_bit_sizes: Annotated[list[Count], msgspec.Meta(max_length=16)]
    scale_bits: Count
    context_sha256: HexDigest
    signature: str = ""


class HeContext(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The public context (base64 of TenSEAL's serialisation, no secret key) with the
    custodian's statement: what the custodian uploads and every member fetches."""

    statement: HeContextStatement
    context: str


class HeSumOffer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the aggregator asks the custodian to decrypt: the sum of the ciphertexts of
    ``contributors`` (each an accepted masked input of the attempt), by its digest
    (:func:`fedsec.crypto.he.sum_digest`).  The custodian re-adds the archived
    ciphertexts itself before it believes the digest."""

    federation_id: str
    round: Id
    attempt: Id
    contributors: Annotated[list[MemberId], msgspec.Meta(max_length=MAX_COHORT)]
    sum_sha256: HexDigest
    log_index: Count  # the log holds every accepted entry of the attempt below this index


class DecryptionStatement(_Signed, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """The custodian's signed account of one decryption: which contributions' sum (each
    once, checked against the log), and the hash of the plaintext it released (the
    integer sum of the members' quantized vectors, little-endian int64)."""

    DOMAIN: ClassVar[str] = HE_DECRYPTION_DOMAIN

    federation_id: str
    round: Id
    attempt: Id
    custodian: MemberId
    contributors: Annotated[list[MemberId], msgspec.Meta(max_length=MAX_COHORT)]
    sum_sha256: HexDigest
    plaintext_sha256: HexDigest
    # A hidden model (he.model_visible_to_aggregator = false) only; omitted otherwise,
    # so visible-model statements sign as before.  The custodian derived the new model
    # from ``parent_version`` and sealed plaintext and model to ``recipients``.
    ring_sha256: HexDigest | None = None  # the ring sum, as the aggregate entry logs it
    weight_sum: float | None = None  # Σ w, as the aggregate entry logs it
    parent_version: Id | None = None
    model_sha256: HexDigest | None = None  # the derived model file, in the clear
    sealed_sha256: HexDigest | None = None  # the sealed release, as the aggregator stores it
    recipients: Annotated[list[MemberId], msgspec.Meta(max_length=MAX_COHORT)] = []
    signature: str = ""

    @property
    def sealed(self) -> bool:
        """Whether this decryption released a hidden model (sealed to its recipients)."""
        return self.model_sha256 is not None


# -- operations: alerts, audit verdicts, the dashboard ------------------------------------------

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
    failed: Annotated[list[CheckName], msgspec.Meta(max_length=32)] = []

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
    failed: Annotated[list[CheckName], msgspec.Meta(max_length=32)] = []
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


class ErrorBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    error: str
    detail: str


T = TypeVar("T")


def parse_uint(raw: str, what: str, max_value: int = MAX_ID) -> int:
    """A path or query integer: canonical ASCII decimal (``0|[1-9][0-9]*``), at most
    ``max_value``.

    Raises:
        PayloadError: anything else (signs, spaces, ``_``, non-ASCII digits, leading
            zeros, exponents, too large), quoted truncated.
    """
    if not _UINT_RE.fullmatch(raw) or int(raw) > max_value:
        raise PayloadError(
            f"{what} must be a decimal integer from 0 to {max_value} without sign, spaces or "
            f"leading zeros, got {raw[:24]!r}{'...' if len(raw) > 24 else ''}"
        )
    return int(raw)


def non_finite(value: Any) -> tuple[str, float] | None:
    """The first float in ``value`` that is NaN or infinite, with its path in msgspec's
    notation (``$.report.delta``); None when every float is finite.

    ``value`` is a struct or what ``json.loads``, ``msgspec.to_builtins`` or an untyped
    msgspec decoder gives; structs, lists, tuples and dicts are searched through.
    """
    if isinstance(value, float):
        return None if math.isfinite(value) else ("$", value)
    items: Iterable[tuple[Any, Any]]
    if isinstance(value, msgspec.Struct):
        items = ((name, getattr(value, name)) for name in _float_fields(type(value)))
    elif isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = non_finite(item)
        if found is not None:
            # the path is built only for the one bad value, not for every good one
            return "$" + _step(key) + found[0][1:], found[1]
    return None


@functools.cache
def _float_fields(cls: type[msgspec.Struct]) -> tuple[str, ...]:
    """The fields of ``cls`` whose type can hold a float, at any depth: the only ones
    :func:`non_finite` looks into (a share list of 100 members then costs nothing)."""
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    return tuple(f.name for f in info.fields if _may_hold_float(f.type, set()))


def _may_hold_float(t: msgspec.inspect.Type, seen: set[type]) -> bool:
    ins = msgspec.inspect
    if isinstance(t, ins.FloatType):
        return True
    if isinstance(t, ins.StructType):
        if t.cls in seen:  # a recursive struct: its floats are found where first met
            return False
        seen.add(t.cls)
        return any(_may_hold_float(f.type, seen) for f in t.fields)
    if isinstance(t, ins.UnionType):
        return any(_may_hold_float(u, seen) for u in t.types)
    if isinstance(t, ins.ListType | ins.SetType | ins.FrozenSetType | ins.VarTupleType):
        return _may_hold_float(t.item_type, seen)
    if isinstance(t, ins.TupleType):
        return any(_may_hold_float(u, seen) for u in t.item_types)
    if isinstance(t, ins.DictType):
        return _may_hold_float(t.key_type, seen) or _may_hold_float(t.value_type, seen)
    no_float = (ins.StrType, ins.IntType, ins.BoolType, ins.BytesType, ins.LiteralType)
    return not isinstance(t, (*no_float, ins.NoneType, ins.ByteArrayType, ins.EnumType))


def check_finite(value: Any, what: str) -> None:
    """Refuse a decoded message holding a float that is NaN or infinite (see the module's
    *Numbers*).

    Raises:
        PayloadError: naming ``what`` and the field.
    """
    found = non_finite(value)
    if found is not None:
        path, number = found
        raise PayloadError(
            f"{what} is invalid: {number} is not a finite number - at `{path}` "
            "(fedsec messages carry finite numbers only)"
        )


def _step(key: Any) -> str:
    """One step of a path: ``.name`` for a field or an identifier key, else ``[key]``."""
    if isinstance(key, str) and key.isidentifier():
        return f".{key[:64]}"
    text = repr(key[:64]) if isinstance(key, str) else str(key)
    return f"[{text}]"


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise PayloadError(f"duplicate JSON key {key[:64]!r}: each key may appear once")
        found[key] = value
    return found


# A signed body must mean one thing to every reader: the stdlib scanner (C) calls the
# hook for each object, which refuses a key given twice (msgspec keeps the last one).
_DUPLICATE_CHECK: Final = json.JSONDecoder(object_pairs_hook=_refuse_duplicate_keys)


def decode(raw: bytes, kind: type[T], *, max_bytes: int, what: str, unique_keys: bool = True) -> T:
    """Decode a JSON body into ``kind``, checking its size first.

    ``unique_keys`` parses the body a second time (stdlib scanner) to refuse a key
    given twice; a request body must mean one thing to every reader.  The agent's
    client turns it off for the aggregator's answers, whose signed parts it verifies
    over their canonical re-encoding, so a repeated key there changes nothing signed.

    Raises:
        PayloadTooLarge: more than ``max_bytes``.
        PayloadError: malformed JSON, a key given twice in one object, wrong types,
            numbers out of range or not finite, a rule between fields broken
            (``__post_init__``), or unknown fields (named).
    """
    if len(raw) > max_bytes:
        raise PayloadTooLarge(f"{what} is {len(raw)} bytes, over the limit of {max_bytes}")
    try:
        value = msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        raise PayloadError(f"{what} is invalid: {str(exc)[:300]}") from None
    except msgspec.DecodeError as exc:
        raise PayloadError(f"{what} is not valid JSON: {str(exc)[:300]}") from None
    check_finite(value, what)  # JSON cannot carry one (msgspec refuses it): one rule for all
    if not unique_keys:
        return value
    try:
        _DUPLICATE_CHECK.decode(raw.decode("utf-8"))
    except PayloadError as exc:
        raise PayloadError(f"{what} is invalid: {exc.detail}") from None
    except ValueError as exc:  # msgspec accepted what the stdlib does not (never seen)
        raise PayloadError(f"{what} is not valid JSON: {str(exc)[:300]}") from None
    return value


def encode(value: Any) -> bytes:
    return msgspec.json.encode(value)


def _unhex(value: str, what: str) -> bytes:
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise PayloadError(f"{what} is not hex") from None


def unhex(value: str, what: str, length: int | None = None) -> bytes:
    """Hex to bytes, refusing bad hex or the wrong length with a sentence naming ``what``."""
    raw = _unhex(value, what)
    if length is not None and len(raw) != length:
        raise PayloadError(f"{what} must be {length} bytes, got {len(raw)}")
    return raw
