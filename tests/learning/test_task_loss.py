"""Training, DP-SGD, distributed DP and evaluation minimise and report the task's own
loss (or its batch step); a loss that is not a 0-d batch mean is refused before the
model changes."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from fedsec.errors import InvalidTask
from fedsec.learning.distributed import clipped_gradient_sum
from fedsec.learning.training import DPParams, train_local
from fedsec.task import Task
from fedsec.tasks import evaluate, get_task
from fedsec.tasks.params import flatten_params

BASE = get_task("breast_cancer")
DATA = BASE.load(0)
X, Y = DATA.x_train[:200], DATA.y_train[:200]
DP = DPParams(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5)


def _double_ce(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return 2.0 * F.cross_entropy(output, targets)


def _double_ce_step(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return 2.0 * F.cross_entropy(model(x), y)


def _trained(task: Task, lr: float, dp: DPParams | None = None) -> np.ndarray:
    model = BASE.build_model(0)
    params = dataclasses.replace(BASE.defaults, lr=lr, momentum=0.0, optimizer="sgd")
    train_local(model, X, Y, params, dp, "cpu", seed=5, task=task)
    return flatten_params(model)


@pytest.mark.parametrize(
    "own",
    [
        dataclasses.replace(BASE, loss=_double_ce),
        dataclasses.replace(BASE, batch_step=_double_ce_step),
    ],
    ids=["loss", "batch_step"],
)
def test_training_minimises_the_tasks_own_loss(own: Task) -> None:
    # Twice the cross-entropy at lr is cross-entropy at 2 lr, exactly (powers of two
    # scale floats without rounding): the task's loss, not cross-entropy, was minimised.
    assert own.own_loss
    doubled = _trained(own, lr=0.05)
    assert np.array_equal(doubled, _trained(BASE, lr=0.1))
    assert not np.array_equal(doubled, _trained(BASE, lr=0.05))


def test_dp_sgd_trains_a_tasks_own_loss_through_opacus() -> None:
    own = dataclasses.replace(BASE, loss=_double_ce)
    model = BASE.build_model(0)
    before = flatten_params(model)
    result = train_local(model, X, Y, BASE.defaults, DP, "cpu", seed=5, task=own)
    after = flatten_params(model)
    assert result.epsilon_round is not None and np.isfinite(result.train_loss)
    assert np.all(np.isfinite(after)) and not np.array_equal(before, after)
    assert not hasattr(model, "_module")  # the caller's model gained no Opacus wrapper


@pytest.mark.parametrize(
    ("loss", "refusal"),
    [
        (lambda o, y: F.cross_entropy(o, y, reduction="none"), "expected a scalar"),
        (lambda o, y: F.cross_entropy(o, y, reduction="sum"), "is not the batch mean"),
        (lambda o, y: (o.argmax(1) == y).sum(), "expected floating point"),
    ],
    ids=["per_record", "sum", "integer"],
)
@pytest.mark.parametrize("dp", [None, DP], ids=["plain", "dp"])
def test_a_loss_that_is_not_the_batch_mean_is_refused_before_training(
    loss: Any, refusal: str, dp: DPParams | None
) -> None:
    model = BASE.build_model(0)
    before = flatten_params(model)
    rng = torch.get_rng_state()
    with pytest.raises(InvalidTask, match=refusal):
        train_local(
            model, X, Y, BASE.defaults, dp, "cpu", seed=5, task=dataclasses.replace(BASE, loss=loss)
        )
    assert np.array_equal(flatten_params(model), before)
    assert torch.equal(torch.get_rng_state(), rng)


def test_evaluation_reports_the_tasks_loss() -> None:
    model = BASE.build_model(0)
    acc, ce = evaluate(model, DATA.x_test, DATA.y_test, task=BASE)
    assert (acc, ce) == evaluate(model, DATA.x_test, DATA.y_test)  # the default: unchanged
    own_acc, own = evaluate(
        model, DATA.x_test, DATA.y_test, task=dataclasses.replace(BASE, loss=_double_ce)
    )
    assert own_acc == acc and own == pytest.approx(2 * ce, rel=1e-5)
    step = dataclasses.replace(BASE, batch_step=_double_ce_step)
    assert evaluate(model, DATA.x_test, DATA.y_test, task=step)[1] == pytest.approx(
        2 * ce, rel=1e-5
    )


def test_distributed_dp_clips_per_record_gradients_of_the_tasks_loss() -> None:
    model = BASE.build_model(0)
    include = np.zeros(len(Y), dtype=bool)
    include[:40] = True
    default, n = clipped_gradient_sum(model, X, Y, include, 1e6)
    mean_ce = dataclasses.replace(BASE, loss=lambda o, y: F.cross_entropy(o, y))
    own, m = clipped_gradient_sum(model, X, Y, include, 1e6, task=mean_ce)
    assert n == m == 40
    np.testing.assert_allclose(own, default, rtol=1e-5, atol=1e-7)  # per record, unscaled
    doubled, _ = clipped_gradient_sum(
        model, X, Y, include, 1e6, task=dataclasses.replace(BASE, loss=_double_ce)
    )
    np.testing.assert_allclose(doubled, 2 * default, rtol=1e-5, atol=1e-7)
