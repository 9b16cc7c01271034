"""A task's local-training defaults: the optimiser settings of one round."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from fedsec.errors import ConfigError

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
