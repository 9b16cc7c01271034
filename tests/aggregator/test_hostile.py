"""The aggregator against hostile clients, over real loopback sockets (issue 12).

Each request is written by hand (see :mod:`tests.support.hostile`) where aiohttp's client
would normalise it.  Every refusal is checked for its status and its
``{"error", "detail"}`` body, and for leaving the state database (every table's row
count, the protocol tables' rows) and the transparency log file as they were; a
refused request whose signature verified may only add its nonce to the replay store.
No test here may make the aggregator log at ERROR level or answer 5xx.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import gzip
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.workspace import Workspace
from fedsec.protocol import compact, wire
from tests.support.aggregator import (
    FED,
    Cohort,
    FakeClock,
    Federation,
    join_request,
    log_entries,
    make_federation,
    plain_upload,
    privacy_report,
)
from tests.support.hostile import (
    HOST,
    DurableState,
    Headers,
    RawAnswer,
    Served,
    assert_unchanged,
    close,
    durable_state,
    exchange,
    read_answer,
    request_head,
    serve,
    signed_headers,
    signed_request,
)
from tests.support.http import Api, _fix_cohort, _to_masked_input, _upload

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(90)]

AGENTS = ("a0", "a1", "a2", "a3")
# Fast connection limits so the slow-client cases finish in seconds; a rate limit far
# above what these tests send, except where the quota itself is tested.
SERVER = {
    "header_timeout_s": 0.5,
    "body_timeout_s": 2.0,
    "member_rate_per_s": 1000.0,
    "member_burst": 1000,
}
MiB = 1 << 20
MAX_BODY = 64 * MiB  # the default server.max_body_bytes
MAX_JSON = 1 * MiB  # the default server.max_json_bytes
STATEMENT = f"commitment={'00' * 32}&signature={'00' * 64}"
ANSWER_S = 3.0  # a refusal that needs no body must come within this


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def no_error_logs(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """No hostile request may make the aggregator log at ERROR (its bug path)."""
    yield
    errors = [
        f"{r.name}: {r.getMessage()}"
        for when in ("setup", "call")
        for r in caplog.get_records(when)
        if r.levelno >= logging.ERROR
    ]
    assert errors == []


@dataclass
class Hostile:
    """A served aggregator and the hostile client's requests to it."""

    fed: Federation
    served: Served

    @property
    def ws(self) -> Workspace:
        return self.served.ws

    @property
    def port(self) -> int:
        return self.served.port

    async def send(self, data: bytes, *, timeout: float = 10.0) -> RawAnswer:
        answer = await exchange(self.port, data, timeout=timeout)
        assert answer.status < 500, answer
        return answer

    def signed(
        self,
        who: str,
        method: str,
        target: str,
        body: bytes = b"",
        extra: Headers = (),
        *,
        content_type: str | None = None,
    ) -> bytes:
        return signed_request(
            self.fed.identities[who], method, target, body, extra, content_type=content_type
        )

    async def call(self, who: str, method: str, target: str, body: bytes = b"") -> RawAnswer:
        return await self.send(self.signed(who, method, target, body))

    async def ok(self, who: str, method: str, target: str, body: bytes = b"") -> Any:
        answer = await self.call(who, method, target, body)
        assert answer.status == 200, answer
        return answer.json()

    async def refused(
        self,
        status: int,
        code: str,
        request: bytes | Callable[[], Awaitable[RawAnswer]],
        *,
        nonces: int = 0,
    ) -> str:
        """The request is answered ``status`` with error ``code`` and nothing durable
        changes (but ``nonces`` replay-store rows); returns the detail."""
        before = durable_state(self.ws)
        answer = await (self.send(request) if isinstance(request, bytes) else request())
        assert answer.status == status, answer
        error, detail = answer.error()
        assert error == code, answer
        assert_unchanged(before, durable_state(self.ws), nonces_may_grow_by=nonces)
        return detail


def _federation(root: Path, **server: Any) -> Federation:
    return make_federation(
        root,
        agents=AGENTS,
        observers=("obs",),
        auditors=("aud",),
        server={**SERVER, **server},
        validation=False,
    )


@pytest_asyncio.fixture
async def hostile(tmp_path: Path) -> AsyncIterator[Hostile]:
    fed = _federation(tmp_path / "ws")
    served = await serve(fed.ws, Coordinator(fed.ws, clock=FakeClock()))
    try:
        yield Hostile(fed, served)
    finally:
        await served.stop()
        fed.ws.close()


def _join_body(**changes: Any) -> bytes:
    return wire.encode(msgspec.structs.replace(join_request("a0"), **changes))


def _join_doc(**changes: Any) -> bytes:
    """A join request with fields set to values msgspec.Struct would refuse to build."""
    doc = json.loads(_join_body())
    doc.update(changes)
    return json.dumps(doc).encode()


def _report_doc(**changes: Any) -> bytes:
    doc: dict[str, Any] = {
        "federation_id": FED,
        "round": 1,
        "attempt": 0,
        "member": "a0",
        "dataset_id": "breast_cancer:iid:0:a0",
        "epsilon": 1.5,
        "delta": 1e-5,
        "noise_multiplier": 1.1,
        "sample_rate": 0.1,
        "steps": 10,
        "samples": 50,
        "signature": "00" * 64,
    }
    doc.update(changes)
    return json.dumps(doc).encode()


# -- 1. integers outside storage range or not in canonical form -----------------------------------

# As they appear in the target: " 1" and the fullwidth digit zero are percent-encoded.
BAD_INTEGERS = (
    "99999999999999999999",
    "12345678901234567890",
    "2147483648",  # 2**31: over the storage range
    "-1",
    "1e3",
    "+1",
    "%201",  # " 1"
    "1%20",  # "1 "
    "1_0",
    "%EF%BC%90",  # "０", which int() accepts
    "01",
    "00",
    "0x1",
)


def _integer_targets(bad: str) -> list[tuple[str, str]]:
    return [
        ("POST", f"/v1/rounds/{bad}/join?attempt=0"),
        ("POST", f"/v1/rounds/1/join?attempt={bad}"),
        ("GET", f"/v1/rounds/{bad}/receipt"),
        ("GET", f"/v1/rounds/1/keys?attempt={bad}"),
        ("POST", f"/v1/rounds/{bad}/masked-input?attempt=0&{STATEMENT}"),
        ("GET", f"/v1/models/{bad}/manifest"),
        ("GET", f"/v1/models/{bad}"),
    ]


async def test_non_canonical_integers_in_the_target_are_bad_requests(hostile: Hostile) -> None:
    join = _join_body()
    for bad in BAD_INTEGERS:
        for method, target in _integer_targets(bad):
            body = join if "/join" in target else b"\x00" * 64 if "masked" in target else b""
            request = hostile.signed("a0", method, target, body)
            detail = await hostile.refused(400, "bad_request", request, nonces=1)
            assert len(detail) < 1000
    # canonical numbers still work
    assert (await hostile.ok("a0", "POST", "/v1/rounds/1/join?attempt=0", join))["accepted"]
    assert (await hostile.ok("a0", "GET", "/v1/models/1/manifest"))["version"] == 1


async def test_model_version_of_thousands_of_digits_is_a_bad_request(hostile: Hostile) -> None:
    # under the request-line limit, so the handler's own number check must refuse it
    target = "/v1/models/" + "9" * 5000
    await hostile.refused(400, "bad_request", hostile.signed("a0", "GET", target), nonces=1)
    # over aiohttp's 8190-byte request line: refused by the HTTP parser, still a 400
    before = durable_state(hostile.ws)
    answer = await hostile.send(request_head("GET", "/v1/models/" + "9" * 9000))
    assert answer.status == 400, answer
    # refused by the HTTP layer before any route runs (transport.PARSER_REJECTIONS_NOTE)
    assert answer.error()[0] in ("bad_request", "bad_http"), answer
    assert_unchanged(before, durable_state(hostile.ws))


@pytest.mark.parametrize("value", [2**63, 2**64 - 1, 2**70, -(2**63) - 1])
async def test_json_integers_outside_storage_range_are_bad_requests(
    hostile: Hostile, value: int
) -> None:
    join = "/v1/rounds/1/join?attempt=0"
    for field in ("samples", "base_version"):
        request = hostile.signed("a0", "POST", join, _join_doc(**{field: value}))
        await hostile.refused(400, "bad_request", request, nonces=1)
    report = "/v1/rounds/1/report?attempt=0"
    for field in ("round", "attempt", "steps", "samples", "trained_round"):
        request = hostile.signed("a0", "POST", report, _report_doc(**{field: value}))
        await hostile.refused(400, "bad_request", request, nonces=1)
    assert hostile.ws.state.joins.samples(1, 0) == {}


# -- 2. replays -----------------------------------------------------------------------------------


async def test_replay_within_the_skew_window_is_refused(hostile: Hostile) -> None:
    captured = hostile.signed("a0", "GET", "/v1/round")
    assert (await hostile.send(captured)).status == 200
    detail = await hostile.refused(401, "replayed", captured)
    assert "nonce" in detail
    join = hostile.signed("a1", "POST", "/v1/rounds/1/join?attempt=0", _join_body())
    assert (await hostile.send(join)).status == 200
    await hostile.refused(401, "replayed", join)
    assert hostile.ws.state.joins.samples(1, 0) == {"a1": 50}


async def test_replay_after_a_restart_is_refused(tmp_path: Path) -> None:
    fed = _federation(tmp_path / "ws")
    clock = FakeClock()
    served = await serve(fed.ws, Coordinator(fed.ws, clock=clock))
    try:
        captured = signed_request(fed.identities["a0"], "GET", "/v1/round")
        assert (await exchange(served.port, captured)).status == 200
    finally:
        await served.stop()
        fed.ws.close()
    ws = Workspace.open(fed.root)
    served = await serve(ws, Coordinator(ws, clock=clock))
    try:
        before = durable_state(ws)
        answer = await exchange(served.port, captured)
        assert answer.status == 401, answer
        assert answer.error()[0] == "replayed"
        assert_unchanged(before, durable_state(ws))
        fresh = signed_request(fed.identities["a0"], "GET", "/v1/round")
        assert (await exchange(served.port, fresh)).status == 200
    finally:
        await served.stop()
        ws.close()


# -- 3. per-member quota --------------------------------------------------------------------------


async def test_a_member_at_full_speed_is_rate_limited_and_others_are_not(tmp_path: Path) -> None:
    rate, burst = 20.0, 40
    fed = _federation(tmp_path / "ws", member_rate_per_s=rate, member_burst=burst)
    served = await serve(fed.ws, Coordinator(fed.ws, clock=FakeClock()))
    try:
        before = durable_state(fed.ws)
        reader, writer = await asyncio.open_connection(HOST, served.port)
        statuses: list[int] = []
        limited: RawAnswer | None = None
        deadline = time.monotonic() + 20.0
        try:
            while len(statuses) < 2000 and time.monotonic() < deadline:
                writer.write(signed_request(fed.identities["a0"], "GET", "/v1/round"))
                answer = await asyncio.wait_for(read_answer(reader), 10.0)
                statuses.append(answer.status)
                if answer.status != 200:
                    limited = answer
                    break
        finally:
            await close(writer)
        assert limited is not None, f"{len(statuses)} requests in 20 s, none refused"
        assert limited.status == 429, limited
        assert limited.error()[0] == "rate_limited"
        retry_after = limited.headers.get("Retry-After", "")
        assert retry_after.isdigit() and int(retry_after) >= 1, limited
        assert len(statuses) > burst, statuses  # the full burst was served first
        # the limit is per key: another member is served at once
        other = await exchange(
            served.port, signed_request(fed.identities["a1"], "GET", "/v1/round")
        )
        assert other.status == 200, other
        assert_unchanged(before, durable_state(fed.ws), nonces_may_grow_by=len(statuses) + 1)
    finally:
        await served.stop()
        fed.ws.close()


# -- 4. bodies of unauthenticated requests are never read -----------------------------------------


async def _answer_to_head(port: int, head: bytes, timeout: float = ANSWER_S) -> RawAnswer:
    """Send only the head of a request whose body never comes; its answer must not
    need the body."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(head)
        await writer.drain()
        try:
            return await asyncio.wait_for(read_answer(reader), timeout)
        except TimeoutError:
            pytest.fail(f"no answer within {timeout} s: the server is waiting for the body")
    finally:
        await close(writer)


async def test_unsigned_upload_is_refused_without_reading_its_body(hostile: Hostile) -> None:
    target = f"/v1/rounds/0/masked-input?attempt=0&{STATEMENT}"
    head = request_head(
        "POST",
        target,
        [("Content-Type", "application/octet-stream")],
        content_length=50_000_000,
    )
    started = time.monotonic()
    detail = await hostile.refused(
        401, "unauthenticated", lambda: _answer_to_head(hostile.port, head)
    )
    assert time.monotonic() - started < ANSWER_S
    assert "signature" in detail.lower()


async def test_a_chunked_body_over_the_limit_that_arrived_whole_is_refused(
    tmp_path: Path,
) -> None:
    # no Content-Length to refuse it by: the head and the whole chunked body come in one
    # write, so the body has arrived (and is not read in pieces) when it is checked
    fed = _federation(tmp_path / "ws", max_json_bytes=2048)
    served = await serve(fed.ws, Coordinator(fed.ws, clock=FakeClock()))
    try:
        hostile = Hostile(fed, served)
        join = "/v1/rounds/1/join?attempt=0"
        for member, size in (("a0", 2048), ("a1", 2049)):
            body = wire.encode(join_request(member)).ljust(size)
            headers = [
                *signed_headers(fed.identities[member], "POST", join, body).items(),
                ("Content-Type", "application/json"),
                ("Transfer-Encoding", "chunked"),
            ]
            request = request_head("POST", join, headers)
            request += f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
            if size == 2048:  # at the limit: read and accepted
                assert (await hostile.send(request)).status == 200
                continue
            detail = await hostile.refused(413, "payload_too_large", request)
            assert "2048" in detail
        assert set(fed.ws.state.joins.samples(1, 0)) == {"a0"}
    finally:
        await served.stop()
        fed.ws.close()


async def test_compressed_bodies_are_refused(hostile: Hostile) -> None:
    join = "/v1/rounds/1/join?attempt=0"
    packed = gzip.compress(_join_body())
    request = hostile.signed("a0", "POST", join, packed, [("Content-Encoding", "gzip")])
    await hostile.refused(415, "unsupported_content_encoding", request, nonces=1)
    target = f"/v1/rounds/1/masked-input?attempt=0&{STATEMENT}"
    packed = gzip.compress(b"\x00" * 10_000)
    request = hostile.signed("a0", "POST", target, packed, [("Content-Encoding", "gzip")])
    await hostile.refused(415, "unsupported_content_encoding", request, nonces=1)
    assert hostile.ws.state.joins.samples(1, 0) == {}


async def test_expect_continue_over_the_limit_or_unsigned_gets_no_continue(
    hostile: Hostile,
) -> None:
    identity = hostile.fed.identities["a0"]
    cases = [
        # signed (the signature covers the headers; the body would follow), over the limits
        (f"/v1/rounds/1/masked-input?attempt=0&{STATEMENT}", MAX_BODY + 1, True, 413),
        ("/v1/rounds/1/join?attempt=0", MAX_JSON + 1, True, 413),
        # unsigned, under the limits
        (f"/v1/rounds/1/masked-input?attempt=0&{STATEMENT}", 1000, False, 401),
        ("/v1/rounds/1/join?attempt=0", 100, False, 401),
    ]
    codes = {413: "payload_too_large", 401: "unauthenticated"}
    for target, length, signed, status in cases:
        headers: list[tuple[str, str]] = [("Expect", "100-continue")]
        if signed:
            headers += list(signed_headers(identity, "POST", target, b"").items())
        head = request_head("POST", target, headers, content_length=length)
        answer = await _answer_to_head(hostile.port, head)
        assert answer.interim == [], f"{target}: sent 100 Continue before refusing"
        assert answer.status == status, answer
        assert answer.error()[0] == codes[status]


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


async def _unsigned_upload(port: int, size: int, chunk: bytes) -> RawAnswer | None:
    """Send an unsigned upload of ``size`` bytes, reading the answer while sending; the
    answer, or None when the server closed before one could be read."""
    target = f"/v1/rounds/1/masked-input?attempt=0&{STATEMENT}"
    head = request_head(
        "POST", target, [("Content-Type", "application/octet-stream")], content_length=size
    )
    reader, writer = await asyncio.open_connection(HOST, port)
    answer_task = asyncio.create_task(read_answer(reader))
    try:
        writer.write(head)
        sent = 0
        with contextlib.suppress(ConnectionError, OSError):
            while sent < size and not answer_task.done():
                writer.write(chunk[: size - sent])
                await writer.drain()
                sent += len(chunk)
        try:
            return await asyncio.wait_for(answer_task, 10.0)
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            return None
    finally:
        answer_task.cancel()
        with contextlib.suppress(BaseException):
            await answer_task
        await close(writer)


@pytest.mark.slow
async def test_concurrent_unsigned_uploads_do_not_grow_memory(hostile: Hostile) -> None:
    n, size, bound = 16, 16 * MiB, 64 * MiB
    chunk = bytes(256 * 1024)
    gc.collect()
    baseline = peak = _rss_bytes()
    stop = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, _rss_bytes())
            await asyncio.sleep(0.005)

    before = durable_state(hostile.ws)
    sampler = asyncio.create_task(sample())
    started = time.monotonic()
    try:
        answers = await asyncio.wait_for(
            asyncio.gather(*(_unsigned_upload(hostile.port, size, chunk) for _ in range(n))), 60.0
        )
    finally:
        stop.set()
        await sampler
    peak = max(peak, _rss_bytes())
    growth = peak - baseline
    statuses = [a.status if a is not None else None for a in answers]
    print(
        f"\n{n} concurrent unsigned {size // MiB} MiB uploads, {time.monotonic() - started:.2f} s:"
        f" server process RSS {baseline / MiB:.1f} -> peak {peak / MiB:.1f} MiB"
        f" (growth {growth / MiB:.1f} MiB, bound {bound // MiB} MiB); answers {statuses}"
    )
    for answer in answers:
        if answer is not None:
            assert answer.status == 401, answer
            assert answer.error()[0] == "unauthenticated"
    assert growth <= bound, f"RSS grew {growth / MiB:.1f} MiB"
    assert_unchanged(before, durable_state(hostile.ws))
    assert (await hostile.send(request_head("GET", "/v1/health"))).status == 200


# -- 5. slow connections --------------------------------------------------------------------------


async def test_dribbled_headers_are_cut_off_after_the_header_timeout(hostile: Hostile) -> None:
    reader, writer = await asyncio.open_connection(HOST, hostile.port)
    started = time.monotonic()
    head = b"GET /v1/health HTTP/1.1\r\nHost: aggregator.test\r\nX-Slow: "

    async def dribble() -> None:
        with contextlib.suppress(ConnectionError, OSError):
            for i in range(40):  # 8 s at most
                writer.write(head[i : i + 1] if i < len(head) else b"a")
                await writer.drain()
                await asyncio.sleep(0.2)

    dribbler = asyncio.create_task(dribble())
    try:
        try:
            got = await asyncio.wait_for(reader.read(65536), ANSWER_S)
        except (ConnectionError, OSError):
            got = b""
        except TimeoutError:
            pytest.fail(f"connection still open {ANSWER_S} s into a dribbled header block")
        elapsed = time.monotonic() - started
    finally:
        dribbler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await dribbler
        await close(writer)
    assert elapsed < ANSWER_S
    if got:  # answered before closing: a 4xx (408), never a 5xx
        status = int(got.split(b" ", 2)[1])
        assert 400 <= status < 500, got[:200]
    # the server still serves
    assert (await hostile.send(request_head("GET", "/v1/health"))).status == 200


# -- 6. traffic counting --------------------------------------------------------------------------


async def test_refused_uploads_are_not_counted_as_round_traffic(tmp_path: Path) -> None:
    members = ("a0", "a1")
    fed = make_federation(
        tmp_path / "ws",
        agents=members,
        observers=("obs",),
        round={"secure_sum": "none", "min_agents": 2, "rounds": 2},
        server=SERVER,
        validation=False,
    )
    served = await serve(fed.ws, Coordinator(fed.ws, clock=FakeClock()))
    ids = fed.identities
    sent: list[int] = []  # whole requests (head and body) that were answered 200

    async def call(who: str, method: str, target: str, body: bytes = b"") -> Any:
        request = signed_request(ids[who], method, target, body)
        answer = await exchange(served.port, request)
        assert answer.status == 200, answer
        sent.append(len(request))
        return answer.json()

    try:
        join = _join_body()
        for m in members:
            await call(m, "POST", "/v1/rounds/1/join?attempt=0", join)
        state = msgspec.convert(await call("a0", "GET", "/v1/round"), wire.RoundState)
        assert state.stage == "masked_input" and state.spec is not None
        uploaded = sum(sent)  # round 1's accepted requests so far, heads included

        before = durable_state(fed.ws)
        for target, length in (
            (f"/v1/rounds/1/masked-input?attempt=0&{STATEMENT}", 50_000_000),
            (f"/v1/rounds/1/masked-input?attempt=0&{STATEMENT}", MAX_BODY),
            ("/v1/rounds/1/join?attempt=0", MAX_JSON - 1),
        ):
            head = request_head("POST", target, [], content_length=length)
            # the answer itself is test_unsigned_upload_is_refused_without_reading_its_body's
            # concern; here only what was counted matters
            with contextlib.suppress(TimeoutError):
                await exchange(served.port, head, timeout=1.0)
        assert_unchanged(before, durable_state(fed.ws))

        for m in members:
            raw, commitment, signature = plain_upload(m, state.spec, ids)
            target = (
                f"/v1/rounds/1/masked-input?attempt=0&commitment={commitment}&signature={signature}"
            )
            await call(m, "POST", target, raw)
            uploaded += sent[-1]
        row = fed.ws.state.rounds.get(1, 0)
        assert row is not None and row.stage == "closed" and row.summary is not None
        summary = msgspec.json.decode(row.summary, type=wire.RoundSummary)
        assert summary.bytes_up == uploaded, (summary.bytes_up, uploaded)
        status = msgspec.convert(await call("obs", "GET", "/v1/status"), wire.FederationStatus)
        (shown,) = [s for s in status.history if (s.round, s.attempt) == (1, 0)]
        assert shown.bytes_up == uploaded
    finally:
        await served.stop()
        fed.ws.close()


# -- 7. refused requests for made-up rounds log nothing -------------------------------------------


async def test_uploads_for_a_made_up_round_write_no_log_entries(hostile: Hostile) -> None:
    target = f"/v1/rounds/777/masked-input?attempt=0&{STATEMENT}"
    before = durable_state(hostile.ws)
    for i in range(50):
        body = i.to_bytes(4, "big") * 16
        answer = await hostile.send(hostile.signed("a0", "POST", target, body))
        assert 400 <= answer.status < 500, answer
        answer.error()
    assert_unchanged(before, durable_state(hostile.ws), nonces_may_grow_by=50)


# -- 8. details never echo client input at length -------------------------------------------------


async def test_huge_header_or_query_values_are_refused_briefly(hostile: Hostile) -> None:
    huge = "A" * 900_000
    for request in (
        request_head("GET", "/v1/round", [("X-Bogus", huge)]),
        request_head("GET", "/v1/round", [("Signature-Input", huge)]),
        request_head("GET", f"/v1/rounds/1/keys?attempt=0&wait={huge}"),
    ):
        before = durable_state(hostile.ws)
        answer = await hostile.send(request)
        assert 400 <= answer.status < 500, answer
        # refused by the HTTP layer (transport.PARSER_REJECTIONS_NOTE) or by a handler
        assert answer.error()[0] in ("bad_request", "bad_http"), answer
        assert len(answer.error()[1]) < 1000, answer
        assert_unchanged(before, durable_state(hostile.ws))


async def test_long_values_within_the_parser_limits_are_not_echoed(hostile: Hostile) -> None:
    long = "A" * 7000
    signed_keys = hostile.signed("a0", "GET", f"/v1/rounds/1/keys?attempt=0&wait={long}")
    requests: list[tuple[bytes, int]] = [
        (signed_keys, 1),
        (request_head("GET", "/v1/round", [("Signature-Input", "fedsec=" + long)]), 0),
        (request_head("GET", "/v1/round", [("Content-Digest", "sha-256=:" + long)]), 0),
        (request_head("GET", f"/v1/rounds/{long}/receipt"), 0),
    ]
    for request, nonces in requests:
        before = durable_state(hostile.ws)
        answer = await hostile.send(request)
        assert 400 <= answer.status < 500, answer
        assert len(answer.error()[1]) < 1000, answer
        assert_unchanged(before, durable_state(hostile.ws), nonces_may_grow_by=nonces)


async def test_long_json_strings_are_not_echoed(hostile: Hostile) -> None:
    join = "/v1/rounds/1/join?attempt=0"
    huge = "x" * 900_000
    doc = json.loads(_join_body())
    bodies = [
        _join_doc(dataset_schema=huge),
        _join_doc(task_version=huge),
        _join_doc(samples=huge),
        json.dumps({**doc, huge: 1}).encode(),
    ]
    for body in bodies:
        assert len(body) < MAX_JSON
        before = durable_state(hostile.ws)
        answer = await hostile.send(hostile.signed("a0", "POST", join, body))
        assert 400 <= answer.status < 500, answer
        assert len(answer.error()[1]) < 1000, answer
        assert_unchanged(before, durable_state(hostile.ws), nonces_may_grow_by=1)


# -- 9. duplicate JSON keys -----------------------------------------------------------------------


async def test_duplicate_json_keys_are_bad_requests(hostile: Hostile) -> None:
    join = "/v1/rounds/1/join?attempt=0"
    good = _join_body()
    twice = good[:-1] + b',"samples":2}'
    assert json.loads(twice)["samples"] == 2  # a lenient parser would take the last
    detail = await hostile.refused(
        400, "bad_request", hostile.signed("a0", "POST", join, twice), nonces=1
    )
    assert "samples" in detail
    doc = json.loads(_report_doc())
    nested = _report_doc()[:-1] + b',"epsilon":0.0}'
    assert json.loads(nested)["epsilon"] != doc["epsilon"]
    report = "/v1/rounds/1/report?attempt=0"
    await hostile.refused(
        400, "bad_request", hostile.signed("a0", "POST", report, nested), nonces=1
    )
    assert hostile.ws.state.joins.samples(1, 0) == {}


# -- 10. status is for members only ---------------------------------------------------------------


async def test_status_needs_a_signature(hostile: Hostile) -> None:
    await hostile.refused(401, "unauthenticated", request_head("GET", "/v1/status"))
    for who in ("a0", "obs", "aud"):
        status = msgspec.convert(await hostile.ok(who, "GET", "/v1/status"), wire.FederationStatus)
        assert status.federation_id == FED and status.stage == "open"


# -- 11. clients that give up mid-body ------------------------------------------------------------


async def _partial(port: int, request: bytes, keep: int, *, half_close: bool) -> RawAnswer | None:
    """Send the first ``keep`` bytes of ``request``, then half-close (and read what the
    server answers) or abort the connection."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(request[:keep])
        await writer.drain()
        if not half_close:
            writer.transport.abort()
            return None
        writer.write_eof()
        try:
            return await asyncio.wait_for(read_answer(reader), 5.0)
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            return None
    finally:
        await close(writer)


async def test_clients_closing_mid_body_get_no_server_error(hostile: Hostile) -> None:
    join = hostile.signed("a0", "POST", "/v1/rounds/1/join?attempt=0", _join_body())
    upload_target = f"/v1/rounds/1/masked-input?attempt=0&{STATEMENT}"
    upload = hostile.signed("a0", "POST", upload_target, bytes(200_000))
    unsigned = request_head("POST", upload_target, [], content_length=1_000_000) + bytes(100_000)
    before = durable_state(hostile.ws)
    for request in (join, upload, unsigned):
        for half_close in (True, False):
            keep = len(request) - 10 if request is join else len(request) // 2
            answer = await _partial(hostile.port, request, keep, half_close=half_close)
            if answer is not None:
                assert 400 <= answer.status < 500, answer
                answer.error()
    assert_unchanged(before, durable_state(hostile.ws))
    assert hostile.ws.state.joins.samples(1, 0) == {}
    # and the server keeps serving
    assert (await hostile.send(request_head("GET", "/v1/health"))).status == 200
    assert (await hostile.call("a1", "GET", "/v1/round")).status == 200


async def test_durable_state_covers_every_table(tmp_path: Path) -> None:
    """The state check itself: every state table and the log file are in it."""
    fed = _federation(tmp_path / "ws")
    Coordinator(fed.ws, clock=FakeClock())
    state: DurableState = durable_state(fed.ws)
    assert {"rounds", "joins", "messages", "log", "server_state"} <= set(state.counts)
    assert state.log_lines == state.counts["log"] > 0
    fed.ws.close()


# -- 12. strictness: one value per query parameter, verdicts that agree with themselves ----------


async def test_a_query_parameter_given_twice_on_a_signed_route_is_refused(api: Api) -> None:
    """The signature covers the whole target, so ``?attempt=1&attempt=0`` is signed; a
    reader taking the first value and another taking the last would act on different
    attempts.  Refused before the body is read or the nonce is spent, naming it."""
    body = wire.encode(join_request("a0"))
    twice = [
        ("POST", "/v1/rounds/1/join?attempt=0&attempt=1", body),
        ("GET", "/v1/rounds/1/keys?attempt=0&wait=0&wait=5", b""),
        ("GET", "/v1/round?wait=0&timeout=0&wait=1", b""),
        ("GET", "/v1/audit/log?from=0&from=5", b""),
        ("GET", "/v1/rounds/1/keys?unknown=1&unknown=2", b""),
    ]
    for method, target, payload in twice:
        who = "aud" if target.startswith("/v1/audit") else "a0"
        detail = await api.refused(
            400, "bad_request", lambda m=method, t=target, p=payload, w=who: api.call(w, m, t, p)
        )
        name = target.split("&")[-1].split("=")[0]
        assert f"query parameter {name!r}" in detail and "more than once" in detail, detail
    assert api.fed.ws.state.joins.samples(1, 0) == {}
    await api.ok("a0", "POST", "/v1/rounds/1/join?attempt=0", body)  # one value: accepted


async def test_a_passed_verdict_listing_failed_checks_is_refused(api: Api) -> None:
    """``passed: true`` with ``failed: ["magnitude"]`` says two things; the dashboard and
    the quarantine rules would read it as passed.  Refused as a whole submission."""
    cohort = await _to_masked_input(api)
    path, raw = _upload(cohort, "a0")
    await api.ok("a0", "POST", path, raw)
    contradictory = {"round": 1, "attempt": 0, "member": "a0", "passed": True}
    bodies = [
        {"verdicts": [{**contradictory, "failed": ["magnitude"]}]},
        {
            "verdicts": [
                {**contradictory, "passed": False, "failed": ["norm_bound"]},
                {**contradictory, "failed": ["magnitude"]},
            ]
        },
    ]
    for doc in bodies:
        body = json.dumps(doc).encode()
        detail = await api.refused(
            400, "bad_request", lambda b=body: api.call("aud", "POST", "/v1/audit/verdicts", b)
        )
        assert "passed" in detail and "magnitude" in detail, detail
    assert api.fed.ws.state.verdicts.count() == 0
    honest = {"verdicts": [{**contradictory, "passed": False, "failed": ["magnitude"]}]}
    receipt = await api.ok("aud", "POST", "/v1/audit/verdicts", json.dumps(honest).encode())
    assert receipt["stored"] == 1


# -- 13. non-finite numbers in the compact encoding (issue 32 item 6) ------------------------------


async def _at_share_keys(api: Api) -> tuple[Cohort, wire.KeyListBody]:
    """The cohort fixed and advertised: a0's key list, to address its shares."""
    cohort = await _fix_cohort(api)
    for m in AGENTS:
        await api.ok(m, "POST", "/v1/rounds/1/advertise", cohort.advertise(m))
    await api.wait_stage("share_keys")
    keys = msgspec.convert(await api.ok("a0", "GET", "/v1/rounds/1/keys"), wire.KeyListBody)
    return cohort, keys


NON_FINITE_REPORTS = (
    {"delta": math.nan, "noise_multiplier": math.inf, "sample_rate": math.nan},
    {"epsilon_budget": math.inf},
    {"epsilon": -math.inf},
    {"extra_epsilon": math.nan},
)


@pytest.mark.parametrize("changes", NON_FINITE_REPORTS, ids=lambda c: ",".join(c))
async def test_a_compact_report_with_non_finite_numbers_is_refused(
    api: Api, changes: dict[str, float]
) -> None:
    """msgpack carries NaN and ±inf, which JSON cannot: a member's shares, compact, with
    its privacy report signed over those values is refused before anything is stored or
    logged, with a sentence naming the field."""
    cohort, keys = await _at_share_keys(api)
    path = "/v1/rounds/1/shares"
    shares = cohort.share_keys("a0", keys)
    report = privacy_report("a0", **changes).sign(api.fed.identities["a0"])
    raw = compact.encode(msgspec.structs.replace(shares, report=report))

    def send() -> Awaitable[tuple[int, bytes, str]]:
        headers = api.headers("a0", "POST", path, raw)
        headers["Content-Type"] = compact.MEDIA_TYPE
        return api.send("POST", path, raw, headers)

    logged = log_entries(api.fed.ws)
    detail = await api.refused(400, "bad_request", send)
    # NaN fails a field's range (msgspec names it); an infinity in range is not finite
    assert f".{next(iter(changes))}`" in detail, detail
    assert log_entries(api.fed.ws) == logged
    assert api.fed.ws.state.reports.get(1, 0, "a0") is None
    # the same member's honest shares and report still go through
    honest = msgspec.structs.replace(
        shares, report=privacy_report("a0").sign(api.fed.identities["a0"])
    )
    await api.ok("a0", "POST", path, honest)
