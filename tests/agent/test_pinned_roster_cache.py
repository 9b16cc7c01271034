"""The roster entries' verified signatures are shared by every agent in a process (a
simulation hosts a thousand); a substituted key is still refused by the next agent."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import msgspec
import pytest

from fedsec.agent import pinned_roster
from fedsec.agent.pinned_roster import PinnedRoster
from fedsec.aggregator_client import AggregatorClient
from fedsec.aggregator_client.api import RosterBody
from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import SignatureError
from fedsec.protocol.roster import sign_roster_entry, verify_roster_entry

FED = "cache-fed"
ADMIN = SigningIdentity(bytes([7]) * 32)
MEMBERS = {f"m{i}": SigningIdentity(bytes([i + 1]) * 32) for i in range(3)}
STRANGER = SigningIdentity(bytes([99]) * 32)


class _Serves:
    """Stands in for the aggregator client: answers GET /roster with ``body``."""

    def __init__(self, body: RosterBody) -> None:
        self.body = body

    async def roster(self) -> RosterBody:
        return self.body


def _roster() -> RosterBody:
    entries = [
        sign_roster_entry(
            federation_id=FED, agent_id=m, public_key=i.public_bytes, role="agent", admin=ADMIN
        )
        for m, i in MEMBERS.items()
    ]
    return RosterBody(entries=entries, admin_public_key=ADMIN.public_bytes.hex())


def _client(body: RosterBody) -> AggregatorClient:
    return cast(AggregatorClient, _Serves(body))


@pytest.mark.asyncio
async def test_verified_once_per_process_and_a_substituted_key_still_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []

    def counting(entry: Any, admin: bytes, federation_id: str) -> None:
        calls.append(entry.agent_id)
        verify_roster_entry(entry, admin, federation_id)

    monkeypatch.setattr(pinned_roster, "verify_roster_entry", counting)
    pinned_roster._VERIFIED.clear()
    genuine = _roster()
    for m, identity in MEMBERS.items():
        (tmp_path / m).mkdir()
        keys = await PinnedRoster(tmp_path / m, m, identity).keys(_client(genuine), FED)
        assert keys == {n: i.public_bytes for n, i in MEMBERS.items()}
    assert sorted(calls) == sorted(MEMBERS)  # 3 verifications for 3 agents, not 9

    # the aggregator swaps m2's key and keeps the admin's signature: not in the shared
    # set (other bytes), so verified, and refused
    entries = list(genuine.entries)
    entries[2] = msgspec.structs.replace(entries[2], public_key=STRANGER.public_bytes.hex())
    forged = RosterBody(entries=entries, admin_public_key=genuine.admin_public_key)
    (tmp_path / "late").mkdir()
    late = PinnedRoster(tmp_path / "late", "m0", MEMBERS["m0"])
    with pytest.raises(SignatureError):
        await late.keys(_client(forged), FED)
    assert len(pinned_roster._VERIFIED) == len(MEMBERS)  # the forgery was not added
