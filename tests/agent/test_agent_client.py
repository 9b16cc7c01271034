"""The agent's HTTP client against a real aiohttp server on a loopback port.

The server verifies every request with the aggregator's RequestVerifier, so a test
passes only if what the client signs is what it sends.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from fedsec.aggregator_client import AggregatorClient, error_from_response, parse_retry_after
from fedsec.crypto.httpsig import NonceCache, RequestVerifier
from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import (
    AggregatorRefused,
    AggregatorUnreachable,
    AuthError,
    ClockSkewError,
    ForbiddenError,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    ReplayError,
    RequestTimeout,
    RetryLater,
    ServerBusy,
    SignatureError,
    WrongStage,
)
from fedsec.protocol.wire import (
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
            "signature_input": request.headers.get("Signature-Input", ""),
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


def run(
    scenario: Callable[[Recorder, AggregatorClient], Awaitable[None]],
    recorder: Recorder | None = None,
    **client_options: Any,
) -> Recorder:
    """Run ``scenario`` against a loopback server; ``client_options`` override the
    client's arguments (identity, retry settings, sleep, clock)."""
    recorder = recorder or Recorder()
    options: dict[str, Any] = {
        "identity": AGENT,
        "timeout_s": 5.0,
        "retry_max": 3,
        "backoff_initial_s": 0.001,
        "backoff_max_s": 0.004,
    }
    options.update(client_options)

    async def main() -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", recorder.dispatch)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        try:
            client = AggregatorClient(
                str(server.make_url("/")), aggregator_public_key=AGGREGATOR.public_bytes, **options
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

        from fedsec.protocol.wire import AdvertiseKeysBody

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


# ------------------------------------------------------- refusals the agent outlives


class Pauses:
    """The client's injected sleep: records every retry delay and returns at once."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


def signature_param(signature_input: str, name: str) -> str:
    """One parameter (``created``, ``nonce``) of a Signature-Input header."""
    match = re.search(rf';{name}=("?)([^";]+)\1', signature_input)
    assert match is not None, signature_input
    return match.group(2)


def nonces(entries: list[dict[str, Any]]) -> list[str]:
    return [signature_param(e["signature_input"], "nonce") for e in entries]


def refuse(
    status: int, code: str, detail: str = "not now", headers: dict[str, str] | None = None
) -> web.Response:
    return web.json_response({"error": code, "detail": detail}, status=status, headers=headers)


def join_once_refused(
    server: Recorder, status: int, code: str, headers: dict[str, str] | None = None
) -> None:
    """``POST /rounds/3/join`` answers the refusal first and success next."""
    calls = 0

    @server.route("POST", "/v1/rounds/3/join")
    async def join(request: web.Request) -> web.Response:
        nonlocal calls
        calls += 1
        if calls == 1:
            return refuse(status, code, headers=headers)
        return web.Response(body=encode(JoinResponse(True, "welcome")))


JOIN = JoinRequest("ab" * 32, "1", 120)


@pytest.mark.parametrize(
    ("status", "code"), [(429, "rate_limited"), (503, "busy"), (408, "request_timeout")]
)
def test_temporary_refusal_waits_retry_after_then_retries_signed_afresh(
    status: int, code: str
) -> None:
    pauses = Pauses()

    async def scenario(server: Recorder, client: AggregatorClient) -> None:
        join_once_refused(server, status, code, {"Retry-After": "3"})
        assert await client.join(3, 1, JOIN) == JoinResponse(True, "welcome")

    seen = run(scenario, sleep=pauses, backoff_max_s=10.0).seen
    assert pauses.delays == [3.0]
    assert [e["path"] for e in seen] == ["/v1/rounds/3/join"] * 2
    assert all(e.get("keyid") == AGENT.key_id for e in seen)  # both verified
    assert len(set(nonces(seen))) == 2
    assert seen[0]["body"] == seen[1]["body"]


@pytest.mark.parametrize(
    ("header", "low", "high"),
    [
        ("3600", 10.0, 10.0),  # capped at backoff_max_s
        (None, 0.0, 0.5),  # absent: the first backoff, full jitter over [0, initial]
        ("soon", 0.0, 0.5),
        ("-1", 0.0, 0.5),
        ("1.5", 0.0, 0.5),
        ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0, 0.5),  # an HTTP-date: not delta-seconds
    ],
)
def test_retry_after_is_capped_and_a_missing_or_malformed_one_means_backoff(
    header: str | None, low: float, high: float
) -> None:
    pauses = Pauses()

    async def scenario(server: Recorder, client: AggregatorClient) -> None:
        join_once_refused(
            server, 429, "rate_limited", {} if header is None else {"Retry-After": header}
        )
        await client.join(3, 1, JOIN)

    seen = run(scenario, sleep=pauses, backoff_initial_s=0.5, backoff_max_s=10.0).seen
    (delay,) = pauses.delays
    assert low <= delay <= high
    assert len(seen) == 2


def test_temporary_refusal_is_raised_as_its_class_once_the_retries_run_out() -> None:
    pauses = Pauses()

    async def scenario(server: Recorder, client: AggregatorClient) -> None:
        @server.route("GET", "/v1/round")
        async def busy(request: web.Request) -> web.Response:
            return refuse(503, "busy", "every upload slot is taken", {"Retry-After": "1"})

        with pytest.raises(ServerBusy) as info:
            await client.get_round()
        assert info.value.detail == (
            "aggregator still refused GET /v1/round after 4 attempts: every upload slot is taken"
        )
        assert info.value.retry_after == 1.0

    seen = run(scenario, sleep=pauses, backoff_max_s=10.0).seen
    assert pauses.delays == [1.0, 1.0, 1.0]
    assert len(seen) == 4 and len(set(nonces(seen))) == 4


def test_replayed_refusal_backs_off_and_retries_with_a_fresh_nonce() -> None:
    pauses = Pauses()

    async def scenario(server: Recorder, client: AggregatorClient) -> None:
        join_once_refused(server, 401, "replayed")
        assert await client.join(3, 1, JOIN) == JoinResponse(True, "welcome")

    seen = run(scenario, sleep=pauses, backoff_initial_s=0.5, backoff_max_s=10.0).seen
    (delay,) = pauses.delays
    assert 0.0 <= delay <= 0.5  # the backoff: a replay refusal carries no Retry-After
    assert len(seen) == 2 and len(set(nonces(seen))) == 2


def test_replayed_refusal_is_bounded_by_the_retry_budget() -> None:
    pauses = Pauses()

    async def scenario(server: Recorder, client: AggregatorClient) -> None:
        @server.route("GET", "/v1/round")
        async def full(request: web.Request) -> web.Response:
            return refuse(401, "replayed", "the nonce store is full")

        with pytest.raises(ReplayError, match="after 2 attempts: the nonce store is full"):
            await client.get_round()

    seen = run(scenario, sleep=pauses, retry_max=1).seen
    assert len(seen) == 2 and len(pauses.delays) == 1


class SkewCheckingRecorder(Recorder):
    """Refuses signatures created more than 300 s from its clock as ``clock_skew`` before
    verifying them, as the aggregator does; aiohttp adds the Date header to the answer."""

    def __init__(self) -> None:
        super().__init__()
        self.skewed: list[dict[str, Any]] = []

    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        signature_input = request.headers.get("Signature-Input", "")
        created = int(signature_param(signature_input, "created"))
        if abs(created - time.time()) > 300:
            self.skewed.append({"signature_input": signature_input, "created": created})
            return refuse(401, "clock_skew", f"signature created at {created} is out of window")
        return await super().dispatch(request)


def test_clock_skew_is_corrected_from_the_date_header_and_the_request_resent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    behind = 1000.0  # the agent's clock, against the aggregator's
    pauses = Pauses()
    recorder = SkewCheckingRecorder()

    async def scenario(server: Recorder, client: AggregatorClient) -> None:
        @server.route("GET", "/v1/round")
        async def get_round(request: web.Request) -> web.Response:
            return web.Response(body=encode(state(4)))

        assert (await client.get_round()).token == 4
        assert client.clock_offset_s == pytest.approx(behind, abs=2.0)
        assert (await client.get_round()).token == 4  # later requests keep the offset

    log = logging.getLogger("fedsec.aggregator_client")
    log.addHandler(caplog.handler)
    try:
        run(scenario, recorder, sleep=pauses, clock=lambda: time.time() - behind)
    finally:
        log.removeHandler(caplog.handler)
    (skewed,) = recorder.skewed
    assert skewed["created"] == pytest.approx(time.time() - behind, abs=30)
    assert len(recorder.seen) == 2  # the resend and the later request, both accepted
    for entry in recorder.seen:
        assert int(signature_param(entry["signature_input"], "created")) == pytest.approx(
            time.time(), abs=30
        )
    assert len(set(nonces([skewed, *recorder.seen]))) == 3
    assert pauses.delays == []  # resent at once: the wait would not fix the clock
    warning = re.search(r"clock offset of (\d+) s against the aggregator; check NTP", caplog.text)
    assert warning is not None and abs(int(warning.group(1)) - behind) <= 2


def test_clock_skew_again_after_correcting_gives_up_clearly() -> None:
    pauses = Pauses()

    async def scenario(server: Recorder, client: AggregatorClient) -> None:
        @server.route("GET", "/v1/round")
        async def skewed(request: web.Request) -> web.Response:
            return refuse(401, "clock_skew", "created 400 s in the future")

        with pytest.raises(ClockSkewError) as info:
            await client.get_round()
        assert "for clock skew again after this agent corrected its clock" in info.value.detail
        assert "(NTP)" in info.value.detail and "\n" not in info.value.detail

    seen = run(scenario, sleep=pauses).seen
    assert len(seen) == 2 and pauses.delays == []


def test_clock_skew_without_a_usable_date_header_is_not_retried() -> None:
    async def scenario(server: Recorder, client: AggregatorClient) -> None:
        @server.route("GET", "/v1/round")
        async def skewed(request: web.Request) -> web.Response:
            return refuse(401, "clock_skew", "too old", {"Date": "yesterday"})

        with pytest.raises(ClockSkewError, match="no usable Date header"):
            await client.get_round()
        assert client.clock_offset_s == 0.0

    assert len(run(scenario).seen) == 1


def test_key_not_on_the_roster_is_permanent_and_says_what_to_do() -> None:
    pauses = Pauses()
    recorder = Recorder()

    async def scenario(server: Recorder, client: AggregatorClient) -> None:
        with pytest.raises(AuthError) as info:
            await client.get_round()
        assert type(info.value) is AuthError
        assert info.value.detail.startswith("aggregator refused GET /v1/round as unauthenticated")
        assert f"key {STRANGER.key_id} is not on the roster or was revoked" in info.value.detail
        assert "ask the consortium admin to enrol it" in info.value.detail

    run(scenario, recorder, identity=STRANGER, sleep=pauses)
    assert len(recorder.seen) == 1 and pauses.delays == []


def test_forbidden_is_permanent_and_says_what_to_do() -> None:
    pauses = Pauses()

    async def scenario(server: Recorder, client: AggregatorClient) -> None:
        @server.route("POST", "/v1/rounds/3/join")
        async def join(request: web.Request) -> web.Response:
            return refuse(403, "forbidden", "alice has role auditor; this needs agent")

        with pytest.raises(ForbiddenError) as info:
            await client.join(3, 1, JOIN)
        assert "as forbidden: alice has role auditor; this needs agent" in info.value.detail
        assert "check its roster entry" in info.value.detail

    seen = run(scenario, sleep=pauses).seen
    assert len(seen) == 1 and pauses.delays == []


@pytest.mark.parametrize(
    ("status", "raw", "retry_after", "cls", "code"),
    [
        (429, b'{"error": "rate_limited", "detail": "slow"}', 7.0, RateLimited, "rate_limited"),
        (503, b'{"error": "busy", "detail": "full"}', None, ServerBusy, "busy"),
        (503, b"<html>proxy says no</html>", 2.0, ServerBusy, "busy"),
        (429, b'{"error": "new_code", "detail": "slow"}', None, RateLimited, "rate_limited"),
        (408, b'{"error": "request_timeout", "detail": "late"}', None, RequestTimeout, None),
        (401, b'{"error": "clock_skew", "detail": "late"}', None, ClockSkewError, None),
        (401, b'{"error": "replayed", "detail": "again"}', None, ReplayError, None),
        (403, b'{"error": "forbidden", "detail": "no"}', None, ForbiddenError, None),
    ],
)
def test_error_from_response_maps_temporary_refusals_and_carries_retry_after(
    status: int, raw: bytes, retry_after: float | None, cls: type[Exception], code: str | None
) -> None:
    exc = error_from_response(status, raw, "GET /v1/round", retry_after)
    assert type(exc) is cls
    if code is not None:
        assert exc.code == code
    if isinstance(exc, RetryLater):
        assert exc.retry_after == (1.0 if retry_after is None else retry_after)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("0", 0.0),
        ("120", 120.0),
        (" 5 ", 5.0),
        (None, None),
        ("", None),
        ("-3", None),
        ("2.5", None),
        ("\u0663", None),  # ARABIC-INDIC DIGIT THREE: str.isdigit, not ASCII
        ("Fri, 31 Dec 1999 23:59:59 GMT", None),
    ],
)
def test_retry_after_is_delta_seconds_only(value: str | None, seconds: float | None) -> None:
    assert parse_retry_after(value) == seconds
