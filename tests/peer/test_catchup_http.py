"""Catch-up over real HTTP on loopback: a returning peer asks its neighbours for signed
offers and rejoins from those that pass every check; a forged, misdirected, oversized or
stale offer is refused with its reason in the log and leaves the peer as it was."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import msgspec
import numpy as np
import pytest
import pytest_asyncio
from aiohttp import web

from fedsec.audit.peer_journals import cross_check_journals
from fedsec.crypto.httpsig import sign_request
from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import StaleUpdate
from fedsec.peer import catchup, messages
from fedsec.peer.gossip import GossipPeer, GossipSettings
from fedsec.peer.http import offer_path, peer_app
from fedsec.peer.journal import PeerJournal
from fedsec.peer.limits import MAX_OFFERS_PER_ROUND, max_offer_bytes
from fedsec.peer.runner import catch_up, run_rounds
from tests.peer.conftest import DIM, FED, Neighbourhood, make_neighbourhood

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _state(peer: GossipPeer) -> tuple[object, ...]:
    return peer.round, peer.exchange, peer.model.tobytes(), len(peer.journal.entries)


def _neighbour_at(hood: Neighbourhood, who: SigningIdentity, round_: int, end: float) -> GossipPeer:
    """``who`` as a real peer that trained ``round_`` from ``end − 1`` to ``end``, after
    rounds ``round_ − 2`` and ``round_ − 1`` (a history of three)."""
    others = [hood.me.key_id] + [n.key_id for n in hood.neighbours if n is not who]
    settings = GossipSettings(exchanges=1, robust=False)
    q = GossipPeer(FED, who.key_id, others, np.zeros(DIM), 10, PeerJournal(FED, who), settings)
    for r in range(round_ - 2, round_ + 1):
        q.round, q.model = r, np.full(DIM, end - 1.0 - (round_ - r))
        q.own_model(q.model + 1.0)
    return q


class Served:
    def __init__(self, hood: Neighbourhood, session: aiohttp.ClientSession, tmp: Path) -> None:
        self.hood, self.session, self.tmp = hood, session, tmp
        self.urls: dict[str, str] = {}
        self._runners: list[web.AppRunner] = []

    async def serve(self, key: str, app: web.Application) -> None:
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self._runners.append(runner)
        self.urls[key] = f"http://127.0.0.1:{runner.addresses[0][1]}"

    async def honest(self, who: SigningIdentity, round_: int, end: float) -> GossipPeer:
        q = _neighbour_at(self.hood, who, round_, end)
        await self.serve(who.key_id, peer_app(q, self.hood.roster, who))
        return q

    async def hostile(self, who: SigningIdentity, handler: Handler) -> None:
        app = web.Application()
        app.router.add_post("/peer/v1/{federation}/offer", handler)
        await self.serve(who.key_id, app)

    async def catch_up(self) -> catchup.CatchUp | None:
        hood = self.hood
        return await catch_up(self.session, hood.peer, hood.me, self.urls, hood.roster)

    async def close(self) -> None:
        for runner in self._runners:
            await runner.cleanup()


@pytest_asyncio.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    async with aiohttp.ClientSession() as session:
        s = Served(make_neighbourhood(), session, tmp_path)
        yield s
        await s.close()


def _offer_from(
    hood: Neighbourhood, who: SigningIdentity, round_: int, **changes: object
) -> Handler:
    """A hostile neighbour's offer handler: an honest offer of ``who`` at ``round_``
    with ``changes`` made to its fields (before signing, unless ``signer`` is given)."""
    q = _neighbour_at(hood, who, round_, 5.0)

    async def handler(request: web.Request) -> web.Response:
        asked = catchup.decode_request(await request.read())
        asked = msgspec.structs.replace(asked, **{k: v for k, v in changes.items() if k == "nonce"})
        signer = changes.get("signer", who)
        assert isinstance(signer, SigningIdentity)
        newest, history = q.offer()
        if "federation_id" in changes:
            newest = msgspec.structs.replace(newest, federation_id=str(changes["federation_id"]))
            asked = msgspec.structs.replace(asked, federation_id=str(changes["federation_id"]))
        offer = catchup.make_offer(signer, asked, newest, history)
        offer = msgspec.structs.replace(offer, sender=who.key_id)
        if signer is not who:  # re-sign the claim "who offers this" with the wrong key
            statement = catchup.offer_statement(
                offer.federation_id, who.key_id, offer.requester, offer.nonce, offer.model,
                offer.history,
            )  # fmt: skip
            offer = msgspec.structs.replace(offer, signature=signer.sign("peer-offer", statement))
        return web.Response(body=msgspec.msgpack.encode(offer))

    return handler


@pytest.mark.asyncio
async def test_a_returning_peer_catches_up_from_its_neighbours_signed_offers(
    served: Served,
) -> None:
    a, b, c = served.hood.neighbours
    offerers = [await served.honest(who, 5, end) for who, end in ((a, 5.0), (b, 7.0), (c, 6.0))]
    caught = await served.catch_up()
    assert caught is not None and caught.round == 6
    peer = served.hood.peer
    np.testing.assert_allclose(peer.model, np.full(DIM, 6.0))  # the median of 5, 7, 6
    assert (peer.round, sorted(caught.sources)) == (6, sorted(n.key_id for n in (a, b, c)))
    (entry,) = peer.journal.of_kind("peer_caught_up")
    assert entry["round"] == 6
    # each offerer journalled its offer, which the auditor matches with the catch-up
    for q in offerers:
        (offered,) = q.journal.of_kind("peer_offer_sent")
        assert (offered["to"], offered["nonce"]) == (served.hood.me.key_id, entry["nonce"])
        assert offered["sha256"] == caught.sources[q.me]
    files = []
    for n, journal in enumerate([peer.journal, *(q.journal for q in offerers)]):
        journal.head()
        files.append(served.tmp / f"peer{n}.jsonl")
        files[-1].write_bytes(b"".join(e.line + b"\n" for e in journal.entries))
    checked = cross_check_journals(files, served.hood.roster)
    assert (checked.problem, checked.catch_ups) == (None, 3)


@pytest.mark.asyncio
async def test_a_forged_offer_among_honest_ones_is_refused_and_left_out(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    a, b, c = served.hood.neighbours
    await served.honest(a, 5, 5.0)
    await served.honest(b, 5, 7.0)
    # c's offer, signed by the stranger: without the signature check it would be a source
    await served.hostile(c, _offer_from(served.hood, c, 5, signer=served.hood.stranger))
    with caplog.at_level(logging.INFO, logger="fedsec.peer"):
        caught = await served.catch_up()
    assert caught is not None and sorted(caught.sources) == sorted([a.key_id, b.key_id])
    assert f"event=peer_offer_refused sender={c.key_id} code=bad_signature" in caplog.text


HOSTILE_OFFERS: dict[str, tuple[dict[str, object], str]] = {
    "forged": ({"signer": "stranger"}, "bad_signature"),
    "another federation": ({"federation_id": "other-fed"}, "protocol_error"),
    "replayed from another request": ({"nonce": "ab" * 32}, "replayed"),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("case", sorted(HOSTILE_OFFERS))
async def test_a_hostile_offer_is_refused_by_name_and_changes_nothing(
    served: Served, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    changes, code = HOSTILE_OFFERS[case]
    if changes.get("signer") == "stranger":
        changes = {"signer": served.hood.stranger}
    for who in served.hood.neighbours:
        await served.hostile(who, _offer_from(served.hood, who, 5, **changes))
    before = _state(served.hood.peer)
    with caplog.at_level(logging.INFO, logger="fedsec.peer"):
        assert await served.catch_up() is None
    assert _state(served.hood.peer) == before
    for who in served.hood.neighbours:
        assert f"event=peer_offer_refused sender={who.key_id} code={code}" in caplog.text


@pytest.mark.asyncio
async def test_an_offer_behind_the_peer_is_refused_as_stale(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    peer = served.hood.peer
    peer.round, peer.model = 8, np.full(DIM, 3.0)
    for who in served.hood.neighbours:
        await served.hostile(who, _offer_from(served.hood, who, 5))
    before = _state(peer)
    with caplog.at_level(logging.INFO, logger="fedsec.peer"):
        assert await served.catch_up() is None
    assert _state(peer) == before
    assert caplog.text.count("code=stale detail=the offer is of round 5, behind") == 3


@pytest.mark.asyncio
@pytest.mark.parametrize("chunked", [False, True])
async def test_an_oversized_offer_is_refused_before_it_is_read(
    served: Served, caplog: pytest.LogCaptureFixture, chunked: bool
) -> None:
    size = max_offer_bytes(DIM) + 1

    async def flood(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        if chunked:
            response.enable_chunked_encoding()
        else:
            response.content_length = size
        await response.prepare(request)
        for _ in range(size // 1024 + 1):
            await response.write(b"\0" * 1024)
        return response

    for who in served.hood.neighbours:
        await served.hostile(who, flood)
    before = _state(served.hood.peer)
    with caplog.at_level(logging.INFO, logger="fedsec.peer"):
        assert await served.catch_up() is None
    assert _state(served.hood.peer) == before
    assert caplog.text.count("code=payload_too_large") == 3


@pytest.mark.asyncio
async def test_an_offer_is_made_only_to_a_neighbour_that_signs_its_request(
    served: Served,
) -> None:
    hood = served.hood
    a = hood.neighbours[0]
    q = await served.honest(a, 5, 5.0)
    fresh = GossipPeer(FED, a.key_id, [hood.me.key_id], np.zeros(DIM), 10, PeerJournal(FED, a))
    await served.serve("untrained", peer_app(fresh, hood.roster, a))

    async def ask(signer: SigningIdentity, url: str) -> tuple[int, str]:
        request = catchup.OfferRequest(FED, signer.key_id, "cd" * 32)
        body = msgspec.msgpack.encode(request)
        headers = sign_request(signer, "POST", offer_path(FED), {}, body)
        async with served.session.post(url + offer_path(FED), data=body, headers=headers) as r:
            return r.status, (await r.json())["error"]

    journal = len(q.journal.entries)
    assert await ask(hood.stranger, served.urls[a.key_id]) == (403, "unknown_member")
    assert await ask(SigningIdentity.generate(), served.urls[a.key_id]) == (401, "unauthenticated")
    assert await ask(hood.me, served.urls["untrained"]) == (404, "not_found")
    assert len(q.journal.entries) == journal


@pytest.mark.asyncio
async def test_a_neighbour_asking_for_offers_over_and_over_cannot_grow_the_journal(
    served: Served,
) -> None:
    hood = served.hood
    a = hood.neighbours[0]
    q = await served.honest(a, 5, 5.0)

    async def ask(nonce: str) -> int:
        request = catchup.OfferRequest(FED, hood.me.key_id, nonce)
        body = msgspec.msgpack.encode(request)
        headers = sign_request(hood.me, "POST", offer_path(FED), {}, body)
        url = served.urls[a.key_id] + offer_path(FED)
        async with served.session.post(url, data=body, headers=headers) as r:
            return r.status

    statuses = [await ask(f"{n:064x}") for n in range(MAX_OFFERS_PER_ROUND)]
    assert statuses == [200] * MAX_OFFERS_PER_ROUND
    journal = len(q.journal.entries)
    assert await ask("ef" * 32) == 429  # rate_limited, and nothing journalled
    assert len(q.journal.entries) == journal == MAX_OFFERS_PER_ROUND


@pytest.mark.asyncio
async def test_a_restarted_peer_catches_up_before_its_first_round(served: Served) -> None:
    hood = served.hood
    for who, end in zip(hood.neighbours, (5.0, 7.0, 6.0), strict=True):
        await served.honest(who, 5, end)
    trained: list[int] = []

    def trainer(model: np.ndarray, round_: int) -> np.ndarray:
        trained.append(round_)
        return model + 1.0

    outcomes = await run_rounds(
        hood.peer, hood.me, served.urls, trainer, 6, asyncio.Condition(), roster=hood.roster,
        catch_up_at_start=True,
    )  # fmt: skip
    assert (outcomes, trained, hood.peer.round) == ([], [], 6)


def test_a_neighbour_far_ahead_tells_the_peer_it_missed_rounds(hood: Neighbourhood) -> None:
    a = hood.neighbours[0]
    ahead = messages.make_model(FED, 3, a.key_id, 10, np.zeros(DIM), np.ones(DIM))
    near = messages.make_model(FED, 1, a.key_id, 10, np.zeros(DIM), np.ones(DIM))
    hood.peer.receive(a.key_id, messages.encode(near), FED, 1)
    assert not hood.peer.noticed_behind()
    with pytest.raises(Exception, match="ahead"):
        hood.peer.receive(a.key_id, messages.encode(ahead), FED, 3)
    assert hood.peer.noticed_behind()
    assert not hood.peer.noticed_behind()  # the note is taken once


@pytest.mark.asyncio
async def test_a_peer_that_hears_a_neighbour_far_ahead_catches_up_before_its_next_round(
    served: Served,
) -> None:
    hood = served.hood
    ends = zip(hood.neighbours, (5.0, 7.0, 6.0), strict=True)
    neighbours = [await served.honest(w, 5, e) for w, e in ends]
    ahead, _ = neighbours[0].offer()
    with pytest.raises(StaleUpdate):  # what its endpoint answers the neighbour's round 5
        hood.peer.receive(ahead.sender, messages.encode(ahead), FED, 5)
    trained: list[int] = []

    def trainer(model: np.ndarray, round_: int) -> np.ndarray:
        trained.append(round_)
        return model + 1.0

    outcomes = await run_rounds(
        hood.peer, hood.me, served.urls, trainer, 6, asyncio.Condition(), roster=hood.roster
    )
    assert (outcomes, trained, hood.peer.round) == ([], [], 6)
    np.testing.assert_allclose(hood.peer.model, np.full(DIM, 6.0))
