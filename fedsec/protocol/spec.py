"""The round spec: the signed contract of one round attempt, and the settings it carries
(training, DP, the robust aggregation rule, the update codec).

:meth:`RoundSpec.encoded_dim` and :meth:`RoundSpec.secagg_params` derive from the codec
(:mod:`fedsec.protocol.update_codec`), which reads the spec's fields only: the codec
names :class:`RoundSpec` for type checking alone, so the two modules import in one
direction.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Final, Literal

import msgspec

from fedsec.crypto.quantize import QuantSpec
from fedsec.crypto.secagg.messages import SecAggParams
from fedsec.errors import ProtocolError
from fedsec.protocol.body import Count, HexDigest, Id, _Signed, unhex
from fedsec.protocol.codec_choice import codec_for
from fedsec.protocol.shards import ShardGroup, check_groups, group_index

ROUND_SPEC_DOMAIN = "round-spec"

SecureSum = Literal["secagg", "none", "he"]
#: How a trusted-mode attempt combines its members' updates (fedsec.learning.robust).
AggregationRule = Literal[
    "fedavg", "trimmed_mean", "median", "multi_krum", "centered_clipping", "dnc", "fltrust"
]


class TaskPin(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The task package a federation runs, as every party computes it from its own
    installation (``fedsec.task.digest``): no code crosses the network, so members
    compare what they installed against this before training."""

    entry_point: str  # the name in the "fedsec.tasks" entry-point group
    distribution: str
    version: str
    digest: HexDigest  # sha256 of the distribution's files


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
    # the task package, pinned; None in specs made before pinning, which keep their bytes
    task_pin: TaskPin | None = None
    # [validation] federated: each member of the cohort scores the model this attempt
    # produces on its held-out split and sends a signed evaluation report
    federated_evaluation: bool = False
    # [round] shards > 1: the cohort's groups (fedsec.protocol.shards), each summed by its
    # own SecAgg+ session; empty: one session over the whole cohort
    groups: list[ShardGroup] = msgspec.field(default_factory=list)

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
        return codec_for(self).length - 1

    def member_params(self, member: str) -> SecAggParams:
        """The SecAgg+ parameters ``member`` runs under: its group's in a sharded attempt
        (it is told no other group's members), the whole cohort's otherwise.

        Raises:
            UnknownMember: a sharded attempt none of whose groups holds ``member``.
            ProtocolError / QuantizationError / PayloadError: see :meth:`secagg_params`.
        """
        return self.secagg_params(group_index(self.groups, member) if self.groups else None)

    def secagg_params(self, group: int | None = None) -> SecAggParams:
        """SecAgg+ parameters of this attempt, identical for aggregator and members.

        Each attempt has a fresh seed, so its digest, and hence every signature,
        share and mask bound to it, differs from any other attempt's.

        Args:
            group: in a sharded attempt, the index of the group whose session these are:
                the group is the cohort, with its own k, t and graph commitments (its
                digest differs from every other group's), while the ring, the codec and
                the seed stay the attempt's, so the groups' ring sums add up to the one
                sum of the whole cohort.  None: the whole cohort.

        Raises:
            ProtocolError / QuantizationError / PayloadError: invalid values in the spec;
                groups that are not the split the seed gives; no such group.
        """
        cohort, k, t = self.cohort, self.neighbors, self.threshold
        commitments = self.graph_commitments
        if group is not None:
            check_groups(self.cohort, self.seed, self.groups)
            if not 0 <= group < len(self.groups):
                raise ProtocolError(f"round {self.round} has no shard group {group}")
            shard = self.groups[group]
            cohort, k, t = shard.members, shard.neighbors, shard.threshold
            if commitments:
                at = {m: i for i, m in enumerate(self.cohort)}
                commitments = [commitments[at[m]] for m in cohort]
        return SecAggParams(
            federation_id=self.federation_id,
            round=self.round,
            cohort=tuple(cohort),
            neighbors=k,
            threshold=t,
            quant=self.quant_spec(),
            dim=self.encoded_dim(),
            seed=unhex(self.seed, "round seed", 32),
            wraps=self.codec.headroom_bits > 0,
            graph_commitments=tuple(unhex(c, "graph commitment", 32) for c in commitments),
        )
