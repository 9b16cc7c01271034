"""Commit, challenge, reveal over real HTTP: agents train and contribute, an auditor draws
challenges from the signed log heads, agents answer with sealed reveals, and the auditor
opens them against the commitments the members signed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import pytest
import pytest_asyncio

from fedsec.agent.runtime import AgentRuntime
from fedsec.aggregator.http import make_app
from fedsec.aggregator.transport import start_server
from fedsec.aggregator.workspace import Workspace
from fedsec.aggregator_client import AggregatorClient
from fedsec.audit.challenge import closed_rounds, draw_challenges, open_reveal_checked
from fedsec.audit.verify import verify_log
from fedsec.crypto.commitment import seal_reveal
from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import DecryptionError, IntegrityError, PayloadError
from fedsec.federation import (
    LocalAgent,
    agent_config,
    create_federation,
    enrol_agents,
    federation_toml,
)
from fedsec.protocol import wire
from fedsec.protocol.roster import sign_roster_entry

pytestmark = pytest.mark.asyncio


@dataclass
class Federation:
    ws: Workspace
    url: str
    agents: list[LocalAgent]
    runtimes: list[AgentRuntime]
    auditor: SigningIdentity

    @property
    def log(self) -> Path:
        return self.ws.root / "audit" / "log.jsonl"

    def client(self, identity: SigningIdentity) -> AggregatorClient:
        return AggregatorClient(
            self.url,
            identity,
            self.ws.signer.public_bytes,
            timeout_s=10,
            retry_max=1,
            backoff_initial_s=0.1,
            backoff_max_s=0.2,
        )


@pytest_asyncio.fixture
async def fed(tmp_path: Path) -> AsyncIterator[Federation]:
    text = federation_toml(
        "fed",
        "breast_cancer",
        round_={"min_agents": 3, "max_agents": 3, "rounds": 2, "advertise_s": 5.0},
        training={"local_epochs": 1, "batch_size": 32, "lr": 0.1},
        dp={"enabled": True, "noise_multiplier": 1.5},
        server={"port": 0},
    )
    ws = create_federation(tmp_path, "fed", "breast_cancer", text)
    agents = enrol_agents(ws, tmp_path, 3)
    auditor = SigningIdentity.generate()
    ws.roster.add(
        sign_roster_entry(
            federation_id="fed",
            agent_id="auditor-1",
            public_key=auditor.public_bytes,
            role="auditor",
            admin=ws.admin(),
        )
    )
    server = await start_server(make_app(ws), "127.0.0.1", 0, None, ws.config.server)
    url = server.url
    runtimes = [
        AgentRuntime(
            agent_config(
                a,
                url=url,
                aggregator_public=ws.signer.public_bytes,
                task="breast_cancer",
                part_index=i,
                parts=3,
                partition="iid",
                seed=1,
                epsilon=50.0,
            ),
            a.identity,
        )
        for i, a in enumerate(agents)
    ]
    await asyncio.wait_for(asyncio.gather(*(rt.run() for rt in runtimes)), timeout=120)
    try:
        yield Federation(ws, url, agents, runtimes, auditor)
    finally:
        await server.close()
        ws.close()


async def test_challenged_members_reveal_exactly_what_they_committed(fed: Federation) -> None:
    requests = draw_challenges(fed.log, rate=1.0)
    assert {(r.round, r.member) for r in requests} == {
        (r, a.agent_id) for r in (1, 2) for a in fed.agents
    }
    async with fed.client(fed.auditor) as client:
        for req in requests:
            await client.challenge(req)
        # a second challenge of the same pair is refused
        with pytest.raises(Exception, match="already challenged"):
            await client.challenge(requests[0])

    for rt in fed.runtimes:
        async with rt.make_client() as client:
            assert await rt.answer_challenges(client, "fed") == 2
            assert await rt.answer_challenges(client, "fed") == 0  # nothing left open

    async with fed.client(fed.auditor) as client:
        reveals = (await client.reveals()).reveals
    assert len(reveals) == 6
    rounds = closed_rounds(fed.log)
    for reveal in reveals:
        opened = open_reveal_checked(fed.auditor, reveal, rounds)
        home = next(a for a in fed.agents if a.agent_id == reveal.member)
        kept = fed.runtimes[fed.agents.index(home)].vault.load_update(reveal.round, reveal.attempt)
        assert np.array_equal(opened.quantized, kept.update)

    # another auditor's key cannot open them
    with pytest.raises(DecryptionError, match="not sealed to this auditor"):
        open_reveal_checked(SigningIdentity.generate(), reveals[0], rounds)

    # a member revealing something other than what it committed to is caught
    payload = wire.RevealPayload(
        federation_id="fed",
        round=reveals[0].round,
        attempt=reveals[0].attempt,
        member=reveals[0].member,
        update=(b"\x00" * 2 * (rounds[(reveals[0].round, reveals[0].attempt)].spec.dim + 1)).hex(),
        salt="00" * 32,
    )
    forged = msgspec.structs.replace(
        reveals[0],
        sealed=seal_reveal(fed.auditor.public_bytes, msgspec.json.encode(payload)).hex(),
    )
    with pytest.raises(IntegrityError, match="does not match its commitment"):
        open_reveal_checked(fed.auditor, forged, rounds)

    # the challenges and reveals are in the log, which still verifies end to end
    result = verify_log(fed.log, fed.ws.root / "audit" / "archive", fed.ws.root)
    assert result.ok, result.problem
    assert result.rounds_verified == 2 and result.models_verified == 2


async def test_challenges_must_follow_from_a_beacon_after_the_round(fed: Federation) -> None:
    rounds = closed_rounds(fed.log)
    first = rounds[(1, 0)]
    assert first.beacon_index is not None
    async with fed.client(fed.auditor) as client:
        # a beacon from before the round closed (the genesis entry) is refused
        bad = wire.ChallengeRequest(1, 0, first.survivors[0], 0, 1.0)
        with pytest.raises(PayloadError, match="not a signed head written after round 1"):
            await client.challenge(bad)
        # an agent cannot challenge
    async with fed.runtimes[0].make_client() as agent_client:
        with pytest.raises(Exception, match="auditor"):
            await agent_client.challenge(
                wire.ChallengeRequest(1, 0, first.survivors[0], first.beacon_index, 1.0)
            )


async def test_audit_check_judges_every_reveal_against_the_control_sample(
    fed: Federation, tmp_path: Path
) -> None:
    from fedsec.audit.check import check_reveals
    from fedsec.tasks import get_task

    async with fed.client(fed.auditor) as client:
        for req in draw_challenges(fed.log, rate=1.0):
            await client.challenge(req)
    for rt in fed.runtimes:
        async with rt.make_client() as client:
            await rt.answer_challenges(client, "fed")
    async with fed.client(fed.auditor) as client:
        reveals = (await client.reveals()).reveals
    data = get_task("breast_cancer").load()
    control = tmp_path / "control.npz"
    np.savez(control, x=data.x_test, y=data.y_test)
    forged = msgspec.structs.replace(reveals[0], sealed=reveals[1].sealed)  # someone else's
    verdicts = check_reveals(fed.auditor, [*reveals[1:], forged], fed.log, fed.ws.root, control)
    assert len(verdicts) == len(reveals)
    by_key = {(v["member"], v["round"]): v for v in verdicts}
    bad = by_key[(forged.member, forged.round)]
    assert not bad["passed"] and bad["failed"] == ["commitment"]
    for v in verdicts:
        if v is not bad:
            assert {"signal", "direction", "magnitude", "replay"} & set(v["scores"]) or v["failed"]
            # the committed weight is checked against the signed record count: honest
            # agents weight by volume (no data summary: quality 1), so it is within cap
            assert "weight" not in v["failed"]
            assert v["scores"]["weight"] <= v["scores"]["weight_cap"] + 1 / 255

    # a control sample with the wrong schema is refused, naming the file
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, x=np.zeros((4, 3), np.float32), y=np.zeros(4, np.int64))
    with pytest.raises(Exception, match=r"wrong\.npz"):
        check_reveals(fed.auditor, reveals[1:2], fed.log, fed.ws.root, wrong)
