"""A standby takes over mid-round: two workspaces on one PostgreSQL database, the leader
served on loopback stops (its server closed, its lease no longer renewed), the standby's
serve loop (:func:`fedsec.aggregator.replica.serve_replica`) takes the expired lease,
resumes the round through the restart path and closes it with the members' inputs, an
identical retry of an input the old leader accepted getting the same receipt."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import aiohttp
import msgspec
import pytest
from aiohttp.test_utils import TestClient

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.http.app import make_app
from fedsec.aggregator.replica import serve_replica
from fedsec.aggregator.storage.audit_trail import LOG_FILE
from fedsec.aggregator.storage.postgres import PostgresStateStore
from fedsec.aggregator.storage.postgres.lease import LEASE_S
from fedsec.aggregator.workspace import Workspace
from fedsec.protocol import wire
from tests.support.aggregator import FakeClock, make_federation
from tests.support.http import AGENTS, Api, _to_masked_input, _upload

pytestmark = pytest.mark.asyncio


async def _health(session: Any) -> Any:
    async with session.get("/v1/health") as resp:
        assert resp.status == 200
        return await resp.json()


async def test_the_standby_takes_over_and_closes_the_round(
    tmp_path: Path, database: str, aiohttp_client: Callable[..., Awaitable[TestClient]]
) -> None:
    clock = FakeClock()
    fed = make_federation(
        tmp_path / "ws",
        agents=AGENTS,
        round={"threshold": 2},
        validation=False,
        sections={"storage": {"url": database}},
    )
    leader = Coordinator(fed.ws, clock=clock)
    a = Api(await aiohttp_client(make_app(fed.ws, leader)), fed, leader)
    standby_ws = Workspace.open(tmp_path / "ws")
    serving: asyncio.Queue[str] = asyncio.Queue()
    stop = asyncio.Event()
    replica = asyncio.create_task(
        serve_replica(
            standby_ws,
            "127.0.0.1",
            0,
            None,
            stop,
            clock=clock,
            on_serving=serving.put_nowait,
            poll_s=0.1,
        )
    )
    url = await asyncio.wait_for(serving.get(), 10)
    session = aiohttp.ClientSession(base_url=url)
    b = Api(cast(TestClient, session), fed, a.coord)
    try:
        assert await _health(session) == {"status": "ok", "role": "standby"}
        cohort = await _to_masked_input(a)
        receipts = {}
        for m in AGENTS[:2]:
            path, raw = _upload(cohort, m)
            receipts[m] = (path, raw, await a.ok(m, "POST", path, raw))
        # the leader dies: its server stops, its lease is no longer renewed
        store = fed.ws.state
        assert isinstance(store, PostgresStateStore)
        store.lease.stop_keeping()
        await a.client.close()
        killed = time.monotonic()
        assert await asyncio.wait_for(serving.get(), 3 * LEASE_S) == url
        took = time.monotonic() - killed
        assert took <= LEASE_S + 2, took
        assert await _health(session) == {"status": "ok", "role": "leader", "token": 2}
        assert standby_ws.state.alerts.count_open() == {"leader_changed": 1}
        # an identical retry of an input the old leader accepted: the same receipt
        path, raw, receipt = receipts["a0"]
        assert await b.ok("a0", "POST", path, raw) == receipt
        for m in AGENTS[2:]:
            path, raw = _upload(cohort, m)
            await b.ok(m, "POST", path, raw)
        await b.wait_stage("consistency")
        for m in AGENTS:
            request = msgspec.convert(
                await b.ok(m, "GET", "/v1/rounds/1/unmask"), wire.UnmaskRequestBody
            )
            await b.ok(m, "POST", "/v1/rounds/1/consistency", cohort.sign(m, request))
        await b.wait_stage("unmask")
        for m in AGENTS:
            proof = msgspec.convert(
                await b.ok(m, "GET", "/v1/rounds/1/consistency"), wire.ConsistencyProofBody
            )
            await b.ok(m, "POST", "/v1/rounds/1/unmask", cohort.unmask(m, proof))
        state = await b.wait_stage("open")
        assert (state.round, state.rounds_completed, state.model_version) == (2, 1, 2)
        status, _, _ = await b.call("a1", "GET", "/v1/models/2")
        assert status == 200
        assert (
            json.loads((await b.call("a1", "GET", "/v1/rounds/1/receipt"))[1]) == receipts["a1"][2]
        )
        # the log file the standby's first coordinator knew is completed once, by the
        # new leader: it equals the database's chain
        exported = (tmp_path / "ws" / LOG_FILE).read_bytes().splitlines()
        assert exported == [line for _, line in standby_ws.state.log.log_lines()]
    finally:
        await session.close()
        stop.set()
        await replica
        standby_ws.close()
        fed.ws.close()
