"""The custodian's client calls against a real aiohttp server on a loopback port: what each
sends (method, path, query, body) and how it reads the answer."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from fedsec.aggregator_client import AggregatorClient
from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import PayloadError, PayloadTooLarge, ProtocolError
from fedsec.protocol.wire import HeContext, HeContextStatement, HeSumOffer, encode

CUSTODIAN = SigningIdentity(bytes(range(32)))
AGGREGATOR = SigningIdentity(bytes(range(32, 64)))
OFFER = HeSumOffer(
    federation_id="f",
    round=3,
    attempt=1,
    contributors=["a", "b", "c"],
    sum_sha256="ab" * 32,
    log_index=17,
)


def run(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]], scenario: Any
) -> list[Any]:
    seen: list[Any] = []

    async def record(request: web.Request) -> web.StreamResponse:
        assert "Signature" in request.headers  # every request is signed, GETs too
        seen.append((request.method, request.path, dict(request.query), await request.read()))
        return await handler(request)

    async def main() -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", record)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        try:
            async with AggregatorClient(
                str(server.make_url("/")), CUSTODIAN, AGGREGATOR.public_bytes, retry_max=0
            ) as client:
                await scenario(client)
        finally:
            await server.close()

    asyncio.run(main())
    return seen


def test_offer_log_archive_and_decryption_calls() -> None:
    blob = b"\x01\x02" * 50

    async def handler(request: web.Request) -> web.StreamResponse:
        if request.path.endswith("/he-sum"):
            return web.Response(body=encode(OFFER), content_type="application/json")
        if request.path == "/v1/audit/log":
            return web.Response(body=b'{"index":0}\n')
        if request.path.startswith("/v1/audit/archive/"):
            return web.Response(body=blob)
        return web.json_response({"accepted": True})

    async def scenario(client: AggregatorClient) -> None:
        assert await client.he_sum(3, 1, wait=2.5) == OFFER
        assert await client.log_lines(5) == b'{"index":0}\n'
        digest = hashlib.sha256(blob).hexdigest()
        assert await client.archived(digest, max_bytes=len(blob)) == blob
        with pytest.raises(PayloadTooLarge):
            await client.archived(digest, max_bytes=len(blob) - 1)
        with pytest.raises(PayloadError):
            await client.archived("../roster", max_bytes=10)
        await client.post_decryption(3, 1, b"\x00body")

    seen = run(handler, scenario)
    digest = hashlib.sha256(blob).hexdigest()
    assert seen[0][:3] == ("GET", "/v1/rounds/3/he-sum", {"attempt": "1", "wait": "2.5"})
    assert seen[1][:3] == ("GET", "/v1/audit/log", {"from": "5"})
    assert seen[2][:2] == ("GET", f"/v1/audit/archive/{digest}")
    assert seen[-1] == ("POST", "/v1/rounds/3/decryption", {"attempt": "1"}, b"\x00body")


def test_put_he_context_and_its_conflict() -> None:
    statement = HeContextStatement(
        federation_id="f",
        custodian="keeper",
        poly_modulus_degree=8192,
        coeff_mod_bit_sizes=[60, 60],
        scale_bits=40,
        context_sha256="cd" * 32,
    ).sign(CUSTODIAN)
    context = HeContext(statement=statement, context="AAAA")

    async def handler(request: web.Request) -> web.StreamResponse:
        if len(seen_calls) > 1:
            return web.json_response(
                {"error": "protocol_error", "detail": "another context"}, status=409
            )
        return web.json_response({"accepted": True})

    seen_calls: list[int] = []

    async def scenario(client: AggregatorClient) -> None:
        seen_calls.append(1)
        await client.put_he_context(context)
        seen_calls.append(2)
        with pytest.raises(ProtocolError) as caught:
            await client.put_he_context(context)
        assert caught.value.http_status == 409

    seen = run(handler, scenario)
    assert seen[0][:2] == ("POST", "/v1/he/context")
    assert seen[0][3] == encode(context)
