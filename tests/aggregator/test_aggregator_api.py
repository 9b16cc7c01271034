"""The aggregator's HTTP API over real loopback sockets (aiohttp test server).

Every refusal is checked for its status, its ``{"error", "detail"}`` body and for
leaving the state store, the round in memory and the roster exactly as they were.
One secure round runs end to end over HTTP with a member lost after share keys.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.http.app import make_app
from fedsec.crypto.identity import SigningIdentity
from fedsec.modelfile import ModelManifest, verify_manifest
from fedsec.protocol import compact, wire
from tests.support.aggregator import (
    FAST_ROUND,
    FED,
    FakeClock,
    expected_params,
    make_federation,
    model_params,
    snapshot,
)
from tests.support.http import (
    AGENTS,
    JOIN,
    MASKED,
    MAX_BODY,
    MAX_JSON,
    Api,
    _fix_cohort,
    _join_body,
    _masked_path,
    _to_masked_input,
    _upload,
)

pytestmark = pytest.mark.asyncio

# -- public endpoints ------------------------------------------------------------------------------


async def test_health_status_and_openapi_cover_every_route(api: Api) -> None:
    async with api.client.get("/v1/health") as resp:
        assert resp.status == 200 and await resp.json() == {"status": "ok", "role": "single"}
    async with api.client.get("/v1/status") as resp:
        # alerts and round history are for enrolled roles only
        assert resp.status == 401 and (await resp.json())["error"] == "unauthenticated"
    status = msgspec.convert(await api.ok("a0", "GET", "/v1/status"), wire.FederationStatus)
    assert (status.federation_id, status.stage, status.agents_active) == (FED, "open", 4)
    async with api.client.get("/v1/openapi.json") as resp:
        assert resp.status == 200
        doc = await resp.json()
    assert doc["openapi"].startswith("3.")
    paths = doc["paths"]
    routes = {
        (route.resource.canonical, route.method.lower())
        for route in api.client.server.app.router.routes()  # type: ignore[union-attr]
        if route.method != "HEAD" and route.resource is not None
    }
    # 21 protocol routes (with SecAgg+ consistency and federated evaluation), 6 audit
    # (challenges, reveals, verdicts, quarantine), 7 operations (dashboard sign-in), 8 of
    # homomorphic summation (with the commit step)
    assert len(routes) == 42
    for path, method in routes:
        assert path in paths, path
        assert method in paths[path], (path, method)
    documented = {(p, m) for p, ops in paths.items() for m in ops}
    assert documented == routes
    schemas = doc["components"]["schemas"]
    refs = {v.rsplit("/", 1)[1] for v in _refs(doc)}
    assert refs and refs <= set(schemas)


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "$ref"] + [
            r for v in node.values() for r in _refs(v)
        ]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


async def test_unknown_route_and_method_answer_json_errors(api: Api) -> None:
    await api.refused(404, "not_found", lambda: api.call("a0", "GET", "/v1/nothing"))
    await api.refused(405, "method_not_allowed", lambda: api.call("a0", "DELETE", "/v1/round"))


# -- authentication --------------------------------------------------------------------------------


async def test_missing_signature_headers(api: Api) -> None:
    body = _join_body()
    detail = await api.refused(401, "unauthenticated", lambda: api.send("POST", JOIN, body, {}))
    assert "Signature" in detail or "signature" in detail
    headers = api.headers("a0", "POST", JOIN, body)
    del headers["Signature"]
    await api.refused(401, "unauthenticated", lambda: api.send("POST", JOIN, body, headers))


async def test_tampered_body_or_target_fails_the_signature(api: Api) -> None:
    signed = _join_body()
    headers = api.headers("a0", "POST", JOIN, signed)
    tampered = _join_body(samples=5000)
    detail = await api.refused(
        401, "unauthenticated", lambda: api.send("POST", JOIN, tampered, headers)
    )
    assert "digest" in detail
    other_attempt = "/v1/rounds/1/join?attempt=1"
    headers = api.headers("a0", "POST", JOIN, signed)
    detail = await api.refused(
        401, "unauthenticated", lambda: api.send("POST", other_attempt, signed, headers)
    )
    assert "bad signature" in detail
    assert api.fed.ws.state.joins.samples(1, 0) == {}


async def test_replayed_nonce_is_refused(api: Api) -> None:
    body = _join_body()
    headers = api.headers("a0", "POST", JOIN, body)
    status, raw, _ = await api.send("POST", JOIN, body, headers)
    assert status == 200 and json.loads(raw)["accepted"] is True
    detail = await api.refused(401, "replayed", lambda: api.send("POST", JOIN, body, headers))
    assert "nonce" in detail
    assert api.fed.ws.state.joins.samples(1, 0) == {"a0": 50}


async def test_stale_and_future_timestamps_are_refused(api: Api) -> None:
    body = _join_body()
    for created in (int(time.time()) - 10_000, int(time.time()) + 10_000):
        headers = api.headers("a0", "POST", JOIN, body, created=created)
        detail = await api.refused(
            401, "clock_skew", lambda h=headers: api.send("POST", JOIN, body, h)
        )
        assert "stale timestamp" in detail


async def test_unknown_and_revoked_keys_are_refused(api: Api) -> None:
    body = _join_body()
    stranger = SigningIdentity.generate()
    detail = await api.refused(
        401, "unauthenticated", lambda: api.call(stranger, "POST", JOIN, body)
    )
    assert stranger.key_id in detail
    await api.refused(401, "unauthenticated", lambda: api.call("gone", "POST", JOIN, body))
    await api.refused(401, "unauthenticated", lambda: api.call("gone", "GET", "/v1/round"))
    # revoking a member takes effect at once for its next request
    await api.ok("a1", "GET", "/v1/round")
    api.fed.ws.roster.revoke("a1", api.fed.ws.admin())
    await api.refused(401, "unauthenticated", lambda: api.call("a1", "POST", JOIN, body))


async def test_roles_limit_what_a_key_may_do(api: Api) -> None:
    body = _join_body()
    for who in ("obs", "aud"):
        detail = await api.refused(403, "forbidden", lambda w=who: api.call(w, "POST", JOIN, body))
        assert "role" in detail
    state = await api.ok("obs", "GET", "/v1/round")
    assert state["stage"] == "open"
    assert api.fed.ws.state.joins.samples(1, 0) == {}


# -- protocol position -----------------------------------------------------------------------------


async def test_wrong_round_attempt_or_stage_is_a_conflict(api: Api) -> None:
    body = _join_body()
    for path in ("/v1/rounds/2/join?attempt=0", "/v1/rounds/1/join?attempt=1"):
        await api.refused(409, "wrong_stage", lambda p=path: api.call("a0", "POST", p, body))
    advert = wire.encode(
        wire.AdvertiseKeysBody(enc_public="00" * 32, mask_public="00" * 32, signature="00" * 64)
    )
    await api.refused(
        409, "wrong_stage", lambda: api.call("a0", "POST", "/v1/rounds/1/advertise", advert)
    )
    await api.refused(409, "wrong_stage", lambda: api.call("a0", "GET", "/v1/rounds/1/keys"))
    # a well-formed statement: the stage, not the statement, is what is refused
    early = _masked_path("00" * 32, "00" * 64)
    await api.refused(409, "wrong_stage", lambda: api.call("a0", "POST", early, b"\x00" * 100))
    cohort = await _fix_cohort(api)
    await api.refused(409, "wrong_stage", lambda: api.call("a0", "POST", JOIN, body))
    good = wire.encode(cohort.advertise("a0"))
    await api.refused(
        409, "wrong_stage", lambda: api.call("a0", "POST", "/v1/rounds/1/advertise?attempt=1", good)
    )
    await api.ok("a0", "POST", "/v1/rounds/1/advertise", good)
    await api.refused(404, "not_found", lambda: api.call("a0", "GET", "/v1/rounds/1/receipt"))


async def test_a_compact_upload_is_checked_then_stored_as_its_json_form(api: Api) -> None:
    cohort = await _fix_cohort(api)
    path = "/v1/rounds/1/advertise"

    def send_compact(raw: bytes) -> Awaitable[tuple[int, bytes, str]]:
        headers = api.headers("a0", "POST", path, raw)
        headers["Content-Type"] = compact.MEDIA_TYPE
        return api.send("POST", path, raw, headers)

    short_key = msgspec.msgpack.encode([b"k" * 31, b"k" * 32, b"s" * 64])
    await api.refused(400, "bad_request", lambda: send_compact(short_key))
    body = cohort.advertise("a0")
    status, raw, _ = await send_compact(compact.encode(body))
    assert status == 200, raw
    # stored, archived and replayed exactly as the JSON upload would be
    assert api.fed.ws.state.messages.get(1, 0, "advertise", "a0") == wire.encode(body)
    await api.ok("a0", "POST", path, body)  # the JSON retry is the same message


async def test_malformed_json_unknown_fields_and_bad_numbers(api: Api) -> None:
    for body in (b"{not json", b"[]", b'{"dataset_schema": "x", "task_version": "1"}'):
        await api.refused(400, "bad_request", lambda b=body: api.call("a0", "POST", JOIN, b))
    extra = json.loads(_join_body())
    extra["admin"] = True
    detail = await api.refused(
        400, "bad_request", lambda: api.call("a0", "POST", JOIN, json.dumps(extra).encode())
    )
    assert "admin" in detail
    wrong_type = json.loads(_join_body())
    wrong_type["samples"] = "many"
    await api.refused(
        400, "bad_request", lambda: api.call("a0", "POST", JOIN, json.dumps(wrong_type).encode())
    )
    body = _join_body()
    for path in ("/v1/rounds/x/join", "/v1/rounds/1/join?attempt=first"):
        await api.refused(400, "bad_request", lambda p=path: api.call("a0", "POST", p, body))
    await api.refused(
        400, "bad_request", lambda: api.call("a0", "GET", "/v1/round?wait=soon&timeout=1")
    )


async def test_oversized_bodies_are_refused_before_use(api: Api) -> None:
    big = b"\x00" * (MAX_BODY + 1)
    path = _masked_path("00" * 32, "00" * 64)
    detail = await api.refused(413, "payload_too_large", lambda: api.call("a0", "POST", path, big))
    assert str(MAX_BODY) in detail
    padded = _join_body()[:-1] + b"," + b" " * MAX_JSON + b'"x": 1}'
    await api.refused(413, "payload_too_large", lambda: api.call("a0", "POST", JOIN, padded))


# -- intake in the masked-input stage --------------------------------------------------------------


async def test_masked_input_retry_duplicate_and_bad_vector(api: Api) -> None:
    cohort = await _to_masked_input(api)
    path, raw = _upload(cohort, "a0")
    first = msgspec.convert(await api.ok("a0", "POST", path, raw), wire.Receipt)
    first.verify(api.fed.ws.signer.public_bytes)
    before = snapshot(api.fed.ws, api.coord)
    assert _upload(cohort, "a0") == (path, raw)  # a retry sends the very same request
    again = msgspec.convert(await api.ok("a0", "POST", path, raw), wire.Receipt)
    assert again == first
    assert snapshot(api.fed.ws, api.coord) == before
    changed = bytes([raw[0] ^ 1]) + raw[1:]
    changed_path, _ = _upload(cohort, "a0", changed)
    await api.refused(409, "duplicate", lambda: api.call("a0", "POST", changed_path, changed))
    short_path, short = _upload(cohort, "a1", cohort.masked_input("a1")[:-3])
    detail = await api.refused(400, "bad_vector", lambda: api.call("a1", "POST", short_path, short))
    assert "bytes" in detail
    await api.refused(403, "forbidden", lambda: api.call("obs", "POST", path, raw))
    got = await api.ok("a0", "GET", "/v1/rounds/1/receipt")
    assert msgspec.convert(got, wire.Receipt) == first


async def test_masked_input_without_its_statement_is_a_bad_request(api: Api) -> None:
    cohort = await _to_masked_input(api)
    raw, commitment, signature = cohort.upload("a0")
    for path in (
        f"{MASKED}?attempt=0",
        f"{MASKED}?attempt=0&commitment={commitment}",
        f"{MASKED}?attempt=0&signature={signature}",
        f"{MASKED}?attempt=0&commitment=&signature={signature}",
        f"{MASKED}?attempt=0&commitment={commitment}&signature=",
    ):
        detail = await api.refused(
            400, "bad_request", lambda p=path: api.call("a0", "POST", p, raw)
        )
        assert "commitment" in detail and "signature" in detail
    assert api.coord.live.session is not None and api.coord.live.session.contributed == []
    await api.ok("a0", "POST", _masked_path(commitment, signature), raw)


async def test_masked_input_statement_signed_by_another_member_is_refused(api: Api) -> None:
    cohort = await _to_masked_input(api)
    path, raw = _upload(cohort, "a1", signer="a2")  # a1's statement, a2's signature
    await api.refused(401, "bad_signature", lambda: api.call("a1", "POST", path, raw))
    # a genuine statement of a0's does not cover a1's upload either
    a0_path, _ = _upload(cohort, "a0")
    await api.refused(401, "bad_signature", lambda: api.call("a1", "POST", a0_path, raw))
    assert api.coord.live.session is not None and api.coord.live.session.contributed == []
    path, raw = _upload(cohort, "a1")
    receipt = msgspec.convert(await api.ok("a1", "POST", path, raw), wire.Receipt)
    receipt.verify(api.fed.ws.signer.public_bytes)
    assert api.coord.live.session.contributed == ["a1"]


# -- a whole secure round over HTTP ----------------------------------------------------------------


@pytest_asyncio.fixture
async def api5(
    tmp_path: Path, clock: FakeClock, aiohttp_client: Callable[..., Awaitable[TestClient]]
) -> Api:
    # four members cannot lose one: t = 3 of 3 neighbours (2t > 3 + 1 colluder)
    fed = make_federation(tmp_path / "ws5", agents=FIVE)
    coord = Coordinator(fed.ws, clock=clock)
    return Api(await aiohttp_client(make_app(fed.ws, coord)), fed, coord)


FIVE = (*AGENTS, "a4")


async def test_secure_round_over_http_survives_a_member_lost_after_share_keys(
    api5: Api, clock: FakeClock
) -> None:
    api = api5
    cohort = await _to_masked_input(api, FIVE)
    spec = cohort.spec
    spec.verify(api.fed.ws.signer.public_bytes)
    assert (spec.cohort, spec.neighbors, spec.threshold) == (list(FIVE), 4, 3)
    survivors = FIVE[:4]  # a4 stops after share keys
    receipts = {}
    for m in survivors:
        path, raw = _upload(cohort, m)
        receipts[m] = msgspec.convert(await api.ok(m, "POST", path, raw), wire.Receipt)
    clock.advance(FAST_ROUND["masked_s"] + FAST_ROUND["open_s"])  # the ticker closes the stage
    await api.wait_stage("consistency")
    for m in survivors:
        request = msgspec.convert(
            await api.ok(m, "GET", "/v1/rounds/1/unmask"), wire.UnmaskRequestBody
        )
        assert (request.survivors, request.dropped) == (list(survivors), ["a4"])
        await api.ok(m, "POST", "/v1/rounds/1/consistency", cohort.sign(m, request))
    await api.wait_stage("unmask")
    for m in survivors:
        proof = msgspec.convert(
            await api.ok(m, "GET", "/v1/rounds/1/consistency"), wire.ConsistencyProofBody
        )
        await api.ok(m, "POST", "/v1/rounds/1/unmask", cohort.unmask(m, proof))
    state = await api.wait_stage("open")
    assert (state.round, state.rounds_completed, state.model_version) == (2, 1, 2)

    manifest = ModelManifest.from_json(
        json.dumps(await api.ok("a1", "GET", "/v1/models/latest")).encode()
    )
    status, model, _ = await api.call("a1", "GET", "/v1/models/2")
    assert status == 200
    verify_manifest(manifest, api.fed.ws.signer.public_bytes, model, federation_id=FED)
    assert (manifest.version, manifest.parent, manifest.round) == (2, 1, 1)
    old, new = model_params(api.fed.ws, 1), model_params(api.fed.ws, 2)
    exact = expected_params(old, [cohort.quantized[m] for m in survivors], spec)
    np.testing.assert_array_equal(new, exact)
    for m in survivors:
        receipt = msgspec.convert(await api.ok(m, "GET", "/v1/rounds/1/receipt"), wire.Receipt)
        assert receipt == receipts[m]
        receipt.verify(api.fed.ws.signer.public_bytes)
    await api.refused(404, "not_found", lambda: api.call("a4", "GET", "/v1/rounds/1/receipt"))
    status_body = msgspec.convert(await api.ok("a0", "GET", "/v1/status"), wire.FederationStatus)
    assert [(h.round, h.stage, h.survivors, h.dropped) for h in status_body.history] == [
        (1, "closed", 4, ["a4"])
    ]


async def _trickle(parts: list[bytes]) -> AsyncIterator[bytes]:
    """A body sent in pieces over a slow link (chunked, no Content-Length)."""
    for i, part in enumerate(parts):
        if i:
            await asyncio.sleep(0.05)
        yield part


async def test_body_arriving_in_pieces_is_read_whole(api: Api) -> None:
    cohort = await _to_masked_input(api)
    path, raw = _upload(cohort, "a0")
    headers = api.headers("a0", "POST", path, raw)
    parts = [raw[:500], raw[500:1000], raw[1000:]]
    status, body, _ = await api.send("POST", path, _trickle(parts), headers)  # type: ignore[arg-type]
    assert status == 200, body
    receipt = msgspec.json.decode(body, type=wire.Receipt)
    receipt.verify(api.fed.ws.signer.public_bytes)
    assert api.coord.live.session is not None and api.coord.live.session.contributed == ["a0"]

    big = [b"\x00" * (MAX_BODY // 2), b"\x00" * (MAX_BODY // 2), b"\x00" * 10]
    path, _ = _upload(cohort, "a1")
    headers = api.headers("a1", "POST", path, b"".join(big))
    await api.refused(
        413,
        "payload_too_large",
        lambda: api.send("POST", path, _trickle(big), headers),  # type: ignore[arg-type]
    )
