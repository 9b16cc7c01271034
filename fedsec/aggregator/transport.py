"""Serving the aggregator's aiohttp application: the listener and its connection rules.

:func:`start_server` is the one way the aggregator is served (``fedsec aggregator serve``,
in-process simulations, tests).  It runs the application's start-up and clean-up through an
``aiohttp.web.AppRunner``, but opens the listener itself with ``loop.create_server`` and a
protocol factory of its own: every connection is a :class:`_GuardedHandler`, aiohttp's
``RequestHandler`` with the rules below.  aiohttp has no header timeout and no connection
limit of its own, and the protocol is the one place that sees a connection before any
request exists, so that is where they go.

**Header deadline.**  A connection must deliver a complete request head (request line and
headers) within ``server.header_timeout_s`` of opening, and on keep-alive within as long of
the first byte of that head, or it is closed without an answer; bytes dribbled in do not
extend the deadline.  The handler arms that deadline itself (:class:`_GuardedHandler`).
A kept-alive connection that sends nothing is closed after ``server.keepalive_s`` of idle
time, aiohttp's own keep-alive timer: members come back between stages, and each new
connection is a TCP (and TLS) handshake and a connection-gate admission, so their client
keeps an idle connection for a while (``aggregator_client.limits.IDLE_CONNECTION_S``,
below the default keep-alive).  Neither closes a connection while a handler runs, so a
long-poll held for 25 s after its headers arrived is not cut.  With TLS, the handshake has
the header allowance (``ssl_handshake_timeout``) before the connection counts.  The body has
its own deadline, ``server.body_timeout_s``, enforced by the application.

**Connection limits.**  At most ``server.max_connections`` connections are open at once
(0, the default: sized from the roster, with the process's descriptor limit raised to fit
or the start refused, :mod:`fedsec.aggregator.capacity`), and at most
``server.max_connections_per_peer`` unauthenticated ones from one peer (an IPv4 address,
an IPv6 /64); a connection is unauthenticated until it carries a signed request or
an observer's token (:func:`mark_authenticated`).  At the limit, a new connection displaces
the oldest idle unauthenticated one, or else the oldest idle kept-alive one, so a flood of
idle connections from any number of addresses, or under one member's key, never keeps a
member out; one that can displace none, or is over its peer's share, is closed as soon as
it is accepted.  Each is logged at INFO (throttled).  The rules
are :class:`_ConnectionGate`'s.

**Logs.**  A request aiohttp's parser refuses, or a client that disconnects mid-request, is
the client's doing: one INFO line, no traceback, at most :data:`LOG_LINES_PER_WINDOW` of
each kind per :data:`LOG_WINDOW_S` (the next line says how many were suppressed).  Anything
else reaching aiohttp's error path is our bug and stays an ERROR with its traceback.

**Parser rejections.**  Malformed HTTP (a bad request line, method, header or
Content-Length, a NUL in the path, a line over :data:`MAX_LINE_BYTES`) is refused by aiohttp
before any route or middleware runs.  The handler answers those with the API's usual error
body, ``{"error": "bad_http", "detail": <aiohttp's reason, at most DETAIL_CHARS
characters>}``, as ``application/json`` with aiohttp's status (400), and closes the
connection; :data:`PARSER_REJECTIONS_NOTE` says so in the OpenAPI description.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import ipaddress
import logging
import math
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from fedsec.aggregator.capacity import connection_limit, descriptors_needed, ensure_descriptors
from fedsec.config import ServerSection
from fedsec.protocol import wire

log = logging.getLogger(__name__)

# Longest request line or header line, and most header lines, aiohttp's parser accepts
# (aiohttp's defaults, as nginx's 8 KiB header buffers): our longest line is an RFC 9421
# signature header of a few hundred bytes, and a signed request carries about a dozen.
MAX_LINE_BYTES = 8190
MAX_HEADERS = 128
# Connections the OS queues before accept; aiohttp's TCPSite default.  A burst beyond it
# is refused by the kernel, which clients retry like any refused connect.
LISTEN_BACKLOG = 128
# Log throttle for client-caused events: 5 lines per 10 s is enough to see a pattern (and
# its peers) while a flood of garbage costs one line per 2 s, not one per request.
LOG_LINES_PER_WINDOW = 5
LOG_WINDOW_S = 10.0
# aiohttp's reason for a parser rejection quotes the offending bytes; 200 characters keeps
# the quote readable and bounds what a client can make us echo and log.
DETAIL_CHARS = 200
# ``error`` code of a parser rejection's body.
BAD_HTTP = "bad_http"

PARSER_REJECTIONS_NOTE = (
    "Requests that are not well-formed HTTP/1.1 (a malformed request line, method or "
    "header, an invalid or conflicting Content-Length or Transfer-Encoding, a NUL or "
    f"other invalid byte in the path, a line over {MAX_LINE_BYTES} bytes, more than "
    f"{MAX_HEADERS} headers) are refused by the HTTP layer before any route runs: status "
    f'400, the usual JSON error body with error "{BAD_HTTP}" and the parser\'s reason as '
    f"detail (at most {DETAIL_CHARS} characters), and the connection is closed. A "
    "connection that has not sent a complete request head within server.header_timeout_s "
    "of opening, or of the head's first byte after a previous answer, is closed without an "
    "answer, as is a kept-alive connection idle for server.keepalive_s, and a "
    "connection beyond server.max_connections_per_peer unauthenticated ones from one "
    "address; at server.max_connections, a new connection displaces the oldest idle "
    "unauthenticated one, else the oldest idle kept-alive one, or is closed on accept when "
    "every connection has a request in progress."
)

# What a client did wrong, as opposed to our bugs: refused by aiohttp's parser, or a body
# that breaks its framing (bad chunk, short Content-Length) while a handler reads it.
CLIENT_FAULTS = (HttpProcessingError, RequestPayloadError)


class ThrottledLog:
    """INFO lines for one kind of client-caused event, at most ``lines`` per ``window_s``.

    Lines over the budget are counted, not logged; the next line logged carries
    ``suppressed=<count>``.
    """

    def __init__(
        self,
        logger: logging.Logger,
        *,
        lines: int = LOG_LINES_PER_WINDOW,
        window_s: float = LOG_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._lines = lines
        self._window_s = window_s
        self._clock = clock
        self._window_start = -math.inf
        self._logged = 0
        self._suppressed = 0

    def info(self, msg: str, *args: object) -> None:
        """Log ``msg % args`` at INFO unless this window's budget is spent."""
        now = self._clock()
        if now - self._window_start >= self._window_s:
            self._window_start, self._logged = now, 0
        if self._logged >= self._lines:
            self._suppressed += 1
            return
        self._logged += 1
        if self._suppressed:
            msg, args = msg + " suppressed=%d", (*args, self._suppressed)
            self._suppressed = 0
        self._logger.info(msg, *args)


class _ConnectionGate:
    """Admits connections within the limits, and says which to close to make room.

    Every connection counts against ``server.max_connections``.  Until it has carried an
    authenticated request (:func:`mark_authenticated`) it is *unauthenticated*, and
    counts against its peer's ``server.max_connections_per_peer`` too.  When the listener
    is full, a new connection takes the place of the oldest unauthenticated one that is
    idle (no request in progress), else of the oldest idle authenticated one (a kept-alive
    connection between a member's requests: its client reconnects for the next one); only
    when every connection has a request in progress is the new one refused.  So a flood
    from one address holds at most its peer's share, a flood from many addresses holds
    only connections any newcomer may displace, members' requests in progress (their long
    polls) are never displaced, and idle connections kept alive under one member's key
    (``server.keepalive_s``, up to its request rate times that) cannot keep others out.
    """

    def __init__(self, limit: int, per_peer: int) -> None:
        self.limit = limit
        self.per_peer = per_peer
        self._open: dict[_GuardedHandler, str] = {}  # connection -> its peer's key
        # unauthenticated connections, oldest first (dicts keep insertion order)
        self._unauthenticated: dict[_GuardedHandler, None] = {}
        self._per_peer: collections.Counter[str] = collections.Counter()
        self._refusals = ThrottledLog(log)
        self._evictions = ThrottledLog(log)

    @property
    def open(self) -> int:
        return len(self._open)

    def admit(self, conn: _GuardedHandler, transport: asyncio.BaseTransport) -> bool:
        """Count ``conn`` in, making room if needed; False when it must be closed."""
        peer = peer_key(transport.get_extra_info("peername"))
        if self._per_peer[peer] >= self.per_peer:
            return self._refuse("max_connections_per_peer", self.per_peer, transport)
        if len(self._open) >= self.limit:
            idle = next((c for c in self._unauthenticated if c.idle), None)
            if idle is None:  # kept-alive connections, oldest first (at the limit only)
                idle = next((c for c in self._open if c.idle), None)
            if idle is None:
                return self._refuse("max_connections", self.limit, transport)
            self._evictions.info(
                "event=connection_evicted reason=max_connections limit=%d peer=%s for=%s",
                self.limit,
                _address(idle.peername),
                _peer(transport),
            )
            self.release(idle)
            idle.force_close()
        self._open[conn] = peer
        self._unauthenticated[conn] = None
        self._per_peer[peer] += 1
        return True

    def authenticated(self, conn: _GuardedHandler) -> None:
        """``conn`` carried an authenticated request: it no longer counts against its
        peer's share, and is never displaced."""
        if self._unauthenticated.pop(conn, 0) is None:
            self._uncount(self._open[conn])

    def release(self, conn: _GuardedHandler) -> None:
        """``conn`` is closed (or closing); idempotent."""
        peer = self._open.pop(conn, None)
        if peer is not None and self._unauthenticated.pop(conn, 0) is None:
            self._uncount(peer)

    def _uncount(self, peer: str) -> None:
        self._per_peer[peer] -= 1
        if self._per_peer[peer] <= 0:
            del self._per_peer[peer]

    def _refuse(self, reason: str, limit: int, transport: asyncio.BaseTransport) -> bool:
        self._refusals.info(
            "event=connection_refused reason=%s limit=%d peer=%s",
            reason,
            limit,
            _peer(transport),
        )
        return False


@dataclass(frozen=True)
class _Rules:
    """What every connection of one listener shares."""

    header_timeout_s: float
    gate: _ConnectionGate
    rejections: ThrottledLog
    disconnects: ThrottledLog


class _GuardedHandler(RequestHandler):
    """aiohttp's HTTP/1.1 protocol with the connection limit, each request's header
    deadline, and client faults answered in JSON and logged without tracebacks."""

    __slots__ = ("_admitted", "_head_timer", "_last_payload", "_rules")

    def __init__(self, manager: web.Server, *, rules: _Rules, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._rules = rules
        self._admitted = False
        # the deadline of the request head on its way (None: no head under way)
        self._head_timer: asyncio.TimerHandle | None = None
        # the body of the last request whose head arrived: bytes after it belong to the
        # next head only once it is complete
        self._last_payload: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._rules.gate.admit(self, transport):
            transport.close()
            return
        self._admitted = True
        super().connection_made(transport)
        self._arm_head_deadline()  # the first head: counted from the connection's open

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self._admitted:  # refused (aiohttp never saw it), or already released
            return
        self._admitted = False
        self._rules.gate.release(self)
        self._disarm_head_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """aiohttp's parsing, and the header deadline: the first bytes of a head after an
        answer start it, a complete head meets it."""
        between_requests = self._between_requests()
        heads = self._request_count
        super().data_received(data)
        if self._request_count != heads:
            self._disarm_head_deadline()
            if self._messages:
                self._last_payload = self._messages[-1][1]
        elif between_requests and self._head_timer is None and not self._force_close:
            self._arm_head_deadline()

    def _between_requests(self) -> bool:
        """No request is being handled or waits to be, and the last one's body arrived
        whole: the next bytes are a request head's."""
        payload = self._last_payload
        return (
            not self._request_in_progress
            and not self._messages
            and (payload is None or payload.is_eof())
        )

    def _arm_head_deadline(self) -> None:
        loop = asyncio.get_running_loop()
        heads = self._request_count
        self._head_timer = loop.call_later(self._rules.header_timeout_s, self._head_overdue, heads)

    def _disarm_head_deadline(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_overdue(self, heads: int) -> None:
        # aiohttp counts the request heads its parser has completed on this connection:
        # the same count means the head under way is still incomplete
        self._head_timer = None
        if self._request_count == heads and not self._request_in_progress:
            log.debug("event=header_timeout peer=%s", self.peername)
            self.force_close()

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        """aiohttp's (write the response, log it), then let go of the body it wrote.

        aiohttp's connection loop keeps a keep-alive connection's last response until the
        next request on it arrives, and members hold their connections between stages: each
        kept what it was last sent, so 1,000 members idle after advertising their keys kept
        1,000 copies of the key list (n^2: ~400 MB), and every model download stayed
        resident per connection.  A written body is in the socket (or the transport's
        buffer, which holds its own copy), and nothing reads it again.
        """
        answered, reset = await super().finish_response(request, resp, start_time)
        if isinstance(answered, web.Response):
            answered.body = None
        return answered, reset

    @property
    def idle(self) -> bool:
        """No request is being handled: the connection waits for (the rest of) a head."""
        return not self._request_in_progress

    def authenticated(self) -> None:
        """This connection carried an authenticated request (see :class:`_ConnectionGate`)."""
        self._rules.gate.authenticated(self)

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """Answer a request aiohttp could not hand to, or get an answer from, the app.

        Client faults get a JSON 4xx and one throttled INFO line; a client that went away
        gets one throttled INFO line (there is no one to answer); the rest is our bug, left
        to aiohttp (ERROR with traceback, 500).

        Raises:
            ConnectionError: the response had already started, so the connection can only
                be closed (aiohttp's own rule; its caller closes it).
        """
        if isinstance(exc, CLIENT_FAULTS):
            return self._refuse_bad_http(request, status, exc, message)
        if isinstance(exc, ConnectionError) and self.transport is None:  # the client left
            self._rules.disconnects.info(
                "event=client_disconnected method=%s path=%r peer=%s",
                request.method,
                request.path[:DETAIL_CHARS],
                request.remote,
            )
            return _closing(web.Response(status=status))
        return super().handle_error(request, status, exc, message)

    def _refuse_bad_http(
        self, request: web.BaseRequest, status: int, exc: BaseException, message: str | None
    ) -> web.StreamResponse:
        detail = _one_line(message or getattr(exc, "message", "") or str(exc))
        status = status if 400 <= status < 500 else 400  # a framing error mid-body: 400
        self._rules.rejections.info(
            "event=bad_http status=%d peer=%s detail=%r", status, request.remote, detail
        )
        if request.writer.output_size > 0:
            raise ConnectionError("the response had started; closing the connection instead")
        body = wire.encode(wire.ErrorBody(error=BAD_HTTP, detail=detail))
        return _closing(web.Response(body=body, status=status, content_type="application/json"))


def _one_line(reason: str) -> str:
    """aiohttp's reason on one line, without the caret line that marks a column."""
    kept = (line.strip() for line in reason.splitlines())
    return " ".join(line for line in kept if line not in ("", "^"))[:DETAIL_CHARS]


def _closing(response: web.Response) -> web.Response:
    response.force_close()
    return response


def peer_key(peername: object) -> str:
    """The address a peer's connections are counted under: its IPv4 address, or the /64
    of its IPv6 address (one host is commonly given a whole /64, so counting per address
    would let it open connections from as many addresses as it likes)."""
    host = peername[0] if isinstance(peername, tuple) and peername else peername
    return _host_key(str(host))


# Parsing an address costs ~8 µs, once per accepted connection: the last 4,096 hosts
# (a 1,000-member roster's, with room to spare) are remembered; any other is parsed anew.
@functools.lru_cache(maxsize=4096)
def _host_key(host: str) -> str:
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host  # a Unix socket: one peer
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def mark_authenticated(request: web.BaseRequest) -> None:
    """The request was authenticated (a signed member request, an observer's token): its
    connection no longer counts against its peer's share and is never displaced."""
    conn = request.protocol
    if isinstance(conn, _GuardedHandler) and conn.transport is not None:
        conn.authenticated()


def _peer(transport: asyncio.BaseTransport) -> str:
    return _address(transport.get_extra_info("peername"))


def _address(peer: object) -> str:
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)


class RunningServer:
    """An application being served on one listener; :meth:`close` stops both."""

    def __init__(
        self, runner: web.AppRunner, listener: asyncio.Server, gate: _ConnectionGate, url: str
    ) -> None:
        self._runner = runner
        self._listener = listener
        self._gate = gate
        self.url = url
        self.port: int = listener.sockets[0].getsockname()[1]

    @property
    def app(self) -> web.Application:
        """The application being served."""
        return self._runner.app

    @property
    def open_connections(self) -> int:
        """Connections open now (those refused over the limit never count)."""
        return self._gate.open

    async def close(self) -> None:
        """Stop accepting, let in-flight requests finish (aiohttp's shutdown timeout),
        close every connection and run the application's clean-up."""
        self._listener.close()
        await self._runner.cleanup()
        await self._listener.wait_closed()


async def start_server(
    app: web.Application,
    host: str,
    port: int,
    ssl_context: ssl.SSLContext | None,
    server_cfg: ServerSection,
    *,
    identities: int = 0,
) -> RunningServer:
    """Run ``app``'s start-up and serve it on ``host``:``port`` (0 = any free port).

    Args:
        app: the application; its start-up runs here, its clean-up in ``close()``.
        host: address to listen on.
        port: TCP port; 0 picks a free one (see :attr:`RunningServer.port`).
        ssl_context: serve HTTPS with it; None serves plain HTTP.
        server_cfg: ``[server]``: ``header_timeout_s``, ``keepalive_s`` and the
            connection limits.
        identities: roster entries; ``max_connections = 0`` sizes the limit from them.

    Raises:
        ConfigError: the hard ``RLIMIT_NOFILE`` is below what the limit needs; nothing ran.
        OSError: the address cannot be bound; the application's clean-up has run.
    """
    limit = _sized_limit(server_cfg.max_connections, identities)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    server = runner.server
    assert server is not None  # setup() made it
    gate = _ConnectionGate(limit, server_cfg.max_connections_per_peer)
    rules = _Rules(server_cfg.header_timeout_s, gate, ThrottledLog(log), ThrottledLog(log))
    loop = asyncio.get_running_loop()

    def protocol() -> _GuardedHandler:
        return _GuardedHandler(
            server,
            rules=rules,
            loop=loop,
            keepalive_timeout=server_cfg.keepalive_s,
            access_log=None,
            max_line_size=MAX_LINE_BYTES,
            max_field_size=MAX_LINE_BYTES,
            max_headers=MAX_HEADERS,
        )

    try:
        listener = await loop.create_server(
            protocol,
            host,
            port,
            ssl=ssl_context,
            backlog=LISTEN_BACKLOG,
            ssl_handshake_timeout=server_cfg.header_timeout_s if ssl_context else None,
        )
    except BaseException:
        await runner.cleanup()
        raise
    bound = listener.sockets[0].getsockname()[1]
    scheme = "https" if ssl_context else "http"
    return RunningServer(runner, listener, gate, f"{scheme}://{_url_host(host)}:{bound}")


def _sized_limit(configured: int, identities: int) -> int:
    """The connection limit, with the descriptors for it secured (see ``capacity``)."""
    limit = connection_limit(configured, identities)
    sized = connection_limit(0, identities)
    if limit < sized:
        log.warning(
            "event=connection_limit_below_roster max_connections=%d roster=%d needs=%d",
            limit,
            identities,
            sized,
        )
    what = f"server.max_connections={limit} (roster of {identities})"
    ensure_descriptors(descriptors_needed(limit), what)
    log.info("event=connection_limit max_connections=%d roster=%d", limit, identities)
    return limit


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
