"""What this member signs and keeps for one contribution: the privacy report, the
contribution statement (the commitment the auditor may ask it to open), the receipt
check and the agent's own record.  Pure: signing and hashing only."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from fedsec.agent.charges import PrivacyCharge, TrainedUpdate
from fedsec.agent.member import Member
from fedsec.agent.vault import RoundRecord
from fedsec.crypto.commitment import CommitmentContext, commit
from fedsec.crypto.quantize import RingVector
from fedsec.errors import IntegrityError
from fedsec.protocol.ddp import is_distributed
from fedsec.protocol.wire import ContributionStatement, PrivacyReport, Receipt, RoundSpec


@dataclass(frozen=True)
class Contribution:
    """What this member puts into one attempt."""

    trained: TrainedUpdate
    samples: int
    weight: float
    quantized: RingVector


def privacy_report(
    spec: RoundSpec, member: Member, charged: PrivacyCharge | TrainedUpdate
) -> PrivacyReport:
    """The signed report of what this attempt's training was charged."""
    return PrivacyReport(
        federation_id=spec.federation_id,
        round=spec.round,
        attempt=spec.attempt,
        member=member.id,
        dataset_id=member.dataset_id,
        epsilon=charged.epsilon,
        delta=member.privacy_delta,
        # without DP no noise was added, whatever value the spec carries
        noise_multiplier=spec.dp.noise_multiplier if spec.dp.enabled else 0.0,
        sample_rate=charged.sample_rate,
        steps=charged.steps,
        samples=member.samples,
        trained_round=charged.trained_round,
        epsilon_budget=member.privacy_epsilon,
        extra_epsilon=member.extra_epsilon,
        dp_mode="distributed" if is_distributed(spec) else "local",
        honest_survivors=spec.dp.min_survivors if is_distributed(spec) else 0,
        charge=charged.index,
        unreported=list(charged.unreported),
    ).sign(member.identity)


def contribution_statement(
    spec: RoundSpec,
    member: Member,
    quantized: RingVector,
    salt: bytes,
    vector: bytes,
    commitments_sha256: str = "",
) -> ContributionStatement:
    """The signed statement binding ``vector`` to the commitment H(salt ‖ quantized)
    (and, in homomorphic summation, to the commitment set's digest we were shown)."""
    commitment = commit(
        quantized,
        salt,
        CommitmentContext(spec.federation_id, spec.round, spec.attempt, member.id, spec.ring_bits),
    )
    return ContributionStatement(
        federation_id=spec.federation_id,
        round=spec.round,
        attempt=spec.attempt,
        member=member.id,
        vector_sha256=hashlib.sha256(vector).hexdigest(),
        commitment=commitment.hex(),
        commitments_sha256=commitments_sha256,
    ).sign(member.identity)


def check_receipt(receipt: Receipt, spec: RoundSpec, member: str, digest: str) -> None:
    """Raises IntegrityError: the receipt names another member, round or contribution."""
    r, a = spec.round, spec.attempt
    expected = (spec.federation_id, r, a, member, digest)
    got = (
        receipt.federation_id,
        receipt.round,
        receipt.attempt,
        receipt.member,
        receipt.contribution_sha256,
    )
    if got != expected:
        raise IntegrityError(
            f"receipt for round {r} attempt {a} does not acknowledge what was sent: "
            f"expected {expected}, got {got}"
        )


def round_record(
    spec: RoundSpec, member: Member, contribution: Contribution, receipt: Receipt, at: float
) -> RoundRecord:
    trained = contribution.trained
    return RoundRecord(
        federation_id=spec.federation_id,
        round=spec.round,
        attempt=spec.attempt,
        member=member.id,
        dataset_id=member.dataset_id,
        model_version=spec.model_version,
        secure_sum=spec.secure_sum,
        epsilon=trained.epsilon,
        samples=contribution.samples,
        weight=contribution.weight,
        steps=trained.steps,
        contribution_sha256=receipt.contribution_sha256,
        receipt_log_index=receipt.log_index,
        recorded_at=at,
        dp_mode="distributed" if is_distributed(spec) else "local",
    )
