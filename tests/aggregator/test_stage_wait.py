"""Held answers of the SecAgg+ endpoints (``?wait=S``) over real loopback sockets.

An upload with ``wait`` is answered once the round reaches the next stage, carrying
that stage's data for the caller (key list, share relay, unmask request, round
state); a stage-data GET with ``wait`` long-polls until its stage.  Held answers come
back without data, and promptly, when the wait runs out or the attempt is aborted;
a malformed ``wait`` is refused before anything is accepted.  Every wait here is
bounded by ``asyncio.wait_for`` so a regression fails fast instead of hanging.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import sys
import tracemalloc
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import numpy as np
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.http import make_app
from fedsec.aggregator.http.longpoll import CHANGED
from fedsec.protocol import wire
from fedsec.protocol.limits import LONG_POLL_S
from tests.support.aggregator import (
    FAST_ROUND,
    Cohort,
    FakeClock,
    expected_params,
    join_request,
    log_entries,
    make_federation,
    model_params,
)
from tests.support.http import AGENTS, Api, _fix_cohort, _to_masked_input, _upload

# a hung held request fails its test within seconds, not at the suite-wide timeout
pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

ROUND = "/v1/rounds/1"
BAD_WAITS = ("-1", "nan", "inf", "-inf", "1e999", "1e3", "1_0", "%205", "abc", "")
BOUND = 8.0  # no single step of these tests may take longer than this
#: A held answer's own wait, the longest a server holds one: longer than any step's
#: bound, so within a test only the stage change releases it, however slowly a loaded
#: machine computes the other members' uploads.
HOLD = LONG_POLL_S

T = TypeVar("T")


#: An accepted upload's answer that carries no next-stage data.
EMPTY_ANSWER = {
    "accepted": True,
    "keys": None,
    "relay": None,
    "proof": None,
    "commitments": None,
    "state": None,
}


def _now() -> float:
    return asyncio.get_running_loop().time()


async def _bounded(aw: Awaitable[T], timeout: float = BOUND) -> T:
    return await asyncio.wait_for(aw, timeout)


async def _held(api: Api, count: int) -> None:
    """Wait until the aggregator holds ``count`` requests (they reached it and wait for
    a change of the round), within :data:`BOUND` seconds."""
    changed = api.client.server.app[CHANGED]  # type: ignore[union-attr]
    deadline = _now() + BOUND
    while changed.waiting < count:
        assert _now() < deadline, f"{changed.waiting} requests held, expected {count}"
        await asyncio.sleep(0.01)


async def _held_until_last(
    api: Api, send: Callable[[str], Coroutine[Any, Any, Any]], members: tuple[str, ...] = AGENTS
) -> dict[str, Any]:
    """Send for every member but the last concurrently, check those answers are held,
    then send the last member's (which completes the stage) and collect all answers."""
    early = {m: asyncio.create_task(send(m)) for m in members[:-1]}
    await _held(api, len(early))
    assert not any(t.done() for t in early.values()), "answered before the stage was reached"
    last = await _bounded(send(members[-1]))
    # released by the stage change, not by their own waits (HOLD) running out
    got = dict(zip(early, await _bounded(asyncio.gather(*early.values()), 3.0), strict=True))
    return {**got, members[-1]: last}


def _accepted(raw: Any) -> wire.Accepted:
    answer = msgspec.convert(raw, wire.Accepted)
    assert answer.accepted is True
    return answer


# -- a whole secure round on held answers ----------------------------------------------------------


async def test_secure_round_runs_on_held_answers_alone(api: Api) -> None:
    """Every stage's data arrives in the answer to the previous upload: the held answers
    equal what the stage-data GETs return, and the round closes with the exact sum."""
    cohort = await _fix_cohort(api)
    spec = cohort.spec
    public = api.fed.ws.signer.public_bytes

    async def advertise(m: str) -> Any:
        path = f"{ROUND}/advertise?attempt=0&wait={HOLD}"
        return await api.ok(m, "POST", path, cohort.advertise(m))

    adverts = {m: _accepted(raw) for m, raw in (await _held_until_last(api, advertise)).items()}
    for m, answer in adverts.items():
        assert answer.keys is not None and answer.relay is None and answer.state is None
        assert [e.member for e in answer.keys.entries] == list(AGENTS)
        fetched = await api.ok(m, "GET", f"{ROUND}/keys?attempt=0")
        assert answer.keys == msgspec.convert(fetched, wire.KeyListBody)

    async def shares(m: str) -> Any:
        keys = adverts[m].keys
        assert keys is not None
        return await api.ok(
            m, "POST", f"{ROUND}/shares?attempt=0&wait={HOLD}", cohort.share_keys(m, keys)
        )

    relays = {m: _accepted(raw) for m, raw in (await _held_until_last(api, shares)).items()}
    for m, answer in relays.items():
        assert answer.relay is not None and answer.keys is None and answer.state is None
        fetched = await api.ok(m, "GET", f"{ROUND}/shares?attempt=0")
        assert answer.relay == msgspec.convert(fetched, wire.ShareRelayBody)
        cohort.receive_shares(m, answer.relay)

    async def masked(m: str) -> Any:
        path, raw = _upload(cohort, m)
        return await api.ok(m, "POST", f"{path}&wait={HOLD}", raw)

    inputs = {
        m: msgspec.convert(raw, wire.MaskedInputAnswer)
        for m, raw in (await _held_until_last(api, masked)).items()
    }
    for m, held in inputs.items():
        held.receipt.verify(public)
        assert (held.receipt.round, held.receipt.attempt, held.receipt.member) == (1, 0, m)
        assert held.receipt == msgspec.convert(
            await api.ok(m, "GET", f"{ROUND}/receipt?attempt=0"), wire.Receipt
        )
        assert held.unmask is not None
        assert (held.unmask.survivors, held.unmask.dropped) == (list(AGENTS), [])
        assert held.unmask.state_token == api.coord.token  # nothing changed since
        fetched = await api.ok(m, "GET", f"{ROUND}/unmask?attempt=0")
        assert held.unmask == msgspec.convert(fetched, wire.UnmaskRequestBody)

    async def consistency(m: str) -> Any:
        request = inputs[m].unmask
        assert request is not None
        return await api.ok(
            m, "POST", f"{ROUND}/consistency?attempt=0&wait={HOLD}", cohort.sign(m, request)
        )

    signed = {m: _accepted(raw) for m, raw in (await _held_until_last(api, consistency)).items()}
    for m, answer in signed.items():
        assert answer.proof is not None and answer.keys is None and answer.state is None
        assert (answer.proof.survivors, answer.proof.dropped) == (list(AGENTS), [])
        # classic SecAgg at 4 members: every other member's signature
        assert sorted(s.member for s in answer.proof.signatures) == sorted(set(AGENTS) - {m})
        fetched = await api.ok(m, "GET", f"{ROUND}/consistency?attempt=0")
        assert answer.proof == msgspec.convert(fetched, wire.ConsistencyProofBody)

    async def unmask(m: str) -> Any:
        proof = signed[m].proof
        assert proof is not None
        return await api.ok(
            m, "POST", f"{ROUND}/unmask?attempt=0&wait={HOLD}", cohort.unmask(m, proof)
        )

    closed = {m: _accepted(raw) for m, raw in (await _held_until_last(api, unmask)).items()}
    for answer in closed.values():
        assert answer.keys is None and answer.relay is None
        state = answer.state
        assert state is not None
        assert (state.round, state.attempt, state.stage) == (2, 0, "open")
        assert (state.rounds_completed, state.model_version) == (1, 2)
        assert state.token == api.coord.token

    old, new = model_params(api.fed.ws, 1), model_params(api.fed.ws, 2)
    exact = expected_params(old, [cohort.quantized[m] for m in AGENTS], spec)
    np.testing.assert_array_equal(new, exact)


async def test_upload_without_wait_answers_at_once_without_data(api: Api) -> None:
    """No ``wait`` (or ``wait=0``): an upload is answered at once with its data fields
    null (the bare-Receipt masked-input answer is covered by test_aggregator_api)."""
    cohort = await _fix_cohort(api)
    empty = EMPTY_ANSWER
    assert (
        await _bounded(api.ok("a0", "POST", f"{ROUND}/advertise", cohort.advertise("a0"))) == empty
    )
    path = f"{ROUND}/advertise?attempt=0&wait=0"
    assert await _bounded(api.ok("a1", "POST", path, cohort.advertise("a1")), 2) == empty


# -- held answers without data -------------------------------------------------------------------


async def test_held_answers_come_back_empty_when_the_wait_runs_out(api: Api) -> None:
    """A held upload or GET whose stage is not reached in time is answered after about
    ``wait`` seconds: the upload accepted with null data, the GET 409 wrong_stage."""
    cohort = await _fix_cohort(api)
    start = _now()
    answer = await _bounded(
        api.ok("a0", "POST", f"{ROUND}/advertise?attempt=0&wait=1", cohort.advertise("a0"))
    )
    elapsed = _now() - start
    assert answer == EMPTY_ANSWER
    assert 0.9 <= elapsed < 3.0, elapsed
    session = api.coord.live.session
    assert session is not None and set(session.advertised) == {"a0"}  # it was accepted
    assert api.coord.live.stage == "advertise"

    start = _now()
    status, raw, _ = await _bounded(api.call("a0", "GET", f"{ROUND}/keys?attempt=0&wait=0.5"))
    elapsed = _now() - start
    assert status == 409 and json.loads(raw)["error"] == "wrong_stage", raw
    assert 0.4 <= elapsed < 3.0, elapsed


async def test_held_masked_input_times_out_with_its_receipt_and_no_unmask(api: Api) -> None:
    """``masked-input?wait`` with others still to upload: after the wait, the receipt
    (valid, stored) and ``unmask`` null; ``wait=0`` gives the same shape at once."""
    cohort = await _to_masked_input(api)
    path, raw = _upload(cohort, "a1")
    got = await _bounded(api.ok("a1", "POST", f"{path}&wait=0", raw), 2.0)
    assert msgspec.convert(got, wire.MaskedInputAnswer).unmask is None
    path, raw = _upload(cohort, "a0")
    start = _now()
    got = await _bounded(api.ok("a0", "POST", f"{path}&wait=0.5", raw))
    elapsed = _now() - start
    answer = msgspec.convert(got, wire.MaskedInputAnswer)
    assert answer.unmask is None
    answer.receipt.verify(api.fed.ws.signer.public_bytes)
    stored = await api.ok("a0", "GET", f"{ROUND}/receipt?attempt=0")
    assert answer.receipt == msgspec.convert(stored, wire.Receipt)
    assert 0.4 <= elapsed < 3.0, elapsed


async def test_held_unmask_times_out_with_no_state(api: Api, clock: FakeClock) -> None:
    """``unmask?wait`` while another survivor has not answered: after the wait, accepted
    with ``state`` null and the attempt still unmasking."""
    cohort = await _to_masked_input(api)
    for m in AGENTS:
        path, raw = _upload(cohort, m)
        await api.ok(m, "POST", path, raw)
    await api.wait_stage("consistency")
    for m in AGENTS:
        request = msgspec.convert(
            await api.ok(m, "GET", f"{ROUND}/unmask?attempt=0"), wire.UnmaskRequestBody
        )
        await api.ok(m, "POST", f"{ROUND}/consistency?attempt=0", cohort.sign(m, request))
    await api.wait_stage("unmask")
    proof = msgspec.convert(
        await api.ok("a0", "GET", f"{ROUND}/consistency?attempt=0"), wire.ConsistencyProofBody
    )
    start = _now()
    answer = await _bounded(
        api.ok("a0", "POST", f"{ROUND}/unmask?attempt=0&wait=0.5", cohort.unmask("a0", proof))
    )
    elapsed = _now() - start
    assert answer == EMPTY_ANSWER
    assert 0.4 <= elapsed < 3.0, elapsed
    assert (api.coord.live.round, api.coord.live.stage) == (1, "unmask")


async def test_abort_releases_held_requests_at_once_without_data(
    api: Api, clock: FakeClock
) -> None:
    """When the attempt aborts (too few advertised by the deadline), a held upload is
    answered at once with null keys and a held GET keys with 409 wrong_stage."""
    cohort = await _fix_cohort(api)
    post = asyncio.create_task(
        api.ok("a0", "POST", f"{ROUND}/advertise?attempt=0&wait=20", cohort.advertise("a0"))
    )
    await _held(api, 1)  # the advertisement is accepted before the GET waits
    get = asyncio.create_task(api.call("a0", "GET", f"{ROUND}/keys?attempt=0&wait=20"))
    await _held(api, 2)
    assert not post.done() and not get.done()

    start = _now()
    clock.advance(FAST_ROUND["advertise_s"])  # the ticker closes advertise: 1 < t, abort
    answer = await _bounded(post, 3.0)
    status, raw, _ = await _bounded(get, 3.0)
    elapsed = _now() - start
    assert answer == EMPTY_ANSWER
    assert status == 409 and json.loads(raw)["error"] == "wrong_stage", raw
    assert elapsed < 1.5, elapsed  # released by the abort, not by the 20 s wait
    live = api.coord.live
    assert (live.round, live.attempt, live.stage) == (1, 1, "open")


async def test_abort_at_share_keys_releases_a_held_shares_upload(
    api: Api, clock: FakeClock
) -> None:
    """A held ``shares?wait`` upload is answered with ``relay`` null as soon as the
    attempt aborts for too few shares."""
    cohort = await _fix_cohort(api)
    for m in AGENTS:
        await api.ok(m, "POST", f"{ROUND}/advertise?attempt=0", cohort.advertise(m))
    await api.wait_stage("share_keys")
    keys = msgspec.convert(await api.ok("a0", "GET", f"{ROUND}/keys?attempt=0"), wire.KeyListBody)
    held = asyncio.create_task(
        api.ok("a0", "POST", f"{ROUND}/shares?attempt=0&wait=20", cohort.share_keys("a0", keys))
    )
    await _held(api, 1)
    assert not held.done()
    start = _now()
    clock.advance(FAST_ROUND["share_s"])
    answer = await _bounded(held, 3.0)
    assert _now() - start < 1.5
    assert answer == EMPTY_ANSWER
    assert (api.coord.live.attempt, api.coord.live.stage) == (1, "open")


# -- refusals ------------------------------------------------------------------------------------


async def _call_bounded(
    api: Api, who: str, method: str, path: str, body: bytes
) -> tuple[int, bytes, str]:
    return await _bounded(api.call(who, method, path, body), 5.0)


async def _refuse_bad_waits(api: Api, who: str, method: str, path: str, body: bytes) -> None:
    """Each malformed ``wait`` on ``path`` is a 400 that changes nothing (state, round,
    roster, transparency log)."""
    sep = "&" if "?" in path else "?"
    for bad in BAD_WAITS:
        logged = len(log_entries(api.fed.ws))
        target = f"{path}{sep}wait={bad}"
        request = functools.partial(_call_bounded, api, who, method, target, body)
        detail = await api.refused(400, "bad_request", request)
        assert "wait" in detail, detail
        assert len(log_entries(api.fed.ws)) == logged, f"{method} {target} was logged"


async def test_bad_wait_is_refused_before_anything_is_accepted(api: Api, clock: FakeClock) -> None:
    """``wait`` of -1, nan, inf, 1e999, 1e3, 1_0, " 5" (sent encoded), abc or empty is
    refused 400 on every upload and stage-data GET, at the stage where the same request
    without it is accepted."""
    cohort = await _fix_cohort(api)
    for m in AGENTS:
        body = wire.encode(cohort.advertise(m))
        await _refuse_bad_waits(api, m, "POST", f"{ROUND}/advertise?attempt=0", body)
        await api.ok(m, "POST", f"{ROUND}/advertise?attempt=0", body)
    await api.wait_stage("share_keys")
    await _refuse_bad_waits(api, "a0", "GET", f"{ROUND}/keys?attempt=0", b"")
    await _refuse_bad_waits(api, "a0", "GET", f"{ROUND}/keys", b"")  # wait as the only param
    for m in AGENTS:
        keys = msgspec.convert(await api.ok(m, "GET", f"{ROUND}/keys?attempt=0"), wire.KeyListBody)
        body = wire.encode(cohort.share_keys(m, keys))
        await _refuse_bad_waits(api, m, "POST", f"{ROUND}/shares?attempt=0", body)
        await api.ok(m, "POST", f"{ROUND}/shares?attempt=0", body)
    await api.wait_stage("masked_input")
    await _refuse_bad_waits(api, "a0", "GET", f"{ROUND}/shares?attempt=0", b"")
    for m in AGENTS:
        relay = await api.ok(m, "GET", f"{ROUND}/shares?attempt=0")
        cohort.receive_shares(m, msgspec.convert(relay, wire.ShareRelayBody))
        path, raw = _upload(cohort, m)
        await _refuse_bad_waits(api, m, "POST", path, raw)
        session = api.coord.live.session
        assert session is not None and m not in session.contributed
        await api.ok(m, "POST", path, raw)
    await api.wait_stage("consistency")
    await _refuse_bad_waits(api, "a0", "GET", f"{ROUND}/unmask?attempt=0", b"")
    for m in AGENTS:
        request = msgspec.convert(
            await api.ok(m, "GET", f"{ROUND}/unmask?attempt=0"), wire.UnmaskRequestBody
        )
        body = wire.encode(cohort.sign(m, request))
        await _refuse_bad_waits(api, m, "POST", f"{ROUND}/consistency?attempt=0", body)
        await api.ok(m, "POST", f"{ROUND}/consistency?attempt=0", body)
    await api.wait_stage("unmask")
    await _refuse_bad_waits(api, "a0", "GET", f"{ROUND}/consistency?attempt=0", b"")
    for m in AGENTS:
        proof = msgspec.convert(
            await api.ok(m, "GET", f"{ROUND}/consistency?attempt=0"), wire.ConsistencyProofBody
        )
        body = wire.encode(cohort.unmask(m, proof))
        await _refuse_bad_waits(api, m, "POST", f"{ROUND}/unmask?attempt=0", body)
        await api.ok(m, "POST", f"{ROUND}/unmask?attempt=0", body)
    state = await api.wait_stage("open")
    assert (state.round, state.rounds_completed) == (2, 1)


async def test_wait_is_capped_not_refused(api: Api) -> None:
    """A large finite ``wait`` (over the 25 s cap) is accepted; the answer still comes
    as soon as the stage is reached."""
    cohort = await _fix_cohort(api)

    async def advertise(m: str) -> Any:
        path = f"{ROUND}/advertise?attempt=0&wait=999999999"
        return await api.ok(m, "POST", path, cohort.advertise(m))

    answers = await _held_until_last(api, advertise)
    assert all(_accepted(a).keys is not None for a in answers.values())


# -- long-polling GETs ---------------------------------------------------------------------------


async def test_keys_long_poll_is_answered_when_the_last_member_advertises(api: Api) -> None:
    """``GET keys?wait=2`` issued before share_keys is answered with the key list as
    soon as the last member advertises, well before its wait runs out."""
    cohort = await _fix_cohort(api)
    for m in AGENTS[:-1]:
        await api.ok(m, "POST", f"{ROUND}/advertise?attempt=0", cohort.advertise(m))
    start = _now()
    poll = asyncio.create_task(api.call("a0", "GET", f"{ROUND}/keys?attempt=0&wait=2"))
    await _held(api, 1)
    assert not poll.done()
    await api.ok(AGENTS[-1], "POST", f"{ROUND}/advertise?attempt=0", cohort.advertise(AGENTS[-1]))
    status, raw, _ = await _bounded(poll, 3.0)
    elapsed = _now() - start
    assert status == 200, raw
    assert elapsed < 1.5, elapsed
    keys = msgspec.json.decode(raw, type=wire.KeyListBody)
    assert [e.member for e in keys.entries] == list(AGENTS)
    fetched = await api.ok("a0", "GET", f"{ROUND}/keys?attempt=0")
    assert keys == msgspec.convert(fetched, wire.KeyListBody)


async def test_unmask_long_poll_is_answered_when_the_last_input_arrives(api: Api) -> None:
    """``GET unmask?wait`` issued during masked_input is answered with the survivors as
    soon as the last masked input completes the stage."""
    cohort = await _to_masked_input(api)
    for m in AGENTS[:-1]:
        path, raw = _upload(cohort, m)
        await api.ok(m, "POST", path, raw)
    start = _now()
    poll = asyncio.create_task(api.call("a1", "GET", f"{ROUND}/unmask?attempt=0&wait=2"))
    await _held(api, 1)
    assert not poll.done()
    path, raw = _upload(cohort, AGENTS[-1])
    await api.ok(AGENTS[-1], "POST", path, raw)
    status, body, _ = await _bounded(poll, 3.0)
    assert status == 200, body
    assert _now() - start < 1.5
    request = msgspec.json.decode(body, type=wire.UnmaskRequestBody)
    assert (request.survivors, request.dropped) == (list(AGENTS), [])


async def test_a_held_masked_input_does_not_keep_its_upload(api: Api) -> None:
    """A masked input is summed on arrival; its held answer then waits for the stage to
    close (with 1,000 members, most of the stage) without a copy of the upload: one kept
    per held member made the aggregator's memory grow by the model's size per member."""
    cohort = await _to_masked_input(api)
    path, raw = _upload(cohort, "a0")
    tracemalloc.start()
    try:
        held = asyncio.create_task(api.ok("a0", "POST", f"{path}&wait={HOLD}", raw))
        await _held(api, 1)
        gc.collect()
        snapshot = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    # a bytes object as long as the upload (what the request's body was read into)
    kept = [t for t in snapshot.traces if t.size == sys.getsizeof(raw)]
    assert kept == [], "the held request keeps its upload"
    for m in AGENTS[1:]:  # and the held answer still comes, with the unmask request
        path, raw = _upload(cohort, m)
        await api.ok(m, "POST", path, raw)
    answer = msgspec.convert(await _bounded(held, 3.0), wire.MaskedInputAnswer)
    assert answer.unmask is not None and answer.unmask.survivors == list(AGENTS)


async def test_long_poll_for_another_attempt_is_answered_at_once(api: Api) -> None:
    """A GET with ``wait`` for an attempt that is not the current one is not held."""
    await _fix_cohort(api)
    start = _now()
    status, raw, _ = await _bounded(
        api.call("a0", "GET", f"{ROUND}/keys?attempt=1&wait={HOLD}"), 3.0
    )
    assert status == 409 and json.loads(raw)["error"] == "wrong_stage", raw
    assert _now() - start < 1.0


# -- the published contract ----------------------------------------------------------------------


async def test_openapi_documents_wait_and_the_held_answers(api: Api) -> None:
    """/v1/openapi.json lists ``wait`` on every upload and stage-data GET that takes it,
    and has the Accepted and MaskedInputAnswer schemas the answers use."""
    async with api.client.get("/v1/openapi.json") as resp:
        assert resp.status == 200
        doc = await resp.json()
    paths = doc["paths"]
    r = "/v1/rounds/{round}"
    for path, method in (
        (f"{r}/advertise", "post"),
        (f"{r}/keys", "get"),
        (f"{r}/shares", "post"),
        (f"{r}/shares", "get"),
        (f"{r}/masked-input", "post"),
        (f"{r}/unmask", "get"),
        (f"{r}/unmask", "post"),
    ):
        params = {p["name"]: p for p in paths[path][method].get("parameters", [])}
        assert "wait" in params, (path, method)
        assert params["wait"]["in"] == "query"
        assert params["wait"]["schema"]["type"] == "number"
    schemas = doc["components"]["schemas"]
    assert {"Accepted", "MaskedInputAnswer"} <= set(schemas)
    assert {"accepted", "keys", "relay", "state"} <= set(schemas["Accepted"]["properties"])
    assert {"receipt", "unmask"} <= set(schemas["MaskedInputAnswer"]["properties"])
    assert "state_token" in schemas["UnmaskRequestBody"]["properties"]

    def ok_schema(path: str, method: str) -> str:
        return json.dumps(paths[path][method]["responses"]["200"]["content"])

    for path in (f"{r}/advertise", f"{r}/shares", f"{r}/consistency", f"{r}/unmask"):
        assert "#/components/schemas/Accepted" in ok_schema(path, "post"), path
    assert "#/components/schemas/MaskedInputAnswer" in ok_schema(f"{r}/masked-input", "post")


# -- the unmask stage closes once the answers decide the sum --------------------------------------

EIGHT = tuple(f"a{i}" for i in range(8))


@pytest_asyncio.fixture
async def api8(
    tmp_path: Path, clock: FakeClock, aiohttp_client: Callable[..., Awaitable[TestClient]]
) -> Api:
    # classic SecAgg for 8 with t = 5: each seed has 7 holders and t + 1 = 6 of them
    # decide it, so a0..a6's answers decide the sum without a7's
    fed = make_federation(tmp_path / "ws8", agents=EIGHT, validation=False)
    coord = Coordinator(fed.ws, clock=clock)
    return Api(await aiohttp_client(make_app(fed.ws, coord)), fed, coord)


async def test_late_unmask_answer_is_not_needed_and_gets_the_round_state(api8: Api) -> None:
    api = api8
    for m in EIGHT:
        await api.ok(m, "POST", f"{ROUND}/join?attempt=0", join_request(m))
    state = await api.wait_stage("advertise")
    assert state.spec is not None and (state.spec.neighbors, state.spec.threshold) == (7, 5)
    cohort = Cohort(state.spec, api.fed.identities)
    for m in EIGHT:
        await api.ok(m, "POST", f"{ROUND}/advertise?attempt=0", cohort.advertise(m))
    keys = msgspec.convert(await api.ok("a0", "GET", f"{ROUND}/keys?attempt=0"), wire.KeyListBody)
    for m in EIGHT:
        await api.ok(m, "POST", f"{ROUND}/shares?attempt=0", cohort.share_keys(m, keys))
    for m in EIGHT:
        relay = await api.ok(m, "GET", f"{ROUND}/shares?attempt=0")
        cohort.receive_shares(m, msgspec.convert(relay, wire.ShareRelayBody))

    async def masked(m: str) -> wire.MaskedInputAnswer:
        path, raw = _upload(cohort, m)
        answer = await api.ok(m, "POST", f"{path}&wait={HOLD}", raw)
        return msgspec.convert(answer, wire.MaskedInputAnswer)

    held = await _bounded(asyncio.gather(*(masked(m) for m in EIGHT)))
    requests = {m: answer.unmask for m, answer in zip(EIGHT, held, strict=True)}

    async def consistency(m: str) -> wire.Accepted:
        request = requests[m]
        assert request is not None
        path = f"{ROUND}/consistency?attempt=0&wait={HOLD}"
        return _accepted(await _bounded(api.ok(m, "POST", path, cohort.sign(m, request))))

    signed = await _bounded(asyncio.gather(*(consistency(m) for m in EIGHT)))
    proofs = {m: answer.proof for m, answer in zip(EIGHT, signed, strict=True)}
    answers = {m: cohort.unmask(m, proof) for m, proof in proofs.items() if proof}
    assert set(answers) == set(EIGHT)

    async def unmask(m: str) -> wire.Accepted:
        path = f"{ROUND}/unmask?attempt=0&wait={HOLD}"
        return _accepted(await _bounded(api.ok(m, "POST", path, answers[m])))

    # a0..a6 decide the sum: their held answers are released by the close
    decided = await _bounded(asyncio.gather(*(unmask(m) for m in EIGHT[:7])))
    for answer in decided:
        assert answer.state is not None and (answer.state.round, answer.state.stage) == (2, "open")
    logged = len(log_entries(api.fed.ws))
    # a7 comes late: answered at once with the state, nothing stored or logged
    for m in EIGHT[7:]:
        late = await unmask(m)
        assert late.state is not None and (late.state.round, late.state.stage) == (2, "open")
        assert api.fed.ws.state.messages.get(1, 0, "unmask", m) is None
    assert len(log_entries(api.fed.ws)) == logged
    old, new = model_params(api.fed.ws, 1), model_params(api.fed.ws, 2)
    exact = expected_params(old, [cohort.quantized[m] for m in EIGHT], cohort.spec)
    np.testing.assert_array_equal(new, exact)
