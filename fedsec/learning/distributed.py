"""Record-level distributed DP-SGD: each member's share of one DP-SGD step.

In distributed DP at record level, a round is exactly one step of DP-SGD over the union
of the members' records (Kairouz, Liu, Steinke 2021, §5):

- each member Poisson-samples its records with the round's rate q
  (:func:`poisson_sample`), clips every per-sample gradient to C with Opacus' grad
  sampler and sums them (:func:`clipped_gradient_sum`);
- it discretises that sum and adds its share of the noise
  (:func:`fedsec.crypto.discretize.encode`); SecAgg+ sums the shares;
- the model holder divides the decoded sum Σ clip(g) + N(0, σ²C²) by the expected batch
  q·N of the union and hands it to the optimiser as the gradient
  (:func:`apply_gradient_sum`), which is what Opacus' ``DPOptimizer`` does centrally.

Since every record is sampled independently with rate q whichever member holds it, the
union batch is a Poisson sample of the union with rate q, and the privacy cost per
record is that of central DP-SGD with (q, σ, steps = rounds).

One local step per round is what this supports, on purpose: with several local steps
the second step's gradient depends on the first step's noise-free local update, which
the analysis above does not cover (the members would have to add noise at each local
step, i.e. run local DP).
"""

from __future__ import annotations

import copy
import hashlib
import math
import os
import warnings

import numpy as np
import torch
from opacus import GradSampleModule
from torch.nn import functional as F

from fedsec.errors import ConfigError
from fedsec.task.definition import Task, as_targets


def poisson_sample(n: int, rate: float, seed: bytes | None = None) -> np.ndarray:
    """Which of ``n`` records join this step: each independently with probability
    ``rate``.

    The draw is a secret of the member (privacy amplification by sampling assumes nobody
    knows which records were used): by default from the OS CSPRNG; a ``seed`` expands
    through SHAKE-256 for reproducible simulations and tests.

    Raises:
        ConfigError: ``rate`` outside (0, 1] or ``n`` negative.
    """
    if not 0.0 < rate <= 1.0:
        raise ConfigError(f"sampling rate must be in (0, 1], got {rate}")
    if n < 0:
        raise ConfigError(f"record count must be non-negative, got {n}")
    raw = hashlib.shake_256(seed).digest(8 * n) if seed is not None else os.urandom(8 * n)
    words = np.frombuffer(raw, dtype="<u8") >> np.uint64(11)
    return words.astype(np.float64) * (1.0 / (1 << 53)) < rate


def clipped_gradient_sum(
    model: torch.nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    include: np.ndarray,
    max_grad_norm: float,
    device: torch.device | str = "cpu",
    task: Task | None = None,
) -> tuple[np.ndarray, int]:
    """Σ over the included records of their per-sample gradients, each clipped to L2
    norm ``max_grad_norm`` (over all parameters together, as Opacus does).

    Args:
        model: the current model; not modified (a copy gets the grad sampler's hooks).
        x, y: the member's records.
        include: boolean mask of the records in this step (:func:`poisson_sample`).
        max_grad_norm: C.
        device: where to compute.
        task: whose loss (batch mean, or its ``batch_step``) the gradients are of;
            None: cross-entropy.

    Returns:
        (the flat float64 sum in ``model.parameters()`` order, the number of records).

    Raises:
        ConfigError: mismatched lengths or a non-positive clip norm.
        InvalidTask: the task's loss is not a 0-d floating tensor.
    """
    if not (len(x) == len(y) == len(include)):
        raise ConfigError(f"x, y and include differ in length: {len(x)}, {len(y)}, {len(include)}")
    if not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
        raise ConfigError(f"clip norm must be a positive number, got {max_grad_norm}")
    dim = sum(p.numel() for p in model.parameters())
    rows = np.flatnonzero(include)
    if rows.size == 0:
        return np.zeros(dim), 0
    target = torch.device(device)
    xb = torch.from_numpy(np.ascontiguousarray(x[rows], dtype=np.float32)).to(target)
    yb = torch.from_numpy(as_targets(y[rows])).to(target)
    per_sample = _per_sample_gradients(copy.deepcopy(model).to(target), xb, yb, task)
    norms = per_sample.norm(dim=1, keepdim=True)
    factors = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)  # Opacus' clipping rule
    return (per_sample * factors).sum(dim=0).cpu().numpy(), int(rows.size)


def _per_sample_gradients(
    work: torch.nn.Module, xb: torch.Tensor, yb: torch.Tensor, task: Task | None
) -> torch.Tensor:
    """Each record's gradient of the loss, one float64 row per record."""
    # Cross-entropy is summed, as before tasks had a loss (the bundled tasks' updates
    # stay bit-identical); a task's own loss is its batch mean, which Opacus' grad
    # sampler scales back to per-sample gradients (loss_reduction="mean").
    own = task is not None and task.own_loss
    sampled = GradSampleModule(work, loss_reduction="mean" if own else "sum")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            loss = (
                task.batch_loss(sampled, (xb, yb))
                if own and task is not None
                else F.cross_entropy(sampled(xb), yb, reduction="sum")
            )
            torch.autograd.backward(loss)
        return torch.cat(
            [p.grad_sample.reshape(len(yb), -1) for p in sampled.parameters()], dim=1
        ).double()
    finally:
        sampled.remove_hooks()


def apply_gradient_sum(
    model: torch.nn.Module,
    gradient_sum: np.ndarray,
    expected_batch: float,
    optimizer: torch.optim.Optimizer,
) -> None:
    """One optimiser step with gradient ``gradient_sum / expected_batch`` (the decoded
    noisy sum over the union divided by q·N, as Opacus' DP optimiser scales).

    Raises:
        ConfigError: wrong length, non-finite values or a non-positive batch.
    """
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    flat = np.asarray(gradient_sum, dtype=np.float64).reshape(-1)
    if flat.size != total:
        raise ConfigError(f"gradient has {flat.size} values, the model {total}")
    if not (expected_batch > 0 and np.all(np.isfinite(flat))):
        raise ConfigError("gradient must be finite and the expected batch positive")
    offset = 0
    for p in params:
        chunk = flat[offset : offset + p.numel()] / expected_batch
        p.grad = torch.from_numpy(chunk.reshape(p.shape)).to(p.dtype).to(p.device)
        offset += p.numel()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
