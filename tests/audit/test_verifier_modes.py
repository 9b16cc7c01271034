"""Each attempt's summation mode decides what ``fedsec audit verify`` checks for it
(:data:`fedsec.audit.verifier.modes.AUDITS`), rather than branches on ``secure_sum``."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast, get_args

import pytest
from click.testing import CliRunner

from fedsec.audit.verifier.attempts import Attempt, Consulted, ModeAudit
from fedsec.audit.verifier.modes import AUDITS, ReplayedAudit, open_mode
from fedsec.cli import main
from fedsec.protocol.spec import SecureSum
from tests.support.audit import entries, find, read_lines, rewrite_signed


def test_every_mode_a_spec_can_name_has_an_audit() -> None:
    assert sorted(AUDITS) == sorted(get_args(SecureSum))
    assert all(issubclass(audit, ModeAudit) for audit in AUDITS.values())


def test_a_mode_without_an_audit_of_its_own_is_summed_through_its_replay() -> None:
    """A plug-in mode whose log holds only its stage messages needs no audit code."""
    attempt = cast(Attempt, SimpleNamespace(spec=SimpleNamespace(secure_sum="toy")))
    audit = open_mode(attempt, cast(Consulted, None))
    assert type(audit) is ReplayedAudit and audit.attempt is attempt


def _verify(root: Path) -> dict[str, Any]:
    result = CliRunner().invoke(main, ["audit", "verify", "--workspace", str(root), "--json"])
    assert result.exit_code == 1, result.output
    doc: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return doc


@pytest.mark.slow  # the session fixture runs a real federation (~15 s)
def test_a_decryption_statement_in_a_secagg_round_is_refused(workspace_copy: Path) -> None:
    """The operator, holding the aggregator key, logs a custodian's decryption for a
    SecAgg+ round (re-chaining and re-signing every later head): the round's mode has
    nothing decrypted, and the entry is named."""
    index = find(workspace_copy, "round_open", 1)  # round 2's: round 1's spec is before it
    fid = entries(workspace_copy)[0]["body"]["federation_id"]
    statement = {
        "federation_id": fid,
        "round": 1,
        "attempt": 0,
        "custodian": "agent-1",
        "contributors": ["agent-1", "agent-2"],
        "sum_sha256": "ab" * 32,
        "plaintext_sha256": "cd" * 32,
        "signature": "00" * 64,
    }

    def forge(doc: dict[str, Any]) -> None:
        doc["kind"], doc["body"] = "he_decryption", statement

    rewrite_signed(workspace_copy, index, forge)
    lines = len(read_lines(workspace_copy))
    doc = _verify(workspace_copy)
    assert doc["problem"] == (
        f"log entry {index} (he_decryption): round 1 attempt 0 is a secure_sum = secagg "
        "round; nothing is decrypted"
    ), doc
    assert doc["entries"] == index < lines  # every entry before it held, none after counted
