"""The dashboard's snapshot (``GET /dashboard/api/snapshot``) carries, for each round
attempt, what its rounds table shows of distributed DP: the realised noise multiplier,
the coordinates summed and those at the ring's edge (likely wraps), as the round
summaries in the state store hold them, served by a real aggregator on loopback."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.http import make_app
from fedsec.aggregator.transport import start_server
from tests.support.aggregator import make_federation
from tests.support.round_history import DDP_ROUNDS, seed_rounds

pytestmark = pytest.mark.timeout(60)


@pytest.mark.asyncio
async def test_the_snapshot_carries_each_rounds_wraps_and_noise(tmp_path: Path) -> None:
    fed = make_federation(tmp_path)
    seed_rounds(fed.ws)
    app = make_app(fed.ws, Coordinator(fed.ws))
    server = await start_server(app, "127.0.0.1", 0, None, fed.ws.config.server)
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{server.url}/dashboard/api/snapshot") as resp,
        ):
            assert resp.status == 200, await resp.text()
            snapshot = json.loads(await resp.read())
    finally:
        await server.close()
        fed.ws.close()
    shown = {
        r["round"]: (r["noise_multiplier"], r["coordinates"], r["edge_count"])
        for r in snapshot["rounds"]
    }
    assert shown == DDP_ROUNDS
    # the attempt the coordinator opened after the seeded ones is live, not history
    assert snapshot["now"]["round"] == max(DDP_ROUNDS) + 1
