"""The fedsec.task API: entry-point discovery, the task contract and its refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset as TorchDataset

from fedsec.errors import ConfigError, DpIncompatibleModel, InvalidTask, TaskMismatch, UnknownTask
from fedsec.task import (
    DataSource,
    Metric,
    Task,
    TaskData,
    TaskSchema,
    TrainingParams,
    installed_tasks,
    load_task,
)
from fedsec.tasks import TASKS, get_task
from tests.task.conftest import InstallDist

TOY = """
import torch
from torch.utils.data import TensorDataset
from fedsec.task import Task, TaskData, TaskSchema, TrainingParams

def _data(source):
    x = torch.zeros(4, 3)
    y = torch.tensor([0, 1, 0, 1])
    return TaskData(train=TensorDataset(x, y), test=TensorDataset(x, y))

task = Task(
    name="toy", version="1", schema=TaskSchema(input_shape=(3,), num_classes=2),
    defaults=TrainingParams(lr=0.1, batch_size=2, local_epochs=1),
    model=lambda: torch.nn.Linear(3, 2), data=_data,
)

def factory(width: int, scale: float = 1.0):
    import dataclasses
    return dataclasses.replace(task, name="wide")

def not_a_task():
    return "task"
"""


def _task(**overrides: object) -> Task:
    fields: dict[str, object] = {
        "name": "toy",
        "version": "1",
        "schema": TaskSchema(input_shape=(3,), num_classes=2),
        "defaults": TrainingParams(lr=0.1, batch_size=2, local_epochs=1),
        "model": lambda: torch.nn.Linear(3, 2),
        "data": lambda source: TaskData(train=_Rows(5), test=_Rows(3)),
    }
    fields.update(overrides)
    return Task(**fields)  # type: ignore[arg-type]


class _Rows(TorchDataset[tuple[torch.Tensor, torch.Tensor]]):
    """A map-style dataset computing each record when asked (as one read from disk)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((3,), float(i)), torch.tensor(i % 2)


# ---- discovery ---------------------------------------------------------------------------


def test_bundled_tasks_are_found_through_fedsecs_own_entry_points() -> None:
    found = installed_tasks()
    for name in TASKS:
        (entry,) = found[name]
        assert entry.distribution_name == "fedsec"
        assert entry.value.startswith("fedsec.tasks.")
    assert get_task("digits").name == "digits"


def test_a_task_package_on_the_path_is_found_by_entry_point(install_dist: InstallDist) -> None:
    install_dist(
        "toy-task", "2.0", {"toy": "toy_pkg:task", "wide": "toy_pkg:factory"}, {"toy_pkg": TOY}
    )
    (entry,) = installed_tasks()["toy"]
    assert (entry.distribution_name, entry.version) == ("toy-task", "2.0")
    task = load_task("toy")
    assert task.name == "toy" and task.load().x_train.shape == (4, 3)
    assert get_task("wide", width=3).name == "wide"  # the old lookup goes through entry points


def test_unknown_entry_point_is_refused_naming_the_installed_tasks() -> None:
    with pytest.raises(UnknownTask, match=r"unknown task 'xray'.*'digits'") as info:
        load_task("xray")
    assert info.value.code == "unknown_task"
    assert isinstance(info.value, ConfigError)  # what get_task's callers catch


def test_a_name_declared_by_two_packages_is_refused(install_dist: InstallDist) -> None:
    install_dist("toy-task", "1.0", {"toy": "toy_pkg:task"}, {"toy_pkg": TOY})
    install_dist("evil-task", "9.9", {"toy": "toy_pkg:task"}, {})
    with pytest.raises(UnknownTask, match=r"more than one package: .*evil-task 9.9.*toy-task"):
        load_task("toy")


def test_entry_point_refusals_name_the_problem(install_dist: InstallDist) -> None:
    install_dist(
        "toy-task",
        "1.0",
        {
            "missing": "toy_pkg:nothing_here",
            "gone": "no_such_module:task",
            "text": "toy_pkg:not_a_task",
            "wide": "toy_pkg:factory",
            "toy": "toy_pkg:task",
            "alias": "toy_pkg:task",
        },
        {"toy_pkg": TOY},
    )
    with pytest.raises(InvalidTask, match="entry point 'alias' gives a task named 'toy'"):
        load_task("alias")
    with pytest.raises(InvalidTask, match="cannot be imported"):
        load_task("missing")
    with pytest.raises(InvalidTask, match="cannot be imported"):
        load_task("gone")
    with pytest.raises(InvalidTask, match=r"returned str, expected a fedsec.task.Task"):
        load_task("text")
    with pytest.raises(ConfigError, match=r"requires option\(s\) \['width'\]"):
        load_task("wide")
    with pytest.raises(ConfigError, match=r"no option\(s\) \['depth'\]"):
        load_task("wide", width=1, depth=2)
    assert load_task("toy", path="/data").options == {"path": "/data"}  # for its data


# ---- the contract -----------------------------------------------------------------------


def test_lazy_torch_datasets_are_read_item_by_item_into_arrays() -> None:
    data = _task().load()
    assert data.x_train.dtype == np.float32 and data.y_train.dtype == np.int64
    np.testing.assert_array_equal(data.x_train[:, 0], [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(data.y_test, [0, 1, 0])


def test_data_function_receives_the_members_source() -> None:
    seen: list[DataSource] = []

    def data(source: DataSource) -> TaskData:
        seen.append(source)
        return TaskData(train=_Rows(2), test=_Rows(2))

    _task(data=data, options={"path": "/srv/records"}).load(seed=7)
    assert seen[0].seed == 7 and seen[0].options == {"path": "/srv/records"}


def test_a_loss_that_is_not_a_scalar_is_refused_and_changes_nothing() -> None:
    task = _task(loss=lambda out, y: torch.nn.functional.cross_entropy(out, y, reduction="none"))
    model = task.build_model(0)
    before = [p.detach().clone() for p in model.parameters()]
    batch = (torch.ones(4, 3), torch.tensor([0, 1, 0, 1]))
    with pytest.raises(InvalidTask, match=r"shape \(4,\), expected a scalar .*\.mean\(\)") as info:
        task.batch_loss(model, batch)
    assert info.value.code == "invalid_task"
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, q) and p.grad is None


def test_batch_step_replaces_forward_and_loss() -> None:
    task = _task(batch_step=lambda model, batch: model(batch["x"]).pow(2).mean())
    loss = task.batch_loss(task.build_model(0), {"x": torch.ones(2, 3)})
    assert loss.dim() == 0
    bad = _task(batch_step=lambda model, batch: "0.5")
    with pytest.raises(InvalidTask, match="returned str"):
        bad.batch_loss(bad.build_model(0), {})


def test_metrics_are_sums_so_any_batching_gives_one_mean() -> None:
    task = _task()
    out = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    y = torch.tensor([0, 1, 1, 1])
    whole = task.metric_totals(out, y)
    halves = [task.metric_totals(out[i : i + 2], y[i : i + 2]) for i in (0, 2)]
    assert whole["accuracy"] == 2 == sum(h["accuracy"] for h in halves)
    assert whole["cross_entropy"] == pytest.approx(sum(h["cross_entropy"] for h in halves))
    assert task.primary_metric == "accuracy" and task.higher_is_better


def test_metric_and_primary_refusals() -> None:
    with pytest.raises(InvalidTask, match="primary metric 'auc' is not one of"):
        _task(primary_metric="auc")
    mean_error = Metric(total=lambda out, y: (out.argmax(1) != y).float(), higher_is_better=False)
    task = _task(metrics={"error": mean_error}, primary_metric="error")
    assert not task.higher_is_better
    with pytest.raises(InvalidTask, match="metric 'error' returned shape"):
        task.metric_totals(torch.zeros(2, 2), torch.tensor([0, 1]))


def test_model_factory_must_build_a_module_and_data_must_fit_the_schema() -> None:
    with pytest.raises(InvalidTask, match=r"returned str, expected a torch.nn.Module"):
        _task(model=lambda: "net").build_model(0)
    wrong = _task(schema=TaskSchema(input_shape=(4,), num_classes=2))
    with pytest.raises(TaskMismatch, match="expected"):
        wrong.load()


def test_dp_fix_replaces_batchnorm_with_groupnorm() -> None:
    def net() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))

    assert isinstance(_task(model=net).build_model(0)[1], torch.nn.BatchNorm1d)
    assert isinstance(_task(model=net, dp_fix=True).build_model(0)[1], torch.nn.GroupNorm)


def test_the_round_runtime_runs_any_loss_and_primary_metric(install_dist: InstallDist) -> None:
    source = TOY + (
        "import dataclasses\n"
        "from fedsec.task import Metric\n"
        "own_loss = dataclasses.replace(task, name='own_loss', loss=lambda o, y: o.mean())\n"
        "err = Metric(total=lambda o, y: (o.argmax(1) != y).sum(), higher_is_better=False)\n"
        "own_metric = dataclasses.replace(\n"
        "    task, name='own_metric', metrics={'error': err}, primary_metric='error')\n"
    )
    install_dist(
        "toy-task",
        "1.0",
        {"own_loss": "toy_pkg:own_loss", "own_metric": "toy_pkg:own_metric"},
        {"toy_pkg": source},
    )
    assert get_task("own_loss").own_loss  # rounds train with the task's own loss
    # dashboards and alerts follow the task's own primary metric in its direction
    own = get_task("own_metric")
    assert own.primary_metric == "error" and not own.higher_is_better


def test_the_runtime_refuses_a_model_opacus_cannot_train(install_dist: InstallDist) -> None:
    source = TOY + (
        "import dataclasses\n"
        "def _bn():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4),\n"
        "                               torch.nn.Linear(4, 2))\n"
        "bn = dataclasses.replace(task, name='bn', model=_bn)\n"
        "bn_fixed = dataclasses.replace(task, name='bn_fixed', model=_bn, dp_fix=True)\n"
    )
    install_dist(
        "toy-task", "1.0", {"bn": "toy_pkg:bn", "bn_fixed": "toy_pkg:bn_fixed"}, {"toy_pkg": source}
    )
    with pytest.raises(DpIncompatibleModel, match=r"layer '1' \(BatchNorm1d\): replace it with"):
        get_task("bn")
    fixed = get_task("bn_fixed").build_model(0)
    assert isinstance(fixed[1], torch.nn.GroupNorm)
