"""``fedsec task new NAME``: a task package that installs, is found and passes its test.

The package uses the src layout and setuptools, declares its task in the
``fedsec.tasks`` entry-point group and ships a test that finds the task through that
entry point (so it passes only once the package is installed, as a member installs it).
"""

from __future__ import annotations

import keyword
import re
from pathlib import Path

from fedsec.errors import ConfigError

#: A name that is a distribution name, an import name and an entry-point name at once.
_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")

_PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{name}"
version = "0.1.0"
description = "A fedsec task: {name}"
requires-python = ">=3.11"
dependencies = ["fedsec", "torch>=2.2"]

# fedsec finds the task here; every party pins this distribution's version and digest.
[project.entry-points."fedsec.tasks"]
{name} = "{name}.task:task"

[tool.setuptools.packages.find]
where = ["src"]
"""

_TASK = '''\
"""The {name} task: the model, the data and the training defaults every party shares.

Replace the synthetic records below with your own: ``data`` receives the member's
configured source (``source.options`` holds the member's task options, such as a file
path) and returns torch datasets that read records lazily.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from fedsec.task import DataSource, Task, TaskData, TaskSchema, TrainingParams

N_FEATURES = 8
CLASSES = ("negative", "positive")


class Records(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Records read one at a time (here from arrays; from files in a real task)."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(self.x[i]), torch.tensor(self.y[i])


def data(source: DataSource) -> TaskData:
    """Synthetic, linearly separable records; ``source.seed`` picks the split."""
    rng = np.random.default_rng(1234)
    x = rng.normal(size=(400, N_FEATURES)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    order = np.random.default_rng(source.seed).permutation(len(y))
    train, test = order[:320], order[320:]
    return TaskData(train=Records(x[train], y[train]), test=Records(x[test], y[test]))


def model() -> torch.nn.Module:
    """Any torch.nn.Module; GroupNorm, not BatchNorm, if it is to train under DP-SGD."""
    return torch.nn.Sequential(
        torch.nn.Linear(N_FEATURES, 16), torch.nn.ReLU(), torch.nn.Linear(16, len(CLASSES))
    )


task = Task(
    name="{name}",
    version="1",
    schema=TaskSchema(input_shape=(N_FEATURES,), num_classes=len(CLASSES), class_names=CLASSES),
    defaults=TrainingParams(lr=0.1, batch_size=32, local_epochs=1),
    model=model,
    data=data,
)
'''

_TEST = '''\
"""The {name} task is installed, found by its entry point and keeps the task contract."""

from __future__ import annotations

import torch

from fedsec.task import load_task
from fedsec.task.digest import task_pin
from fedsec.task.dp import check_dp_compatible


def test_task_is_found_by_entry_point_and_trains() -> None:
    task = load_task("{name}")
    data = task.load()
    model = task.build_model(0)
    check_dp_compatible(task.name, model)
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    optimizer = torch.optim.SGD(model.parameters(), lr=task.defaults.lr)
    first = float(task.batch_loss(model, (x, y)))
    for _ in range(50):
        optimizer.zero_grad()
        task.batch_loss(model, (x, y)).backward()
        optimizer.step()
    assert float(task.batch_loss(model, (x, y))) < first
    with torch.no_grad():
        totals = task.metric_totals(model(x), y)
    assert totals[task.primary_metric] / len(y) > 0.8


def test_task_is_pinned_by_its_installed_files() -> None:
    pin = task_pin("{name}")
    assert (pin.distribution, pin.version) == ("{name}", "0.1.0")
    assert len(pin.digest) == 64
'''

_README = """\
# {name}

A fedsec task package. Install it where each party runs fedsec (the same wheel for
everyone: the federation pins its version and the digest of its files):

    pip install .
    fedsec task inspect {name}
    python -m pytest tests
"""


def write_skeleton(name: str, parent: Path) -> list[Path]:
    """Write the package ``parent/name``: pyproject, task module, test and README.

    Args:
        name: the task, distribution and import name (lowercase letters, digits, ``_``).
        parent: the directory to create the package in.

    Returns:
        the files written.

    Raises:
        ConfigError: ``name`` is not a valid name, or ``parent/name`` already exists.
    """
    if not _NAME.fullmatch(name) or keyword.iskeyword(name):
        raise ConfigError(
            f"task name {name!r} must be lowercase letters, digits and '_', starting with a "
            "letter (it is the distribution, import and entry-point name)"
        )
    root = parent / name
    if root.exists():
        raise ConfigError(f"{root} already exists; choose another name or directory")
    files = {
        root / "pyproject.toml": _PYPROJECT,
        root / "README.md": _README,
        root / "src" / name / "__init__.py": f'"""The {name} fedsec task."""\n',
        root / "src" / name / "task.py": _TASK,
        root / "tests" / f"test_{name}.py": _TEST,
    }
    for path, template in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(template.replace("{name}", name), encoding="utf-8")
    return list(files)
