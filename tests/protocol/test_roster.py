"""The admin-signed roster: enrolment, revocation, tamper detection, live reload."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import msgspec
import pytest

from fedsec import config
from fedsec.aggregator.storage.roster_file import Roster
from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import ConfigError, IntegrityError, NotFound, SignatureError
from fedsec.protocol import roster as protocol_roster
from fedsec.protocol.roster import (
    RosterEntry,
    entry_from_event,
    revoke_roster_entry,
    sign_roster_entry,
    verify_roster_entry,
)

FED = "fed-1"


@pytest.fixture
def admin() -> SigningIdentity:
    return SigningIdentity.generate()


def _entry(
    admin: SigningIdentity, agent_id: str, key: bytes | None = None, **kw: object
) -> RosterEntry:
    return sign_roster_entry(
        federation_id=FED,
        agent_id=agent_id,
        public_key=key or SigningIdentity.generate().public_bytes,
        role=kw.pop("role", "agent"),  # type: ignore[arg-type]
        admin=admin,
        **kw,  # type: ignore[arg-type]
    )


@pytest.fixture
def roster(tmp_path: Path, admin: SigningIdentity) -> Roster:
    r = Roster(tmp_path, FED, admin.public_bytes)
    r.add(_entry(admin, "hospital-a", max_weight=0.5))
    r.add(_entry(admin, "hospital-b"))
    r.add(_entry(admin, "auditor-1", role="auditor"))
    return r


def test_add_and_lookup(roster: Roster, tmp_path: Path, admin: SigningIdentity) -> None:
    a = roster.get("hospital-a")
    assert a is not None and a.max_weight == 0.5
    assert roster.by_key_id(a.key_id) == a
    assert roster.by_key_id("ed25519:" + "0" * 32) is None
    assert [e.agent_id for e in roster.active_agents()] == ["hospital-a", "hospital-b"]
    assert roster.serial == 3
    again = Roster(tmp_path, FED, admin.public_bytes)
    assert again.entries() == roster.entries()
    again.verify_all(admin.public_bytes)


def test_add_returns_log_event(tmp_path: Path, admin: SigningIdentity) -> None:
    r = Roster(tmp_path, FED, admin.public_bytes)
    entry = _entry(admin, "lab-1")
    event = r.add(entry)
    assert event["type"] == "roster_add" and event["serial"] == 1
    assert event["federation_id"] == FED
    json.dumps(event)  # JSON-ready
    carried = entry_from_event(event)
    assert carried == entry
    verify_roster_entry(carried, admin.public_bytes, FED)


def test_duplicate_id_refused_file_unchanged(roster: Roster, admin: SigningIdentity) -> None:
    before = roster.path.read_bytes()
    with pytest.raises(ConfigError, match="id 'hospital-a'"):
        roster.add(_entry(admin, "hospital-a"))
    assert roster.path.read_bytes() == before
    assert roster.serial == 3


def test_duplicate_key_refused_file_unchanged(roster: Roster, admin: SigningIdentity) -> None:
    before = roster.path.read_bytes()
    existing = roster.get("hospital-b")
    assert existing is not None
    with pytest.raises(ConfigError, match="already enrolled as 'hospital-b'"):
        roster.add(_entry(admin, "hospital-c", key=existing.public_key_bytes))
    assert roster.path.read_bytes() == before
    assert roster.get("hospital-c") is None


def test_entry_not_signed_by_admin_refused(roster: Roster) -> None:
    before = roster.path.read_bytes()
    with pytest.raises(SignatureError):
        roster.add(_entry(SigningIdentity.generate(), "intruder"))
    forged = msgspec.structs.replace(_entry(SigningIdentity.generate(), "x"), admin_signature="")
    with pytest.raises(SignatureError, match="no valid admin signature"):
        roster.add(forged)
    assert roster.path.read_bytes() == before


def test_entry_signed_for_other_federation_refused(roster: Roster, admin: SigningIdentity) -> None:
    before = roster.path.read_bytes()
    other = sign_roster_entry(
        federation_id="fed-2",
        agent_id="lab-9",
        public_key=SigningIdentity.generate().public_bytes,
        role="agent",
        admin=admin,
    )
    with pytest.raises(SignatureError):
        roster.add(other)
    assert roster.path.read_bytes() == before


def test_invalid_fields_refused(admin: SigningIdentity) -> None:
    with pytest.raises(IntegrityError, match="max_weight"):
        _entry(admin, "a", max_weight=1.5)
    with pytest.raises(IntegrityError, match="not a valid identifier"):
        _entry(admin, "bad id/")
    with pytest.raises(IntegrityError, match="32 bytes"):
        _entry(admin, "a", key=b"\x01" * 31)


def test_entry_id_alphabet_is_the_config_one() -> None:
    assert config.ID_PATTERN is protocol_roster.ID_PATTERN


def test_entry_verification_needs_no_store(admin: SigningIdentity) -> None:
    entry = _entry(admin, "lab-1", max_weight=0.25, added_at=100.0)
    verify_roster_entry(entry, admin.public_bytes, FED)
    revoked = revoke_roster_entry(entry, admin, FED, at=200.0)
    assert revoked.status == "revoked" and revoked.revoked_at == 200.0
    verify_roster_entry(revoked, admin.public_bytes, FED)
    with pytest.raises(SignatureError, match="does not verify"):
        verify_roster_entry(entry, admin.public_bytes, "fed-2")
    with pytest.raises(SignatureError, match="does not verify"):
        verify_roster_entry(entry, SigningIdentity.generate().public_bytes, FED)
    widened = msgspec.structs.replace(entry, max_weight=1.0)
    with pytest.raises(SignatureError, match="does not verify"):
        verify_roster_entry(widened, admin.public_bytes, FED)
    unrevoked = msgspec.structs.replace(revoked, status="active", revoked_at=None)
    with pytest.raises(SignatureError, match="does not verify"):
        verify_roster_entry(unrevoked, admin.public_bytes, FED)
    assert entry.status == "active" and entry.max_weight == 0.25  # entries are immutable
    with pytest.raises(IntegrityError, match="malformed"):
        entry_from_event({"type": "roster_add", "entry": {"agent_id": "x"}})


def test_revoke(roster: Roster, tmp_path: Path, admin: SigningIdentity) -> None:
    event = roster.revoke("hospital-b", admin, at=1234.5)
    assert event["type"] == "roster_revoke" and event["serial"] == 4
    b = roster.get("hospital-b")
    assert b is not None and b.status == "revoked" and b.revoked_at == 1234.5
    assert roster.by_key_id(b.key_id) == b  # still known, so a request can be told "revoked"
    assert [e.agent_id for e in roster.active_agents()] == ["hospital-a"]
    verify_roster_entry(entry_from_event(event), admin.public_bytes, FED)
    assert Roster(tmp_path, FED, admin.public_bytes).get("hospital-b") == b
    # ids and keys are not reusable after revocation
    before = roster.path.read_bytes()
    with pytest.raises(ConfigError, match="revoked"):
        roster.add(_entry(admin, "hospital-b"))
    with pytest.raises(ConfigError, match="revoked"):
        roster.add(_entry(admin, "hospital-z", key=b.public_key_bytes))
    with pytest.raises(ConfigError, match="already revoked"):
        roster.revoke("hospital-b", admin)
    assert roster.path.read_bytes() == before


def test_revoke_needs_admin_and_known_id(roster: Roster, admin: SigningIdentity) -> None:
    before = roster.path.read_bytes()
    with pytest.raises(SignatureError, match="not the admin key"):
        roster.revoke("hospital-a", SigningIdentity.generate())
    with pytest.raises(NotFound):
        roster.revoke("nobody", admin)
    assert roster.path.read_bytes() == before
    assert roster.get("hospital-a") is not None and roster.get("hospital-a").is_active  # type: ignore[union-attr]


def _edit(path: Path, change: dict[str, object], index: int = 0) -> None:
    doc = json.loads(path.read_bytes())
    doc["entries"][index].update(change)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    "change",
    [{"status": "active", "revoked_at": None}, {"max_weight": 1.0}, {"role": "auditor"}],
)
def test_tampered_file_refused_at_load(
    roster: Roster, tmp_path: Path, admin: SigningIdentity, change: dict[str, object]
) -> None:
    roster.revoke("hospital-a", admin)
    _edit(roster.path, change)
    with pytest.raises(SignatureError, match="'hospital-a'"):
        Roster(tmp_path, FED, admin.public_bytes)


def test_wrong_admin_or_federation_refused(roster: Roster, tmp_path: Path) -> None:
    with pytest.raises(IntegrityError, match="admin key"):
        Roster(tmp_path, FED, SigningIdentity.generate().public_bytes)
    with pytest.raises(IntegrityError, match="federation 'fed-1', not 'fed-2'"):
        Roster(tmp_path, "fed-2", SigningIdentity.generate().public_bytes)


def test_reload_sees_changes_by_another_writer(
    roster: Roster, tmp_path: Path, admin: SigningIdentity
) -> None:
    serving = Roster(tmp_path, FED, admin.public_bytes)
    assert serving.reload_if_changed() is False
    roster.add(_entry(admin, "lab-new"))
    assert serving.reload_if_changed() is True
    assert serving.get("lab-new") is not None
    assert serving.reload_if_changed() is False
    roster.revoke("lab-new", admin)
    assert serving.reload_if_changed() is True
    assert serving.get("lab-new").status == "revoked"  # type: ignore[union-attr]


def test_reload_refuses_tampered_and_rolled_back_files(
    roster: Roster, tmp_path: Path, admin: SigningIdentity
) -> None:
    serving = Roster(tmp_path, FED, admin.public_bytes)
    old = roster.path.read_bytes()
    roster.revoke("hospital-a", admin)
    assert serving.reload_if_changed() is True
    entries = serving.entries()
    # Roll back to the file before the revocation: refused, revocation stays in force.
    roster.path.write_bytes(old)
    assert serving.reload_if_changed() is False
    assert "older" in (serving.last_reload_error or "")
    assert serving.entries() == entries
    # A tampered file is refused too.
    _edit(roster.path, {"max_weight": 1.0}, index=1)
    assert serving.reload_if_changed() is False
    assert "does not verify" in (serving.last_reload_error or "")
    assert serving.entries() == entries


def _add_in_process(root: str, admin_seed_hex: str, agent_id: str) -> None:
    admin = SigningIdentity(bytes.fromhex(admin_seed_hex))
    Roster(Path(root), FED, admin.public_bytes).add(_entry(admin, agent_id))


def test_concurrent_writers_do_not_lose_entries(tmp_path: Path) -> None:
    seed = os.urandom(32)
    admin = SigningIdentity(seed)
    Roster(tmp_path, FED, admin.public_bytes)
    ctx = multiprocessing.get_context("fork")
    procs = [
        ctx.Process(target=_add_in_process, args=(str(tmp_path), seed.hex(), f"lab-{i}"))
        for i in range(6)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=20)
        assert p.exitcode == 0
    final = Roster(tmp_path, FED, admin.public_bytes)
    assert sorted(e.agent_id for e in final.entries()) == [f"lab-{i}" for i in range(6)]
    assert final.serial == 6
