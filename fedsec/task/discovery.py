"""Find tasks by name in the ``fedsec.tasks`` entry-point group.

A task package declares, in its ``pyproject.toml``::

    [project.entry-points."fedsec.tasks"]
    xray = "hospital_xray.task:task"

The object named is a :class:`~fedsec.task.Task`, or a factory that returns one from
keyword options (``csv`` takes a file path, ``table`` the federation's features).
fedsec never imports code it was sent: only what is installed here is found.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import Distribution, EntryPoint, entry_points
from types import MappingProxyType
from typing import Any

from fedsec.errors import ConfigError, InvalidTask, UnknownTask
from fedsec.task.definition import Task

#: The entry-point group task packages declare their tasks in.
ENTRY_POINT_GROUP = "fedsec.tasks"


@dataclass(frozen=True)
class TaskEntry:
    """One installed task: its entry-point name, target and providing distribution."""

    name: str
    value: str
    distribution: Distribution
    entry_point: EntryPoint

    @property
    def distribution_name(self) -> str:
        """The providing distribution's name as its metadata spells it."""
        return str(self.distribution.metadata["Name"])

    @property
    def version(self) -> str:
        """The providing distribution's version."""
        return str(self.distribution.version)


def installed_tasks() -> dict[str, list[TaskEntry]]:
    """Every task name in the entry-point group, with each distinct declaration of it.

    A distribution found twice on ``sys.path`` with the same target counts once; two
    distributions declaring one name are both listed (and :func:`find_task` refuses it).
    """
    found: dict[str, list[TaskEntry]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        entry = _entry(ep)
        known = found.setdefault(ep.name, [])
        if not any(
            e.value == entry.value and e.distribution_name == entry.distribution_name for e in known
        ):
            known.append(entry)
    return found


def task_names() -> tuple[str, ...]:
    """The names of the installed tasks, sorted."""
    return tuple(sorted(installed_tasks()))


def find_task(name: str) -> TaskEntry:
    """The one installed declaration of task ``name``.

    Raises:
        UnknownTask: no installed distribution declares ``name``, or several do (the
            name would not say whose code runs).
    """
    entries = installed_tasks().get(name, [])
    if not entries:
        raise UnknownTask(
            f"unknown task '{name}': no installed package declares it in the "
            f"'{ENTRY_POINT_GROUP}' entry-point group; installed tasks are {list(task_names())}"
        )
    if len(entries) > 1:
        who = ", ".join(f"{e.distribution_name} {e.version} ({e.value})" for e in entries)
        raise UnknownTask(f"task '{name}' is declared by more than one package: {who}")
    return entries[0]


def load_task(name: str, **options: Any) -> Task:
    """Build the installed task ``name`` with ``options``.

    Args:
        name: the entry-point name.
        **options: the member's task options: keyword arguments of a task factory
            (checked against its signature), and for either form the ``options`` of
            the :class:`DataSource` the data function receives.

    Raises:
        UnknownTask: see :func:`find_task`.
        ConfigError: an unknown or missing option, or a bad option value.
        InvalidTask: the entry point does not name a Task or a factory of one, cannot
            be imported, or gives a task whose name is not the entry-point name.
    """
    entry = find_task(name)
    try:
        target = entry.entry_point.load()
    except (ImportError, AttributeError) as exc:
        raise InvalidTask(
            f"task '{name}' ({entry.value} in {entry.distribution_name} {entry.version}) "
            f"cannot be imported: {exc}"
        ) from exc
    if isinstance(target, Task):
        # A task object reads its options in its data function (DataSource.options).
        return _named(name, target, options)
    if not callable(target):
        raise InvalidTask(
            f"task '{name}' entry point {entry.value} names a {type(target).__name__}, "
            "expected a fedsec.task.Task or a function returning one"
        )
    task = _call_factory(name, target, options)
    if not isinstance(task, Task):
        raise InvalidTask(
            f"task '{name}' factory {entry.value} returned {type(task).__name__}, "
            "expected a fedsec.task.Task"
        )
    return _named(name, task, options)


def _named(name: str, task: Task, options: dict[str, Any]) -> Task:
    # Round specs name the task by Task.name and members pin it by entry point: the
    # two must be one name, or a spec could name code other than what is pinned.
    if task.name != name:
        raise InvalidTask(
            f"entry point '{name}' gives a task named '{task.name}'; "
            "a task's name must be its entry-point name"
        )
    return dataclasses.replace(task, options=MappingProxyType(dict(options)))


def _call_factory(name: str, factory: Callable[..., Any], options: dict[str, Any]) -> Any:
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


def _entry(ep: EntryPoint) -> TaskEntry:
    dist = ep.dist
    if dist is None:  # only for entry points built by hand, never for installed ones
        raise InvalidTask(f"task '{ep.name}' entry point has no distribution")
    return TaskEntry(name=ep.name, value=ep.value, distribution=dist, entry_point=ep)
