"""The aggregator's listener (fedsec.aggregator.transport), over raw loopback sockets.

The rules are app-agnostic, so a tiny application stands in for the aggregator's: a quick
route, a long-poll-style route that answers HOLD_S after its headers arrived, a route that
reads its body, and one with a bug.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import ssl
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio
from aiohttp import web

from fedsec.aggregator.transport import (
    LOG_LINES_PER_WINDOW,
    MAX_LINE_BYTES,
    PARSER_REJECTIONS_NOTE,
    RunningServer,
    ThrottledLog,
    mark_authenticated,
    peer_key,
    start_server,
)
from fedsec.aggregator_client.limits import IDLE_CONNECTION_S
from fedsec.config import ServerSection
from tests.support.tls import self_signed

HEADER_TIMEOUT_S = 0.5
# A deadline close must come after the timeout (less timer jitter) and well before 3x it.
EARLIEST_S = 0.9 * HEADER_TIMEOUT_S
LATEST_S = 3 * HEADER_TIMEOUT_S
HOLD_S = 2.0  # 4x the header timeout
# Pace of a dribbling client: ten bytes per header timeout.
DRIBBLE_S = HEADER_TIMEOUT_S / 10
# Bound on anything that should happen at once (an answer, a refusal, a close).
PROMPT_S = 5.0

UPLOAD_STARTED = web.AppKey("upload_started", asyncio.Event)
UPLOAD_ENDED = web.AppKey("upload_ended", asyncio.Event)
SENT_BODIES = web.AppKey("sent_bodies", list)
#: A body the size of a 1,000-member key list, as the advertisement's answer carries.
LARGE_BODY_BYTES = 400_000
GET_OK = b"GET /ok HTTP/1.1\r\nHost: test\r\n\r\n"

Start = Callable[..., Awaitable[RunningServer]]


def _app() -> web.Application:
    app = web.Application()
    app[UPLOAD_STARTED] = asyncio.Event()
    app[UPLOAD_ENDED] = asyncio.Event()
    app[SENT_BODIES] = []

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def hold(request: web.Request) -> web.Response:
        await asyncio.sleep(HOLD_S)  # the held answer under test, not synchronisation
        return web.json_response({"held_s": HOLD_S})

    async def upload(request: web.Request) -> web.Response:
        app[UPLOAD_STARTED].set()
        try:
            body = await request.read()  # a disconnect raises out of here, unhandled
        finally:
            app[UPLOAD_ENDED].set()
        return web.json_response({"bytes": len(body)})

    async def bug(request: web.Request) -> web.Response:
        raise RuntimeError("a deliberate bug")

    async def signed(request: web.Request) -> web.Response:
        mark_authenticated(request)  # as a member's signed request is, once verified
        return web.json_response({"ok": True})

    async def peer(request: web.Request) -> web.Response:
        # the client's port as the server sees it: one port, one connection
        peername = request.transport.get_extra_info("peername") if request.transport else None
        return web.json_response({"port": peername[1] if peername else None})

    async def large(request: web.Request) -> web.Response:
        body = _Body(LARGE_BODY_BYTES)
        app[SENT_BODIES].append(weakref.ref(body))
        return web.Response(body=body, content_type="application/octet-stream")

    app.router.add_get("/ok", ok)
    app.router.add_get("/hold", hold)
    app.router.add_post("/upload", upload)
    app.router.add_get("/bug", bug)
    app.router.add_get("/peer", peer)
    app.router.add_get("/signed", signed)
    app.router.add_get("/large", large)
    return app


class _Body(bytearray):
    """A response body the test can hold a weak reference to (bytes cannot have one)."""


@pytest_asyncio.fixture
async def start() -> AsyncIterator[Start]:
    servers: list[RunningServer] = []

    async def start_one(tls: ssl.SSLContext | None = None, **server: object) -> RunningServer:
        settings = {"header_timeout_s": HEADER_TIMEOUT_S, **server}
        cfg = msgspec.structs.replace(ServerSection(), **settings)
        running = await start_server(_app(), "127.0.0.1", 0, tls, cfg)
        servers.append(running)
        return running

    yield start_one
    for running in servers:
        await asyncio.wait_for(running.close(), PROMPT_S)


Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def _connect(server: RunningServer) -> Connection:
    return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", server.port), PROMPT_S)


async def _response(
    reader: asyncio.StreamReader, within: float = PROMPT_S
) -> tuple[int, dict[str, str], bytes]:
    """Status, headers (lower-case names) and body of the next response."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), within)
    status_line, *lines = head.decode("latin-1").rstrip("\r\n").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines)}
    body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), within)
    return int(status_line.split()[1]), headers, body


async def _get_ok(conn: Connection) -> int:
    reader, writer = conn
    writer.write(GET_OK)
    status, _, _ = await _response(reader)
    return status


async def _closed_after(reader: asyncio.StreamReader, within: float) -> tuple[float, bytes]:
    """Seconds until the server closes the connection, and what it sent before that."""
    loop = asyncio.get_running_loop()
    start, received = loop.time(), b""
    while chunk := await _read_or_reset(reader, start + within - loop.time()):
        received += chunk
    return loop.time() - start, received


async def _read_or_reset(reader: asyncio.StreamReader, within: float) -> bytes:
    try:
        return await asyncio.wait_for(reader.read(65536), within)
    except ConnectionResetError:
        return b""


async def _dribble_until_closed(conn: Connection, head: bytes, within: float) -> float:
    """Send ``head`` a byte at a time, one per DRIBBLE_S; seconds until the server closed."""
    reader, writer = conn
    loop = asyncio.get_running_loop()
    start = loop.time()
    for i in range(len(head)):
        assert loop.time() - start < within, "the server never closed the connection"
        writer.write(head[i : i + 1])
        try:
            if await _read_or_reset(reader, DRIBBLE_S) == b"":
                return loop.time() - start
        except TimeoutError:
            continue  # still open: next byte
    raise AssertionError("the whole head went out before the server closed the connection")


async def _wait_until(condition: Callable[[], bool], within: float = PROMPT_S) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not condition():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def _padded_head() -> bytes:
    """A request head long enough that dribbling it outlasts LATEST_S."""
    pad = b"a" * int(2 * LATEST_S / DRIBBLE_S)
    return b"GET /ok HTTP/1.1\r\nHost: test\r\nX-Pad: " + pad + b"\r\n\r\n"


# -- header deadline ------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_connection_dribbling_its_headers_is_closed_at_the_header_deadline(
    start: Start,
) -> None:
    server = await start()
    conn = await _connect(server)
    elapsed = await _dribble_until_closed(conn, _padded_head(), LATEST_S)
    assert EARLIEST_S <= elapsed < LATEST_S
    await _wait_until(lambda: server.open_connections == 0)


@pytest.mark.asyncio
async def test_a_silent_connection_is_closed_at_the_header_deadline(start: Start) -> None:
    server = await start()
    reader, _ = await _connect(server)
    elapsed, received = await _closed_after(reader, LATEST_S)
    assert EARLIEST_S <= elapsed < LATEST_S
    assert received == b""  # closed without an answer


@pytest.mark.asyncio
async def test_a_keep_alive_connection_gets_the_header_deadline_from_a_heads_first_byte(
    start: Start,
) -> None:
    server = await start()  # keepalive_s: the default, far longer than the test
    conn = await _connect(server)
    assert await _get_ok(conn) == 200
    # idle for longer than the header deadline: kept alive, no head is under way
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(conn[0].read(1), 2 * HEADER_TIMEOUT_S)
    assert await _get_ok(conn) == 200
    # a head dribbled in is cut at the header deadline from its first byte
    elapsed = await _dribble_until_closed(conn, _padded_head(), LATEST_S)
    assert EARLIEST_S <= elapsed < LATEST_S
    await _wait_until(lambda: server.open_connections == 0)


KEEPALIVE_S = 4 * HEADER_TIMEOUT_S


@pytest.mark.asyncio
async def test_an_idle_connection_is_reused_within_the_keep_alive_and_closed_after_it(
    start: Start,
) -> None:
    server = await start(keepalive_s=KEEPALIVE_S)
    reader, writer = await _connect(server)
    ports = []
    for _ in range(2):
        writer.write(b"GET /peer HTTP/1.1\r\nHost: test\r\n\r\n")
        status, _, body = await _response(reader)
        assert status == 200
        ports.append(json.loads(body)["port"])
        assert server.open_connections == 1
        # idle past the header deadline, within the keep-alive: still open
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.read(1), 2 * HEADER_TIMEOUT_S)
    assert ports[0] == ports[1] == writer.get_extra_info("sockname")[1]  # one connection
    # the second answer was 2 header deadlines ago: closed at the keep-alive, no answer
    elapsed, received = await _closed_after(reader, 3 * KEEPALIVE_S)
    assert received == b""
    assert KEEPALIVE_S - 2 * HEADER_TIMEOUT_S - 0.1 * KEEPALIVE_S <= elapsed < 3 * KEEPALIVE_S
    await _wait_until(lambda: server.open_connections == 0)


def test_the_members_client_gives_an_idle_connection_up_before_the_server_does() -> None:
    assert ServerSection().keepalive_s > IDLE_CONNECTION_S


@pytest.mark.asyncio
async def test_a_long_poll_held_past_the_header_deadline_is_answered(start: Start) -> None:
    server = await start()
    reader, writer = await _connect(server)
    loop = asyncio.get_running_loop()
    begun = loop.time()
    writer.write(b"GET /hold HTTP/1.1\r\nHost: test\r\n\r\n")
    status, _, body = await _response(reader, within=HOLD_S + PROMPT_S)
    assert (status, json.loads(body)) == (200, {"held_s": HOLD_S})
    assert loop.time() - begun >= 0.9 * HOLD_S
    assert await _get_ok((reader, writer)) == 200  # and the connection is still usable


def _tls_contexts(tmp_path: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A server context with a fresh self-signed certificate for 127.0.0.1, and a client
    context that trusts it."""
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    self_signed(cert_file, key_file)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert_file, key_file)
    return server, ssl.create_default_context(cafile=cert_file)


@pytest.mark.asyncio
async def test_over_tls_a_stalled_handshake_is_closed_at_the_header_deadline(
    start: Start, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    server_tls, client_tls = _tls_contexts(tmp_path)
    server = await start(tls=server_tls)
    assert server.url.startswith("https://")
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection("127.0.0.1", server.port, ssl=client_tls), PROMPT_S
    )
    assert await _get_ok((reader, writer)) == 200
    writer.close()

    silent, _ = await _connect(server)  # plain TCP: never starts the handshake
    elapsed, received = await _closed_after(silent, LATEST_S)
    assert EARLIEST_S <= elapsed < LATEST_S
    assert received == b""
    _assert_no_error_logged(caplog)


# -- connection limit -----------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_connection_over_the_limit_is_closed_on_accept_when_none_is_idle(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fedsec.aggregator.transport")
    # a long header deadline, so a prompt close can only be the limit's
    server = await start(max_connections=3, header_timeout_s=30.0)
    busy = [await _connect(server) for _ in range(3)]
    for _, writer in busy:  # each in a request: none may be displaced
        writer.write(b"GET /hold HTTP/1.1\r\nHost: test\r\n\r\n")
    await _wait_until(lambda: server.open_connections == 3)

    reader, _ = await _connect(server)
    elapsed, received = await _closed_after(reader, PROMPT_S)
    assert received == b"" and elapsed < PROMPT_S
    assert server.open_connections == 3
    assert any("reason=max_connections " in r.getMessage() for r in caplog.records)

    for reader, _ in busy:  # the first three are untouched: their answers come
        status, _, body = await _response(reader, within=HOLD_S + PROMPT_S)
        assert (status, json.loads(body)) == (200, {"held_s": HOLD_S})
    busy[0][1].close()
    await _wait_until(lambda: server.open_connections == 2)
    assert await _get_ok(await _connect(server)) == 200  # the freed slot is usable


@pytest.mark.asyncio
async def test_at_the_limit_a_new_connection_displaces_the_oldest_idle_one(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fedsec.aggregator.transport")
    server = await start(max_connections=3, header_timeout_s=30.0)
    idle = [await _connect(server) for _ in range(3)]
    assert await _get_ok(idle[1]) == 200  # answered, now idle in keep-alive
    await _wait_until(lambda: server.open_connections == 3)

    newcomer = await _connect(server)
    assert await _get_ok(newcomer) == 200
    elapsed, received = await _closed_after(idle[0][0], PROMPT_S)  # the oldest went
    assert received == b"" and elapsed < PROMPT_S
    assert server.open_connections == 3
    assert await _get_ok(idle[1]) == 200 and await _get_ok(idle[2]) == 200
    assert any("event=connection_evicted" in r.getMessage() for r in caplog.records)


@pytest.mark.asyncio
async def test_a_members_idle_kept_alive_connections_do_not_keep_another_member_out(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    # a member's key fills the listener with connections that each carried a signed
    # request and then idle in keep-alive (server.keepalive_s: the default, 75 s)
    caplog.set_level(logging.INFO, logger="fedsec.aggregator.transport")
    server = await start(max_connections=3, header_timeout_s=30.0)
    held = [await _connect(server) for _ in range(3)]
    for reader, writer in held:
        writer.write(b"GET /signed HTTP/1.1\r\nHost: test\r\n\r\n")
        assert (await _response(reader))[0] == 200
    assert server.open_connections == 3

    newcomer = await _connect(server)  # another member
    assert await _get_ok(newcomer) == 200
    # the oldest idle one made room: closed, without an answer; the others are open
    elapsed, received = await _closed_after(held[0][0], PROMPT_S)
    assert received == b"" and elapsed < PROMPT_S
    assert server.open_connections == 3
    for conn in held[1:]:
        assert await _get_ok(conn) == 200
    assert any("event=connection_evicted" in r.getMessage() for r in caplog.records)


@pytest.mark.asyncio
async def test_one_peers_unauthenticated_connections_are_capped(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fedsec.aggregator.transport")
    server = await start(max_connections=10, max_connections_per_peer=2, header_timeout_s=30.0)
    kept = [await _connect(server) for _ in range(2)]
    reader, _ = await _connect(server)
    elapsed, received = await _closed_after(reader, PROMPT_S)
    assert received == b"" and elapsed < PROMPT_S
    assert server.open_connections == 2
    assert any("reason=max_connections_per_peer" in r.getMessage() for r in caplog.records)
    kept[0][1].close()
    await _wait_until(lambda: server.open_connections == 1)
    assert await _get_ok(await _connect(server)) == 200  # its share is free again


@pytest.mark.parametrize(
    ("peername", "key"),
    [
        (("192.0.2.7", 4711), "192.0.2.7"),
        (("2001:db8:1:2:3:4:5:6", 4711, 0, 0), "2001:db8:1:2::/64"),
        (("2001:db8:1:2:ffff::1", 1, 0, 0), "2001:db8:1:2::/64"),  # one host's /64
        (("::ffff:192.0.2.7", 4711, 0, 0), "192.0.2.7"),
        (("fe80::1%eth0", 1, 0, 2), "fe80::/64"),
        ("/run/fedsec.sock", "/run/fedsec.sock"),
    ],
)
def test_a_peer_is_an_ipv4_address_or_an_ipv6_64(peername: object, key: str) -> None:
    assert peer_key(peername) == key


# -- parser rejections and logs -------------------------------------------------------

MALFORMED = {
    "bad_content_length": b"POST /ok HTTP/1.1\r\nHost: test\r\nContent-Length: abc\r\n\r\n",
    "conflicting_content_length": (
        b"POST /ok HTTP/1.1\r\nHost: test\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"
    ),
    "nul_in_method": b"GE\x00T /ok HTTP/1.1\r\nHost: test\r\n\r\n",
    "nul_in_path": b"GET /o\x00k HTTP/1.1\r\nHost: test\r\n\r\n",
    "oversized_header_line": (
        b"GET /ok HTTP/1.1\r\nHost: test\r\nX-Pad: " + b"a" * (MAX_LINE_BYTES + 1) + b"\r\n\r\n"
    ),
    "not_http": b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03",
}


def _assert_no_error_logged(caplog: pytest.LogCaptureFixture) -> None:
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert [r for r in caplog.records if r.exc_info] == []


@pytest.mark.asyncio
@pytest.mark.parametrize("request_bytes", MALFORMED.values(), ids=MALFORMED.keys())
@pytest.mark.parametrize("after_a_request", [False, True], ids=["first", "keep_alive"])
async def test_malformed_http_gets_a_json_400_and_one_info_line(
    start: Start, caplog: pytest.LogCaptureFixture, request_bytes: bytes, after_a_request: bool
) -> None:
    caplog.set_level(logging.DEBUG)
    server = await start()
    reader, writer = await _connect(server)
    if after_a_request:
        assert await _get_ok((reader, writer)) == 200
    writer.write(request_bytes)
    status, headers, body = await _response(reader)
    assert status == 400
    assert headers["content-type"].startswith("application/json")
    answer = json.loads(body)
    assert answer.keys() == {"error", "detail"} and answer["error"] == "bad_http"
    assert 0 < len(answer["detail"]) <= 200
    assert (await _closed_after(reader, PROMPT_S))[1] == b""  # and the connection is closed
    _assert_no_error_logged(caplog)
    lines = [r for r in caplog.records if "event=bad_http" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert "\n" not in lines[0].getMessage()


@pytest.mark.asyncio
async def test_a_flood_of_malformed_requests_is_logged_within_the_throttle(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fedsec.aggregator.transport")
    server = await start()
    for _ in range(3 * LOG_LINES_PER_WINDOW):
        reader, writer = await _connect(server)
        writer.write(MALFORMED["nul_in_path"])
        assert (await _response(reader))[0] == 400
        writer.close()
    lines = [r for r in caplog.records if "event=bad_http" in r.getMessage()]
    assert len(lines) == LOG_LINES_PER_WINDOW


@pytest.mark.asyncio
async def test_a_client_leaving_mid_body_logs_no_error(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    server = await start()
    _, writer = await _connect(server)
    writer.write(b"POST /upload HTTP/1.1\r\nHost: test\r\nContent-Length: 100000\r\n\r\n0123456789")
    app = server.app
    await asyncio.wait_for(app[UPLOAD_STARTED].wait(), PROMPT_S)
    writer.close()
    await asyncio.wait_for(app[UPLOAD_ENDED].wait(), PROMPT_S)
    await _wait_until(lambda: server.open_connections == 0)
    _assert_no_error_logged(caplog)
    assert any("event=client_disconnected" in r.getMessage() for r in caplog.records)


@pytest.mark.asyncio
async def test_a_server_bug_still_logs_an_error_with_its_traceback(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    server = await start()
    reader, writer = await _connect(server)
    writer.write(b"GET /bug HTTP/1.1\r\nHost: test\r\n\r\n")
    assert (await _response(reader))[0] == 500
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None
    assert isinstance(errors[0].exc_info[1], RuntimeError)


# -- memory -----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_sent_body_is_not_kept_by_its_idle_keep_alive_connection(start: Start) -> None:
    # aiohttp keeps a connection's last response until its next request: 1,000 members
    # idle after an advertisement kept 1,000 copies of the key list (n^2 bytes).
    server = await start(header_timeout_s=4 * PROMPT_S)  # idle, it stays open
    conn = await _connect(server)
    reader, writer = conn
    writer.write(b"GET /large HTTP/1.1\r\nHost: test\r\n\r\n")
    status, _, body = await _response(reader)
    assert (status, len(body)) == (200, LARGE_BODY_BYTES)
    [sent] = server.app[SENT_BODIES]

    def released() -> bool:
        gc.collect()
        return sent() is None

    await _wait_until(released)
    assert server.open_connections == 1  # released while the connection is open and idle
    assert await _get_ok(conn) == 200  # and it still serves


# -- throttle and note ----------------------------------------------------------------


def test_throttled_log_counts_what_it_suppressed(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="throttle-test")
    now = [0.0]
    throttle = ThrottledLog(
        logging.getLogger("throttle-test"), lines=2, window_s=10.0, clock=lambda: now[0]
    )
    for i in range(5):
        throttle.info("event=x n=%d", i)
    now[0] = 10.0
    throttle.info("event=x n=%d", 5)
    assert [r.getMessage() for r in caplog.records] == [
        "event=x n=0",
        "event=x n=1",
        "event=x n=5 suppressed=3",
    ]


def test_parser_rejections_note_names_the_error_code_and_the_limits() -> None:
    assert '"bad_http"' in PARSER_REJECTIONS_NOTE
    assert "server.header_timeout_s" in PARSER_REJECTIONS_NOTE
    assert "server.max_connections" in PARSER_REJECTIONS_NOTE
