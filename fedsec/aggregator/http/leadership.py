"""A standby's answer to a write, and to a member's read: ``503 not_leader`` naming the
leader, before anything of the request is consumed.

A standby's round state is the one it loaded at start (its round logic is idle), and a
deposed leader's is where it was deposed: either would tell a member a stale stage
(``wrong_stage``, a permanent refusal) while the leader has moved on.  So every signed
request goes to the leader; what operators and probes read (health, the API
description, the dashboard, /metrics) stays served, from this process's own view.

Checked ahead of authentication and the round's intake, so a standby records no nonce
(the member may send the very same signed request to the leader), raises no
contribution event and touches no state.  A deposed leader still believes it leads and
passes this check; the database's fence then refuses its write
(:mod:`fedsec.aggregator.storage.postgres.lease`).

An application serves the round only under the fencing token its coordinator was built
under (:data:`BUILT_UNDER`).  A standby that takes the lease over holds a valid token
while its standby application still serves, until the application rebuilt from the
database replaces it (:mod:`fedsec.aggregator.replica`); the fence would pass that
application's writes, yet its round state is the one loaded at start.  So meanwhile it
answers ``not_leader`` too (retry: the rebuilt one serves in a moment), and its round
logic stays idle (:func:`leads_here`).
"""

from __future__ import annotations

from typing import Final

from aiohttp import web

from fedsec.aggregator.http.keys import ENDPOINT_OF, WORKSPACE, Handler
from fedsec.aggregator.storage.leadership import Leased, NotLeader, lease_of

#: POSTs that change nothing: trading a dashboard token for a cookie only reads the
#: token table, and a standby's dashboard must stay reachable to show its role.
_READ_ONLY_POSTS: Final = frozenset({"dashboard_session"})
#: The fencing token the application's coordinator was built under; 0 when it was built
#: on a standby or without a lease (tokens start at 1).
BUILT_UNDER = web.AppKey("built_under", int)


def token_of(state: object) -> int:
    """The fencing token the process owning ``state`` holds now, 0 for none (what
    :func:`~fedsec.aggregator.http.app.make_app` records as :data:`BUILT_UNDER`)."""
    lease = lease_of(state)
    return 0 if lease is None or lease.token is None else lease.token


def leads_here(app: web.Application, lease: Leased) -> bool:
    """True while this process leads under the token ``app``'s coordinator was built
    under: not on a standby, not once deposed, not in a standby's application after its
    process took the lease over (the rebuilt application leads)."""
    return lease.token is not None and not lease.deposed and lease.token == app[BUILT_UNDER]


@web.middleware
async def leader_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse a state-changing request, or a signed read, on a standby with
    :class:`~fedsec.aggregator.storage.leadership.NotLeader`.

    Raises:
        NotLeader: this process does not lead (answered 503 by the error middleware).
    """
    lease = lease_of(request.app[WORKSPACE].state)
    if lease is None:
        return await handler(request)
    endpoint = request.app[ENDPOINT_OF].get(request.match_info.handler)
    if request.method in ("GET", "HEAD", "OPTIONS"):
        refused = endpoint is not None and bool(endpoint.roles)  # a member's signed read
    else:
        refused = endpoint is None or endpoint.name not in _READ_ONLY_POSTS
    if refused:
        refusal = lease.standby_refusal()
        if refusal is not None:
            raise refusal
        if lease.token != request.app[BUILT_UNDER]:
            raise NotLeader(
                f"not leader yet: this replica took the lease over with token {lease.token} "
                "and is resuming the round from the database; retry in a moment",
                None,
            )
    return await handler(request)
