"""``fedsec bench gossip``: every run reports what it claims (tiny sizes; no accuracy
thresholds)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from fedsec.cli import main


def test_bench_gossip_reports_each_run_and_refuses_the_sign_flipper() -> None:
    args = ["bench", "gossip", "--task", "breast_cancer", "--agents", "5", "--degree", "2"]
    args += ["--rounds", "1"]
    args += ["--local-epochs", "1", "--runs", "robust,plain", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    robust, plain = (json.loads(line) for line in result.output.splitlines())
    assert (robust["run"], robust["attackers"], robust["robust"]) == ("robust", 1, True)
    assert robust["refused_attacker_share"] == 1.0 and robust["refused_honest_share"] == 0.0
    assert plain["robust"] is False and plain["refused_attacker_share"] == 0.0
    assert 0.0 <= plain["accuracy"] <= 1.0 and plain["worst_peer"] <= plain["accuracy"]


def test_bench_gossip_churn_returning_peers_catch_up_over_http() -> None:
    args = ["bench", "gossip", "--task", "breast_cancer", "--agents", "5", "--degree", "2"]
    args += ["--rounds", "20", "--local-epochs", "1", "--exchanges", "3"]
    args += ["--runs", "churn", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    (churn,) = (json.loads(line) for line in result.output.splitlines())
    # one of the five peers (30 %, rounded down) left and came back through its neighbours' offers
    assert (churn["run"], churn["churn_share"], churn["returns"]) == ("churn", 0.3, 1)
