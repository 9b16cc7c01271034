"""The diabetes_postgres task: disease progression a year after baseline, from ten
clinical features, read from the member's own database table.

The member's database comes from its task options (``url``, optionally
``password_file`` and ``table``), or from ``DIABETES_PG_URL`` where a tool passes no
options (``fedsec simulate``). The rows are read once through :mod:`fedsec.data`'s SQL
source (a server-side cursor, the password kept out of every message); each row carries
its split (``train`` or ``test``), so members and auditor agree on the hold-out.
Features and target are standardised with the member's own training rows; R² is against
the declared training-target variance (1), so members' sums pool.
"""

from __future__ import annotations

import os
import re

import numpy as np
import torch
from torch import nn

from fedsec.data.settings import SourceSpec
from fedsec.data.sources import open_source
from fedsec.errors import ConfigError
from fedsec.task import (
    DataSource,
    Task,
    TaskData,
    TaskSchema,
    TrainingParams,
    mean_squared_error,
    regression_metrics,
    tensor_data,
)

#: Feature columns, in the model's input order (scikit-learn's names).
FEATURES = ("age", "sex", "bmi", "bp", "s1", "s2", "s3", "s4", "s5", "s6")
TARGET = "progression"
SPLIT = "split"
DEFAULT_TABLE = "diabetes"
# A table name goes into the query text: only a plain (optionally schema-qualified)
# identifier is accepted, never a fragment of SQL.
_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,62}(\.[a-z_][a-z0-9_]{0,62})?$")


def _query(table: str) -> str:
    if not _IDENTIFIER.match(table):
        raise ConfigError(f"diabetes_postgres: table {table!r} is not a plain identifier")
    columns = ", ".join((*FEATURES, TARGET, SPLIT))
    return f"SELECT {columns} FROM {table} ORDER BY id"  # the identifier is checked above


def _read(source: DataSource) -> dict[str, list[object]]:
    """Every column of the member's table, as Python lists.

    Raises:
        ConfigError: no database named, an unusable table name, or the source's own
            refusal (no connection, a failed query, no rows), naming it.
    """
    options = source.options
    url = str(options.get("url") or os.environ.get("DIABETES_PG_URL", ""))
    if not url:
        raise ConfigError(
            "diabetes_postgres needs its database: task option 'url' or DIABETES_PG_URL"
        )
    spec = SourceSpec(
        kind="sql",
        url=url,
        query=_query(str(options.get("table", DEFAULT_TABLE))),
        password_file=str(options.get("password_file", "")),
        name="diabetes_postgres",
    )
    columns: dict[str, list[object]] = {name: [] for name in (*FEATURES, TARGET, SPLIT)}
    for chunk in open_source(spec).chunks():
        for name in columns:
            columns[name].extend(chunk.columns[name].to_pylist())
    return columns


def data(source: DataSource) -> TaskData:
    """The member's rows, split by their ``split`` column and standardised with the
    training rows' mean and deviation (``seed`` unused: the table fixes the split).

    Raises:
        ConfigError: see :func:`_read`; a split other than train/test, or no training
            or no test rows.
    """
    columns = _read(source)
    x = np.array([columns[f] for f in FEATURES], dtype=np.float64).T
    y = np.array(columns[TARGET], dtype=np.float64).reshape(-1, 1)
    split = np.array(columns[SPLIT], dtype=object)
    unknown = sorted({str(s) for s in split} - {"train", "test"})
    if unknown:
        raise ConfigError(f"diabetes_postgres: split values {unknown}; only train and test")
    train, test = split == "train", split == "test"
    if not train.any() or not test.any():
        raise ConfigError("diabetes_postgres: the table needs both train and test rows")
    x_mean, x_std = x[train].mean(axis=0), x[train].std(axis=0)
    y_mean, y_std = y[train].mean(axis=0), y[train].std(axis=0)

    def features(rows: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray((x[rows] - x_mean) / x_std, dtype=np.float32)

    def targets(rows: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray((y[rows] - y_mean) / y_std, dtype=np.float32)

    return tensor_data(features(train), targets(train), features(test), targets(test))


class ProgressionMLP(nn.Module):
    """Ten standardised features -> 32 hidden units -> one standardised value."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(len(FEATURES), 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layers(x)
        return out


task = Task(
    name="diabetes_postgres",
    version="1",
    schema=TaskSchema(
        input_shape=(len(FEATURES),),
        num_classes=1,
        feature_names=FEATURES,
        class_names=(TARGET,),
        target="value",
    ),
    defaults=TrainingParams(lr=0.01, batch_size=32, local_epochs=1, optimizer="sgd", momentum=0.9),
    model=ProgressionMLP,
    data=data,
    loss=mean_squared_error,
    metrics=regression_metrics(target_variance=1.0),
    primary_metric="r2",
)
