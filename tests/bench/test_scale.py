"""``fedsec bench scale`` at a small size: the row a user reads, from a real run (a
separate aggregator process and real members over loopback)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from fedsec.bench.scale import bench_scale

MEMBERS = 4


def test_a_row_per_member_count_with_the_aggregators_cost() -> None:
    result = CliRunner().invoke(
        bench_scale,
        ["--members", str(MEMBERS), "--rounds", "1", "--task", "breast_cancer", "--json"],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    assert len(rows) == 1
    row = rows[0]
    assert (row["members"], row["rounds"], row["rounds_closed"]) == (MEMBERS, 1, 1)
    assert row["connections_refused"] == 0
    assert row["member_processes"] == 1  # a few members stay in the simulating process
    assert row["aggregator_cpu_ms_per_member_round"] > 0
    assert row["aggregator_peak_rss_mb"] > 0
    assert row["requests_per_member_round"] > 0 and row["bytes_up_per_member_round"] > 0
    # the floor: the Ed25519 checks of a member-round's requests, timed in the same run
    assert row["ed25519_check_us"] > 0
    floor = row["requests_per_member_round"] * row["ed25519_check_us"] / 1000
    assert abs(row["signature_floor_ms_per_member_round"] - floor) < 0.01
    assert row["cpu_over_signature_floor"] > 0


def test_member_counts_are_checked() -> None:
    result = CliRunner().invoke(bench_scale, ["--members", "100,x"])
    assert result.exit_code != 0 and "comma-separated integers" in result.output
