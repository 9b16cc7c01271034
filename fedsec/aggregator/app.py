"""The aggregator's HTTP API (aiohttp): authentication, limits, errors, long-polling.

Handlers only move bytes: they authenticate the request (RFC 9421 signature,
roster role), decode the body with its size limit, call the coordinator and
encode the answer.  Errors the user caused are ``FedsecError`` and become 4xx
``{"error", "detail"}``; anything else is our bug: logged, answered 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
import msgspec
from aiohttp import web

from fedsec.aggregator.challenges import ChallengeDesk
from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.openapi import openapi_document
from fedsec.aggregator.ratelimit import MemberRateLimit
from fedsec.aggregator.replay import NONCE_DB, PersistentNonceStore
from fedsec.aggregator.transport import CLIENT_FAULTS
from fedsec.aggregator.workspace import Workspace
from fedsec.crypto.httpsig import RequestVerifier, SignedHeaders
from fedsec.errors import (
    AuthError,
    FedsecError,
    ForbiddenError,
    PayloadError,
    PayloadTooLarge,
    RequestTimeout,
    RetryLater,
    ServerBusy,
    UnsupportedEncoding,
)
from fedsec.protocol import wire
from fedsec.protocol.endpoints import BY_NAME, ENDPOINTS, Endpoint
from fedsec.protocol.limits import LONG_POLL_S, MAX_COUNT

log = logging.getLogger(__name__)

# Deadlines are seconds long; checking 20 times a second closes a stage within 50 ms.
TICK_S = 0.05
# Roster changes made by the CLI while serving are picked up within a second.
ROSTER_RELOAD_S = 1.0
# An error detail quotes client input; past this many characters it is cut, so a
# client cannot make the answer or the log echo a megabyte back.
MAX_DETAIL_CHARS = 400
# Refusals are logged at INFO, at most this many a second (the rest are counted), so a
# client sending garbage at full speed cannot flood the operator's log.
REFUSAL_LOG_PER_S = 20

_WAIT_RE = re.compile(r"[0-9]{1,12}(\.[0-9]{1,6})?")

T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

COORDINATOR = web.AppKey("coordinator", Coordinator)
CHALLENGES = web.AppKey("challenges", ChallengeDesk)
WORKSPACE = web.AppKey("workspace", Workspace)
VERIFIER = web.AppKey("verifier", RequestVerifier)
NONCES = web.AppKey("nonces", PersistentNonceStore)
RATE = web.AppKey("rate", MemberRateLimit)
UPLOADS = web.AppKey("uploads", asyncio.Semaphore)
# Set on a request once its signature, role and body are verified: only then are its
# bytes counted in a round's summary.
_MEMBER = web.RequestKey("member", tuple)
# Set once the body has been read to its end: a refusal before that closes the
# connection, so the server never reads (or lingers on) an unauthenticated body.
_BODY_READ = web.RequestKey("body_read", bool)
_SIGNED = web.RequestKey("signed", SignedHeaders)


class _ChangeSignal:
    """Wakes long-polling requests when the coordinator's token changes."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        #: Requests held right now, waiting for a change (tests wait on it instead of
        #: sleeping to know that a request is held).
        self.waiting = 0

    def fire(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout: float) -> None:
        self.waiting += 1
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event.wait(), timeout)
        finally:
            self.waiting -= 1


CHANGED = web.AppKey("changed", _ChangeSignal)


def _json(value: Any, status: int = 200) -> web.Response:
    return web.Response(body=wire.encode(value), status=status, content_type="application/json")


@web.middleware
async def traffic_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Count the response bytes of authenticated requests per round attempt (the
    demo's bytes up/down columns); request bytes are counted on arrival, once
    authenticated (:func:`_authenticate`)."""
    response = await handler(request)
    key = request.get(_MEMBER)
    body = response.body if isinstance(response, web.Response) else None
    if key is not None and isinstance(body, bytes | bytearray):
        request.app[COORDINATOR].count_traffic(key, 0, len(body))
    return response


class _RefusalLog:
    """INFO lines for refused requests, at most ``per_s`` a second; the rest are counted
    and the count is reported with the next line that gets through."""

    def __init__(self, per_s: int) -> None:
        self._per_s = per_s
        self._second = 0
        self._lines = 0
        self._suppressed = 0

    def refused(self, request: web.Request, code: str, status: int, detail: str) -> None:
        second = int(time.monotonic())
        if second != self._second:
            self._second, self._lines = second, 0
        if self._lines >= self._per_s:
            self._suppressed += 1
            return
        self._lines += 1
        suppressed, self._suppressed = self._suppressed, 0
        log.info(
            "event=refused method=%s path=%s code=%s status=%d detail=%r suppressed=%d",
            request.method,
            _quote(request.path, 120),
            code,
            status,
            _quote(detail, 200),
            suppressed,
        )


_REFUSALS = _RefusalLog(REFUSAL_LOG_PER_S)


def _quote(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters cut)"


def _error(request: web.Request, code: str, status: int, detail: str) -> web.Response:
    _REFUSALS.refused(request, code, status, detail)
    response = _json(wire.ErrorBody(error=code, detail=_quote(detail)), status)
    if not request.get(_BODY_READ) and (request.content_length or request.body_exists):
        # the body was not read (refused before authentication, or too large): close
        # rather than read and discard it to keep the connection
        response.force_close()
    return response


# A client that goes away or breaks framing mid-body is its own mistake, not our bug.
_CLIENT_GONE = (*CLIENT_FAULTS, ConnectionError, EOFError)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except RetryLater as exc:
        response = _error(request, exc.code, exc.http_status, exc.detail)
        response.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
        return response
    except FedsecError as exc:
        return _error(request, exc.code, exc.http_status, exc.detail)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(request, exc.reason.lower().replace(" ", "_"), exc.status, exc.reason)
    except _CLIENT_GONE as exc:
        return _error(request, "incomplete_body", 400, f"the request body did not arrive: {exc}")
    except Exception:
        log.exception("event=internal_error method=%s path=%s", request.method, request.path)
        return _json(
            wire.ErrorBody(error="internal_error", detail="the aggregator hit a bug; see its log"),
            500,
        )


def _check_framing(request: web.Request, limit: int) -> None:
    """What the request line and headers say about the body, before any of it is read.

    Raises:
        UnsupportedEncoding: a ``Content-Encoding`` other than identity (aiohttp would
            inflate it, so a small body could expand hundreds of times).
        PayloadTooLarge: a declared length over ``limit``.
    """
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding != "identity":
        raise UnsupportedEncoding(
            f"Content-Encoding {_quote(encoding, 32)!r} is refused: fedsec bodies are sent "
            "uncompressed (signed vectors and models do not compress)"
        )
    declared = request.content_length
    if declared is not None and declared > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {limit}")


async def _read_body(request: web.Request, limit: int) -> bytes:
    """The body, at most ``limit`` bytes, within ``server.body_timeout_s``.

    Raises:
        PayloadTooLarge: more than ``limit`` bytes arrive.
        RequestTimeout: the body did not arrive in time.
    """
    cfg = request.app[WORKSPACE].config.server
    # StreamReader.read(n) returns what has arrived so far (up to n), not n bytes: a body
    # that comes in several pieces (slow link, chunked encoding) must be read in a loop.
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(cfg.body_timeout_s):
            while chunk := await request.content.read(limit + 1 - size):
                chunks.append(chunk)
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
    except TimeoutError:
        raise RequestTimeout(
            f"the request body did not arrive within {cfg.body_timeout_s:g} s "
            f"({size} bytes received)"
        ) from None
    request[_BODY_READ] = True
    return b"".join(chunks)


@contextlib.asynccontextmanager
async def _upload_slot(request: web.Request, limit: int) -> AsyncIterator[None]:
    """Hold one of ``server.max_concurrent_uploads`` slots while a body that may be
    larger than a JSON control message is read, bounding bodies in memory.

    Raises:
        ServerBusy: no slot freed within ``server.upload_queue_s``.
    """
    cfg = request.app[WORKSPACE].config.server
    declared = request.content_length
    if limit <= cfg.max_json_bytes or (declared is not None and declared <= cfg.max_json_bytes):
        yield
        return
    slots = request.app[UPLOADS]
    try:
        async with asyncio.timeout(cfg.upload_queue_s):
            await slots.acquire()
    except TimeoutError:
        raise ServerBusy(
            f"all {cfg.max_concurrent_uploads} upload slots stayed busy for "
            f"{cfg.upload_queue_s:g} s; retry shortly",
            retry_after=cfg.upload_queue_s / 4,
        ) from None
    try:
        yield
    finally:
        slots.release()


def _authorised(request: web.Request, roles: tuple[str, ...]) -> tuple[str, str]:
    """Framing, signature over the headers, roster role and rate: (agent id, key id).

    Raises:
        PayloadError, AuthError, ReplayError: see :meth:`RequestVerifier.verify_headers`.
        ForbiddenError: the key's role is not one of ``roles``.
        RateLimited: the key is over its request rate.
    """
    signed = request.app[VERIFIER].verify_headers(request.method, request.raw_path, request.headers)
    entry = request.app[WORKSPACE].roster.by_key_id(signed.keyid)
    if entry is None or not entry.is_active:
        raise AuthError(f"key {signed.keyid} is unknown or revoked")
    if entry.role not in roles:
        raise ForbiddenError(
            f"{entry.agent_id} has role {entry.role}; this needs {' or '.join(roles)}"
        )
    request.app[RATE].charge(signed.keyid, time.monotonic())
    request[_SIGNED] = signed
    return entry.agent_id, signed.keyid


def _endpoint(request: web.Request) -> Endpoint:
    """The endpoint-table entry of the route ``request`` matched."""
    return _ENDPOINT_OF[request.match_info.handler]


def _body_limit(request: web.Request, endpoint: Endpoint) -> int:
    """The configured limit the endpoint's ``body_limit`` names, in bytes."""
    cfg = request.app[WORKSPACE].config.server
    return cfg.max_body_bytes if endpoint.body_limit == "binary" else cfg.max_json_bytes


async def _authenticate(request: web.Request) -> tuple[str, bytes]:
    """Authenticate the request; return (agent id, body).

    The roles allowed and the body limit are the matched endpoint's (the table in
    :mod:`fedsec.protocol.endpoints`).  Everything that needs no body is checked
    before a byte of it is read: framing, signature headers, key, roster role,
    created time, nonce and the member's rate.  Only then is the body read (bounded
    in size, time and concurrency), checked against the signed digest, and the nonce
    recorded.
    """
    endpoint = _endpoint(request)
    limit = _body_limit(request, endpoint)
    _check_framing(request, limit)
    member, _keyid = _authorised(request, endpoint.roles)
    async with _upload_slot(request, limit):
        body = await _read_body(request, limit)
    request.app[VERIFIER].verify_body(request[_SIGNED], body)
    coord = request.app[COORDINATOR]
    key = coord.current_attempt()
    request[_MEMBER] = key
    # counted on arrival: a held answer (e.g. the unmask answer, held until the round
    # is over) must not leave its upload out of the round's summary
    coord.count_traffic(key, len(body), 0)
    return member, body


async def _expect(request: web.Request) -> web.StreamResponse | None:
    """``Expect: 100-continue``: answer 100 only to a request that would be read; a
    refusal (size, encoding, signature, role) goes out before the client sends the body."""
    if request.headers.get("Expect", "").lower() != "100-continue":
        return _error(request, "expectation_failed", 417, "only Expect: 100-continue is known")
    try:
        _check_framing(request, _body_limit(request, _endpoint(request)))
        request.app[VERIFIER].verify_headers(request.method, request.raw_path, request.headers)
    except FedsecError as exc:
        return _error(request, exc.code, exc.http_status, exc.detail)
    if request.version >= aiohttp.HttpVersion11:
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0
    return None


def _round_args(request: web.Request) -> tuple[int, int]:
    round_ = wire.parse_uint(request.match_info["round"], "round")
    attempt = wire.parse_uint(request.query.get("attempt", "0"), "attempt")
    return round_, attempt


def _wait_seconds(request: web.Request) -> float:
    """The ``wait`` query parameter of a stage-data request: seconds to hold the answer
    until the round reaches that stage (0, the default, answers at once)."""
    return _seconds(request.query.get("wait", "0"), "wait")


def _seconds(raw: str, what: str) -> float:
    """A query parameter in seconds, capped at :data:`LONG_POLL_S`.

    Raises:
        PayloadError: not a plain non-negative decimal.
    """
    # plain decimal only: float() would also take "nan", "inf", "1e999", "1_0" and " 5"
    if not _WAIT_RE.fullmatch(raw):
        raise PayloadError(
            f"{what} must be a non-negative number of seconds like 5 or 2.5, "
            f"got {_quote(raw, 32)!r}"
        )
    return min(float(raw), LONG_POLL_S)


async def _hold_while(request: web.Request, pending: Callable[[], bool], wait: float) -> None:
    """Hold the request, at most ``wait`` seconds, while ``pending()`` (re-checked each
    time the round state changes)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    while pending():
        left = deadline - loop.time()
        if left <= 0:
            return
        await request.app[CHANGED].wait(left)


async def _hold_until(
    request: web.Request, round_: int, attempt: int, stage: str, wait: float
) -> bool:
    """Hold the request, at most ``wait`` seconds, while the attempt is still in
    progress before ``stage``; True when it has reached (or passed) ``stage``."""
    coord = request.app[COORDINATOR]
    await _hold_while(request, lambda: coord.before_stage(round_, attempt, stage), wait)
    return coord.has_reached(round_, attempt, stage)


def _decode(raw: bytes, kind: type[T], request: web.Request, what: str) -> T:
    ws = request.app[WORKSPACE]
    return wire.decode(raw, kind, max_bytes=ws.config.server.max_json_bytes, what=what)


# -- public endpoints --------------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


async def openapi(request: web.Request) -> web.Response:
    return _json(openapi_document())


async def status(request: web.Request) -> web.Response:
    # alerts and round history are the consortium's, not the public's: any enrolled role
    await _authenticate(request)
    coord = request.app[COORDINATOR]
    ws = request.app[WORKSPACE]
    now = coord.round_state()
    history = [
        msgspec.json.decode(r.summary, type=wire.RoundSummary)
        for r in ws.state.rounds(200)
        if r.summary is not None
    ]
    return _json(
        wire.FederationStatus(
            federation_id=ws.federation_id,
            round=now.round,
            attempt=now.attempt,
            stage=now.stage,
            model_version=now.model_version,
            rounds_completed=now.rounds_completed,
            rounds_target=now.rounds_target,
            finished=now.finished,
            agents_active=len(ws.roster.active_agents()),
            history=history,
            alerts=coord.alerts[-50:],
        )
    )


# -- agent endpoints ---------------------------------------------------------------------------


async def get_round(request: web.Request) -> web.Response:
    await _authenticate(request)
    coord = request.app[COORDINATOR]
    wait = wire.parse_uint(request.query.get("wait", "0"), "wait token", MAX_COUNT)
    timeout = _seconds(request.query.get("timeout", "0"), "timeout")
    if wait and wait == coord.token and timeout > 0:
        await request.app[CHANGED].wait(timeout)
    return _json(coord.round_state())


async def get_roster(request: web.Request) -> web.Response:
    await _authenticate(request)
    ws = request.app[WORKSPACE]
    return _json(
        {
            "federation_id": ws.federation_id,
            "admin_public_key": ws.admin_public.hex(),
            "entries": [e.to_dict() for e in ws.roster.entries()],
        }
    )


async def join(request: web.Request) -> web.Response:
    member, body = await _authenticate(request)
    r, a = _round_args(request)
    req = _decode(body, wire.JoinRequest, request, "join request")
    return _json(request.app[COORDINATOR].join(member, r, a, req))


async def report(request: web.Request) -> web.Response:
    member, body = await _authenticate(request)
    r, a = _round_args(request)
    rep = _decode(body, wire.PrivacyReport, request, "privacy report")
    request.app[COORDINATOR].report(member, r, a, rep)
    return _json({"accepted": True})


async def _next_stage_data(
    request: web.Request, r: int, a: int, stage: str, wait: float, fetch: Callable[[], T]
) -> T | None:
    """After an accepted upload with ``?wait``: the next stage's data for the caller once
    the round reaches it, or None (no wait asked, not reached in time, attempt over, or
    the caller is not in it; the agent then falls back to polling)."""
    if wait <= 0 or not await _hold_until(request, r, a, stage, wait):
        return None
    try:
        return fetch()
    except FedsecError:
        return None


async def advertise(request: web.Request) -> web.Response:
    member, body = await _authenticate(request)
    r, a = _round_args(request)
    msg = _decode(body, wire.AdvertiseKeysBody, request, "key advertisement")
    wait = _wait_seconds(request)  # checked before anything is accepted
    coord = request.app[COORDINATOR]
    coord.advertise(member, r, a, msg)
    keys = await _next_stage_data(
        request, r, a, "share_keys", wait, lambda: coord.key_list(member, r, a)
    )
    return _json(wire.Accepted(accepted=True, keys=keys))


async def keys(request: web.Request) -> web.Response:
    member, _ = await _authenticate(request)
    r, a = _round_args(request)
    await _hold_until(request, r, a, "share_keys", _wait_seconds(request))
    return _json(request.app[COORDINATOR].key_list(member, r, a))


async def post_shares(request: web.Request) -> web.Response:
    member, body = await _authenticate(request)
    r, a = _round_args(request)
    msg = _decode(body, wire.ShareKeysBody, request, "encrypted shares")
    wait = _wait_seconds(request)  # checked before anything is accepted
    coord = request.app[COORDINATOR]
    coord.share_keys(member, r, a, msg)
    relay = await _next_stage_data(
        request, r, a, "masked_input", wait, lambda: coord.share_relay(member, r, a)
    )
    return _json(wire.Accepted(accepted=True, relay=relay))


async def get_shares(request: web.Request) -> web.Response:
    member, _ = await _authenticate(request)
    r, a = _round_args(request)
    await _hold_until(request, r, a, "masked_input", _wait_seconds(request))
    return _json(request.app[COORDINATOR].share_relay(member, r, a))


async def masked_input(request: web.Request) -> web.Response:
    member, body = await _authenticate(request)
    r, a = _round_args(request)
    commitment = request.query.get("commitment", "")
    signature = request.query.get("signature", "")
    if not commitment or not signature:
        raise PayloadError(
            "masked input needs the commitment and signature query parameters "
            "(the member's signed contribution statement)"
        )
    wait = _wait_seconds(request)  # checked before anything is accepted
    coord = request.app[COORDINATOR]
    receipt = coord.masked_input(member, r, a, body, commitment, signature)
    if "wait" not in request.query:
        return _json(receipt)
    # a plain round has no unmask stage to hold for (another attempt is never held)
    held = wait if coord.has_stage("unmask") else 0.0
    unmask = await _next_stage_data(
        request, r, a, "unmask", held, lambda: coord.unmask_request(member, r, a)
    )
    return _json(wire.MaskedInputAnswer(receipt=receipt, unmask=unmask))


async def get_unmask(request: web.Request) -> web.Response:
    member, _ = await _authenticate(request)
    r, a = _round_args(request)
    await _hold_until(request, r, a, "unmask", _wait_seconds(request))
    return _json(request.app[COORDINATOR].unmask_request(member, r, a))


async def post_unmask(request: web.Request) -> web.Response:
    member, body = await _authenticate(request)
    r, a = _round_args(request)
    msg = _decode(body, wire.UnmaskResponseBody, request, "unmask answer")
    wait = _wait_seconds(request)  # checked before anything is accepted
    coord = request.app[COORDINATOR]
    coord.unmask(member, r, a, msg)
    if wait <= 0:
        return _json(wire.Accepted(accepted=True))

    def unmasking() -> bool:
        return coord.in_stage(r, a, "unmask")

    # held until the attempt is over: the answer then carries the state the agent
    # would otherwise long-poll for next (closed, usually the next round already open)
    await _hold_while(request, unmasking, wait)
    return _json(wire.Accepted(accepted=True, state=None if unmasking() else coord.round_state()))


async def receipt(request: web.Request) -> web.Response:
    member, _ = await _authenticate(request)
    r, _a = _round_args(request)
    return _json(request.app[COORDINATOR].receipt(member, r))


# -- audit challenges and reveals ----------------------------------------------------------------


async def post_challenge(request: web.Request) -> web.Response:
    auditor, body = await _authenticate(request)
    req = _decode(body, wire.ChallengeRequest, request, "challenge")
    return _json(request.app[CHALLENGES].challenge(auditor, req))


async def get_challenges(request: web.Request) -> web.Response:
    member, _ = await _authenticate(request)
    return _json(request.app[CHALLENGES].open_for(member))


async def post_reveal(request: web.Request) -> web.Response:
    ws = request.app[WORKSPACE]
    member, body = await _authenticate(request)
    reveal = wire.decode(
        body, wire.RevealBody, max_bytes=ws.config.server.max_body_bytes, what="reveal"
    )
    return _json(request.app[CHALLENGES].reveal(member, reveal))


async def get_reveals(request: web.Request) -> web.Response:
    auditor, _ = await _authenticate(request)
    return _json(request.app[CHALLENGES].reveals_for(auditor))


def _version(request: web.Request) -> int:
    return wire.parse_uint(request.match_info["version"], "model version")


async def latest_manifest(request: web.Request) -> web.Response:
    await _authenticate(request)
    return web.Response(
        body=request.app[WORKSPACE].models.latest().to_json(), content_type="application/json"
    )


async def manifest(request: web.Request) -> web.Response:
    await _authenticate(request)
    m = request.app[WORKSPACE].models.get(_version(request))
    return web.Response(body=m.to_json(), content_type="application/json")


async def model(request: web.Request) -> web.Response:
    await _authenticate(request)
    data = request.app[WORKSPACE].models.read(_version(request))
    return web.Response(body=data, content_type="application/octet-stream")


# -- application -------------------------------------------------------------------------------


async def _ticker(app: web.Application) -> AsyncIterator[None]:
    coord = app[COORDINATOR]
    ws = app[WORKSPACE]
    signal = app[CHANGED]
    coord.on_change = signal.fire

    async def run() -> None:
        last_reload = 0.0
        while True:
            try:
                now = time.monotonic()
                if now - last_reload >= ROSTER_RELOAD_S:
                    if ws.roster.reload_if_changed():
                        signal.fire()
                    last_reload = now
                coord.tick()
            except Exception:
                log.exception("event=tick_failed")
            await asyncio.sleep(TICK_S)

    task = asyncio.create_task(run())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _replay_store(app: web.Application) -> AsyncIterator[None]:
    yield
    app[NONCES].close()


def make_app(workspace: Workspace, coordinator: Coordinator | None = None) -> web.Application:
    """Build the aiohttp application for ``workspace``.

    Raises:
        sqlite3.Error: the workspace's replay store cannot be opened.
    """
    cfg = workspace.config.server
    app = web.Application(
        middlewares=[traffic_middleware, error_middleware], client_max_size=cfg.max_body_bytes
    )
    app[WORKSPACE] = workspace
    app[COORDINATOR] = coordinator or Coordinator(workspace)
    app[CHALLENGES] = ChallengeDesk(workspace, app[COORDINATOR].trail)
    app[CHANGED] = _ChangeSignal()
    app[RATE] = MemberRateLimit(cfg.member_rate_per_s, cfg.member_burst)
    app[UPLOADS] = asyncio.Semaphore(cfg.max_concurrent_uploads)

    def resolve(key_id: str) -> bytes | None:
        entry = workspace.roster.by_key_id(key_id)
        return entry.public_key_bytes if entry is not None and entry.is_active else None

    # nonces are kept for twice the skew window so a request is never accepted after its
    # nonce has been forgotten, and on disk so a restart forgets none of them
    app[NONCES] = PersistentNonceStore(workspace.root / NONCE_DB, 2 * cfg.clock_skew_s)
    app[VERIFIER] = RequestVerifier(resolve, app[NONCES], max_skew_s=cfg.clock_skew_s)
    for endpoint in ENDPOINTS:
        app.router.add_route(
            endpoint.method, endpoint.template, _HANDLERS[endpoint.name], expect_handler=_expect
        )
    app.cleanup_ctx.append(_replay_store)
    app.cleanup_ctx.append(_ticker)
    return app


# The handler of each endpoint in fedsec.protocol.endpoints.ENDPOINTS, by its name; the
# routes, their roles and body limits come from that table.
_HANDLERS: dict[str, Handler] = {
    "health": health,
    "openapi": openapi,
    "status": status,
    "get_round": get_round,
    "get_roster": get_roster,
    "latest_manifest": latest_manifest,
    "manifest": manifest,
    "model": model,
    "join": join,
    "report": report,
    "advertise": advertise,
    "keys": keys,
    "post_shares": post_shares,
    "get_shares": get_shares,
    "masked_input": masked_input,
    "get_unmask": get_unmask,
    "post_unmask": post_unmask,
    "receipt": receipt,
    "post_challenge": post_challenge,
    "get_challenges": get_challenges,
    "post_reveal": post_reveal,
    "get_reveals": get_reveals,
}
_ENDPOINT_OF: dict[Handler, Endpoint] = {
    handler: BY_NAME[name] for name, handler in _HANDLERS.items()
}
