"""What ``fedsec task inspect`` reports of an installed task."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from fedsec.task.digest import task_pin
from fedsec.task.discovery import load_task
from fedsec.task.dp import dp_problems


@dataclass(frozen=True)
class TaskReport:
    """An installed task as a federation would pin it, and whether DP-SGD can train it.

    ``version`` is the distribution's version (what is pinned with the digest);
    ``task_version`` is the task's own ``Task.version``.
    """

    name: str
    distribution: str
    version: str
    digest: str
    task_version: str
    params: int
    buffers: int
    input_shape: list[int]
    num_classes: int
    primary_metric: str
    higher_is_better: bool
    dp_compatible: bool
    dp_problems: list[str]
    target: str = "class"  # what num_classes counts: classes, values or labels

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-compatible values."""
        return asdict(self)


def inspect_task(name: str, **options: Any) -> TaskReport:
    """Build, digest and DP-check the installed task ``name``.

    Raises:
        UnknownTask: no single installed distribution declares ``name``.
        ConfigError: a missing, unknown or bad task option.
        InvalidTask: the entry point does not give a task, or its files cannot be read.
    """
    task = load_task(name, **options)
    pin = task_pin(name)
    model = task.build_model(0)
    problems = dp_problems(model)
    return TaskReport(
        name=name,
        distribution=pin.distribution,
        version=pin.version,
        digest=pin.digest,
        task_version=task.version,
        params=sum(p.numel() for p in model.parameters()),
        buffers=sum(b.numel() for b in model.buffers()),
        input_shape=list(task.schema.input_shape),
        num_classes=task.schema.num_classes,
        primary_metric=task.primary_metric,
        higher_is_better=task.higher_is_better,
        dp_compatible=not problems,
        dp_problems=[str(p) for p in problems],
        target=task.schema.target,
    )
