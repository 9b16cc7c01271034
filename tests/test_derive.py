"""fedsec.derive.apply_mean steps the model in place a run at a time; every model
version the aggregator writes and the auditor re-derives depends on it being bit for bit
the whole-vector step it replaced, which is written out here as the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedsec import derive
from fedsec.derive import apply_mean
from fedsec.errors import PayloadError, RoundAborted, TaskMismatch
from fedsec.learning.optimizers import AdamMoments, FedAdam, FedAvg, ServerRule, server_step
from fedsec.tasks.params import (
    arrays_to_state,
    flatten_params,
    load_flat_params,
    param_count,
    state_to_arrays,
)


def _whole_vector(
    model: nn.Module,
    parent: dict[str, np.ndarray],
    weighted_sum: np.ndarray,
    weight_sum: float,
    rule: ServerRule,
    state: AdamMoments | None,
) -> AdamMoments | None:
    """The step as it was: the mean, the flat parameters and the step, each whole."""
    mean = (np.asarray(weighted_sum) / weight_sum).astype(np.float32)
    arrays_to_state(model, parent)
    new, state = server_step(rule, flatten_params(model), mean, state)
    load_flat_params(model, new)
    return state


class _Mixed(nn.Module):
    """Parameters of several shapes and dtypes, one frozen, one not contiguous."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3)
        self.wide = nn.Parameter(torch.randn(7, 11).t())  # a transposed view
        self.wide64 = nn.Parameter(torch.randn(13, dtype=torch.float64))
        self.narrow16 = nn.Parameter(torch.randn(9, dtype=torch.float16))
        self.frozen = nn.Parameter(torch.randn(4), requires_grad=False)
        self.head = nn.Linear(6, 3)
        self.register_buffer("counts", torch.arange(5))


def _case(seed: int, sum_dtype: type) -> tuple[nn.Module, dict[str, np.ndarray], np.ndarray]:
    torch.manual_seed(seed)
    model = _Mixed()
    rng = np.random.default_rng(seed)
    parent = state_to_arrays(_Mixed())  # another draw: loading it changes every parameter
    weighted_sum = (rng.standard_normal(param_count(model)) * 10).astype(sum_dtype)
    return model, parent, weighted_sum


RULES: list[ServerRule] = [FedAvg(1.0), FedAvg(0.37), FedAdam(0.01, 0.9, 0.99, 1e-3)]


@pytest.mark.parametrize("run", [1, 5, 64, 1 << 18])
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("sum_dtype", [np.float64, np.float32])
@pytest.mark.parametrize("weight_sum", [3.7, 7, np.float64(2.5), np.float32(1.3)])
def test_in_place_step_is_the_whole_vector_step(
    monkeypatch: pytest.MonkeyPatch, run: int, rule: ServerRule, sum_dtype: type, weight_sum: float
) -> None:
    monkeypatch.setattr(derive, "RUN", run)
    for seed, with_state in ((1, False), (2, True)):
        ours, parent, weighted_sum = _case(seed, sum_dtype)
        theirs, _, _ = _case(seed, sum_dtype)
        d = param_count(ours)
        rng = np.random.default_rng(seed + 100)
        state = None
        if with_state:
            m = rng.standard_normal(d).astype(np.float32)
            state = AdamMoments(m, np.abs(rng.standard_normal(d)).astype(np.float32))
        got = apply_mean(ours, parent, weighted_sum, weight_sum, rule, state)
        want = _whole_vector(theirs, parent, weighted_sum, weight_sum, rule, state)
        mine, reference = state_to_arrays(ours), state_to_arrays(theirs)
        for name in reference:
            assert mine[name].dtype == reference[name].dtype
            assert mine[name].tobytes() == reference[name].tobytes(), name
        if want is None:
            assert got is None
        else:
            assert got is not None
            assert got.m.tobytes() == want.m.tobytes()
            assert got.v.tobytes() == want.v.tobytes()


def test_the_resnet_sized_run_boundaries_match(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs that split parameters unevenly (a run of 1000 over layers of 10 to 9,000)."""
    monkeypatch.setattr(derive, "RUN", 1000)
    models = [nn.Sequential(nn.Linear(90, 100), nn.Linear(100, 10)) for _ in range(2)]
    parent = state_to_arrays(models[0])
    weighted_sum = np.random.default_rng(0).standard_normal(param_count(models[0]))
    apply_mean(models[0], parent, weighted_sum, 10.0, FedAvg(1.0))
    _whole_vector(models[1], parent, weighted_sum, 10.0, FedAvg(1.0), None)
    assert flatten_params(models[0]).tobytes() == flatten_params(models[1]).tobytes()


@pytest.mark.parametrize("rule", RULES)
def test_a_model_that_holds_its_parent_steps_as_one_given_the_parent(rule: ServerRule) -> None:
    # the aggregator reads the parent into the model's own tensors and passes None
    ours, parent, weighted_sum = _case(5, np.float64)
    theirs, _, _ = _case(5, np.float64)
    arrays_to_state(ours, parent)
    got = apply_mean(ours, None, weighted_sum, 3.0, rule)
    want = apply_mean(theirs, parent, weighted_sum, 3.0, rule)
    mine, reference = state_to_arrays(ours), state_to_arrays(theirs)
    assert all(mine[k].tobytes() == reference[k].tobytes() for k in reference)
    assert (got is None) == (want is None)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_a_non_finite_step_is_refused_and_leaves_the_parent() -> None:
    model, parent, weighted_sum = _case(3, np.float64)
    weighted_sum[-1] = 1e300  # inf as float32: the last run, after the others were stepped
    with pytest.raises(PayloadError, match="NaN or infinite"):
        apply_mean(model, parent, weighted_sum, 1.0, FedAvg(1.0))
    after = state_to_arrays(model)
    assert all(after[k].tobytes() == parent[k].tobytes() for k in parent)


def test_a_sum_of_the_wrong_length_is_refused_before_loading() -> None:
    model, parent, weighted_sum = _case(4, np.float64)
    before = state_to_arrays(model)
    with pytest.raises(TaskMismatch, match="the model has"):
        apply_mean(model, parent, weighted_sum[:-1], 1.0, FedAvg(1.0))
    with pytest.raises(ValueError, match="FedAdam moments"):
        apply_mean(model, parent, weighted_sum, 1.0, RULES[2], AdamMoments.zeros(3))
    with pytest.raises(RoundAborted):
        apply_mean(model, parent, weighted_sum, 0.0, FedAvg(1.0))
    after = state_to_arrays(model)
    assert all(after[k].tobytes() == before[k].tobytes() for k in before)
