"""Opacus's check at ``aggregator init``, recorded so that serving imports no Opacus,
and run again (in a child process) when the task or its options changed since."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import opacus  # noqa: F401  (imported before install_dist's snapshot: torch registers
import pytest  # Opacus' operators once per process, so the teardown must not unload it)

from fedsec.aggregator.workspace import DP_VERDICT_FILE, Workspace, init_workspace
from fedsec.errors import DpIncompatibleModel, InvalidTask
from fedsec.task import dp_verdict
from fedsec.task.digest import loaded_task_pin
from fedsec.tasks import get_task

from .conftest import InstallDist

PLAIN = """
import torch
from torch.utils.data import TensorDataset
from fedsec.task import Task, TaskData, TaskSchema, TrainingParams

def _data(source):
    x = torch.zeros(4, 3)
    y = torch.tensor([0, 1, 0, 1])
    return TaskData(train=TensorDataset(x, y), test=TensorDataset(x, y))

def _model():
    return MODEL

task = Task(
    name="xray", version="1", schema=TaskSchema(input_shape=(3,), num_classes=2),
    defaults=TrainingParams(lr=0.1, batch_size=2, local_epochs=1),
    model=_model, data=_data,
)
"""
LINEAR = "torch.nn.Linear(3, 2)"
BATCHNORM = (
    "torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))"
)


def _install(install_dist: InstallDist, model: str) -> Path:
    site = install_dist("xray-task", "1.0", {"xray": "xray_pkg:task"}, {"xray_pkg": ""})
    _rewrite(site, model)
    return site


def _rewrite(site: Path, model: str) -> None:
    """The package's code as an upgrade installs it; a process started afterwards
    imports it and pins its new files."""
    (site / "xray_pkg" / "__init__.py").write_text(PLAIN.replace("MODEL", model))
    sys.modules.pop("xray_pkg", None)
    importlib.invalidate_caches()
    loaded_task_pin.cache_clear()


def _never(*args: object) -> None:
    raise AssertionError("the check ran again")


def test_init_records_the_verdict_and_serving_does_not_check_again(
    install_dist: InstallDist, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _install(install_dist, LINEAR)
    ws = init_workspace(tmp_path / "ws", "fed", "xray")
    record = (tmp_path / "ws" / DP_VERDICT_FILE).read_bytes()
    assert b'"entry_point":"xray"' in record and b'"opacus":' in record
    monkeypatch.setattr(dp_verdict, "check_in_child", _never)
    monkeypatch.setattr("fedsec.task.dp.check_dp_compatible", _never)
    assert ws.served_task().name == "xray"
    ws.close()


def test_a_task_upgraded_to_an_incompatible_model_is_refused_at_serve(
    install_dist: InstallDist, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = _install(install_dist, LINEAR)
    init_workspace(tmp_path / "ws", "fed", "xray").close()
    record = (tmp_path / "ws" / DP_VERDICT_FILE).read_bytes()
    _rewrite(site, BATCHNORM)  # the digest changes: the record no longer applies
    refusal = r"layer '1' \(BatchNorm1d\): replace it with"
    # a serving aggregator has no Opacus loaded: a child process imports the new code
    with pytest.raises(DpIncompatibleModel, match=refusal):
        dp_verdict.check_in_child("xray", "{}")
    ws = Workspace.open(tmp_path / "ws")
    # this test's process has Opacus loaded, so it checks in process; same refusal
    monkeypatch.setattr(dp_verdict, "check_in_child", _never)
    with pytest.raises(DpIncompatibleModel, match=refusal):
        ws.served_task()
    assert (tmp_path / "ws" / DP_VERDICT_FILE).read_bytes() == record  # nothing recorded
    ws.close()


def test_serving_without_opacus_loaded_checks_in_a_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = init_workspace(tmp_path / "ws", "fed", "breast_cancer")
    path = tmp_path / "ws" / DP_VERDICT_FILE
    record = path.read_bytes()
    path.unlink()
    monkeypatch.delitem(sys.modules, "opacus")  # as in a serving aggregator
    monkeypatch.setattr("fedsec.task.dp.check_dp_compatible", _never)
    checked: list[str] = []
    monkeypatch.setattr(dp_verdict, "check_in_child", lambda name, _: checked.append(name))
    ws.served_task()
    assert checked == ["breast_cancer"] and path.read_bytes() == record
    ws.close()


def test_a_compatible_upgrade_is_checked_once_and_recorded(
    install_dist: InstallDist, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = _install(install_dist, LINEAR)
    init_workspace(tmp_path / "ws", "fed", "xray").close()
    before = (tmp_path / "ws" / DP_VERDICT_FILE).read_bytes()
    _rewrite(site, "torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))")
    ws = Workspace.open(tmp_path / "ws")
    ws.served_task()  # checked (here, in process: Opacus is loaded) and recorded
    after = (tmp_path / "ws" / DP_VERDICT_FILE).read_bytes()
    assert after != before and loaded_task_pin("xray").digest in after.decode()
    monkeypatch.setattr(dp_verdict, "check_in_child", _never)
    ws.served_task()  # recorded: not checked again
    ws.close()


def test_a_missing_or_damaged_record_is_checked_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = init_workspace(tmp_path / "ws", "fed", "breast_cancer")
    path = tmp_path / "ws" / DP_VERDICT_FILE
    record = path.read_bytes()
    checked: list[str] = []
    monkeypatch.setattr("fedsec.task.dp.check_dp_compatible", lambda name, _: checked.append(name))
    for damaged in (None, b"{", record.replace(b'"opacus":"', b'"opacus":"0.')):
        if damaged is None:
            path.unlink()
        else:
            path.write_bytes(damaged)
        ws.served_task()
        assert path.read_bytes() == record
    assert checked == ["breast_cancer"] * 3
    ws.close()


def test_a_child_that_fails_otherwise_is_an_invalid_task(
    install_dist: InstallDist, tmp_path: Path
) -> None:
    site = _install(install_dist, LINEAR)
    init_workspace(tmp_path / "ws", "fed", "xray").close()
    record = (tmp_path / "ws" / DP_VERDICT_FILE).read_bytes()
    _rewrite(site, "torch.nn.Linear(3, 2)\nraise SystemExit(5)")  # its import exits
    ws = Workspace.open(tmp_path / "ws")
    with pytest.raises(InvalidTask, match="failed"):
        dp_verdict.check_in_child("xray", "{}")
    assert (tmp_path / "ws" / DP_VERDICT_FILE).read_bytes() == record
    ws.close()


def test_init_still_refuses_an_incompatible_model_before_writing(
    install_dist: InstallDist, tmp_path: Path
) -> None:
    _install(install_dist, BATCHNORM)
    with pytest.raises(DpIncompatibleModel, match=r"BatchNorm1d"):
        init_workspace(tmp_path / "ws", "fed", "xray")
    assert not (tmp_path / "ws").exists()
    with pytest.raises(DpIncompatibleModel):
        get_task("xray")
