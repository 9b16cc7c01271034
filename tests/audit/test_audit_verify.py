"""``fedsec audit verify`` against the records of a real federation, untouched and tampered.

One federation runs once per session (:mod:`tests.support.audit`); every test copies its
records, changes one thing the way an operator covering its tracks (or a disk
error) would, and runs the command a compliance officer runs.  The untouched copy
must verify; every tampered one must exit 1 with a sentence naming the entry or
file at fault, never with a traceback.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest
from click.testing import CliRunner

from fedsec.agent.ledger import epsilon_of
from fedsec.archive import Archive
from fedsec.audit import accountant
from fedsec.cli import main
from fedsec.crypto.identity import SigningIdentity
from fedsec.protocol import wire
from fedsec.protocol.roster import sign_roster_entry
from tests.support.audit import (
    AGENTS,
    ARCHIVE,
    LOG,
    ROUNDS,
    agent_key,
    aggregator_key,
    archive_path,
    build_workspace,
    edit_entry,
    encode,
    entries,
    find,
    model_path,
    read_lines,
    rechain,
    rewrite_signed,
    write_lines,
)

pytestmark = pytest.mark.slow  # the session fixture runs a real federation (~15 s)


def verify(root: Path, *receipts: Path, extra: tuple[str, ...] = ()) -> tuple[int, dict[str, Any]]:
    """Run ``fedsec audit verify --json`` as a user would; return (exit code, JSON result)."""
    args = ["audit", "verify", "--workspace", str(root), "--json", *extra]
    for r in receipts:
        args += ["--receipts", str(r)]
    result = CliRunner().invoke(main, args)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"verify raised instead of reporting: {result.exception!r}")
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(result.stdout.strip().splitlines()[-1])


def fails(root: Path, *receipts: Path, extra: tuple[str, ...] = ()) -> str:
    """Verify, expect failure; return the problem sentence."""
    code, doc = verify(root, *receipts, extra=extra)
    assert code == 1 and doc["ok"] is False, doc
    assert doc["problem"], doc
    assert "Traceback" not in doc["problem"]
    return str(doc["problem"])


def receipts_of(root: Path) -> list[Path]:
    return [root / f"agent-{i + 1}" / "receipts" for i in range(AGENTS)]


def names_entry(problem: str, *indexes: int) -> bool:
    """Whether ``problem`` names one of the log entries (by index or by file line = index + 1)."""
    return any(f"log entry {i} " in problem or f"line {i + 1}:" in problem for i in indexes)


# -- the untouched records -------------------------------------------------------------------------


def test_untouched_records_verify(workspace_copy: Path) -> None:
    code, doc = verify(workspace_copy, *receipts_of(workspace_copy))
    assert code == 0, doc
    assert doc["ok"] is True and doc["problem"] is None
    assert doc["rounds_verified"] == ROUNDS
    assert doc["models_verified"] == ROUNDS
    assert doc["heads"] == ROUNDS
    assert doc["privacy_reports"] == ROUNDS * AGENTS
    assert doc["receipts_checked"] == ROUNDS * AGENTS
    assert sorted(doc["epsilon"]) == [f"agent-{i + 1}" for i in range(AGENTS)]
    assert doc["entries"] == len(read_lines(workspace_copy))


def test_untouched_records_plain_output_and_pinned_key(workspace_copy: Path) -> None:
    pinned = aggregator_key(workspace_copy).public_bytes.hex()
    result = CliRunner().invoke(
        main, ["audit", "verify", "--workspace", str(workspace_copy), "--aggregator-key", pinned]
    )
    assert result.exit_code == 0, result.output
    assert "OK: every check holds" in result.stdout
    assert f"rounds re-aggregated {ROUNDS}" in result.stdout


def test_another_aggregator_key_than_the_pinned_one_fails(workspace_copy: Path) -> None:
    other = SigningIdentity.generate().public_bytes.hex()
    problem = fails(workspace_copy, extra=("--aggregator-key", other))
    assert "log entry 0 (genesis)" in problem and "pinned" in problem


# -- the chain ------------------------------------------------------------------------------------


def _target(root: Path, kind: str) -> int:
    if kind == "accepted":
        return find(root, "accepted", stage="masked_input")
    if kind == "head":
        return find(root, "head", nth=-1)  # the last line: no later entry to chain to it
    if kind == "model_version":
        return find(root, "model_version", nth=-1)
    return find(root, kind, nth=1 if kind in ("roster", "privacy_report", "aggregate") else 0)


@pytest.mark.parametrize(
    "kind",
    ["genesis", "roster", "round_spec", "accepted", "privacy_report", "aggregate", "head"],
)
@pytest.mark.parametrize("how", ["hex_digit", "bit"])
def test_flipping_one_byte_of_an_entry_fails(workspace_copy: Path, kind: str, how: str) -> None:
    lines = read_lines(workspace_copy)
    index = _target(workspace_copy, kind)
    line = bytearray(lines[index])
    if how == "hex_digit":  # still valid, canonical JSON: only hashes and signatures notice
        match = re.search(rb"[0-9a-f]{64}", bytes(line))  # a key, hash or signature
        assert match is not None
        pos = match.start() + 10
        line[pos] = ord("0") if line[pos] != ord("0") else ord("1")
    else:  # an arbitrary bit flip in the middle of the line
        pos = len(line) // 2
        line[pos] ^= 0x01
    lines[index] = bytes(line)
    write_lines(workspace_copy, lines)
    problem = fails(workspace_copy)
    assert names_entry(problem, index, index + 1), problem


def test_flipping_a_byte_of_a_model_version_metric_fails(workspace_copy: Path) -> None:
    index = _target(workspace_copy, "model_version")
    lines = read_lines(workspace_copy)
    lines[index] = lines[index].replace(b'"accuracy":0.', b'"accuracy":1.', 1)
    assert lines[index] != read_lines(workspace_copy)[index]
    write_lines(workspace_copy, lines)
    problem = fails(workspace_copy)
    assert names_entry(problem, index, index + 1), problem


@pytest.mark.parametrize(
    ("kind", "stage"),
    [("accepted", "masked_input"), ("privacy_report", None), ("head", None), ("roster", None)],
)
def test_deleting_an_entry_fails(workspace_copy: Path, kind: str, stage: str | None) -> None:
    index = find(workspace_copy, kind, **({"stage": stage} if stage else {}))
    lines = read_lines(workspace_copy)
    del lines[index]
    write_lines(workspace_copy, lines)
    problem = fails(workspace_copy)
    assert f"line {index + 1}:" in problem and "expected" in problem, problem


def test_swapping_two_entries_fails(workspace_copy: Path) -> None:
    index = find(workspace_copy, "accepted", stage="masked_input")
    lines = read_lines(workspace_copy)
    lines[index], lines[index + 1] = lines[index + 1], lines[index]
    write_lines(workspace_copy, lines)
    problem = fails(workspace_copy)
    assert f"line {index + 1}:" in problem, problem


def test_swapping_two_entries_and_rehashing_fails_at_the_head(workspace_copy: Path) -> None:
    """Reordering two messages of a stage changes nothing the replay sees: the head must."""
    index = find(workspace_copy, "accepted", stage="masked_input")
    lines = read_lines(workspace_copy)
    lines[index], lines[index + 1] = lines[index + 1], lines[index]
    write_lines(workspace_copy, rechain(lines, index))
    head = next(e["index"] for e in entries(workspace_copy)[index:] if e["kind"] == "head")
    problem = fails(workspace_copy)
    assert f"log entry {head} (head)" in problem and "signature" in problem, problem


def test_inserting_a_forged_entry_fails(workspace_copy: Path) -> None:
    index = find(workspace_copy, "round_open", nth=1)
    lines = read_lines(workspace_copy)
    forged = json.loads(lines[index])
    forged["body"]["round"] = 99
    lines.insert(index + 1, encode(forged))
    write_lines(workspace_copy, lines)
    problem = fails(workspace_copy)
    assert f"line {index + 2}:" in problem, problem


def test_inserting_a_forged_entry_and_rehashing_fails_at_the_head(workspace_copy: Path) -> None:
    index = find(workspace_copy, "round_open", nth=1)
    lines = read_lines(workspace_copy)
    forged = json.loads(lines[index])
    # a well-formed alert: only the head can tell it was never written by the aggregator
    forged["kind"] = "alert"
    forged["body"] = {"detail": "nothing happened here", "time": forged["time"]}
    lines.insert(index + 1, encode(forged))
    write_lines(workspace_copy, rechain(lines, index + 1))
    head = next(e["index"] for e in entries(workspace_copy)[index:] if e["kind"] == "head")
    problem = fails(workspace_copy)
    assert f"log entry {head} (head)" in problem and "signature" in problem, problem


def test_truncating_the_last_line_fails(workspace_copy: Path) -> None:
    log = workspace_copy / LOG
    data = log.read_bytes()
    log.write_bytes(data[: -len(read_lines(workspace_copy)[-1]) // 2])
    problem = fails(workspace_copy)
    count = len(read_lines(workspace_copy))
    assert f"line {count}:" in problem and ("truncated" in problem or "JSON" in problem), problem


def test_a_line_that_is_not_json_fails(workspace_copy: Path) -> None:
    lines = read_lines(workspace_copy)
    index = len(lines) // 2
    lines[index] = b"this is not a log entry {"
    write_lines(workspace_copy, lines)
    problem = fails(workspace_copy)
    assert f"line {index + 1}:" in problem and "not JSON" in problem, problem


def test_an_unknown_entry_kind_fails(workspace_copy: Path) -> None:
    index = find(workspace_copy, "round_open", nth=1)
    edit_entry(workspace_copy, index, lambda doc: doc.update(kind="bonus_payment"))
    problem = fails(workspace_copy)
    assert f"line {index + 1}:" in problem and "bonus_payment" in problem, problem


def test_an_entry_in_non_canonical_form_fails(workspace_copy: Path) -> None:
    lines = read_lines(workspace_copy)
    index = find(workspace_copy, "round_open")
    lines[index] = json.dumps(json.loads(lines[index]), indent=None).encode()  # spaces
    write_lines(workspace_copy, lines)
    problem = fails(workspace_copy)
    assert f"line {index + 1}:" in problem and "canonical" in problem, problem


# -- a consistent rewrite of the chain: only the signed head can tell ------------------------------


@pytest.mark.parametrize(
    ("kind", "change"),
    [
        ("aggregate", lambda doc: doc["body"].update(weight_sum=2.5)),  # not re-derived
        ("round_open", lambda doc: doc["body"].update(attempt=7)),
        ("accepted", lambda doc: doc.update(time=doc["time"] - 3600)),  # backdated
        ("head", lambda doc: doc["body"].update(federation_id="another")),
    ],
)
def test_a_rehashed_chain_fails_at_the_next_signed_head(
    workspace_copy: Path, kind: str, change: Any
) -> None:
    index = find(workspace_copy, kind)
    edit_entry(workspace_copy, index, change, consistent=True)
    # every later line now chains and every later head names the new hashes ...
    problem = fails(workspace_copy)
    # ... but the first head at or after the change cannot be re-signed without the key
    head = next(e["index"] for e in entries(workspace_copy)[index:] if e["kind"] == "head")
    assert f"log entry {head} (head)" in problem, problem
    assert "head signature does not verify" in problem, problem


def test_a_rehashed_chain_with_stale_head_hashes_fails_at_the_head(workspace_copy: Path) -> None:
    """The attacker re-chains but leaves the heads' signed_hash alone."""
    index = find(workspace_copy, "round_open", nth=1)
    lines = read_lines(workspace_copy)
    doc = json.loads(lines[index])
    doc["body"]["attempt"] = 3
    lines[index] = encode(doc)
    write_lines(workspace_copy, rechain(lines, index + 1, fix_heads=False))
    head = next(e["index"] for e in entries(workspace_copy)[index:] if e["kind"] == "head")
    problem = fails(workspace_copy)
    assert f"log entry {head}" in problem and "head" in problem, problem


# -- a body outside its kind's schema: refused even when the operator re-signs ------------------


@pytest.mark.parametrize(
    ("kind", "match", "change", "expected"),
    [
        ("accepted", {}, lambda b: b.update(bonus=1), "unknown field `bonus`"),
        ("round_open", {}, lambda b: b.update(note="x"), "unknown field `note`"),
        ("roster", {}, lambda b: b.update(extra=True), "unknown field `extra`"),
        ("aggregate", {}, lambda b: b.pop("weight_sum"), "missing required field `weight_sum`"),
        ("model_version", {}, lambda b: b.pop("note"), "missing required field `note`"),
        ("accepted", {}, lambda b: b.pop("bytes"), "missing required field `bytes`"),
        (
            "accepted",
            {"stage": "advertise"},
            lambda b: b.update(commitment=None),
            "not in the form the aggregator writes",
        ),
        ("aggregate", {}, lambda b: b.update(survivors="all"), "Expected `array`"),
    ],
)
def test_a_body_outside_its_schema_fails_even_when_every_head_is_re_signed(
    workspace_copy: Path, kind: str, match: dict[str, Any], change: Any, expected: str
) -> None:
    """The operator holds the aggregator key: the chain and the heads all check out, so
    only the entry's schema (fedsec.protocol.log_entries) can refuse it."""
    index = find(workspace_copy, kind, **match)
    rewrite_signed(workspace_copy, index, lambda doc: change(doc["body"]))
    problem = fails(workspace_copy)
    assert f"log entry {index} ({kind}): {kind} body" in problem, problem
    assert expected in problem, problem


# -- signatures against the roster ---------------------------------------------------------------


def test_a_roster_entry_signed_by_a_non_admin_key_fails(workspace_copy: Path) -> None:
    """The aggregator swaps agent-1's key for its own and signs the entry itself."""
    index = find(workspace_copy, "roster", agent_id="agent-1")
    impostor = SigningIdentity.generate()
    forged = sign_roster_entry(
        federation_id=entries(workspace_copy)[0]["body"]["federation_id"],
        agent_id="agent-1",
        public_key=impostor.public_bytes,
        role="agent",
        admin=aggregator_key(workspace_copy),  # not the admin's key
    )
    edit_entry(workspace_copy, index, lambda doc: doc.update(body=forged.to_dict()))
    problem = fails(workspace_copy)
    assert f"log entry {index} (roster)" in problem and "admin signature" in problem, problem


def test_a_privacy_report_lowering_epsilon_fails(workspace_copy: Path) -> None:
    """Properly signed by the member, chained: only the monotonicity rule is broken."""
    first = entries(workspace_copy)[find(workspace_copy, "privacy_report", member="agent-2")]
    index = find(workspace_copy, "privacy_report", member="agent-2", round=2)
    report = msgspec.convert(entries(workspace_copy)[index]["body"], wire.PrivacyReport)
    lowered = msgspec.structs.replace(
        report, epsilon=first["body"]["epsilon"] / 2, signature=""
    ).sign(agent_key(workspace_copy, "agent-2"))
    lowered.verify(agent_key(workspace_copy, "agent-2").public_bytes)
    edit_entry(workspace_copy, index, lambda doc: doc.update(body=msgspec.to_builtins(lowered)))
    problem = fails(workspace_copy)
    assert f"log entry {index} (privacy_report)" in problem, problem
    assert "agent-2" in problem and "less than" in problem, problem


def test_a_privacy_report_not_matching_its_dp_parameters_fails(workspace_copy: Path) -> None:
    """Signed by the member but with ε the logged noise and sampling cannot give."""
    index = find(workspace_copy, "privacy_report", member="agent-3", round=ROUNDS)
    report = msgspec.convert(entries(workspace_copy)[index]["body"], wire.PrivacyReport)
    inflated = msgspec.structs.replace(report, epsilon=report.epsilon * 1.5, signature="").sign(
        agent_key(workspace_copy, "agent-3")
    )
    edit_entry(workspace_copy, index, lambda doc: doc.update(body=msgspec.to_builtins(inflated)))
    problem = fails(workspace_copy)
    assert f"log entry {index} (privacy_report)" in problem, problem
    assert "independent accountant" in problem, problem


def _redeclare(root: Path, change: Any) -> int:
    """Agent-3's last privacy report changed by ``change`` and re-signed, with every later
    head re-signed (the operator's key: only the report's content is tested); return
    its index."""
    index = find(root, "privacy_report", member="agent-3", round=ROUNDS)
    report = msgspec.convert(entries(root)[index]["body"], wire.PrivacyReport)
    changed = change(report).sign(agent_key(root, "agent-3"))
    rewrite_signed(root, index, lambda doc: doc.update(body=msgspec.to_builtins(changed)))
    return index


def test_a_charge_whose_report_never_reached_the_log_is_declared_and_verifies(
    workspace_copy: Path,
) -> None:
    """The member was charged for a training once more than the log shows (it dropped
    out after training): its next report declares that charge, and its ε composes it."""

    def dropped_once(report: wire.PrivacyReport) -> wire.PrivacyReport:
        assert report.charge == ROUNDS - 1  # one charge per round so far
        cost = (report.noise_multiplier, report.sample_rate, report.steps)
        # a long training, so that leaving it out puts ε past even the RDP bound
        long = (report.noise_multiplier, report.sample_rate, 10 * report.steps)
        missed = wire.ChargeRecord(report.charge, ROUNDS, *long)
        epsilon = epsilon_of([cost] * ROUNDS + [long], report.delta)
        assert epsilon > 1.1 * accountant.epsilon_range([cost] * ROUNDS, report.delta)[1]
        return msgspec.structs.replace(
            report,
            epsilon=epsilon + report.extra_epsilon,
            charge=report.charge + 1,
            unreported=[missed],
            signature="",
        )

    _redeclare(workspace_copy, dropped_once)
    code, doc = verify(workspace_copy)
    assert code == 0, doc["problem"]
    # the same ε without the declaration is more than the logged trainings give
    _redeclare(workspace_copy, lambda r: msgspec.structs.replace(r, unreported=[], signature=""))
    assert "independent accountant" in fails(workspace_copy)


def test_a_declared_charge_contradicting_its_logged_report_fails(workspace_copy: Path) -> None:
    def contradicting(report: wire.PrivacyReport) -> wire.PrivacyReport:
        first = wire.ChargeRecord(0, 1, report.noise_multiplier, report.sample_rate, 1)
        return msgspec.structs.replace(report, unreported=[first], signature="")

    index = _redeclare(workspace_copy, contradicting)
    problem = fails(workspace_copy)
    assert f"log entry {index} (privacy_report)" in problem, problem
    assert "agent-3 gives charge 0 on" in problem and "an earlier report gave it" in problem


def test_a_privacy_report_signed_by_another_member_fails(workspace_copy: Path) -> None:
    index = find(workspace_copy, "privacy_report", member="agent-1")
    report = msgspec.convert(entries(workspace_copy)[index]["body"], wire.PrivacyReport)
    forged = msgspec.structs.replace(report, signature="").sign(
        agent_key(workspace_copy, "agent-2")
    )
    edit_entry(workspace_copy, index, lambda doc: doc.update(body=msgspec.to_builtins(forged)))
    problem = fails(workspace_copy)
    assert f"log entry {index} (privacy_report)" in problem and "signature" in problem, problem


# -- the archive ---------------------------------------------------------------------------------


def _masked(root: Path, nth: int = 0) -> tuple[int, str]:
    index = find(root, "accepted", nth, stage="masked_input")
    return index, str(entries(root)[index]["body"]["sha256"])


def test_an_archived_masked_input_with_other_content_fails(workspace_copy: Path) -> None:
    index, digest = _masked(workspace_copy)
    path = archive_path(workspace_copy, digest)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    problem = fails(workspace_copy)
    assert f"log entry {index} (accepted)" in problem and digest in problem, problem


def test_another_archived_object_renamed_into_place_fails(workspace_copy: Path) -> None:
    index, digest = _masked(workspace_copy)
    _, other = _masked(workspace_copy, nth=1)
    shutil.copyfile(archive_path(workspace_copy, other), archive_path(workspace_copy, digest))
    problem = fails(workspace_copy)
    assert f"log entry {index} (accepted)" in problem and digest in problem, problem
    assert other in problem, problem  # names what the file actually holds


def test_a_missing_archived_object_fails(workspace_copy: Path) -> None:
    index = find(workspace_copy, "accepted", stage="unmask")
    digest = str(entries(workspace_copy)[index]["body"]["sha256"])
    archive_path(workspace_copy, digest).unlink()
    problem = fails(workspace_copy)
    assert f"log entry {index} (accepted)" in problem and digest in problem, problem


def test_a_substituted_masked_input_logged_consistently_fails(workspace_copy: Path) -> None:
    """Archive and log both changed to another vector: the member's statement does not sign it."""
    index, digest = _masked(workspace_copy)
    data = bytearray(archive_path(workspace_copy, digest).read_bytes())
    data[8] ^= 0x01
    forged = Archive(workspace_copy / ARCHIVE).put(bytes(data))
    edit_entry(workspace_copy, index, lambda doc: doc["body"].update(sha256=forged))
    problem = fails(workspace_copy)
    assert f"log entry {index} (accepted)" in problem and "contribution-statement" in problem


# -- models ---------------------------------------------------------------------------------------


def test_a_model_file_changed_on_disk_fails(workspace_copy: Path) -> None:
    index = find(workspace_copy, "model_version", version=3)
    digest = str(entries(workspace_copy)[index]["body"]["sha256"])
    path = model_path(workspace_copy, digest)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # a weight, not the header
    path.write_bytes(bytes(data))
    problem = fails(workspace_copy)
    assert f"log entry {index} (model_version)" in problem, problem


def test_a_missing_model_file_fails(workspace_copy: Path) -> None:
    index = find(workspace_copy, "model_version", version=2)
    digest = str(entries(workspace_copy)[index]["body"]["sha256"])
    model_path(workspace_copy, digest).unlink()
    problem = fails(workspace_copy)
    assert f"log entry {index} (model_version)" in problem and digest in problem, problem


def test_a_model_not_derived_from_the_round_sum_fails(workspace_copy: Path) -> None:
    """The logged optimiser does not match what produced the model: re-derivation differs."""
    index = find(workspace_copy, "aggregate", round=2)
    edit_entry(workspace_copy, index, lambda doc: doc["body"].update(server_lr=0.5))
    problem = fails(workspace_copy)
    assert "model_version" in problem and "re-deriving" in problem, problem


def test_an_aggregate_with_a_different_sum_fails(workspace_copy: Path) -> None:
    index = find(workspace_copy, "aggregate", round=1)
    edit_entry(workspace_copy, index, lambda doc: doc["body"].update(sum_sha256="ab" * 32))
    problem = fails(workspace_copy)
    assert f"log entry {index} (aggregate)" in problem and "sum" in problem, problem


@pytest.fixture(scope="module")
def fedadam_records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A federation whose server optimiser is FedAdam (moments carried across rounds)."""
    root = tmp_path_factory.mktemp("fedadam") / "federation"
    return build_workspace(root, server_optimizer="fedadam")


def test_fedadam_model_versions_are_re_derived_bit_for_bit(
    fedadam_records: Path, tmp_path: Path
) -> None:
    """Each version depends on the moments of every earlier round: the auditor's FedAdam
    (the aggregator's own, from fedsec.learning) must reproduce every file hash."""
    root = tmp_path / "federation"
    shutil.copytree(fedadam_records, root, ignore=shutil.ignore_patterns("*.lock"))
    aggregates = [e["body"] for e in entries(root) if e["kind"] == "aggregate"]
    assert [a["optimizer"] for a in aggregates] == ["fedadam"] * ROUNDS
    code, doc = verify(root, *receipts_of(root))
    assert code == 0, doc
    assert doc["rounds_verified"] == ROUNDS and doc["models_verified"] == ROUNDS
    # the same sums under FedAvg give other models: the re-derivation really ran FedAdam
    index = find(root, "aggregate", round=ROUNDS)
    edit_entry(root, index, lambda d: d["body"].update(optimizer="fedavg"))
    problem = fails(root)
    assert "model_version" in problem and "re-deriving" in problem, problem


@pytest.mark.parametrize(
    "codec",
    [
        pytest.param(
            {"quant_bits": 4, "rotation": "hadamard", "sparsity": 0.5, "error_feedback": True},
            id="compressed",
        ),
        pytest.param(
            {"quant_bits": 4, "rotation": "hadamard", "sparsity": 0.5, "headroom_bits": 1},
            id="compressed-wrapping",
        ),
        pytest.param({"dp_mode": "distributed", "dp_min_survivors": 1.0}, id="distributed"),
    ],
)
@pytest.mark.timeout(900)  # runs its own federation
def test_encoded_rounds_are_re_derived_bit_for_bit(
    codec: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The decoding is part of the signed recipe: the auditor replays the archived,
    encoded masked inputs through the spec's codec and re-derives every version."""
    root = build_workspace(tmp_path_factory.mktemp("codec") / "federation", **codec)
    specs = [e["body"] for e in entries(root) if e["kind"] == "round_spec"]
    assert specs and all(("codec" in s) != ("dp_mode" in codec) for s in specs)
    code, doc = verify(root, *receipts_of(root))
    assert code == 0, doc
    assert doc["rounds_verified"] == ROUNDS and doc["models_verified"] == ROUNDS
    index = find(root, "aggregate", round=1)
    edit_entry(root, index, lambda d: d["body"].update(sum_sha256="ab" * 32))
    problem = fails(root)
    assert f"log entry {index} (aggregate)" in problem and "sum" in problem, problem


# -- receipts -------------------------------------------------------------------------------------


def _receipt(root: Path, member: str = "agent-1", round_: int = 2) -> tuple[Path, wire.Receipt]:
    path = root / member / "receipts" / f"r{round_:06d}-a0.json"
    return path, msgspec.json.decode(path.read_bytes(), type=wire.Receipt)


def test_a_receipt_whose_log_index_points_elsewhere_fails(workspace_copy: Path) -> None:
    """Signed by the aggregator, but its log entry is not the contribution (it was dropped)."""
    path, receipt = _receipt(workspace_copy)
    elsewhere = find(workspace_copy, "round_open")
    moved = msgspec.structs.replace(receipt, log_index=elsewhere, signature="").sign(
        aggregator_key(workspace_copy)
    )
    path.write_bytes(msgspec.json.encode(moved))
    problem = fails(workspace_copy, path)
    assert str(path) in problem and f"log entry {elsewhere}" in problem, problem


def test_a_receipt_pointing_at_another_members_contribution_fails(workspace_copy: Path) -> None:
    path, receipt = _receipt(workspace_copy, "agent-1")
    other = find(workspace_copy, "accepted", stage="masked_input", member="agent-2", round=2)
    moved = msgspec.structs.replace(receipt, log_index=other, signature="").sign(
        aggregator_key(workspace_copy)
    )
    path.write_bytes(msgspec.json.encode(moved))
    problem = fails(workspace_copy, path)
    assert str(path) in problem and "different contribution" in problem, problem


def test_a_receipt_with_a_bad_signature_fails(workspace_copy: Path) -> None:
    path, receipt = _receipt(workspace_copy)
    sig = receipt.signature
    bad = msgspec.structs.replace(receipt, signature=sig[:-1] + ("0" if sig[-1] != "0" else "1"))
    path.write_bytes(msgspec.json.encode(bad))
    problem = fails(workspace_copy, workspace_copy / "agent-1" / "receipts")
    assert str(path) in problem and "not signed" in problem, problem


def test_a_receipt_that_is_not_a_receipt_fails(workspace_copy: Path) -> None:
    path, _ = _receipt(workspace_copy)
    path.write_bytes(b'{"hello": "world"}')
    problem = fails(workspace_copy, path)
    assert str(path) in problem and "unreadable" in problem, problem


# -- numbers the log's standard JSON cannot hold (issue 32 item 6) --------------------------------


@pytest.mark.parametrize(
    "changes",
    [
        {"delta": math.nan, "noise_multiplier": math.inf, "sample_rate": math.nan},
        {"epsilon_budget": math.inf},
        {"noise_multiplier": math.inf},
        {"sample_rate": math.nan},
    ],
    ids=lambda c: ",".join(c),
)
def test_a_privacy_report_with_non_finite_numbers_is_named(
    workspace_copy: Path, changes: dict[str, float]
) -> None:
    """An aggregator that let NaN or infinity through (as before issue 32) wrote them into
    the log; the member signed them, the operator re-signs every head.  Verification names
    the entry and the member instead of stopping on an exception."""
    index = _redeclare(
        workspace_copy, lambda r: msgspec.structs.replace(r, **changes, signature="")
    )
    line = read_lines(workspace_copy)[index]
    assert b"NaN" in line or b"Infinity" in line
    problem = fails(workspace_copy)
    assert names_entry(problem, index), problem
    assert "agent-3" in problem and next(iter(changes)) in problem, problem
