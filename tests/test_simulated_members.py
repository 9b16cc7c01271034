"""The simulated members' plan, ranges and process count, without running a federation
(the runs are in tests/e2e/test_simulate_processes.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from click.testing import CliRunner

from fedsec.demo import simulate
from fedsec.errors import ConfigError
from fedsec.simulated_members import (
    PLAN_FILE,
    MemberPlan,
    default_member_processes,
    parse_member_range,
    read_plan,
    run_member_processes,
    split,
    write_plan,
)
from fedsec.simulation import SimulationSpec, run_simulation

PLAN = MemberPlan(
    url="http://127.0.0.1:1",
    aggregator_public_key="00" * 32,
    task="breast_cancer",
    members=6,
    partition="iid",
    seed=0,
    dp_epsilon=None,
    distributed_dp=False,
)


def test_a_member_range_is_a_slice_of_the_roster() -> None:
    assert parse_member_range("", 6) == range(6)
    assert parse_member_range("2:5", 6) == range(2, 5)
    for bad in ("5:2", "3:3", "-1:2", "0:7", "3", "a:b", ":4"):
        with pytest.raises(ConfigError, match="0 <= A < B <= 6"):
            parse_member_range(bad, 6)


def test_processes_split_the_members_evenly_and_exactly() -> None:
    for members, processes in ((range(1000), 7), (range(3, 9), 2), (range(5), 8)):
        ranges = split(members, processes)
        assert [i for r in ranges for i in r] == list(members)
        assert max(map(len, ranges)) - min(map(len, ranges)) <= 1
        assert len(ranges) == min(processes, len(members))


def test_the_default_leaves_a_core_to_the_aggregator_and_small_runs_in_one() -> None:
    assert default_member_processes(50, 16) == 1  # the 50-member run stays as it was
    assert default_member_processes(1000, 16) == 10
    assert default_member_processes(5000, 16) == 15
    assert default_member_processes(1000, 2) == 1
    assert default_member_processes(1000, 1) == 1


def test_the_plan_round_trips_and_a_stranger_file_is_refused(tmp_path: Path) -> None:
    path = write_plan(PLAN, tmp_path)
    assert path.name == PLAN_FILE and read_plan(path) == PLAN
    assert "identity" not in path.read_text()  # no secret in it
    path.write_text('{"url": "http://x"}')
    with pytest.raises(ConfigError, match="is not a members' plan"):
        read_plan(path)
    with pytest.raises(ConfigError, match="cannot read the members' plan"):
        read_plan(tmp_path / "absent.json")


def test_losing_members_on_purpose_needs_them_in_one_process(tmp_path: Path) -> None:
    spec = SimulationSpec(
        task="breast_cancer", agents=4, rounds=1, kill_fraction=0.5, member_processes=2
    )
    with pytest.raises(ConfigError, match="--member-processes 1"):
        asyncio.run(run_simulation(spec, workdir=tmp_path))
    assert not (tmp_path / PLAN_FILE).exists()  # refused before anything was served


def test_a_failed_member_process_names_its_log(tmp_path: Path) -> None:
    plan = write_plan(PLAN, tmp_path)  # no member homes beside it: no identity keys
    with pytest.raises(ConfigError, match="members 0:2 exited with code 1; see") as caught:
        asyncio.run(run_member_processes(plan, [range(0, 2)], 1))
    log = Path(str(caught.value).rsplit("see ", 1)[1])
    assert "identity.key" in log.read_text()


def test_members_only_without_a_plan_says_so(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        simulate, ["--members-only", str(tmp_path / "members.json"), "--member-range", "0:2"]
    )
    assert result.exit_code != 0
    assert "cannot read the members' plan" in result.output


def test_simulate_says_which_member_range_is_wrong(tmp_path: Path) -> None:
    args = ["--task", "breast_cancer", "--agents", "4", "--member-range", "3:9"]
    result = CliRunner().invoke(simulate, [*args, "--workdir", str(tmp_path / "fed")])
    assert result.exit_code != 0
    assert "member range '3:9': give A:B with 0 <= A < B <= 4" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "fed" / PLAN_FILE).exists()  # refused before serving
