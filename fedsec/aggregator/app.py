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
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from fedsec import wire
from fedsec.aggregator.challenges import ChallengeDesk
from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.openapi import openapi_document
from fedsec.aggregator.workspace import Workspace
from fedsec.crypto.httpsig import NonceCache, RequestVerifier
from fedsec.errors import (
    AuthError,
    FedsecError,
    ForbiddenError,
    PayloadError,
    PayloadTooLarge,
)

log = logging.getLogger(__name__)

# Agents long-poll GET /round; 25 s stays under common proxy idle timeouts (30-60 s).
MAX_LONG_POLL_S = 25.0
# Deadlines are seconds long; checking 20 times a second closes a stage within 50 ms.
TICK_S = 0.05
# Roster changes made by the CLI while serving are picked up within a second.
ROSTER_RELOAD_S = 1.0
# Nonces are kept for twice the skew window so a request is never accepted after its
# nonce has been forgotten.
NONCE_CACHE_ENTRIES = 200_000

_WAIT_RE = re.compile(r"[0-9]{1,12}(\.[0-9]{1,6})?")

T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

COORDINATOR = web.AppKey("coordinator", Coordinator)
CHALLENGES = web.AppKey("challenges", ChallengeDesk)
WORKSPACE = web.AppKey("workspace", Workspace)
VERIFIER = web.AppKey("verifier", RequestVerifier)


class _ChangeSignal:
    """Wakes long-polling requests when the coordinator's token changes."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout)


CHANGED = web.AppKey("changed", _ChangeSignal)


def _json(value: Any, status: int = 200) -> web.Response:
    return web.Response(body=wire.encode(value), status=status, content_type="application/json")


@web.middleware
async def traffic_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Count body bytes per round attempt (the demo's bytes up/down columns)."""
    coord = request.app[COORDINATOR]
    key = (coord.live.round, coord.live.attempt)
    counted = request.path.startswith(f"{wire.API_PREFIX}/rounds/") or request.path.startswith(
        f"{wire.API_PREFIX}/models/"
    )
    if counted:
        # counted on arrival: a held answer (e.g. the unmask answer, held until the round
        # is over) must not leave its upload out of the round's summary
        coord.count_traffic(key, request.content_length or 0, 0)
    response = await handler(request)
    body = response.body if isinstance(response, web.Response) else None
    if counted and isinstance(body, bytes | bytearray):
        coord.count_traffic(key, 0, len(body))
    return response


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except FedsecError as exc:
        log.info(
            "event=refused method=%s path=%s code=%s status=%d detail=%r",
            request.method,
            request.path,
            exc.code,
            exc.http_status,
            exc.detail,
        )
        return _json(wire.ErrorBody(error=exc.code, detail=exc.detail), exc.http_status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        body = wire.ErrorBody(error=exc.reason.lower().replace(" ", "_"), detail=exc.reason)
        return _json(body, exc.status)
    except Exception:
        log.exception("event=internal_error method=%s path=%s", request.method, request.path)
        return _json(
            wire.ErrorBody(error="internal_error", detail="the aggregator hit a bug; see its log"),
            500,
        )


async def _read_body(request: web.Request, limit: int) -> bytes:
    """The body, refusing before reading it when the declared length is over ``limit``."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {limit}")
    # StreamReader.read(n) returns what has arrived so far (up to n), not n bytes: a body
    # that comes in several pieces (slow link, chunked encoding) must be read in a loop.
    chunks: list[bytes] = []
    size = 0
    while chunk := await request.content.read(limit + 1 - size):
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
    return b"".join(chunks)


async def _authenticate(
    request: web.Request, limit: int, roles: tuple[str, ...]
) -> tuple[str, bytes]:
    """Verify the request signature; return (agent id, body)."""
    body = await _read_body(request, limit)
    ws = request.app[WORKSPACE]
    key_id = request.app[VERIFIER].verify(request.method, request.raw_path, request.headers, body)
    entry = ws.roster.by_key_id(key_id)
    if entry is None or not entry.is_active:
        raise AuthError(f"key {key_id} is unknown or revoked")
    if entry.role not in roles:
        raise ForbiddenError(
            f"{entry.agent_id} has role {entry.role}; this needs {' or '.join(roles)}"
        )
    return entry.agent_id, body


def _round_args(request: web.Request) -> tuple[int, int]:
    try:
        round_ = int(request.match_info["round"])
        attempt = int(request.query.get("attempt", "0"))
    except ValueError:
        raise PayloadError("round and attempt must be integers") from None
    return round_, attempt


def _wait_seconds(request: web.Request) -> float:
    """The ``wait`` query parameter of a stage-data request: seconds to hold the answer
    until the round reaches that stage (0, the default, answers at once)."""
    raw = request.query.get("wait", "0")
    # plain decimal only: float() would also take "nan", "inf", "1e999", "1_0" and " 5"
    if not _WAIT_RE.fullmatch(raw):
        raise PayloadError(
            f"wait must be a non-negative number of seconds like 5 or 2.5, got {raw[:32]!r}"
        )
    return min(float(raw), MAX_LONG_POLL_S)


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
    live = coord.live
    return (
        (live.round, live.attempt) == (round_, attempt)
        and live.stage != "aborted"
        and not coord.before_stage(round_, attempt, stage)
    )


def _decode(raw: bytes, kind: type[T], request: web.Request, what: str) -> T:
    ws = request.app[WORKSPACE]
    return wire.decode(raw, kind, max_bytes=ws.config.server.max_json_bytes, what=what)


# -- public endpoints --------------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


async def openapi(request: web.Request) -> web.Response:
    return _json(openapi_document())


async def status(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    ws = request.app[WORKSPACE]
    live = coord.live
    history = [
        msgspec.json.decode(r.summary, type=wire.RoundSummary)
        for r in ws.state.rounds(200)
        if r.summary is not None
    ]
    return _json(
        wire.FederationStatus(
            federation_id=ws.federation_id,
            round=live.round,
            attempt=live.attempt,
            stage=live.stage,  # type: ignore[arg-type]
            model_version=ws.models.latest().version,
            rounds_completed=coord.rounds_completed,
            rounds_target=ws.config.round.rounds,
            finished=coord.finished,
            agents_active=len(ws.roster.active_agents()),
            history=history,
            alerts=coord.alerts[-50:],
        )
    )


# -- agent endpoints ---------------------------------------------------------------------------

_AGENT = ("agent",)
_ANY = ("agent", "observer", "auditor")


def _json_limit(request: web.Request) -> int:
    return request.app[WORKSPACE].config.server.max_json_bytes


async def get_round(request: web.Request) -> web.Response:
    await _authenticate(request, _json_limit(request), _ANY)
    coord = request.app[COORDINATOR]
    try:
        wait = int(request.query.get("wait", "0"))
        timeout = min(float(request.query.get("timeout", "0")), MAX_LONG_POLL_S)
    except ValueError:
        raise PayloadError("wait must be an integer token and timeout a number") from None
    if wait and wait == coord.token and timeout > 0:
        await request.app[CHANGED].wait(timeout)
    return _json(coord.round_state())


async def get_roster(request: web.Request) -> web.Response:
    await _authenticate(request, _json_limit(request), _ANY)
    ws = request.app[WORKSPACE]
    return _json(
        {
            "federation_id": ws.federation_id,
            "admin_public_key": ws.admin_public.hex(),
            "entries": [e.to_dict() for e in ws.roster.entries()],
        }
    )


async def join(request: web.Request) -> web.Response:
    member, body = await _authenticate(request, _json_limit(request), _AGENT)
    r, a = _round_args(request)
    req = _decode(body, wire.JoinRequest, request, "join request")
    return _json(request.app[COORDINATOR].join(member, r, a, req))


async def report(request: web.Request) -> web.Response:
    member, body = await _authenticate(request, _json_limit(request), _AGENT)
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
    member, body = await _authenticate(request, _json_limit(request), _AGENT)
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
    member, _ = await _authenticate(request, _json_limit(request), _AGENT)
    r, a = _round_args(request)
    await _hold_until(request, r, a, "share_keys", _wait_seconds(request))
    return _json(request.app[COORDINATOR].key_list(member, r, a))


async def post_shares(request: web.Request) -> web.Response:
    member, body = await _authenticate(request, _json_limit(request), _AGENT)
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
    member, _ = await _authenticate(request, _json_limit(request), _AGENT)
    r, a = _round_args(request)
    await _hold_until(request, r, a, "masked_input", _wait_seconds(request))
    return _json(request.app[COORDINATOR].share_relay(member, r, a))


async def masked_input(request: web.Request) -> web.Response:
    ws = request.app[WORKSPACE]
    member, body = await _authenticate(request, ws.config.server.max_body_bytes, _AGENT)
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
    held = wait if coord.live.session is not None else 0.0
    unmask = await _next_stage_data(
        request, r, a, "unmask", held, lambda: coord.unmask_request(member, r, a)
    )
    return _json(wire.MaskedInputAnswer(receipt=receipt, unmask=unmask))


async def get_unmask(request: web.Request) -> web.Response:
    member, _ = await _authenticate(request, _json_limit(request), _AGENT)
    r, a = _round_args(request)
    await _hold_until(request, r, a, "unmask", _wait_seconds(request))
    return _json(request.app[COORDINATOR].unmask_request(member, r, a))


async def post_unmask(request: web.Request) -> web.Response:
    member, body = await _authenticate(request, _json_limit(request), _AGENT)
    r, a = _round_args(request)
    msg = _decode(body, wire.UnmaskResponseBody, request, "unmask answer")
    wait = _wait_seconds(request)  # checked before anything is accepted
    coord = request.app[COORDINATOR]
    coord.unmask(member, r, a, msg)
    if wait <= 0:
        return _json(wire.Accepted(accepted=True))

    def unmasking() -> bool:
        live = coord.live
        return (live.round, live.attempt, live.stage) == (r, a, "unmask")

    # held until the attempt is over: the answer then carries the state the agent
    # would otherwise long-poll for next (closed, usually the next round already open)
    await _hold_while(request, unmasking, wait)
    return _json(wire.Accepted(accepted=True, state=None if unmasking() else coord.round_state()))


async def receipt(request: web.Request) -> web.Response:
    member, _ = await _authenticate(request, _json_limit(request), _AGENT)
    r, _a = _round_args(request)
    return _json(request.app[COORDINATOR].receipt(member, r))


# -- audit challenges and reveals ----------------------------------------------------------------


async def post_challenge(request: web.Request) -> web.Response:
    auditor, body = await _authenticate(request, _json_limit(request), ("auditor",))
    req = _decode(body, wire.ChallengeRequest, request, "challenge")
    return _json(request.app[CHALLENGES].challenge(auditor, req))


async def get_challenges(request: web.Request) -> web.Response:
    member, _ = await _authenticate(request, _json_limit(request), _AGENT)
    return _json(request.app[CHALLENGES].open_for(member))


async def post_reveal(request: web.Request) -> web.Response:
    ws = request.app[WORKSPACE]
    member, body = await _authenticate(request, ws.config.server.max_body_bytes, _AGENT)
    reveal = wire.decode(
        body, wire.RevealBody, max_bytes=ws.config.server.max_body_bytes, what="reveal"
    )
    return _json(request.app[CHALLENGES].reveal(member, reveal))


async def get_reveals(request: web.Request) -> web.Response:
    auditor, _ = await _authenticate(request, _json_limit(request), ("auditor",))
    return _json(request.app[CHALLENGES].reveals_for(auditor))


def _version(request: web.Request) -> int:
    try:
        return int(request.match_info["version"])
    except ValueError:
        raise PayloadError("model version must be an integer") from None


async def latest_manifest(request: web.Request) -> web.Response:
    await _authenticate(request, _json_limit(request), _ANY)
    return web.Response(
        body=request.app[WORKSPACE].models.latest().to_json(), content_type="application/json"
    )


async def manifest(request: web.Request) -> web.Response:
    await _authenticate(request, _json_limit(request), _ANY)
    m = request.app[WORKSPACE].models.get(_version(request))
    return web.Response(body=m.to_json(), content_type="application/json")


async def model(request: web.Request) -> web.Response:
    await _authenticate(request, _json_limit(request), _ANY)
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


def make_app(workspace: Workspace, coordinator: Coordinator | None = None) -> web.Application:
    """Build the aiohttp application for ``workspace``."""
    cfg = workspace.config.server
    app = web.Application(
        middlewares=[traffic_middleware, error_middleware], client_max_size=cfg.max_body_bytes
    )
    app[WORKSPACE] = workspace
    app[COORDINATOR] = coordinator or Coordinator(workspace)
    app[CHALLENGES] = ChallengeDesk(workspace, app[COORDINATOR].trail)
    app[CHANGED] = _ChangeSignal()

    def resolve(key_id: str) -> bytes | None:
        entry = workspace.roster.by_key_id(key_id)
        return entry.public_key_bytes if entry is not None and entry.is_active else None

    app[VERIFIER] = RequestVerifier(
        resolve,
        NonceCache(window_s=2 * cfg.clock_skew_s, max_entries=NONCE_CACHE_ENTRIES),
        max_skew_s=cfg.clock_skew_s,
    )
    p = wire.API_PREFIX
    app.router.add_get(f"{p}/health", health)
    app.router.add_get(f"{p}/openapi.json", openapi)
    app.router.add_get(f"{p}/status", status)
    app.router.add_get(f"{p}/round", get_round)
    app.router.add_get(f"{p}/roster", get_roster)
    app.router.add_get(f"{p}/models/latest", latest_manifest)
    app.router.add_get(f"{p}/models/{{version}}/manifest", manifest)
    app.router.add_get(f"{p}/models/{{version}}", model)
    r = f"{p}/rounds/{{round}}"
    app.router.add_post(f"{r}/join", join)
    app.router.add_post(f"{r}/report", report)
    app.router.add_post(f"{r}/advertise", advertise)
    app.router.add_get(f"{r}/keys", keys)
    app.router.add_post(f"{r}/shares", post_shares)
    app.router.add_get(f"{r}/shares", get_shares)
    app.router.add_post(f"{r}/masked-input", masked_input)
    app.router.add_get(f"{r}/unmask", get_unmask)
    app.router.add_post(f"{r}/unmask", post_unmask)
    app.router.add_get(f"{r}/receipt", receipt)
    app.router.add_post(f"{p}/audit/challenges", post_challenge)
    app.router.add_get(f"{p}/audit/challenges", get_challenges)
    app.router.add_post(f"{p}/audit/reveals", post_reveal)
    app.router.add_get(f"{p}/audit/reveals", get_reveals)
    app.cleanup_ctx.append(_ticker)
    return app
