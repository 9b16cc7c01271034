"""What a task is: its data schema, its dataset, its model and its training defaults.

A task is the contract every member of a federation shares: the same input shape and
classes (the :class:`TaskSchema`, compared by fingerprint), the same model architecture
(named by ``Task.name`` and ``Task.version``), and sensible local-training defaults.
Only the data behind it differs per member.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from fedsec.errors import ConfigError, TaskMismatch

Optimizer = Literal["sgd", "adam"]


@dataclass(frozen=True)
class TrainingParams:
    """Local optimisation settings for one round (or one centralized run).

    ``momentum`` is used by SGD only; Adam keeps its own moment estimates.
    """

    lr: float
    batch_size: int
    local_epochs: int
    optimizer: Optimizer = "sgd"
    momentum: float = 0.0

    def __post_init__(self) -> None:
        if not (self.lr > 0 and np.isfinite(self.lr)):
            raise ConfigError(f"training lr must be a positive finite number, got {self.lr!r}")
        if self.batch_size < 1:
            raise ConfigError(f"training batch_size must be >= 1, got {self.batch_size}")
        if self.local_epochs < 1:
            raise ConfigError(f"training local_epochs must be >= 1, got {self.local_epochs}")
        if self.optimizer not in ("sgd", "adam"):
            raise ConfigError(f"training optimizer must be 'sgd' or 'adam', got {self.optimizer!r}")
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"training momentum must be in [0, 1), got {self.momentum}")


@dataclass(frozen=True)
class TaskSchema:
    """The shape of a task's data, which every member must agree on.

    ``input_shape`` excludes the batch dimension. ``class_names`` fixes the meaning of
    each class index (index i is ``class_names[i]``); it matters when members derive
    classes from their own files.
    """

    input_shape: tuple[int, ...]
    num_classes: int
    feature_names: tuple[str, ...] | None = None
    class_names: tuple[str, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The schema as plain JSON-compatible values (lists, not tuples)."""
        return {
            "input_shape": list(self.input_shape),
            "num_classes": self.num_classes,
            "feature_names": None if self.feature_names is None else list(self.feature_names),
            "class_names": None if self.class_names is None else list(self.class_names),
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TaskSchema:
        """Rebuild a schema from :meth:`to_dict` output.

        Raises:
            TaskMismatch: ``raw`` lacks a field or has a field of the wrong type.
        """
        try:
            feature_names = raw["feature_names"]
            class_names = raw["class_names"]
            return cls(
                input_shape=tuple(int(d) for d in raw["input_shape"]),
                num_classes=int(raw["num_classes"]),
                feature_names=None if feature_names is None else tuple(map(str, feature_names)),
                class_names=None if class_names is None else tuple(map(str, class_names)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise TaskMismatch(f"task schema is malformed: {exc!r}") from exc

    def fingerprint(self) -> str:
        """sha256 hex digest of the canonical JSON of the schema.

        Canonical: sorted keys, no whitespace, UTF-8; so equal schemas hash equally on
        every machine and Python version.
        """
        canonical = json.dumps(
            self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=False
        )
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Dataset:
    """A task's local data: float32 features and int64 class indices."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


@dataclass(frozen=True)
class Task:
    """A federated learning task: schema, data loader, model factory and defaults.

    ``version`` changes whenever the data preparation or the model architecture
    changes, so members running different code are told apart.
    """

    name: str
    version: str
    schema: TaskSchema
    defaults: TrainingParams
    loader: Callable[[int], Dataset] = field(repr=False)
    model_factory: Callable[[], torch.nn.Module] = field(repr=False)

    def load(self, seed: int = 0) -> Dataset:
        """Load the task's data; the same ``seed`` always gives the same arrays.

        ``seed`` chooses the train/test split where the task makes one; members
        evaluating on a common test set should all use the default.
        """
        dataset = self.loader(seed)
        _check_dataset(self, dataset)
        return dataset

    def build_model(self, seed: int) -> torch.nn.Module:
        """A freshly initialised float32 model on the CPU, identical for equal seeds.

        The global torch RNG is forked, so building a model does not disturb the
        caller's random stream.
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = self.model_factory()
        return model.float()


def check_schema(
    expected_fingerprint: str, task: Task, expected_schema: TaskSchema | None = None
) -> None:
    """Refuse a local task whose schema differs from the federation's.

    Args:
        expected_fingerprint: the schema fingerprint the round requires.
        task: the local task.
        expected_schema: the federation's full schema, if known; lets the error name the
            fields that differ instead of only the local schema.

    Raises:
        TaskMismatch: the fingerprints differ; the message names the difference.
    """
    local = task.schema
    local_fp = local.fingerprint()
    if local_fp == expected_fingerprint:
        return
    if expected_schema is not None and expected_schema.fingerprint() == expected_fingerprint:
        diffs = _schema_differences(expected_schema, local)
        raise TaskMismatch(
            f"task '{task.name}' does not match the federation's schema: " + "; ".join(diffs)
        )
    raise TaskMismatch(
        f"task '{task.name}' schema fingerprint {local_fp[:12]} does not match the "
        f"federation's {expected_fingerprint[:12]}; local schema is {_describe(local)}"
    )


def _schema_differences(expected: TaskSchema, local: TaskSchema) -> list[str]:
    diffs: list[str] = []
    if expected.input_shape != local.input_shape:
        diffs.append(f"input_shape expected {expected.input_shape}, local {local.input_shape}")
    if expected.num_classes != local.num_classes:
        diffs.append(f"num_classes expected {expected.num_classes}, local {local.num_classes}")
    for label, want, have in (
        ("feature_names", expected.feature_names, local.feature_names),
        ("class_names", expected.class_names, local.class_names),
    ):
        if want == have:
            continue
        if want is None or have is None:
            diffs.append(f"{label} expected {want}, local {have}")
            continue
        missing = [n for n in want if n not in have]
        extra = [n for n in have if n not in want]
        if missing or extra:
            diffs.append(f"{label} missing locally {missing}, extra locally {extra}")
        else:
            diffs.append(f"{label} in a different order: expected {list(want)}, local {list(have)}")
    return diffs


def _describe(schema: TaskSchema) -> str:
    parts = [f"input_shape={schema.input_shape}", f"num_classes={schema.num_classes}"]
    if schema.feature_names is not None:
        parts.append(f"{len(schema.feature_names)} named features")
    if schema.class_names is not None:
        parts.append(f"classes={list(schema.class_names)}")
    return ", ".join(parts)


def _check_dataset(task: Task, dataset: Dataset) -> None:
    """Catch a loader that breaks the float32/int64 contract before a model sees it."""
    for split, x, y in (
        ("train", dataset.x_train, dataset.y_train),
        ("test", dataset.x_test, dataset.y_test),
    ):
        if x.dtype != np.float32 or y.dtype != np.int64:
            raise TaskMismatch(
                f"task '{task.name}' {split} data has dtypes {x.dtype}/{y.dtype}, "
                "expected float32 features and int64 labels"
            )
        if x.shape[1:] != task.schema.input_shape or x.shape[0] != y.shape[0]:
            raise TaskMismatch(
                f"task '{task.name}' {split} data has shape {x.shape} with {y.shape[0]} labels, "
                f"expected (n, *{task.schema.input_shape})"
            )
        if y.size and (int(y.min()) < 0 or int(y.max()) >= task.schema.num_classes):
            raise TaskMismatch(
                f"task '{task.name}' {split} labels fall outside 0..{task.schema.num_classes - 1}"
            )
