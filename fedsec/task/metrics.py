"""A task's loss and metrics, and the checks that they keep their contract.

A metric is declared as a *sum over a batch's records* (``Metric.total``), not as a
mean: the value over any set of records is then ``sum of totals / record count``,
whatever the batching, so members can report counts and sums and the federation's
value is the weighted mean of theirs without any per-record output leaving a member.
A ratio of two sums (micro-F1: ``2TP / (2TP + FP + FN)``) declares its denominator's
sum as ``Metric.weight``; the value is then ``sum of totals / sum of weights``, which
pools across batches and members just as exactly.

Three families are bundled: classification (cross-entropy on class indices),
regression (mean squared error; MAE, MSE and R²) and multi-label (binary
cross-entropy on logits; micro-F1, subset and label accuracy).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from fedsec.errors import InvalidTask

#: ``(model output, targets) -> loss``: a 0-d tensor, the batch mean (what DP-SGD's
#: per-sample clipping expects: Opacus scales by the expected batch size).
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: ``(model, batch) -> loss`` for models whose forward needs more than ``(x, y)``;
#: ``batch`` is whatever the task's datasets yield, collated by a DataLoader.
BatchStep = Callable[[torch.nn.Module, Any], torch.Tensor]


@dataclass(frozen=True)
class Metric:
    """One metric: the sum of its per-record values over a batch, and its direction.

    ``total(output, targets)`` returns a number or a 0-d tensor: the *sum* over the
    batch's records (accuracy: the count of correct predictions), so a mean over any
    batching is ``sum(total) / records``.

    ``weight`` is a ratio's denominator, summed the same way; each record adds at most 1
    to it (micro-F1 divides both sums by twice the label count), so a member's weights
    never exceed its record count. ``bounds`` is the range of the metric's value (its
    total over its weight): a federation refuses a member's report outside it.
    """

    total: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | float]
    higher_is_better: bool
    #: the denominator's sum over the batch for a ratio of sums; None: the record count
    weight: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | float] | None = None
    bounds: tuple[float, float] = (-math.inf, math.inf)


def cross_entropy(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits ``output`` against class indices ``targets``."""
    return F.cross_entropy(output, targets)


def _correct(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (output.argmax(dim=1) == targets).sum()


def _cross_entropy_sum(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets, reduction="sum")


#: The metrics of a classification task: accuracy (primary) and cross-entropy.
CLASSIFICATION_METRICS: Mapping[str, Metric] = {
    "accuracy": Metric(total=_correct, higher_is_better=True, bounds=(0.0, 1.0)),
    "cross_entropy": Metric(
        total=_cross_entropy_sum, higher_is_better=False, bounds=(0.0, math.inf)
    ),
}


def mean_squared_error(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error of ``output`` against real-valued ``targets`` of the same shape."""
    return F.mse_loss(output, targets)


def binary_cross_entropy(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean binary cross-entropy of logits ``output`` against 0/1 ``targets`` (one
    column per label), computed from the logits for numerical stability."""
    return F.binary_cross_entropy_with_logits(output, targets)


def _per_record(values: torch.Tensor) -> torch.Tensor:
    """Each record's mean over its output columns: ``(n, k) -> (n,)``."""
    return values.reshape(len(values), -1).mean(dim=1)


def regression_metrics(target_variance: float = 1.0) -> Mapping[str, Metric]:
    """MAE, MSE and R² of a regression task.

    R² is ``1 - MSE / target_variance`` with the variance *declared* by the task (the
    training targets' variance: 1 for targets standardised on the training split), not
    the evaluated set's own: the set's variance needs its mean before its sum, so it
    is no sum of per-record values, and members could not pool it without a second
    round trip. Against a fixed variance each record contributes ``1 - se / var``.

    Raises:
        InvalidTask: ``target_variance`` is not a positive finite number.
    """
    if not (target_variance > 0 and math.isfinite(target_variance)):
        raise InvalidTask(f"target_variance must be positive and finite, got {target_variance}")

    def absolute(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return _per_record((output - targets).abs()).sum()

    def squared(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return _per_record((output - targets) ** 2).sum()

    def explained(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return (1.0 - _per_record((output - targets) ** 2) / target_variance).sum()

    return {
        "mae": Metric(total=absolute, higher_is_better=False, bounds=(0.0, math.inf)),
        "mse": Metric(total=squared, higher_is_better=False, bounds=(0.0, math.inf)),
        "r2": Metric(total=explained, higher_is_better=True, bounds=(-math.inf, 1.0)),
    }


def _predicted(output: torch.Tensor) -> torch.Tensor:
    return output > 0  # logit > 0 is probability > 1/2


# micro-F1 = 2TP / (2TP + FP + FN), both sums divided by twice the label count so that
# a record adds at most 1 to the denominator (see Metric)
def _true_positives_share(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return 2 * (_predicted(output) & (targets > 0.5)).sum() / (2 * output.shape[1])


def _f1_denominator(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # 2TP + FP + FN = predicted positives + actual positives
    positives = _predicted(output).sum() + (targets > 0.5).sum()
    return positives / (2 * output.shape[1])


def _subset_correct(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (_predicted(output) == (targets > 0.5)).all(dim=1).sum()


def _label_correct(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return _per_record((_predicted(output) == (targets > 0.5)).float()).sum()


def _bce_sum(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    bce = F.binary_cross_entropy_with_logits(output, targets, reduction="none")
    return _per_record(bce).sum()


#: The metrics of a multi-label task: micro-F1 over all labels (a ratio of sums),
#: subset accuracy (every label of a record right), label accuracy (1 - Hamming loss)
#: and binary cross-entropy.
MULTILABEL_METRICS: Mapping[str, Metric] = {
    "micro_f1": Metric(
        total=_true_positives_share,
        higher_is_better=True,
        weight=_f1_denominator,
        bounds=(0.0, 1.0),
    ),
    "subset_accuracy": Metric(total=_subset_correct, higher_is_better=True, bounds=(0.0, 1.0)),
    "label_accuracy": Metric(total=_label_correct, higher_is_better=True, bounds=(0.0, 1.0)),
    "bce": Metric(total=_bce_sum, higher_is_better=False, bounds=(0.0, math.inf)),
}


@dataclass(frozen=True)
class MetricSums:
    """A model's metrics over some records as sums: ``records``, and per metric its
    ``(total, weight)`` (the loss included, as ``loss``, weighted by records).

    Sums pool exactly: the sums over two sets of records are the sums of each, so a
    federation's value is the weighted mean of its members' without any per-record
    output leaving a member.
    """

    records: int
    sums: Mapping[str, tuple[float, float]]

    def values(self) -> dict[str, float]:
        """Each metric's value, ``total / weight``; a metric whose weight is 0 (micro-F1
        with no positive label predicted or present) has no value and is left out."""
        return {name: t / w for name, (t, w) in sorted(self.sums.items()) if w > 0}

    def __add__(self, other: MetricSums) -> MetricSums:
        """The sums over both sets of records.

        Raises:
            InvalidTask: the two name different metrics.
        """
        if set(self.sums) != set(other.sums):
            raise InvalidTask(f"cannot pool metrics {sorted(self.sums)} with {sorted(other.sums)}")
        return MetricSums(
            records=self.records + other.records,
            sums={
                name: (t + other.sums[name][0], w + other.sums[name][1])
                for name, (t, w) in self.sums.items()
            },
        )


def checked_loss(task_name: str, loss: Any) -> torch.Tensor:
    """``loss`` if it is a 0-d floating tensor, the form back-propagation and DP-SGD need.

    Raises:
        InvalidTask: ``loss`` is not a tensor, not 0-d, or not floating point; the
            message says what was returned and how to reduce it.
    """
    if not isinstance(loss, torch.Tensor):
        raise InvalidTask(
            f"task '{task_name}' loss returned {type(loss).__name__}, expected a 0-d tensor"
        )
    if loss.dim() != 0:
        raise InvalidTask(
            f"task '{task_name}' loss returned a tensor of shape {tuple(loss.shape)}, "
            "expected a scalar (0-d) tensor: reduce it over the batch, e.g. with .mean()"
        )
    if not loss.is_floating_point():
        raise InvalidTask(
            f"task '{task_name}' loss has dtype {loss.dtype}, expected floating point"
        )
    return loss


def metric_total(task_name: str, metric_name: str, value: torch.Tensor | float) -> float:
    """A metric's batch total as a finite float.

    Raises:
        InvalidTask: the total is not a number or 0-d tensor, or is not finite.
    """
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise InvalidTask(
                f"task '{task_name}' metric '{metric_name}' returned shape "
                f"{tuple(value.shape)}, expected the batch's sum as a scalar"
            )
        value = float(value.detach())
    if not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidTask(
            f"task '{task_name}' metric '{metric_name}' returned {value!r}, "
            "expected a finite number"
        )
    return float(value)
