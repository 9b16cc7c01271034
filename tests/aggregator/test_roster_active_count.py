"""The roster's count of active members, which the cohort reads after every join, follows
every change: enrolment, revocation and a reload of a file another process changed."""

from __future__ import annotations

from pathlib import Path

from fedsec.aggregator.storage.roster_file import Roster
from fedsec.crypto.identity import SigningIdentity
from fedsec.protocol.roster import sign_roster_entry

FED = "fed-1"


def _add(roster: Roster, admin: SigningIdentity, agent_id: str, role: str = "agent") -> None:
    roster.add(
        sign_roster_entry(
            federation_id=FED,
            agent_id=agent_id,
            public_key=SigningIdentity.generate().public_bytes,
            role=role,  # type: ignore[arg-type]
            admin=admin,
        )
    )


def test_the_active_count_follows_enrolment_revocation_and_reload(tmp_path: Path) -> None:
    admin = SigningIdentity.generate()
    roster = Roster(tmp_path, FED, admin.public_bytes)
    assert roster.active_agent_count() == 0
    _add(roster, admin, "a")
    _add(roster, admin, "b")
    _add(roster, admin, "watcher", role="observer")  # not a member
    assert roster.active_agent_count() == len(roster.active_agents()) == 2
    roster.revoke("a", admin, at=1.0)
    assert roster.active_agent_count() == 1
    assert [e.agent_id for e in roster.active_agents()] == ["b"]
    # another process enrols one more; this one sees it on reload
    other = Roster(tmp_path, FED, admin.public_bytes)
    _add(other, admin, "c")
    reread = Roster(tmp_path, FED, admin.public_bytes)
    assert reread.active_agent_count() == 2
