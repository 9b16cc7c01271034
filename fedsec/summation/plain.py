"""Trusted mode (``secure_sum = "none"``): members' signed quantized updates summed in
the clear, or combined by the spec's robust rule (:mod:`fedsec.learning.robust`); one
stage, masked_input."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from fedsec.crypto.quantize import check_packed, unpack
from fedsec.crypto.secagg import MaskedInput
from fedsec.errors import BadVector, DuplicateMessage, ProtocolError, RoundAborted
from fedsec.learning import robust
from fedsec.protocol import wire
from fedsec.protocol.codec_choice import codec_for
from fedsec.protocol.stages import Stage
from fedsec.summation.mode import SessionInputs, StageWindow, SummationMode, upload_window
from fedsec.summation.session import (
    ReferenceUpdate,
    RuleRefusal,
    StageMessage,
    SummationResult,
    SummationSession,
    log,
)


class PlainSession(SummationSession):
    """A trusted aggregator: members' signed quantized updates summed in the clear, or,
    when the spec names an aggregation rule (``spec.aggregation``), combined by that rule
    (:mod:`fedsec.learning.robust`) once they are all in.

    Without a rule, only the running sum is kept (O(dim)), and each upload is read from its
    packed bytes a run at a time (plain codec: no unpacked copy of it).  With one, each
    accepted update is kept as its ring vector (dim + 1 values of the ring's width, its
    smallest form) until finalize, so memory is bounded by the cohort cap:
    ``round.max_agents`` × (dim + 1) × ring bytes, and finalize briefly holds ``n × dim``
    float64 values and the rule's temporaries (:mod:`fedsec.learning.robust`).

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
        if self.rule is None:  # only the running sum is kept: read the upload in runs
            check_packed(message.vector, encoding.length, spec.ring_bits)
            try:
                encoding.check_packed(message.vector)
            except BadVector as exc:
                raise BadVector(f"{member}'s update: {exc.detail}") from None
            self.weight += encoding.add_packed(message.vector, self.total)
            self.members.append(member)
            return
        vector = unpack(message.vector, encoding.length, spec.ring_bits)
        try:
            encoding.check_input(vector)
        except BadVector as exc:
            raise BadVector(f"{member}'s update: {exc.detail}") from None
        self.weight += encoding.add_one(vector, self.total)
        self.members.append(member)
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


@dataclass(frozen=True)
class PlainMode(SummationMode):
    """A trusted aggregator: it sees every update, so it may apply a robust rule."""

    name: str = "none"
    stages: tuple[Stage, ...] = ("masked_input",)
    windows: Mapping[str, StageWindow] = field(
        default_factory=lambda: {"masked_input": upload_window}
    )

    def _open(self, spec: wire.RoundSpec, inputs: SessionInputs) -> PlainSession:
        return PlainSession(spec, inputs.min_agents, inputs.reference)


PLAIN = PlainMode()
