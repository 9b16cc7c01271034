"""Split one dataset among simulated members: IID, or label-skewed by a Dirichlet prior.

Every partitioner returns a list of sorted int64 index arrays that together cover every
index exactly once, is deterministic for a given seed, and leaves no part empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from fedsec.errors import ConfigError

# Redrawing the Dirichlet proportions is how the usual benchmarks (e.g. NIID-Bench) meet a
# minimum part size; after this many tries we rebalance instead so small alphas terminate.
MAX_DIRICHLET_DRAWS = 100


def _check_counts(n_samples: int, n_parts: int, min_size: int) -> None:
    if n_parts < 1:
        raise ConfigError(f"number of parts must be >= 1, got {n_parts}")
    if min_size < 1:
        raise ConfigError(f"minimum part size must be >= 1, got {min_size}")
    if n_samples < n_parts * min_size:
        raise ConfigError(
            f"cannot split {n_samples} samples into {n_parts} parts of at least {min_size}"
        )


def partition_iid(n_samples: int, n_parts: int, seed: int) -> list[np.ndarray]:
    """Shuffle ``range(n_samples)`` and cut it into ``n_parts`` near-equal parts.

    Raises:
        ConfigError: fewer samples than parts, or ``n_parts < 1``.
    """
    _check_counts(n_samples, n_parts, 1)
    order = np.random.default_rng(seed).permutation(n_samples)
    return [np.sort(part).astype(np.int64) for part in np.array_split(order, n_parts)]


def partition_dirichlet(
    labels: np.ndarray, n_parts: int, alpha: float, seed: int, min_size: int = 1
) -> list[np.ndarray]:
    """Label-skewed split: each class is divided among parts with Dir(alpha) proportions.

    Small ``alpha`` (e.g. 0.1) gives each part a few dominant classes; large ``alpha``
    approaches an IID split.

    Args:
        labels: 1-D class labels of the whole dataset.
        n_parts: number of parts (simulated members).
        alpha: Dirichlet concentration, > 0.
        seed: seed of the split.
        min_size: smallest allowed part. Proportions are redrawn up to
            ``MAX_DIRICHLET_DRAWS`` times; after that, samples move from the largest parts
            to the short ones, which keeps the skew but guarantees the minimum.

    Raises:
        ConfigError: ``alpha <= 0`` or too few samples for ``n_parts * min_size``.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ConfigError(f"labels must be 1-D, got shape {labels.shape}")
    if not (alpha > 0 and np.isfinite(alpha)):
        raise ConfigError(f"Dirichlet alpha must be a positive finite number, got {alpha}")
    n_samples = int(labels.shape[0])
    _check_counts(n_samples, n_parts, min_size)
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)

    parts: list[list[int]] = []
    for _ in range(MAX_DIRICHLET_DRAWS):
        parts = [[] for _ in range(n_parts)]
        for cls in classes:
            members = rng.permutation(np.flatnonzero(labels == cls))
            proportions = rng.dirichlet(np.full(n_parts, alpha))
            cuts = (np.cumsum(proportions)[:-1] * len(members)).astype(np.int64)
            for part, chunk in zip(parts, np.split(members, cuts), strict=True):
                part.extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            break
    else:
        _rebalance(parts, min_size, rng)
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def _rebalance(parts: list[list[int]], min_size: int, rng: np.random.Generator) -> None:
    """Move random samples from the largest part to each short part until all reach min."""
    for short in sorted(range(len(parts)), key=lambda i: len(parts[i])):
        while len(parts[short]) < min_size:
            donor = max(range(len(parts)), key=lambda i: len(parts[i]))
            pick = int(rng.integers(len(parts[donor])))
            parts[short].append(parts[donor].pop(pick))


@dataclass(frozen=True)
class PartitionSpec:
    """A parsed partition description such as ``iid`` or ``dirichlet:0.5``."""

    kind: Literal["iid", "dirichlet"]
    alpha: float | None = None

    def apply(
        self, labels: np.ndarray, n_parts: int, seed: int, min_size: int = 1
    ) -> list[np.ndarray]:
        """Partition a dataset with these ``labels`` into ``n_parts`` index arrays."""
        if self.kind == "iid":
            return partition_iid(len(labels), n_parts, seed)
        assert self.alpha is not None  # guaranteed by parse_partition
        return partition_dirichlet(labels, n_parts, self.alpha, seed, min_size=min_size)

    def __str__(self) -> str:
        return "iid" if self.kind == "iid" else f"dirichlet:{self.alpha:g}"


def parse_partition(text: str) -> PartitionSpec:
    """Parse ``"iid"`` or ``"dirichlet:<alpha>"`` (alpha > 0).

    Raises:
        ConfigError: any other text, naming the accepted forms.
    """
    spec = text.strip().lower()
    if spec == "iid":
        return PartitionSpec("iid")
    kind, sep, value = spec.partition(":")
    if kind == "dirichlet" and sep:
        try:
            alpha = float(value)
        except ValueError:
            alpha = float("nan")
        if alpha > 0 and np.isfinite(alpha):
            return PartitionSpec("dirichlet", alpha)
    raise ConfigError(
        f"partition {text!r} is not understood; use 'iid' or 'dirichlet:<alpha>' with alpha > 0"
    )
