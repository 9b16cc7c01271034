"""This member's task and its share of the training data, as ``agent.toml`` names them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fedsec.config import DataSection
from fedsec.errors import ConfigError
from fedsec.tasks import Task, get_task, parse_partition


@dataclass(frozen=True)
class LocalData:
    """This member's task and its share of the training data."""

    task: Task
    x: npt.NDArray[np.float32]
    y: npt.NDArray[np.int64]

    @property
    def samples(self) -> int:
        return len(self.y)


def load_local_data(data: DataSection) -> LocalData:
    """Build the task and this member's part of its training data.

    Raises:
        ConfigError: unknown task, bad options or partition, unreadable CSV.
    """
    options = dict(data.task_options)
    if data.csv:
        if data.task != "csv":
            raise ConfigError(
                f'data.csv is set but data.task is {data.task!r}; set data.task = "csv"'
            )
        options["path"] = data.csv
    task = get_task(data.task, **options)
    dataset = task.load()
    x, y = dataset.x_train, dataset.y_train
    if data.parts > 1:
        parts = parse_partition(data.partition).apply(y, data.parts, data.seed)
        index = parts[data.part_index]
        x, y = x[index], y[index]
    return LocalData(task=task, x=x, y=y)
