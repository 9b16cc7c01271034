"""A task over a member's own CSV file: numeric features, one label column.

The file must have a header row. Features are parsed as floats (no missing values)
and standardized with statistics of the local training split, since no member may
see another's data. Classes are the sorted unique labels of the file, numerically
if every label is a number, so "2" sorts before "10"; a federation whose members may
lack a class locally passes ``classes`` so that every member maps labels to the same
indices.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from fedsec.errors import ConfigError, TaskMismatch
from fedsec.task import DataSource, Task, TaskData, TaskSchema, TrainingParams
from fedsec.tasks.models import TabularMLP
from fedsec.tasks.preprocessing import split_and_standardize

DEFAULT_TEST_FRACTION = 0.2


def _sorted_labels(labels: Iterable[str]) -> list[str]:
    try:
        return sorted(labels, key=float)
    except ValueError:
        return sorted(labels)


def _read_header(path: Path) -> list[str]:
    try:
        with path.open(newline="", encoding="utf-8") as fh:
            header = next(csv.reader(fh), None)
    except OSError as exc:
        raise ConfigError(f"cannot read CSV file {path}: {exc.strerror or exc}") from exc
    if not header:
        raise ConfigError(f"CSV file {path} is empty; a header row is required")
    header = [h.strip() for h in header]
    duplicates = sorted({h for h in header if header.count(h) > 1})
    if duplicates:
        raise ConfigError(f"CSV file {path} has duplicate column names {duplicates}")
    return header


def _read_rows(
    path: Path, header: list[str], label_column: str, feature_columns: tuple[str, ...]
) -> tuple[np.ndarray, list[str]]:
    label_ix = header.index(label_column)
    feature_ix = [header.index(c) for c in feature_columns]
    rows: list[list[float]] = []
    labels: list[str] = []
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csv.reader(fh)
        next(reader)
        for line_no, record in enumerate(reader, start=2):
            if not record or all(not cell.strip() for cell in record):
                continue
            if len(record) != len(header):
                raise ConfigError(
                    f"CSV file {path} line {line_no} has {len(record)} fields, "
                    f"the header has {len(header)}"
                )
            values: list[float] = []
            for col, ix in zip(feature_columns, feature_ix, strict=True):
                cell = record[ix].strip()
                try:
                    value = float(cell)
                except ValueError:
                    value = math.nan
                if not math.isfinite(value):
                    raise ConfigError(
                        f"CSV file {path} line {line_no} column '{col}' is {cell!r}, "
                        "expected a finite number (missing values are not imputed)"
                    )
                values.append(value)
            label = record[label_ix].strip()
            if not label:
                raise ConfigError(f"CSV file {path} line {line_no} has an empty label")
            rows.append(values)
            labels.append(label)
    if not rows:
        raise ConfigError(f"CSV file {path} has no data rows")
    return np.asarray(rows, dtype=np.float64).reshape(len(rows), len(feature_columns)), labels


def csv_task(
    path: str | Path,
    label_column: str,
    feature_columns: Sequence[str] | None = None,
    classes: Sequence[str] | None = None,
    test_fraction: float = DEFAULT_TEST_FRACTION,
) -> Task:
    """Build a task from a local CSV file.

    Args:
        path: the CSV file (header row required).
        label_column: the column holding class labels.
        feature_columns: feature columns in model input order; default all other columns
            in file order.
        classes: the federation's full list of class labels, in index order; default the
            sorted unique labels of this file.
        test_fraction: share of rows held out for local evaluation.

    Raises:
        ConfigError: the file is unreadable or malformed, or a named column is missing.
        TaskMismatch: the file holds a label outside ``classes``.
    """
    csv_path = Path(path)
    header = _read_header(csv_path)
    if label_column not in header:
        raise ConfigError(
            f"CSV file {csv_path} has no label column '{label_column}'; columns are {header}"
        )
    if feature_columns is None:
        features = tuple(c for c in header if c != label_column)
    else:
        features = tuple(feature_columns)
        missing = [c for c in features if c not in header]
        if missing:
            raise ConfigError(f"CSV file {csv_path} lacks feature columns {missing}")
        if label_column in features:
            raise ConfigError(f"label column '{label_column}' is also listed as a feature")
    if not features:
        raise ConfigError(f"CSV file {csv_path} has no feature columns besides the label")
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"csv test_fraction must be in (0, 1), got {test_fraction}")

    x_all, labels = _read_rows(csv_path, header, label_column, features)
    local_classes = _sorted_labels(set(labels))
    if classes is None:
        class_names = tuple(local_classes)
    else:
        class_names = tuple(str(c) for c in classes)
        unknown = [c for c in local_classes if c not in class_names]
        if unknown:
            raise TaskMismatch(
                f"CSV file {csv_path} has labels {unknown} outside the federation's "
                f"classes {list(class_names)}"
            )
    if len(class_names) < 2:
        raise ConfigError(
            f"CSV file {csv_path} has a single class {list(class_names)}; pass the "
            "federation's classes so the model has every output"
        )
    index = {c: i for i, c in enumerate(class_names)}
    y_all = np.asarray([index[label] for label in labels], dtype=np.int64)
    if len(y_all) < 2:
        raise ConfigError(f"CSV file {csv_path} needs at least 2 rows to hold out a test split")

    def data(source: DataSource) -> TaskData:
        return split_and_standardize(x_all, y_all, test_fraction, source.seed, standardize=True)

    n_features = len(features)
    n_classes = len(class_names)
    return Task(
        name="csv",
        version="1",
        schema=TaskSchema(
            input_shape=(n_features,),
            num_classes=n_classes,
            feature_names=features,
            class_names=class_names,
        ),
        defaults=TrainingParams(
            lr=0.05, batch_size=32, local_epochs=1, optimizer="sgd", momentum=0.9
        ),
        model=lambda: TabularMLP(n_features, n_classes, hidden=64),
        data=data,
    )
