"""The robust aggregation rules (fedsec.learning.robust): hand-computed results on small
inputs for every rule, their refusals and reasons, the parameter ranges, and properties
(permutation invariance, trimmed mean with β = 0 is the weighted mean, identical
updates aggregate to themselves)."""

from __future__ import annotations

import math
import typing

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsec.config import AggregationSection
from fedsec.errors import AggregationImpossible, ConfigError
from fedsec.learning import robust
from fedsec.protocol import wire

ONES = np.ones


def _rows(*rows: list[float]) -> np.ndarray:
    return np.array(rows, dtype=np.float64)


def _spec(**fields: object) -> wire.AggregationSpec:
    return wire.AggregationSpec(**fields)  # type: ignore[arg-type]


# -- hand-computed results -----------------------------------------------------------------------


def test_fedavg_is_the_weighted_mean() -> None:
    result = robust.fedavg(_rows([1, 0], [3, 2]), np.array([1.0, 3.0]))
    np.testing.assert_array_equal(result.update, [2.5, 1.5])  # ([1,0] + 3·[3,2]) / 4
    assert [o.weight for o in result.outcomes] == [0.25, 0.75]
    assert all(o.accepted and not o.reason for o in result.outcomes)


def test_trimmed_mean_cuts_each_end_of_every_coordinate_then_weighs_the_rest() -> None:
    x = _rows([1, 5], [2, -1], [3, 0], [100, 0])
    w = np.array([1.0, 1.0, 2.0, 1.0])
    result = robust.trimmed_mean(x, w, 0.25)  # ⌊0.25·4⌋ = 1 cut at each end
    # coordinate 0 keeps 2 (w 1) and 3 (w 2): (2 + 6) / 3; coordinate 1 keeps the two 0s
    np.testing.assert_allclose(result.update, [8 / 3, 0.0], rtol=0, atol=1e-15)
    # share of the coordinates each member was kept in
    assert [o.score for o in result.outcomes] == [0.0, 0.5, 1.0, 0.5]
    assert [o.weight for o in result.outcomes] == [0.2, 0.2, 0.4, 0.2]


def test_trimmed_mean_with_beta_zero_keeps_everything() -> None:
    x = _rows([1, 5], [2, -1], [3, 0], [100, 0])
    result = robust.trimmed_mean(x, ONES(4), 0.0)
    np.testing.assert_allclose(result.update, [26.5, 1.0])
    assert [o.score for o in result.outcomes] == [1.0] * 4


def test_median_is_coordinatewise_and_ignores_weights() -> None:
    odd = robust.median(_rows([1, 10], [2, -5], [9, 0]), np.array([5.0, 1.0, 1.0]))
    np.testing.assert_array_equal(odd.update, [2.0, 0.0])
    even = robust.median(_rows([1], [2], [3], [100]), ONES(4))
    np.testing.assert_array_equal(even.update, [2.5])
    assert [o.weight for o in even.outcomes] == [0.25] * 4


POINTS = _rows([0], [1], [2], [3], [50])  # Krum scores with f = 1 (2 nearest): 5 2 2 5 4513


def test_multi_krum_keeps_the_lowest_scores_and_refuses_the_rest_with_the_reason() -> None:
    result = robust.multi_krum(POINTS, ONES(5), byzantine=1)  # m = 0: n − f = 4
    np.testing.assert_array_equal(result.update, [1.5])
    assert [o.score for o in result.outcomes] == [5.0, 2.0, 2.0, 5.0, 2209.0 + 2304.0]
    assert result.accepted == [0, 1, 2, 3]
    refused = result.outcomes[4]
    assert not refused.accepted and refused.weight == 0.0
    assert "score 4513" in refused.reason and "not among the 4 lowest" in refused.reason


def test_multi_krum_averages_the_selected_by_weight() -> None:
    result = robust.multi_krum(POINTS, np.array([1.0, 1.0, 3.0, 1.0, 1.0]), 1, krum_selected=2)
    np.testing.assert_array_equal(result.update, [1.75])  # (1·1 + 3·2) / 4
    assert result.accepted == [1, 2]
    assert [o.weight for o in result.outcomes] == [0.0, 0.25, 0.75, 0.0, 0.0]


def test_multi_krum_needs_more_than_2f_plus_2_updates() -> None:
    with pytest.raises(AggregationImpossible, match="at least 5 updates"):
        robust.multi_krum(POINTS[:4], ONES(4), byzantine=1)
    with pytest.raises(AggregationImpossible, match="at most n - f = 4"):
        robust.multi_krum(POINTS, ONES(5), byzantine=1, krum_selected=5)


def test_centered_clipping_pulls_at_most_tau_per_update_and_iteration() -> None:
    x, w = _rows([3, 4], [0, 0]), ONES(2)
    one = robust.centered_clipping(x, w, clip_radius=1.0, clip_iterations=1)
    # from 0: [3, 4] (norm 5) is clipped to [0.6, 0.8]; the zero update not at all
    np.testing.assert_allclose(one.update, [0.3, 0.4], rtol=0, atol=1e-15)
    two = robust.centered_clipping(x, w, clip_radius=1.0, clip_iterations=2)
    # from [0.3, 0.4]: [2.7, 3.6] (norm 4.5) clipped to [0.6, 0.8]; [-0.3, -0.4] kept
    np.testing.assert_allclose(two.update, [0.45, 0.6], rtol=0, atol=1e-15)
    assert [o.score for o in two.outcomes] == pytest.approx([1 / 4.5, 1.0])
    assert all(o.accepted for o in two.outcomes)


def test_centered_clipping_with_a_wide_radius_is_the_weighted_mean() -> None:
    x, w = _rows([1, 0], [3, 2]), np.array([1.0, 3.0])
    result = robust.centered_clipping(x, w, clip_radius=100.0, clip_iterations=3)
    np.testing.assert_allclose(result.update, [2.5, 1.5], rtol=0, atol=1e-15)


# four updates spread along y, one far out along x: the centred rows' top principal
# direction is x (variance 12.8 against 2.5), where the mean 0.8 puts the four at -0.8
DNC_POINTS = _rows([0, 1], [0, -1], [0, 0.5], [0, -0.5], [4, 0])


def test_dnc_refuses_the_farthest_along_the_top_principal_direction() -> None:
    result = robust.dnc(DNC_POINTS, np.array([1.0, 1.0, 1.0, 3.0, 1.0]), byzantine=1)
    np.testing.assert_allclose(result.update, [0.0, -1 / 6], rtol=0, atol=1e-15)
    assert result.accepted == [0, 1, 2, 3]
    assert [o.score for o in result.outcomes] == pytest.approx([0.64] * 4 + [10.24])
    assert [o.weight for o in result.outcomes] == pytest.approx([1 / 6, 1 / 6, 1 / 6, 0.5, 0])
    assert result.outcomes[4].reason == (
        "dnc (byzantine=1): its update lies 3.2 from the mean along the updates' top "
        "principal direction, among the 1 farthest of 5 (the kept lie at most 0.8 from it)"
    )


def test_dnc_finds_attackers_hidden_inside_every_coordinate_s_spread() -> None:
    # ALIE (Baruch et al. 2019): every attacker sends μ − zσ, inside the honest spread of
    # each coordinate, so no coordinate-wise or distance rule sees it; its shared
    # direction is what the top principal direction finds
    rng = np.random.default_rng(0)
    honest = rng.normal(0.1, 1.0, size=(40, 500))
    alie = np.repeat((honest.mean(axis=0) - 0.47 * honest.std(axis=0))[None], 10, axis=0)
    result = robust.dnc(np.vstack([honest, alie]), ONES(50), byzantine=10)
    assert result.accepted == list(range(40))
    assert robust.multi_krum(np.vstack([honest, alie]), ONES(50), 10).accepted[-10:] == list(
        range(40, 50)
    )  # Multi-Krum keeps every attacker: central vectors score best


def test_dnc_needs_an_honest_majority() -> None:
    honest_majority = r"needs more than 2f = 4 updates \(.*\), got 4$"
    with pytest.raises(AggregationImpossible, match=honest_majority):
        robust.dnc(DNC_POINTS[:4], ONES(4), byzantine=2)


REFERENCE = np.array([2.0, 0.0])


def test_fltrust_normalises_to_the_reference_norm_and_weighs_by_relu_cosine() -> None:
    x = _rows([1, 0], [1, 1], [-1, 0], [0, 0])
    result = robust.fltrust(x, ONES(4), REFERENCE)
    # trust 1 and 1/√2; rescaled to norm 2: [2, 0] and [√2, √2]
    trust = 1 / math.sqrt(2)
    expected = (np.array([2.0, 0.0]) + trust * np.array([math.sqrt(2), math.sqrt(2)])) / (1 + trust)
    np.testing.assert_allclose(result.update, expected, rtol=0, atol=1e-15)
    assert [o.score for o in result.outcomes] == pytest.approx([1.0, trust, 0.0, 0.0])
    assert [o.weight for o in result.outcomes] == pytest.approx(
        [1 / (1 + trust), trust / (1 + trust), 0.0, 0.0]
    )
    assert result.accepted == [0, 1]
    assert "does not point the reference's way (cosine -1.0000)" in result.outcomes[2].reason
    assert "a zero update has no direction" in result.outcomes[3].reason


def test_fltrust_refuses_updates_below_the_minimum_trust_score() -> None:
    result = robust.fltrust(_rows([1, 0], [1, 1]), ONES(2), REFERENCE, min_trust_score=0.8)
    np.testing.assert_allclose(result.update, [2.0, 0.0])
    assert result.accepted == [0]
    assert "trust score 0.7071 (cosine with the reference) is below the minimum 0.8" in (
        result.outcomes[1].reason
    )


def test_fltrust_is_blind_to_an_update_s_scale() -> None:
    x = _rows([1, 0], [1, 1])
    scaled = x * np.array([[10.0], [0.01]])
    np.testing.assert_allclose(
        robust.fltrust(scaled, ONES(2), REFERENCE).update,
        robust.fltrust(x, ONES(2), REFERENCE).update,
        rtol=1e-12,
    )


def test_fltrust_without_any_trusted_update_is_a_clear_error() -> None:
    with pytest.raises(AggregationImpossible, match=r"no update is trusted.*every one of the 2"):
        robust.fltrust(_rows([-1, 0], [0, 3]), ONES(2), REFERENCE)
    with pytest.raises(AggregationImpossible, match=r"reference update .* is zero"):
        robust.fltrust(_rows([1, 0]), ONES(1), np.zeros(2))


def test_the_norm_threshold_refuses_against_the_median_norm() -> None:
    x = _rows([1, 0], [0, 1], [2, 0], [0, 10])  # norms 1 1 2 10, median 1.5
    refused = robust.norm_outliers(x, 3.0)
    assert list(refused) == [3]
    assert "norm 10 is over 3 times the median update norm 1.5 (at most 4.5)" in refused[3]
    assert robust.norm_outliers(x, 0.0) == {}  # off


# -- the whole rule, from the codec's rows --------------------------------------------------------


def test_aggregate_divides_out_the_weights_and_refuses_zero_weights() -> None:
    weighted = _rows([0.5, 0.0], [1.0, 2.0], [0.3, 0.3])  # w·Δ
    weights = np.array([0.5, 1.0, 0.0])
    result = robust.aggregate(_spec(rule="median"), weighted, weights)
    np.testing.assert_array_equal(result.update, [1.0, 1.0])  # median of [1, 0] and [1, 2]
    assert result.accepted == [0, 1]
    assert "its weight is 0" in result.outcomes[2].reason


def test_aggregate_applies_the_norm_threshold_before_the_rule() -> None:
    weighted = _rows([1, 0], [0, 1], [1, 1], [30, 40])
    spec = _spec(rule="fedavg", max_norm_ratio=2.0)
    result = robust.aggregate(spec, weighted, ONES(4))
    np.testing.assert_allclose(result.update, [2 / 3, 2 / 3])
    assert result.accepted == [0, 1, 2]
    assert "norm 50 is over 2 times the median" in result.outcomes[3].reason
    weighted_sum, weight = robust.as_weighted_sum(result, ONES(4))
    assert weight == 3.0
    np.testing.assert_allclose(weighted_sum, [2.0, 2.0])


def test_aggregate_with_nothing_left_is_a_clear_error() -> None:
    with pytest.raises(AggregationImpossible, match="no update is left"):
        robust.aggregate(_spec(rule="median"), _rows([1, 0]), np.array([0.0]))


def test_describe_names_the_parameters_the_rule_reads() -> None:
    spec = _spec(rule="multi_krum", byzantine=2)
    assert robust.describe(spec) == (
        "multi_krum (byzantine=2, krum_selected=0, max_norm_ratio=0.0)"
    )
    assert (
        robust.describe(_spec(rule="fltrust"))
        == "fltrust (min_trust_score=0.0, max_norm_ratio=0.0)"
    )


# -- parameters ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "good", "bad"),
    [
        ("trim_fraction", [0.0, 0.49], [-0.1, 0.5, math.nan]),
        ("byzantine", [0, 3], [-1, 1.5]),
        ("krum_selected", [0, 7], [-2]),
        ("clip_radius", [1e-6, 10.0], [0.0, -1.0, math.inf]),
        ("clip_iterations", [1, 100], [0, 101]),
        ("root_records", [1, 100], [0]),
        ("min_trust_score", [0.0, 1.0], [-0.01, 1.01]),
        ("max_norm_ratio", [0.0, 1.0, 5.0], [0.5, -1.0]),
    ],
)
def test_each_parameter_has_one_declared_range(
    name: str, good: list[float], bad: list[float]
) -> None:
    for value in good:
        robust.check_parameter(name, value)
    for value in bad:
        with pytest.raises(ConfigError, match=f"^{name}: expected .*, got .* \\(.+\\)$"):
            robust.check_parameter(name, value)


def test_a_rule_refuses_a_parameter_outside_its_range() -> None:
    with pytest.raises(ConfigError, match=r"trim_fraction: expected a number in \[0, 0.5\)"):
        robust.trimmed_mean(_rows([1]), ONES(1), 0.5)


def test_rules_parameters_config_and_spec_are_one_list() -> None:
    assert set(robust.RULE_PARAMETERS) == set(typing.get_args(wire.AggregationRule))
    read = {n for names in robust.RULE_PARAMETERS.values() for n in names}
    assert read | set(robust.EVERY_RULE) == set(robust.PARAMETERS)
    spec_fields = {f.name: f.default for f in msgspec.structs.fields(wire.AggregationSpec)}
    config_fields = {f.name: f.default for f in msgspec.structs.fields(AggregationSection)}
    assert spec_fields == config_fields
    assert set(spec_fields) == {"rule", *robust.PARAMETERS}


# -- properties ---------------------------------------------------------------------------------


def _random_case(seed: int, n: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)), rng.uniform(0.1, 1.0, size=n)


RULES: dict[str, typing.Callable[[np.ndarray, np.ndarray], robust.RobustAggregate]] = {
    "fedavg": robust.fedavg,
    "trimmed_mean": lambda x, w: robust.trimmed_mean(x, w, 0.2),
    "median": robust.median,
    "multi_krum": lambda x, w: robust.multi_krum(x, w, 1, 2),
    "centered_clipping": lambda x, w: robust.centered_clipping(x, w, 0.5, 3),
    "dnc": lambda x, w: robust.dnc(x, w, 2),
    "fltrust": lambda x, w: robust.fltrust(x, w, x.mean(axis=0) + 0.5),
}

cases = st.tuples(st.integers(0, 2**32 - 1), st.integers(5, 9), st.integers(1, 6))


@settings(max_examples=60, deadline=None)
@given(case=cases, rule=st.sampled_from(sorted(RULES)), data=st.data())
def test_every_rule_is_blind_to_the_members_order(
    case: tuple[int, int, int], rule: str, data: st.DataObject
) -> None:
    x, w = _random_case(*case)
    order = np.array(data.draw(st.permutations(range(len(w)))))
    try:
        straight = RULES[rule](x, w)
    except AggregationImpossible:  # fltrust with no trusted update: the same either way
        with pytest.raises(AggregationImpossible):
            RULES[rule](x[order], w[order])
        return
    shuffled = RULES[rule](x[order], w[order])
    np.testing.assert_allclose(shuffled.update, straight.update, rtol=1e-10, atol=1e-12)
    assert [shuffled.outcomes[i].accepted for i in np.argsort(order)] == [
        o.accepted for o in straight.outcomes
    ]


@settings(max_examples=60, deadline=None)
@given(case=cases, rule=st.sampled_from(sorted(RULES)))
def test_accepted_shares_sum_to_one_and_refusals_say_why(
    case: tuple[int, int, int], rule: str
) -> None:
    x, w = _random_case(*case)
    try:
        result = RULES[rule](x, w)
    except AggregationImpossible:
        return
    assert len(result.outcomes) == len(w)
    assert sum(o.weight for o in result.outcomes if o.accepted) == pytest.approx(1.0)
    assert all(o.reason and o.weight == 0 for o in result.outcomes if not o.accepted)


@settings(max_examples=60, deadline=None)
@given(case=cases)
def test_trimmed_mean_with_beta_zero_is_the_weighted_mean(case: tuple[int, int, int]) -> None:
    x, w = _random_case(*case)
    np.testing.assert_allclose(
        robust.trimmed_mean(x, w, 0.0).update, robust.fedavg(x, w).update, rtol=1e-12, atol=1e-12
    )


@settings(max_examples=60, deadline=None)
@given(case=cases)
def test_identical_updates_aggregate_to_that_update(case: tuple[int, int, int]) -> None:
    x, w = _random_case(*case)
    same = np.repeat(x[:1], len(w), axis=0)
    np.testing.assert_array_equal(robust.median(same, w).update, x[0])
    for rule in ("fedavg", "trimmed_mean", "multi_krum", "dnc"):
        np.testing.assert_allclose(RULES[rule](same, w).update, x[0], rtol=1e-12)
    # fltrust against that same direction: every update trusted fully, norm the reference's
    fl = robust.fltrust(same, w, 2 * x[0])
    np.testing.assert_allclose(fl.update, 2 * x[0], rtol=1e-12)
