"""A task over a federation schema: the member's own tables, encoded alike everywhere.

The federation's ``[schema]`` fixes the encoded features and the classes, so the task's
:class:`TaskSchema`, its fingerprint and the model are the same at every member and at
the aggregator, which holds no data: its task has no loader.  A member attaches its
encoded records (``fedsec.data.table.build_table``) with :func:`with_records`; they are
split and standardised with this member's own statistics, as the ``csv`` task does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from fedsec.errors import ConfigError, TaskMismatch
from fedsec.task import DataSource, Task, TaskData, TaskSchema, TrainingParams
from fedsec.tasks.csv_task import DEFAULT_TEST_FRACTION
from fedsec.tasks.models import TabularMLP
from fedsec.tasks.preprocessing import split_and_standardize


def table_task(features: Sequence[str], classes: Sequence[str]) -> Task:
    """The task of a federation schema's encoded ``features`` and ``classes``.

    Raises:
        ConfigError: no features, or fewer than two classes.
    """
    if not features:
        raise ConfigError("task table needs at least one feature")
    if len(classes) < 2:
        raise ConfigError("task table needs at least two classes")
    n_features, n_classes = len(features), len(classes)

    def no_records(source: DataSource) -> TaskData:
        raise ConfigError("task table holds no records here: the data stays with the members")

    return Task(
        name="table",
        version="1",
        schema=TaskSchema(
            input_shape=(n_features,),
            num_classes=n_classes,
            feature_names=tuple(features),
            class_names=tuple(classes),
        ),
        defaults=TrainingParams(
            lr=0.05, batch_size=32, local_epochs=1, optimizer="sgd", momentum=0.9
        ),
        model=lambda: TabularMLP(n_features, n_classes, hidden=64),
        data=no_records,
    )


def table_task_for_model(arrays: Mapping[str, np.ndarray]) -> Task:
    """The table task whose model has these parameters.

    An auditor re-deriving a model version holds the model file, not the federation's
    schema; feature and class names do not change the parameters, so placeholders do.

    Raises:
        TaskMismatch: ``arrays`` are not a table model's.
    """
    try:
        n_features = int(arrays["layers.0.weight"].shape[1])
        n_classes = int(arrays["layers.2.weight"].shape[0])
    except (KeyError, IndexError) as exc:
        raise TaskMismatch(f"not a model of task table: {exc!r}") from None
    return table_task(
        [f"feature_{i}" for i in range(n_features)], [f"class_{j}" for j in range(n_classes)]
    )


def with_records(task: Task, x: np.ndarray, y: np.ndarray) -> Task:
    """``task`` loading this member's encoded records.

    Raises:
        ConfigError: fewer than two records, or a shape the schema does not have.
    """
    if len(y) < 2:
        raise ConfigError(
            f"only {len(y)} usable record(s); need at least 2 to hold out a test split"
        )
    if x.shape[1:] != task.schema.input_shape:
        raise ConfigError(
            f"records have {x.shape[1:]} features, the schema {task.schema.input_shape}"
        )

    def data(source: DataSource) -> TaskData:
        return split_and_standardize(x, y, DEFAULT_TEST_FRACTION, source.seed, standardize=True)

    return dataclasses.replace(task, data=data)
