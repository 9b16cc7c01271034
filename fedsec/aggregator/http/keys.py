"""What the application and each request carry between the HTTP layer's modules.

Typed ``aiohttp`` keys: the application's long-lived objects (set once by
:func:`fedsec.aggregator.http.app.make_app`) and the facts a request acquires as it
passes the checks of :mod:`fedsec.aggregator.http.auth`.  The change signal's key,
:data:`fedsec.aggregator.http.longpoll.CHANGED`, lives with the signal.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web

from fedsec.aggregator.challenges import ChallengeDesk
from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.nonces import DurableNonceStore
from fedsec.aggregator.ops import Operations
from fedsec.aggregator.ops.metrics import FederationMetrics
from fedsec.aggregator.ratelimit import MemberRateLimit
from fedsec.aggregator.workspace import Workspace
from fedsec.crypto.httpsig import RequestVerifier, SignedHeaders
from fedsec.protocol.endpoints import Endpoint

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

COORDINATOR = web.AppKey("coordinator", Coordinator)
CHALLENGES = web.AppKey("challenges", ChallengeDesk)
WORKSPACE = web.AppKey("workspace", Workspace)
VERIFIER = web.AppKey("verifier", RequestVerifier)
NONCES = web.AppKey("nonces", DurableNonceStore)
RATE = web.AppKey("rate", MemberRateLimit)
UPLOADS = web.AppKey("uploads", asyncio.Semaphore)
OPS = web.AppKey("ops", Operations)
# The process's metrics (the leader's are its operations'; a group server has its own):
# what the request-counting middleware and ``GET /metrics`` read.
METRICS = web.AppKey("metrics", FederationMetrics)
# The endpoint-table entry of each route's handler: the handler is how a request finds
# its endpoint (its roles and body limit).
ENDPOINT_OF = web.AppKey("endpoint_of", dict[Handler, Endpoint])

# Set on a request once its signature, role and body are verified: only then are its
# bytes counted in a round's summary.
MEMBER = web.RequestKey("member", tuple)
# Set once the body has been read to its end: a refusal before that closes the
# connection, so the server never reads (or lingers on) an unauthenticated body.
BODY_READ = web.RequestKey("body_read", bool)
SIGNED = web.RequestKey("signed", SignedHeaders)
