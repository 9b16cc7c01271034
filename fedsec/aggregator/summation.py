"""Summation sessions: how one round attempt turns its members' contributions into
Σ w·Δ and Σ w, behind one interface, so the round engine never asks which mode runs.

A session is created once the cohort is fixed and the spec signed.  The engine feeds
it every accepted stage message (:meth:`SummationSession.receive`, or
:meth:`~SummationSession.replay` for stored ones on resume), asks whether a stage is
complete, closes each stage but the last, and finalizes the last one into a
:class:`SummationResult`.  Each mode is one implementation:

- :class:`SecAggPlusSession` (``secure_sum = "secagg"``): the SecAgg+ server state
  machine of :mod:`fedsec.crypto.secagg`; stages advertise, share_keys, masked_input,
  unmask.
- :class:`PlainSession` (``secure_sum = "none"``): signed quantized updates summed in
  the clear; one stage, masked_input.

Later modes (homomorphic, distributed-DP noise, sparse encodings) are new subclasses.
Sessions are sans-I/O: nothing here touches the state store or the log.
"""

from __future__ import annotations

import hashlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from fedsec.crypto.quantize import dequantize_one, unpack
from fedsec.crypto.secagg import (
    AdvertiseKeys,
    MaskedInput,
    ServerSession,
    ShareKeys,
    ShareRelay,
    UnmaskResponse,
)
from fedsec.errors import BadVector, DuplicateMessage, RoundAborted, UnknownMember
from fedsec.protocol import codec, wire
from fedsec.protocol.replay import feed_accepted
from fedsec.protocol.stages import SECAGG_STAGES, Stage

# logged under the round engine's name (fedsec.aggregator.rounds.context): operators filter on it
log = logging.getLogger("fedsec.aggregator.coordinator")

#: A decoded stage message, as the member sent it.
StageMessage = AdvertiseKeys | ShareKeys | MaskedInput | UnmaskResponse


@dataclass(frozen=True, slots=True)
class SummationResult:
    """What an attempt summed, and from whom."""

    weighted_sum: np.ndarray  # Σ w·Δ, float64, length dim
    weight_sum: float  # Σ w
    survivors: list[str]  # whose contributions are in the sum, sorted
    dropped: list[str]  # who was expected but is not, sorted
    sum_sha256: str  # the sum as the mode computed it (the log's ``aggregate`` entry)


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
        """Who survived and who dropped, fetched in unmask.

        Raises:
            UnknownMember: ``member`` is not a survivor.
        """
        raise UnknownMember(f"{member} is not a survivor of round {self.spec.round}")


def open_session(
    spec: wire.RoundSpec, roster_keys: Mapping[str, bytes], min_agents: int
) -> SummationSession:
    """The session for ``spec``'s ``secure_sum`` mode: the one place that asks it.

    Args:
        spec: the attempt's signed spec.
        roster_keys: member id -> Ed25519 public key, for the cohort.
        min_agents: fewest contributions a sum may hold (modes without their own bound).
    """
    if spec.secure_sum == "secagg":
        return SecAggPlusSession(spec, roster_keys)
    return PlainSession(spec, min_agents)


class SecAggPlusSession(SummationSession):
    """SecAgg+ (Bell et al. 2020): the aggregator learns only the survivors' sum."""

    stages = SECAGG_STAGES

    def __init__(self, spec: wire.RoundSpec, roster_keys: Mapping[str, bytes]) -> None:
        super().__init__(spec)
        self.server = ServerSession(spec.secagg_params(), roster_keys)
        self._relays: dict[str, ShareRelay] = {}
        # the key list every live member fetches, built once (fixed from share_keys on)
        self._key_list: wire.KeyListBody | None = None

    def receive(self, stage: str, message: StageMessage) -> None:
        if stage == "advertise" and isinstance(message, AdvertiseKeys):
            self.server.receive_advertise(message)
        elif stage == "share_keys" and isinstance(message, ShareKeys):
            self.server.receive_share_keys(message)
        elif stage == "masked_input" and isinstance(message, MaskedInput):
            self.server.receive_masked_input(message)
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
        if stage == "unmask":
            # every survivor answered, or the answers so far already decide the sum
            return s.answered == s.survivors or s.ready_to_finalize()
        return False

    def close(self, stage: str) -> None:
        if stage == "advertise":
            self.server.close_advertise()
        elif stage == "share_keys":
            self._relays = self.server.close_share_keys()
        elif stage == "masked_input":
            self.server.close_masked_input()
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
        return SummationResult(
            weighted_sum=result.weighted_sum,
            weight_sum=result.weight_sum,
            survivors=list(result.survivors),
            dropped=list(result.dropped),
            sum_sha256=hashlib.sha256(result.ring_sum.tobytes()).hexdigest(),
        )

    def participant_count(self) -> int:
        return len(self.server.participants)

    def key_list(self, member: str) -> wire.KeyListBody:
        s = self.server
        if member not in s.live:
            return super().key_list(member)
        if self._key_list is None:
            self._key_list = codec.key_list_body(
                a for m, a in sorted(s.advertised.items()) if m in s.live
            )
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


class PlainSession(SummationSession):
    """A trusted aggregator: members' signed quantized updates summed in the clear.

    Args:
        spec: the attempt's signed spec.
        min_agents: fewest updates the sum may hold.
    """

    stages: tuple[Stage, ...] = ("masked_input",)

    def __init__(self, spec: wire.RoundSpec, min_agents: int) -> None:
        super().__init__(spec)
        self.min_agents = min_agents
        self.total = np.zeros(spec.dim, dtype=np.float64)  # Σ w·Δ
        self.weight = 0.0  # Σ w
        self.members: list[str] = []  # in arrival order

    def receive(self, stage: str, message: StageMessage) -> None:
        """Raises: DuplicateMessage, BadVector, QuantizationError (as the vector decodes)."""
        if stage != "masked_input" or not isinstance(message, MaskedInput):
            raise ValueError(f"a plain round takes only masked_input, not {stage}")
        member, spec = message.member, self.spec
        if member in self.members:
            raise DuplicateMessage(f"{member} already sent its update")
        quant = spec.quant_spec()
        vector = unpack(message.vector, spec.dim + 1, spec.ring_bits)
        if int(vector.max(initial=0)) > quant.levels:
            raise BadVector(f"{member}'s update has values above {quant.levels} levels")
        update, weight = dequantize_one(vector, quant)
        self.total += update
        self.weight += weight
        self.members.append(member)

    def replay(self, stage: str, member: str, raw: bytes) -> None:
        self.receive(stage, MaskedInput(member, raw))

    def complete(self, stage: str) -> bool:
        return stage == "masked_input" and len(self.members) == len(self.spec.cohort)

    def close(self, stage: str) -> None:
        raise ValueError(f"a plain round has no stage {stage!r} to close before finalize")

    def finalize(self) -> SummationResult:
        dropped = sorted(set(self.spec.cohort) - set(self.members))
        if len(self.members) < self.min_agents:
            raise RoundAborted(
                f"round {self.spec.round}: {len(self.members)} updates arrived, need "
                f"{self.min_agents}; missing: {dropped}"
            )
        return SummationResult(
            weighted_sum=self.total,
            weight_sum=self.weight,
            survivors=sorted(self.members),
            dropped=dropped,
            sum_sha256=hashlib.sha256(self.total.astype("<f8").tobytes()).hexdigest(),
        )

    def participant_count(self) -> int:
        return len(self.members)
