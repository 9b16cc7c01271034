"""This member's task and its share of the training data, as ``agent.toml`` names them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from fedsec.config import DataSection
from fedsec.errors import ConfigError
from fedsec.protocol import wire
from fedsec.tasks import Task, get_task, parse_partition


@dataclass(frozen=True)
class LocalData:
    """This member's task and its share of the training data."""

    task: Task
    x: npt.NDArray[np.float32]
    y: npt.NDArray[np.int64]
    # task "table": the unsigned data summary the member signs at join
    summary: wire.DataSummary | None = None
    fingerprint: str = ""  # task "table": of the sources, to catch a change before training

    @property
    def samples(self) -> int:
        return len(self.y)


def load_local_data(data: DataSection, state_dir: str | Path = "", member: str = "") -> LocalData:
    """Build the task and this member's part of its training data.

    Raises:
        ConfigError: unknown task, bad options or partition, unreadable CSV or source.
        TaskMismatch: task "table" data that differs from the federation schema.
    """
    if data.task == "table":
        return _load_table(data, Path(state_dir), member)
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


def _load_table(data: DataSection, state_dir: Path, member: str) -> LocalData:
    """Read the owner's sources through its rules into the federation's encoding."""
    from fedsec.data.rules import load_hash_key
    from fedsec.data.settings import ColumnRules
    from fedsec.data.sources import open_source
    from fedsec.data.summary import data_summary
    from fedsec.data.table import build_table
    from fedsec.tasks.table_task import with_records

    schema = data.schema
    if schema is None:
        raise ConfigError('data.task = "table" needs the federation schema in [data.schema]')
    rules = data.rules or ColumnRules()
    key = None
    if "hash" in rules.anonymise.values():
        key = load_hash_key(rules.hash_key_file or str(state_dir / "anonymise.key"))
    sources = [open_source(s) for s in data.sources]
    table = build_table(sources, schema, rules, key)
    task = with_records(get_task("table", **data.task_options), table.x, table.y)
    dataset = task.load()
    # with summary_epsilon > 0 the counts are noised; AgentRuntime.prepare charges it
    summary = data_summary(table, schema, member, count_epsilon=data.summary_epsilon)
    return LocalData(
        task=task,
        x=dataset.x_train,
        y=dataset.y_train,
        summary=summary,
        fingerprint=table.fingerprint,
    )
