"""Strictness gaps of the operations endpoints found by the review of issue 32 (items 5
and 8): each test is the probe, against the real aggregator served on 127.0.0.1 with
requests written by hand (:mod:`tests.support.hostile`), so the bytes, the ``Host`` and
the cookies are exactly what the test says.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import stat
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any
from unittest import mock

import msgspec
import pytest
import pytest_asyncio
from aiohttp.test_utils import make_mocked_request

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.http.keys import OPS
from fedsec.aggregator.http.ops import MAX_STREAMS_PER_VIEWER, is_loopback
from fedsec.archive import Archive
from fedsec.config import parse_federation_config
from fedsec.errors import ConfigError
from fedsec.protocol import wire
from tests.aggregator.test_ops_access import Site, _federation, sign_in
from tests.support.aggregator import FakeClock, Federation, config_text, make_federation
from tests.support.hostile import (
    HOST,
    assert_unchanged,
    close,
    durable_state,
    exchange,
    read_answer,
    request_head,
    serve,
    signed_request,
)

pytestmark = pytest.mark.timeout(60)

DOCS = Path(__file__).resolve().parents[2] / "docs"

StartSite = Callable[..., Awaitable[Site]]


@pytest_asyncio.fixture
async def sites(tmp_path: Path) -> AsyncIterator[StartSite]:
    started: list[Site] = []

    async def start(
        dashboard: Mapping[str, Any] | None = None, metrics: Mapping[str, Any] | None = None
    ) -> Site:
        fed = _federation(tmp_path / f"ws{len(started)}", dashboard=dashboard, metrics=metrics)
        site = Site(fed, await serve(fed.ws, Coordinator(fed.ws, clock=FakeClock())))
        started.append(site)
        return site

    yield start
    for site in started:
        await site.served.stop()
        site.fed.ws.close()


CLOSED = {"dashboard": {"loopback_open": False}, "metrics": {"access": "token"}}


# -- item 5: a bearer token with a byte that is not UTF-8 --------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("byte", [b"\xff", b"\xc3", b"\x80"])
async def test_a_token_with_a_byte_that_is_not_utf8_is_a_401_not_a_500(
    sites: StartSite, byte: bytes
) -> None:
    site = await sites(**CLOSED)
    token = b"fdt_" + b"a" * 63 + byte  # the right length and prefix
    for target, header in (
        ("/metrics", b"Authorization: Bearer " + token),
        ("/dashboard/api/snapshot", b"Authorization: Bearer " + token),
        ("/dashboard/api/snapshot", b"Cookie: fedsec_dashboard=" + token),
    ):
        before = durable_state(site.fed.ws)
        head = f"GET {target} HTTP/1.1\r\nHost: {site.loopback}\r\n".encode() + header + b"\r\n\r\n"
        answer = await exchange(site.port, head)
        assert answer.status == 401, (target, answer)
        assert answer.error()[0] == "unauthenticated"
        assert_unchanged(before, durable_state(site.fed.ws))


# -- item 8: the Host of a loopback request is parsed, not matched by prefix ------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "host",
    [
        "[::1]evil.example",
        "[::1]evil.example:{port}",
        "[::1]:{port}evil.example",
        "[127.0.0.1]:{port}",
        "localhost:{port}:80",
        "localhost.:{port}",
        "::1",
        "",
        None,  # no Host header at all
    ],
)
async def test_a_host_that_only_begins_like_loopback_is_not_loopback(
    sites: StartSite, host: str | None
) -> None:
    site = await sites()
    for target in ("/metrics", "/dashboard/api/snapshot"):
        before = durable_state(site.fed.ws)
        if host is None:
            head = f"GET {target} HTTP/1.1\r\nConnection: close\r\n\r\n".encode()
        else:
            head = request_head("GET", target, [("Host", host.format(port=site.port))])
        answer = await exchange(site.port, head)
        assert answer.status in (400, 401), (host, target, answer)
        if answer.status == 401:
            assert answer.error()[0] == "unauthenticated"
        assert_unchanged(before, durable_state(site.fed.ws))


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "host",
    ["127.0.0.1:{port}", "127.0.0.1", "localhost:{port}", "LocalHost", "[::1]:{port}", "[::1]"],
)
async def test_a_loopback_host_with_or_without_a_port_is_loopback(
    sites: StartSite, host: str
) -> None:
    site = await sites()
    answer = await site.get("/metrics", host=host.format(port=site.port))
    assert answer.status == 200, answer


# -- item 8: HEAD /v1/health, for load balancers ----------------------------------------------


@pytest.mark.asyncio
async def test_head_health_is_answered_like_get_without_a_body(sites: StartSite) -> None:
    site = await sites()
    reader, writer = await asyncio.open_connection(HOST, site.port)
    try:
        writer.write(request_head("HEAD", "/v1/health") + request_head("GET", "/v1/health"))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
        assert head.startswith(b"HTTP/1.1 200"), head
        assert b"application/json" in head
        # no body: the next bytes are the GET's answer
        get = await asyncio.wait_for(read_answer(reader), 5.0)
        assert get.status == 200 and get.json() == {"status": "ok", "role": "single"}
    finally:
        await close(writer)


# -- item 8: an unknown alert's acknowledgement: one answer, one document ---------------------


@pytest.mark.asyncio
async def test_an_unknown_alerts_ack_is_403_as_the_docs_say(sites: StartSite) -> None:
    site = await sites()
    body = json.dumps({"token": "ab" * 32}).encode()
    before = durable_state(site.fed.ws)
    head = request_head(
        "POST",
        "/v1/alerts/999/ack",
        [("Content-Type", "application/json")],
        content_length=len(body),
    )
    answer = await exchange(site.port, head + body)
    assert answer.status == 403 and answer.error()[0] == "forbidden"
    assert_unchanged(before, durable_state(site.fed.ws))
    for doc in ("monitoring.md", "security.md"):
        text = " ".join((DOCS / doc).read_text().split())
        assert "unknown alert" in text, doc
        assert not re.search(r"unknown alert[^.]{0,40}\b404\b", text), doc
        assert re.search(r"unknown alert[^.]{0,80}\b403\b|403[^.]{0,80}unknown alert", text), doc


# -- item 5: one observer cannot hold every live stream ---------------------------------------


async def _open_stream(site: Site, token: str) -> tuple[int, asyncio.StreamWriter]:
    """Open a live stream with ``token``: its status, and the connection (kept open)."""
    reader, writer = await asyncio.open_connection(HOST, site.port)
    writer.write(
        request_head(
            "GET",
            "/dashboard/api/events",
            [("Host", site.loopback), ("Authorization", f"Bearer {token}")],
        )
    )
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
    return int(head.split(b" ", 2)[1]), writer


@pytest.mark.asyncio
async def test_one_observer_holds_at_most_its_share_of_the_live_streams(
    sites: StartSite,
) -> None:
    site = await sites(**CLOSED)
    ops = site.served.app[OPS]
    mine, theirs = site.issue(observer="obs"), site.issue(observer="obs2")
    held = []
    try:
        for _ in range(MAX_STREAMS_PER_VIEWER):
            status, writer = await _open_stream(site, mine)
            held.append(writer)
            assert status == 200
        status, writer = await _open_stream(site, mine)
        held.append(writer)
        assert status == 503
        assert ops.streams == MAX_STREAMS_PER_VIEWER
        status, writer = await _open_stream(site, theirs)  # another observer gets in
        held.append(writer)
        assert status == 200
    finally:
        for writer in held:
            await close(writer)
        await site.streams_ended()


# -- item 5: refused members' norms and cosines are not every role's ---------------------------

REASONS = {
    "a1": "fltrust: its update does not point the reference's way (cosine -0.9421)",
    "a2": "its norm 41.7 is over 3 times the median update norm 2.1",
}


def _closed_round_with_refusals(fed: Federation) -> None:
    summary = wire.RoundSummary(
        round=1,
        attempt=0,
        stage="closed",
        cohort=3,
        participants=3,
        survivors=1,
        dropped=["a1", "a2"],
        model_version=1,
        accuracy=None,
        loss=None,
        aggregation_s=0.1,
        duration_s=1.0,
        epsilon_max=None,
        detail="aggregation rule fltrust refused "
        + "; ".join(f"{m}: {r}" for m, r in REASONS.items()),
        refused=dict(REASONS),
    )
    state = fed.ws.state
    state.rounds.open(1, 0, 0.0)
    state.rounds.close(
        1, 0, "closed", 1.0, model_version=1, summary=wire.encode(summary), detail=""
    )


async def _status(port: int, fed: Federation, who: str) -> wire.FederationStatus:
    answer = await exchange(port, signed_request(fed.identities[who], "GET", "/v1/status"))
    assert answer.status == 200, answer
    return msgspec.json.decode(answer.body, type=wire.FederationStatus)


@pytest.mark.asyncio
async def test_a_member_reads_its_own_refusal_and_no_one_elses(tmp_path: Path) -> None:
    fed = make_federation(
        tmp_path / "ws", ("a0", "a1", "a2"), observers=("obs",), auditors=("aud",)
    )
    _closed_round_with_refusals(fed)
    served = await serve(fed.ws, Coordinator(fed.ws))
    try:
        for who in ("a0", "a1", "a2"):
            (summary,) = (await _status(served.port, fed, who)).history
            assert summary.refused == ({who: REASONS[who]} if who in REASONS else {})
            shown = json.dumps(msgspec.to_builtins(summary))
            for reason in (r for m, r in REASONS.items() if m != who):
                assert reason not in shown
            assert summary.dropped == ["a1", "a2"]  # who is out of the sum stays public
        for who in ("obs", "aud"):  # the operator's role and the checkers read them all
            (summary,) = (await _status(served.port, fed, who)).history
            assert summary.refused == REASONS
    finally:
        await served.stop()


# -- item 5: the plaintext archive is the aggregator's alone ----------------------------------


def test_archive_objects_are_readable_by_their_owner_only(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        archive = Archive(tmp_path / "archive")
        digest = archive.put(b"a member's update, in plaintext with secure_sum = none")
    finally:
        os.umask(old)
    path = archive.path(digest)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


# -- item 5: a webhook carries an ack capability, so not over plain HTTP -----------------------


@pytest.mark.parametrize(
    "url",
    [
        "http://alerts.example/hook",
        "http://10.0.0.7:9000/hook",
        "http://[2001:db8::1]/hook",
        "http://127.0.0.1.evil.example/hook",
        "ftp://alerts.example/hook",
        "https:///hook",
        "https://alerts.example:notaport/hook",
    ],
)
def test_a_webhook_that_is_not_https_or_loopback_is_refused(url: str) -> None:
    text = config_text(alerts={"webhooks": [url]})
    with pytest.raises(ConfigError, match=r"alerts\.webhooks\[0\]: expected an https:// URL"):
        parse_federation_config(text)


@pytest.mark.parametrize(
    "url",
    [
        "https://alerts.example/hook",
        "http://127.0.0.1:9000/hook",
        "http://localhost/hook",
        "http://[::1]:9000/hook",
    ],
)
def test_an_https_or_loopback_webhook_is_accepted(url: str) -> None:
    cfg = parse_federation_config(config_text(alerts={"webhooks": [url]}))
    assert cfg.alerts.webhooks == [url]


def test_a_request_with_no_host_is_not_loopback() -> None:
    # aiohttp's request.host falls back to the address the request arrived on when
    # there is no Host header (the machine's name in older versions): loopback here
    transport = mock.Mock()
    transport.get_extra_info.return_value = ("127.0.0.1", 40000)
    request = make_mocked_request("GET", "/metrics", headers={}, transport=transport)
    assert request.remote == "127.0.0.1" and request.host.startswith("127.0.0.1")
    assert not is_loopback(request)


# -- item 5: the dashboard's token is posted, never put in an address --------------------------


@pytest.mark.asyncio
async def test_a_token_in_the_address_opens_no_session(sites: StartSite) -> None:
    site = await sites(**CLOSED)
    token = site.issue()
    before = durable_state(site.fed.ws)
    answer = await site.get(f"/dashboard?token={token}")
    assert answer.status == 400 and answer.error()[0] == "bad_request"
    assert "Set-Cookie" not in answer.headers and token not in answer.body.decode()
    assert_unchanged(before, durable_state(site.fed.ws))


@pytest.mark.asyncio
async def test_a_browser_without_a_session_gets_the_sign_in_form(sites: StartSite) -> None:
    site = await sites(**CLOSED)
    answer = await site.get("/dashboard", headers=(("Accept", "text/html,*/*;q=0.8"),))
    assert answer.status == 401 and answer.headers["Content-Type"].startswith("text/html")
    page = answer.body.decode()
    assert re.search(r'<form method="post" action="/dashboard"', page), page
    assert 'name="token" type="password"' in page
    assert "<script" not in page
    csp = answer.headers["Content-Security-Policy"]
    assert "form-action 'self'" in csp and "script-src 'self'" in csp
    # the same form again after a refused sign-in, and no cookie
    refused = await sign_in(site, b"token=fdt_" + b"0" * 64, headers=(("Accept", "text/html"),))
    assert refused.status == 401 and b'action="/dashboard"' in refused.body
    assert "Set-Cookie" not in refused.headers


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("host", "secure"),
    [
        ("{loopback}", False),  # the operator on the aggregator's machine
        ("localhost:{port}", False),
        ("dashboard.example.org", True),  # a TLS-terminating proxy forwarding its Host
        ("10.0.0.7:{port}", True),
    ],
)
async def test_the_session_cookie_is_secure_unless_plain_loopback(
    sites: StartSite, host: str, secure: bool
) -> None:
    site = await sites(**CLOSED)
    host = host.format(loopback=site.loopback, port=site.port)
    answer = await sign_in(site, f"token={site.issue()}".encode(), host=host)
    assert answer.status == 303, answer
    (header,) = answer.headers.getall("Set-Cookie")
    assert ("Secure" in header.split("; ")) == secure, header


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "headers",
    [
        (("Origin", "https://evil.example"),),
        (("Sec-Fetch-Site", "cross-site"),),
        (("Sec-Fetch-Site", "same-site"),),
    ],
)
async def test_a_sign_in_posted_from_another_site_is_refused(
    sites: StartSite, headers: tuple[tuple[str, str], ...]
) -> None:
    site = await sites(**CLOSED)
    token = site.issue()
    before = durable_state(site.fed.ws)
    answer = await sign_in(site, f"token={token}".encode(), headers=headers)
    assert answer.status == 403 and answer.error()[0] == "forbidden"
    assert "Set-Cookie" not in answer.headers
    assert_unchanged(before, durable_state(site.fed.ws))
    same = (("Origin", f"http://{site.loopback}"), ("Sec-Fetch-Site", "same-origin"))
    assert (await sign_in(site, f"token={token}".encode(), headers=same)).status == 303
    # our own form, sent under Referrer-Policy: no-referrer, posts "Origin: null"
    ours = (("Origin", "null"), ("Sec-Fetch-Site", "same-origin"))
    assert (await sign_in(site, f"token={token}".encode(), headers=ours)).status == 303


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("body", "content_type", "status"),
    [
        (b"token=fdt_" + b"a" * 64, "application/json", 400),
        (b"token=a&token=b", None, 400),
        (b"token=a&other=b", None, 400),
        (b"tok=a", None, 400),
        (b"token=fdt_\xff" + b"a" * 63, None, 400),
        (b"token=" + b"a" * 2000, None, 413),
    ],
)
async def test_a_malformed_sign_in_is_a_4xx_and_sets_no_cookie(
    sites: StartSite, body: bytes, content_type: str | None, status: int
) -> None:
    site = await sites(**CLOSED)
    before = durable_state(site.fed.ws)
    headers = (("Content-Type", content_type),) if content_type else ()
    answer = await sign_in(site, body, headers=headers)
    assert answer.status == status, answer
    assert "Set-Cookie" not in answer.headers
    assert_unchanged(before, durable_state(site.fed.ws))
