"""``fedsec bench robust``: the attacks are what the docstring says, the rule matrix
runs the real rule code and reports what it claims, and the quarantine run judges with
the real control-sample code (tiny sizes; no timings, no accuracy thresholds)."""

from __future__ import annotations

import dataclasses
import json
from statistics import NormalDist

import numpy as np
import pytest
from click.testing import CliRunner

from fedsec.bench import robust as R
from fedsec.cli import main
from fedsec.errors import ConfigError


@pytest.fixture(scope="module")
def fed() -> R.Federation:
    small = R.make_federation("mnist1d", 10, 0.2, "iid", 1, 0)
    return dataclasses.replace(small, clip=1.0)


def _honest(fed: R.Federation) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(5)
    return {i: rng.normal(0.0, 0.01, 64) for i in range(fed.n)}


def test_two_of_ten_attack_and_the_partition_covers_everyone(fed: R.Federation) -> None:
    assert len(fed.bad) == 2 and fed.bad <= set(range(10))
    assert sum(len(y) for _, y in fed.parts) == 4000


@pytest.mark.parametrize(
    ("attack", "factor"), [("none", 1.0), ("signflip", -4.0), ("scale", 10.0), ("zero", 0.0)]
)
def test_scaling_attacks_send_a_multiple_of_their_honest_update(
    fed: R.Federation, attack: str, factor: float
) -> None:
    honest = _honest(fed)
    sent = R.attack_updates(fed, attack, np.zeros(64), honest, 1)
    assert sorted(sent) == sorted(fed.bad)
    for i, v in sent.items():
        np.testing.assert_allclose(v, np.clip(factor * honest[i], -1.0, 1.0))


def test_alie_sends_mean_minus_z_std_of_the_honest_updates(fed: R.Federation) -> None:
    honest = _honest(fed)
    good = np.stack([honest[i] for i in range(fed.n) if i not in fed.bad])
    # n = 10, f = 2: s = 10 // 2 + 1 - 2 = 4, z = Φ⁻¹((10 - 4) / 10)
    z = NormalDist().inv_cdf(0.6)
    for v in R.attack_updates(fed, "alie", np.zeros(64), honest, 1).values():
        np.testing.assert_allclose(v, good.mean(axis=0) - z * good.std(axis=0))


def test_gaussian_noise_is_ten_times_the_honest_norm_and_within_the_ring(
    fed: R.Federation,
) -> None:
    honest = {i: v * 1000 for i, v in _honest(fed).items()}  # coordinates beyond C = 1
    good = np.stack([honest[i] for i in range(fed.n) if i not in fed.bad])
    for v in R.attack_updates(fed, "gaussian", np.zeros(64), honest, 1).values():
        assert np.all(np.abs(v) <= 1.0)  # each coordinate within what the ring expresses
    small = _honest(fed)
    mean_norm = np.mean(
        np.linalg.norm(np.stack([small[i] for i in range(fed.n) if i not in fed.bad]), axis=1)
    )
    for v in R.attack_updates(fed, "gaussian", np.zeros(64), small, 1).values():
        assert np.linalg.norm(v) == pytest.approx(10 * mean_norm, rel=0.35)
    assert good.shape[0] == 8


def test_rules_are_sized_to_the_attackers(fed: R.Federation) -> None:
    assert R.rule_spec("multi_krum", fed).byzantine == 2  # f = the attackers
    assert R.rule_spec("dnc", fed).byzantine == 3  # 1.5 times them, with an honest majority
    many = dataclasses.replace(fed, bad=set(range(4)))
    assert R.rule_spec("dnc", many).byzantine == 4  # (n - 1) // 2 at most


def test_an_unknown_attack_or_rule_is_refused_by_name(fed: R.Federation) -> None:
    with pytest.raises(ConfigError, match="unknown attack 'poison'"):
        R.attack_updates(fed, "poison", np.zeros(64), _honest(fed), 1)
    result = CliRunner().invoke(main, ["bench", "robust", "--rules", "krum", "--rounds", "1"])
    assert result.exit_code != 0 and "--rules: unknown ['krum']" in result.output


def test_the_rule_matrix_reports_one_line_per_rule_and_attack() -> None:
    args = ["bench", "robust", "--agents", "6", "--bad", "0.2", "--rounds", "1", "--json"]
    result = CliRunner().invoke(
        main, [*args, "--attacks", "none,scale", "--rules", "fedavg,multi_krum"]
    )
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.output.strip().splitlines()]
    # attack by attack, every rule under each
    assert [(r["rule"].split()[0], r["attack"]) for r in lines] == [
        ("fedavg", "none"), ("multi_krum", "none"), ("fedavg", "scale"), ("multi_krum", "scale"),
    ]  # fmt: skip
    for r in lines:
        assert r["bad"] == 1 and r["agents"] == 6 and 0 <= r["accuracy"] <= 1
        assert r["clean_fedavg_accuracy"] == lines[0]["accuracy"]
        assert r["local_epochs"] == 2
    # FedAvg takes the attacker's whole share; Multi-Krum (f = 1) leaves the scaled one out
    assert lines[2]["attacker_weight_share"] == pytest.approx(1 / 6, abs=1e-3)
    assert lines[3]["attacker_weight_share"] == 0.0
    assert "byzantine=1" in lines[3]["rule"]


def test_audit_quarantine_catches_a_free_rider_with_the_control_checks() -> None:
    # without DP here to keep the test cheap (the bench's runs use DP, which the checks
    # are calibrated for): a zero update fails them either way
    whole = R.make_federation("mnist1d", 6, 0.2, "iid", 1, 0)
    # 40 records a member: one cheap reference a round, the same checks
    fed = dataclasses.replace(whole, parts=[(x[:40], y[:40]) for x, y in whole.parts])
    g0 = R._initial(fed)
    fed = R.calibrate_clip(fed, g0)
    (attacker,) = fed.bad
    result = R.run_quarantine(fed, g0, "zero", 1.0)
    # challenged in round 1, failed, quarantined; the model rolls back to before round 1
    assert result.quarantined_at[attacker] == 1
    assert result.challenged_rounds == {attacker: 1}
    assert result.rollback_to_round == 1 and result.accuracy_before_rollback is not None
    # an honest member quarantined is named with the round and the tests it failed
    assert result.false_quarantine_tests.keys() == set(result.quarantined_at) - fed.bad
    assert all(why.startswith("round ") for why in result.false_quarantine_tests.values())
    # the rolled-back round is trained again, without the attacker: the final model has
    # as many applied rounds as the clean run's
    assert result.rounds_run == 2


def test_secure_sum_secagg_measures_audit_quarantine_only() -> None:
    args = ["bench", "robust", "--agents", "6", "--rounds", "1", "--secure-sum", "secagg"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0
    assert "--secure-sum secagg measures --defence audit-quarantine" in result.output


def test_cells_run_in_the_order_given_and_unknown_ones_are_refused() -> None:
    args = ["bench", "robust", "--agents", "6", "--rounds", "1", "--local-epochs", "1"]
    result = CliRunner().invoke(main, [*args, "--cells", "median:zero,fedavg:none", "--json"])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.output.strip().splitlines()]
    assert [(r["rule"].split()[0], r["attack"]) for r in lines] == [
        ("median", "zero"), ("fedavg", "none"),
    ]  # fmt: skip
    assert lines[0]["local_epochs"] == 1
    assert lines[1]["accuracy"] == lines[1]["clean_fedavg_accuracy"]
    refused = CliRunner().invoke(main, [*args, "--cells", "median:poison"])
    assert (
        refused.exit_code != 0 and "--cells: 'median:poison' is not RULE:ATTACK" in refused.output
    )


def test_the_budget_spent_counts_the_rounds_trained_after_a_rollback() -> None:
    fed = R.make_federation("mnist1d", 6, 0.2, "iid", 3, 0, dp_epsilon=8.0)
    # the noise is calibrated so that the run's rounds spend the budget, no more
    spent = R._epsilon_spent(fed, 3)
    assert spent is not None and spent == pytest.approx(8.0, rel=0.01)
    longer = R._epsilon_spent(fed, 5)
    assert longer is not None and longer > spent * 1.1
    assert R._epsilon_spent(R.make_federation("mnist1d", 6, 0.2, "iid", 3, 0), 3) is None
