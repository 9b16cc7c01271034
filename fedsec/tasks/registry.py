"""The bundled tasks, and :func:`get_task`: a task looked up by name, with options.

The bundled tasks are declared in fedsec's own ``pyproject.toml`` in the
``fedsec.tasks`` entry-point group, so they are found exactly as a task package's are
(:func:`fedsec.task.load_task`): there is one path, not two.
"""

from __future__ import annotations

from typing import Any

from fedsec.task import Task, load_task
from fedsec.task.dp import check_dp_compatible

#: The tasks fedsec itself declares in the ``fedsec.tasks`` entry-point group.
TASKS: tuple[str, ...] = (
    "breast_cancer",
    "digits",
    "mnist1d",
    "csv",
    "table",
    "diabetes",
    "digits_labels",
)


def get_task(name: str, **options: Any) -> Task:
    """Build the installed task called ``name``.

    Args:
        name: an entry-point name in the ``fedsec.tasks`` group, e.g. one of :data:`TASKS`.
        **options: task options; ``csv`` takes ``path``, ``label_column``,
            ``feature_columns``, ``classes``, ``test_fraction``; ``table`` takes
            ``features`` and ``classes`` (filled in from a ``[schema]`` section).

    Raises:
        UnknownTask: no installed package declares ``name`` (a ConfigError).
        ConfigError: unknown or missing option, or bad option value.
        InvalidTask: the entry point does not give a task.
        DpIncompatibleModel: a model layer Opacus cannot train (named, with its fix).
    """
    return runnable(load_task(name, **options))


def runnable(task: Task) -> Task:
    """``task`` if the round runtime can train it under DP.

    Training, the aggregator's validation, members' federated evaluation and the
    audit's control-sample checks apply the task's own loss and metrics, and dashboards
    and alerts follow its primary metric in its direction. Its model must pass Opacus's
    validator: updates carry trainable parameters only, so a layer whose buffers change
    in training (BatchNorm) would leave the global model's buffers at their initial
    values, and DP-SGD refuses it. Checked here, where the aggregator, each agent and
    the auditor look the task up, before anything runs.

    Raises:
        DpIncompatibleModel: a layer Opacus refuses; the message names it and its fix.
    """
    check_dp_compatible(task.name, task.build_model(0))
    return task
