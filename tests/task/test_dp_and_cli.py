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
