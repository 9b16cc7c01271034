"""``fedsec audit report``: one self-contained HTML page from a real federation's records."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from click.testing import CliRunner

from fedsec.audit.report import LogSummary, RoundRow, render_report, summarize
from fedsec.audit.verify import VerifyResult
from fedsec.cli import main
from tests.support.audit import (
    AGENTS,
    ROUNDS,
    edit_entry,
    entries,
    find,
)

pytestmark = pytest.mark.slow  # the session fixture runs a real federation (~15 s)


class _Resources(HTMLParser):
    """Every URL-bearing attribute and every element name in a page."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self.tags: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        for name, value in attrs:
            if name in ("src", "href", "xlink:href", "action", "data", "poster") and value:
                self.urls.append(value)


def report(root: Path, out: Path, *extra: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(
        main, ["audit", "report", "--workspace", str(root), "--out", str(out), *extra]
    )
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"report raised: {result.exception!r}")
    page = out.read_text(encoding="utf-8") if out.exists() else ""
    return result.exit_code, result.output, page


def _rows(page: str) -> dict[tuple[int, int], list[str]]:
    """Cells of the per-round table, by (round, attempt)."""
    rows = {}
    for m in re.finditer(r'<tr id="round-(\d+)-(\d+)">(.*?)</tr>', page):
        cells = [
            re.sub(r"<[^>]+>", " ", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", m[3])
        ]
        rows[(int(m[1]), int(m[2]))] = cells
    return rows


def test_report_of_untouched_records(workspace_copy: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    receipts = workspace_copy / "agent-1" / "receipts"
    code, output, page = report(workspace_copy, out, "--receipts", str(receipts))
    assert code == 0, output
    assert f"report written to {out}" in output and "OK: every check holds" in output
    assert page.startswith("<!DOCTYPE html>")

    # self-contained: nothing to fetch, nothing to run
    parser = _Resources()
    parser.feed(page)
    assert parser.urls == [], parser.urls
    assert "http://" not in page and "https://" not in page
    assert not parser.tags & {"script", "link", "img", "iframe", "object", "embed"}
    assert "<style>" in page and page.count("<svg") == 4

    # the verification result
    assert "VERIFIED" in page and "FAILED" not in page
    assert f"rounds re-aggregated</th><td>{ROUNDS}<" in page
    assert f"receipts checked</th><td>{ROUNDS}<" in page

    # one row per round attempt, with the figures the log holds
    log = entries(workspace_copy)
    rows = _rows(page)
    assert sorted(rows) == [(r, 0) for r in range(1, ROUNDS + 1)]
    for r in range(1, ROUNDS + 1):
        aggregate = log[find(workspace_copy, "aggregate", round=r)]["body"]
        version = log[find(workspace_copy, "model_version", round=r)]["body"]
        reports = [
            e["body"]["epsilon"]
            for e in log
            if e["kind"] == "privacy_report" and e["body"]["round"] == r
        ]
        cells = rows[(r, 0)]
        assert cells[:4] == [str(r), "0", "closed", str(AGENTS)], cells
        assert cells[4] == str(len(aggregate["survivors"]))
        assert cells[6] == str(AGENTS)  # contributions accepted
        assert cells[8] == str(version["version"])
        assert cells[9] == f"{version['metrics']['accuracy']:.4f}"
        assert cells[10] == f"{max(reports):.3f}"
        assert float(cells[12]) >= 0  # aggregation time, from the log's timestamps

    # the roster and every member's ε
    for i in range(AGENTS):
        assert f"agent-{i + 1}" in page
    assert "Verdicts</h3><p>none" in page


def test_report_of_a_tampered_log_says_failed(workspace_copy: Path, tmp_path: Path) -> None:
    index = find(workspace_copy, "aggregate", round=2)
    edit_entry(workspace_copy, index, lambda doc: doc["body"].update(weight_sum=1.0))
    out = tmp_path / "report.html"
    code, output, page = report(workspace_copy, out)
    assert code == 1, output
    assert out.exists(), "the report is written even when verification fails"
    assert "FAILED" in output and "FAILED" in page
    assert "not vouched for" in page
    assert "head signature does not verify" in page
    assert len(_rows(page)) == ROUNDS  # still shows what the log says


def test_report_of_a_log_with_a_garbage_line(workspace_copy: Path, tmp_path: Path) -> None:
    log = workspace_copy / "aggregator" / "audit" / "log.jsonl"
    lines = log.read_bytes().splitlines()
    lines[10] = b"\xff\xfe not json"
    log.write_bytes(b"".join(line + b"\n" for line in lines))
    out = tmp_path / "report.html"
    code, _, page = report(workspace_copy, out)
    assert code == 1
    assert "FAILED" in page and "not JSON" in page and "unreadable lines" in page


def test_report_shows_verdicts(workspace_copy: Path, tmp_path: Path) -> None:
    verdicts = tmp_path / "verdicts.json"
    verdicts.write_text(
        json.dumps(
            {
                "verdicts": [
                    {
                        "member": "agent-1",
                        "round": 1,
                        "passed": True,
                        "failed": [],
                        "scores": {"z_dir": 5.2},
                    },
                    {
                        "member": "agent-2",
                        "round": 2,
                        "attempt": 0,
                        "passed": False,
                        "failed": ["direction", "replay"],
                        "scores": {"z_dir": -3.1},
                    },
                ]
            }
        )
    )
    out = tmp_path / "report.html"
    code, output, page = report(workspace_copy, out, "--verdicts", str(verdicts))
    assert code == 0, output
    assert "2 checked, 1 failed" in page
    assert "direction, replay" in page and "z_dir 5.2" in page


def test_a_malformed_verdicts_file_is_refused(workspace_copy: Path, tmp_path: Path) -> None:
    verdicts = tmp_path / "verdicts.json"
    verdicts.write_text('{"verdicts": [{"who": "agent-1"}]}')
    out = tmp_path / "report.html"
    code, output, _ = report(workspace_copy, out, "--verdicts", str(verdicts))
    assert code == 1 and "verdicts file" in output and not out.exists()


# -- rendering, without a federation --------------------------------------------------------------


def test_everything_from_the_log_is_escaped() -> None:
    hostile = '<script>alert("x")</script><img src=https://evil.example/x.png>'
    key = "ab" * 32
    # well-formed bodies (the report decodes each with its kind's struct) carrying the
    # hostile string in every free-text field the page shows
    spec = {
        "federation_id": hostile,
        "round": 1,
        "attempt": 0,
        "secure_sum": "secagg",
        "model_version": 0,
        "model_sha256": key,
        "task": hostile,
        "task_version": hostile,
        "schema_fingerprint": hostile,
        "cohort": [hostile],
        "neighbors": 1,
        "threshold": 1,
        "quant_bits": 16,
        "ring_bits": 32,
        "clip_norm": 1.0,
        "dim": 3,
        "seed": key,
        "max_weight_samples": 10,
        "weight_caps": {},
        "training": {"local_epochs": 1, "batch_size": 8, "lr": 0.1, "optimizer": hostile},
        "dp": {"enabled": True, "noise_multiplier": 1.0, "max_grad_norm": 1.0, "delta": 1e-5},
        "deadlines": {},
        "signature": hostile,
    }
    report = {
        "federation_id": hostile,
        "round": 1,
        "attempt": 0,
        "member": hostile,
        "dataset_id": hostile,
        "epsilon": 1.0,
        "delta": 1e-5,
        "noise_multiplier": 1.0,
        "sample_rate": 0.1,
        "steps": 1,
        "samples": 10,
        "signature": hostile,
    }
    genesis = {
        "federation_id": hostile,
        "aggregator_public_key": hostile,
        "admin_public_key": hostile,
        "task": hostile,
        "task_version": hostile,
        "schema_fingerprint": hostile,
        "server": {"optimizer": hostile, "server_lr": hostile},
        "round": {"rounds": hostile, "min_agents": hostile, "secure_sum": hostile},
    }
    roster = {
        "agent_id": hostile,
        "public_key": hostile,
        "role": "agent",
        "max_weight": None,
        "status": "active",
        "added_at": 2.0,
        "revoked_at": None,
        "admin_signature": hostile,
    }
    challenge = {
        "round": 1,
        "attempt": 0,
        "member": hostile,
        "auditor": hostile,
        "beacon_index": 1,
        "beacon": hostile,
        "rate": 0.5,
    }
    bodies = [
        ("genesis", genesis),
        ("roster", roster),
        ("round_spec", spec),
        ("privacy_report", report),
        ("round_aborted", {"round": 1, "attempt": 0, "detail": hostile}),
        ("alert", {"detail": hostile, "time": 6.0}),
        ("rollback", {"version": 2, "weights_of": 1, "note": hostile}),
        ("challenge", challenge),
        ("aggregate", {"round": "x"}),  # malformed
    ]
    docs = [
        {"index": i, "time": float(i + 1), "kind": kind, "body": body}
        for i, (kind, body) in enumerate(bodies)
    ]
    summary = summarize(docs)
    page = render_report(
        summary,
        VerifyResult(ok=False, problem=hostile),
        inputs={"log": hostile},
        verdicts=[{"member": hostile, "round": hostile, "passed": hostile, "failed": [hostile]}],
    )
    parser = _Resources()
    parser.feed(page)
    assert parser.urls == [] and not parser.tags & {"script", "img"}
    assert "&lt;script&gt;" in page
    assert "aborted" in page and "not understood" in page
    # every well-formed entry was understood, and so reached the page escaped
    assert [e for e in summary.events if e[1] == "unreadable"] == [
        (8, "unreadable", "aggregate entry not understood")
    ]
    assert summary.genesis is not None and hostile in summary.roster
    assert page.count("&lt;script&gt;") >= 10


def test_empty_summary_renders() -> None:
    page = render_report(LogSummary(), VerifyResult(ok=False, problem="holds no entries"))
    assert "no rounds" in page and "FAILED" in page


def test_round_row_times() -> None:
    row = RoundRow(1, 0, status="closed", spec_time=10.0, last_message_time=14.0, close_time=14.5)
    assert row.duration_s == 4.5 and row.aggregation_s == 0.5
    assert RoundRow(1, 0, status="aborted", spec_time=1.0, close_time=2.0).aggregation_s is None
