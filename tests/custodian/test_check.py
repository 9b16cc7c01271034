"""The custodian's decision against a real log and real ciphertexts: it releases the exact
integer sum of an honest round, and refuses every offer the log does not prove, without
decrypting anything."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest

from fedsec.crypto import he
from fedsec.crypto.identity import SigningIdentity
from fedsec.custodian import check
from fedsec.custodian.check import LogFollower, Refused, Released, decide
from fedsec.errors import IntegrityError
from fedsec.protocol.he_release import frame as frame_decryption
from fedsec.protocol.log import lines
from fedsec.protocol.log_entries import RoundAbortedEntry
from fedsec.protocol.wire import DecryptionStatement

from .conftest import ATTEMPT, CUSTODIAN, DIM, FID, MEMBERS, ROUND, Federation, quantized_update


class DecryptSpy:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return he.decrypt_sum(*args, **kwargs)


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Iterator[DecryptSpy]:
    """Counts every decryption of a sum: check.decrypt_sum is the release's only use of
    the secret context (each contribution is opened apart, by check.decrypt_contribution)."""
    recorder = DecryptSpy()
    monkeypatch.setattr(check, "decrypt_sum", recorder)
    yield recorder


def refused(federation: Federation, offer: Any, spy: DecryptSpy, **kwargs: Any) -> Refused:
    follower = kwargs.pop("follower", None) or federation.follower()
    with pytest.raises(Refused) as caught:
        decide(offer, follower, federation.fetch(), federation.custody(), **kwargs)
    assert spy.calls == 0, "a refused offer must never reach the secret context"
    return caught.value


# -- the honest round --------------------------------------------------------------------------


def test_releases_the_exact_integer_sum(federation: Federation, spy: DecryptSpy) -> None:
    offer = federation.honest_round()
    release = decide(offer, federation.follower(), federation.fetch(), federation.custody())

    expected = federation.expected_sum(MEMBERS)
    assert np.array_equal(np.frombuffer(release.plaintext, dtype="<i8"), expected)
    assert len(release.plaintext) == (DIM + 1) * 8
    statement = release.statement
    assert statement == DecryptionStatement(
        federation_id=FID,
        round=ROUND,
        attempt=ATTEMPT,
        custodian=CUSTODIAN,
        contributors=sorted(MEMBERS),
        sum_sha256=offer.sum_sha256,
        plaintext_sha256=hashlib.sha256(release.plaintext).hexdigest(),
    )
    assert statement.signature == ""  # the service signs it
    assert spy.calls == 1


def test_the_same_release_is_answered_again(federation: Federation, spy: DecryptSpy) -> None:
    offer = federation.honest_round()
    released = [Released(ROUND, ATTEMPT, offer.sum_sha256, tuple(MEMBERS))]
    again = decide(
        offer, federation.follower(), federation.fetch(), federation.custody(), released=released
    )
    assert np.array_equal(
        np.frombuffer(again.plaintext, dtype="<i8"), federation.expected_sum(MEMBERS)
    )


def test_the_log_may_arrive_in_any_pieces(federation: Federation, spy: DecryptSpy) -> None:
    offer = federation.honest_round()
    raw = federation.log_bytes()
    follower = LogFollower(FID, federation.aggregator.public_bytes)
    for start in range(0, len(raw), 97):  # cuts lines anywhere, JSON included
        follower.feed(raw[start : start + 97])
    assert follower.next_index == len(federation.entries)
    release = decide(offer, follower, federation.fetch(), federation.custody())
    assert release.statement.sum_sha256 == offer.sum_sha256


def test_decryption_body_layout(federation: Federation, spy: DecryptSpy) -> None:
    offer = federation.honest_round()
    release = decide(offer, federation.follower(), federation.fetch(), federation.custody())
    signed = release.statement.sign(federation.custodian)
    body = frame_decryption(signed, release.plaintext)
    length = int.from_bytes(body[:4], "little")
    statement = msgspec.json.decode(body[4 : 4 + length], type=DecryptionStatement)
    statement.verify(federation.custodian.public_bytes)
    assert body[4 + length :] == release.plaintext


# -- sums that are not the logged sum ----------------------------------------------------------


def test_refuses_a_digest_that_is_not_the_readded_sum(
    federation: Federation, spy: DecryptSpy
) -> None:
    federation.honest_round()
    # the aggregator asks for alice's ciphertext alone, labelled as everyone's sum
    alice = federation.archive[_logged(federation)["alice"]]
    offer = federation.offer(MEMBERS, bodies=[alice])
    assert refused(federation, offer, spy).reason == "not_logged_sum"


def test_refuses_an_offer_that_leaves_out_an_accepted_member(
    federation: Federation, spy: DecryptSpy
) -> None:
    federation.honest_round()
    offer = federation.offer(["alice", "bob", "carol"])
    assert refused(federation, offer, spy).reason == "not_logged_sum"


# -- too few, twice, unknown -------------------------------------------------------------------


def test_refuses_fewer_than_min_agents(federation: Federation, spy: DecryptSpy) -> None:
    offer = federation.honest_round(["alice", "bob"])
    error = refused(federation, offer, spy)
    assert error.reason == "too_few"
    assert "at least 3" in error.detail


def test_genesis_min_agents_above_the_floor_counts(
    he_keys: tuple[bytes, bytes], spy: DecryptSpy
) -> None:
    federation = Federation(*he_keys, min_agents=4).setup()
    offer = federation.honest_round(["alice", "bob", "carol"])
    assert refused(federation, offer, spy).reason == "too_few"


def test_a_genesis_cannot_lower_the_custodians_floor(
    he_keys: tuple[bytes, bytes], spy: DecryptSpy
) -> None:
    federation = Federation(*he_keys, min_agents=1).setup()
    offer = federation.honest_round(["alice", "bob"])
    assert refused(federation, offer, spy).reason == "too_few"


def test_refuses_the_same_member_twice_in_the_offer(
    federation: Federation, spy: DecryptSpy
) -> None:
    federation.honest_round()
    offer = federation.offer(MEMBERS)
    offer = msgspec.structs.replace(offer, contributors=["alice", *offer.contributors])
    assert refused(federation, offer, spy).reason == "counted_twice"


def test_refuses_the_same_ciphertext_accepted_twice(
    federation: Federation, spy: DecryptSpy
) -> None:
    federation.append(federation.spec())
    # dave (a real member, signing) commits to alice's ciphertext's hash, which the
    # aggregator told it, and re-uploads her ciphertext: alice counted twice
    federation.commit(bodies={"dave": federation.prepared("alice")})
    for member in ("alice", "bob", "carol"):
        federation.accept(member)
    federation.accept("dave", federation.archive[_logged(federation)["alice"]])
    offer = federation.offer(MEMBERS)
    assert refused(federation, offer, spy).reason == "counted_twice"


def test_refuses_a_member_accepted_twice(federation: Federation, spy: DecryptSpy) -> None:
    federation.append(federation.spec())
    federation.commit()
    for member in MEMBERS:
        federation.accept(member)
    federation.accept("alice", federation.encrypted(quantized_update(7)))
    offer = federation.offer(MEMBERS)
    assert refused(federation, offer, spy).reason == "counted_twice"


def test_refuses_a_contributor_not_accepted_in_the_log(
    federation: Federation, spy: DecryptSpy
) -> None:
    federation.honest_round(["alice", "bob", "carol"])
    eve = federation.encrypted(quantized_update(9))
    offer = federation.offer(
        ["alice", "bob", "carol", "eve"],
        bodies=[*(federation.archive[d] for d in _logged(federation).values()), eve],
    )
    assert refused(federation, offer, spy).reason == "unknown_contributor"


def test_refuses_a_contribution_outside_the_cohort(federation: Federation, spy: DecryptSpy) -> None:
    federation.append(federation.spec(cohort=["alice", "bob", "carol"]))
    federation.commit()
    for member in MEMBERS:
        federation.accept(member)
    error = refused(federation, federation.offer(MEMBERS), spy)
    assert error.reason == "unknown_contributor"
    assert "dave is not in the attempt's cohort" in error.detail


def test_refuses_a_contribution_its_member_did_not_sign(
    federation: Federation, spy: DecryptSpy
) -> None:
    federation.append(federation.spec())
    # the aggregator makes up dave's contribution: it cannot sign as dave
    made_up = federation.encrypted(np.zeros(DIM + 1))
    federation.commit(bodies={"dave": made_up})
    for member in ("alice", "bob", "carol"):
        federation.accept(member)
    federation.accept("dave", made_up, signer=federation.aggregator)
    error = refused(federation, federation.offer(MEMBERS), spy)
    assert error.reason == "forged_contribution"


def test_refuses_a_contribution_of_a_custodian_role(
    federation: Federation, spy: DecryptSpy
) -> None:
    federation.append(federation.spec(cohort=[*MEMBERS, CUSTODIAN]))
    zeros = federation.encrypted(np.zeros(DIM + 1))
    federation.commit(["alice", "bob"])
    federation.commit([CUSTODIAN], {CUSTODIAN: zeros}, signer=federation.custodian)
    for member in ("alice", "bob"):
        federation.accept(member)
    federation.accept(CUSTODIAN, zeros, signer=federation.custodian)
    error = refused(federation, federation.offer(["alice", "bob", CUSTODIAN]), spy)
    assert error.reason == "unknown_contributor"


# -- the archive -------------------------------------------------------------------------------


def test_refuses_archive_bytes_that_do_not_hash_to_the_entry(
    federation: Federation, spy: DecryptSpy
) -> None:
    offer = federation.honest_round()
    digest = _logged(federation)["bob"]
    good = federation.archive[digest]
    other = federation.encrypted(quantized_update(55))
    # same length, other bytes: only the hash tells them apart
    federation.archive[digest] = other[: len(good)].ljust(len(good), b"\0")
    assert refused(federation, offer, spy).reason == "archive_mismatch"


def test_refuses_a_missing_archive_object(federation: Federation, spy: DecryptSpy) -> None:
    offer = federation.honest_round()
    del federation.archive[_logged(federation)["carol"]]
    assert refused(federation, offer, spy).reason == "archive_mismatch"


# -- the log -----------------------------------------------------------------------------------


def test_refuses_a_tampered_log_line(federation: Federation, spy: DecryptSpy) -> None:
    offer = federation.honest_round()
    docs = [json.loads(e.line) for e in federation.entries]
    target = next(i for i, d in enumerate(docs) if d["kind"] == "accepted")
    docs[target]["body"]["member"] = "eve"
    raw = b"".join(
        json.dumps(d, sort_keys=True, separators=(",", ":")).encode() + b"\n" for d in docs
    )
    follower = LogFollower(FID, federation.aggregator.public_bytes)
    with pytest.raises(IntegrityError, match="does not chain"):
        follower.feed(raw)
    # an altered line shows only in the next one, whose prev no longer matches: that
    # line and everything after it are not kept
    assert follower.next_index == target + 1
    with pytest.raises(IntegrityError):  # broken for good
        follower.feed(b"")
    assert refused(federation, offer, spy, follower=follower).reason == "bad_log"


def test_refuses_a_log_rewritten_between_reads(federation: Federation, spy: DecryptSpy) -> None:
    federation.honest_round()
    follower = federation.follower()
    # the aggregator serves a rewritten history to a later read
    rewritten = Federation(federation.secret, federation.public)
    rewritten.aggregator = federation.aggregator
    rewritten.setup()
    rewritten.honest_round()
    rewritten.head()
    with pytest.raises(IntegrityError):
        follower.feed(lines(rewritten.entries[len(federation.entries) :]))


def test_refuses_a_head_signed_by_another_key(federation: Federation, spy: DecryptSpy) -> None:
    federation.append(federation.spec())
    federation.commit()
    for member in MEMBERS:
        federation.accept(member)
    offer = federation.offer(MEMBERS)
    federation.head(signer=SigningIdentity.generate())
    follower = LogFollower(FID, federation.aggregator.public_bytes)
    with pytest.raises(IntegrityError, match="head signature does not verify"):
        follower.feed(federation.log_bytes())
    assert refused(federation, offer, spy, follower=follower).reason == "bad_log"


def test_refuses_a_log_of_another_aggregator_key(federation: Federation, spy: DecryptSpy) -> None:
    federation.honest_round()
    follower = LogFollower(FID, SigningIdentity.generate().public_bytes)
    with pytest.raises(IntegrityError, match="aggregator key other than the pinned one"):
        follower.feed(federation.log_bytes())
    assert follower.next_index == 0


def test_refuses_an_offer_beyond_the_log_served(federation: Federation, spy: DecryptSpy) -> None:
    offer = federation.honest_round()
    follower = LogFollower(FID, federation.aggregator.public_bytes)
    follower.feed(lines(federation.entries[:-3]))
    assert refused(federation, offer, spy, follower=follower).reason == "log_incomplete"


def test_refuses_an_attempt_already_over(federation: Federation, spy: DecryptSpy) -> None:
    offer = federation.honest_round()
    federation.append(RoundAbortedEntry(round=ROUND, attempt=ATTEMPT, detail="deadline"))
    assert refused(federation, offer, spy).reason == "attempt_over"


def test_refuses_a_second_sum_of_a_released_round(federation: Federation, spy: DecryptSpy) -> None:
    offer = federation.honest_round()
    # attempt 0 released everyone's sum but the post was lost; this attempt lacks dave:
    # the two sums would give dave's update
    released = [Released(ROUND, ATTEMPT + 1, "ee" * 32, ("alice", "bob", "carol"))]
    error = refused(federation, offer, spy, released=released)
    assert error.reason == "already_released"


def test_a_sum_of_other_members_of_the_round_may_be_released(
    federation: Federation, spy: DecryptSpy
) -> None:
    offer = federation.honest_round()
    released = [
        Released(ROUND, ATTEMPT + 1, "ee" * 32, ("erin", "frank", "grace")),
        Released(ROUND - 1, ATTEMPT, "dd" * 32, tuple(MEMBERS)),
    ]
    decide(
        offer, federation.follower(), federation.fetch(), federation.custody(), released=released
    )
    assert spy.calls == 1


# -- the round and the context -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"secure_sum": "secagg", "he_context_sha256": "", "custodian": ""}, "not_he_round"),
        ({"secure_sum": "none", "he_context_sha256": "", "custodian": ""}, "not_he_round"),
        ({"he_context_sha256": "ff" * 32}, "wrong_context"),
        ({"custodian": "someone-else"}, "wrong_context"),
    ],
)
def test_refuses_a_round_not_under_this_context(
    federation: Federation, spy: DecryptSpy, changes: dict[str, Any], reason: str
) -> None:
    federation.append(federation.spec(**changes))
    federation.commit()
    for member in MEMBERS:
        federation.accept(member)
    assert refused(federation, federation.offer(MEMBERS), spy).reason == reason


def test_refuses_without_the_custodians_context_statement(
    he_keys: tuple[bytes, bytes], spy: DecryptSpy
) -> None:
    federation = Federation(*he_keys)
    federation.setup()
    # drop the he_context entry: rebuild the log without it
    kept = [e for e in federation.entries if e.kind not in ("he_context", "head")]
    federation.entries = []
    for entry in kept:
        federation.append(entry.decode())
    offer = federation.honest_round()
    assert refused(federation, offer, spy).reason == "wrong_context"


def test_refuses_a_context_statement_not_signed_by_the_custodian(
    he_keys: tuple[bytes, bytes], spy: DecryptSpy
) -> None:
    federation = Federation(*he_keys)
    federation.setup()
    kept = [e for e in federation.entries if e.kind not in ("he_context", "head")]
    federation.entries = []
    for entry in kept:
        federation.append(entry.decode())
    forged = federation.context_statement().sign(federation.aggregator)
    federation.append(forged)
    offer = federation.honest_round()
    assert refused(federation, offer, spy).reason == "wrong_context"


def test_refuses_no_spec(federation: Federation, spy: DecryptSpy) -> None:
    offer = federation.offer([], bodies=[federation.encrypted(quantized_update(1))])
    offer = msgspec.structs.replace(offer, contributors=list(MEMBERS))
    assert refused(federation, offer, spy).reason == "not_he_round"


# -- what decrypts but is not released ---------------------------------------------------------


def test_refuses_a_non_integral_sum(federation: Federation, spy: DecryptSpy) -> None:
    federation.append(federation.spec())
    halves = federation.encrypted(quantized_update(3).astype(np.float64) + 0.5)
    federation.commit(bodies={"dave": halves})
    for member in ("alice", "bob", "carol"):
        federation.accept(member)
    federation.accept("dave", halves)
    offer = federation.offer(MEMBERS)
    with pytest.raises(Refused) as caught:
        decide(offer, federation.follower(), federation.fetch(), federation.custody())
    assert caught.value.reason == "not_integral"
    assert "dave" in caught.value.detail  # its contribution, opened alone
    assert spy.calls == 0  # the sum was never decrypted


def test_refuses_a_sum_out_of_range(federation: Federation, spy: DecryptSpy) -> None:
    federation.append(federation.spec())
    federation.commit(bodies={"dave": federation.encrypted(np.full(DIM + 1, -5000.0))})
    for member in MEMBERS:
        federation.accept(member)
    with pytest.raises(Refused) as caught:
        decide(
            federation.offer(MEMBERS),
            federation.follower(),
            federation.fetch(),
            federation.custody(),
        )
    assert caught.value.reason == "out_of_range"


def _logged(federation: Federation) -> dict[str, str]:
    return {
        e.body["member"]: e.body["sha256"]
        for e in federation.entries
        if e.kind == "accepted" and e.body["stage"] == "masked_input"
    }
