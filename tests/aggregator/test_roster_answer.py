"""GET /v1/roster is encoded once per roster serial and follows every change: a member
added or revoked while serving is in the next answer."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedsec.aggregator_client import AggregatorClient
from fedsec.crypto.identity import SigningIdentity
from fedsec.protocol.roster import sign_roster_entry
from tests.support.agent import live_aggregator
from tests.support.aggregator import FED, make_federation

NEWCOMER = SigningIdentity(bytes([42]) * 32)


@pytest.mark.asyncio
async def test_the_roster_answer_follows_additions_and_revocations(tmp_path: Path) -> None:
    fed = make_federation(tmp_path, agents=("a0", "a1"))
    async with live_aggregator(fed) as live:
        client = AggregatorClient(
            live.url, fed.identities["a0"], fed.ws.signer.public_bytes, timeout_s=10, retry_max=1
        )
        async with client:
            first = await client.roster()
            assert [e.agent_id for e in first.entries] == ["a0", "a1"]
            assert await client.roster() == first  # same serial, same answer

            fed.ws.roster.add(
                sign_roster_entry(
                    federation_id=FED,
                    agent_id="a2",
                    public_key=NEWCOMER.public_bytes,
                    role="agent",
                    admin=fed.ws.admin(),
                )
            )
            added = await client.roster()
            assert [e.agent_id for e in added.entries] == ["a0", "a1", "a2"]

            fed.ws.roster.revoke("a1", fed.ws.admin())
            revoked = await client.roster()
            assert {e.agent_id: e.is_active for e in revoked.entries} == {
                "a0": True,
                "a1": False,
                "a2": True,
            }
