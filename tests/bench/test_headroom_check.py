"""``bench/headroom_check.py``: the in-process screen runs with the real codec and
reports the settings it ran (tiny sizes; no accuracy thresholds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "headroom_check.py"
TINY = ["--agents", "4", "--rounds", "2", "--bits", "2", "--range-stddevs", "1"]


def _run(*args: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *TINY, *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    row: dict[str, Any] = json.loads(done.stdout)
    return row


def test_a_screen_reports_what_it_ran_and_dropping_no_edges_changes_nothing() -> None:
    plain = _run("--headroom", "4", "--keep", "0.332")
    dropped = _run("--headroom", "4", "--keep", "0.332", "--drop-edges", "--server-momentum", "0")
    # four members never reach the outer eighth of a 6-bit ring: nothing is dropped
    assert plain["peak_centred_levels"] < 28 and plain["wrap_rate"] == 0.0
    assert dropped["drop_edges"] is True and plain["drop_edges"] is False
    assert dropped["final_accuracy"] == plain["final_accuracy"]
    assert plain["ring_bits"] == 6 and plain["payload_bytes_per_agent_round"] == 1299
    assert plain["local_epochs"] == 2 and plain["server_lr"] == 1.0  # the task's settings


def test_momentum_moves_the_model_by_an_average_of_the_mean_updates() -> None:
    plain = _run("--headroom", "4", "--keep", "0.332", "--local-epochs", "1")
    damped = _run(
        "--headroom", "4", "--keep", "0.332", "--local-epochs", "1", "--server-momentum", "0.5"
    )
    assert damped["server_momentum"] == 0.5 and damped["local_epochs"] == 1
    # round 1 moves both alike; round 2 moves the damped run by half its mean update
    # plus half of round 1's, so the final models differ
    assert damped["final_accuracy"] != plain["final_accuracy"]
