"""Attacks on a peer's endpoint over real HTTP on loopback: every one is a 4xx that
names the refusal and leaves the peer as it was."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
from aiohttp import web

from fedsec.crypto.httpsig import sign_request
from fedsec.crypto.identity import SigningIdentity
from fedsec.peer import messages
from fedsec.peer.http import model_path, peer_app, send_model
from tests.peer.conftest import DIM, FED, Neighbourhood, make_neighbourhood


class Served:
    def __init__(self, hood: Neighbourhood, url: str, session: aiohttp.ClientSession) -> None:
        self.hood, self.url, self.session = hood, url, session

    def state(self) -> tuple[int, bytes, int, dict[str, int]]:
        peer = self.hood.peer
        held = {k: v.message.round for k, v in peer._held.items()}
        return peer.round, peer.model.tobytes(), len(peer.journal.entries), held

    async def post(
        self, signer: SigningIdentity, body: bytes, path: str
    ) -> tuple[int, dict[str, str], dict[str, str]]:
        headers = {"Content-Type": messages.CONTENT_TYPE}
        headers |= sign_request(signer, "POST", path, headers, body)
        return await self.post_signed(headers, body, path)

    async def post_signed(
        self, headers: dict[str, str], body: bytes, path: str
    ) -> tuple[int, dict[str, str], dict[str, str]]:
        async with self.session.post(self.url + path, data=body, headers=headers) as r:
            return r.status, await r.json(), headers


@pytest_asyncio.fixture
async def served() -> AsyncIterator[Served]:
    hood = make_neighbourhood()
    runner = web.AppRunner(peer_app(hood.peer, hood.roster, hood.me))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    async with aiohttp.ClientSession() as session:
        yield Served(hood, f"http://127.0.0.1:{port}", session)
    await runner.cleanup()


def _message(sender: SigningIdentity, round_: int = 0, dim: int = DIM) -> messages.PeerModel:
    return messages.make_model(FED, round_, sender.key_id, 10, np.zeros(dim), np.ones(dim))


@pytest.mark.asyncio
async def test_a_neighbours_signed_model_is_kept(served: Served) -> None:
    a = served.hood.neighbours[0]
    status, body = await send_model(served.session, served.url, a, _message(a), 5.0)
    assert status == 200, body
    assert served.state()[3] == {a.key_id: 0}


@pytest.mark.asyncio
async def test_a_replayed_request_is_refused(served: Served) -> None:
    a = served.hood.neighbours[0]
    raw = messages.encode(_message(a))
    path = model_path(FED, 0)
    status, _, headers = await served.post(a, raw, path)
    assert status == 200
    before = served.state()
    status, refusal, _ = await served.post_signed(headers, raw, path)
    assert (status, refusal["error"]) == (401, "replayed")
    assert served.state() == before


@pytest.mark.asyncio
async def test_a_model_from_an_earlier_round_resigned_is_refused(served: Served) -> None:
    a = served.hood.neighbours[0]
    served.hood.peer.own_model(np.ones(DIM))
    assert (await send_model(served.session, served.url, a, _message(a, 0), 5.0))[0] == 200
    served.hood.peer.combine()
    assert (await send_model(served.session, served.url, a, _message(a, 1), 5.0))[0] == 200
    before = served.state()
    status, refusal, _ = await served.post(a, messages.encode(_message(a, 0)), model_path(FED, 0))
    assert (status, refusal["error"]) == (401, "replayed")
    assert served.state() == before


@pytest.mark.asyncio
async def test_a_model_signed_by_a_member_that_is_not_a_neighbour_is_refused(
    served: Served,
) -> None:
    stranger = served.hood.stranger
    before = served.state()
    status, refusal = await send_model(
        served.session, served.url, stranger, _message(stranger), 5.0
    )
    assert status == 403 and '"unknown_member"' in refusal
    assert served.state() == before


@pytest.mark.asyncio
async def test_a_model_signed_by_a_key_outside_the_roster_is_refused(served: Served) -> None:
    outsider = SigningIdentity.generate()
    before = served.state()
    status, refusal = await send_model(
        served.session, served.url, outsider, _message(outsider), 5.0
    )
    assert status == 401, refusal
    assert served.state() == before


@pytest.mark.asyncio
async def test_a_neighbours_model_sent_as_anothers_is_refused(served: Served) -> None:
    a, b, _ = served.hood.neighbours
    before = served.state()
    status, refusal, _ = await served.post(b, messages.encode(_message(a)), model_path(FED, 0))
    assert (status, refusal["error"]) == (401, "unauthenticated")
    assert served.state() == before


@pytest.mark.asyncio
async def test_a_signed_path_for_another_round_is_refused(served: Served) -> None:
    a = served.hood.neighbours[0]
    before = served.state()
    status, refusal, _ = await served.post(a, messages.encode(_message(a, 0)), model_path(FED, 1))
    assert (status, refusal["error"]) == (409, "protocol_error")
    assert served.state() == before


@pytest.mark.asyncio
@pytest.mark.parametrize("bad", ["short", "long", "nan"])
async def test_a_model_of_the_wrong_length_or_with_nan_is_refused(served: Served, bad: str) -> None:
    a = served.hood.neighbours[0]
    if bad == "nan":
        values = np.ones(DIM, dtype=messages.WIRE_DTYPE)
        values[0] = np.nan
        start = np.zeros(DIM, dtype=messages.WIRE_DTYPE).tobytes()
        message = messages.PeerModel(FED, 0, a.key_id, 10, start, values.tobytes())
    else:
        message = _message(a, 0, DIM - 1 if bad == "short" else DIM + 1)
    before = served.state()
    status, refusal, _ = await served.post(a, messages.encode(message), model_path(FED, 0))
    assert (status, refusal["error"]) == (400, "bad_vector")
    assert served.state() == before


@pytest.mark.asyncio
async def test_a_body_longer_than_any_model_is_refused_before_it_is_read(served: Served) -> None:
    a = served.hood.neighbours[0]
    body = b"\0" * (8 * DIM + 10_000)
    before = served.state()
    status, refusal, _ = await served.post(a, body, model_path(FED, 0))
    assert (status, refusal["error"]) == (413, "payload_too_large")
    assert served.state() == before
