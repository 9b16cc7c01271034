"""The URL a leader advertises (``[server] advertise_url``, else the URL it listens on)
is the one a standby names in its ``503 not_leader``: behind a proxy the listening
address is not where members reach the leader."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.http.app import make_app
from fedsec.aggregator.http.errors import LEADER_HEADER
from fedsec.aggregator.replica import serve_replica
from fedsec.aggregator.workspace import Workspace
from fedsec.config import parse_federation_config
from fedsec.errors import ConfigError
from tests.support.aggregator import FakeClock, config_text, make_federation
from tests.support.http import JOIN, Api, _join_body

PUBLIC_URL = "https://aggregator-a.consortium.example"


@pytest.mark.asyncio
@pytest.mark.parametrize("advertised", [PUBLIC_URL, ""])
async def test_a_standby_names_the_url_the_leader_advertises(
    tmp_path: Path,
    database: str,
    aiohttp_client: Callable[..., Awaitable[TestClient]],
    advertised: str,
) -> None:
    fed = make_federation(
        tmp_path / "ws",
        agents=("a0", "a1"),
        validation=False,
        server={"advertise_url": advertised},
        sections={"storage": {"url": database}},
    )
    serving: asyncio.Queue[str] = asyncio.Queue()
    stop = asyncio.Event()
    leader = asyncio.create_task(
        serve_replica(fed.ws, "127.0.0.1", 0, None, stop, on_serving=serving.put_nowait)
    )
    listening = await asyncio.wait_for(serving.get(), 10)
    standby_ws = Workspace.open(tmp_path / "ws")
    standby = Coordinator(standby_ws, clock=FakeClock())
    b = Api(await aiohttp_client(make_app(standby_ws, standby)), fed, standby)
    try:
        body = _join_body("a0")
        headers = b.headers("a0", "POST", JOIN, body)
        async with b.client.request("POST", JOIN, data=body, headers=headers) as resp:
            status, answer, named = resp.status, json.loads(await resp.read()), resp.headers
        expected = advertised or listening
        assert (status, answer["error"]) == (503, "not_leader")
        assert named[LEADER_HEADER] == expected and expected in answer["detail"]
    finally:
        await b.client.close()
        standby_ws.close()
        stop.set()
        await leader
        fed.ws.close()


@pytest.mark.parametrize("url", ["aggregator-a:8443", "ftp://aggregator-a", "https://"])
def test_an_advertise_url_that_is_not_an_http_url_is_refused(url: str) -> None:
    with pytest.raises(ConfigError, match=r"server\.advertise_url"):
        parse_federation_config(config_text(server={"advertise_url": url}))
