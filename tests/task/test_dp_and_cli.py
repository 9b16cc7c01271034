"""DP compatibility by Opacus's validator, and the ``fedsec task`` commands."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from fedsec.errors import DpIncompatibleModel
from fedsec.task.cli import task as task_cli
from fedsec.task.dp import check_dp_compatible, dp_problems
from fedsec.tasks import get_task


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3),
        torch.nn.BatchNorm2d(4),
        torch.nn.Flatten(),
        torch.nn.LSTM(4, 4),
    )


def test_refusal_names_each_offending_layer_and_its_fix() -> None:
    model = _net()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(DpIncompatibleModel) as info:
        check_dp_compatible("xray", model)
    detail = info.value.detail
    assert "layer '1' (BatchNorm2d): replace it with GroupNorm" in detail
    assert "layer '3' (LSTM): use opacus.layers.DPLSTM" in detail
    assert info.value.code == "dp_incompatible_model"
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_bundled_models_pass_and_fixed_models_pass() -> None:
    for name in ("breast_cancer", "digits", "mnist1d"):
        assert dp_problems(get_task(name).build_model(0)) == []
    from opacus.validators import ModuleValidator

    fixed = ModuleValidator.fix(torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.BatchNorm1d(4)))
    assert dp_problems(fixed) == []


def test_inspect_prints_name_version_digest_params_and_dp() -> None:
    runner = CliRunner()
    out = runner.invoke(task_cli, ["inspect", "digits", "--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    assert report["name"] == "digits" and report["distribution"] == "fedsec"
    assert report["params"] == sum(
        p.numel() for p in get_task("digits").build_model(0).parameters()
    )
    assert len(report["digest"]) == 64 and report["dp_compatible"] is True
    text = runner.invoke(task_cli, ["inspect", "digits"])
    assert "digest:" in text.output and "DP-SGD:         compatible" in text.output


def test_inspect_takes_task_options() -> None:
    out = CliRunner().invoke(
        task_cli,
        ["inspect", "table", "--json", "--option", 'features=["a","b"]', "--option",
         'classes=["x","y","z"]'],
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    assert report["input_shape"] == [2] and report["num_classes"] == 3


def _inplace_net() -> torch.nn.Module:
    """torchvision's pattern: a norm layer's output activated in place."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, bias=False),
        torch.nn.GroupNorm(2, 4),
        torch.nn.ReLU(inplace=True),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 4 * 4, 2),
    )


def _one_dp_step(model: torch.nn.Module) -> None:
    from fedsec.learning.training import DPParams, train_dataset
    from fedsec.tasks import TrainingParams

    data = torch.utils.data.TensorDataset(torch.randn(8, 1, 6, 6), torch.randint(0, 2, (8,)))
    params = TrainingParams(lr=0.1, batch_size=4, local_epochs=1)
    train_dataset(model, data, params, DPParams(1.0, 1.0, 1e-5), "cpu", seed=0)


def test_an_in_place_activation_is_refused_before_it_breaks_the_first_dp_step() -> None:
    # Opacus's validator passes it, and its per-sample hooks then fail at the first
    # step ("a view ... is being modified inplace"): the check must say so first.
    with pytest.raises(RuntimeError, match="inplace"):
        _one_dp_step(_inplace_net())
    model = _inplace_net()
    with pytest.raises(DpIncompatibleModel) as info:
        check_dp_compatible("xray", model)
    assert "layer '2' (ReLU): set inplace=False" in info.value.detail
    assert model[2].inplace  # the check changes nothing


def test_the_dp_fix_option_turns_in_place_activations_off() -> None:
    from fedsec.task import Task, TaskData, TaskSchema, TrainingParams

    task = Task(
        name="xray",
        version="1",
        schema=TaskSchema(input_shape=(1, 6, 6), num_classes=2),
        defaults=TrainingParams(lr=0.1, batch_size=4, local_epochs=1),
        model=_inplace_net,
        data=lambda _source: TaskData(train=[], test=[]),
        dp_fix=True,
    )
    model = task.build_model(0)
    assert dp_problems(model) == []
    _one_dp_step(model)
