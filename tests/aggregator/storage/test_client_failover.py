"""A member's client given both replicas' URLs, through a real take-over: two
``serve_replica`` servers (two workspaces) on one PostgreSQL database, the leader
stopped mid-masked-input without releasing its lease.  The member's identical retry of
the input the old leader accepted finds the new leader by itself (the old URL refuses
the connection, the standby answers ``not_leader`` until it leads) and gets the same
receipt."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import cast

import aiohttp
import pytest
from aiohttp.test_utils import TestClient

from fedsec.aggregator.replica import serve_replica
from fedsec.aggregator.storage.postgres import PostgresStateStore
from fedsec.aggregator.workspace import Workspace
from fedsec.aggregator_client import AggregatorClient
from fedsec.protocol import wire
from tests.support.aggregator import FakeClock, contribution_statement, make_federation
from tests.support.http import AGENTS, Api, _to_masked_input

pytestmark = pytest.mark.asyncio


async def test_an_identical_retry_through_the_url_list_gets_the_same_receipt(
    tmp_path: Path, database: str
) -> None:
    clock = FakeClock()
    fed = make_federation(
        tmp_path / "ws",
        agents=AGENTS,
        round={"threshold": 2},
        validation=False,
        sections={"storage": {"url": database}},
    )
    urls: dict[str, asyncio.Queue[str]] = {"a": asyncio.Queue(), "b": asyncio.Queue()}
    stops = {"a": asyncio.Event(), "b": asyncio.Event()}
    standby_ws = Workspace.open(tmp_path / "ws")
    replicas = {
        name: asyncio.create_task(
            serve_replica(
                ws,
                "127.0.0.1",
                0,
                None,
                stops[name],
                clock=clock,
                on_serving=urls[name].put_nowait,
                poll_s=0.1,
            )
        )
        for name, ws in (("a", fed.ws), ("b", standby_ws))
    }
    leader_url = await asyncio.wait_for(urls["a"].get(), 10)
    standby_url = await asyncio.wait_for(urls["b"].get(), 10)
    session = aiohttp.ClientSession(base_url=leader_url)
    a = Api(cast(TestClient, session), fed, None)  # type: ignore[arg-type]
    member = AggregatorClient(
        [leader_url, standby_url],
        fed.identities["a0"],
        fed.ws.signer.public_bytes,
        retry_max=30,
        backoff_initial_s=0.2,
        backoff_max_s=1.0,
    )
    try:
        cohort = await _to_masked_input(a)
        raw, _, _ = cohort.upload("a0")
        statement = contribution_statement(
            "a0", cohort.spec, raw, cohort.quantized["a0"], fed.identities["a0"]
        )
        receipt, _ = await member.masked_input(1, 0, raw, statement)
        assert member.base_url == leader_url
        # the leader dies: its server stops, its lease is no longer renewed or released
        store = fed.ws.state
        assert isinstance(store, PostgresStateStore)
        store.lease.stop_keeping()
        stops["a"].set()
        await replicas["a"]
        again, _ = await member.masked_input(1, 0, raw, statement)
        assert again == receipt
        assert member.base_url == standby_url
        assert await asyncio.wait_for(urls["b"].get(), 1) == standby_url  # it took over
        state = await member.get_round()
        assert (state.round, state.stage) == (1, "masked_input")
        assert isinstance(state, wire.RoundState)
    finally:
        await member.close()
        await session.close()
        for name in ("a", "b"):
            stops[name].set()
            await replicas[name]
        standby_ws.close()
        fed.ws.close()
