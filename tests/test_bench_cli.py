"""The benchmark entry points run and report what they claim (tiny sizes; no timings)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from fedsec.cli import main


@pytest.mark.parametrize("stage", ["advertise", "share", "masked", "unmask"])
def test_bench_secagg_reports_an_exact_round(stage: str) -> None:
    result = CliRunner().invoke(
        main,
        [
            "bench",
            "secagg",
            "--clients",
            "12",
            "--dim",
            "300",
            "--dropout",
            "0.2",
            "--dropout-stage",
            stage,
            "--neighbors",
            "6",
            "--threshold",
            "4",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    record = json.loads(result.output.strip().splitlines()[-1])
    assert record["exact"] is True
    assert record["dropout_stage"] == stage and record["clients"] == 12
    assert record["max_abs_err"] <= record["quant_step"]
    assert record["bytes_per_param"] == pytest.approx(
        (record["dim"] + 1) * record["ring_bits"] / 8 / record["dim"], abs=1 / record["dim"]
    )
    for key in ("client_s", "server_s", "floor_s", "share_bytes_per_client", "peak_rss_mb"):
        assert record[key] >= 0


def test_simulate_uses_the_requested_local_settings() -> None:
    """A tiny real federation over loopback: the options reach the members' training."""
    result = CliRunner().invoke(
        main,
        [
            "simulate",
            "--task",
            "breast_cancer",
            "--agents",
            "3",
            "--rounds",
            "2",
            "--secure-sum",
            "none",
            "--batch-size",
            "8",
            "--local-epochs",
            "1",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    record = json.loads(result.output.strip().splitlines()[-1])
    assert (record["batch_size"], record["local_epochs"], record["rounds"]) == (8, 1, 2)
    assert record["aborted_rounds"] == 0
    assert 0.5 < record["final_accuracy"] <= 1.0
