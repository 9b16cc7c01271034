"""A task's loss and metrics, and the checks that they keep their contract.

A metric is declared as a *sum over a batch's records* (``Metric.total``), not as a
mean: the value over any set of records is then ``sum of totals / record count``,
whatever the batching, so members can report counts and sums and the federation's
value is the weighted mean of theirs without any per-record output leaving a member.
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
    """

    total: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | float]
    higher_is_better: bool


def cross_entropy(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits ``output`` against class indices ``targets``."""
    return F.cross_entropy(output, targets)


def _correct(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (output.argmax(dim=1) == targets).sum()


def _cross_entropy_sum(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets, reduction="sum")


#: The metrics of a classification task: accuracy (primary) and cross-entropy.
CLASSIFICATION_METRICS: Mapping[str, Metric] = {
    "accuracy": Metric(total=_correct, higher_is_better=True),
    "cross_entropy": Metric(total=_cross_entropy_sum, higher_is_better=False),
}


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
