"""The member's commit step of homomorphic summation, between encrypting its update and
uploading it.

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

from fedsec.agent.actions import CommitmentsFetched, FetchCommitments, SendCommit, Step
from fedsec.agent.attempt import AttemptTracker, upload
from fedsec.agent.member import Member
from fedsec.errors import IntegrityError
from fedsec.protocol.wire import (
    CiphertextCommitment,
    CommitBody,
    CommitmentSetBody,
    RoundSpec,
    commitments_digest,
)

log = logging.getLogger("fedsec.agent")


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
