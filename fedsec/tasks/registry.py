"""The registry of bundled tasks: look a task up by name, with options."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from fedsec.errors import ConfigError
from fedsec.tasks.base import Task
from fedsec.tasks.csv_task import csv_task
from fedsec.tasks.mnist1d_task import mnist1d_task
from fedsec.tasks.sklearn_tasks import breast_cancer_task, digits_task
from fedsec.tasks.table_task import table_task

_FACTORIES: dict[str, Callable[..., Task]] = {
    "breast_cancer": breast_cancer_task,
    "digits": digits_task,
    "mnist1d": mnist1d_task,
    "csv": csv_task,
    "table": table_task,
}

TASKS: tuple[str, ...] = tuple(_FACTORIES)


def get_task(name: str, **options: Any) -> Task:
    """Build the task called ``name``.

    Args:
        name: one of :data:`TASKS`.
        **options: task options; ``csv`` takes ``path``, ``label_column``,
            ``feature_columns``, ``classes``, ``test_fraction``; ``table`` takes
            ``features`` and ``classes`` (filled in from a ``[schema]`` section).

    Raises:
        ConfigError: unknown task, unknown or missing option, or bad option value.
    """
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ConfigError(f"unknown task '{name}'; known tasks are {list(TASKS)}")
    params = inspect.signature(factory).parameters
    unknown = sorted(set(options) - set(params))
    if unknown:
        accepted = sorted(params) or "none"
        raise ConfigError(f"task '{name}' has no option(s) {unknown}; accepted: {accepted}")
    required = [
        p
        for p, spec in params.items()
        if spec.default is inspect.Parameter.empty and p not in options
    ]
    if required:
        raise ConfigError(f"task '{name}' requires option(s) {required}")
    return factory(**options)
