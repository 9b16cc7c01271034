"""A host with no key cannot lock members out by holding connections (issue 32, item 7).

The real aggregator is served on loopback with its connection rules
(:func:`fedsec.aggregator.transport.start_server`); clients bind to other loopback
addresses (127.0.0.2, 127.0.0.3, ...) to stand for other hosts.  ``max_connections`` is
lowered so the flood stays small; the rule under test does not depend on the number.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from fedsec.aggregator.coordinator import Coordinator
from tests.support.aggregator import Federation, make_federation
from tests.support.hostile import HOST, Served, read_answer, request_head, serve, signed_request

MAX_CONNECTIONS = 12
PER_PEER = 4
# Bound on anything that should happen at once (an answer, a refusal, a close).
PROMPT_S = 5.0
ATTACKER = "127.0.0.9"
MEMBER = "127.0.0.2"
HEALTH = request_head("GET", "/v1/health")

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@pytest.fixture
def fed(tmp_path: Path) -> Federation:
    return make_federation(
        tmp_path / "ws",
        agents=("a0", "a1"),
        server={
            "max_connections": MAX_CONNECTIONS,
            "max_connections_per_peer": PER_PEER,
            # long: a close during the test can only be the connection rules'
            "header_timeout_s": 60.0,
        },
        validation=False,
    )


@pytest_asyncio.fixture
async def served(fed: Federation) -> AsyncIterator[Served]:
    running = await serve(fed.ws, Coordinator(fed.ws))
    yield running
    await asyncio.wait_for(running.stop(), 2 * PROMPT_S)


@contextlib.asynccontextmanager
async def _connections(port: int, source: str, count: int) -> AsyncIterator[list[Connection]]:
    """``count`` idle connections from ``source``, closed on exit."""
    opened: list[Connection] = []
    try:
        for _ in range(count):
            opened.append(
                await asyncio.wait_for(
                    asyncio.open_connection(HOST, port, local_addr=(source, 0)), PROMPT_S
                )
            )
        yield opened
    finally:
        for _, writer in opened:
            writer.close()


async def _ask(port: int, source: str, data: bytes) -> int:
    """Status of the answer to ``data`` sent from ``source`` on a new connection; 0 when
    the connection is closed without one."""
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(HOST, port, local_addr=(source, 0)), PROMPT_S
    )
    try:
        writer.write(data)
        return (await asyncio.wait_for(read_answer(reader), PROMPT_S)).status
    except (asyncio.IncompleteReadError, ConnectionError):
        return 0
    finally:
        writer.close()


async def _closed(conn: Connection) -> bool:
    """True when the server has closed ``conn`` (it reads end of file at once)."""
    try:
        return await asyncio.wait_for(conn[0].read(1), PROMPT_S) == b""
    except ConnectionError:
        return True


def _signed_get(fed: Federation, target: str) -> bytes:
    return signed_request(fed.identities["a0"], "GET", target)


@pytest.mark.asyncio
async def test_idle_connections_from_one_host_do_not_starve_health_or_members(
    served: Served, fed: Federation, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fedsec.aggregator.transport")
    flood = MAX_CONNECTIONS + 4  # more than the whole listener takes
    async with _connections(served.port, ATTACKER, flood) as attack:
        # the attacker holds at most its share; the rest were closed on accept
        closed = [await _closed(c) for c in attack[PER_PEER:]]
        assert all(closed)
        assert await _ask(served.port, MEMBER, HEALTH) == 200
        assert await _ask(served.port, MEMBER, _signed_get(fed, "/v1/round")) == 200
        # the attacker's own address gets nothing more, not even health
        assert await _ask(served.port, ATTACKER, HEALTH) == 0
    assert any("reason=max_connections_per_peer" in r.getMessage() for r in caplog.records)


@pytest.mark.asyncio
async def test_a_flood_from_many_hosts_gives_way_to_a_member(
    served: Served, fed: Federation, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fedsec.aggregator.transport")
    # a member's authenticated connection, kept open (keep-alive) through the flood
    reader, writer = await asyncio.open_connection(HOST, served.port, local_addr=(MEMBER, 0))
    writer.write(_signed_get(fed, "/v1/round"))
    assert (await asyncio.wait_for(read_answer(reader), PROMPT_S)).status == 200

    sources = [f"127.0.0.{10 + i}" for i in range(MAX_CONNECTIONS // PER_PEER + 1)]
    async with contextlib.AsyncExitStack() as stack:
        for source in sources:  # every slot the member does not hold, and more
            await stack.enter_async_context(_connections(served.port, source, PER_PEER))
        # the authenticated connection was not displaced, and still answers
        writer.write(_signed_get(fed, "/v1/round"))
        assert (await asyncio.wait_for(read_answer(reader), PROMPT_S)).status == 200
        # a new member connection takes the place of the oldest idle unauthenticated one
        assert await _ask(served.port, "127.0.0.3", _signed_get(fed, "/v1/round")) == 200
        assert await _ask(served.port, "127.0.0.4", HEALTH) == 200
    writer.close()
    assert any("event=connection_evicted" in r.getMessage() for r in caplog.records)


@pytest.mark.asyncio
async def test_an_unauthenticated_body_gets_the_header_deadline(tmp_path: Path) -> None:
    fed = make_federation(
        tmp_path / "ws",
        agents=("a0", "a1"),
        server={"header_timeout_s": 0.5, "body_timeout_s": 60.0},
        validation=False,
    )
    served = await serve(fed.ws, Coordinator(fed.ws))
    try:
        loop = asyncio.get_running_loop()
        begun = loop.time()
        head = request_head(
            "POST",
            "/v1/alerts/1/ack",
            {"Content-Type": "application/json"},
            content_length=80,
        )
        reader, writer = await asyncio.open_connection(HOST, served.port)
        writer.write(head)  # and never the body
        answer = await asyncio.wait_for(read_answer(reader), PROMPT_S)
        writer.close()
        assert answer.status == 408 and answer.error()[0] == "request_timeout"
        assert loop.time() - begun < PROMPT_S  # not body_timeout_s
    finally:
        await served.stop()
