"""FLTrust's reference update: the aggregator's own training, each round, on a small
root dataset it holds (Cao et al. 2021), with the same training code members run.

The root dataset is drawn from the task's training split, so it never overlaps the
test split the aggregator validates on.  The reference is trained without DP (the data
is the aggregator's own), from a seed derived from the round's, so a restarted
aggregator trains the same one, and clipped to the round's clip norm like every
member's update, so the aggregate it scales cannot outgrow what members may send.
"""

from __future__ import annotations

import copy
import hashlib

import numpy as np
import numpy.typing as npt
import torch

from fedsec.errors import ConfigError
from fedsec.learning.training import TrainingParams, train_local
from fedsec.tasks.base import Dataset, Task
from fedsec.tasks.params import flatten_params

# The root records are a fixed draw, whatever the round: one dataset the aggregator
# holds, as in FLTrust, not a fresh sample per round.
_ROOT_DRAW = b"fedsec/fltrust-root"


def root_dataset(data: Dataset, records: int) -> tuple[np.ndarray, np.ndarray]:
    """``records`` records drawn once from ``data``'s training split (disjoint from its
    test split, which the aggregator validates on).

    Raises:
        ConfigError: the training split holds fewer than ``records``.
    """
    n = len(data.y_train)
    if not 1 <= records <= n:
        raise ConfigError(
            f"aggregation.root_records: expected an integer in 1..{n} (the task's training "
            f"records), got {records}"
        )
    seed = int.from_bytes(hashlib.sha256(_ROOT_DRAW).digest()[:8], "big")
    chosen = np.sort(np.random.default_rng(seed).choice(n, size=records, replace=False))
    return data.x_train[chosen], data.y_train[chosen]


def reference_seed(round_seed: str) -> int:
    """The training seed of a round's reference, from the spec's hex seed."""
    return (
        int.from_bytes(hashlib.sha256(b"fltrust/" + bytes.fromhex(round_seed)).digest()[:8], "big")
        >> 1
    )


def reference_update(
    model: torch.nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    params: TrainingParams,
    clip_norm: float,
    seed: int,
    task: Task | None = None,
) -> npt.NDArray[np.float64]:
    """Train a copy of ``model`` (the round's global model) on the root dataset and
    return its update Δ₀ = trained − global, clipped to ``clip_norm``.

    Args:
        model: the global model the round trains from; not modified.
        x, y: the root dataset.
        params: the round's training settings.
        clip_norm: the round's L2 bound on every update.
        seed: batch sampling seed (:func:`reference_seed`).
        task: whose loss the reference minimises, as members do; None: cross-entropy.

    Raises:
        ConfigError: empty or mismatched data.
        InvalidTask: the task's loss is not a 0-d batch mean.
    """
    work = copy.deepcopy(model)
    before = flatten_params(work).astype(np.float64)
    train_local(work, x, y, params, None, "cpu", seed, task=task)
    delta = flatten_params(work).astype(np.float64) - before
    norm = float(np.sqrt(np.einsum("i,i->", delta, delta)))
    if norm > clip_norm:
        delta *= clip_norm / norm
    return delta
