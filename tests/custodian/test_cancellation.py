"""A colluding member cancels the honest members' contributions (issue 32, item 1).

The aggregator holds every member's ciphertext; a member colluding with it uploads
``Enc(0) − Σ`` of the other honest members' ciphertexts, signed as its own.  The sum the
custodian is offered is then the victim's ciphertext alone, although the log shows four
distinct, signed contributions: a custodian that checks only the sum releases the
victim's exact vector.  Two layers refuse it.  The commit step: every member commits to
its ciphertext's hash before any ciphertext is accepted or served, and binds the digest of
the commitment set into its statement, so a ciphertext made from the others' is either
not the one its member committed to, or committed after them, which the honest
statements' digest shows.  And the custodian decrypts each contribution privately and
refuses one that is not an integer vector in the codec's range, or that repeats another.
Most tests here log the colluder's commitment as if it had the honest ciphertexts in
advance (the harness holds every key), to test the second layer alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tenseal as ts

from fedsec.crypto import he
from fedsec.custodian.check import ROUNDING_TOLERANCE, Refused, decide
from fedsec.custodian.service import DecryptionHalted

from .conftest import DIM, MEMBERS, PARAMS, QUANT_BITS, Federation
from .test_service import FakeAggregator, serve

VICTIM, COLLUDER = "alice", "dave"
HONEST_OTHERS = ("bob", "carol")
LEVELS = (1 << QUANT_BITS) - 1


def cancelling(federation: Federation, bodies: Sequence[bytes], plus: np.ndarray) -> bytes:
    """``Enc(plus) − Σ bodies``, chunk by chunk, framed as a member's upload: made with
    the public context and the ciphertexts alone, as the aggregator and a member can."""
    dim = federation.dim + 1
    parts = [he.unframe_chunks(b, PARAMS, dim) for b in bodies]
    own = he.encrypt(federation.public_ctx, plus.astype(np.float64))
    ctx = federation.public_ctx.context
    out = []
    for i, chunk in enumerate(own):
        vec = ts.ckks_vector_from(ctx, chunk)
        for chunks in parts:
            vec = vec - ts.ckks_vector_from(ctx, chunks[i])
        out.append(bytes(vec.serialize()))
    return he.frame_chunks(out)


def with_foreknowledge(
    federation: Federation, colluding: Callable[[Mapping[str, bytes]], bytes]
) -> None:
    """A round in which the colluder committed to ``colluding(honest ciphertexts)`` as if
    it had them before committing, which the commit step rules out (see
    :func:`test_a_shifted_cancellation_of_concentrated_updates_is_refused`): the log
    passes every check but the opening of each contribution."""
    federation.append(federation.spec())
    honest = {m: federation.prepared(m) for m in (VICTIM, *HONEST_OTHERS)}
    federation.commit(bodies={COLLUDER: colluding(honest)})
    for member in MEMBERS:
        federation.accept(member)


def cancelling_round(federation: Federation, plus: np.ndarray | None = None) -> Any:
    """The honest members upload; the colluder uploads ``Enc(plus) − Σ`` of the honest
    others' ciphertexts (``plus`` zero by default), signed with its own key."""
    zero = np.zeros(federation.dim + 1) if plus is None else plus
    with_foreknowledge(
        federation, lambda honest: cancelling(federation, [honest[m] for m in HONEST_OTHERS], zero)
    )
    offer = federation.offer(MEMBERS)
    federation.head()
    return offer


def _digest(federation: Federation, member: str) -> str:
    return next(
        e.body["sha256"]
        for e in federation.entries
        if e.kind == "accepted" and e.body["stage"] == "masked_input" and e.body["member"] == member
    )


def test_the_cancelling_contribution_is_refused(federation: Federation) -> None:
    offer = cancelling_round(federation)
    with pytest.raises(Refused) as caught:
        decide(offer, federation.follower(), federation.fetch(), federation.custody())
    assert caught.value.reason == "out_of_range"
    assert COLLUDER in caught.value.detail and VICTIM not in caught.value.detail


def test_without_the_check_the_sum_is_the_victims_vector(federation: Federation) -> None:
    """What the refused offer would have released: the harness bites."""
    offer = cancelling_round(federation)
    bodies = [federation.archive[_digest(federation, m)] for m in sorted(MEMBERS)]
    total = he.CiphertextSum(federation.public_ctx, PARAMS, DIM + 1)
    for body in bodies:
        total.add(he.unframe_chunks(body, PARAMS, DIM + 1))
    assert total.digest() == offer.sum_sha256
    values = he.decrypt_sum(federation.secret_ctx, total.serialize(), DIM + 1)
    assert np.max(np.abs(values - federation.plain[VICTIM])) < ROUNDING_TOLERANCE


def test_a_contribution_off_the_integers_is_refused_without_its_error(
    federation: Federation,
) -> None:
    off = np.full(DIM + 1, 7.0)
    off[2] += 0.4  # one value 0.4 from an integer; alone it is in range
    with_foreknowledge(federation, lambda honest: federation.encrypted(off))
    with pytest.raises(Refused) as caught:
        decide(
            federation.offer(MEMBERS),
            federation.follower(),
            federation.fetch(),
            federation.custody(),
        )
    assert caught.value.reason == "not_integral"
    assert "dave" in caught.value.detail
    assert "0.4" not in caught.value.detail and "0.6" not in caught.value.detail


def test_a_contribution_repeating_another_is_refused(federation: Federation) -> None:
    """A fresh encryption of a vector another member sent (here the victim's, which a
    colluder could only copy by rerandomising its ciphertext) doubles that member's
    weight in the sum: refused, although the ciphertexts differ."""
    with_foreknowledge(federation, lambda honest: federation.encrypted(federation.plain[VICTIM]))
    with pytest.raises(Refused) as caught:
        decide(
            federation.offer(MEMBERS),
            federation.follower(),
            federation.fetch(),
            federation.custody(),
        )
    assert caught.value.reason == "repeated_contribution"
    assert "dave" in caught.value.detail and "alice" in caught.value.detail


def test_a_cancellation_of_one_member_within_the_range_is_released(
    federation: Federation,
) -> None:
    """What the range check cannot see: ``Enc(L) − Enc(x_victim)`` decrypts to
    ``L − x_victim``, an in-range vector, so the sum is released without the victim's
    share (here the honest others' values are spread over the whole range, so one
    colluder cancels one member, no more).  Only with the victim's ciphertext in hand
    before committing, which the commit step rules out."""
    full = np.full(DIM + 1, float(LEVELS))
    with_foreknowledge(federation, lambda honest: cancelling(federation, [honest[VICTIM]], full))
    release = decide(
        federation.offer(MEMBERS),
        federation.follower(),
        federation.fetch(),
        federation.custody(),
    )
    total = np.frombuffer(release.plaintext, "<i8")
    assert np.array_equal(total, federation.expected_sum(HONEST_OTHERS) + LEVELS)


@pytest.mark.parametrize("colluder_committed", ["before", "after"])
def test_a_shifted_cancellation_of_concentrated_updates_is_refused(
    federation: Federation, colluder_committed: str
) -> None:
    """Clipped updates quantize near the middle of the range, so ``Enc(c) − Σ others``
    with ``c`` = the others' expected total plus half the range stays in range: the sum
    is the victim's vector plus ``c``, which the aggregator knows.  The range check
    cannot see it; the commit step does.  The colluder has the honest ciphertexts only
    once they are uploaded, after every honest commitment: its own commitment came
    before them (to other bytes: ``not_committed``), or the aggregator logs it after
    them, and the honest statements bind the set without it (``commitments_differ``)."""
    federation.append(federation.spec())
    middle = LEVELS // 2
    rng = np.random.default_rng(7)
    honest = {}
    for member in (VICTIM, *HONEST_OTHERS):
        near = middle + rng.integers(-3, 4, DIM + 1)
        federation.plain[member] = near
        honest[member] = federation.encrypted(near)
    federation.commit(list(honest), honest)
    if colluder_committed == "before":
        federation.commit([COLLUDER])  # an honest-looking commitment, made blind
    for member, body in honest.items():
        federation.accept(member, body)
    shift = np.full(DIM + 1, float(middle * len(HONEST_OTHERS) + middle))
    shifted = cancelling(federation, [honest[m] for m in HONEST_OTHERS], shift)
    if colluder_committed == "after":
        federation.commit([COLLUDER], {COLLUDER: shifted})
    federation.accept(COLLUDER, shifted)
    offer = federation.offer(MEMBERS)
    with pytest.raises(Refused) as caught:
        decide(offer, federation.follower(), federation.fetch(), federation.custody())
    if colluder_committed == "before":
        assert caught.value.reason == "not_committed"
        assert COLLUDER in caught.value.detail
    else:
        assert caught.value.reason == "commitments_differ"
        assert VICTIM in caught.value.detail  # the first honest statement disagrees

    # the harness bites: the offered sum is the victim's vector shifted by c, in range
    total = he.CiphertextSum(federation.public_ctx, PARAMS, DIM + 1)
    for body in [*honest.values(), shifted]:
        total.add(he.unframe_chunks(body, PARAMS, DIM + 1))
    assert total.digest() == offer.sum_sha256
    values = np.rint(he.decrypt_sum(federation.secret_ctx, total.serialize(), DIM + 1))
    assert np.array_equal(values - shift, federation.plain[VICTIM])
    assert values.min() >= 0 and values.max() <= len(MEMBERS) * LEVELS


# -- the service: the refusal named, and a stop after repeated ones ------------------------------


def test_the_service_names_the_refusal_and_stops_after_the_limit(
    federation: Federation, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeAggregator(federation, cancelling_round(federation))
    service = serve(federation, fake, tmp_path)
    service.max_decryption_refusals = 1
    with (
        caplog.at_level(logging.WARNING, logger="fedsec.custodian"),
        pytest.raises(DecryptionHalted, match="IND-CPA-D"),
    ):
        asyncio.run(service.run())
    assert fake.decryptions == []
    (decision,) = service.decisions.read()
    assert (decision.outcome, decision.reason) == ("refused", "out_of_range")
    assert "reason=out_of_range" in caplog.text and COLLUDER in decision.detail
    assert "alert=custodian_halted decryption_refusals=1 limit=1" in caplog.text

    # a restart on the same decision log stops before it publishes anything
    again = FakeAggregator(federation, fake.offer)
    restarted = serve(federation, again, tmp_path)
    restarted.max_decryption_refusals = 1
    with pytest.raises(DecryptionHalted):
        asyncio.run(restarted.run())
    assert (again.contexts, again.polls, again.decryptions) == ([], 0, [])
    assert len(restarted.decisions.read()) == 1
    # under the default limit the refused attempt stays refused and the service goes on
    third = FakeAggregator(federation, fake.offer)
    asyncio.run(serve(federation, third, tmp_path).run())
    assert third.contexts and third.decryptions == []
