"""The cancellation attack of issue 32 (item 1) against a real aggregator app on a loopback
port and the real custodian service talking to it over HTTP.

The aggregator is malicious through hooks: it hands every ciphertext it accepts to the
colluding member ``a4`` as it arrives, and (:meth:`LeakyCoordinator.late_commit`) it can
reopen the commit step for the colluder after the honest ciphertexts arrived.  The
colluder builds ``Enc(0) − Σ`` of the other honest members' ciphertexts with its own
signed statement, over the real endpoints; the custodian, following the real log and
fetching the real archive, must not release the victim's vector.

Every member commits to its ciphertext's hash before any ciphertext is taken: while the
commit step is open there is nothing to leak, and once it closed the colluder's crafted
ciphertext is not the one it committed to (refused, nothing changed); an aggregator that
takes the colluder's commitment late logs it after the honest ciphertexts, whose
statements bind the set without it, and the custodian refuses before decrypting
anything.  With the aggregator honest, an auditor colluding with a member could take the
ciphertexts from ``GET /v1/audit/archive`` while the attempt is open: the archive refuses
objects of an open attempt to everyone but the custodian in decrypt.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
import tenseal as ts
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.http import make_app
from fedsec.aggregator_client import AggregatorClient
from fedsec.crypto import he
from fedsec.crypto.httpsig import sign_request
from fedsec.custodian.check import Custody
from fedsec.custodian.follow import LogFollower
from fedsec.custodian.service import CustodianService
from fedsec.custodian.store import DecisionLog
from fedsec.protocol import wire
from fedsec.summation.he import HeSession
from tests.support.aggregator import (
    FED,
    FakeClock,
    Federation,
    he_commit_body,
    join_request,
    log_entries,
    make_federation,
    plain_upload,
    quantized_input,
    snapshot,
)

MEMBERS = ("a0", "a1", "a2", "a3", "a4")
VICTIM, COLLUDER = "a0", "a4"
HONEST_OTHERS = ("a1", "a2", "a3")
CUSTODIAN = "kh"
PARAMS = he.HeParams()  # [he]'s defaults


class LeakyCoordinator(Coordinator):
    """The malicious hooks: every accepted ciphertext is handed to the colluder; a late
    commitment can be taken after the ciphertexts."""

    leaked: dict[str, bytes]

    def masked_input(self, member: str, round_: int, attempt: int, raw: bytes, *rest: Any) -> Any:
        receipt = super().masked_input(member, round_, attempt, raw, *rest)
        self.__dict__.setdefault("leaked", {})[member] = raw
        return receipt

    def late_commit(self, member: str, body: wire.CommitBody) -> None:
        """Reopen the commit step for ``member`` (the session's closed set dropped),
        take its commitment, and let the step close again with it in the set."""
        session = self.live.summing()
        assert isinstance(session, HeSession)
        session._commitment_set = None  # the attack's hook
        self.live.stage = "commit"
        self.commit(member, self.live.round, self.live.attempt, body)
        assert self.live.stage == "masked_input"


@dataclass
class Live:
    fed: Federation
    coord: LeakyCoordinator
    url: str
    http: ClientSession
    custody: Custody
    public: bytes


@pytest.fixture(scope="module")
def keys() -> tuple[bytes, bytes]:
    return he.generate_keys(PARAMS)


@pytest_asyncio.fixture
async def live(tmp_path: Path, keys: tuple[bytes, bytes]) -> AsyncIterator[Live]:
    fed = make_federation(
        tmp_path / "ws",
        MEMBERS,
        custodians=(CUSTODIAN,),
        auditors=("aud",),
        round={"secure_sum": "he", "min_agents": 3, "decrypt_s": 30.0},
        sections={"he": {"custodian": CUSTODIAN}},
    )
    coord = LeakyCoordinator(fed.ws, clock=FakeClock())
    secret, public = keys
    custody = Custody(
        federation_id=FED,
        custodian_id=CUSTODIAN,
        public_key=fed.identities[CUSTODIAN].public_bytes,
        context_sha256=hashlib.sha256(public).hexdigest(),
        public_ctx=he.load_public_context(public, PARAMS, PARAMS.context_max_bytes(False)),
        secret_ctx=he.load_secret_context(secret, PARAMS, PARAMS.context_max_bytes(True)),
    )
    server = TestServer(make_app(fed.ws, coord), host="127.0.0.1")
    await server.start_server()
    try:
        async with ClientSession() as http:
            yield Live(fed, coord, str(server.make_url("")), http, custody, public)
    finally:
        await server.close()


async def request(live: Live, who: str, method: str, path: str, body: bytes = b"") -> Any:
    headers = sign_request(live.fed.identities[who], method, path, {}, body)
    async with live.http.request(method, live.url + path, data=body, headers=headers) as resp:
        return resp.status, await resp.read()


async def commit(live: Live, member: str, raw: bytes, expect: int = 200) -> Any:
    spec = live.coord.live.spec
    assert spec is not None
    body = wire.encode(he_commit_body(member, spec, live.fed.identities[member], raw))
    status, answer = await request(live, member, "POST", "/v1/rounds/1/commit?attempt=0", body)
    assert status == expect, answer
    return json.loads(answer)


def commitment_digest(live: Live) -> str:
    """The commitment set's digest, as the members are shown it (GET commit)."""
    shown = live.coord.commitment_set(VICTIM, 1, 0)
    return wire.commitments_digest((c.member, c.vector_sha256) for c in shown.commitments)


async def upload(
    live: Live, member: str, raw: bytes, expect: int = 200, bound: str | None = None
) -> Any:
    spec = live.coord.live.spec
    assert spec is not None
    bound = commitment_digest(live) if bound is None else bound
    _, commitment, signature = plain_upload(
        member, spec, live.fed.identities, raw, commitments_sha256=bound
    )
    path = f"/v1/rounds/1/masked-input?attempt=0&commitment={commitment}&signature={signature}"
    status, answer = await request(live, member, "POST", path, raw)
    assert status == expect, answer
    return json.loads(answer)


def encrypt(live: Live, values: np.ndarray) -> bytes:
    return he.frame_chunks(he.encrypt(live.custody.public_ctx, values.astype(np.float64)))


def cancelling(live: Live, bodies: list[bytes], dim: int) -> bytes:
    """``Enc(0) − Σ bodies``: the public context and the leaked ciphertexts suffice."""
    ctx = live.custody.public_ctx.context
    out = []
    for i, chunk in enumerate(he.encrypt(live.custody.public_ctx, np.zeros(dim))):
        vec = ts.ckks_vector_from(ctx, chunk)
        for body in bodies:
            vec = vec - ts.ckks_vector_from(ctx, he.unframe_chunks(body, PARAMS, dim)[i])
        out.append(bytes(vec.serialize()))
    return he.frame_chunks(out)


async def open_round(live: Live, service: CustodianService) -> wire.RoundSpec:
    await service.publish_context()
    for m in MEMBERS:
        assert live.coord.join(m, 1, 0, join_request()).accepted
    live.coord.tick()
    spec = live.coord.live.spec
    assert spec is not None and live.coord.live.stage == "commit"
    return spec


def custodian_service(live: Live, client: AggregatorClient, tmp_path: Path) -> CustodianService:
    return CustodianService(
        client,
        live.custody,
        live.fed.identities[CUSTODIAN],
        live.public,
        LogFollower(FED, live.fed.ws.signer.public_bytes),
        DecisionLog(tmp_path / "decryptions.jsonl"),
        poll_timeout_s=0.1,
    )


@pytest.mark.asyncio
async def test_a_colluder_cannot_have_the_victims_vector_released(
    live: Live, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    identity = live.fed.identities[CUSTODIAN]
    async with AggregatorClient(
        live.url, identity, live.fed.ws.signer.public_bytes, retry_max=0
    ) as client:
        service = custodian_service(live, client, tmp_path)
        spec = await open_round(live, service)
        dim = spec.dim + 1
        honest = {m: encrypt(live, quantized_input(m, spec)) for m in (VICTIM, *HONEST_OTHERS)}
        for m, raw in honest.items():
            await commit(live, m, raw)
        # the aggregator waits for the colluder, and takes its late commitment once it
        # has built its ciphertext from the honest ones (the hook)
        assert live.coord.live.stage == "commit"
        bound_without = wire.commitments_digest(
            (m, hashlib.sha256(raw).hexdigest()) for m, raw in honest.items()
        )
        # the hooks: the set closes without a4, and masked_input is held open for it
        session = live.coord.live.summing()
        session.close("commit")
        live.coord.live.stage = "masked_input"
        session.complete = lambda stage: False  # type: ignore[method-assign]
        for m, raw in honest.items():
            await upload(live, m, raw, bound=bound_without)
        crafted = cancelling(live, [live.coord.leaked[m] for m in HONEST_OTHERS], dim)
        del session.complete
        live.coord.late_commit(
            COLLUDER, he_commit_body(COLLUDER, spec, live.fed.identities[COLLUDER], crafted)
        )
        await upload(live, COLLUDER, crafted)  # its statement binds the set with it
        assert live.coord.live.stage == "decrypt"

        with caplog.at_level(logging.INFO, logger="fedsec.custodian"):
            await service.handle(1, 0)

    kinds = [e["kind"] for e in log_entries(live.fed.ws)]
    assert "he_decryption" not in kinds, "the custodian released the cancelled sum"
    (decision,) = service.decisions.read()
    assert (decision.outcome, decision.reason) == ("refused", "commitments_differ")
    assert "refused round=1 attempt=0 reason=commitments_differ" in caplog.text
    assert VICTIM in decision.detail  # the first honest statement disagrees with the set
    assert live.coord.live.stage == "decrypt"  # nothing posted; the deadline aborts it


@pytest.mark.asyncio
async def test_no_ciphertext_is_taken_or_served_before_every_commitment_is_fixed(
    live: Live, tmp_path: Path
) -> None:
    """What the colluder can have before it commits: nothing.  While the commit step is
    open, uploads are refused (so the hook has nothing to leak) and the commitment set
    is not served; once it closed, the colluder's ciphertext built from the leaked ones
    is not the one it committed to: refused, and nothing changes."""
    identity = live.fed.identities[CUSTODIAN]
    async with AggregatorClient(
        live.url, identity, live.fed.ws.signer.public_bytes, retry_max=0
    ) as client:
        service = custodian_service(live, client, tmp_path)
        spec = await open_round(live, service)
        dim = spec.dim + 1
        honest = {m: encrypt(live, quantized_input(m, spec)) for m in (VICTIM, *HONEST_OTHERS)}
        for m, raw in honest.items():
            await commit(live, m, raw)
            answer = await upload(live, m, raw, expect=409, bound="")
            assert answer["error"] == "wrong_stage"
        status, raw = await request(live, COLLUDER, "GET", "/v1/rounds/1/commit?attempt=0")
        assert status == 409 and json.loads(raw)["error"] == "wrong_stage"
        assert live.coord.__dict__.get("leaked", {}) == {}  # nothing to build from
        blind = encrypt(live, quantized_input(COLLUDER, spec))
        answer = await commit(live, COLLUDER, blind)  # the last commitment closes the step
        assert live.coord.live.stage == "masked_input"
        for m, raw in honest.items():
            await upload(live, m, raw)
        crafted = cancelling(live, [live.coord.leaked[m] for m in HONEST_OTHERS], dim)
        before = (
            snapshot(live.fed.ws, live.coord),
            len(log_entries(live.fed.ws)),
            tuple(live.coord.live.summing().members),  # type: ignore[attr-defined]
        )
        answer = await upload(live, COLLUDER, crafted, expect=400)
        assert answer["error"] == "integrity_error"
        assert "not the one it committed to" in answer["detail"]
        after_log = [e["kind"] for e in log_entries(live.fed.ws, before[1])]
        assert after_log in ([], ["refused"])
        assert (
            snapshot(live.fed.ws, live.coord),
            tuple(live.coord.live.summing().members),  # type: ignore[attr-defined]
        ) == (before[0], before[2])
        # a commitment now is too late: the set is fixed
        answer = await commit(live, COLLUDER, crafted, expect=409)
        assert answer["error"] in ("duplicate", "wrong_stage")
        # the colluder's committed ciphertext is taken; the honest sum is released
        await upload(live, COLLUDER, blind)
        assert live.coord.live.stage == "decrypt"
        await service.handle(1, 0)
    (decision,) = service.decisions.read()
    assert decision.outcome == "released", decision
    assert live.coord.live.round == 2


@pytest.mark.asyncio
async def test_the_archive_of_an_open_attempt_is_not_served(
    live: Live, tmp_path: Path, keys: tuple[bytes, bytes]
) -> None:
    identity = live.fed.identities[CUSTODIAN]
    async with AggregatorClient(
        live.url, identity, live.fed.ws.signer.public_bytes, retry_max=0
    ) as client:
        service = custodian_service(live, client, tmp_path)
        spec = await open_round(live, service)
        bodies = {m: encrypt(live, quantized_input(m, spec)) for m in MEMBERS}
        for m, raw in bodies.items():
            await commit(live, m, raw)
        for m in (VICTIM, *HONEST_OTHERS):
            await upload(live, m, bodies[m])
        digest = hashlib.sha256(live.coord.leaked[VICTIM]).hexdigest()
        path = f"/v1/audit/archive/{digest}"
        # masked_input is open: neither the auditor nor the custodian is served
        for who in ("aud", CUSTODIAN):
            status, raw = await request(live, who, "GET", path)
            assert status == 409, raw
            answer = json.loads(raw)
            assert answer["error"] == "wrong_stage" and "still open" in answer["detail"]
        await upload(live, COLLUDER, bodies[COLLUDER])
        assert live.coord.live.stage == "decrypt"
        # in decrypt the custodian reads what it re-adds; an auditor still waits
        status, raw = await request(live, CUSTODIAN, "GET", path)
        assert status == 200 and raw == live.coord.leaked[VICTIM]
        status, raw = await request(live, "aud", "GET", path)
        assert status == 409 and json.loads(raw)["error"] == "wrong_stage"

        await service.handle(1, 0)  # the honest sum is released; the attempt closes
        assert live.coord.live.round == 2
        status, raw = await request(live, "aud", "GET", path)
        assert status == 200 and raw == live.coord.leaked[VICTIM]
    context = base64.b64decode(live.coord.he_context().context)
    assert context == keys[1]
