"""``fedsec task``: list, inspect and start task packages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from fedsec.errors import ConfigError


@click.group()
def task() -> None:
    """Task packages: the model and data code every party installs and pins."""


@task.command("list")
def task_list() -> None:
    """The installed tasks and the distribution that declares each."""
    from fedsec.task.discovery import installed_tasks

    for name, entries in sorted(installed_tasks().items()):
        for entry in entries:
            click.echo(f"{name}\t{entry.distribution_name} {entry.version}\t{entry.value}")


@task.command("inspect")
@click.argument("entry")
@click.option(
    "--option",
    "options",
    multiple=True,
    metavar="KEY=VALUE",
    help="a task option; VALUE is read as JSON where it parses (lists, numbers)",
)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def task_inspect(entry: str, options: tuple[str, ...], as_json: bool) -> None:
    """Name, version, digest, parameter count and DP compatibility of task ENTRY."""
    from fedsec.task.inspection import inspect_task

    report = inspect_task(entry, **_parse_options(options))
    if as_json:
        click.echo(json.dumps(report.to_dict()))
        return
    direction = "higher" if report.higher_is_better else "lower"
    for label, value in (
        ("name", f"{report.name} (task version {report.task_version})"),
        ("distribution", f"{report.distribution} {report.version}"),
        ("digest", report.digest),
        ("params", f"{report.params:,} (buffers: {report.buffers:,})"),
        ("input", f"{tuple(report.input_shape)}, {_outputs(report.num_classes, report.target)}"),
        ("primary metric", f"{report.primary_metric} ({direction} is better)"),
        ("DP-SGD", "compatible (Opacus validator)" if report.dp_compatible else
         "NOT compatible (Opacus validator):"),
    ):  # fmt: skip
        click.echo(f"{label + ':':<16}{value}")
    for problem in report.dp_problems:
        click.echo(f"  - {problem}")


@task.command("new")
@click.argument("name")
@click.option(
    "--dir",
    "parent",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("."),
    show_default=True,
    help="where to create the package directory",
)
def task_new(name: str, parent: Path) -> None:
    """Write a task package skeleton NAME/ that passes its own test once installed."""
    from fedsec.task.skeleton import write_skeleton

    for path in write_skeleton(name, parent):
        click.echo(str(path))
    click.echo(f"next: pip install -e {parent / name} && python -m pytest {parent / name}/tests")


def _parse_options(options: tuple[str, ...]) -> dict[str, Any]:
    parsed: dict[str, Any] = {}
    for item in options:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"task option {item!r} must be KEY=VALUE")
        try:
            parsed[key] = json.loads(raw)
        except ValueError:
            parsed[key] = raw
    return parsed


def _outputs(count: int, target: str) -> str:
    """``10 classes``, ``1 regression value``, ``3 labels (multi-label)``."""
    noun = {"class": "class", "value": "regression value", "labels": "label"}[target]
    plural = noun if count == 1 else ("classes" if noun == "class" else noun + "s")
    return f"{count} {plural}" + (" (multi-label)" if target == "labels" else "")
