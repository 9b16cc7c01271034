"""Server optimisers: how the mean update Σw·Δ/Σw moves the global model.

FedAvg applies the mean update scaled by ``server_lr`` (1.0 = plain federated
averaging).  FedAdam (Reddi et al., "Adaptive Federated Optimization", 2021)
treats the mean update as a pseudo-gradient and keeps Adam moments on the
server; the moments are persisted in the state store after every round so a
restarted aggregator continues with the same optimiser state.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from fedsec.aggregator.state import StateStore
from fedsec.config import ServerSection


class ServerOptimizer(Protocol):
    def step(self, current: np.ndarray, mean_update: np.ndarray) -> np.ndarray: ...

    def save(self) -> None: ...


class FedAvg:
    def __init__(self, server_lr: float) -> None:
        self.server_lr = server_lr

    def step(self, current: np.ndarray, mean_update: np.ndarray) -> np.ndarray:
        return (current + np.float32(self.server_lr) * mean_update).astype(np.float32)

    def save(self) -> None:
        pass


class FedAdam:
    _M, _V = "fedadam.m", "fedadam.v"

    def __init__(self, cfg: ServerSection, dim: int, store: StateStore) -> None:
        self.lr, self.b1, self.b2, self.tau = (
            cfg.server_lr,
            cfg.adam_beta1,
            cfg.adam_beta2,
            cfg.adam_tau,
        )
        self._store = store
        m, v = store.get_value(self._M), store.get_value(self._V)
        ok = m is not None and v is not None and len(m) == len(v) == 4 * dim
        self.m = (
            np.frombuffer(m, dtype=np.float32).copy() if ok and m else np.zeros(dim, np.float32)
        )
        self.v = (
            np.frombuffer(v, dtype=np.float32).copy() if ok and v else np.zeros(dim, np.float32)
        )

    def step(self, current: np.ndarray, mean_update: np.ndarray) -> np.ndarray:
        self.m = (self.b1 * self.m + (1 - self.b1) * mean_update).astype(np.float32)
        self.v = (self.b2 * self.v + (1 - self.b2) * mean_update**2).astype(np.float32)
        return (current + self.lr * self.m / (np.sqrt(self.v) + self.tau)).astype(np.float32)

    def save(self) -> None:
        with self._store.transaction():
            self._store.put_value(self._M, self.m.tobytes())
            self._store.put_value(self._V, self.v.tobytes())


def make_optimizer(cfg: ServerSection, dim: int, store: StateStore) -> ServerOptimizer:
    if cfg.optimizer == "fedadam":
        return FedAdam(cfg, dim, store)
    return FedAvg(cfg.server_lr)
