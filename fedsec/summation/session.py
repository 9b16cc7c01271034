"""The summation-session interface: how one round attempt turns its members'
contributions into Σ w·Δ and Σ w, so the round engine never asks which mode runs.

A session is created once the cohort is fixed and the spec signed
(:meth:`fedsec.summation.mode.SummationMode.open_session`).  The engine feeds it every
accepted stage message (:meth:`SummationSession.receive`, or
:meth:`~SummationSession.replay` for stored ones), asks whether a stage is complete,
closes each stage but the last, and finalizes the last one into a
:class:`SummationResult`.  Each mode's session lives in its own module
(:mod:`fedsec.summation.secagg`, :mod:`~fedsec.summation.plain`,
:mod:`~fedsec.summation.he`).  Sessions are sans-I/O: nothing here touches a state
store, a log or a file.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fedsec.crypto.secagg import (
    AdvertiseKeys,
    ConsistencySignature,
    MaskedInput,
    ShareKeys,
    UnmaskResponse,
)
from fedsec.errors import UnknownMember
from fedsec.protocol import he_release, wire
from fedsec.protocol.stages import Stage

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
#: so it stays free of I/O (the aggregator's ``rounds/reference.py`` makes one).
ReferenceUpdate = Callable[[wire.RoundSpec], np.ndarray]


@dataclass(frozen=True, slots=True)
class GroupSum:
    """One group's part of a sharded attempt's sum (the log's ``aggregate`` entry lists
    them): whose contributions its ring sum holds and that ring sum's SHA-256."""

    survivors: tuple[str, ...]
    dropped: tuple[str, ...]
    sum_sha256: str


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
    # a sharded attempt: each group's survivors and ring-sum hash, in group order
    groups: tuple[GroupSum, ...] = ()


class SummationSession(ABC):
    """One attempt's summation.

    Args:
        spec: the attempt's signed spec (cohort fixed).
    """

    #: The message stages of this mode, in order; the last one ends in :meth:`finalize`.
    stages: tuple[Stage, ...]
    #: The digest of the commitment set every contribution statement binds, once fixed
    #: (homomorphic summation: :func:`fedsec.protocol.wire.commitments_digest`); "" in a
    #: mode whose members commit to nothing before they upload.
    commitments_sha256: str = ""

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
