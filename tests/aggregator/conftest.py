"""Fixtures of the aggregator tests: a federation of AGENTS, a fake clock and the
aggregator served on loopback with a signed caller (tests.support.http.Api)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.http import make_app
from tests.support.aggregator import (
    FakeClock,
    Federation,
    make_federation,
)
from tests.support.http import AGENTS, MAX_BODY, MAX_JSON, Api


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def fed(tmp_path: Path) -> Federation:
    fed = make_federation(
        tmp_path / "ws",
        agents=(*AGENTS, "gone"),
        observers=("obs",),
        auditors=("aud",),
        # 4 members; t = 2 lets the round survive losing one of them
        round={"threshold": 2},
        server={"max_body_bytes": MAX_BODY, "max_json_bytes": MAX_JSON},
        validation=False,
    )
    fed.ws.roster.revoke("gone", fed.ws.admin())
    return fed


@pytest_asyncio.fixture
async def api(
    fed: Federation, clock: FakeClock, aiohttp_client: Callable[..., Awaitable[TestClient]]
) -> Api:
    coord = Coordinator(fed.ws, clock=clock)
    client = await aiohttp_client(make_app(fed.ws, coord))
    assert client.server.host == "127.0.0.1"
    return Api(client, fed, coord)
