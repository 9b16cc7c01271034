"""A group server: the aiohttp application that takes the stage requests of the shard
groups the signed spec gives its URL (:class:`~fedsec.aggregator.groups.desk.GroupDesk`),
and ``fedsec aggregator group-serve`` around it.

It authenticates as the leader does (:func:`fedsec.aggregator.http.auth.verify_request`:
the same signature, roster and rate checks, and the same durable nonce store, so a
request accepted here is a replay at the leader and at every other group server), and
answers in the leader's formats, held answers included: a held request waits on the
store's stage (polled every :data:`POLL_S`), since the leader's change signal does not
cross processes.  Only the stage routes are served, with the server's own ``/metrics``
(:class:`~fedsec.aggregator.ops.metrics.FederationMetrics`, without the federation's
state, which the leader exports); a member asks the leader for everything else.  While
it runs it writes its heartbeat to the store every
:data:`~fedsec.aggregator.groups.hosts.HEARTBEAT_S`; the leader takes over the groups of
a server whose heartbeat stopped.  The bytes of each signed request are counted in its
attempt as the leader counts its own, and stored for the leader's round summary with
the server's messages and heartbeats (:meth:`GroupDesk.count_request`).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final

from aiohttp import web

from fedsec.aggregator.groups.desk import ANSWER_STAGES, STAGE_POLL_S, GroupDesk
from fedsec.aggregator.groups.hosts import HEARTBEAT_S, follow_again
from fedsec.aggregator.http import ops
from fedsec.aggregator.http.app import set_request_checks
from fedsec.aggregator.http.auth import (
    expect_continue,
    head_bytes,
    metrics_middleware,
    verify_request,
)
from fedsec.aggregator.http.errors import error_middleware, json_response
from fedsec.aggregator.http.keys import (
    ENDPOINT_OF,
    MEMBER,
    METRICS,
    WORKSPACE,
    Handler,
)
from fedsec.aggregator.http.params import (
    decode_json,
    decode_upload,
    round_args,
    statement_params,
    wait_seconds,
)
from fedsec.aggregator.ops.metrics import FederationMetrics
from fedsec.aggregator.storage.leadership import NotLeader
from fedsec.aggregator.transport import start_server
from fedsec.aggregator.workspace import Workspace
from fedsec.aio import cancel_and_wait
from fedsec.errors import FedsecError
from fedsec.protocol import codec, wire
from fedsec.protocol.endpoints import BY_NAME, Endpoint
from fedsec.summation import mode_named

log = logging.getLogger("fedsec.aggregator.groups")

#: How often a held answer looks at the attempt's stage again (the desk reads it from the
#: store at most that often for all of them: :data:`~fedsec.aggregator.groups.desk.STAGE_POLL_S`).
POLL_S: Final = STAGE_POLL_S

DESK = web.AppKey("group_desk", GroupDesk)


async def _verified(request: web.Request) -> tuple[str, bytes]:
    """:func:`~fedsec.aggregator.http.auth.verify_request`, then the request's bytes
    counted in the attempt in progress, on arrival (as the leader's ``authenticate``:
    a held answer must not leave its upload out); (agent id, body).

    Raises:
        FedsecError: as :func:`~fedsec.aggregator.http.auth.verify_request`.
    """
    member, body = await verify_request(request)
    try:
        named: tuple[int, int] | None = round_args(request)
    except FedsecError:  # refused by the handler; counted in the attempt in progress
        named = None
    attempt = request.app[DESK].count_request(named, head_bytes(request) + len(body))
    if attempt is not None:
        request[MEMBER] = attempt
    return member, body


@web.middleware
async def _traffic_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Count the answer's body bytes of a request :func:`_verified` counted, refusals
    included (outside the error middleware), in the attempt it was counted in."""
    response = await handler(request)
    attempt = request.get(MEMBER)
    body = response.body if isinstance(response, web.Response) else None
    if attempt is not None and isinstance(body, bytes | bytearray):
        request.app[DESK].count_answer(attempt, len(body))
    return response


async def _held(desk: GroupDesk, r: int, a: int, stage: str, wait: float) -> bool:
    """Wait at most ``wait`` s for attempt (r, a) to reach ``stage``; whether it did."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    while not desk.reached(r, a, stage):
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(POLL_S)
    return True


async def _next(desk: GroupDesk, name: str, member: str, r: int, a: int, wait: float) -> Any:
    """The answer ``name`` once its stage is reached within ``wait`` s, else None (the
    member then fetches it)."""
    if wait <= 0 or not await _held(desk, r, a, ANSWER_STAGES[name], wait):
        return None
    try:
        return desk.answer(name, member, r, a)
    except FedsecError:
        return None


def _fetch(name: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The handler of a stage fetch: ``name``'s answer, held until its stage."""

    async def handler(request: web.Request) -> web.Response:
        member, _ = await _verified(request)
        r, a = round_args(request)
        desk = request.app[DESK]
        await _held(desk, r, a, ANSWER_STAGES[name], wait_seconds(request))
        return json_response(desk.answer(name, member, r, a))

    return handler


async def advertise(request: web.Request) -> web.Response:
    member, body = await _verified(request)
    r, a = round_args(request)
    msg = decode_upload(body, wire.AdvertiseKeysBody, request, "key advertisement")
    wait = wait_seconds(request)
    desk = request.app[DESK]
    await desk.accept(
        member, r, a, "advertise", wire.encode(msg), lambda m: codec.advertise_message(m, msg)
    )
    keys = await _next(desk, "key_list", member, r, a, wait)
    return json_response(wire.Accepted(accepted=True, keys=keys))


async def post_shares(request: web.Request) -> web.Response:
    member, body = await _verified(request)
    r, a = round_args(request)
    msg = decode_upload(body, wire.ShareKeysBody, request, "encrypted shares")
    wait = wait_seconds(request)
    desk = request.app[DESK]
    await desk.share_keys(member, r, a, msg)
    relay = await _next(desk, "share_relay", member, r, a, wait)
    return json_response(wire.Accepted(accepted=True, relay=relay))


async def masked_input(request: web.Request) -> web.Response:
    member, body = await _verified(request)
    r, a = round_args(request)
    commitment, signature = statement_params(request)
    wait = wait_seconds(request)
    desk = request.app[DESK]
    receipt = await desk.masked_input(member, r, a, body, commitment, signature)
    del body  # stored: not held through the wait
    if "wait" not in request.query:
        return json_response(receipt)
    unmask = await _next(desk, "unmask_request", member, r, a, wait)
    return json_response(wire.MaskedInputAnswer(receipt=receipt, unmask=unmask))


async def post_consistency(request: web.Request) -> web.Response:
    member, body = await _verified(request)
    r, a = round_args(request)
    msg = decode_json(body, wire.ConsistencyBody, request, "consistency signature")
    wait = wait_seconds(request)
    desk = request.app[DESK]
    await desk.accept(
        member, r, a, "consistency", wire.encode(msg), lambda m: codec.consistency_message(m, msg)
    )
    proof = await _next(desk, "consistency_proof", member, r, a, wait)
    return json_response(wire.Accepted(accepted=True, proof=proof))


async def post_unmask(request: web.Request) -> web.Response:
    member, body = await _verified(request)
    r, a = round_args(request)
    msg = decode_upload(body, wire.UnmaskResponseBody, request, "unmask answer")
    wait = wait_seconds(request)
    desk = request.app[DESK]
    await desk.unmask(member, r, a, msg)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    # held while the attempt unmasks; the member then reads the round state at the
    # leader (this server holds none of it)
    while loop.time() < deadline and desk.reached(r, a, "unmask"):
        await asyncio.sleep(POLL_S)
    return json_response(wire.Accepted(accepted=True))


async def health(request: web.Request) -> web.Response:
    desk = request.app[DESK]
    return json_response(
        {"status": "ok", "role": "group_server", "url": desk.url, "accepted": desk.accepted}
    )


_HANDLERS: dict[str, Handler] = {
    "advertise": advertise,
    "keys": _fetch("key_list"),
    "post_shares": post_shares,
    "get_shares": _fetch("share_relay"),
    "masked_input": masked_input,
    "get_unmask": _fetch("unmask_request"),
    "post_consistency": post_consistency,
    "get_consistency": _fetch("consistency_proof"),
    "post_unmask": post_unmask,
    "health": health,
    "metrics": ops.metrics,
}


def make_group_app(workspace: Workspace, url: str) -> web.Application:
    """The group server's application for ``workspace`` at ``url``.

    Raises:
        sqlite3.Error, psycopg.Error: the nonce store cannot be opened.
    """
    cfg = workspace.config.server
    # requests counted as the leader counts its own, refusals included (outside the
    # error middleware); its /metrics has this process's counts only, its traffic goes
    # to the leader's round summaries through the store
    app = web.Application(
        middlewares=[metrics_middleware, _traffic_middleware, error_middleware],
        client_max_size=cfg.max_body_bytes,
    )
    app[WORKSPACE] = workspace
    app[METRICS] = FederationMetrics(None, member_labels=False)
    app[DESK] = GroupDesk(workspace, url, events=app[METRICS].on_event)
    set_request_checks(app, workspace)  # the leader's nonce store: one spend per request
    endpoint_of: dict[Handler, Endpoint] = {
        handler: BY_NAME[name] for name, handler in _HANDLERS.items()
    }
    app[ENDPOINT_OF] = endpoint_of
    for name, handler in _HANDLERS.items():
        endpoint = BY_NAME[name]
        app.router.add_route(
            endpoint.method, endpoint.template, handler, expect_handler=expect_continue
        )
    app.cleanup_ctx.append(_heartbeat)
    return app


async def _heartbeat(app: web.Application) -> AsyncIterator[None]:
    ws, desk = app[WORKSPACE], app[DESK]

    async def run() -> None:
        while True:
            try:
                desk.beat(time.time())
                ws.roster.reload_if_changed()
            except NotLeader:  # another leader took over: write under its token now
                follow_again(ws.state)
            except Exception:  # the store is busy or away: the next beat tries again
                log.exception("event=group_heartbeat_failed url=%s", desk.url)
            await asyncio.sleep(HEARTBEAT_S)

    task = asyncio.create_task(run())
    yield
    await cancel_and_wait(task)


async def serve_group(
    ws: Workspace,
    url: str,
    host: str,
    port: int,
    ssl_ctx: ssl.SSLContext | None,
    stop: asyncio.Event,
    on_serving: Callable[[str], None] = lambda url: None,
) -> None:
    """Serve ``ws``'s groups at ``url`` on ``host``:``port`` until ``stop`` is set.

    Raises:
        ConfigError: the descriptor limit is too low (see ``start_server``).
        OSError: the address cannot be bound.
    """
    mode_named(ws.config.round.secure_sum).warm(ws.config, len(ws.roster.entries()))
    app = make_group_app(ws, url)
    server = await start_server(app, host, port, ssl_ctx, ws.config.server)
    log.info("event=group_server_listening url=%s bound=%s", url, server.url)
    on_serving(server.url)
    try:
        await stop.wait()
    finally:
        await server.close()
