"""A standby (or any replica) that loses its database answers ``503`` with a sentence
saying so, never ``500``: the network to PostgreSQL is cut by a proxy after the
replicas opened through it, and every endpoint of the API is then called, signed by a
member of the role it serves."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.http.app import make_app
from fedsec.aggregator.storage.leadership import local_role
from fedsec.aggregator.workspace import Workspace
from fedsec.protocol.endpoints import ENDPOINTS, Endpoint
from tests.support.aggregator import FakeClock, make_federation
from tests.support.http import Api
from tests.support.proxy import TcpProxy

pytestmark = pytest.mark.asyncio

_SIGNER = {"agent": "a0", "auditor": "au", "custodian": "cu", "observer": "ob"}


@pytest_asyncio.fixture
async def cut_standby(
    tmp_path: Path, database: str, aiohttp_client: Callable[..., Awaitable[TestClient]]
) -> AsyncIterator[tuple[Api, TcpProxy]]:
    target = urlsplit(database)
    proxy = TcpProxy((str(target.hostname), int(target.port or 5432)))
    fed = make_federation(
        tmp_path / "ws",
        agents=("a0", "a1"),
        observers=("ob",),
        auditors=("au",),
        custodians=("cu",),
        validation=False,
        sections={"storage": {"url": proxy.url_for(database)}},
    )
    clock = FakeClock()
    Coordinator(fed.ws, clock=clock)  # the leader: it holds the lease
    standby_ws = Workspace.open(tmp_path / "ws")
    standby = Coordinator(standby_ws, clock=clock)
    api = Api(await aiohttp_client(make_app(standby_ws, standby)), fed, standby)
    assert local_role(standby_ws.state).role == "standby"
    proxy.cut()
    yield api, proxy
    await api.client.close()
    standby_ws.close()
    fed.ws.close()


def _path(endpoint: Endpoint) -> str:
    return re.sub(
        r"\{[a-z0-9_]+\}", lambda m: "a" * 64 if m[0] == "{sha256}" else "1", endpoint.template
    )


async def _call(api: Api, endpoint: Endpoint) -> tuple[int, dict[str, str]]:
    path = _path(endpoint)
    body = b"{}" if endpoint.method == "POST" else b""
    if endpoint.roles:
        headers = api.headers(_SIGNER[endpoint.roles[0]], endpoint.method, path, body)
    else:
        headers = {"Authorization": "Bearer fdt_" + "0" * 64}
    status, raw, content_type = await api.send(endpoint.method, path, body, headers)
    answer = json.loads(raw) if content_type == "application/json" and status >= 400 else {}
    return status, answer


async def test_a_standby_cut_from_its_database_answers_503_never_500(
    cut_standby: tuple[Api, TcpProxy],
) -> None:
    api, _ = cut_standby
    answers = {e.name: await _call(api, e) for e in ENDPOINTS}
    bugs = {name: a for name, a in answers.items() if a[0] >= 500 and a[0] != 503}
    assert bugs == {}
    unavailable = {name for name, (status, _) in answers.items() if status == 503}
    # the writes and every signed request need the database (the nonce, the standby's
    # refusal naming the leader): each says why it cannot be served
    assert {"join", "masked_input", "get_round", "status", "post_challenge"} <= unavailable
    for name in unavailable:
        _status, answer = answers[name]
        assert answer["error"] == "state_unavailable", (name, answer)
        assert "cannot reach its state database" in answer["detail"], (name, answer)
    # what needs no database still answers
    assert answers["health"][0] == 200
    assert answers["openapi"][0] == 200
