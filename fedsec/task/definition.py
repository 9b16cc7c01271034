"""What a task is: a model factory, a data function, a loss, metrics and defaults.

A :class:`Task` is the contract every party of a federation shares: the same model
architecture (``name`` and ``version``, and for installed packages the digest of their
files), the same schema (input shape and classes, compared by fingerprint), the same
loss and metrics. Only the data behind it differs per member: the data function
receives the member's configured :class:`DataSource` and returns torch datasets.

The bundled tasks (``fedsec.tasks``) are declared with this same class and found the
same way, through the ``fedsec.tasks`` entry-point group.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset as TorchDataset
from torch.utils.data import TensorDataset

from fedsec.errors import InvalidTask, TaskMismatch
from fedsec.task.defaults import TrainingParams
from fedsec.task.metrics import (
    CLASSIFICATION_METRICS,
    BatchStep,
    Loss,
    Metric,
    checked_loss,
    cross_entropy,
    metric_total,
)
from fedsec.task.schema import TaskSchema

#: A metric's name as reports, dashboards and ``/metrics`` carry it
#: (:data:`fedsec.protocol.evaluation.MetricName`).
_METRIC_NAME = re.compile(r"[a-z0-9_]{1,64}")


@dataclass(frozen=True)
class DataSource:
    """What a member configured as the data of a task.

    ``seed`` chooses the train/test split where the task makes one (members
    evaluating on a common test set all use the default 0); ``options`` are the
    member's task options (a file path, a table, ...), as ``load_task`` received them.
    """

    seed: int = 0
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class TaskData:
    """A member's local data as torch datasets: each item is ``(x, y)`` tensors, or
    whatever the task's ``batch_step`` consumes. Read lazily, item by item."""

    train: TorchDataset[Any]
    test: TorchDataset[Any]


@dataclass(frozen=True)
class Dataset:
    """A task's local data held in memory: float32 features and, by the schema's
    ``target``, int64 class indices ``(n,)`` or float32 values or labels ``(n, k)``.

    The form the in-memory training loop consumes (:meth:`Task.load`).
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


@dataclass(frozen=True)
class Task:
    """A federated learning task.

    Args:
        name: the task's name, its entry-point name.
        version: changes whenever data preparation or model architecture changes.
        schema: input shape and classes every member agrees on.
        defaults: local-training defaults.
        model: builds a fresh ``torch.nn.Module`` (any module).
        data: ``DataSource -> TaskData``; reads the member's own data.
        loss: ``(output, targets) -> 0-d tensor``, the batch mean; cross-entropy by default.
        metrics: name -> :class:`Metric`; accuracy and cross-entropy by default.
        primary_metric: the metric that dashboards and alerts follow.
        batch_step: ``(model, batch) -> loss``, for a forward that needs more than ``x``.
        dp_fix: apply Opacus's ``ModuleValidator.fix`` to every model built (e.g.
            BatchNorm -> GroupNorm) and turn in-place activations off, so a model with
            such layers can train under DP.
        options: the member's task options, handed to ``data`` in its
            :class:`DataSource`; ``load_task`` sets them.

    Raises:
        InvalidTask: ``primary_metric`` is not one of ``metrics``, ``name`` is empty, a
            metric's name is not lower-case letters, digits and ``_`` (at most 64; it
            is a wire and Prometheus label value) or is ``loss`` (reported next to the
            metrics), or a regression or multi-label schema keeps the classification loss.
    """

    name: str
    version: str
    schema: TaskSchema
    defaults: TrainingParams
    model: Callable[[], torch.nn.Module] = field(repr=False)
    data: Callable[[DataSource], TaskData] = field(repr=False)
    loss: Loss = field(default=cross_entropy, repr=False)
    metrics: Mapping[str, Metric] = field(default_factory=lambda: CLASSIFICATION_METRICS)
    primary_metric: str = "accuracy"
    batch_step: BatchStep | None = field(default=None, repr=False)
    dp_fix: bool = False
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), repr=False)

    def __post_init__(self) -> None:
        if not self.name:
            raise InvalidTask("a task needs a non-empty name")
        for metric in self.metrics:
            if not _METRIC_NAME.fullmatch(metric) or metric == "loss":
                raise InvalidTask(
                    f"task '{self.name}' metric name {metric!r} must be 1-64 lower-case "
                    "letters, digits or '_', and not 'loss' (the loss is reported as 'loss')"
                )
        if self.primary_metric not in self.metrics:
            raise InvalidTask(
                f"task '{self.name}' primary metric '{self.primary_metric}' is not one of "
                f"its metrics {sorted(self.metrics)}"
            )
        if self.schema.target != "class" and self.loss is cross_entropy and not self.batch_step:
            raise InvalidTask(
                f"task '{self.name}' has {self.schema.target} targets but the default "
                "cross-entropy loss, which needs class indices: declare its loss (e.g. "
                "fedsec.task.mean_squared_error or binary_cross_entropy)"
            )

    @property
    def own_loss(self) -> bool:
        """Whether the task trains with a loss or batch step of its own rather than the
        default cross-entropy on ``(x, y)``."""
        return self.batch_step is not None or self.loss is not cross_entropy

    @property
    def higher_is_better(self) -> bool:
        """Whether a larger primary metric is an improvement."""
        return self.metrics[self.primary_metric].higher_is_better

    def build_model(self, seed: int) -> torch.nn.Module:
        """A freshly initialised float32 model on the CPU, identical for equal seeds.

        The global torch RNG is forked, so building a model does not disturb the
        caller's random stream.

        Raises:
            InvalidTask: the factory did not return a ``torch.nn.Module``.
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = self.model()
            if not isinstance(model, torch.nn.Module):
                raise InvalidTask(
                    f"task '{self.name}' model factory returned {type(model).__name__}, "
                    "expected a torch.nn.Module"
                )
            if self.dp_fix:
                from opacus.validators import ModuleValidator

                from fedsec.task.dp import turn_off_in_place

                model = turn_off_in_place(ModuleValidator.fix(model))
        return model.float()

    def datasets(self, source: DataSource | None = None) -> TaskData:
        """The member's data as torch datasets, read by the task's data function; by
        default from split seed 0 and the task's ``options``."""
        return self.data(source if source is not None else DataSource(options=self.options))

    def load(self, seed: int = 0) -> Dataset:
        """The task's data held in memory; the same ``seed`` always gives the same arrays.

        Raises:
            TaskMismatch: the data breaks the schema (dtype, shape, label range).
        """
        data = self.datasets(DataSource(seed=seed, options=self.options))
        x_train, y_train = _arrays(data.train)
        x_test, y_test = _arrays(data.test)
        dataset = Dataset(x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
        _check_dataset(self, dataset)
        return dataset

    def batch_loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """The loss of one batch: ``batch_step(model, batch)``, else ``loss(model(x), y)``.

        Raises:
            InvalidTask: the loss is not a 0-d floating tensor.
        """
        if self.batch_step is not None:
            return checked_loss(self.name, self.batch_step(model, batch))
        x, y = batch
        return checked_loss(self.name, self.loss(model(x), y))

    def metric_totals(self, output: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        """Each metric's sum over one batch (divide by the record count for the mean).

        Raises:
            InvalidTask: a metric returned a non-scalar or a non-finite value.
        """
        return {
            name: metric_total(self.name, name, metric.total(output, targets))
            for name, metric in self.metrics.items()
        }

    def metric_sums(
        self, output: torch.Tensor, targets: torch.Tensor
    ) -> dict[str, tuple[float, float]]:
        """Each metric's ``(total, weight)`` over one batch: the value over any records
        is the sum of totals over the sum of weights (the weight is the record count
        unless the metric declares its own denominator).

        Raises:
            InvalidTask: a metric returned a non-scalar or a non-finite value.
        """
        sums: dict[str, tuple[float, float]] = {}
        for name, metric in self.metrics.items():
            total = metric_total(self.name, name, metric.total(output, targets))
            weight = (
                float(len(targets))
                if metric.weight is None
                else metric_total(self.name, name, metric.weight(output, targets))
            )
            sums[name] = (total, weight)
        return sums


def tensor_data(
    x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray
) -> TaskData:
    """In-memory arrays as torch datasets, sharing their memory (no copy)."""
    return TaskData(
        train=TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train)),
        test=TensorDataset(torch.from_numpy(x_test), torch.from_numpy(y_test)),
    )


def _arrays(data: TorchDataset[Any]) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` arrays of a dataset of ``(x, y)`` items; a TensorDataset's own memory."""
    if isinstance(data, TensorDataset) and len(data.tensors) == 2:
        x, y = data.tensors
        return x.numpy(), y.numpy()
    items = [data[i] for i in range(len(data))]  # type: ignore[arg-type]
    if not items:
        raise TaskMismatch("a task dataset is empty")
    xs = np.stack([np.asarray(x) for x, _ in items])
    ys = np.asarray([np.asarray(y) for _, y in items])
    return xs, ys


def _check_dataset(task: Task, dataset: Dataset) -> None:
    """Catch a data function that breaks the dtype contract before a model sees it."""
    for split, x, y in (
        ("train", dataset.x_train, dataset.y_train),
        ("test", dataset.x_test, dataset.y_test),
    ):
        check_targets(task.name, task.schema, y, f"{split} data")
        if x.dtype != np.float32:
            raise TaskMismatch(
                f"task '{task.name}' {split} data has dtype {x.dtype}, expected float32 features"
            )
        if x.shape[1:] != task.schema.input_shape or x.shape[0] != y.shape[0]:
            raise TaskMismatch(
                f"task '{task.name}' {split} data has shape {x.shape} with {y.shape[0]} labels, "
                f"expected (n, *{task.schema.input_shape})"
            )


def as_targets(y: np.ndarray) -> np.ndarray:
    """``y`` in the dtype training and evaluation feed the loss: int64 class indices, or
    float32 regression values and multi-label labels (floating ``y``). No copy where it
    has that dtype already."""
    dtype = np.float32 if np.issubdtype(y.dtype, np.floating) else np.int64
    return np.ascontiguousarray(y, dtype=dtype)


def check_targets(name: str, schema: TaskSchema, y: np.ndarray, where: str) -> None:
    """Refuse targets that break the schema's target contract.

    Class indices are int64 ``(n,)`` in ``0..num_classes-1``; values and labels are
    float32 ``(n, num_classes)``, finite, labels 0 or 1.

    Raises:
        TaskMismatch: a wrong dtype, shape or value; the message names ``where``.
    """
    k = schema.num_classes
    if schema.target == "class":
        if y.dtype != np.int64 or y.ndim != 1:
            raise TaskMismatch(
                f"task '{name}' {where} has targets {y.dtype} {y.shape}, expected int64 (n,) "
                "class indices"
            )
        if y.size and (int(y.min()) < 0 or int(y.max()) >= k):
            raise TaskMismatch(f"task '{name}' {where} labels fall outside 0..{k - 1}")
        return
    if y.dtype != np.float32 or y.ndim != 2 or y.shape[1] != k:
        raise TaskMismatch(
            f"task '{name}' {where} has targets {y.dtype} {y.shape}, expected float32 "
            f"(n, {k}) {schema.target}s"
        )
    if not np.all(np.isfinite(y)):
        raise TaskMismatch(f"task '{name}' {where} has non-finite targets")
    if schema.target == "labels" and not np.all((y == 0) | (y == 1)):
        raise TaskMismatch(f"task '{name}' {where} has labels other than 0 and 1")
