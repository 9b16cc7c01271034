"""Local training with and without DP-SGD, the centralized baseline, and device choice."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from opacus.accountants import RDPAccountant

from fedsec.agent.device import resolve_device
from fedsec.errors import ConfigError
from fedsec.learning.dp_noise import secure_gaussian as _secure_gaussian
from fedsec.learning.training import (
    DPParams,
    TrainingParams,
    plan_round,
    train_centralized,
    train_local,
)
from fedsec.tasks import evaluate, get_task
from fedsec.tasks.params import flatten_params

DP = DPParams(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5)


@pytest.mark.parametrize("name", ["breast_cancer", "digits", "mnist1d"])
def test_short_plain_training_reduces_loss(name: str) -> None:
    task = get_task(name)
    data = task.load()
    model = task.build_model(0)
    _, loss_before = evaluate(model, data.x_train, data.y_train, "cpu")
    params = replace(task.defaults, local_epochs=2)
    result = train_local(model, data.x_train, data.y_train, params, None, "cpu", seed=0)
    _, loss_after = evaluate(model, data.x_train, data.y_train, "cpu")
    assert loss_after < 0.8 * loss_before
    assert result.epsilon_round is None
    assert result.samples == len(data.y_train)
    assert (result.sample_rate, result.steps) == plan_round(len(data.y_train), params)
    assert math.isfinite(result.train_loss) and result.duration_s > 0


def test_dp_training_reports_finite_epsilon_and_leaves_no_opacus_traces() -> None:
    task = get_task("breast_cancer")
    data = task.load()
    model = task.build_model(0)
    before = flatten_params(model)
    result = train_local(model, data.x_train, data.y_train, task.defaults, DP, "cpu", seed=1)
    assert result.epsilon_round is not None
    assert 0 < result.epsilon_round < math.inf
    assert (result.sample_rate, result.steps) == plan_round(len(data.y_train), task.defaults)
    assert not np.array_equal(flatten_params(model), before)
    # The caller's object is still the plain model: no wrapper, hooks or per-sample grads.
    assert type(model).__name__ == "TabularMLP"
    for module in model.modules():
        assert not module._forward_hooks and not module._backward_hooks
        assert not module._forward_pre_hooks
    for p in model.parameters():
        assert not hasattr(p, "grad_sample") and p.grad is None


def test_dp_epsilon_matches_rdp_accounting_of_the_round() -> None:
    task = get_task("breast_cancer")
    data = task.load()
    result = train_local(
        task.build_model(0), data.x_train, data.y_train, task.defaults, DP, "cpu", seed=2
    )
    accountant = RDPAccountant()
    accountant.history = [(DP.noise_multiplier, result.sample_rate, result.steps)]
    assert result.epsilon_round == pytest.approx(accountant.get_epsilon(DP.delta))


@pytest.mark.parametrize("dp", [None, DP])
def test_training_is_deterministic_for_a_seed(dp: DPParams | None) -> None:
    task = get_task("digits")
    data = task.load()
    x, y = data.x_train[:300], data.y_train[:300]
    runs = []
    for seed in (5, 5, 6):
        model = task.build_model(0)
        train_local(model, x, y, task.defaults, dp, "cpu", seed=seed)
        runs.append(flatten_params(model))
    np.testing.assert_array_equal(runs[0], runs[1])
    assert not np.array_equal(runs[0], runs[2])


def test_training_leaves_global_rng_untouched() -> None:
    task = get_task("breast_cancer")
    data = task.load()
    torch.manual_seed(42)
    expected = torch.rand(3)
    torch.manual_seed(42)
    train_local(task.build_model(0), data.x_train, data.y_train, task.defaults, DP, "cpu", 0)
    np.testing.assert_array_equal(torch.rand(3).numpy(), expected.numpy())


def test_dp_training_survives_empty_poisson_batches() -> None:
    task = get_task("breast_cancer")
    data = task.load()
    model = task.build_model(0)
    # Three records at sample rate 1/3: about 30% of the 30 steps sample nobody.
    params = TrainingParams(lr=0.05, batch_size=1, local_epochs=10)
    result = train_local(model, data.x_train[:3], data.y_train[:3], params, DP, "cpu", seed=3)
    assert result.steps == 30
    assert np.all(np.isfinite(flatten_params(model)))


def test_dp_noise_never_comes_from_torch_generators(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's generator is a Mersenne Twister keyed by 64 bits: predictable from its output
    task = get_task("breast_cancer")
    data = task.load()
    model = task.build_model(0)

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("DP noise drawn from a torch generator")

    for name in ("normal", "randn", "randn_like", "normal_"):
        monkeypatch.setattr(torch, name, refused, raising=False)
    monkeypatch.setattr(torch.Tensor, "normal_", refused)
    before = flatten_params(model)
    train_local(model, data.x_train, data.y_train, task.defaults, DP, "cpu", seed=4)
    assert not np.array_equal(flatten_params(model), before)


def test_dp_noise_has_the_configured_standard_deviation() -> None:
    # Zero features give zero weight gradients, so one SGD step at lr 1 moves each
    # weight by the noise alone: N(0, (sigma * C)^2) / B
    dp = DPParams(noise_multiplier=1.5, max_grad_norm=2.0, delta=1e-5)
    batch = 8
    model = torch.nn.Linear(1000, 4)
    before = model.weight.detach().clone()
    x = np.zeros((batch, 1000), dtype=np.float32)
    y = np.arange(batch, dtype=np.int64) % 4
    params = TrainingParams(lr=1.0, batch_size=batch, local_epochs=1)
    result = train_local(model, x, y, params, dp, "cpu", seed=7)
    assert result.steps == 1
    moved = (model.weight.detach() - before).numpy().ravel() * batch
    assert abs(moved.mean()) < 4 * 3.0 / math.sqrt(moved.size)
    assert moved.std() == pytest.approx(dp.noise_multiplier * dp.max_grad_norm, rel=0.06)


def test_secure_gaussian_is_normal_and_one_stream_per_domain() -> None:
    seed = bytes(range(32))
    like = torch.zeros(200_000, dtype=torch.float64)
    a = _secure_gaussian(seed, b"a", 3.0, like).numpy()
    assert abs(a.mean()) < 4 * 3.0 / math.sqrt(a.size)
    assert a.std() == pytest.approx(3.0, rel=0.01)
    kurtosis = float(np.mean((a / a.std()) ** 4))
    assert kurtosis == pytest.approx(3.0, abs=0.05)
    np.testing.assert_array_equal(_secure_gaussian(seed, b"a", 3.0, like).numpy(), a)
    b = _secure_gaussian(seed, b"b", 3.0, like).numpy()
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.02
    as_float32 = _secure_gaussian(seed, b"a", 3.0, like.to(torch.float32))
    assert as_float32.dtype == torch.float32 and as_float32.shape == like.shape


def test_batchnorm_model_is_refused_under_dp() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    x = np.zeros((8, 4), dtype=np.float32)
    y = np.zeros(8, dtype=np.int64)
    params = TrainingParams(lr=0.1, batch_size=4, local_epochs=1)
    with pytest.raises(ConfigError, match="cannot be trained with DP-SGD"):
        train_local(model, x, y, params, DP, "cpu", seed=0)


def test_invalid_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="noise_multiplier"):
        DPParams(noise_multiplier=0.0, max_grad_norm=1.0, delta=1e-5)
    with pytest.raises(ConfigError, match="delta"):
        DPParams(noise_multiplier=1.0, max_grad_norm=1.0, delta=1.0)
    with pytest.raises(ConfigError, match="optimizer"):
        TrainingParams(lr=0.1, batch_size=4, local_epochs=1, optimizer="rmsprop")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="batch_size"):
        TrainingParams(lr=0.1, batch_size=0, local_epochs=1)
    task = get_task("breast_cancer")
    empty_x = np.zeros((0, 30), dtype=np.float32)
    with pytest.raises(ConfigError, match="non-empty"):
        train_local(
            task.build_model(0), empty_x, np.zeros(0, np.int64), task.defaults, None, "cpu", 0
        )


def test_plan_round_mirrors_opacus_rounding() -> None:
    params = TrainingParams(lr=0.1, batch_size=10, local_epochs=2)
    assert plan_round(455, params) == (1 / 46, 92)
    # 1 / (1 / 93) is just below 93 in floating point; Opacus then takes 92 steps.
    assert plan_round(930, params)[1] == 2 * int(1 / (1 / 93))


def test_centralized_baseline_learns_breast_cancer() -> None:
    task = get_task("breast_cancer")
    accuracy, loss = train_centralized(task, task.load(), epochs=5, device="cpu", seed=0)
    assert accuracy > 0.9 and loss < 0.3


# ---- device ------------------------------------------------------------------------


def test_resolve_device_cpu_and_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device(" AUTO ") == torch.device("cuda")


def test_resolve_device_refuses_missing_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for spec in ("cuda", "cuda:1"):
        with pytest.raises(ConfigError, match="CUDA is not available"):
            resolve_device(spec)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match="has 2 CUDA device"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("spec", ["gpu", "cuda:x", "", "mps"])
def test_resolve_device_refuses_unknown_specs(spec: str) -> None:
    with pytest.raises(ConfigError, match="not understood"):
        resolve_device(spec)
