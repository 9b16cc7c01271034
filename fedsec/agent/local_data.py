"""This member's task and its share of the training data, as ``agent.toml`` names them.

The training data stays a torch dataset as the task's data function returns it, read
lazily (e.g. an image folder read a batch at a time), so a member's memory does not grow
with its dataset; only a table, built from the owner's sources through its rules, is
held in memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset as TorchDataset
from torch.utils.data import Subset, TensorDataset

from fedsec.config import DataSection
from fedsec.errors import ConfigError, TaskMismatch
from fedsec.protocol import wire
from fedsec.tasks import Task, get_task, parse_partition


@dataclass(frozen=True)
class LocalData:
    """This member's task and its share of the training data."""

    task: Task
    #: the member's training records, ``(x, y)`` items read when training asks for them
    train: TorchDataset[Any]
    # task "table": the unsigned data summary the member signs at join
    summary: wire.DataSummary | None = None
    fingerprint: str = ""  # task "table": of the sources, to catch a change before training

    @property
    def samples(self) -> int:
        return len(self.train)  # type: ignore[arg-type]  # map-style: has a length


def task_options(data: DataSection) -> dict[str, Any]:
    """The options ``data.task`` is built with (``data.csv`` is the csv task's path).

    Raises:
        ConfigError: ``data.csv`` set for a task other than csv.
    """
    options = dict(data.task_options)
    if data.csv:
        if data.task != "csv":
            raise ConfigError(
                f'data.csv is set but data.task is {data.task!r}; set data.task = "csv"'
            )
        options["path"] = data.csv
    return options


def load_local_data(data: DataSection, state_dir: str | Path = "", member: str = "") -> LocalData:
    """Build the task and this member's part of its training data.

    Raises:
        ConfigError: unknown task, bad options or partition, unreadable CSV or source.
        TaskMismatch: task "table" data that differs from the federation schema.
    """
    if data.task == "table":
        return _load_table(data, Path(state_dir), member)
    task = get_task(data.task, **task_options(data))
    train = task.datasets().train
    check_record(task, train)
    if data.parts > 1:
        parts = parse_partition(data.partition).apply(labels(train), data.parts, data.seed)
        train = Subset(train, parts[data.part_index].tolist())
    return LocalData(task=task, train=train)


def check_record(task: Task, train: TorchDataset[Any]) -> None:
    """Refuse data whose records break the task's schema, from its first record (the
    rest is read only in training): float32 features of the schema's input shape.

    Raises:
        TaskMismatch: the dataset is empty, or its first record has another shape or dtype.
    """
    if len(train) < 1:  # type: ignore[arg-type]
        raise TaskMismatch(f"task '{task.name}' training data is empty")
    record = train[0]
    features = record[0] if isinstance(record, (tuple, list)) else None
    if not isinstance(features, torch.Tensor):
        return  # a batch_step task's own record layout: its step checks it
    if features.dtype != torch.float32 or tuple(features.shape) != task.schema.input_shape:
        raise TaskMismatch(
            f"task '{task.name}' records have {features.dtype} features of shape "
            f"{tuple(features.shape)}; the schema says float32 of {task.schema.input_shape}"
        )


def labels(train: TorchDataset[Any]) -> np.ndarray:
    """Every record's label, for partitioning a simulation's data among members: an
    in-memory dataset's own array, else read record by record (one label held each)."""
    if isinstance(train, TensorDataset):
        return train.tensors[1].numpy()
    targets = getattr(train, "targets", None)
    if targets is not None:
        return np.asarray(targets)
    return np.asarray([int(train[i][1]) for i in range(len(train))])  # type: ignore[arg-type]


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
    train = TensorDataset(torch.from_numpy(dataset.x_train), torch.from_numpy(dataset.y_train))
    # with summary_epsilon > 0 the counts are noised; AgentRuntime.prepare charges it
    summary = data_summary(table, schema, member, count_epsilon=data.summary_epsilon)
    return LocalData(
        task=task,
        train=train,
        summary=summary,
        fingerprint=table.fingerprint,
    )
