"""Who may look (issue 14): ``/metrics`` and the dashboard are open to the operator on
the aggregator's own machine (a loopback peer *and* a loopback ``Host``, so a page
elsewhere cannot reach them by DNS rebinding) and otherwise need an observer's token of
the right scope, which stops working when it expires, is revoked, or its observer is;
the dashboard's sign-in form trades a posted token for an HttpOnly, SameSite=Strict cookie;
query parameters are checked; a turned-off dashboard is not there.  Every refusal
leaves the durable state as it was and never echoes the token.  The dashboard is served
with a strict Content-Security-Policy, and its snapshot carries no key, share or vector.

Requests are written by hand (:mod:`tests.support.hostile`) so the ``Host`` header and
cookies are exactly what the test says, to an aggregator served on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from click.testing import CliRunner
from multidict import CIMultiDict

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.http.keys import OPS
from fedsec.aggregator.ops import tokens
from fedsec.cli import main
from fedsec.errors import AuthError, ConfigError, ForbiddenError
from fedsec.protocol import wire
from tests.support.aggregator import (
    FED,
    Cohort,
    FakeClock,
    Federation,
    join_request,
    log_entries,
    make_federation,
)
from tests.support.hostile import (
    HOST,
    RawAnswer,
    Served,
    assert_unchanged,
    close,
    durable_state,
    exchange,
    request_head,
    serve,
)

pytestmark = pytest.mark.timeout(60)

AGENTS = ("a0", "a1", "a2")
OBSERVERS = ("obs", "obs2")
HOUR = 3600.0
DASHBOARD_ROUTES = ("/dashboard", "/dashboard/api/snapshot", "/dashboard/api/events")
COOKIE = "fedsec_dashboard"
CSP_PARTS = ("script-src 'self'", "frame-ancestors 'none'", "default-src 'self'")


# -- a served federation with [dashboard] and [metrics] settings -----------------------------------


def _federation(
    root: Path,
    *,
    dashboard: Mapping[str, Any] | None = None,
    metrics: Mapping[str, Any] | None = None,
) -> Federation:
    """A fresh workspace whose federation.toml also carries ``[dashboard]`` and
    ``[metrics]`` overrides."""
    return make_federation(
        root,
        AGENTS,
        observers=OBSERVERS,
        auditors=("aud",),
        validation=False,
        sections={
            # pushes soon after a change: a test's stream ends soon after its client goes
            "dashboard": {"push_interval_s": 0.05, **(dashboard or {})},
            "metrics": dict(metrics or {}),
        },
    )


@dataclass
class Site:
    """A served aggregator and the operator's (or a stranger's) requests to it."""

    fed: Federation
    served: Served

    @property
    def port(self) -> int:
        return self.served.port

    @property
    def loopback(self) -> str:
        return f"{HOST}:{self.port}"

    def issue(
        self,
        scope: Any = "dashboard",
        observer: str = "obs",
        ttl: float = HOUR,
        now: float | None = None,
    ) -> str:
        """A token of ``scope`` for ``observer``, issued at ``now`` (default: now)."""
        ws = self.fed.ws
        now = time.time() if now is None else now
        token, _ = tokens.issue(ws.state.tokens, ws.roster, observer, scope, ttl, now)
        return token

    async def get(
        self,
        target: str,
        *,
        host: str | None = None,
        token: str | None = None,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> RawAnswer:
        items = [("Host", host or self.loopback), *headers]
        if token is not None:
            items.append(("Authorization", f"Bearer {token}"))
        if target.startswith("/dashboard/api/events"):
            answer = await _event_stream_head(self.port, request_head("GET", target, items))
            await self.streams_ended()
            return answer
        answer = await exchange(self.port, request_head("GET", target, items), timeout=5.0)
        assert answer.status < 500, answer
        return answer

    async def streams_ended(self) -> None:
        """Wait until every live stream whose client has gone has ended.  A stream
        notices only when it next writes: announce a change so it does at once."""
        ops = self.served.app[OPS]
        async with asyncio.timeout(5.0):
            while ops.streams:
                self.served.coord.context.changed()
                await asyncio.sleep(0.02)

    async def refused(self, status: int, target: str, **kw: Any) -> tuple[str, str]:
        """``GET target`` is answered ``status`` with a JSON error that does not echo the
        token, sets no cookie and leaves the durable state as it was."""
        before = durable_state(self.fed.ws)
        answer = await self.get(target, **kw)
        assert answer.status == status, (target, kw, answer)
        error, detail = answer.error()
        assert "Set-Cookie" not in answer.headers
        for secret in _secrets(target, kw):
            assert secret not in answer.body.decode("utf-8", "replace"), (secret, answer)
        assert_unchanged(before, durable_state(self.fed.ws))
        return error, detail


def _secrets(target: str, kw: Mapping[str, Any]) -> Iterator[str]:
    """Token-like strings a request carried: none may come back in the answer."""
    carried = " ".join([target, str(kw.get("token") or ""), repr(kw.get("headers", ()))])
    for token in re.findall(r"fdt_[0-9a-zA-Z]{16,}", carried):
        yield token
        yield token[4:]


async def _event_stream_head(port: int, data: bytes) -> RawAnswer:
    """An answer of the live-event stream: a refusal whole, or a stream's status,
    headers and first event (then closed: it would run for minutes)."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(5.0):
            lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            headers: CIMultiDict[str] = CIMultiDict()
            for line in lines[1:]:
                if line:
                    name, _, value = line.partition(":")
                    headers.add(name.strip(), value.strip())
            if "Content-Length" in headers:
                body = await reader.readexactly(int(headers["Content-Length"]))
            else:  # chunked: each event is written as one chunk
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                body = await reader.readexactly(size)
            return RawAnswer(int(lines[0].split(" ", 2)[1]), headers, body, [])
    finally:
        await close(writer)


StartSite = Callable[..., Awaitable[Site]]


@pytest_asyncio.fixture
async def sites(tmp_path: Path) -> AsyncIterator[StartSite]:
    started: list[Site] = []

    async def start(
        dashboard: Mapping[str, Any] | None = None,
        metrics: Mapping[str, Any] | None = None,
        prepare: Callable[[Federation, Coordinator], None] | None = None,
    ) -> Site:
        fed = _federation(tmp_path / f"ws{len(started)}", dashboard=dashboard, metrics=metrics)
        coord = Coordinator(fed.ws, clock=FakeClock())
        if prepare is not None:
            prepare(fed, coord)
        site = Site(fed, await serve(fed.ws, coord))
        started.append(site)
        return site

    yield start
    for site in started:
        await site.served.stop()
        site.fed.ws.close()


CLOSED = {"dashboard": {"loopback_open": False}, "metrics": {"access": "token"}}


# -- loopback --------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_loopback_opens_metrics_and_the_dashboard_by_default(sites: StartSite) -> None:
    site = await sites()
    for host in (site.loopback, "localhost", f"localhost:{site.port}", f"[::1]:{site.port}"):
        answer = await site.get("/metrics", host=host)
        assert answer.status == 200, (host, answer)
        assert answer.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        assert b"fedsec_round " in answer.body and b"fedsec_alerts_raised" in answer.body
    page = await site.get("/dashboard")
    assert page.status == 200 and page.headers["Content-Type"].startswith("text/html")
    snapshot = await site.get("/dashboard/api/snapshot")
    assert snapshot.status == 200
    assert msgspec.json.decode(snapshot.body, type=wire.DashboardSnapshot).federation_id == FED
    events = await site.get("/dashboard/api/events")
    assert events.status == 200 and events.headers["Content-Type"] == "text/event-stream"
    assert events.body.startswith(b"event: snapshot\ndata: {")
    asset = await site.get("/dashboard/assets/dashboard.js")
    assert asset.status == 200 and asset.headers["Content-Type"].startswith("text/javascript")


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "host",
    [
        "evil.example",
        "evil.example:{port}",
        "127.0.0.1.evil.example",
        "localhost.evil.example:{port}",
        "10.0.0.7:{port}",
    ],
)
async def test_a_foreign_host_header_from_loopback_needs_a_token(
    sites: StartSite, host: str
) -> None:
    """DNS rebinding: a page on evil.example resolving its name to 127.0.0.1 reaches the
    aggregator from a loopback peer, but its requests say Host: evil.example."""
    site = await sites()
    host = host.format(port=site.port)
    for target in ("/metrics", *DASHBOARD_ROUTES):
        error, detail = await site.refused(401, target, host=host)
        assert error == "unauthenticated" and "needs a token" in detail
    # with a token, the host does not matter
    answer = await site.get("/metrics", host=host, token=site.issue("metrics"))
    assert answer.status == 200
    answer = await site.get("/dashboard/api/snapshot", host=host, token=site.issue())
    assert answer.status == 200


@pytest.mark.asyncio
async def test_metrics_access_open_needs_nothing(sites: StartSite) -> None:
    site = await sites(dashboard={"loopback_open": False}, metrics={"access": "open"})
    answer = await site.get("/metrics", host="evil.example")
    assert answer.status == 200 and b"fedsec_round " in answer.body
    await site.refused(401, "/dashboard/api/snapshot")  # the dashboard stays closed


# -- tokens ----------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_with_loopback_closed_only_a_valid_token_of_the_scope_opens(
    sites: StartSite,
) -> None:
    site = await sites(**CLOSED)
    ws = site.fed.ws
    for target in ("/metrics", *DASHBOARD_ROUTES):
        error, _ = await site.refused(401, target)
        assert error == "unauthenticated"

    metrics, dashboard = site.issue("metrics"), site.issue("dashboard")
    assert (await site.get("/metrics", token=metrics)).status == 200
    for target in DASHBOARD_ROUTES:
        assert (await site.get(target, token=dashboard)).status == 200, target
    # the wrong scope: known, but forbidden
    error, detail = await site.refused(403, "/metrics", token=dashboard)
    assert error == "forbidden" and "dashboard, not metrics" in detail
    for target in DASHBOARD_ROUTES:
        error, _ = await site.refused(403, target, token=metrics)
        assert error == "forbidden"

    # expired (issued two hours ago for one)
    expired = site.issue("metrics", now=time.time() - 2 * HOUR)
    error, detail = await site.refused(401, "/metrics", token=expired)
    assert "expired" in detail
    # revoked
    revoked = site.issue("metrics")
    assert ws.state.tokens.revoke(tokens.digest(revoked))
    _, detail = await site.refused(401, "/metrics", token=revoked)
    assert "unknown or revoked" in detail
    # its observer revoked from the roster: every token of it stops working
    of_obs2 = [site.issue("metrics", "obs2"), site.issue("dashboard", "obs2")]
    assert (await site.get("/metrics", token=of_obs2[0])).status == 200
    logged = len(log_entries(ws))
    ws.roster.revoke("obs2", ws.admin())
    # the serving aggregator logs the roster change on its next tick: wait for that
    async with asyncio.timeout(5.0):
        while not any(e["body"].get("agent_id") == "obs2" for e in log_entries(ws, logged)):
            await asyncio.sleep(0.02)
    _, detail = await site.refused(401, "/metrics", token=of_obs2[0])
    assert "no longer in the roster" in detail
    await site.refused(401, "/dashboard/api/snapshot", token=of_obs2[1])
    # obs's tokens are unaffected
    assert (await site.get("/metrics", token=metrics)).status == 200


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "authorization",
    [
        "Bearer abc",
        "Bearer fdt_" + "0" * 64,  # well-formed, never issued
        "Bearer fdt_" + "0" * 63,
        "Bearer FDT_" + "a" * 64,
        "Bearer " + "a" * 68,
        "Bearer ",
        "Basic b2JzOnNlY3JldA==",
        "fdt_" + "1" * 64,
        "Bearer fdt_" + "2" * 64 + "x" * 10_000,
    ],
)
async def test_a_malformed_or_unknown_token_is_refused(
    sites: StartSite, authorization: str
) -> None:
    site = await sites(**CLOSED)
    headers = (("Authorization", authorization),)
    for target in ("/metrics", "/dashboard/api/snapshot"):
        before = durable_state(site.fed.ws)
        answer = await site.get(target, headers=headers)
        assert 400 <= answer.status < 500, answer
        if len(authorization) < 8000:  # a header past the line limit is refused by aiohttp
            assert answer.status == 401, answer
            error, _ = answer.error()
            assert error == "unauthenticated"
            credential = authorization.rpartition(" ")[2]
            assert len(credential) < 8 or credential not in answer.body.decode()
        assert_unchanged(before, durable_state(site.fed.ws))


def test_tokens_are_issued_only_to_active_observers_for_a_bounded_time(
    tmp_path: Path,
) -> None:
    fed = _federation(tmp_path / "ws")
    ws = fed.ws
    now = time.time()
    ws.roster.revoke("obs2", ws.admin())
    refused: list[tuple[str, Any, float]] = [
        ("a0", "dashboard", HOUR),  # an agent
        ("aud", "dashboard", HOUR),  # an auditor
        ("ghost", "dashboard", HOUR),  # not in the roster
        ("obs2", "metrics", HOUR),  # revoked
        ("obs", "admin", HOUR),  # no such scope
        ("obs", "dashboard", 0.0),
        ("obs", "dashboard", -1.0),
        ("obs", "dashboard", tokens.MAX_TTL_S + 1),
        ("obs", "dashboard", math.inf),
        ("obs", "dashboard", math.nan),
    ]
    for observer, scope, ttl in refused:
        with pytest.raises(ConfigError) as info:
            tokens.issue(ws.state.tokens, ws.roster, observer, scope, ttl, now)
        assert info.value.detail, (observer, scope, ttl)
        assert ws.state.tokens.all() == [], (observer, scope, ttl)
    with pytest.raises(ConfigError, match="not an active observer"):
        tokens.issue(ws.state.tokens, ws.roster, "a0", "dashboard", HOUR, now)

    token, row = tokens.issue(ws.state.tokens, ws.roster, "obs", "metrics", tokens.MAX_TTL_S, now)
    assert re.fullmatch(r"fdt_[0-9a-f]{64}", token)
    assert (row.observer, row.scope, row.expires_at - row.issued_at) == (
        "obs",
        "metrics",
        tokens.MAX_TTL_S,
    )
    assert ws.state.tokens.all() == [row] and row.sha256 == tokens.digest(token)
    assert token not in repr(row) and token[4:] not in repr(row)  # only the hash is kept
    assert tokens.check(ws.state.tokens, ws.roster, token, "metrics", now) == "obs"
    with pytest.raises(ForbiddenError):
        tokens.check(ws.state.tokens, ws.roster, token, "dashboard", now)
    with pytest.raises(AuthError, match="expired"):
        tokens.check(ws.state.tokens, ws.roster, token, "metrics", now + tokens.MAX_TTL_S)
    ws.close()


# -- the dashboard's session cookie ----------------------------------------------------------------


def _cookie(answer: RawAnswer) -> Any:
    (header,) = answer.headers.getall("Set-Cookie")
    jar: SimpleCookie = SimpleCookie()
    jar.load(header)
    return jar[COOKIE], header


async def sign_in(
    site: Site, body: bytes, headers: tuple[tuple[str, str], ...] = (), host: str | None = None
) -> RawAnswer:
    """``POST /dashboard`` as the sign-in form sends it (form-encoded ``token=...``)."""
    items = [
        ("Host", host or site.loopback),
        ("Content-Type", "application/x-www-form-urlencoded"),
        *headers,
    ]
    head = request_head("POST", "/dashboard", items, content_length=len(body))
    answer = await exchange(site.port, head + body, timeout=5.0)
    assert answer.status < 500, answer
    return answer


@pytest.mark.asyncio
async def test_a_posted_token_becomes_a_strict_session_cookie(sites: StartSite) -> None:
    site = await sites(**CLOSED)
    token = site.issue()
    before = durable_state(site.fed.ws)
    answer = await sign_in(site, f"token={token}".encode())
    assert answer.status == 303, answer
    assert answer.headers["Location"] == "/dashboard"
    morsel, header = _cookie(answer)
    assert morsel.value == token
    assert morsel["path"] == "/dashboard"
    assert morsel["httponly"] is True
    assert morsel["samesite"] == "Strict"
    assert morsel["max-age"] == str(int(site.fed.ws.config.dashboard.token_ttl_s))
    assert "Secure" not in header  # plain HTTP on loopback (peer and Host)
    assert token not in answer.body.decode()
    assert_unchanged(before, durable_state(site.fed.ws))

    cookie = (("Cookie", f"{COOKIE}={token}"),)
    snapshot = await site.get("/dashboard/api/snapshot", headers=cookie)
    assert snapshot.status == 200
    msgspec.json.decode(snapshot.body, type=wire.DashboardSnapshot)
    page = await site.get("/dashboard", headers=cookie)
    assert page.status == 200 and page.headers["Content-Type"].startswith("text/html")
    assert (await site.get("/dashboard/api/events", headers=cookie)).status == 200
    # the cookie opens the dashboard only: the scrape takes a header
    await site.refused(401, "/metrics", headers=cookie)
    # a revoked token's cookie stops working at once
    site.fed.ws.state.tokens.revoke(tokens.digest(token))
    await site.refused(401, "/dashboard/api/snapshot", headers=cookie)


@pytest.mark.asyncio
async def test_a_bad_posted_token_sets_no_cookie(sites: StartSite) -> None:
    site = await sites(**CLOSED)
    bad = "fdt_" + "ab" * 32
    expired = site.issue(now=time.time() - 2 * HOUR)
    for body, status, code in (
        (f"token={bad}", 401, "unauthenticated"),
        ("token=not-a-token", 401, "unauthenticated"),
        ("token=", 401, "unauthenticated"),
        (f"token={expired}", 401, "unauthenticated"),
        (f"token={site.issue('metrics')}", 403, "forbidden"),  # a scrape token
    ):
        before = durable_state(site.fed.ws)
        answer = await sign_in(site, body.encode())
        assert answer.status == status, (body, answer)
        error, detail = answer.error()
        assert error == code and "ab" * 8 not in detail
        assert "Set-Cookie" not in answer.headers
        assert_unchanged(before, durable_state(site.fed.ws))
    # a cookie holding a bad token is refused like the header
    await site.refused(401, "/dashboard/api/snapshot", headers=(("Cookie", f"{COOKIE}={bad}"),))


# -- parameters, size, a turned-off dashboard ------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "target",
    [
        "/metrics?x=1",
        "/metrics?token={token}",
        "/dashboard?x=1",
        "/dashboard?token={token}&token={token}",
        "/dashboard?token={token}&x=1",
        "/dashboard/api/snapshot?token={token}",
        "/dashboard/api/snapshot?a=1&a=2",
        "/dashboard/api/events?since=3",
        "/dashboard/assets/dashboard.js?v=2",
    ],
)
async def test_unknown_or_repeated_query_parameters_are_refused(
    sites: StartSite, target: str
) -> None:
    site = await sites()
    target = target.format(token=site.issue())
    error, _ = await site.refused(400, target)
    assert error == "bad_request"


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "target",
    [
        "/metrics?" + "x" * 10_000 + "=1",
        "/dashboard?token=" + "f" * 10_000,
        "/dashboard/api/snapshot?" + "&".join(f"p{i}=1" for i in range(1500)),
        "/dashboard?token=" + "f" * 7_900,  # under the line limit: our own refusal
        "/metrics?" + "y" * 7_900 + "=1",
    ],
)
async def test_an_oversized_query_is_refused_not_a_server_error(
    sites: StartSite, target: str
) -> None:
    site = await sites()
    before = durable_state(site.fed.ws)
    answer = await site.get(target)
    assert 400 <= answer.status < 500, answer
    assert "Set-Cookie" not in answer.headers
    assert b"f" * 100 not in answer.body and b"y" * 100 not in answer.body
    assert_unchanged(before, durable_state(site.fed.ws))


@pytest.mark.asyncio
async def test_a_turned_off_dashboard_is_not_there(sites: StartSite) -> None:
    site = await sites(dashboard={"enabled": False})
    token = site.issue()
    for target in DASHBOARD_ROUTES:
        error, detail = await site.refused(404, target)
        assert error == "not_found" and "dashboard.enabled = false" in detail
        await site.refused(404, target, token=token)
    # nor a token traded for a cookie, nor its files
    answer = await sign_in(site, f"token={token}".encode())
    assert answer.status == 404 and "Set-Cookie" not in answer.headers
    await site.refused(404, "/dashboard/assets/dashboard.js")
    # the scrape is another matter
    assert (await site.get("/metrics")).status == 200


@pytest.mark.asyncio
async def test_a_live_stream_whose_viewer_left_frees_its_slot(sites: StartSite) -> None:
    site = await sites()
    ops = site.served.app[OPS]
    reader, writer = await asyncio.open_connection(HOST, site.port)
    writer.write(request_head("GET", "/dashboard/api/events", [("Host", site.loopback)]))
    await writer.drain()
    async with asyncio.timeout(5.0):
        await reader.readuntil(b"\n\n")  # the first snapshot
    assert ops.streams == 1
    await close(writer)  # the tab is closed; nothing in the federation changes
    try:
        deadline = asyncio.get_running_loop().time() + 2.0
        while ops.streams and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        assert ops.streams == 0, "a departed viewer still holds a live-stream slot after 2 s"
    finally:
        await site.streams_ended()


# -- the command line ------------------------------------------------------------------------------


def _aggregator(*args: str) -> Any:
    return CliRunner().invoke(main, ["aggregator", *args])


def test_dashboard_tokens_are_issued_listed_and_revoked_from_the_command_line(
    tmp_path: Path,
) -> None:
    fed = _federation(tmp_path / "ws")
    ws, root = fed.ws, str(fed.root)
    result = _aggregator("dashboard-token", "--workspace", root, "--observer", "obs")
    assert result.exit_code == 0, result.output
    token = result.stdout.strip()
    assert re.fullmatch(r"fdt_[0-9a-f]{64}", token), result.stdout  # stdout: the token only
    assert tokens.check(ws.state.tokens, ws.roster, token, "dashboard", time.time()) == "obs"
    (row,) = ws.state.tokens.all()
    assert row.expires_at - row.issued_at == ws.config.dashboard.token_ttl_s
    assert f"dashboard token for obs, id {row.sha256[:12]}" in result.stderr
    assert "/dashboard and paste the token into its sign-in form" in result.stderr
    assert token not in result.stderr  # never in an address to open

    result = _aggregator(
        "dashboard-token", "--workspace", root, "--observer", "obs2", "--scope", "metrics",
        "--ttl-s", "60",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    scrape = result.stdout.strip()
    assert tokens.check(ws.state.tokens, ws.roster, scrape, "metrics", time.time()) == "obs2"
    assert "Authorization: Bearer" in result.stderr and scrape not in result.stderr
    scrape_row = ws.state.tokens.get(tokens.digest(scrape))
    assert scrape_row is not None and scrape_row.expires_at - scrape_row.issued_at == 60

    # refused: nothing stored, the reason printed, no traceback
    for args in (
        ("--observer", "a0"),
        ("--observer", "ghost"),
        ("--observer", "obs", "--ttl-s", "0"),
        ("--observer", "obs", "--ttl-s", str(31 * 24 * 3600)),
    ):
        result = _aggregator("dashboard-token", "--workspace", root, *args)
        assert result.exit_code == 1, (args, result.output)
        assert result.stdout == "" and "error: " in result.stderr
        assert "Traceback" not in result.output
        assert len(ws.state.tokens.all()) == 2

    listed = _aggregator("tokens", "list", "--workspace", root)
    assert listed.exit_code == 0, listed.output
    lines = listed.output.splitlines()
    assert len(lines) == 2
    (line,) = [x for x in lines if x.startswith(row.sha256[:12])]
    assert re.fullmatch(
        rf"{row.sha256[:12]}  obs  dashboard  \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d UTC  valid", line
    ), line
    assert token not in listed.output and token[4:] not in listed.output

    # revoking needs an id that names one token
    for bad in ("abc", "0" * 12):
        result = _aggregator("tokens", "revoke", "--workspace", root, "--id", bad)
        assert result.exit_code == 1 and "Traceback" not in result.output
    assert not any(r.revoked for r in ws.state.tokens.all())
    result = _aggregator("tokens", "revoke", "--workspace", root, "--id", row.sha256[:12].upper())
    assert result.exit_code == 0, result.output
    assert f"revoked {row.sha256[:12]} (obs, dashboard)" in result.output
    with pytest.raises(AuthError, match="revoked"):
        tokens.check(ws.state.tokens, ws.roster, token, "dashboard", time.time())
    assert tokens.check(ws.state.tokens, ws.roster, scrape, "metrics", time.time()) == "obs2"
    listed = _aggregator("tokens", "list", "--workspace", root)
    assert any(
        x.startswith(row.sha256[:12]) and x.endswith("revoked") for x in listed.output.splitlines()
    )
    ws.close()


# -- what the dashboard sends ----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_every_dashboard_answer_carries_a_strict_content_security_policy(
    sites: StartSite,
) -> None:
    site = await sites()
    token = site.issue()
    answers = [
        await site.get("/dashboard"),
        await sign_in(site, f"token={token}".encode()),
        await site.get("/dashboard/api/snapshot"),
        await site.get("/dashboard/api/events"),
        await site.get("/dashboard/assets/dashboard.js"),
        await site.get("/dashboard/assets/dashboard.css"),
    ]
    for answer in answers:
        assert answer.status in (200, 303), answer
        csp = answer.headers["Content-Security-Policy"]
        for part in CSP_PARTS:
            assert part in csp, (part, csp)
        assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
        assert answer.headers["X-Frame-Options"] == "DENY"
        assert answer.headers["X-Content-Type-Options"] == "nosniff"
        assert answer.headers["Cache-Control"] == "no-store"
    # the page loads its script from its own origin, and has no inline script
    page = answers[0].body.decode()
    assert re.search(r"<script[^>]*\bsrc=\"/dashboard/assets/dashboard\.js\"", page), page
    assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", page), page


@dataclass
class RoundSecrets:
    """What a SecAgg+ round put on the wire that the dashboard must never show."""

    hex_strings: list[str]
    masked: list[bytes]


def _full_round(fed: Federation, coord: Coordinator, out: RoundSecrets) -> None:
    r, a = coord.live.round, coord.live.attempt
    for m in AGENTS:
        assert coord.join(m, r, a, join_request(m, r)).accepted
    coord.tick()
    assert coord.live.spec is not None
    cohort = Cohort(coord.live.spec, fed.identities)
    for m in AGENTS:
        adv = cohort.advertise(m)
        out.hex_strings += [adv.enc_public, adv.mask_public, adv.signature]
        coord.advertise(m, r, a, adv)
    for m in AGENTS:
        shares = cohort.share_keys(m, coord.key_list(m, r, a))
        out.hex_strings += [s.ciphertext for s in shares.shares]
        coord.share_keys(m, r, a, shares)
    for m in AGENTS:
        cohort.receive_shares(m, coord.share_relay(m, r, a))
    for m in AGENTS:
        raw, commitment, signature = cohort.upload(m)
        out.masked.append(raw)
        out.hex_strings += [commitment, signature]
        coord.masked_input(m, r, a, raw, commitment, signature)
    for m in AGENTS:
        coord.consistency(m, r, a, cohort.sign(m, coord.unmask_request(m, r, a)))
    for m in AGENTS:
        answer = cohort.unmask(m, coord.consistency_proof(m, r, a))
        out.hex_strings += [*answer.seed_shares.values(), *answer.key_shares.values()]
        coord.unmask(m, r, a, answer)
    assert coord.live.round == r + 1
    row = coord.alert_desk.raise_alert("member_refused", "member a1", "a1: 10 refused")
    assert row is not None
    out.hex_strings.append(row.ack_sha256)
    token, token_row = tokens.issue(
        fed.ws.state.tokens, fed.ws.roster, "obs", "dashboard", HOUR, time.time()
    )
    out.hex_strings += [token, token[4:], token_row.sha256]


def _keys(doc: Any) -> Iterator[str]:
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield key
            yield from _keys(value)
    elif isinstance(doc, list):
        for value in doc:
            yield from _keys(value)


@pytest.mark.asyncio
async def test_the_snapshot_carries_no_key_share_ciphertext_or_vector(sites: StartSite) -> None:
    secrets_seen = RoundSecrets([], [])
    site = await sites(prepare=lambda fed, coord: _full_round(fed, coord, secrets_seen))
    answer = await site.get("/dashboard/api/snapshot")
    assert answer.status == 200
    text = answer.body.decode()
    snapshot = msgspec.json.decode(answer.body, type=wire.DashboardSnapshot)
    # it does describe the round: one closed attempt, three members' contributions
    (closed,) = [s for s in snapshot.rounds if s.stage == "closed"]
    assert (closed.cohort, closed.survivors) == (3, 3)
    assert {m.id: m.rounds_contributed for m in snapshot.members if m.role == "agent"} == {
        m: 1 for m in AGENTS
    }
    assert [a.kind for a in snapshot.alerts] == ["member_refused"]

    assert len(secrets_seen.hex_strings) > 20 and len(secrets_seen.masked) == 3
    for value in secrets_seen.hex_strings:
        assert len(value) >= 32
        for start in range(0, len(value) - 31, 16):
            assert value[start : start + 32] not in text, value
    for raw in secrets_seen.masked:
        hexed = raw.hex()
        assert len(hexed) > 64
        for start in range(0, len(hexed) - 31, 2):  # no 16-byte run of any masked input
            assert hexed[start : start + 32] not in text
    # nothing in it is named like a secret
    names = {k.lower() for k in _keys(json.loads(text))}
    for part in ("key", "share", "cipher", "vector", "signature", "token", "mask", "commit"):
        assert not [n for n in names if part in n], (part, sorted(names))
    # the only long hex strings are the model versions' published hashes
    published = {m.sha256 for m in snapshot.models}
    assert set(re.findall(r"[0-9a-f]{32,}", text)) <= published


@pytest.mark.asyncio
async def test_stopping_the_server_ends_open_live_streams_at_once(tmp_path: Path) -> None:
    fed = _federation(tmp_path / "ws")
    served = await serve(fed.ws, Coordinator(fed.ws, clock=FakeClock()))
    reader, writer = await asyncio.open_connection(HOST, served.port)
    writer.write(request_head("GET", "/dashboard/api/events", [("Host", f"{HOST}:{served.port}")]))
    await writer.drain()
    async with asyncio.timeout(5.0):
        await reader.readuntil(b"\n\n")  # the first snapshot: the tab is open and watching
    started = time.monotonic()
    await served.stop()  # SIGTERM's path: the stream must not hold the shutdown
    assert time.monotonic() - started < 5.0
    await close(writer)
