"""The aggregator's HTTP API in tests: a served federation and a signed caller (Api),
with the helpers that drive a round over HTTP."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp.test_utils import TestClient

from fedsec.aggregator.coordinator import Coordinator
from fedsec.crypto.httpsig import sign_request
from fedsec.crypto.identity import SigningIdentity
from fedsec.protocol import wire
from tests.support.aggregator import (
    Cohort,
    Federation,
    join_request,
    snapshot,
)

AGENTS = ("a0", "a1", "a2", "a3")
MAX_BODY = 4096  # a masked vector of this task is ~1.5 KB
MAX_JSON = 2048
JOIN = "/v1/rounds/1/join?attempt=0"
MASKED = "/v1/rounds/1/masked-input"


class Api:
    """Signed requests to a running aggregator, as an agent would make them."""

    def __init__(self, client: TestClient, fed: Federation, coord: Coordinator) -> None:
        self.client = client
        self.fed = fed
        self.coord = coord

    def identity(self, who: str | SigningIdentity) -> SigningIdentity:
        return who if isinstance(who, SigningIdentity) else self.fed.identities[who]

    def headers(
        self, who: str | SigningIdentity, method: str, path: str, body: bytes, **kw: Any
    ) -> dict[str, str]:
        return sign_request(self.identity(who), method, path, {}, body, **kw)

    async def send(
        self, method: str, path: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, bytes, str]:
        async with self.client.request(method, path, data=body, headers=headers) as resp:
            return resp.status, await resp.read(), resp.content_type

    async def call(
        self, who: str | SigningIdentity, method: str, path: str, body: bytes = b""
    ) -> tuple[int, bytes, str]:
        return await self.send(method, path, body, self.headers(who, method, path, body))

    async def ok(self, who: str, method: str, path: str, body: Any = b"") -> Any:
        raw_body = body if isinstance(body, bytes) else wire.encode(body)
        status, raw, _ = await self.call(who, method, path, raw_body)
        assert status == 200, raw
        return json.loads(raw)

    async def refused(
        self,
        status: int,
        code: str,
        request: Callable[[], Awaitable[tuple[int, bytes, str]]],
    ) -> str:
        """The request is answered ``status`` with error ``code`` and nothing changes."""
        before = snapshot(self.fed.ws, self.coord)
        got, raw, content_type = await request()
        assert (got, content_type) == (status, "application/json"), raw
        body = json.loads(raw)
        assert set(body) == {"error", "detail"}, body
        assert body["error"] == code, body
        assert isinstance(body["detail"], str) and body["detail"]
        assert snapshot(self.fed.ws, self.coord) == before
        return str(body["detail"])

    async def wait_stage(self, stage: str, timeout: float = 10.0) -> wire.RoundState:
        """Long-poll GET /round until the round reaches ``stage`` (or fail at the deadline)."""
        deadline = asyncio.get_running_loop().time() + timeout
        state = msgspec.convert(await self.ok("a0", "GET", "/v1/round"), wire.RoundState)
        while state.stage != stage:
            assert asyncio.get_running_loop().time() < deadline, f"stuck in {state.stage}"
            path = f"/v1/round?wait={state.token}&timeout=1"
            state = msgspec.convert(await self.ok("a0", "GET", path), wire.RoundState)
        return state


def _masked_path(commitment: str, signature: str, round_: int = 1, attempt: int = 0) -> str:
    """The masked-input target carrying a contribution statement as query parameters."""
    return (
        f"/v1/rounds/{round_}/masked-input?attempt={attempt}"
        f"&commitment={commitment}&signature={signature}"
    )


def _upload(cohort: Cohort, member: str, raw: bytes | None = None, **kw: Any) -> tuple[str, bytes]:
    """(path, body) of ``member``'s masked input with its signed statement."""
    body, commitment, signature = cohort.upload(member, raw, **kw)
    return _masked_path(commitment, signature), body


def _join_body(member: str = "a0", **changes: Any) -> bytes:
    return wire.encode(msgspec.structs.replace(join_request(member), **changes))


async def _fix_cohort(api: Api, members: tuple[str, ...] = AGENTS) -> Cohort:
    for m in members:
        await api.ok(m, "POST", JOIN, join_request(m))
    state = await api.wait_stage("advertise")
    assert state.spec is not None
    return Cohort(state.spec, api.fed.identities)


async def _to_masked_input(api: Api, members: tuple[str, ...] = AGENTS) -> Cohort:
    cohort = await _fix_cohort(api, members)
    for m in members:
        await api.ok(m, "POST", "/v1/rounds/1/advertise", cohort.advertise(m))
    await api.wait_stage("share_keys")
    for m in members:
        keys = msgspec.convert(await api.ok(m, "GET", "/v1/rounds/1/keys"), wire.KeyListBody)
        await api.ok(m, "POST", "/v1/rounds/1/shares", cohort.share_keys(m, keys))
    await api.wait_stage("masked_input")
    for m in members:
        relay = await api.ok(m, "GET", "/v1/rounds/1/shares")
        cohort.receive_shares(m, msgspec.convert(relay, wire.ShareRelayBody))
    return cohort
