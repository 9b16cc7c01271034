"""Archive retention: the objects of old rounds are deleted at a round close, but only under a
head-signed ``archive_pruned`` log entry, so ``fedsec audit verify`` can tell pruning by
retention from objects that vanished, and from a log that hides either.

Coordinator-level federations (real SQLite, real archive files, real SecAgg+ sessions, a fake
clock) laid out like a demo directory (``root/aggregator``), so the tampering helpers of
:mod:`tests.support.audit` and the CLI runner of :mod:`tests.audit.test_audit_verify`
apply unchanged.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import msgspec
import pytest
from click.testing import CliRunner

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.workspace import CONFIG_FILE, Workspace, init_workspace
from fedsec.audit.report import summarize
from fedsec.cli import main
from fedsec.config import AuditSection, dump_federation_config, parse_federation_config
from fedsec.errors import ConfigError
from fedsec.faults import AGGREGATOR_ENV, NO_FAULTS, Faults
from tests.aggregator.test_resilience import MEMBERS, _round
from tests.audit.test_audit_verify import fails, verify
from tests.support.aggregator import (
    FAST_ROUND,
    FakeClock,
    Federation,
    join_request,
    make_federation,
    plain_upload,
)
from tests.support.audit import (
    archive_path,
    encode,
    entries,
    find,
    read_lines,
    rechain,
    rewrite_signed,
    write_lines,
)

ROUNDS = 3


def federation(
    root: Path, retention: int, agents: tuple[str, ...] = MEMBERS, **options: Any
) -> Federation:
    """A workspace under ``root/aggregator`` keeping ``retention`` closed rounds' objects."""
    fed = make_federation(root / "aggregator", agents, **options)
    config = msgspec.structs.replace(
        fed.ws.config, audit=AuditSection(archive_retention_rounds=retention)
    )
    dump_federation_config(config, fed.root / CONFIG_FILE)
    fed.ws.close()
    return Federation(Workspace.open(fed.root), fed.identities)


def run_rounds(
    root: Path, retention: int, rounds: int = ROUNDS, faults: Faults = NO_FAULTS
) -> Federation:
    fed = federation(root, retention)
    coord = Coordinator(fed.ws, clock=FakeClock(), faults=faults)
    for _ in range(rounds):
        _round(coord, fed, MEMBERS)
    return fed


def save_receipts(fed: Federation, root: Path, rounds: int = ROUNDS) -> Path:
    """Every member's receipt of every round, as members keep them; return their folder."""
    folder = root / "receipts"
    folder.mkdir()
    coord = Coordinator(fed.ws, clock=FakeClock())
    for r in range(1, rounds + 1):
        for m in MEMBERS:
            (folder / f"{m}-r{r}.json").write_bytes(msgspec.json.encode(coord.receipt(m, r)))
    return folder


def objects_of(root: Path, round_: int) -> set[str]:
    """The archive objects the log's accepted entries of ``round_`` name."""
    return {
        e["body"]["sha256"]
        for e in entries(root)
        if e["kind"] == "accepted" and e["body"]["round"] == round_
    }


def prunings(root: Path) -> list[dict[str, Any]]:
    return [e for e in entries(root) if e["kind"] == "archive_pruned"]


@pytest.fixture
def retained(tmp_path: Path) -> tuple[Path, Path]:
    """Three closed rounds keeping one round's objects; (records root, receipts folder)."""
    root = tmp_path / "federation"
    fed = run_rounds(root, retention=1)
    receipts = save_receipts(fed, tmp_path)
    fed.ws.close()
    return root, receipts


# -- the aggregator side -----------------------------------------------------------------------


def test_retention_zero_keeps_every_archive_object(tmp_path: Path) -> None:
    root = tmp_path / "federation"
    run_rounds(root, retention=0).ws.close()
    assert prunings(root) == []
    for r in range(1, ROUNDS + 1):
        kept = objects_of(root, r)
        assert kept and all(archive_path(root, d).exists() for d in kept)
    code, doc = verify(root)
    assert code == 0, doc
    assert doc["rounds_verified"] == ROUNDS and doc["models_verified"] == ROUNDS
    assert doc["pruned_rounds"] == []


def test_retention_prunes_older_rounds_under_a_signed_log_entry(
    retained: tuple[Path, Path],
) -> None:
    root, receipts = retained
    logged = entries(root)
    pruned = prunings(root)
    # round 2's close prunes round 1, round 3's close prunes round 2; round 3 is kept
    assert [p["body"]["rounds"] for p in pruned] == [[1], [2]]
    assert [p["body"]["before_round"] for p in pruned] == [2, 3]
    for p, round_ in zip(pruned, (1, 2), strict=True):
        assert p["body"]["retention_rounds"] == 1
        assert p["body"]["objects"] == sorted(objects_of(root, round_))
        # written at that round's close, after its model version, and signed by its head
        assert logged[p["index"] - 1]["kind"] == "model_version"
        assert logged[p["index"] + 1]["kind"] == "head"
        assert not any(archive_path(root, d).exists() for d in objects_of(root, round_))
    assert all(archive_path(root, d).exists() for d in objects_of(root, 3))

    code, doc = verify(root, receipts)
    assert code == 0, doc
    assert doc["pruned_rounds"] == [
        {
            "round": r,
            "log_entry": p["index"],
            "detail": f"pruned by retention (log entry {p['index']})",
        }
        for r, p in zip((1, 2), pruned, strict=True)
    ]
    # only the kept round is re-run; receipts of the pruned rounds still check out
    assert doc["rounds_verified"] == 1 and doc["models_verified"] == 1
    assert doc["receipts_checked"] == ROUNDS * len(MEMBERS)
    assert doc["heads"] == ROUNDS and doc["entries"] == len(logged)
    plain = CliRunner().invoke(main, ["audit", "verify", "--workspace", str(root)])
    assert plain.exit_code == 0 and "OK: every check holds" in plain.stdout, plain.output
    assert "round 1: not re-aggregated, pruned by retention" in plain.stdout
    # the compliance report lists each pruning among its events
    events = [e for e in summarize(logged).events if e[1] == "archive_pruned"]
    assert [e[0] for e in events] == [p["index"] for p in pruned]
    assert "round(s) [1] deleted under retention (1 rounds kept" in events[0][2]


def _plain_round(
    coord: Coordinator, fed: Federation, clock: FakeClock, members: tuple[str, ...]
) -> None:
    """One ``secure_sum = "none"`` round: a member's upload is the same bytes every round."""
    r, a = coord.live.round, coord.live.attempt
    for m in members:
        assert coord.join(m, r, a, join_request(m, r)).accepted
    clock.advance(FAST_ROUND["open_s"] + 1)  # past the join deadline: the cohort is fixed
    coord.tick()
    assert coord.live.spec is not None and coord.live.stage == "masked_input"
    for m in members:
        coord.masked_input(m, r, a, *plain_upload(m, coord.live.spec, fed.identities))
    assert coord.live.round == r + 1


def test_an_object_shared_with_a_kept_round_is_not_deleted(tmp_path: Path) -> None:
    root = tmp_path / "federation"
    fed = federation(
        root,
        retention=1,
        agents=(*MEMBERS, "a3"),
        round={"secure_sum": "none", "min_agents": 2, "rounds": ROUNDS},
    )
    clock = FakeClock()
    coord = Coordinator(fed.ws, clock=clock)
    # cohorts of three: the ring width, hence the packed upload, depends on the cohort size
    _plain_round(coord, fed, clock, MEMBERS)
    _plain_round(coord, fed, clock, ("a0", "a1", "a3"))
    _plain_round(coord, fed, clock, ("a0", "a1", "a3"))
    fed.ws.close()
    shared = objects_of(root, 1) & objects_of(root, ROUNDS)
    assert len(shared) == 2  # a0's and a1's uploads, byte-identical in every round
    only_round_1 = objects_of(root, 1) - shared
    # one pruning, at round 2's close: a2's upload; a0's and a1's are still used
    [pruned] = prunings(root)
    assert pruned["body"]["rounds"] == [1] and pruned["body"]["objects"] == sorted(only_round_1)
    assert not any(archive_path(root, d).exists() for d in only_round_1)
    assert all(archive_path(root, d).exists() for d in shared)
    code, doc = verify(root)
    assert code == 0, doc
    assert [p["round"] for p in doc["pruned_rounds"]] == [1]
    assert doc["rounds_verified"] == ROUNDS - 1  # round 2 lost nothing: still re-run


_CRASHING_DRIVER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    from fedsec.faults import Faults
    from tests.audit.test_audit_retention import run_rounds
    faults = Faults.from_environment("aggregator")  # this child's entry point
    run_rounds(Path(sys.argv[1]), retention=1, rounds=2, faults=faults)
    """
)


def test_a_crash_between_the_entry_and_the_deletion_leaves_objects_the_restart_deletes(
    tmp_path: Path,
) -> None:
    root = tmp_path / "federation"
    proc = subprocess.run(
        [sys.executable, "-c", _CRASHING_DRIVER, str(root), str(Path(__file__).parents[2])],
        env={**os.environ, AGGREGATOR_ENV: "2:archive_prune"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    # the entry and its head are committed and in the file; nothing was deleted yet
    [pruned] = prunings(root)
    assert pruned["body"]["rounds"] == [1] and entries(root)[-1]["kind"] == "head"
    leftovers = objects_of(root, 1)
    assert all(archive_path(root, d).exists() for d in leftovers)
    code, doc = verify(root)  # extra objects are no problem
    assert code == 0 and [p["round"] for p in doc["pruned_rounds"]] == [1], doc

    ws = Workspace.open(root / "aggregator")
    Coordinator(ws, clock=FakeClock())  # the restart finishes the deletion
    ws.close()
    assert not any(archive_path(root, d).exists() for d in leftovers)
    assert all(archive_path(root, d).exists() for d in objects_of(root, 2))
    assert len(prunings(root)) == 1
    code, doc = verify(root)
    assert code == 0 and [p["round"] for p in doc["pruned_rounds"]] == [1], doc


# -- what verify refuses ------------------------------------------------------------------------


def test_an_object_deleted_without_a_log_entry_fails(retained: tuple[Path, Path]) -> None:
    root, _ = retained
    index = find(root, "accepted", round=ROUNDS, stage="masked_input")
    digest = entries(root)[index]["body"]["sha256"]
    archive_path(root, digest).unlink()
    before = read_lines(root)
    problem = fails(root)
    assert f"log entry {index} (accepted): round {ROUNDS}: archive object {digest}" in problem
    assert "no archive_pruned entry records its deletion" in problem, problem
    assert read_lines(root) == before


@pytest.mark.parametrize("rehashed", [False, True])
def test_deleting_the_archive_pruned_entry_is_detected(
    retained: tuple[Path, Path], rehashed: bool
) -> None:
    root, _ = retained
    index = find(root, "archive_pruned")
    lines = read_lines(root)
    del lines[index]
    write_lines(root, rechain(lines, index) if rehashed else lines)
    problem = fails(root)
    if rehashed:  # the chain holds, so round 1's objects are missing with nothing to explain it
        first = find(root, "accepted", round=1)
        assert f"log entry {first} (accepted): round 1: archive object" in problem, problem
        assert "is missing" in problem, problem
    else:
        assert f"line {index + 1}: entry index {index + 1}, expected {index}" in problem, problem


def test_an_unsigned_archive_pruned_entry_explains_nothing(tmp_path: Path) -> None:
    """Someone without the aggregator's key deletes an object and appends an excuse."""
    root = tmp_path / "federation"
    run_rounds(root, retention=0).ws.close()
    index = find(root, "accepted", round=1, stage="masked_input")
    digest = entries(root)[index]["body"]["sha256"]
    archive_path(root, digest).unlink()
    lines = read_lines(root)
    excuse = json.loads(lines[-1])
    excuse["kind"] = "archive_pruned"
    excuse["body"] = {
        "retention_rounds": 1,
        "before_round": 3,
        "rounds": [1, 2],
        "objects": [digest],
    }
    write_lines(root, rechain([*lines, encode(excuse)], len(lines)))
    problem = fails(root)
    assert f"log entry {index} (accepted): round 1: archive object {digest}" in problem, problem
    assert "no archive_pruned entry records its deletion" in problem, problem


@pytest.mark.parametrize(
    ("forgery", "expected"),
    [
        ("kept_object", "which round 3 refers to and retention keeps"),
        ("inside_window", "the newest 1 closed round(s) [2] must all be kept"),
    ],
)
def test_a_signed_pruning_that_breaks_the_retention_rules_fails(
    retained: tuple[Path, Path], forgery: str, expected: str
) -> None:
    """The operator, who holds the key, deletes what retention must keep and signs it."""
    root, _ = retained
    first, last = find(root, "archive_pruned", 0), find(root, "archive_pruned", -1)
    if forgery == "kept_object":
        index, kept = last, sorted(objects_of(root, ROUNDS))[0]

        def change(doc: dict[str, Any]) -> None:
            doc["body"]["objects"] = sorted([*doc["body"]["objects"], kept])
    else:
        index = first

        def change(doc: dict[str, Any]) -> None:
            doc["body"].update(before_round=3, rounds=[1, 2])

    rewrite_signed(root, index, change)
    problem = fails(root)
    assert f"log entry {index} (archive_pruned): " in problem and expected in problem, problem


# -- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("-1", "expected an integer >= 0, got -1"),
        ("1.5", "expected an integer, got 1.5"),
        ('"2"', "expected an integer, got '2'"),
    ],
)
def test_the_retention_setting_is_validated(tmp_path: Path, value: str, reason: str) -> None:
    text = f'[federation]\nid = "fed1"\n\n[audit]\narchive_retention_rounds = {value}\n'
    with pytest.raises(ConfigError) as err:
        parse_federation_config(text)
    assert str(err.value.detail) == f"federation.toml: audit.archive_retention_rounds: {reason}"
    # an aggregator refuses it before creating anything
    with pytest.raises(ConfigError, match=r"audit\.archive_retention_rounds"):
        init_workspace(tmp_path / "ws", "fed1", config_text=text)
    assert not (tmp_path / "ws").exists()
    default = parse_federation_config('[federation]\nid = "fed1"\n')
    assert default.audit.archive_retention_rounds == 0
