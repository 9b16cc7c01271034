"""Serving one aggregator replica: stand by while another leads, lead once its lease has
expired, resuming the round exactly as a restarted aggregator does.

A standby serves (health, reads, ``503 not_leader`` to writes) and polls the lease every
:data:`TAKEOVER_POLL_S`; so does a deposed leader once it has noticed.  Once it holds the
lease it stops its standby application and serves a new one on the same port around a
new :class:`Coordinator`, whose construction is the restart path: the round in progress
is rebuilt from the shared database by replaying what was accepted, and the transparency
log continues from its stored head; the new leader then raises a ``leader_changed``
alert.  An embedded (SQLite) aggregator is alone and serves at once.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable
from typing import Final

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.http import make_app
from fedsec.aggregator.http.keys import COORDINATOR
from fedsec.aggregator.storage.leadership import Leased, Replaceable, lease_of
from fedsec.aggregator.transport import RunningServer, start_server
from fedsec.aggregator.workspace import Workspace
from fedsec.faults import NO_FAULTS, Faults
from fedsec.summation import mode_named

log = logging.getLogger(__name__)

#: How often a standby tries the lease: with the 5 s lease, a killed leader is replaced
#: within about 6 s plus the round's replay, inside the 10 s take-over target.
TAKEOVER_POLL_S: Final = 1.0


async def serve_replica(
    ws: Workspace,
    host: str,
    port: int,
    ssl_ctx: ssl.SSLContext | None,
    stop: asyncio.Event,
    *,
    faults: Faults = NO_FAULTS,
    clock: Callable[[], float] = time.time,
    on_serving: Callable[[str], None] | None = None,
    poll_s: float = TAKEOVER_POLL_S,
) -> None:
    """Serve ``ws`` until ``stop`` is set, taking the lead when the lease is free.

    Args:
        ws: the opened workspace (its store holds the lease if nobody else did).
        host, port, ssl_ctx: where to listen (port 0: any free port, kept on take-over).
        stop: set to stop serving.
        faults: crash points for chaos tests.
        clock: the round engine's clock (tests pass a fake one).
        on_serving: called with the URL once listening, and again after a take-over.
        poll_s: how often a standby tries the lease.

    Raises:
        OSError: the address cannot be bound.
    """
    lease = lease_of(ws.state)
    server = await _start(ws, host, port, ssl_ctx, faults, clock, lease, on_serving)
    try:
        while lease is not None and not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), poll_s)
                break
            except TimeoutError:
                pass
            if lease.token is not None and not lease.deposed:
                continue  # leading
            # a standby, or a deposed leader (its round state is stale): lead again only
            # through the restart path
            if not _took_over(lease):
                continue
            log.info("event=took_over token=%s url=%s", lease.token, server.url)
            await server.close()
            if isinstance(ws.state, Replaceable):  # the old coordinator writes nothing more
                ws.state.forget_commit_callbacks()
            server = await _start(ws, host, server.port, ssl_ctx, faults, clock, lease, on_serving)
            try:
                coord = server.app[COORDINATOR]
                coord.alert_desk.raise_alert(
                    "leader_changed",
                    f"token {lease.token}",
                    f"{server.url} leads with fencing token {lease.token}; the previous leader "
                    "stopped renewing its lease",
                )
            except Exception:  # leading matters more than announcing it
                log.exception("event=leader_changed_alert_failed token=%s", lease.token)
        await stop.wait()
    finally:
        await server.close()


def _took_over(lease: Leased) -> bool:
    """Try the lease once; a database failure is logged and tried again at the next poll."""
    try:
        return lease.take_over(time.time())
    except Exception as exc:  # the driver's error: the database is away, retry later
        log.warning("event=takeover_failed error=%s", exc)
        return False


async def _start(
    ws: Workspace,
    host: str,
    port: int,
    ssl_ctx: ssl.SSLContext | None,
    faults: Faults,
    clock: Callable[[], float],
    lease: Leased | None,
    on_serving: Callable[[str], None] | None,
) -> RunningServer:
    identities = len(ws.roster.entries())
    mode_named(ws.config.round.secure_sum).warm(ws.config, identities)
    app = make_app(ws, Coordinator(ws, clock=clock, faults=faults))
    server = await start_server(app, host, port, ssl_ctx, ws.config.server, identities=identities)
    if lease is not None:  # standbys name this URL in their 503 not_leader
        lease.advertise(ws.config.server.advertise_url or server.url)
    if on_serving is not None:
        on_serving(server.url)
    return server
