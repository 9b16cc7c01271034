"""The aggregator's server optimiser: :mod:`fedsec.learning.optimizers` plus durable state.

The arithmetic is :func:`fedsec.learning.optimizers.server_step`, the function the
auditor re-derives model versions with.  What is the aggregator's own is keeping
FedAdam's moments in the state store after every round (``save``, inside the round
close's transaction), so a restarted aggregator continues with the same optimiser
state; stored moments of another dimension (a different model) are ignored and the
moments start from zero.
"""

from __future__ import annotations

import numpy as np

from fedsec.aggregator.storage import StateStore
from fedsec.config import ServerSection
from fedsec.learning.optimizers import AdamMoments, FedAdam, ServerRule, server_rule, server_step

__all__ = ["ServerOptimizer", "make_optimizer"]

# State-store keys of FedAdam's moments (raw little-endian float32): written by every
# release so far, so a restarted aggregator of a newer release resumes them.
_M, _V = "fedadam.m", "fedadam.v"


class ServerOptimizer:
    """A server rule and its state, persisted in the aggregator's state store."""

    def __init__(self, rule: ServerRule, dim: int, store: StateStore) -> None:
        self.rule = rule
        self._store = store
        self.state: AdamMoments | None = None
        if isinstance(rule, FedAdam):
            self.state = _stored_moments(store, dim) or AdamMoments.zeros(dim)

    def step(self, current: np.ndarray, mean_update: np.ndarray) -> np.ndarray:
        """The new global parameters; the new state is kept for :meth:`save`."""
        new, self.state = server_step(self.rule, current, mean_update, self.state)
        return new

    def save(self) -> None:
        """Persist the state (FedAdam's moments; FedAvg has none)."""
        if self.state is None:
            return
        with self._store.transaction():
            self._store.values.put(_M, self.state.m.tobytes())
            self._store.values.put(_V, self.state.v.tobytes())


def _stored_moments(store: StateStore, dim: int) -> AdamMoments | None:
    m, v = store.values.get(_M), store.values.get(_V)
    if not m or not v or not len(m) == len(v) == 4 * dim:
        return None
    return AdamMoments(
        np.frombuffer(m, dtype=np.float32).copy(), np.frombuffer(v, dtype=np.float32).copy()
    )


def make_optimizer(cfg: ServerSection, dim: int, store: StateStore) -> ServerOptimizer:
    """The configured server optimiser, resuming any state stored by an earlier run."""
    rule = server_rule(cfg.optimizer, cfg.server_lr, cfg.adam_beta1, cfg.adam_beta2, cfg.adam_tau)
    return ServerOptimizer(rule, dim, store)
