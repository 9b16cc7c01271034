"""The aggregator's aiohttp application: its routes, its long-lived objects, its ticker.

:func:`make_app` joins the endpoint table (:mod:`fedsec.protocol.endpoints`) to the
handlers (:mod:`.handlers`), puts the workspace, coordinator, verifier, nonce store,
rate limit, upload slots and operations (metrics, alerts, dashboard) on the application
(:mod:`.keys`), and starts the ticker that closes stages on their deadlines and reloads
the roster, and the webhook sender.  Serving it is
:func:`fedsec.aggregator.transport.start_server`'s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from aiohttp import web

from fedsec.aggregator.challenges import ChallengeDesk
from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.http import handlers, ops
from fedsec.aggregator.http.auth import expect_continue, metrics_middleware, traffic_middleware
from fedsec.aggregator.http.errors import error_middleware, log
from fedsec.aggregator.http.keys import (
    CHALLENGES,
    COORDINATOR,
    ENDPOINT_OF,
    METRICS,
    NONCES,
    OPS,
    RATE,
    UPLOADS,
    VERIFIER,
    WORKSPACE,
    Handler,
)
from fedsec.aggregator.http.leadership import BUILT_UNDER, leader_middleware, leads_here, token_of
from fedsec.aggregator.http.limits import ROSTER_RELOAD_S, TICK_S
from fedsec.aggregator.http.longpoll import CHANGED, ChangeSignal
from fedsec.aggregator.nonces import open_nonce_store
from fedsec.aggregator.ops import Operations
from fedsec.aggregator.ratelimit import MemberRateLimit
from fedsec.aggregator.storage.leadership import lease_of
from fedsec.aggregator.workspace import Workspace
from fedsec.aio import cancel_and_wait
from fedsec.crypto.httpsig import RequestVerifier
from fedsec.protocol.endpoints import BY_NAME, ENDPOINTS, Endpoint

# The handler of each endpoint in fedsec.protocol.endpoints.ENDPOINTS, by its name; the
# routes, their roles and body limits come from that table.
_HANDLERS: dict[str, Handler] = {
    "health": handlers.health,
    "openapi": handlers.openapi,
    "status": handlers.status,
    "get_round": handlers.get_round,
    "get_roster": handlers.get_roster,
    "latest_manifest": handlers.latest_manifest,
    "manifest": handlers.manifest,
    "model": handlers.model,
    "join": handlers.join,
    "report": handlers.report,
    "evaluation": handlers.evaluation,
    "advertise": handlers.advertise,
    "keys": handlers.keys,
    "post_shares": handlers.post_shares,
    "get_shares": handlers.get_shares,
    "post_commit": handlers.post_commit,
    "get_commit": handlers.get_commit,
    "masked_input": handlers.masked_input,
    "get_unmask": handlers.get_unmask,
    "post_consistency": handlers.post_consistency,
    "get_consistency": handlers.get_consistency,
    "post_unmask": handlers.post_unmask,
    "receipt": handlers.receipt,
    "post_challenge": handlers.post_challenge,
    "get_challenges": handlers.get_challenges,
    "post_reveal": handlers.post_reveal,
    "get_reveals": handlers.get_reveals,
    "put_he_context": handlers.put_he_context,
    "get_he_context": handlers.get_he_context,
    "get_he_sum": handlers.get_he_sum,
    "post_decryption": handlers.post_decryption,
    "get_log": handlers.get_log,
    "get_archive": handlers.get_archive,
    "post_verdicts": ops.post_verdicts,
    "post_quarantine": handlers.post_quarantine,
    "ack_alert": ops.ack_alert,
    "dashboard": ops.dashboard,
    "dashboard_session": ops.dashboard_session,
    "dashboard_asset": ops.dashboard_asset,
    "dashboard_snapshot": ops.dashboard_snapshot,
    "dashboard_events": ops.dashboard_events,
    "metrics": ops.metrics,
}
_ENDPOINT_OF: dict[Handler, Endpoint] = {
    handler: BY_NAME[name] for name, handler in _HANDLERS.items()
}


def set_request_checks(app: web.Application, workspace: Workspace) -> None:
    """What :mod:`fedsec.aggregator.http.auth` checks a member's request with: the
    per-member rate, the upload slots, the durable nonce store and the signature
    verifier over ``workspace``'s roster (the leader's application, and a group
    server's: :mod:`fedsec.aggregator.groups.server`).

    Raises:
        sqlite3.Error, psycopg.Error: the nonce store cannot be opened.
    """
    cfg = workspace.config.server
    app[RATE] = MemberRateLimit(cfg.member_rate_per_s, cfg.member_burst)
    app[UPLOADS] = asyncio.Semaphore(cfg.max_concurrent_uploads)

    def resolve(key_id: str) -> bytes | None:
        entry = workspace.roster.by_key_id(key_id)
        return entry.public_key_bytes if entry is not None and entry.is_active else None

    # nonces are kept for twice the skew window so a request is never accepted after its
    # nonce has been forgotten, and on disk (or in the database replicas and group servers
    # share) so a restart forgets none of them and a request accepted by one process is a
    # replay at every other
    app[NONCES] = open_nonce_store(
        workspace.root, workspace.config.storage.url, 2 * cfg.clock_skew_s
    )
    app[VERIFIER] = RequestVerifier(resolve, app[NONCES], max_skew_s=cfg.clock_skew_s)


def make_app(workspace: Workspace, coordinator: Coordinator | None = None) -> web.Application:
    """Build the aiohttp application for ``workspace``.

    Args:
        workspace: the aggregator's workspace (configuration, roster, state, models).
        coordinator: the round engine to serve; a new one for ``workspace`` if None.

    Returns:
        The application, its routes those of the endpoint table.

    Raises:
        sqlite3.Error: the workspace's replay store cannot be opened.
    """
    cfg = workspace.config.server
    app = web.Application(
        middlewares=[metrics_middleware, traffic_middleware, error_middleware, leader_middleware],
        client_max_size=cfg.max_body_bytes,
    )
    app[WORKSPACE] = workspace
    app[COORDINATOR] = coordinator or Coordinator(workspace)
    app[BUILT_UNDER] = token_of(workspace.state)
    app[OPS] = Operations(app[COORDINATOR])
    app[METRICS] = app[OPS].metrics
    app[CHALLENGES] = ChallengeDesk(workspace, app[COORDINATOR].trail)
    app[CHANGED] = ChangeSignal()
    set_request_checks(app, workspace)
    app[ENDPOINT_OF] = _ENDPOINT_OF
    for endpoint in ENDPOINTS:
        app.router.add_route(
            endpoint.method,
            endpoint.template,
            _HANDLERS[endpoint.name],
            expect_handler=expect_continue,
        )
    # load balancers probe liveness with HEAD (aiohttp answers it with GET's headers)
    app.router.add_route("HEAD", BY_NAME["health"].template, handlers.health)
    app.on_shutdown.append(_end_streams)
    app.on_cleanup.append(_sync_audit_copies)
    app.cleanup_ctx.append(_replay_store)
    app.cleanup_ctx.append(_webhooks)
    app.cleanup_ctx.append(_ticker)
    return app


async def _sync_audit_copies(app: web.Application) -> None:
    """A clean stop makes the archive objects and log-file lines written since the last
    round close durable (copies of the state database's, not fsynced one by one)."""
    app[COORDINATOR].trail.close()


async def _ticker(app: web.Application) -> AsyncIterator[None]:
    coord = app[COORDINATOR]
    ws = app[WORKSPACE]
    signal = app[CHANGED]
    operations = app[OPS]
    lease = lease_of(ws.state)
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
                # a standby's round logic and alert rules wait: every write of theirs
                # would be fenced, and once its process took the lease over, they would
                # act on the round state loaded at start (the rebuilt app's run instead)
                if lease is None or leads_here(app, lease):
                    coord.tick()
                    operations.tick()
            except Exception:
                log.exception("event=tick_failed")
            await asyncio.sleep(TICK_S)

    task = asyncio.create_task(run())
    yield
    await cancel_and_wait(task)


async def _end_streams(app: web.Application) -> None:
    """Shutting down: live dashboard streams end (within ops.LIVENESS_S), so stopping the
    server does not wait for the browser tabs watching it."""
    app[OPS].closing = True
    app[CHANGED].fire()


async def _webhooks(app: web.Application) -> AsyncIterator[None]:
    await app[OPS].webhooks.start()
    yield
    await app[OPS].webhooks.stop()


async def _replay_store(app: web.Application) -> AsyncIterator[None]:
    yield
    app[NONCES].close()
