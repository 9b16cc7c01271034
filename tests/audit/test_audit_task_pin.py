"""The auditor lists the task package every round spec pins and, when asked, checks it
against its own installation (``fedsec audit verify --check-task-pin``).

The federation of :func:`tests.support.audit.audit_workspace` runs in a subprocess; in
this shared, editable checkout the source tree (and so the digest of fedsec itself) can
change between that run and this test, so the comparison with the local installation
is exercised through the verifier's ``local_pin`` seam; the CLI flag is checked for
agreeing with a direct comparison, whichever way it goes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from click.testing import CliRunner

from fedsec.archive import Archive
from fedsec.audit.verify import Verifier
from fedsec.cli import main
from fedsec.protocol import wire
from fedsec.task.digest import loaded_task_pin
from tests.support.audit import ARCHIVE, LOG, ROUNDS

pytestmark = pytest.mark.slow  # the session fixture runs a real federation (~15 s)


def _verify_cli(root: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    args = ["audit", "verify", "--workspace", str(root / "aggregator"), "--json", *extra]
    result = CliRunner().invoke(main, args)
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(result.stdout.strip().splitlines()[-1])


def _logged_pin(doc: dict[str, Any]) -> wire.TaskPin:
    [row] = doc["task_pins"]
    return msgspec.convert(row["pin"], wire.TaskPin)


def _verifier(root: Path, local: wire.TaskPin) -> Verifier:
    return Verifier(Archive(root / ARCHIVE), root / "aggregator", local_pin=lambda name: local)


def test_verify_lists_the_one_pin_of_every_round_without_comparing(workspace_copy: Path) -> None:
    code, doc = _verify_cli(workspace_copy)
    assert code == 0, doc
    assert doc["task_pin_checked"] is False
    assert doc["task_pins"][0]["rounds"] == list(range(1, ROUNDS + 1))
    pin = _logged_pin(doc)
    assert (pin.entry_point, pin.distribution) == ("breast_cancer", "fedsec")


def test_the_pinned_installation_passes_the_check(workspace_copy: Path) -> None:
    _, doc = _verify_cli(workspace_copy)
    result = _verifier(workspace_copy, _logged_pin(doc)).run(workspace_copy / LOG)
    assert result.ok, result.problem
    assert result.task_pin_checked and result.rounds_verified == ROUNDS


@pytest.mark.parametrize(
    ("changes", "named"),
    [({"digest": "0" * 64}, "digest expected"), ({"version": "0.0.1"}, "version expected")],
)
def test_another_installation_fails_the_check_naming_what_differs(
    workspace_copy: Path, changes: dict[str, str], named: str
) -> None:
    _, doc = _verify_cli(workspace_copy)
    logged = _logged_pin(doc)
    other = msgspec.structs.replace(logged, **changes)
    result = _verifier(workspace_copy, other).run(workspace_copy / LOG)
    assert not result.ok and result.problem is not None
    assert "round 1 attempt 0 pins a task package other than the one installed here" in (
        result.problem
    )
    assert named in result.problem and "(round_spec)" in result.problem
    assert "distribution expected" not in result.problem  # only what differs is named


def test_the_cli_flag_compares_with_this_installation(workspace_copy: Path) -> None:
    _, plain = _verify_cli(workspace_copy)
    code, doc = _verify_cli(workspace_copy, "--check-task-pin")
    if _logged_pin(plain) == loaded_task_pin("breast_cancer"):
        assert code == 0 and doc["task_pin_checked"] is True, doc
    else:  # the shared checkout changed since the federation ran: a genuine difference
        assert code == 1 and "pins a task package other than" in doc["problem"], doc
