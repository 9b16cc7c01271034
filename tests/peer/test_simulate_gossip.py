"""``fedsec simulate --topology gossip``: real peers on loopback, from the command line."""

from __future__ import annotations

import json

from click.testing import CliRunner

from fedsec.cli import main


def test_simulate_gossip_trains_a_small_task_with_no_aggregator() -> None:
    args = ["simulate", "--topology", "gossip", "--task", "breast_cancer", "--agents", "4"]
    args += ["--rounds", "1", "--local-epochs", "1", "--degree", "2", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["topology"] == "gossip" and summary["agents"] == 4
    assert summary["accuracy_min"] > 0.8  # a linear model of breast_cancer, trained
    assert summary["refused_models"] == 0


def test_simulate_gossip_refuses_a_degree_the_roster_cannot_have() -> None:
    args = ["simulate", "--topology", "gossip", "--task", "breast_cancer", "--agents", "4"]
    result = CliRunner().invoke(main, [*args, "--degree", "4"])
    assert result.exit_code != 0 and "neighbours must be in 2..3" in result.output
