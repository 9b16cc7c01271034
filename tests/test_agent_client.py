"""The agent's HTTP client against a real aiohttp server on a loopback port.

The server verifies every request with the aggregator's RequestVerifier, so a test
passes only if what the client signs is what it sends.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from fedsec.agent.client import AggregatorClient
from fedsec.crypto.httpsig import NonceCache, RequestVerifier
from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import (
    AggregatorRefused,
    AggregatorUnreachable,
    AuthError,
    NotFound,
    PayloadTooLarge,
    SignatureError,
    WrongStage,
)
from fedsec.wire import (
    ContributionStatement,
    JoinRequest,
    JoinResponse,
    MaskedInputAnswer,
    Receipt,
    RoundState,
    UnmaskRequestBody,
    encode,
)

AGENT = SigningIdentity(bytes(range(32)))
AGGREGATOR = SigningIdentity(bytes(range(32, 64)))
STRANGER = SigningIdentity(bytes(range(64, 96)))

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Recorder:
    """A loopback aggregator that verifies signatures and records what it received."""

    def __init__(self) -> None:
        self.verifier = RequestVerifier(
            lambda kid: AGENT.public_bytes if kid == AGENT.key_id else None,
            NonceCache(600.0),
        )
        self.seen: list[dict[str, Any]] = []
        self.routes: dict[tuple[str, str], Handler] = {}

    def route(self, method: str, path: str) -> Callable[[Handler], Handler]:
        def register(fn: Handler) -> Handler:
            self.routes[(method, path)] = fn
            return fn

        return register

    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        entry: dict[str, Any] = {
            "method": request.method,
            "raw_path": request.raw_path,
            "path": request.path,
            "query": dict(request.query),
            "content_type": request.headers.get("Content-Type"),
            "body": body,
        }
        try:
            entry["keyid"] = self.verifier.verify(
                request.method, request.raw_path, request.headers, body
            )
        except AuthError as exc:
            entry["auth_error"] = exc.detail
            self.seen.append(entry)
            return web.json_response({"error": exc.code, "detail": exc.detail}, status=401)
        self.seen.append(entry)
        handler = self.routes.get((request.method, request.path))
        if handler is None:
            return web.json_response({"error": "not_found", "detail": "no route"}, status=404)
        return await handler(request)


def run(scenario: Callable[[Recorder, AggregatorClient], Awaitable[None]]) -> Recorder:
    recorder = Recorder()

    async def main() -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", recorder.dispatch)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        try:
            client = AggregatorClient(
                str(server.make_url("/")),
                AGENT,
                AGGREGATOR.public_bytes,
                timeout_s=5.0,
                retry_max=3,
                backoff_initial_s=0.001,
                backoff_max_s=0.004,
            )
            async with client:
                await scenario(recorder, client)
        finally:
            await server.close()

    asyncio.run(main())
    return recorder


def state(token: int = 1) -> RoundState:
    return RoundState(
        federation_id="fed",
        round=3,
        attempt=1,
        stage="open",
        token=token,
        model_version=1,
        rounds_completed=2,
        rounds_target=10,
        finished=False,
    )


def signed_receipt(body: bytes, signer: SigningIdentity = AGGREGATOR) -> Receipt:
    return Receipt(
        federation_id="fed",
        round=3,
        attempt=1,
        member="alice",
        contribution_sha256=hashlib.sha256(body).hexdigest(),
        log_index=7,
        issued_at=time.time(),
    ).sign(signer)


def statement_for(vector: bytes) -> ContributionStatement:
    return ContributionStatement(
        federation_id="fed",
        round=3,
        attempt=1,
        member="alice",
        vector_sha256=hashlib.sha256(vector).hexdigest(),
        commitment="cd" * 32,
    ).sign(AGENT)


def test_every_request_is_signed_and_verifies() -> None:
    vector = b"\x00\x01\x02packed"
    statement = statement_for(vector)

    async def scenario(server: Recorder, client: AggregatorClient) -> None:
        @server.route("GET", "/v1/round")
        async def get_round(request: web.Request) -> web.Response:
            return web.Response(body=encode(state(5)), content_type="application/json")

        @server.route("POST", "/v1/rounds/3/join")
        async def join(request: web.Request) -> web.Response:
            return web.Response(body=encode(JoinResponse(True, "welcome")))

        @server.route("POST", "/v1/rounds/3/masked-input")
        async def masked(request: web.Request) -> web.Response:
            body = await request.read()
            # the statement travels as query parameters and verifies for the exact body
            ContributionStatement(
                federation_id="fed",
                round=3,
                attempt=int(request.query["attempt"]),
                member="alice",
                vector_sha256=hashlib.sha256(body).hexdigest(),
                commitment=request.query["commitment"],
                signature=request.query["signature"],
            ).verify(AGENT.public_bytes)
            return web.Response(body=encode(signed_receipt(body)))

        assert (await client.get_round()).token == 5
        assert (await client.get_round(wait_token=4, timeout=0.5)).token == 5
        answer = await client.join(3, 1, JoinRequest("ab" * 32, "1", 120))
        assert answer == JoinResponse(True, "welcome")
        receipt, unmask = await client.masked_input(3, 1, vector, statement)
        assert receipt.log_index == 7 and unmask is None

    seen = run(scenario).seen
    assert [e["method"] for e in seen] == ["GET", "GET", "POST", "POST"]
    assert all(e.get("keyid") == AGENT.key_id for e in seen), seen
    assert seen[0]["raw_path"] == "/v1/round"
    assert seen[1]["query"] == {"wait": "4", "timeout": "0.5"}
    assert seen[2]["query"] == {"attempt": "1"}
    assert msgspec.json.decode(seen[2]["body"], type=JoinRequest).samples == 120
    assert seen[3]["content_type"] == "application/octet-stream"
    assert seen[3]["body"] == vector
    assert seen[3]["query"] == {
        "attempt": "1",
        "commitment": statement.commitment,
        "signature": statement.signature,
    }


def test_base_url_path_prefix_is_signed_as_sent() -> None:
    recorder = Recorder()

    async def main() -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", recorder.dispatch)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        try:
            async with AggregatorClient(
                str(server.make_url("/fedsec/")), AGENT, AGGREGATOR.public_bytes, retry_max=0
            ) as client:
                with pytest.raises(NotFound, match="no route"):
                    await client.keys(4, 2)
        finally:
            await server.close()

    asyncio.run(main())
    (entry,) = recorder.seen
    assert entry["raw_path"] == "/fedsec/v1/rounds/4/keys?attempt=2"
    assert entry["keyid"] == AGENT.key_id


def test_4xx_becomes_the_matching_error_with_the_servers_sentence_and_is_not_retried() -> None:
    async def scenario(server: Recorder, client: AggregatorClient) -> None:
        @server.route("POST", "/v1/rounds/3/advertise")
        async def advertise(request: web.Request) -> web.Response:
            return web.json_response(
                {"error": "wrong_stage", "detail": "round 3 is in stage unmask"}, status=409
            )

        @server.route("GET", "/v1/rounds/3/keys")
        async def keys(request: web.Request) -> web.Response:
            return web.json_response(
                {"error": "cohort_full", "detail": "the cohort of round 3 is full"}, status=403
            )

        from fedsec.wire import AdvertiseKeysBody

        with pytest.raises(WrongStage) as wrong:
            await client.advertise(3, 1, AdvertiseKeysBody("aa", "bb", "cc"))
        assert wrong.value.detail == "round 3 is in stage unmask"
        assert wrong.value.http_status == 409

        with pytest.raises(AggregatorRefused) as refused:
            await client.keys(3, 1)
        assert refused.value.code == "cohort_full"
        assert refused.value.http_status == 403
        assert refused.value.detail == "the cohort of round 3 is full"

    seen = run(scenario).seen
    assert len(seen) == 2  # one request each: 4xx is never retried


def test_4xx_without_error_body_is_still_a_clear_error() -> None:
    async def scenario(server: Recorder, client: AggregatorClient) -> None:
        @server.route("GET", "/v1/round")
        async def get_round(request: web.Request) -> web.Response:
            return web.Response(text="teapot", status=418)

        with pytest.raises(AggregatorRefused, match="HTTP 418 to GET /v1/round: teapot"):
            await client.get_round()

    run(scenario)


def test_503_is_retried_with_fresh_signatures_then_succeeds() -> None:
    calls = 0

    async def scenario(server: Recorder, client: AggregatorClient) -> None:
        @server.route("GET", "/v1/round")
        async def flaky(request: web.Request) -> web.Response:
            nonlocal calls
            calls += 1
            if calls < 3:
                return web.json_response({"error": "busy", "detail": "restarting"}, status=503)
            return web.Response(body=encode(state(9)))

        assert (await client.get_round()).token == 9

    seen = run(scenario).seen
    assert calls == 3
    assert all(e.get("keyid") == AGENT.key_id for e in seen)  # no nonce was replayed


def test_persistent_5xx_gives_up_after_all_attempts() -> None:
    async def scenario(server: Recorder, client: AggregatorClient) -> None:
        @server.route("GET", "/v1/models/latest")
        async def broken(request: web.Request) -> web.Response:
            return web.Response(text="boom", status=500)

        with pytest.raises(AggregatorUnreachable, match="after 4 attempts: HTTP 500 boom"):
            await client.latest_manifest()

    assert len(run(scenario).seen) == 4


def test_unreachable_aggregator_is_a_clear_error_after_n_attempts() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # The socket is closed: nothing listens on the port any more.

    async def main() -> None:
        async with AggregatorClient(
            f"http://127.0.0.1:{port}",
            AGENT,
            AGGREGATOR.public_bytes,
            retry_max=2,
            backoff_initial_s=0.001,
            backoff_max_s=0.002,
        ) as client:
            with pytest.raises(AggregatorUnreachable) as info:
                await client.get_round()
        message = info.value.detail
        assert message.startswith(f"aggregator at http://127.0.0.1:{port} unreachable after 3 ")
        assert "Connect" in message

    asyncio.run(main())


def test_oversized_response_is_refused_before_and_while_reading() -> None:
    async def scenario(server: Recorder, client: AggregatorClient) -> None:
        @server.route("GET", "/v1/models/2")
        async def declared(request: web.Request) -> web.Response:
            return web.Response(body=b"x" * 5000)

        @server.route("GET", "/v1/models/3")
        async def chunked(request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse()
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            for _ in range(10):
                await resp.write(b"y" * 700)
            await resp.write_eof()
            return resp

        with pytest.raises(PayloadTooLarge, match="5000 bytes, over the limit of 1000"):
            await client.model_bytes(2, max_bytes=1000)
        with pytest.raises(PayloadTooLarge, match="exceeds the limit of 1000"):
            await client.model_bytes(3, max_bytes=1000)
        assert len(await client.model_bytes(3, max_bytes=7000)) == 7000

    run(scenario)


def test_receipt_not_signed_by_the_pinned_aggregator_is_refused() -> None:
    async def scenario(server: Recorder, client: AggregatorClient) -> None:
        @server.route("GET", "/v1/rounds/3/receipt")
        async def forged(request: web.Request) -> web.Response:
            return web.Response(body=encode(signed_receipt(b"v", signer=STRANGER)))

        with pytest.raises(SignatureError):
            await client.receipt(3)

    run(scenario)


def test_held_masked_input_answer_carries_the_unmask_request() -> None:
    """With ``wait`` the answer is {receipt, unmask}; an aggregator that does not hold
    answers sends the bare receipt, which is taken as it is.  Either receipt must
    verify against the pinned aggregator key."""
    vector = b"\x00\x01\x02packed"
    statement = statement_for(vector)
    request = UnmaskRequestBody(survivors=["alice", "bob"], dropped=["carol"], state_token=9)
    answers = [
        encode(MaskedInputAnswer(receipt=signed_receipt(vector), unmask=request)),
        encode(signed_receipt(vector)),
        encode(MaskedInputAnswer(receipt=signed_receipt(vector, STRANGER), unmask=request)),
    ]

    async def scenario(server: Recorder, client: AggregatorClient) -> None:
        @server.route("POST", "/v1/rounds/3/masked-input")
        async def masked(request: web.Request) -> web.Response:
            return web.Response(body=answers.pop(0), content_type="application/json")

        receipt, unmask = await client.masked_input(3, 1, vector, statement, wait=2.0)
        assert receipt.log_index == 7 and unmask == request
        receipt, unmask = await client.masked_input(3, 1, vector, statement, wait=2.0)
        assert receipt.log_index == 7 and unmask is None
        with pytest.raises(SignatureError):
            await client.masked_input(3, 1, vector, statement, wait=2.0)

    seen = run(scenario).seen
    assert [e["query"]["wait"] for e in seen] == ["2", "2", "2"]
