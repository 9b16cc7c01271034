"""The leader loses its PostgreSQL database mid-round for a few seconds (the network to
it cut by a proxy, long enough for the lease keeper to miss a renewal, shorter than the
lease): every request that needs the database is answered ``503 state_unavailable``
and changes nothing; once the network is back the same leader, under the same fencing
token, accepts the retries and closes the round with every input, the ones accepted
before the cut included (an identical retry of one gets the receipt it had)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import urlsplit

import msgspec
import numpy as np
import pytest
from aiohttp.test_utils import TestClient

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.http.app import make_app
from fedsec.aggregator.storage.postgres import PostgresStateStore
from fedsec.aggregator.storage.postgres.lease import LEASE_S
from fedsec.protocol import wire
from tests.support.aggregator import FakeClock, expected_params, make_federation, model_params
from tests.support.http import AGENTS, Api, _to_masked_input, _upload
from tests.support.proxy import TcpProxy

pytestmark = pytest.mark.asyncio

_RENEWAL_FAILED = "lease renewal failed"


async def _missed_renewal(caplog: pytest.LogCaptureFixture, deadline_s: float) -> None:
    """Wait until the lease keeper (its own thread) logged a failed renewal."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    while not any(_RENEWAL_FAILED in r.getMessage() for r in caplog.records):
        assert loop.time() < deadline, "the lease keeper never met the cut"
        await asyncio.sleep(0.05)


async def _retried(api: Api, who: str, path: str, raw: bytes) -> object:
    """POST as an agent does after an outage: the request that meets the leader's broken
    connection first is answered 503 (its store reconnects then), the retry is served."""
    for _ in range(2):
        status, body, _ = await api.call(who, "POST", path, raw)
        if status != 503:
            break
        assert json.loads(body)["error"] == "state_unavailable"
    assert status == 200, body
    return json.loads(body)


async def test_the_leader_answers_503_while_its_database_is_away_then_loses_nothing(
    tmp_path: Path,
    database: str,
    aiohttp_client: Callable[..., Awaitable[TestClient]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    target = urlsplit(database)
    proxy = TcpProxy((str(target.hostname), int(target.port or 5432)))
    fed = make_federation(
        tmp_path / "ws",
        agents=AGENTS,
        validation=False,
        sections={"storage": {"url": proxy.url_for(database)}},
    )
    try:
        store = fed.ws.state
        assert isinstance(store, PostgresStateStore)
        leader = Coordinator(fed.ws, clock=FakeClock())
        api = Api(await aiohttp_client(make_app(fed.ws, leader)), fed, leader)
        token = store.lease.token
        cohort = await _to_masked_input(api)
        before = {}
        for m in AGENTS[:2]:
            path, raw = _upload(cohort, m)
            before[m] = (path, raw, await api.ok(m, "POST", path, raw))

        proxy.cut()
        during = {m: _upload(cohort, m) for m in AGENTS[2:]}
        for path, raw in [*during.values(), before["a0"][:2]]:
            status, body, _ = await api.call("a2", "POST", path, raw)
            answer = json.loads(body)
            assert (status, answer["error"]) == (503, "state_unavailable"), answer
            assert "cannot reach its state database" in answer["detail"]
        assert (await api.client.get("/v1/health")).status == 200
        # the outage outlasts a renewal of the lease, not the lease itself
        await _missed_renewal(caplog, 3 * LEASE_S)

        proxy.restore()
        # an identical retry of an input accepted before the cut: the same receipt
        assert await _retried(api, "a0", *before["a0"][:2]) == before["a0"][2]
        # the same leader, the same token: nobody took over, nothing was fenced
        assert (store.lease.token, store.lease.deposed) == (token, False)
        assert store.lease.leads()
        # what was refused during the cut was not recorded: the retries are new inputs
        for m, (path, raw) in during.items():
            await api.ok(m, "POST", path, raw)
        await api.wait_stage("consistency")
        for m in AGENTS:
            request = msgspec.convert(
                await api.ok(m, "GET", "/v1/rounds/1/unmask"), wire.UnmaskRequestBody
            )
            await api.ok(m, "POST", "/v1/rounds/1/consistency", cohort.sign(m, request))
        await api.wait_stage("unmask")
        for m in AGENTS:
            proof = msgspec.convert(
                await api.ok(m, "GET", "/v1/rounds/1/consistency"), wire.ConsistencyProofBody
            )
            await api.ok(m, "POST", "/v1/rounds/1/unmask", cohort.unmask(m, proof))
        state = await api.wait_stage("open")
        assert (state.round, state.rounds_completed, state.model_version) == (2, 1, 2)
        # every member's input is in the model: the exact sum of all four
        exact = expected_params(
            model_params(fed.ws, 1), [cohort.quantized[m] for m in AGENTS], cohort.spec
        )
        np.testing.assert_array_equal(model_params(fed.ws, 2), exact)
        assert store.lease.token == token and store.lease.refused == 0
    finally:
        proxy.cut()
        fed.ws.close()
