"""``fedsec simulate`` reports a task's primary metric under its own name: a regression's
R² is ``final_r2``, never ``final_accuracy``."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

from fedsec.simulation import SimulationSpec, run_simulation


def test_a_regression_simulation_reports_r2_under_its_name(tmp_path: Path) -> None:
    spec = SimulationSpec(
        task="diabetes", agents=3, rounds=1, secure_sum="none", aggregator_process=False
    )
    result = asyncio.run(run_simulation(spec, workdir=tmp_path))
    assert result["aborted_rounds"] == 0
    assert (result["primary_metric"], result["higher_is_better"]) == ("r2", True)
    # R² of a fitted linear model on held-out data: finite, at most 1
    assert math.isfinite(result["final_r2"]) and result["final_r2"] <= 1.0
    assert math.isfinite(result["centralized_r2"]) and result["centralized_r2"] <= 1.0
    expected_gap = round(100 * (result["centralized_r2"] - result["final_r2"]), 2)
    assert result["gap_pt"] == expected_gap
    # the task has no accuracy: the keys older benches read say so instead of holding R²
    assert math.isnan(result["final_accuracy"]) and math.isnan(result["centralized_accuracy"])
