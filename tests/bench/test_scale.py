"""``fedsec bench scale`` at a small size: the row a user reads, from a real run (a
separate aggregator process and real members over loopback)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from fedsec.bench.scale import bench_scale
from fedsec.bench.scale_memory import growth, traced_aggregator

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


def test_intake_needs_one_shard_count_and_server_counts() -> None:
    result = CliRunner().invoke(bench_scale, ["--members", "8", "--intake", "0,1"])
    assert result.exit_code != 0 and "one --shards count of at least 2" in result.output
    result = CliRunner().invoke(bench_scale, ["--shards", "2", "--intake", "1,x"])
    assert result.exit_code != 0 and "comma-separated integers" in result.output


# The child waits for the hook's first snapshot, as a bench waits for its aggregator.
_WAIT_FOR_SNAPSHOT = """
import pathlib, sys, time
snap = pathlib.Path(sys.argv[1]) / "last.snap"
deadline = time.monotonic() + 20
while not snap.exists() and "aggregator" in sys.argv and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def test_trace_memory_samples_the_serving_aggregator_only(tmp_path: Path) -> None:
    out, workspace = tmp_path / "trace", tmp_path / "workspace"
    workspace.mkdir()
    (workspace / "serve.json").write_text("{}")  # what the hook waits for: it serves
    before = dict(os.environ)
    with traced_aggregator(out):
        member = [sys.executable, "-c", _WAIT_FOR_SNAPSHOT, str(out), "member"]
        subprocess.run(member, check=True, timeout=60)
        assert list(out.iterdir()) == []  # a member process traces nothing
        serve = ["aggregator", "serve", "--workspace", str(workspace)]
        subprocess.run([sys.executable, "-c", _WAIT_FOR_SNAPSHOT, str(out), *serve], timeout=60)
    assert dict(os.environ) == before
    line = (out / "memory.log").read_text().splitlines()[0]
    assert "rss=" in line and "traced=" in line
    assert growth(out / "peak.snap", out / "last.snap") is not None


def test_an_intake_row_says_what_each_process_spent_and_projects_from_it() -> None:
    result = CliRunner().invoke(
        bench_scale,
        ["--members", "12", "--shards", "2", "--intake", "1,0", "--json"],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    one, leader = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    assert (one["group_servers"], leader["group_servers"]) == (1, 0)
    for row in (one, leader):
        assert row["messages"] == 3 * 12 and row["machine_cores"] >= row["cores"] >= 1
        assert row["leader_cpu_s_to_next_stage"] >= row["leader_cpu_s"] >= 0
        assert row["sender_cpu_s"] > 0
        per = 1000 * row["leader_cpu_s_to_next_stage"] / row["messages"]
        assert abs(row["leader_cpu_ms_per_message"] - per) < 1e-3
        # every accepted message is committed under the store's lock: in a transaction
        # of its own at the leader, with the others of its batch at a group server
        if row["group_servers"]:
            assert row["store_transactions"] >= 1
        else:
            assert row["store_transactions"] >= row["messages"]
        assert row["store_lock_ms_per_message"] > 0
        assert row["store_lock_core_wait_ms_per_message"] >= 0
        t_lock = row["store_lock_ms_per_message"] - row["store_lock_core_wait_ms_per_message"]
        t_leader = row["leader_cpu_ms_per_message"] + row["leader_commit_wait_ms_per_message"]
        bounds = {
            "leader": 1000 / t_leader if t_leader else math.inf,
            "store_lock": 1000 / t_lock if t_lock > 0 else math.inf,
        }
        if row["group_servers"]:
            # /proc counts in ticks (10 ms): the leader's replay of 36 small messages
            # beside a server may read 0, the server's own work may not
            cpu = row["group_server_cpu_s"]
            assert len(cpu) == 1 and cpu[0] > 0
            per = 1000 * sum(cpu) / row["messages"]
            assert abs(row["group_servers_cpu_ms_per_message"] - per) < 1e-3
            t_servers = (
                row["group_servers_cpu_ms_per_message"]
                + row["group_servers_commit_wait_ms_per_message"]
            )
            bounds["group_servers"] = 1000 / t_servers
        else:
            assert row["leader_cpu_s_to_next_stage"] > 0  # it took every message
            assert "group_server_cpu_s" not in row
            assert "group_servers_cpu_ms_per_message" not in row
        limit = min(bounds, key=bounds.__getitem__)
        assert row["projected_limit"] == limit
        assert (
            abs(row["projected_accepted_per_s_with_cores"] - bounds[limit]) < 2e-3 * bounds[limit]
        )
