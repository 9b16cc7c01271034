"""A model's metrics and loss on a labelled set: accuracy and loss for the simulations
and baselines (:func:`evaluate`), every metric of the task as pooled sums for rounds
(:func:`evaluate_sums`, what the aggregator's validation and each member's federated
evaluation report)."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader
from torch.utils.data import Dataset as TorchDataset

from fedsec.task.metrics import MetricSums, checked_loss

if TYPE_CHECKING:
    from fedsec.task.definition import Task

# Large enough to amortise per-batch overhead, small enough for any bundled model's
# activations to fit comfortably on a small GPU.
EVAL_BATCH_SIZE = 1024


def evaluate(
    model: torch.nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    device: torch.device | str = "cpu",
    batch_size: int = EVAL_BATCH_SIZE,
    task: Task | None = None,
) -> tuple[float, float]:
    """Evaluate ``model`` on ``(x, y)``.

    The caller's model is not moved or left in eval mode: if it lives on another
    device, a copy is evaluated.

    Args:
        task: whose loss is reported (its ``batch_step`` when it declares one); None:
            cross-entropy.

    Returns:
        ``(accuracy, mean loss over the records)``; ``(nan, nan)`` for an empty set.
        With floating ``y`` (regression values, multi-label labels) accuracy means
        nothing: the first value is then the task's primary metric (nan without a task).

    Raises:
        InvalidTask: the task's loss is not a 0-d floating tensor.
    """
    n = len(y)
    if n == 0:
        return float("nan"), float("nan")
    if np.issubdtype(y.dtype, np.floating):
        if task is None:
            return float("nan"), float("nan")
        values = evaluate_sums(model, x, y, task, device, batch_size).values()
        return values.get(task.primary_metric, float("nan")), values["loss"]
    target = torch.device(device)
    first = next(model.parameters(), None)
    on_target = first is None or first.device == target
    work = model if on_target else copy.deepcopy(model).to(target)
    was_training = work.training
    work.eval()
    correct = 0
    loss_sum = 0.0
    try:
        with torch.no_grad():
            for start in range(0, n, batch_size):
                xb = torch.from_numpy(np.ascontiguousarray(x[start : start + batch_size])).to(
                    target, torch.float32
                )
                yb = torch.from_numpy(np.ascontiguousarray(y[start : start + batch_size])).to(
                    target, torch.int64
                )
                logits = work(xb)
                loss_sum += _loss_total(task, work, logits, xb, yb)
                correct += int((logits.argmax(dim=1) == yb).sum())
    finally:
        work.train(was_training)
    return correct / n, loss_sum / n


def evaluate_sums(
    model: torch.nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    task: Task,
    device: torch.device | str = "cpu",
    batch_size: int = EVAL_BATCH_SIZE,
) -> MetricSums:
    """Every metric of ``task`` and its loss (as ``loss``) of ``model`` on ``(x, y)``,
    as sums that pool across batches and members. The caller's model is left as it was
    (device and mode), as by :func:`evaluate`.

    Raises:
        InvalidTask: the task's loss is not a 0-d floating tensor, or a metric returned
            a non-scalar or non-finite value.
    """
    target = torch.device(device)
    first = next(model.parameters(), None)
    work = model if first is None or first.device == target else copy.deepcopy(model).to(target)
    was_training = work.training
    work.eval()
    total: MetricSums | None = None
    try:
        with torch.no_grad():
            for start in range(0, len(y), batch_size):
                xb, yb = _batch(x, y, start, batch_size, target)
                batch = _batch_sums(task, work, xb, yb)
                total = batch if total is None else total + batch
    finally:
        work.train(was_training)
    return total if total is not None else MetricSums(records=0, sums={})


def evaluate_dataset(
    model: torch.nn.Module,
    data: TorchDataset[Any],
    task: Task,
    device: torch.device | str = "cpu",
    batch_size: int = EVAL_BATCH_SIZE,
) -> MetricSums:
    """:func:`evaluate_sums` over a torch dataset of ``(x, y)`` records, read a batch at
    a time (a member's held-out split: memory for one batch, whatever its size).

    Raises:
        InvalidTask: see :func:`evaluate_sums`.
    """
    target = torch.device(device)
    work = copy.deepcopy(model).to(target)
    work.eval()
    total: MetricSums | None = None
    with torch.no_grad():
        for xb, yb in DataLoader(data, batch_size=batch_size):
            batch = _batch_sums(task, work, xb.to(target, torch.float32), yb.to(target))
            total = batch if total is None else total + batch
    return total if total is not None else MetricSums(records=0, sums={})


def _batch_sums(
    task: Task, work: torch.nn.Module, xb: torch.Tensor, yb: torch.Tensor
) -> MetricSums:
    output = work(xb)
    sums = dict(task.metric_sums(output, yb))
    sums["loss"] = (_loss_total(task, work, output, xb, yb), float(len(yb)))
    return MetricSums(records=len(yb), sums=sums)


def _batch(
    x: np.ndarray, y: np.ndarray, start: int, size: int, target: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch as tensors: float32 features, targets as int64 class indices or float32
    values and labels, by their dtype."""
    xb = torch.from_numpy(np.ascontiguousarray(x[start : start + size])).to(target, torch.float32)
    dtype = torch.float32 if np.issubdtype(y.dtype, np.floating) else torch.int64
    yb = torch.from_numpy(np.ascontiguousarray(y[start : start + size])).to(target, dtype)
    return xb, yb


def _loss_total(
    task: Task | None,
    model: torch.nn.Module,
    logits: torch.Tensor,
    xb: torch.Tensor,
    yb: torch.Tensor,
) -> float:
    """The batch's loss summed over its records: the task's batch mean times the count,
    or for cross-entropy its exact sum (the value reported before tasks had a loss)."""
    if task is None or not task.own_loss:
        return float(F.cross_entropy(logits, yb, reduction="sum"))
    if task.batch_step is not None:
        return float(task.batch_loss(model, (xb, yb))) * len(yb)
    return float(checked_loss(task.name, task.loss(logits, yb))) * len(yb)
