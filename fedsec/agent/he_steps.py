"""This member's stages of homomorphic summation: encrypt the quantized update a plain
round would send, commit to the ciphertext's hash, then upload it.  The aggregator adds
the ciphertexts, and only their sum is ever decrypted (by the key custodian).

The commit step, between encrypting the update and uploading it:

A member colluding with the aggregator could upload ``Enc(c) − Σ`` of the honest
members' ciphertexts, which cancels them in the sum the custodian decrypts.  So every
member first commits to the SHA-256 of the exact bytes it will upload (signed, logged);
the aggregator serves no ciphertext, and accepts none, until the commitment set is fixed,
and then refuses a ciphertext that is not the committed one.  Each member binds the
digest of the set it was shown into its contribution statement: an aggregator that
shows members different sets (e.g. one completed with a colluder's commitment after the
honest ciphertexts arrived) makes their statements disagree, and the custodian and
``fedsec audit verify`` refuse the round.
"""

from __future__ import annotations

import hashlib
import logging

from fedsec.agent.actions import (
    CommitmentsFetched,
    Encrypt,
    Encrypted,
    FaultPoint,
    FetchCommitments,
    Passed,
    SendCommit,
    Step,
    ask,
)
from fedsec.agent.attempt import AttemptTracker, upload
from fedsec.agent.charges import TrainedUpdate
from fedsec.agent.contribution import Contribution
from fedsec.agent.member import Member
from fedsec.agent.member_steps import MemberAttempt, charge_and_train
from fedsec.errors import IntegrityError
from fedsec.protocol.stages import Stage
from fedsec.protocol.wire import (
    CiphertextCommitment,
    CommitBody,
    CommitmentSetBody,
    Receipt,
    RoundSpec,
    commitments_digest,
)

log = logging.getLogger("fedsec.agent")


class HeSteps:
    """The homomorphic summation mode's member steps
    (:class:`~fedsec.agent.member_steps.MemberSteps`)."""

    # a member that has not committed to its ciphertext cannot send one
    first_stage: Stage = "commit"
    # an aggregator holding the ciphertext could difference it against a retry's sum, or
    # cancel it with a colluder's
    releases_update = True
    judged_by_rule = False

    def __init__(self, attempt: MemberAttempt) -> None:
        self.attempt = attempt

    def train(self) -> Step[tuple[TrainedUpdate, bool]]:
        return (yield from charge_and_train(self.attempt)), False

    def finish(self, c: Contribution) -> Step[Receipt]:
        attempt = self.attempt
        spec = attempt.spec
        yield from attempt.tracker.wait_for(("commit",))
        body = (yield from ask(Encrypt(spec, c.quantized), Encrypted)).body
        # chaos tests: a member lost after training, before its ciphertexts go out
        yield from ask(FaultPoint(spec.round, "encrypted"), Passed)
        bound = yield from commit_ciphertext(attempt.tracker, spec, attempt.member, body)
        receipt, _ = yield from attempt.send_vector(c, body, commitments_sha256=bound)
        return receipt


def commit_ciphertext(
    attempt: AttemptTracker, spec: RoundSpec, member: Member, ciphertext: bytes
) -> Step[str]:
    """Commit to ``ciphertext``'s hash, then get the attempt's commitment set.

    Returns:
        The set's digest, which our contribution statement binds.

    Raises:
        IntegrityError: the set is not one an honest aggregator fixes (see
            :func:`check_commitment_set`).
    """
    (r, a), wait = attempt.key, attempt.long_poll_s
    digest = hashlib.sha256(ciphertext).hexdigest()
    signed = CiphertextCommitment(
        federation_id=spec.federation_id, round=r, attempt=a, member=member.id, vector_sha256=digest
    ).sign(member.identity)
    answer = yield from upload(SendCommit(r, a, CommitBody(digest, signed.signature), wait))
    log.info("he_committed round=%d attempt=%d sha256=%s", r, a, digest)
    if answer is not None and answer.commitments is not None:
        commitments = answer.commitments
    else:
        fetched = yield from attempt.stage_data(
            "masked_input", lambda w: FetchCommitments(r, a, w), CommitmentsFetched
        )
        commitments = fetched.body
    return check_commitment_set(commitments, spec, member.id, digest)


def check_commitment_set(body: CommitmentSetBody, spec: RoundSpec, member: str, digest: str) -> str:
    """The digest of ``body``, when it names cohort members once each and holds our
    commitment to ``digest``.

    Raises:
        IntegrityError: a member twice or outside the cohort, or ours missing or altered.
    """
    members = [c.member for c in body.commitments]
    if len(set(members)) != len(members):
        raise IntegrityError("the commitment set names a member more than once")
    outside = sorted(set(members) - set(spec.cohort))
    if outside:
        raise IntegrityError(f"the commitment set names {outside[:8]}, outside the cohort")
    ours = [c.vector_sha256 for c in body.commitments if c.member == member]
    if ours != [digest]:
        raise IntegrityError(
            "the commitment set does not hold our commitment as we sent it: the aggregator "
            "altered or dropped it"
        )
    return commitments_digest((c.member, c.vector_sha256) for c in body.commitments)
