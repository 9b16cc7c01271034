"""Compatibility with what earlier releases wrote: the wire and log formats stay put.

``fixtures/compat-v1`` is a demo federation (4 agents, 6 SecAgg+ rounds, one agent
killed after share_keys in round 4 and restarted) written by the code of commit
5fe291e, before the round-engine redesign, with every private key removed: the
aggregator workspace (transparency log, archive, signed manifests and models, state
database, roster) and each agent's receipts.  Every later commit must still verify
it end to end.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from fedsec.audit.cli import audit
from fedsec.crypto.identity import SigningIdentity

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "compat-v1"


@pytest.fixture
def old_workspace(tmp_path: Path) -> Path:
    """A writable copy of the fixture (the verifier may open the state read-write)."""
    copy = tmp_path / "compat-v1"
    shutil.copytree(FIXTURE, copy)
    return copy


def test_the_fixture_holds_no_private_key() -> None:
    assert not list(FIXTURE.rglob("*.key"))
    for path in FIXTURE.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert b"BEGIN" not in data and b'"secret' not in data, path


def test_audit_verify_accepts_a_log_written_before_the_redesign(old_workspace: Path) -> None:
    receipts = sorted(old_workspace.glob("agent-*/receipts/*.json"))
    assert receipts
    args = ["verify", "--workspace", str(old_workspace), "--json"]
    for receipt in receipts:
        args += ["--receipts", str(receipt)]
    result = CliRunner().invoke(audit, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary["ok"] is True
    assert summary["rounds_verified"] == 6
    assert summary["models_verified"] == 6
    assert summary["receipts_checked"] == len(receipts)


def test_audit_verify_still_detects_tampering_in_the_old_log(old_workspace: Path) -> None:
    log = old_workspace / "aggregator" / "audit" / "log.jsonl"
    lines = log.read_text().splitlines()
    entry = json.loads(lines[5])
    entry["body"] = {**entry["body"], "tampered": True}
    lines[5] = json.dumps(entry)
    log.write_text("\n".join(lines) + "\n")
    result = CliRunner().invoke(audit, ["verify", "--workspace", str(old_workspace), "--json"])
    assert result.exit_code == 1, result.output
    assert json.loads(result.output.strip().splitlines()[-1])["ok"] is False


# -- an aggregator killed mid-round by the old code, resumed by the new one ----------------------

#: ``fixtures/compat-v1-midround/aggregator``: the workspace of a 4-agent, 3-round SecAgg+
#: federation (breast_cancer, the chaos harness's set-up) run by the code of commit 5fe291e
#: with ``FEDSEC_FAULT_AGGREGATOR_CRASH_AT=2:masked_input:2``: the aggregator SIGKILLed
#: itself right after durably accepting the 2nd masked input of round 2 (attempt 0); the
#: agents were then killed.  Round 1 is closed (model version 2).  ``make_fixture.py``
#: beside it is the script that ran it (cwd and PYTHONPATH /work/baseline, the old
#: checkout).  The WAL was checkpointed into state.db (no -wal/-shm file is kept: same
#: rows), and the private keys (aggregator.key, admin.key), serve.json and the roster lock
#: file were removed.
MIDROUND = Path(__file__).resolve().parents[1] / "fixtures" / "compat-v1-midround"


@dataclass(frozen=True)
class _Stored:
    position: tuple[int, int, str]
    messages: dict[str, list[str]]
    joined: list[str]
    sizes: dict[str, int]


def _stored(db: Path) -> _Stored:
    """What the old code left in ``db``: the last rounds row, the attempt's members and its
    accepted messages per stage (in acceptance order), and the table sizes."""
    import sqlite3

    con = sqlite3.connect(db)
    try:
        rnd, att, stage = con.execute(
            "SELECT round, attempt, stage FROM rounds ORDER BY round DESC, attempt DESC LIMIT 1"
        ).fetchone()
        per_stage: dict[str, list[str]] = {}
        for st, member in con.execute(
            "SELECT stage, member FROM messages WHERE round = ? AND attempt = ? ORDER BY seq",
            (rnd, att),
        ):
            per_stage.setdefault(st, []).append(member)
        joined = sorted(
            m
            for (m,) in con.execute(
                "SELECT member FROM joins WHERE round = ? AND attempt = ?", (rnd, att)
            )
        )
        sizes = {
            t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
            for t in ("rounds", "joins", "messages")
        }
    finally:
        con.close()
    return _Stored((rnd, att, stage), per_stage, joined, sizes)


def _rotate_aggregator_key(root: Path, signer: SigningIdentity) -> None:
    """Make ``signer`` the key of workspace ``root``: its key file, its public key, and
    every model manifest re-signed by it (same fields, same ``created``)."""
    from fedsec.aggregator.workspace import AGGREGATOR_KEY
    from fedsec.keys import save_identity, save_public_key
    from fedsec.modelfile import manifest_from_json, manifest_to_json, sign_manifest

    save_identity(signer, root / AGGREGATOR_KEY)
    save_public_key(root / "aggregator.pub", signer.public_bytes)
    for path in sorted((root / "manifests").glob("*.json")):
        m = manifest_from_json(path.read_bytes())
        resigned = sign_manifest(
            federation_id=m.federation_id,
            version=m.version,
            parent=m.parent,
            round=m.round,
            sha256=m.sha256,
            metrics=m.metrics,
            kind=m.kind,
            note=m.note,
            created=m.created,
            signer=signer,
        )
        path.write_bytes(manifest_to_json(resigned))


def test_the_midround_fixture_holds_no_private_key() -> None:
    assert (MIDROUND / "aggregator" / "state.db").is_file()
    assert not list(MIDROUND.rglob("*.key"))
    for path in MIDROUND.rglob("*"):
        if path.is_file() and path.name != "make_fixture.py":
            data = path.read_bytes()
            assert b"BEGIN" not in data and b'"secret' not in data, path


def test_aggregator_restarted_by_the_new_code_resumes_the_old_codes_round(
    tmp_path: Path,
) -> None:
    from fedsec.aggregator.coordinator import Coordinator
    from fedsec.aggregator.workspace import Workspace

    root = tmp_path / "aggregator"
    shutil.copytree(MIDROUND / "aggregator", root)
    before = _stored(root / "state.db")
    # What the fixture is (see MIDROUND): the crash point it was made with.
    assert before.position == (2, 0, "masked_input")
    assert [len(before.messages[s]) for s in ("advertise", "share_keys", "masked_input")] == [
        4,
        4,
        2,
    ]
    # The private key was not kept, and the new Workspace trusts only its own key: the model
    # store verifies every manifest against the key in aggregator.key, so a fresh key alone
    # leaves "no verified model version".  In the copy only, the fresh key takes the old
    # one's place (a key rotation: manifests re-signed with their fields unchanged,
    # aggregator.pub rewritten); the state database and the log stay as the old code left
    # them.
    _rotate_aggregator_key(root, SigningIdentity.generate())

    ws = Workspace.open(root)
    try:
        row = ws.state.rounds.latest()
        assert row is not None
        # A clock inside the stage's deadline, so nothing closes on time while resuming.
        coord = Coordinator(ws, clock=lambda: row.stage_started_at + 1.0)
        live = coord.live
        assert (live.round, live.attempt, live.stage) == before.position
        assert coord.current_attempt() == (2, 0)
        assert not coord.finished
        assert live.spec is not None
        assert sorted(live.spec.cohort) == before.joined
        # The accepted messages were replayed, stage by stage, into the SecAgg+ session.
        session = live.session
        assert session is not None
        msgs = before.messages
        assert sorted(session.advertised) == sorted(msgs["advertise"])
        assert sorted(session.participants) == sorted(msgs["share_keys"])
        assert session.contributed == msgs["masked_input"]
        for stage, members in msgs.items():
            assert ws.state.messages.count(2, 0, stage) == len(members)
        assert coord.in_stage(2, 0, "masked_input")
        latest = ws.state.rounds.latest()
        assert latest is not None
        assert (latest.round, latest.attempt, latest.stage) == before.position
    finally:
        ws.close()
    # No new attempt (nor any message or join) was written by resuming.
    after = _stored(root / "state.db")
    assert after.sizes == before.sizes
    assert after.position == before.position
