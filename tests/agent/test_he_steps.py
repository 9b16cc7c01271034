"""The member's check of the commitment set it is shown before it uploads its ciphertext
(homomorphic summation): its own commitment must be there as it sent it, every member
once and in the cohort; the digest it then binds is the one every member shown the same
set binds."""

from __future__ import annotations

import pytest

from fedsec.agent.he_steps import check_commitment_set
from fedsec.errors import IntegrityError
from fedsec.protocol import wire

COHORT = ["a0", "a1", "a2"]
OURS = "11" * 32


class _Spec:
    cohort = COHORT


def _set(*pairs: tuple[str, str]) -> wire.CommitmentSetBody:
    return wire.CommitmentSetBody([wire.MemberCommitment(m, h, "00" * 64) for m, h in pairs])


def _check(body: wire.CommitmentSetBody) -> str:
    return check_commitment_set(body, _Spec(), "a0", OURS)  # type: ignore[arg-type]


def test_the_digest_is_the_sets_whatever_the_order() -> None:
    pairs = [("a1", "22" * 32), ("a0", OURS), ("a2", "33" * 32)]
    digest = _check(_set(*pairs))
    assert digest == wire.commitments_digest(pairs)
    assert digest == _check(_set(*sorted(pairs)))
    # a set without a2's commitment is another set: another digest
    assert _check(_set(*pairs[:2])) != digest


@pytest.mark.parametrize(
    ("pairs", "match"),
    [
        ([("a1", "22" * 32)], "does not hold our commitment"),
        ([("a0", "44" * 32), ("a1", "22" * 32)], "does not hold our commitment"),
        ([("a0", OURS), ("a1", "22" * 32), ("a1", "33" * 32)], "more than once"),
        ([("a0", OURS), ("eve", "22" * 32)], "outside the cohort"),
    ],
    ids=["ours dropped", "ours altered", "a member twice", "outside the cohort"],
)
def test_a_set_an_honest_aggregator_does_not_fix_is_refused(
    pairs: list[tuple[str, str]], match: str
) -> None:
    with pytest.raises(IntegrityError, match=match):
        _check(_set(*pairs))
