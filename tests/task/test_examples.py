"""The examples/ task packages: installed by pip, their own tests pass, and a real
federation over loopback trains them (``fedsec simulate``, small sizes)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.support.postgres import PASSWORD, postgres_server
from tests.task.test_package_install import STEP_TIMEOUT_S, _make_venv, _pip_install, _run

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).parents[2] / "examples"


def test_digits_images_trains_in_a_federation_from_its_image_folder(tmp_path: Path) -> None:
    python = _make_venv(tmp_path / "venv")
    package = EXAMPLES / "digits_images"
    _pip_install(python, "-e", package)
    _run(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", package / "tests", cwd=tmp_path)

    images = tmp_path / "images"
    _run(python, "-m", "digits_images.make_folder", images)
    os.environ["DIGITS_IMAGES_DIR"] = str(images)
    try:
        out = _run(
            python, "-m", "fedsec", "simulate", "--task", "digits_images", "--agents", "3",
            "--rounds", "5", "--lr", "0.1", "--local-epochs", "2", "--batch-size", "32",
            "--clip", "20", "--no-baseline", "--json",
        )  # fmt: skip
    finally:
        del os.environ["DIGITS_IMAGES_DIR"]
    result = json.loads(out.strip().splitlines()[-1])
    keys = ("final_accuracy", "dim", "survivors_min")
    print(json.dumps({k: result.get(k) for k in keys}))
    assert (result["rounds"], result["aborted_rounds"]) == (5, 0)
    assert result["dim"] == 78042
    # The path works when the federation learns: chance is 0.1. Five rounds of three
    # members from a random init land far from converged and spread widely: 0.57 and
    # 0.60 on an idle machine, 0.38 in a whole-suite run beside another (same seeds;
    # the members' stochastic rounding draws from the OS). Centrally, 10 epochs: 0.96.
    assert result["final_accuracy"] > 0.2


# The package's own tests, its table written and a federation trained in one interpreter
# (torch and scikit-learn imported once); the aggregator in the same process, as
# `fedsec simulate` otherwise starts it in its own.
_TESTS_TABLE_AND_FEDERATION = """
import asyncio, json, sys
from pathlib import Path
import pytest
if pytest.main(["-q", "-p", "no:cacheprovider", sys.argv[3]]) != 0:
    sys.exit("the package's own tests failed")
from diabetes_postgres.load_table import load_table
from fedsec.simulation import SimulationSpec, run_simulation
print(json.dumps(load_table(sys.argv[1])))
spec = SimulationSpec(task="diabetes_postgres", agents=3, rounds=3, aggregator_process=False)
print(json.dumps(asyncio.run(run_simulation(spec, workdir=Path(sys.argv[2])))))
"""


def test_diabetes_postgres_trains_in_a_federation_from_its_table(tmp_path: Path) -> None:
    """The regression example: its table written into a real PostgreSQL server, read
    through fedsec's SQL source by every member of a real federation (SecAgg+ over
    loopback HTTP), R² reported under its name."""
    python = _make_venv(tmp_path / "venv")
    package = EXAMPLES / "diabetes_postgres"
    _pip_install(python, "-e", package)
    with postgres_server() as server:
        url = server.url()
        done = subprocess.run(
            [python, "-c", _TESTS_TABLE_AND_FEDERATION, url, tmp_path / "federation",
             package / "tests"],
            capture_output=True, text=True, env={**os.environ, "DIABETES_PG_URL": url},
            timeout=STEP_TIMEOUT_S, check=False, cwd=tmp_path,
        )  # fmt: skip
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert PASSWORD not in done.stdout + done.stderr
    counts, result = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    print(json.dumps({k: result.get(k) for k in ("final_r2", "centralized_r2", "dim")}))
    assert counts == {"train": 354, "test": 88}
    assert (result["rounds"], result["aborted_rounds"]) == (3, 0)
    assert (result["primary_metric"], result["dim"]) == ("r2", 10 * 32 + 32 + 32 + 1)
    # the federation learns: R² above 0 (predicting the mean); centrally about 0.5
    assert 0.0 < result["final_r2"] <= 1.0 and 0.0 < result["centralized_r2"] <= 1.0
