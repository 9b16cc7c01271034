"""Summation sessions: how one round attempt turns its members' contributions into
Σ w·Δ and Σ w, behind one interface, so the round engine never asks which mode runs.

A session is created once the cohort is fixed and the spec signed.  The engine feeds
it every accepted stage message (:meth:`SummationSession.receive`, or
:meth:`~SummationSession.replay` for stored ones on resume), asks whether a stage is
complete, closes each stage but the last, and finalizes the last one into a
:class:`SummationResult`.  Each mode is one implementation:

- :class:`SecAggPlusSession` (``secure_sum = "secagg"``): the SecAgg+ server state
  machine of :mod:`fedsec.crypto.secagg`; stages advertise, share_keys, masked_input,
  consistency, unmask.
- :class:`PlainSession` (``secure_sum = "none"``): signed quantized updates summed in
  the clear, or combined by the spec's robust rule (:mod:`fedsec.learning.robust`); one
  stage, masked_input.
- :class:`HeSession` (``secure_sum = "he"``): CKKS ciphertexts of the quantized updates
  added without being opened (:mod:`fedsec.crypto.he`); stages commit (each member's
  signed hash of its ciphertext), masked_input, then decrypt, where the key custodian
  releases the integer sum.

Later modes (distributed-DP noise, sparse encodings) are new subclasses.
Sessions are sans-I/O: nothing here touches the state store or the log.
"""

from __future__ import annotations

import hashlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from fedsec.crypto.quantize import ring_from_integers, unpack
from fedsec.crypto.secagg import (
    AdvertiseKeys,
    ConsistencyProof,
    ConsistencySignature,
    MaskedInput,
    ServerSession,
    ShareKeys,
    ShareRelay,
    UnmaskResponse,
)
from fedsec.errors import (
    BadVector,
    DuplicateMessage,
    IntegrityError,
    PayloadError,
    ProtocolError,
    RoundAborted,
    UnknownMember,
    WrongStage,
)
from fedsec.learning import robust
from fedsec.protocol import codec, he_release, wire
from fedsec.protocol.ddp import is_distributed
from fedsec.protocol.replay import feed_accepted
from fedsec.protocol.stages import HE_STAGES, SECAGG_STAGES, Stage
from fedsec.protocol.update_codec import codec_for

if TYPE_CHECKING:  # TenSEAL is the ``he`` extra's: only an he federation loads it
    from fedsec.crypto.he import PublicContext

# logged under the round engine's name (fedsec.aggregator.rounds.context): operators filter on it
log = logging.getLogger("fedsec.aggregator.coordinator")


@dataclass(frozen=True, slots=True)
class Decryption:
    """The key custodian's decryption of an attempt's ciphertext sum (stage decrypt)."""

    custodian: str
    statement: wire.DecryptionStatement
    # visible model: the dim + 1 summed integers, little-endian int64; hidden model: the
    # sealed release, stored unread as the new version's file
    plaintext: bytes
    sealed: he_release.SealedRelease | None = None
    body: bytes = b""  # the whole body: a hidden model's version file (statement included)


def decode_decryption(custodian: str, raw: bytes, max_json_bytes: int) -> Decryption:
    """A ``post_decryption`` body (:mod:`fedsec.protocol.he_release`).

    Args:
        custodian: who sent it.
        raw: the body as received (and as stored).
        max_json_bytes: bound on the statement's length (``server.max_json_bytes``).

    Raises:
        PayloadError: truncated, a statement length over the bound, a statement that
            does not decode strictly, or a sealed release that does not parse.
    """
    statement, rest = he_release.unframe(raw, max_json_bytes)
    sealed = he_release.decode_sealed(rest) if statement.sealed else None
    return Decryption(custodian, statement, rest, sealed, raw)


#: A decoded stage message, as the member sent it.
StageMessage = (
    AdvertiseKeys
    | ShareKeys
    | MaskedInput
    | ConsistencySignature
    | UnmaskResponse
    | Decryption
    | wire.CiphertextCommitment
)


@dataclass(frozen=True, slots=True)
class RuleRefusal:
    """An update intake accepted (and receipted) that the attempt's aggregation rule kept
    out of the aggregate (trusted mode): logged as a ``refused`` entry at the close."""

    member: str
    sha256: str  # of the update's bytes, as archived
    rule: str  # the rule with its parameters (``fedsec.learning.robust.describe``)
    reason: str  # why the rule refused it

    @property
    def detail(self) -> str:
        """The sentence the ``refused`` entry carries."""
        return f"aggregation rule {self.rule} refused {self.member}'s update: {self.reason}"


#: FLTrust's reference update for an attempt (float64, length dim): the aggregator's
#: own training on its root dataset from the spec's model.  The session only calls it,
#: so it stays free of I/O (``fedsec.aggregator.rounds.reference`` makes one).
ReferenceUpdate = Callable[[wire.RoundSpec], np.ndarray]


@dataclass(frozen=True, slots=True)
class SummationResult:
    """What an attempt summed, and from whom."""

    weighted_sum: np.ndarray  # Σ w·Δ, float64, length dim
    weight_sum: float  # Σ w
    survivors: list[str]  # whose contributions are in the sum, sorted
    dropped: list[str]  # who was expected but is not, sorted
    sum_sha256: str  # the sum as the mode computed it (the log's ``aggregate`` entry)
    # a hidden model (he.model_visible_to_aggregator = false): the custodian's sealed
    # release, the new version's file, derived from ``parent_version``; weighted_sum is empty
    sealed: bytes | None = None
    parent_version: int | None = None
    # trusted mode with a robust rule: accepted updates the rule kept out (in dropped)
    refused: tuple[RuleRefusal, ...] = ()
    # distributed DP or fewer codec headroom bits: coordinates of the ring sum at the
    # ring's edge, i.e. likely wraps (fedsec.protocol.update_codec.UpdateCodec.edge_count)
    edge_count: int = 0


class SummationSession(ABC):
    """One attempt's summation.

    Args:
        spec: the attempt's signed spec (cohort fixed).
    """

    #: The message stages of this mode, in order; the last one ends in :meth:`finalize`.
    stages: tuple[Stage, ...]

    def __init__(self, spec: wire.RoundSpec) -> None:
        self.spec = spec

    def next_stage(self, stage: str) -> Stage | None:
        """The stage after ``stage``, or None when ``stage`` is the last (finalize).

        Raises:
            ValueError: ``stage`` is not one of this mode's stages.
        """
        at = self.stages.index(stage)  # type: ignore[arg-type,unused-ignore]
        return self.stages[at + 1] if at + 1 < len(self.stages) else None

    @abstractmethod
    def receive(self, stage: str, message: StageMessage) -> None:
        """Validate one member's message for ``stage`` and take it in.

        Raises:
            FedsecError: the message is refused; the session is unchanged.
        """

    @abstractmethod
    def replay(self, stage: str, member: str, raw: bytes) -> None:
        """Take in a message accepted before (as stored: JSON body, or the raw vector).

        Raises:
            FedsecError, msgspec.DecodeError: the stored message no longer verifies.
        """

    @abstractmethod
    def complete(self, stage: str) -> bool:
        """True once everyone expected in ``stage`` answered (or, where the mode allows,
        the answers so far already decide the sum)."""

    @abstractmethod
    def close(self, stage: str) -> None:
        """End ``stage`` (not the last one).

        Raises:
            RoundAborted: too few members remain to go on.
        """

    @abstractmethod
    def finalize(self) -> SummationResult:
        """End the last stage and return the sum.

        Raises:
            RoundAborted, RecoveryImpossible: too few contributions, or lost secrets.
            ProtocolError: the members' answers are inconsistent.
        """

    @abstractmethod
    def participant_count(self) -> int:
        """How many members the sum may hold (the round summary's ``participants``)."""

    # Stage data relayed to members.  A mode without key stages has nobody to relay to:
    # every member is refused as the SecAgg+ session refuses one outside the set.

    def key_list(self, member: str) -> wire.KeyListBody:
        """The advertised keys ``member`` fetches in share_keys.

        Raises:
            UnknownMember: ``member`` is not a live member.
        """
        raise UnknownMember(f"{member} is not a live member of round {self.spec.round}")

    def share_relay(self, member: str) -> wire.ShareRelayBody:
        """The encrypted shares addressed to ``member``, fetched in masked_input.

        Raises:
            UnknownMember: ``member`` is not a participant.
        """
        raise UnknownMember(f"{member} is not a participant of round {self.spec.round}")

    def unmask_request(self, member: str, state_token: int) -> wire.UnmaskRequestBody:
        """Who survived and who dropped, fetched in consistency (and signed there).

        Raises:
            UnknownMember: ``member`` is not a survivor.
        """
        raise UnknownMember(f"{member} is not a survivor of round {self.spec.round}")

    def consistency_proof(self, member: str, state_token: int) -> wire.ConsistencyProofBody:
        """``member``'s neighbours' signatures on the survivor sets, fetched in unmask.

        Raises:
            UnknownMember: ``member`` did not sign the survivor sets.
        """
        raise UnknownMember(f"{member} did not sign the survivor sets of round {self.spec.round}")

    def commitment_set(self, member: str) -> wire.CommitmentSetBody:
        """The attempt's ciphertext commitments, fetched in masked_input (homomorphic).

        Raises:
            UnknownMember: ``member`` did not commit.
        """
        raise UnknownMember(f"{member} did not commit to a ciphertext in round {self.spec.round}")


def open_session(
    spec: wire.RoundSpec,
    roster_keys: Mapping[str, bytes],
    min_agents: int,
    he_context: PublicContext | None = None,
    max_json_bytes: int = 1 << 20,
    reference: ReferenceUpdate | None = None,
) -> SummationSession:
    """The session for ``spec``'s ``secure_sum`` mode: the one place that asks it.

    Args:
        spec: the attempt's signed spec.
        roster_keys: member id -> Ed25519 public key, for the cohort (and, for ``he``,
            the key custodian the spec names).
        min_agents: fewest contributions a sum may hold (modes without their own bound).
        he_context: ``he``: the federation's public context, the one the spec names.
        max_json_bytes: ``he``: bound on a stored decryption statement (replay).
        reference: ``none`` with rule ``fltrust``: the aggregator's reference update.

    Raises:
        ProtocolError: an ``he`` spec without the context or the custodian's key; an
            aggregation rule outside trusted mode, or ``fltrust`` without a reference.
    """
    if spec.aggregation is not None and spec.secure_sum != "none":
        raise ProtocolError(
            f"round {spec.round}: aggregation rule {spec.aggregation.rule} needs a trusted "
            f"aggregator (secure_sum none): with {spec.secure_sum} no single update is visible"
        )
    if spec.secure_sum == "secagg":
        return SecAggPlusSession(spec, roster_keys)
    if spec.secure_sum == "he":
        key = roster_keys.get(spec.custodian)
        if he_context is None or key is None:
            raise ProtocolError(
                f"round {spec.round}: a homomorphic sum needs the published context and the "
                f"key custodian {spec.custodian!r} on the roster"
            )
        return HeSession(spec, he_context, key, min_agents, max_json_bytes, roster_keys)
    return PlainSession(spec, min_agents, reference)


def ciphertext_commitment(
    spec: wire.RoundSpec, member: str, body: wire.CommitBody
) -> wire.CiphertextCommitment:
    """The signed commitment ``member`` sent for ``spec``'s attempt (``body``: as posted)."""
    return wire.CiphertextCommitment(
        federation_id=spec.federation_id,
        round=spec.round,
        attempt=spec.attempt,
        member=member,
        vector_sha256=body.vector_sha256,
        signature=body.signature,
    )


class SecAggPlusSession(SummationSession):
    """SecAgg+ (Bell et al. 2020): the aggregator learns only the survivors' sum."""

    stages = SECAGG_STAGES

    def __init__(self, spec: wire.RoundSpec, roster_keys: Mapping[str, bytes]) -> None:
        super().__init__(spec)
        self.server = ServerSession(spec.secagg_params(), roster_keys)
        self._min_survivors = spec.dp.min_survivors if is_distributed(spec) else 0
        self._relays: dict[str, ShareRelay] = {}
        self._proofs: dict[str, ConsistencyProof] = {}
        # the key list every live member fetches, built once (fixed from share_keys on)
        self._key_list: wire.KeyListBody | None = None

    def receive(self, stage: str, message: StageMessage) -> None:
        if stage == "advertise" and isinstance(message, AdvertiseKeys):
            self.server.receive_advertise(message)
        elif stage == "share_keys" and isinstance(message, ShareKeys):
            self.server.receive_share_keys(message)
        elif stage == "masked_input" and isinstance(message, MaskedInput):
            self.server.receive_masked_input(message)
        elif stage == "consistency" and isinstance(message, ConsistencySignature):
            self.server.receive_consistency(message)
        elif stage == "unmask" and isinstance(message, UnmaskResponse):
            self.server.receive_unmask(message)
        else:
            raise ValueError(f"not a {stage} message: {type(message).__name__}")

    def replay(self, stage: str, member: str, raw: bytes) -> None:
        feed_accepted(self.server, stage, member, raw)

    def complete(self, stage: str) -> bool:
        s = self.server
        if stage == "advertise":
            return len(s.advertised) == len(s.params.cohort)
        if stage == "share_keys":
            return s.shared == s.live
        if stage == "masked_input":
            return len(s.contributed) == len(s.participants)
        if stage == "consistency":
            return len(s.signatures) == len(s.survivors)
        if stage == "unmask":
            # every signer answered, or the answers so far already decide the sum
            return s.answered == frozenset(s.signatures) or s.ready_to_finalize()
        return False

    def close(self, stage: str) -> None:
        if stage == "advertise":
            self.server.close_advertise()
        elif stage == "share_keys":
            self._relays = self.server.close_share_keys()
        elif stage == "masked_input":
            arrived, floor = len(self.server.contributed), self._min_survivors
            if arrived < floor:  # unmasking would release a sum with too little noise
                raise RoundAborted(
                    f"round {self.spec.round}: {arrived} masked inputs arrived, fewer than "
                    f"the {floor} survivors the distributed-DP noise is sized for"
                )
            self.server.close_masked_input()
        elif stage == "consistency":
            self._proofs = self.server.close_consistency()
        else:
            raise ValueError(f"stage {stage!r} is not closed by close()")

    def finalize(self) -> SummationResult:
        s = self.server
        log.info(
            "event=unmask_closed round=%d attempt=%d answered=%d survivors=%d",
            self.spec.round,
            self.spec.attempt,
            len(s.answered),
            len(s.survivors),
        )
        result = s.finalize()
        encoding = codec_for(self.spec)
        weighted, weight, edges = encoding.decode_counted(result.ring_sum, len(result.survivors))
        return SummationResult(
            weighted_sum=weighted,
            weight_sum=weight,
            survivors=list(result.survivors),
            dropped=list(result.dropped),
            sum_sha256=hashlib.sha256(result.ring_sum.tobytes()).hexdigest(),
            edge_count=edges,
        )

    def participant_count(self) -> int:
        return len(self.server.participants)

    def key_list(self, member: str) -> wire.KeyListBody:
        s = self.server
        if member not in s.live:
            return super().key_list(member)
        if self._key_list is None:
            # every advertisement: members derive the graph from all revealed nonces
            self._key_list = codec.key_list_body(a for _, a in sorted(s.advertised.items()))
        return self._key_list

    def share_relay(self, member: str) -> wire.ShareRelayBody:
        if member not in self._relays:
            return super().share_relay(member)
        return codec.share_relay_body(self._relays[member])

    def unmask_request(self, member: str, state_token: int) -> wire.UnmaskRequestBody:
        s = self.server
        if member not in s.survivors:
            return super().unmask_request(member, state_token)
        return wire.UnmaskRequestBody(
            survivors=sorted(s.survivors), dropped=sorted(s.dropped), state_token=state_token
        )

    def consistency_proof(self, member: str, state_token: int) -> wire.ConsistencyProofBody:
        if member not in self._proofs:
            return super().consistency_proof(member, state_token)
        return codec.consistency_proof_body(self._proofs[member], state_token)


class PlainSession(SummationSession):
    """A trusted aggregator: members' signed quantized updates summed in the clear, or,
    when the spec names an aggregation rule (``spec.aggregation``), combined by that rule
    (:mod:`fedsec.learning.robust`) once they are all in.

    Without a rule, only the running sum is kept (O(dim)).  With one, each accepted update
    is kept as its ring vector (dim + 1 values of the ring's width, its smallest form) until
    finalize, so memory is bounded by the cohort cap: ``round.max_agents`` × (dim + 1) ×
    ring bytes, and finalize briefly holds ``n × dim`` float64 values and the rule's
    temporaries (:mod:`fedsec.learning.robust`).

    Args:
        spec: the attempt's signed spec.
        min_agents: fewest updates that must arrive.  A rule's refusals come after it:
            they are the rule's purpose (multi_krum leaves f out of every cohort), and the
            rule itself refuses to aggregate nothing (``AggregationImpossible``).
        reference: ``fltrust``: the aggregator's reference update, called at finalize.

    Raises:
        ProtocolError: rule ``fltrust`` without a reference.
    """

    stages: tuple[Stage, ...] = ("masked_input",)

    def __init__(
        self, spec: wire.RoundSpec, min_agents: int, reference: ReferenceUpdate | None = None
    ) -> None:
        super().__init__(spec)
        self.min_agents = min_agents
        self.total = np.zeros(spec.dim, dtype=np.float64)  # Σ w·Δ
        self.weight = 0.0  # Σ w
        self.members: list[str] = []  # in arrival order
        self.rule = spec.aggregation  # None: plain FedAvg over the running sum
        if self.rule is not None and self.rule.rule == "fltrust" and reference is None:
            raise ProtocolError(
                f"round {spec.round}: fltrust needs the aggregator's reference update "
                "(its root dataset)"
            )
        self._reference = reference
        self.vectors: dict[str, np.ndarray] = {}  # with a rule: member -> its ring vector
        self.digests: dict[str, str] = {}  # with a rule: member -> sha256 of its bytes

    def receive(self, stage: str, message: StageMessage) -> None:
        """Raises: DuplicateMessage, BadVector, QuantizationError (as the vector decodes)."""
        if stage != "masked_input" or not isinstance(message, MaskedInput):
            raise ValueError(f"a plain round takes only masked_input, not {stage}")
        member, spec = message.member, self.spec
        if member in self.members:
            raise DuplicateMessage(f"{member} already sent its update")
        encoding = codec_for(spec)
        vector = unpack(message.vector, encoding.length, spec.ring_bits)
        try:
            encoding.check_input(vector)
        except BadVector as exc:
            raise BadVector(f"{member}'s update: {exc.detail}") from None
        update, weight = encoding.decode_one(vector)
        self.total += update
        self.weight += weight
        self.members.append(member)
        if self.rule is not None:
            self.vectors[member] = vector
            self.digests[member] = hashlib.sha256(message.vector).hexdigest()

    def replay(self, stage: str, member: str, raw: bytes) -> None:
        self.receive(stage, MaskedInput(member, raw))

    def complete(self, stage: str) -> bool:
        return stage == "masked_input" and len(self.members) == len(self.spec.cohort)

    def close(self, stage: str) -> None:
        raise ValueError(f"a plain round has no stage {stage!r} to close before finalize")

    def finalize(self) -> SummationResult:
        """Raises: RoundAborted (too few updates arrived), AggregationImpossible (the
        rule cannot form an aggregate from them)."""
        dropped = sorted(set(self.spec.cohort) - set(self.members))
        if len(self.members) < self.min_agents:
            raise RoundAborted(
                f"round {self.spec.round}: {len(self.members)} updates arrived, need "
                f"{self.min_agents}; missing: {dropped}"
            )
        if self.rule is not None:
            return self._by_rule(self.rule)
        return SummationResult(
            weighted_sum=self.total,
            weight_sum=self.weight,
            survivors=sorted(self.members),
            dropped=dropped,
            sum_sha256=hashlib.sha256(self.total.astype("<f8").tobytes()).hexdigest(),
        )

    def _by_rule(self, rule: wire.AggregationSpec) -> SummationResult:
        """The rule over the updates in member order (``fedsec audit verify`` re-derives
        it the same way from the archive, bit for bit)."""
        spec = self.spec
        order = sorted(self.members)
        encoding = codec_for(spec)
        rows = [encoding.decode_one(self.vectors[m]) for m in order]
        weights = np.array([w for _, w in rows])
        reference = self._reference(spec) if self._reference and rule.rule == "fltrust" else None
        result = robust.aggregate(rule, np.stack([u for u, _ in rows]), weights, reference)
        reasons = {
            m: outcome.reason
            for m, outcome in zip(order, result.outcomes, strict=True)
            if not outcome.accepted
        }
        survivors = [order[i] for i in result.accepted]
        self._log_outcomes(rule, order, result)
        described = robust.describe(rule)
        refused = [RuleRefusal(m, self.digests[m], described, why) for m, why in reasons.items()]
        weighted, weight = robust.as_weighted_sum(result, weights)
        return SummationResult(
            weighted_sum=weighted,
            weight_sum=weight,
            survivors=survivors,
            dropped=sorted(set(spec.cohort) - set(survivors)),
            sum_sha256=hashlib.sha256(weighted.astype("<f8").tobytes()).hexdigest(),
            refused=tuple(refused),
        )

    def _log_outcomes(
        self, rule: wire.AggregationSpec, order: list[str], result: robust.RobustAggregate
    ) -> None:
        for member, outcome in zip(order, result.outcomes, strict=True):
            log.info(
                "event=rule_outcome round=%d attempt=%d rule=%s member=%s accepted=%s "
                "share=%.6g score=%s",
                self.spec.round,
                self.spec.attempt,
                rule.rule,
                member,
                outcome.accepted,
                outcome.weight,
                "-" if outcome.score is None else f"{outcome.score:.6g}",
            )

    def participant_count(self) -> int:
        return len(self.members)


class HeSession(SummationSession):
    """Homomorphic summation: the aggregator adds CKKS ciphertexts of the members'
    quantized vectors without opening them, and the key custodian decrypts only their
    sum, which becomes Σ w·Δ exactly as a SecAgg+ ring sum does.

    Args:
        spec: the attempt's signed spec (``he_context_sha256`` names ``context``).
        context: the federation's public CKKS context.
        custodian_key: the Ed25519 key of the custodian the spec names (roster).
        min_agents: fewest ciphertexts a sum may hold (the custodian checks it too).
        max_json_bytes: bound on a stored decryption statement, for :meth:`replay`.
        member_keys: member id -> Ed25519 key, for the cohort: commitments verify under it.
    """

    stages = HE_STAGES

    def __init__(
        self,
        spec: wire.RoundSpec,
        context: PublicContext,
        custodian_key: bytes,
        min_agents: int,
        max_json_bytes: int = 1 << 20,
        member_keys: Mapping[str, bytes] | None = None,
    ) -> None:
        from fedsec.crypto import he

        super().__init__(spec)
        self.min_agents = min_agents
        self._member_keys = dict(member_keys or {})
        self.commitments: dict[str, wire.CiphertextCommitment] = {}
        # fixed when commit closes: the set every member binds into its statement
        self._commitment_set: wire.CommitmentSetBody | None = None
        self.commitments_sha256 = ""
        self.params = context.params
        self._custodian_key = custodian_key
        self._max_json_bytes = max_json_bytes
        self._sum = he.CiphertextSum(context, context.params, spec.dim + 1)
        self.members: list[str] = []  # whose ciphertexts are in the sum, in arrival order
        # fixed when masked_input closes: what the custodian is asked to decrypt
        self.contributors: list[str] | None = None
        self.sum_sha256 = ""
        self.decryption: Decryption | None = None

    # -- commit: the ciphertexts' hashes, before any ciphertext ---------------------------------

    def _receive_commitment(self, message: wire.CiphertextCommitment) -> None:
        """Raises: WrongStage (commit closed), DuplicateMessage, UnknownMember (not in
        the cohort), ProtocolError (another attempt), SignatureError, PayloadError."""
        spec, member = self.spec, message.member
        if self._commitment_set is not None:
            raise WrongStage(f"{member}: the commitments of round {spec.round} closed")
        if member in self.commitments:
            raise DuplicateMessage(f"{member} already committed to its ciphertext")
        key = self._member_keys.get(member)
        if member not in spec.cohort or key is None:
            raise UnknownMember(f"{member} is not in the cohort of round {spec.round}")
        ours = (spec.federation_id, spec.round, spec.attempt)
        if (message.federation_id, message.round, message.attempt) != ours:
            raise ProtocolError(f"{member}'s commitment is for another round attempt")
        message.verify(key)
        self.commitments[member] = message

    def commitment_set(self, member: str) -> wire.CommitmentSetBody:
        if self._commitment_set is None or member not in self.commitments:
            return super().commitment_set(member)
        return self._commitment_set

    def _close_commit(self) -> None:
        if len(self.commitments) < self.min_agents:
            raise RoundAborted(
                f"round {self.spec.round}: {len(self.commitments)} members committed to a "
                f"ciphertext, need {self.min_agents}; missing: {self._uncommitted()}"
            )
        ordered = sorted(self.commitments.items())
        self._commitment_set = wire.CommitmentSetBody(
            [wire.MemberCommitment(m, c.vector_sha256, c.signature) for m, c in ordered]
        )
        self.commitments_sha256 = wire.commitments_digest((m, c.vector_sha256) for m, c in ordered)

    def _uncommitted(self) -> list[str]:
        return sorted(set(self.spec.cohort) - set(self.commitments))

    # -- masked_input: ciphertexts ----------------------------------------------------------------

    def receive(self, stage: str, message: StageMessage) -> None:
        """Raises: DuplicateMessage, WrongStage; for commit, see
        :meth:`_receive_commitment`; for masked_input, ProtocolError (the member did
        not commit), IntegrityError (not the committed bytes), PayloadError, CryptoError
        (a ciphertext that is not one of the federation's, checked before anything is
        added); for decrypt, see :meth:`_check_decryption`."""
        if stage == "commit" and isinstance(message, wire.CiphertextCommitment):
            self._receive_commitment(message)
        elif stage == "masked_input" and isinstance(message, MaskedInput):
            self._receive_ciphertexts(message)
        elif stage == "decrypt" and isinstance(message, Decryption):
            self._check_decryption(message)
            self.decryption = message
        else:
            raise ValueError(f"not a {stage} message: {type(message).__name__}")

    def _receive_ciphertexts(self, message: MaskedInput) -> None:
        from fedsec.crypto import he

        member = message.member
        if member in self.members:
            raise DuplicateMessage(f"{member} already sent its encrypted update")
        if self.contributors is not None:
            raise WrongStage(f"{member}: the encrypted updates of round {self.spec.round} closed")
        if self._commitment_set is None:
            raise WrongStage(f"{member}: the commitments of round {self.spec.round} are open")
        committed = self.commitments.get(member)
        if committed is None:
            raise ProtocolError(
                f"{member} did not commit to a ciphertext in round {self.spec.round}: only "
                "committed ciphertexts are summed"
            )
        if hashlib.sha256(message.vector).hexdigest() != committed.vector_sha256:
            raise IntegrityError(
                f"{member}'s ciphertext is not the one it committed to "
                f"({committed.vector_sha256[:16]}…)"
            )
        # unframe_chunks checks count and lengths before copying; add() checks every
        # chunk against the federation's context before any is added
        self._sum.add(he.unframe_chunks(message.vector, self.params, self.spec.dim + 1))
        self.members.append(member)

    def replay(self, stage: str, member: str, raw: bytes) -> None:
        if stage == "decrypt":
            self.receive(stage, decode_decryption(member, raw, self._max_json_bytes))
        elif stage == "commit":
            body = msgspec.json.decode(raw, type=wire.CommitBody)
            self.receive(stage, ciphertext_commitment(self.spec, member, body))
        else:
            self.receive(stage, MaskedInput(member, raw))

    def complete(self, stage: str) -> bool:
        if stage == "commit":
            return len(self.commitments) == len(self.spec.cohort)
        if stage == "masked_input":  # only a member that committed can upload
            return len(self.members) == len(self.commitments)
        return stage == "decrypt" and self.decryption is not None

    def close(self, stage: str) -> None:
        """Close commit (the commitment set is fixed) or masked_input (the contributors
        and the sum's digest are fixed).

        Raises:
            RoundAborted: fewer than ``min_agents`` commitments or ciphertexts arrived.
        """
        if stage == "commit":
            self._close_commit()
            return
        if stage != "masked_input":
            raise ValueError(f"stage {stage!r} is not closed by close()")
        if len(self.members) < self.min_agents:
            raise RoundAborted(
                f"round {self.spec.round}: {len(self.members)} encrypted updates arrived, need "
                f"{self.min_agents}; missing: {self._missing()}"
            )
        self.contributors = sorted(self.members)
        self.sum_sha256 = self._sum.digest()
        log.info(
            "event=he_sum_fixed round=%d attempt=%d contributors=%d sum_sha256=%s",
            self.spec.round,
            self.spec.attempt,
            len(self.contributors),
            self.sum_sha256[:16],
        )

    def _missing(self) -> list[str]:
        return sorted(set(self.spec.cohort) - set(self.members))

    # -- decrypt: the custodian's answer ----------------------------------------------------------

    def offer(self, log_index: int) -> wire.HeSumOffer:
        """What the custodian is asked to decrypt (``log_index``: the log's length now).

        Raises:
            WrongStage: the encrypted updates are still coming in.
        """
        if self.contributors is None:
            raise WrongStage(f"round {self.spec.round} has not fixed its ciphertext sum yet")
        return wire.HeSumOffer(
            federation_id=self.spec.federation_id,
            round=self.spec.round,
            attempt=self.spec.attempt,
            contributors=list(self.contributors),
            sum_sha256=self.sum_sha256,
            log_index=log_index,
        )

    def _check_decryption(self, message: Decryption) -> None:
        """Raises:
        WrongStage: the sum is not fixed yet.  DuplicateMessage: a decryption arrived.
        UnknownMember: the sender is not the spec's custodian.
        SignatureError: the statement is not signed by the custodian's roster key.
        ProtocolError: another federation, round, attempt, contributors or sum.
        PayloadError, IntegrityError: the plaintext's length or hash is not the
            statement's.  BadVector: a value no sum of the contributors can take.
        """
        spec, st = self.spec, message.statement
        if self.contributors is None:
            raise WrongStage(f"round {spec.round} has no ciphertext sum to decrypt yet")
        if self.decryption is not None:
            raise DuplicateMessage(f"round {spec.round} already has its decryption")
        if message.custodian != spec.custodian or st.custodian != spec.custodian:
            raise UnknownMember(
                f"{message.custodian} is not the key custodian of round {spec.round}"
            )
        st.verify(self._custodian_key)
        ours = (spec.federation_id, spec.round, spec.attempt)
        if (st.federation_id, st.round, st.attempt) != ours:
            raise ProtocolError(
                f"the decryption is for {st.federation_id} round {st.round} attempt "
                f"{st.attempt}, not {ours[0]} round {ours[1]} attempt {ours[2]}"
            )
        if st.contributors != self.contributors:
            raise ProtocolError(
                f"the decryption names contributors {st.contributors[:8]}, not the sum's "
                f"{self.contributors[:8]}"
            )
        if st.sum_sha256 != self.sum_sha256:
            raise ProtocolError(
                f"the decryption is of sum {st.sum_sha256[:16]}…, not {self.sum_sha256[:16]}…"
            )
        if st.sealed != spec.he_model_hidden:
            raise ProtocolError(
                f"round {spec.round} keeps the model "
                f"{'hidden from' if spec.he_model_hidden else 'visible to'} the aggregator; "
                f"the custodian sent a {'sealed' if st.sealed else 'plain'} decryption"
            )
        if message.sealed is not None:
            self._check_sealed(message)
            return
        expected = (spec.dim + 1) * he_release.PLAINTEXT_ITEM_BYTES
        if len(message.plaintext) != expected:
            raise PayloadError(
                f"the decrypted sum is {len(message.plaintext)} bytes; {spec.dim + 1} int64 "
                f"values are {expected}"
            )
        if hashlib.sha256(message.plaintext).hexdigest() != st.plaintext_sha256:
            raise IntegrityError(
                "the decrypted sum does not hash to the statement's plaintext_sha256"
            )
        ints = np.frombuffer(message.plaintext, dtype=he_release.PLAINTEXT_DTYPE)
        top = len(self.contributors) * spec.quant_spec().levels
        if int(ints.min()) < 0 or int(ints.max()) > top:
            raise BadVector(
                f"the decrypted sum holds values outside 0..{top}, which no sum of "
                f"{len(self.contributors)} quantized updates takes"
            )

    def _check_sealed(self, message: Decryption) -> None:
        """A hidden model's release: what the aggregator can check without reading it.

        Raises:
            ProtocolError: a field of a sealed statement missing, another parent than the
                spec's model, or a cohort member (or the custodian) not a recipient.
            IntegrityError: the release does not hash to ``sealed_sha256``, or its
                recipients are not the statement's.
        """
        spec, st, sealed = self.spec, message.statement, message.sealed
        assert sealed is not None
        if None in (st.ring_sha256, st.weight_sum, st.parent_version, st.sealed_sha256):
            raise ProtocolError(
                "a sealed decryption names ring_sha256, weight_sum, parent_version, "
                "model_sha256 and sealed_sha256"
            )
        if st.parent_version != spec.model_version:
            raise ProtocolError(
                f"the custodian derived the model from version {st.parent_version}; round "
                f"{spec.round} trained on version {spec.model_version}"
            )
        if hashlib.sha256(message.plaintext).hexdigest() != st.sealed_sha256:
            raise IntegrityError(
                "the sealed release does not hash to the statement's sealed_sha256"
            )
        if sorted(sealed.boxes) != st.recipients:
            raise IntegrityError("the sealed release's recipients are not the statement's")
        missing = sorted({*spec.cohort, spec.custodian} - set(st.recipients))
        if missing:
            raise ProtocolError(
                f"the sealed model is not sealed to {missing[:8]}: every cohort member and "
                "the custodian must be able to read it"
            )

    def finalize(self) -> SummationResult:
        """Raises RoundAborted: the custodian did not decrypt by the deadline."""
        spec = self.spec
        if self.decryption is None or self.contributors is None:
            raise RoundAborted(
                f"round {spec.round} attempt {spec.attempt}: the key custodian "
                f"{spec.custodian} did not decrypt within round.decrypt_s"
            )
        st = self.decryption.statement
        if st.sealed:  # checked whole in _check_sealed
            assert st.weight_sum is not None and st.ring_sha256 is not None
            return SummationResult(
                weighted_sum=np.zeros(0),
                weight_sum=st.weight_sum,
                survivors=list(self.contributors),
                dropped=self._missing(),
                sum_sha256=st.ring_sha256,
                sealed=self.decryption.body,
                parent_version=st.parent_version,
            )
        quant = spec.quant_spec()
        ints = np.frombuffer(self.decryption.plaintext, dtype=he_release.PLAINTEXT_DTYPE)
        # the ring sum SecAgg+ would have unmasked: the same integers, so the same bytes
        # (fedsec audit verify derives it the same way from the archived plaintext)
        ring = ring_from_integers(ints, quant)
        weighted, weight = codec_for(spec).decode_sum(ring, len(self.contributors))
        return SummationResult(
            weighted_sum=weighted,
            weight_sum=weight,
            survivors=list(self.contributors),
            dropped=self._missing(),
            sum_sha256=hashlib.sha256(ring.tobytes()).hexdigest(),
        )

    def participant_count(self) -> int:
        return len(self.members)
