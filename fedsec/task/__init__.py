"""The public task API: bring your own model and data.

A task is an installable Python package that declares :class:`Task` objects (or
factories of them) in the ``fedsec.tasks`` entry-point group. fedsec finds them with
:func:`load_task`, pins the installed distribution by :func:`task_pin` (entry point,
version and a digest of its files) and never ships code between parties. See
``docs/tasks.md``.
"""

from fedsec.task.defaults import Optimizer, TrainingParams
from fedsec.task.definition import Dataset, DataSource, Task, TaskData, tensor_data
from fedsec.task.discovery import (
    ENTRY_POINT_GROUP,
    TaskEntry,
    find_task,
    installed_tasks,
    load_task,
    task_names,
)
from fedsec.task.metrics import (
    CLASSIFICATION_METRICS,
    MULTILABEL_METRICS,
    BatchStep,
    Loss,
    Metric,
    MetricSums,
    binary_cross_entropy,
    cross_entropy,
    mean_squared_error,
    regression_metrics,
)
from fedsec.task.schema import TARGETS, Target, TaskSchema, check_schema

__all__ = [
    "CLASSIFICATION_METRICS",
    "ENTRY_POINT_GROUP",
    "MULTILABEL_METRICS",
    "TARGETS",
    "BatchStep",
    "DataSource",
    "Dataset",
    "Loss",
    "Metric",
    "MetricSums",
    "Optimizer",
    "Target",
    "Task",
    "TaskData",
    "TaskEntry",
    "TaskSchema",
    "TrainingParams",
    "binary_cross_entropy",
    "check_schema",
    "cross_entropy",
    "find_task",
    "installed_tasks",
    "load_task",
    "mean_squared_error",
    "regression_metrics",
    "task_names",
    "tensor_data",
]
