"""The operations endpoints: the dashboard (page, assets, snapshot, live events),
``/metrics``, alert acknowledgements and auditors' verdicts.

Browsers and Prometheus cannot sign requests, so the dashboard and the scrape take an
observer's bearer token (:mod:`fedsec.aggregator.ops.tokens`) in ``Authorization:
Bearer``, or, for the dashboard, in the session cookie that the sign-in form's
``POST /dashboard`` sets (HttpOnly, SameSite=Strict, scoped to ``/dashboard``, Secure
but on plain loopback); the token travels in the form's body, never in an address.
Where the configuration allows, a loopback request needs no token: both the peer
address and the ``Host`` header must be loopback, so a web page elsewhere cannot reach
it through DNS rebinding.

Every answer of these endpoints is read-only, and every page is served with a strict
Content-Security-Policy: the dashboard runs only its own script and talks only to its
own origin.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import re
import time
import urllib.parse
from importlib import resources
from typing import Final

import msgspec
from aiohttp import web

from fedsec.aggregator.http.auth import authenticate, read_unsigned_body
from fedsec.aggregator.http.errors import json_response, log, quote
from fedsec.aggregator.http.keys import COORDINATOR, METRICS, OPS, WORKSPACE
from fedsec.aggregator.http.longpoll import CHANGED
from fedsec.aggregator.http.params import decode_json
from fedsec.aggregator.ops import tokens
from fedsec.aggregator.ops.metrics import CONTENT_TYPE
from fedsec.aggregator.rounds.alerts import alert_view
from fedsec.aggregator.transport import mark_authenticated
from fedsec.errors import (
    AuthError,
    ForbiddenError,
    NotFound,
    PayloadError,
    ServerBusy,
)
from fedsec.protocol import wire
from fedsec.protocol.endpoints import TokenScope

#: The session cookie holding a dashboard token.
COOKIE: Final = "fedsec_dashboard"
#: Security headers of every dashboard answer.
_HEADERS: Final = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "X-Frame-Options": "DENY",
}
#: The sign-in form's headers: the dashboard's, but its form may post to its own origin.
_SIGN_IN_HEADERS: Final = {
    **_HEADERS,
    "Content-Security-Policy": _HEADERS["Content-Security-Policy"].replace(
        "form-action 'none'", "form-action 'self'"
    ),
}
#: The dashboard's files, by the name in its URL, and their content types.
ASSETS: Final = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
#: Live-event streams open at once; more are answered 503.  A few operators with a tab
#: or two each; the bound keeps a forgotten script from holding hundreds of streams.
MAX_STREAMS: Final = 32
#: Live-event streams one viewer (an observer's token, or the loopback operator) may hold
#: at once: a person with a few tabs open.  Without it one observer could hold all
#: MAX_STREAMS and lock every other operator out; another person gets their own token.
MAX_STREAMS_PER_VIEWER: Final = 4
#: A stream is ended after this many seconds; the browser's EventSource reconnects (and
#: is authenticated again, so a revoked or expired token stops working within this).
STREAM_S: Final = 300.0
#: How often a waiting stream looks whether its viewer left or the server is stopping:
#: a viewer's slot (of MAX_STREAMS) is freed, and a shutdown waits, at most this long.
LIVENESS_S: Final = 1.0
#: With no change, a snapshot is still pushed this often (the countdown and "last
#: seen" stay current; proxies see traffic and keep the stream open).
HEARTBEAT_S: Final = 15.0
#: A sign-in body is token=fdt_ and 64 hex digits, form-encoded: 74 bytes; 1 KiB leaves
#: room for what a browser may add, and bounds what anyone can make us read.
SIGN_IN_BODY_BYTES: Final = 1024
#: What an HTML form posts.
FORM: Final = "application/x-www-form-urlencoded"
#: An acknowledgement is {"token": 64 hex digits}: 80 bytes; 1 KiB leaves room for spaces.
ACK_BODY_BYTES: Final = 1024
#: A ``Host`` header: a bracketed IPv6 address or a name (no brackets or colons), then
#: an optional port (RFC 9110 section 7.2, RFC 3986 section 3.2.2).
_HOST: Final = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[^\[\]:]+))(?::[0-9]{1,5})?")


# -- access ----------------------------------------------------------------------------------------


def _only_params(request: web.Request, allowed: tuple[str, ...] = ()) -> None:
    """Refuse query parameters the endpoint does not take.

    Raises:
        PayloadError: an unknown or repeated parameter.
    """
    for name in request.query:
        if name not in allowed:
            raise PayloadError(f"unknown query parameter {quote(name, 32)!r}")
        if len(request.query.getall(name)) > 1:
            raise PayloadError(f"query parameter {name!r} is given more than once")


def is_loopback(request: web.Request) -> bool:
    """True when the peer is on this machine and the ``Host`` header names it so."""
    try:
        peer = ipaddress.ip_address((request.remote or "").split("%", 1)[0])
    except ValueError:
        return False
    return peer.is_loopback and _names_loopback(request.headers.get("Host"))


def _names_loopback(host: str | None) -> bool:
    """True when ``host`` (a ``Host`` header) is, as a whole, ``localhost`` or a
    loopback address, with or without a port.  Parsed, not matched by prefix: neither
    ``[::1]evil.example`` nor ``127.0.0.1.evil.example`` is loopback, nor is a request
    with no ``Host``."""
    match = _HOST.fullmatch(host or "")
    if match is None:
        return False
    name = match["v6"] or match["name"]
    if name.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    return address.is_loopback and (match["v6"] is None) == (address.version == 4)


def _bearer(request: web.Request, scope: TokenScope) -> str | None:
    header = request.headers.get("Authorization")
    if header is not None:
        kind, _, value = header.partition(" ")
        if kind.lower() != "bearer" or not value.strip():
            raise AuthError("Authorization must be 'Bearer <token>'")
        return value.strip()
    if scope == "dashboard":
        return request.cookies.get(COOKIE)
    return None


def _dashboard_on(request: web.Request) -> None:
    """Raises:
    NotFound: the dashboard is turned off (``dashboard.enabled = false``)."""
    if not request.app[WORKSPACE].config.dashboard.enabled:
        raise NotFound("the dashboard is turned off (dashboard.enabled = false)")


def require_access(request: web.Request, scope: TokenScope) -> str:
    """Who is looking: an observer (by its token), ``loopback`` or ``anyone``.

    Raises:
        NotFound: the dashboard is turned off (``dashboard.enabled = false``).
        AuthError: no token where one is needed, or a bad one (unknown, revoked,
            expired, of a revoked observer).
        ForbiddenError: a valid token of another scope.
    """
    cfg = request.app[WORKSPACE].config
    if scope == "dashboard":
        _dashboard_on(request)
    token = _bearer(request, scope)
    if token is not None:
        ws = request.app[WORKSPACE]
        observer = tokens.check(ws.state.tokens, ws.roster, token, scope, time.time())
        mark_authenticated(request)
        return observer
    if scope == "metrics" and cfg.metrics.access == "open":
        return "anyone"
    open_on_loopback = (
        cfg.dashboard.loopback_open if scope == "dashboard" else cfg.metrics.access == "loopback"
    )
    if open_on_loopback and is_loopback(request):
        return "loopback"
    raise AuthError(
        f"the {scope} needs a token: `fedsec aggregator dashboard-token --scope {scope}`"
    )


# -- the dashboard ---------------------------------------------------------------------------------


def _asset(name: str) -> bytes:
    return resources.files("fedsec.aggregator.ops").joinpath("static", name).read_bytes()


async def dashboard(request: web.Request) -> web.StreamResponse:
    _only_params(request)
    _dashboard_on(request)
    try:
        require_access(request, "dashboard")
    except AuthError as exc:
        if not _from_browser(request) or isinstance(exc, ForbiddenError):
            raise
        return _sign_in(status=401)
    return web.Response(
        body=_asset("dashboard.html"), content_type="text/html", charset="utf-8", headers=_HEADERS
    )


async def dashboard_session(request: web.Request) -> web.StreamResponse:
    """The sign-in form's POST: trade a dashboard token, sent in the body, for the
    session cookie, and go to the dashboard (303).  The token is never in an address,
    so neither the browser's history nor a proxy's access log holds it."""
    _only_params(request)
    _dashboard_on(request)
    _same_site(request)
    # unauthenticated until the token is checked: a small bound, the header deadline
    body = await read_unsigned_body(request, SIGN_IN_BODY_BYTES)
    token = _form_token(request, body)
    ws = request.app[WORKSPACE]
    try:
        tokens.check(ws.state.tokens, ws.roster, token, "dashboard", time.time())
    except AuthError as exc:
        if not _from_browser(request):
            raise
        log.info("event=dashboard_sign_in_refused reason=%s peer=%s", exc.code, request.remote)
        return _sign_in(status=exc.http_status)
    answer = web.HTTPSeeOther("/dashboard", headers=_HEADERS)
    answer.set_cookie(
        COOKIE,
        token,
        path="/dashboard",
        httponly=True,
        samesite="Strict",
        secure=secure_cookie(request),
        max_age=int(ws.config.dashboard.token_ttl_s),
    )
    raise answer


def secure_cookie(request: web.Request) -> bool:
    """Whether the session cookie is ``Secure``: always, but for a plain-HTTP request
    that is loopback by both peer and ``Host`` (the operator on the aggregator's own
    machine).  A plain-HTTP request from anywhere else came through a TLS-terminating
    proxy (the browser speaks HTTPS to it), or crossed a network in the clear, where a
    browser then refuses the cookie: either way no token travels unencrypted.  A proxy
    on the same machine that forwards the public ``Host`` gets ``Secure`` too; one that
    rewrites ``Host`` to loopback should not be run with ``dashboard.loopback_open``."""
    return request.secure or not is_loopback(request)


def _from_browser(request: web.Request) -> bool:
    """A browser navigating (it asks for HTML): it gets the sign-in form, not JSON."""
    return "text/html" in request.headers.get("Accept", "")


def _sign_in(status: int) -> web.Response:
    return web.Response(
        body=_asset("sign-in.html"),
        status=status,
        content_type="text/html",
        charset="utf-8",
        headers=_SIGN_IN_HEADERS,
    )


def _same_site(request: web.Request) -> None:
    """Refuse a sign-in posted by a page of another site (login CSRF: it would sign the
    operator's browser into the poster's session).

    Raises:
        ForbiddenError: ``Sec-Fetch-Site`` or ``Origin`` says another site posted it.
    """
    fetch_site = request.headers.get("Sec-Fetch-Site")
    origin = request.headers.get("Origin")
    host = (request.headers.get("Host") or "").lower()
    cross = fetch_site not in (None, "same-origin", "none")
    # a page sent with Referrer-Policy: no-referrer (ours) posts "Origin: null"; there
    # Sec-Fetch-Site, which every current browser sends, says where the post came from
    if origin is not None and origin != "null":
        cross = cross or urllib.parse.urlsplit(origin).netloc.lower() != host
    if cross:
        raise ForbiddenError("a dashboard sign-in posted from another site is refused")


def _form_token(request: web.Request, body: bytes) -> str:
    """The ``token`` field of a form-encoded sign-in body.

    Raises:
        PayloadError: the body is not ``application/x-www-form-urlencoded``, or not one
            ``token`` field of ASCII.
    """
    if request.content_type != FORM:
        raise PayloadError(f"a dashboard sign-in is a form ({FORM})")
    try:
        fields = urllib.parse.parse_qs(
            body.decode("ascii"), keep_blank_values=True, strict_parsing=True, max_num_fields=1
        )
    except (UnicodeDecodeError, ValueError):
        raise PayloadError("a dashboard sign-in is one field, token=<dashboard token>") from None
    values = fields.get("token", [])
    if len(fields) != 1 or len(values) != 1:
        raise PayloadError("a dashboard sign-in is one field, token=<dashboard token>")
    return values[0]


async def dashboard_asset(request: web.Request) -> web.Response:
    _only_params(request)
    _dashboard_on(request)
    name = request.match_info["name"]
    content_type = ASSETS.get(name)
    if content_type is None:
        raise NotFound(f"no dashboard file {quote(name, 64)!r}")
    return web.Response(body=_asset(name), headers={**_HEADERS, "Content-Type": content_type})


def _change(request: web.Request) -> object:
    """What changes whenever the snapshot may: the coordinator's token and the alerts."""
    coord = request.app[COORDINATOR]
    return coord.token, request.app[OPS].live.last_alert


async def dashboard_snapshot(request: web.Request) -> web.Response:
    _only_params(request)
    require_access(request, "dashboard")
    body = request.app[OPS].dashboard.snapshot(_change(request))
    return web.Response(body=body, content_type="application/json", headers=_HEADERS)


async def dashboard_events(request: web.Request) -> web.StreamResponse:
    _only_params(request)
    viewer = require_access(request, "dashboard")
    ops = request.app[OPS]
    if ops.streams_of[viewer] >= MAX_STREAMS_PER_VIEWER:
        raise ServerBusy(
            f"{viewer} has {MAX_STREAMS_PER_VIEWER} live dashboards open already; close one",
            retry_after=STREAM_S / 10,
        )
    if ops.streams >= MAX_STREAMS:
        raise ServerBusy(f"{MAX_STREAMS} live dashboards are open; retry shortly", retry_after=5)
    ops.streams += 1
    ops.streams_of[viewer] += 1
    try:
        return await _stream(request)
    finally:
        ops.streams -= 1
        ops.streams_of[viewer] -= 1
        if ops.streams_of[viewer] <= 0:
            del ops.streams_of[viewer]


async def _stream(request: web.Request) -> web.StreamResponse:
    ops = request.app[OPS]
    signal = request.app[CHANGED]
    interval = request.app[WORKSPACE].config.dashboard.push_interval_s
    response = web.StreamResponse(
        headers={**_HEADERS, "Content-Type": "text/event-stream", "X-Accel-Buffering": "no"}
    )
    await response.prepare(request)
    end = time.monotonic() + STREAM_S
    sent: object = None
    last = 0.0
    with contextlib.suppress(ConnectionError, asyncio.CancelledError):
        while (now := time.monotonic()) < end:
            change = _change(request)
            if change != sent or now - last >= HEARTBEAT_S:
                await asyncio.sleep(max(0.0, last + interval - now))
                change = _change(request)
                start = time.perf_counter()
                body = ops.dashboard.snapshot(change)
                await response.write(b"event: snapshot\ndata: " + body + b"\n\n")
                ops.metrics.dashboard_pushes.inc()
                ops.metrics.dashboard_seconds.inc(time.perf_counter() - start)
                sent, last = change, time.monotonic()
            if _gone(request) or ops.closing:
                break
            # woken by a change, or after LIVENESS_S to notice a viewer that left (the
            # socket's closing is seen only when looked at) or a server stopping
            await signal.wait(min(LIVENESS_S, max(end - time.monotonic(), 0.0)))
            if _gone(request) or ops.closing:
                break
        if not _gone(request):
            await response.write_eof()
    return response


def _gone(request: web.Request) -> bool:
    """True once the viewer's connection is closed or closing."""
    transport = request.transport
    return transport is None or transport.is_closing()


# -- metrics, alerts, verdicts ---------------------------------------------------------------------


async def metrics(request: web.Request) -> web.Response:
    _only_params(request)
    require_access(request, "metrics")
    body = request.app[METRICS].exposition()
    return web.Response(
        body=body, headers={"Content-Type": CONTENT_TYPE, "Cache-Control": "no-store"}
    )


async def ack_alert(request: web.Request) -> web.Response:
    _only_params(request)
    alert_id = wire.parse_uint(request.match_info["alert"], "alert id")
    # unauthenticated until the token is checked: a small bound, not max_json_bytes
    body = await read_unsigned_body(request, ACK_BODY_BYTES)
    ack = decode_json(body, wire.AlertAck, request, "alert acknowledgement")
    row = request.app[COORDINATOR].alert_desk.ack_with_token(alert_id, ack.token)
    return json_response(alert_view(row))


async def post_verdicts(request: web.Request) -> web.Response:
    auditor, body = await authenticate(request)
    sub = decode_json(body, wire.VerdictSubmission, request, "audit verdicts")
    receipt = request.app[OPS].submit_verdicts(auditor, sub.verdicts)
    quarantined = request.app[COORDINATOR].quarantine_failed(auditor, sub.verdicts)
    return json_response(msgspec.structs.replace(receipt, quarantined=len(quarantined)))
