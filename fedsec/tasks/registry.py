"""The bundled tasks, and :func:`get_task`: a task looked up by name, with options.

The bundled tasks are declared in fedsec's own ``pyproject.toml`` in the
``fedsec.tasks`` entry-point group, so they are found exactly as a task package's are
(:func:`fedsec.task.load_task`): there is one path, not two.
"""

from __future__ import annotations

from typing import Any

from fedsec.task import Task, load_task

#: The tasks fedsec itself declares in the ``fedsec.tasks`` entry-point group.
TASKS: tuple[str, ...] = ("breast_cancer", "digits", "mnist1d", "csv", "table")


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
    """
    return load_task(name, **options)
