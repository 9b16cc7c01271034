"""Each summation mode's audit, by the name a signed spec gives it (``secure_sum``).

A mode's audit says what the mode adds to the checks of an attempt
(:class:`fedsec.audit.verifier.attempts.ModeAudit`): SecAgg+ and trusted-mode rounds
log no entries of their own and are re-aggregated by replaying their messages
(:func:`fedsec.audit.verifier.sums.replay`); a homomorphic round's commitments,
custodian's decryption and sum are :class:`fedsec.audit.verifier.homomorphic.HeAudit`'s.
"""

from __future__ import annotations

from fedsec.audit.verifier import EntryProblem
from fedsec.audit.verifier.attempts import Attempt, Consulted, ModeAudit, Rederived
from fedsec.audit.verifier.homomorphic import HeAudit
from fedsec.audit.verifier.sums import Replayed, replay, trusted_inputs
from fedsec.protocol.log_entries import AggregateEntry

#: Trusted-mode rules whose inputs the log does not hold entirely, and why.
UNDERIVABLE_RULES: dict[str, str] = {
    "fltrust": "FLTrust weighs each update against a reference the aggregator trains on its "
    "own root dataset, which neither the log nor the archive holds",
}


class ReplayedAudit(ModeAudit):
    """A mode whose sum the auditor re-runs from the archived messages (SecAgg+)."""

    def rederive(self, index: int, body: AggregateEntry) -> Rederived:
        replayed = self._replay(index)
        if sorted(replayed.survivors) != sorted(body.survivors):
            raise EntryProblem(f"the archive gives survivors {sorted(replayed.survivors)}")
        if replayed.sha256 != body.sum_sha256:
            raise EntryProblem("the sum recomputed from the archived inputs and reveals differs")
        return Rederived(replayed.sums)

    def _replay(self, index: int) -> Replayed:
        spec = self.attempt.spec
        records = self.consulted.records
        assert records.archive is not None  # nothing is re-derived without it
        return replay(spec, self.attempt.messages, records.archive.get, self._keys())

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
        inputs = dict(trusted_inputs(spec, self.attempt.messages, records.archive.get))
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


#: The audit of each summation mode, by its ``secure_sum`` name.
AUDITS: dict[str, type[ModeAudit]] = {
    "secagg": ReplayedAudit,
    "none": TrustedAudit,
    "he": HeAudit,
}


def open_mode(attempt: Attempt, consulted: Consulted) -> ModeAudit:
    """The audit of ``attempt``'s summation mode."""
    return AUDITS[attempt.spec.secure_sum](attempt, consulted)
