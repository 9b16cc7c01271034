"""``fedsec simulate`` with its members spread over processes, and over "machines" (a
coordinator running some members and a ``--members-only`` process the others, from the
plan): under the unsafe deterministic seed every spread gives the one-process model, bit
for bit, and a result of the same shape."""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fedsec.simulated_members import PLAN_FILE
from fedsec.simulation import SimulationSpec, run_simulation

SPEC = SimulationSpec(task="breast_cancer", agents=6, rounds=1, baseline=False, unsafe_seed="t")
#: Seconds the coordinator may take to write its plan (it serves first: Python + torch).
PLAN_S = 120.0


def _run(spec: SimulationSpec, workdir: Path) -> dict[str, Any]:
    return asyncio.run(run_simulation(spec, workdir=workdir))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run(replace(SPEC, member_processes=1), tmp_path_factory.mktemp("one"))


def test_two_member_processes_give_the_one_process_model(
    one_process: dict[str, Any], tmp_path: Path
) -> None:
    two = _run(replace(SPEC, member_processes=2), tmp_path)
    assert (one_process["member_processes"], two["member_processes"]) == (1, 2)
    assert two["rounds"] == one_process["rounds"] == SPEC.rounds
    assert two["aborted_rounds"] == 0
    assert two["model_sha256"] == one_process["model_sha256"]
    assert two.keys() == one_process.keys()
    # each process ran its half and said so
    for name in ("members-0-3", "members-3-6"):
        assert (tmp_path / f"{name}.json").read_text().startswith('{"members":3,')


async def _members_elsewhere(workdir: Path, members: str) -> int:
    """Once the coordinator wrote its plan, run ``members`` from it in a process of their
    own, as another machine would; its exit code."""
    plan = workdir / PLAN_FILE
    deadline = time.monotonic() + PLAN_S
    while not plan.exists():
        assert time.monotonic() < deadline, "the coordinator wrote no plan"
        await asyncio.sleep(0.1)
    args = ["simulate", "--members-only", str(plan), "--member-range", members]
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "fedsec", *args)
    return await proc.wait()


def test_members_elsewhere_join_from_the_plan(one_process: dict[str, Any], tmp_path: Path) -> None:
    coordinator = replace(SPEC, local_members="0:3", member_processes=1)

    async def both() -> tuple[dict[str, Any], int]:
        served = run_simulation(coordinator, workdir=tmp_path)
        result, code = await asyncio.gather(served, _members_elsewhere(tmp_path, "3:6"))
        return result, code

    result, code = asyncio.run(both())
    assert code == 0
    assert result["rounds"] == SPEC.rounds and result["aborted_rounds"] == 0
    assert result["model_sha256"] == one_process["model_sha256"]
