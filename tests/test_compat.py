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
from pathlib import Path

import pytest
from click.testing import CliRunner

from fedsec.audit.cli import audit

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "compat-v1"


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
