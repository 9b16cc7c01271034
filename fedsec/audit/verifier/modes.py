"""Each summation mode's audit, by the name a signed spec gives it (``secure_sum``).

A mode's audit says what the mode adds to the checks of an attempt
(:class:`fedsec.audit.verifier.attempts.ModeAudit`).  SecAgg+ and trusted-mode rounds
log no entries of their own: their archived messages are summed again by
:func:`fedsec.summation.replay`, the computation the aggregator's session and crash
resume use (a SecAgg+ round through the same server state machine, a trusted-mode
round's robust rule re-applied bit for bit).  A homomorphic round's commitments,
custodian's decryption and sum are :class:`fedsec.audit.verifier.homomorphic.HeAudit`'s.
"""

from __future__ import annotations

from typing import Any

from fedsec.audit.verifier import EntryProblem
from fedsec.audit.verifier.attempts import Attempt, Consulted, ModeAudit, Rederived
from fedsec.audit.verifier.homomorphic import HeAudit
from fedsec.crypto.quantize import unpack
from fedsec.errors import BadVector, IntegrityError
from fedsec.protocol.codec_choice import codec_for
from fedsec.protocol.log_entries import AggregateEntry
from fedsec.summation import SessionInputs, StoredAttempt, StoredMessage, SummationResult, replay

#: Trusted-mode rules whose inputs the log does not hold entirely, and why.
UNDERIVABLE_RULES: dict[str, str] = {
    "fltrust": "FLTrust weighs each update against a reference the aggregator trains on its "
    "own root dataset, which neither the log nor the archive holds",
}


class ReplayedAudit(ModeAudit):
    """A mode whose sum the auditor re-runs from the archived messages (SecAgg+)."""

    def rederive(self, index: int, body: AggregateEntry) -> Rederived:
        replayed = self._replay()
        if sorted(replayed.survivors) != sorted(body.survivors):
            raise EntryProblem(f"the archive gives survivors {sorted(replayed.survivors)}")
        if replayed.sum_sha256 != body.sum_sha256:
            raise EntryProblem("the sum recomputed from the archived inputs and reveals differs")
        self._check_groups(body, replayed)
        return Rederived((replayed.weighted_sum, replayed.weight_sum))

    def _check_groups(self, body: AggregateEntry, replayed: SummationResult) -> None:
        """A sharded attempt: each group logged as the signed spec names it, with the
        survivors and the ring sum its own unmasking gives again.

        Raises:
            EntryProblem: a group missing, added, or with other members, survivors or sum.
        """
        groups = self.attempt.spec.groups
        if len(body.groups) != len(groups):
            raise EntryProblem(
                f"it logs {len(body.groups)} shard group(s); the signed spec names {len(groups)}"
            )
        for index, (logged, group, part) in enumerate(
            zip(body.groups, groups, replayed.groups, strict=True)
        ):
            if logged.members != group.members:
                raise EntryProblem(f"shard group {index}'s members are not the signed spec's")
            if sorted(logged.survivors) != sorted(part.survivors):
                raise EntryProblem(
                    f"the archive gives shard group {index} survivors {sorted(part.survivors)}"
                )
            if logged.sum_sha256 != part.sum_sha256:
                raise EntryProblem(
                    f"shard group {index}'s sum recomputed from the archived inputs and "
                    "reveals differs"
                )

    def _replay(self) -> SummationResult:
        """The attempt summed again from its archived messages.

        Raises:
            FedsecError, msgspec.DecodeError: an archived message is altered or no
                longer verifies, or the messages cannot form a sum.
        """
        records = self.consulted.records
        assert records.archive is not None  # nothing is re-derived without it
        messages = [
            StoredMessage(stage, member, records.archive.get(digest))
            for stage, member, digest in self.attempt.messages
        ]
        inputs = SessionInputs(self._keys(), self.consulted.identities.min_agents)
        return replay(self.attempt.spec, StoredAttempt(inputs, messages))

    def _keys(self) -> dict[str, bytes]:
        """Each cohort member's key, active at the aggregate (the reveals are signed)."""
        identities = self.consulted.identities
        return {m: identities.member_key(m) for m in self.attempt.spec.cohort}


class TrustedAudit(ReplayedAudit):
    """Plain summation (the aggregator sees each update): its sum, or its robust rule,
    re-applied; a rule whose inputs the log does not hold is checked as far as it can be."""

    def rederive(self, index: int, body: AggregateEntry) -> Rederived:
        rule = self.attempt.spec.aggregation
        if rule is not None and rule.rule in UNDERIVABLE_RULES:
            return Rederived(underived=self._underived(body, rule.rule))
        return super().rederive(index, body)

    def _keys(self) -> dict[str, bytes]:
        return {}  # a trusted-mode sum checks no member's signature

    def _underived(self, body: AggregateEntry, rule: str) -> dict[str, object]:
        """A rule whose inputs the log does not hold all of (FLTrust's reference): check
        what it does hold, and list the round as not re-derived."""
        spec, records = self.attempt.spec, self.consulted.records
        assert records.archive is not None
        inputs = dict(self._inputs())
        strangers = sorted(set(body.survivors) - set(inputs))
        if strangers:
            raise EntryProblem(
                f"it names survivor(s) {', '.join(strangers)} without an accepted masked "
                f"input in round {spec.round} attempt {spec.attempt}"
            )
        least = self.consulted.identities.min_agents
        if len(inputs) < least or not body.survivors:
            raise EntryProblem(
                f"it aggregates {len(body.survivors)} of {len(inputs)} archived update(s); a "
                f"round closes with at least round.min_agents = {least} and applies one or more"
            )
        return {
            "round": spec.round,
            "attempt": spec.attempt,
            "rule": rule,
            "detail": f"inputs checked ({len(inputs)} archived updates, "
            f"{len(body.survivors)} applied), aggregate and model version not re-derived: "
            f"{UNDERIVABLE_RULES[rule]}",
        }

    def _inputs(self) -> list[tuple[str, Any]]:
        """(member, ring vector) of each archived masked input, in member order.

        Raises:
            IntegrityError: an update the aggregator must have refused.
        """
        spec, records = self.attempt.spec, self.consulted.records
        assert records.archive is not None
        encoding = codec_for(spec)
        inputs = []
        masked = sorted((m, d) for stage, m, d in self.attempt.messages if stage == "masked_input")
        for member, digest in masked:
            vector = unpack(records.archive.get(digest), encoding.length, spec.ring_bits)
            try:
                encoding.check_input(vector)
            except BadVector as exc:
                raise IntegrityError(
                    f"round {spec.round}: the archived update of {member} has {exc.detail}, "
                    "which the aggregator must have refused"
                ) from None
            inputs.append((member, vector))
        return inputs


#: The audit of each summation mode, by its ``secure_sum`` name.
AUDITS: dict[str, type[ModeAudit]] = {
    "secagg": ReplayedAudit,
    "none": TrustedAudit,
    "he": HeAudit,
}


def open_mode(attempt: Attempt, consulted: Consulted) -> ModeAudit:
    """The audit of ``attempt``'s summation mode.  A mode whose log holds only its stage
    messages needs no audit of its own: :class:`ReplayedAudit` sums them through the
    mode's :meth:`~fedsec.summation.SummationMode.replay`."""
    return AUDITS.get(attempt.spec.secure_sum, ReplayedAudit)(attempt, consulted)
