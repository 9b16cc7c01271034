"""The custodian's I/O loop against a fake aggregator (the I/O boundary only): the log,
archive and offers it serves are the real ones of :mod:`.conftest`."""

from __future__ import annotations

import asyncio
import base64
import hashlib
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from fedsec.crypto.identity import SigningIdentity
from fedsec.custodian import check
from fedsec.custodian.service import CustodianService
from fedsec.custodian.store import DecisionLog
from fedsec.errors import IntegrityError, NotFound, ProtocolError
from fedsec.protocol.log import lines
from fedsec.protocol.wire import DecryptionStatement, HeContext, HeSumOffer, RoundState

from .conftest import ATTEMPT, FID, MEMBERS, ROUND, Federation


class FakeAggregator:
    """Serves a federation's log, archive and one offer; records what the custodian sends."""

    def __init__(
        self, federation: Federation, offer: HeSumOffer, *, page: int = 4, held: bytes = b""
    ) -> None:
        self.federation = federation
        self.offer = offer
        self.page = page  # log lines per answer, as a bounded GET /audit/log
        self.held = held  # a context the aggregator already holds
        self.contexts: list[HeContext] = []
        self.decryptions: list[bytes] = []
        self.polls = 0

    def state(self, stage: str, token: int, finished: bool = False) -> RoundState:
        return RoundState(
            federation_id=FID,
            round=ROUND,
            attempt=ATTEMPT,
            stage=stage,  # type: ignore[arg-type]
            token=token,
            model_version=2,
            rounds_completed=ROUND,
            rounds_target=0,
            finished=finished,
        )

    async def put_he_context(self, context: HeContext) -> None:
        if self.held and base64.b64decode(context.context) != self.held:
            raise ProtocolError("the federation already has another context")
        self.contexts.append(context)

    async def he_context(self) -> HeContext:
        return HeContext(
            statement=self.federation.context_statement(hashlib.sha256(self.held).hexdigest()),
            context=base64.b64encode(self.held).decode(),
        )

    async def get_round(self, wait_token: int | None = None, timeout: float = 0.0) -> RoundState:
        self.polls += 1
        if self.polls == 1:
            return self.state("masked_input", 1)
        if self.polls == 2:
            return self.state("decrypt", 2)
        return self.state("closed", 3, finished=True)

    async def he_sum(self, round: int, attempt: int, wait: float = 0.0) -> HeSumOffer:
        assert (round, attempt) == (ROUND, ATTEMPT)
        return self.offer

    async def post_decryption(self, round: int, attempt: int, body: bytes) -> None:
        self.decryptions.append(body)

    async def log_lines(self, start: int) -> bytes:
        return lines(self.federation.entries[start : start + self.page])

    async def archived(self, sha256: str, max_bytes: int) -> bytes:
        body = self.federation.archive.get(sha256)
        if body is None:
            raise NotFound(f"no archive object {sha256}")
        assert len(body) <= max_bytes
        return body


def serve(federation: Federation, fake: Any, tmp_path: Path) -> CustodianService:
    return CustodianService(
        fake,
        federation.custody(),
        federation.custodian,
        federation.public,
        check.LogFollower(FID, federation.aggregator.public_bytes),
        DecisionLog(tmp_path / "decryptions.jsonl"),
        poll_timeout_s=0.1,
    )


def test_publishes_and_releases_the_logged_sum(federation: Federation, tmp_path: Path) -> None:
    fake = FakeAggregator(federation, federation.honest_round())
    service = serve(federation, fake, tmp_path)
    asyncio.run(service.run())

    (uploaded,) = fake.contexts
    uploaded.statement.verify(federation.custodian.public_bytes)
    assert base64.b64decode(uploaded.context) == federation.public
    assert uploaded.statement.context_sha256 == federation.context_sha256

    (body,) = fake.decryptions
    length = int.from_bytes(body[:4], "little")
    statement = msgspec.json.decode(body[4 : 4 + length], type=DecryptionStatement)
    statement.verify(federation.custodian.public_bytes)
    plaintext = body[4 + length :]
    assert np.array_equal(np.frombuffer(plaintext, "<i8"), federation.expected_sum(MEMBERS))
    assert statement.plaintext_sha256 == hashlib.sha256(plaintext).hexdigest()

    (decision,) = service.decisions.read()
    assert (decision.outcome, decision.round, decision.attempt) == ("released", ROUND, ATTEMPT)
    assert decision.plaintext_sha256 == statement.plaintext_sha256
    assert decision.sum_sha256 == fake.offer.sum_sha256


def test_a_refusal_is_logged_and_nothing_is_sent(
    federation: Federation, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    federation.honest_round()
    alice = next(
        federation.archive[e.body["sha256"]]
        for e in federation.entries
        if e.kind == "accepted"
        and e.body["stage"] == "masked_input"
        and e.body["member"] == "alice"
    )
    forged = federation.offer(MEMBERS, bodies=[alice])
    monkeypatch.setattr(check, "decrypt_sum", _never)
    fake = FakeAggregator(federation, forged)
    service = serve(federation, fake, tmp_path)
    asyncio.run(service.run())

    assert fake.decryptions == []
    (decision,) = service.decisions.read()
    assert (decision.outcome, decision.reason) == ("refused", "not_logged_sum")
    assert decision.plaintext_sha256 == ""


def test_a_refused_attempt_is_not_decided_again(
    federation: Federation, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    offer = federation.honest_round()
    forged = msgspec.structs.replace(offer, sum_sha256="ee" * 32)
    asyncio.run(serve(federation, FakeAggregator(federation, forged), tmp_path).run())
    again = FakeAggregator(federation, offer)
    service = serve(federation, again, tmp_path)  # a restart, on the same decision log
    asyncio.run(service.run())
    assert again.decryptions == []
    assert [d.reason for d in service.decisions.read()] == ["not_logged_sum"]


def test_a_release_still_awaited_is_answered_again(federation: Federation, tmp_path: Path) -> None:
    offer = federation.honest_round()
    first = FakeAggregator(federation, offer)
    asyncio.run(serve(federation, first, tmp_path).run())
    again = FakeAggregator(federation, offer)  # a restart; the round is still in decrypt
    service = serve(federation, again, tmp_path)
    asyncio.run(service.run())
    assert again.decryptions == first.decryptions  # the same statement and plaintext
    assert [d.outcome for d in service.decisions.read()] == ["released", "released"]


def test_the_same_context_already_held_is_fine(federation: Federation, tmp_path: Path) -> None:
    fake = FakeAggregator(federation, federation.honest_round(), held=federation.public)
    asyncio.run(serve(federation, fake, tmp_path).run())
    assert len(fake.decryptions) == 1


def test_another_context_held_is_fatal(federation: Federation, tmp_path: Path) -> None:
    fake = FakeAggregator(federation, federation.honest_round(), held=b"another context")
    with pytest.raises(IntegrityError, match="already holds another CKKS context"):
        asyncio.run(serve(federation, fake, tmp_path).run())
    assert fake.polls == 0 and fake.decryptions == []


def test_a_forged_log_is_fatal_and_logged(
    federation: Federation, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    federation.append(federation.spec())
    federation.commit()
    for member in MEMBERS:
        federation.accept(member)
    offer = federation.offer(MEMBERS)
    federation.head(signer=SigningIdentity.generate())
    monkeypatch.setattr(check, "decrypt_sum", _never)
    fake = FakeAggregator(federation, offer)
    service = serve(federation, fake, tmp_path)
    with pytest.raises(IntegrityError, match="head signature does not verify"):
        asyncio.run(service.run())
    assert fake.decryptions == []
    (decision,) = service.decisions.read()
    assert (decision.outcome, decision.reason) == ("refused", "bad_log")


def test_stops_when_asked(federation: Federation, tmp_path: Path) -> None:
    class Idle(FakeAggregator):
        async def get_round(self, wait_token: int | None = None, timeout: float = 0.0) -> Any:
            if wait_token is None:
                return self.state("masked_input", 1)
            await asyncio.Event().wait()  # a long poll that never answers

    offer = federation.honest_round()

    async def main() -> None:
        service = serve(federation, Idle(federation, offer), tmp_path)
        task = asyncio.create_task(service.run())
        await asyncio.sleep(0)
        service.stop.set()
        await asyncio.wait_for(task, 5)

    asyncio.run(main())


def _never(*_args: Any, **_kwargs: Any) -> Any:
    raise AssertionError("a refused offer reached the secret context")


def test_the_decision_log_shows_a_removed_line(federation: Federation, tmp_path: Path) -> None:
    offer = federation.honest_round()
    decisions = DecisionLog(tmp_path / "decryptions.jsonl")
    for reason in ("too_few", "not_logged_sum", "bad_log"):
        decisions.record_refusal(offer, check.Refused(reason, "x"))  # type: ignore[arg-type]
    assert [d.reason for d in decisions.read()] == ["too_few", "not_logged_sum", "bad_log"]
    kept = decisions.path.read_bytes().splitlines(keepends=True)
    decisions.path.write_bytes(kept[0] + kept[2])
    with pytest.raises(IntegrityError, match="does not chain"):
        decisions.read()


class WindowedAggregator(FakeAggregator):
    """Counts archive fetches in flight; ``missing``'s object is not served."""

    def __init__(self, federation: Federation, offer: HeSumOffer, missing: str = "") -> None:
        super().__init__(federation, offer)
        self.missing = missing
        self.in_flight = 0
        self.most_in_flight = 0
        self.started = 0
        self.ended = 0  # returned, raised or cancelled

    async def archived(self, sha256: str, max_bytes: int) -> bytes:
        self.started += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            for _ in range(3):  # let the other fetches start meanwhile
                await asyncio.sleep(0)
            if sha256 == self.missing:
                raise NotFound(f"no archive object {sha256}")
            return await super().archived(sha256, max_bytes)
        finally:
            self.in_flight -= 1
            self.ended += 1


def _archived_sha256(federation: Federation, member: str) -> str:
    return next(
        e.body["sha256"]
        for e in federation.entries
        if e.kind == "accepted" and e.body["stage"] == "masked_input" and e.body["member"] == member
    )


def test_archive_objects_are_fetched_ahead_within_the_window(
    federation: Federation, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("fedsec.custodian.service.FETCH_AHEAD", 2)
    fake = WindowedAggregator(federation, federation.honest_round())
    asyncio.run(serve(federation, fake, tmp_path).run())
    assert len(fake.decryptions) == 1
    assert fake.started == len(MEMBERS)
    assert fake.most_in_flight == 2  # overlapped, and never more than the window


def test_an_archive_object_not_served_refuses_and_stops_the_other_fetches(
    federation: Federation, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    offer = federation.honest_round()
    monkeypatch.setattr(check, "decrypt_sum", _never)
    fake = WindowedAggregator(federation, offer, missing=_archived_sha256(federation, "bob"))
    service = serve(federation, fake, tmp_path)
    asyncio.run(service.run())
    assert fake.decryptions == []
    assert fake.started == fake.ended and fake.in_flight == 0  # nothing left running
    (decision,) = service.decisions.read()
    assert (decision.outcome, decision.reason) == ("refused", "archive_mismatch")
    assert "bob" in decision.detail
