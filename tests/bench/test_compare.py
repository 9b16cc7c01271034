"""fedsec bench compare on synthetic recorded rows: a ratio that moved beyond its noise
is reported, one within it is not, a missing baseline is said, and the newest matching
row is the baseline."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from fedsec.bench import compare as cmp
from fedsec.cli import main

SECAGG = next(c for c in cmp.CHECKS if c.name == "secagg")
SIMULATE = next(c for c in cmp.CHECKS if c.name == "simulate")


def _secagg_row(**fields: Any) -> dict[str, Any]:
    row = {
        "bench": "secagg",
        "clients": 100,
        "dim": 1_000_000,
        "dropout": 0.1,
        "dropout_stage": "masked",
        "neighbors": 7,
        "threshold": 4,
        "bits": 8,
        "ring_bits": 15,
        "server_over_floor": 1.5,
        "client_over_floor": 1.6,
        "bytes_per_param": 1.875002,
    }
    return {**row, **fields}


def _sim_row(seed: int, accuracy: float, **fields: Any) -> dict[str, Any]:
    row = {
        "bench": "simulate",
        "task": "mnist1d",
        "agents": 10,
        "rounds": 15,
        "partition": "iid",
        "secure_sum": "secagg",
        "quant_bits": 8,
        "dp_epsilon": None,
        "server_optimizer": "fedavg",
        "server_lr": 1.0,
        "seed": seed,
        "final_accuracy": accuracy,
    }
    return {**row, **fields}


def _write(results: Path, name: str, rows: Sequence[dict[str, Any]]) -> None:
    results.mkdir(exist_ok=True)
    with (results / name).open("a") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")


def _by_metric(findings: list[cmp.Finding]) -> dict[str, cmp.Finding]:
    return {f.metric: f for f in findings}


def test_a_ratio_that_moved_beyond_its_noise_is_reported_and_one_within_is_not() -> None:
    recorded = [_secagg_row()]
    # server/floor 1.5 -> 2.0 (+33 %, noise 25 %); client/floor 1.6 -> 1.7 (+6 %)
    today = [_secagg_row(server_over_floor=s, client_over_floor=1.7) for s in (2.1, 2.0, 1.9)]
    found = _by_metric(cmp.compare(SECAGG, today, recorded))
    assert found["server_over_floor"].moved
    assert found["server_over_floor"].current == 2.0  # the median of the repeats
    assert found["server_over_floor"].noise == pytest.approx(0.375)
    assert "MOVED" in found["server_over_floor"].line()
    assert not found["client_over_floor"].moved
    assert "within noise" in found["client_over_floor"].line()
    assert not found["bytes_per_param"].moved


def test_bytes_per_parameter_has_no_noise() -> None:
    found = _by_metric(
        cmp.compare(SECAGG, [_secagg_row(bytes_per_param=1.875003)], [_secagg_row()])
    )
    assert found["bytes_per_param"].moved


def test_a_missing_baseline_is_said_and_is_not_a_move() -> None:
    # the recorded rows ran in a 16-bit ring: other parameters, no baseline for 15 bits
    found = cmp.compare(SECAGG, [_secagg_row()], [_secagg_row(ring_bits=16)])
    assert all(not f.moved for f in found)
    assert all("no recorded row with these parameters" in f.line() for f in found)


def test_the_newest_matching_row_is_the_baseline(tmp_path: Path) -> None:
    results = tmp_path / "results"
    # unstamped rows: older than stamped ones; among stamped ones the latest stamp wins,
    # whatever the file or line it is on
    _write(results, "b.jsonl", [_secagg_row(server_over_floor=9.0)])
    _write(
        results,
        "a.jsonl",
        [
            _secagg_row(server_over_floor=1.1, recorded_at="2026-12-05T18:00:00+00:00"),
            _secagg_row(server_over_floor=1.2, recorded_at="2026-12-04T18:00:00+00:00"),
            _secagg_row(server_over_floor=5.0, ring_bits=16, recorded_at="2026-12-06T00:00:00"),
        ],
    )
    recorded = cmp.load_recorded(results)
    newest = cmp.newest_match(recorded, _secagg_row(), SECAGG.params)
    assert newest is not None and newest["server_over_floor"] == 1.1


def test_an_older_row_without_a_codec_field_matches_its_default() -> None:
    today = _secagg_row(rotation="none", keep=1.0, range_stddevs=0.0, headroom_bits=0)
    assert cmp.newest_match([_secagg_row()], today, SECAGG.params) is not None
    assert cmp.newest_match([_secagg_row()], {**today, "keep": 0.4}, SECAGG.params) is None


def test_accuracy_is_compared_as_the_mean_over_seeds() -> None:
    recorded = [_sim_row(0, 0.80), _sim_row(1, 0.82), _sim_row(2, 0.78)]
    same = [_sim_row(0, 0.79), _sim_row(1, 0.83), _sim_row(2, 0.79)]
    (finding,) = cmp.compare(SIMULATE, same, recorded)
    assert not finding.moved and finding.recorded == pytest.approx(0.80)
    worse = [_sim_row(0, 0.74), _sim_row(1, 0.75), _sim_row(2, 0.73)]
    (finding,) = cmp.compare(SIMULATE, worse, recorded)
    assert finding.moved and finding.current == pytest.approx(0.74)
    (finding,) = cmp.compare(SIMULATE, [*same, _sim_row(3, 0.8)], recorded)
    assert not finding.moved and "seeds [3]" in finding.line()


def test_the_command_prints_what_moved_exits_1_and_records_a_baseline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = tmp_path / "results"
    _write(results, "secagg.jsonl", [_secagg_row()])
    measured = [_secagg_row(server_over_floor=3.0) for _ in range(3)]  # --repeat 3

    def fake_run(argv: Sequence[str]) -> list[dict[str, Any]]:
        assert argv[:2] == ("bench", "secagg")
        return [dict(row) for row in measured]

    monkeypatch.setattr(cmp, "run_command", fake_run)
    args = ["bench", "compare", "--results", str(results), "--only", "secagg"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    assert "secagg: server_over_floor 1.5 -> 3 " in result.output and "MOVED" in result.output
    assert "1 of 3 metrics moved" in result.output
    # recorded: today's row becomes the newest baseline, and nothing moves against it
    assert CliRunner().invoke(main, [*args, "--record"]).exit_code == 1
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (results / "secagg.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and rows[-1]["recorded_at"]


def test_a_failed_benchmark_is_said_and_the_other_checks_still_run(tmp_path: Path) -> None:
    results = tmp_path / "results"
    _write(results, "secagg.jsonl", [_secagg_row()])

    def run(argv: Sequence[str]) -> list[dict[str, Any]]:
        if argv[0] == "simulate":
            raise RuntimeError("fedsec simulate failed (1): boom")
        return [_secagg_row()]

    findings = cmp.run_checks([SIMULATE, SECAGG], results, run=run)
    assert findings[0].failed and "boom" in findings[0].line()
    assert [f.metric for f in findings[1:]] == list(SECAGG.metrics)
    assert not any(f.moved for f in findings)


def test_a_timing_is_compared_with_the_median_of_the_newest_three_rows() -> None:
    # one lucky round among the newest three is not the baseline
    recorded = [_secagg_row(server_over_floor=v) for v in (9.0, 1.6, 1.0, 1.5)]
    found = _by_metric(cmp.compare(SECAGG, [_secagg_row(server_over_floor=1.5)], recorded))
    assert found["server_over_floor"].recorded == 1.5
    assert not found["server_over_floor"].moved
