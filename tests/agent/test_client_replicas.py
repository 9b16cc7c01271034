"""The client's list of aggregator URLs, against real aiohttp servers on loopback: it
moves on from one it cannot reach, follows a standby's ``503 not_leader`` to the leader
it names when (and only when) the member configured that URL, and stays with the one
that answered."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from fedsec.aggregator_client.transport import Route, Transport
from fedsec.config import parse_agent_config
from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import ConfigError, RetryLater
from fedsec.protocol.wire import LEADER_HEADER, NOT_LEADER

AGENT = SigningIdentity(bytes(range(32)))
ROUND = Route("GET", "/v1/round")

Answer = Callable[[web.Request], web.Response]


class Replica:
    """A loopback server answering every request with ``answer``, counting them."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.requests = 0
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.requests += 1
        return self.answer(request)


def _ok(name: str) -> Answer:
    return lambda _: web.json_response({"from": name})


def _not_leader(leader: str | None) -> Answer:
    def answer(_: web.Request) -> web.Response:
        headers = {"Retry-After": "1"}
        if leader is not None:
            headers[LEADER_HEADER] = leader
        body = {"error": NOT_LEADER, "detail": f"not leader: a standby; {leader} leads"}
        return web.json_response(body, status=503, headers=headers)

    return answer


@asynccontextmanager
async def _serving(*replicas: Replica) -> AsyncIterator[None]:
    servers = []
    try:
        for replica in replicas:
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", replica.handle)
            server = TestServer(app, host="127.0.0.1")
            await server.start_server()
            replica.url = str(server.make_url("")).rstrip("/")
            servers.append(server)
        yield
    finally:
        for server in servers:
            await server.close()


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed: connection refused


def _transport(urls: list[str], slept: list[float], retry_max: int = 4) -> Transport:
    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    return Transport(
        urls,
        AGENT,
        timeout_s=5.0,
        retry_max=retry_max,
        backoff_initial_s=0.5,
        backoff_max_s=2.0,
        sleep=sleep,
    )


async def _round(transport: Transport) -> str:
    raw = await transport.request(ROUND, max_bytes=1024, what="round")
    return str(json.loads(raw)["from"])


@pytest.mark.asyncio
async def test_a_leader_the_member_did_not_configure_is_never_followed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    evil = Replica(_ok("evil"))
    leader = Replica(_ok("leader"))
    async with _serving(evil, leader):
        standby = Replica(_not_leader(evil.url))
        async with _serving(standby):
            slept: list[float] = []
            transport = _transport([standby.url, leader.url], slept)
            with caplog.at_level(logging.WARNING, "fedsec.aggregator_client"):
                assert await _round(transport) == "leader"
            alone = _transport([standby.url], [], retry_max=2)
            with pytest.raises(RetryLater, match="not leader"):
                await _round(alone)
            await transport.close()
            await alone.close()
    # nothing went to the URL the standby named: not the member's request, not its key
    assert evil.requests == 0
    assert standby.requests == 1 + 3 and leader.requests == 1
    refused = [r.getMessage() for r in caplog.records if "aggregator_leader_refused" in r.message]
    assert refused and evil.url in refused[0] and "not followed" in refused[0]
    assert slept == []  # the configured next one was asked at once


@pytest.mark.asyncio
async def test_a_standby_sends_the_member_straight_to_the_configured_leader() -> None:
    other = Replica(_ok("other"))
    leader = Replica(_ok("leader"))
    async with _serving(other, leader):
        standby = Replica(_not_leader(leader.url + "/"))  # normalised as configured
        async with _serving(standby):
            slept: list[float] = []
            transport = _transport([standby.url, other.url, leader.url], slept)
            assert await _round(transport) == "leader"
            assert await _round(transport) == "leader"  # stays with the one that answered
            assert transport.base_url == leader.url
            await transport.close()
    assert (standby.requests, other.requests, leader.requests) == (1, 0, 2)
    assert slept == []


@pytest.mark.asyncio
async def test_an_unreachable_aggregator_gives_way_to_the_next() -> None:
    leader = Replica(_ok("leader"))
    async with _serving(leader):
        slept: list[float] = []
        transport = _transport([_dead_url(), leader.url], slept)
        assert await _round(transport) == "leader"
        assert await _round(transport) == "leader"
        await transport.close()
    assert leader.requests == 2 and slept == []


@pytest.mark.asyncio
async def test_a_standby_naming_a_dead_leader_is_waited_on_until_it_leads() -> None:
    dead = _dead_url()
    calls = {"n": 0}
    not_leader = _not_leader(dead)

    def taking_over(request: web.Request) -> web.Response:
        calls["n"] += 1
        return not_leader(request) if calls["n"] <= 2 else web.json_response({"from": "new"})

    standby = Replica(taking_over)
    async with _serving(standby):
        slept: list[float] = []
        transport = _transport([dead, standby.url], slept)
        assert await _round(transport) == "new"
        await transport.close()
    # dead (refused) -> standby at once -> the named leader is the dead one: wait there
    # for its Retry-After rather than go back to it
    assert standby.requests == 3 and slept == [1.0, 1.0]


def test_agent_toml_takes_one_url_or_a_list() -> None:
    key = "ab" * 32
    base = f'[agent]\nid = "m"\naggregator_public_key = "{key}"\n'
    one = parse_agent_config(base + 'aggregator_url = "https://a.example"\n')
    assert one.agent.aggregator_url == "https://a.example"
    urls = '["https://a.example", "https://b.example:8443"]'
    several = parse_agent_config(base + f"aggregator_url = {urls}\n")
    assert several.agent.aggregator_url == ["https://a.example", "https://b.example:8443"]
    for bad in ("[]", '["https://a.example", "b.example"]'):
        with pytest.raises(ConfigError, match=r"agent\.aggregator_url"):
            parse_agent_config(base + f"aggregator_url = {bad}\n")


def test_no_url_is_refused() -> None:
    with pytest.raises(ConfigError, match="no aggregator URL"):
        asyncio.run(_no_url())


async def _no_url() -> None:
    _transport([], [])
