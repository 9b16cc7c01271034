"""Two aggregator replicas behind real aiohttp servers on loopback, one PostgreSQL
database: a replay recorded through one replica is refused by the other, and the
standby refuses a state-changing request with ``503 not_leader`` naming the leader."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.http.app import make_app
from fedsec.aggregator.workspace import Workspace
from tests.support.aggregator import FakeClock, make_federation
from tests.support.http import JOIN, Api, _join_body

pytestmark = pytest.mark.asyncio


@pytest_asyncio.fixture
async def replicas(
    tmp_path: Path, database: str, aiohttp_client: Callable[..., Awaitable[TestClient]]
) -> AsyncIterator[tuple[Api, Api]]:
    clock = FakeClock()
    fed = make_federation(tmp_path / "ws", sections={"storage": {"url": database}})
    leader = Coordinator(fed.ws, clock=clock)
    standby_ws = Workspace.open(tmp_path / "ws")  # the lease is held: a standby
    standby = Coordinator(standby_ws, clock=clock)
    a = Api(await aiohttp_client(make_app(fed.ws, leader)), fed, leader)
    b = Api(await aiohttp_client(make_app(standby_ws, standby)), fed, standby)
    yield a, b
    for api in (a, b):  # stop the servers before their stores
        await api.client.close()
    standby_ws.close()
    fed.ws.close()


async def test_a_replay_through_the_other_replica_is_refused(replicas: tuple[Api, Api]) -> None:
    a, b = replicas
    body = _join_body("a0")
    headers = a.headers("a0", "POST", JOIN, body)
    status, raw, _ = await a.send("POST", JOIN, body, headers)
    assert status == 200 and json.loads(raw)["accepted"] is True
    status, raw, _ = await b.send("POST", JOIN, body, headers)
    assert status == 401 and json.loads(raw)["error"] == "replayed", raw
    assert a.fed.ws.state.joins.samples(1, 0) == {"a0": 50}


async def test_the_standby_refuses_a_write_with_not_leader(replicas: tuple[Api, Api]) -> None:
    a, b = replicas
    status, raw, _ = await b.call("a1", "POST", JOIN, _join_body("a1"))
    answer = json.loads(raw)
    assert (status, answer["error"]) == (503, "not_leader"), raw
    assert "is a standby" in answer["detail"] and "leads with token 1" in answer["detail"]
    assert a.fed.ws.state.joins.samples(1, 0) == {}
