"""Server optimisers: how the mean update Σw·Δ/Σw moves the global model.

FedAvg applies the mean update scaled by ``server_lr`` (1.0 = plain federated
averaging).  FedAdam (Reddi et al., "Adaptive Federated Optimization", 2021)
treats the mean update as a pseudo-gradient and keeps Adam moments on the server.

Pure functions of (parameters, mean update, optimiser state) → (new parameters,
new state): the aggregator persists the state between rounds
(:mod:`fedsec.aggregator.optimizers`) and the auditor carries it along the log
(:mod:`fedsec.audit.verify`).  Both call :func:`server_step`, so a re-derived model
version is bit for bit the published one.  Every result is float32, computed in the
order below; changing that order changes every model hash.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = [
    "AdamMoments",
    "FedAdam",
    "FedAvg",
    "ServerRule",
    "fedadam_step",
    "fedavg_step",
    "server_rule",
    "server_step",
]

Params = npt.NDArray[np.float32]


@dataclass(frozen=True)
class FedAvg:
    """Federated averaging with a server learning rate."""

    server_lr: float


@dataclass(frozen=True)
class FedAdam:
    """FedAdam's settings: server learning rate, moment decays and adaptivity ``tau``."""

    server_lr: float
    beta1: float
    beta2: float
    tau: float


ServerRule = FedAvg | FedAdam


@dataclass(frozen=True)
class AdamMoments:
    """FedAdam's state: first and second moments, float32, one per parameter."""

    m: Params
    v: Params

    @classmethod
    def zeros(cls, dim: int) -> AdamMoments:
        """The state before the first round."""
        return cls(np.zeros(dim, np.float32), np.zeros(dim, np.float32))


def server_rule(
    optimizer: str, server_lr: float, beta1: float, beta2: float, tau: float
) -> ServerRule:
    """The rule named ``optimizer`` (``"fedadam"``; anything else is FedAvg, as configured)."""
    if optimizer == "fedadam":
        return FedAdam(server_lr, beta1, beta2, tau)
    return FedAvg(server_lr)


def fedavg_step(params: Params, mean_update: Params, server_lr: float) -> Params:
    """``params + server_lr · mean_update`` in float32."""
    return (params + np.float32(server_lr) * mean_update).astype(np.float32)


def fedadam_step(
    params: Params, mean_update: Params, moments: AdamMoments, rule: FedAdam
) -> tuple[Params, AdamMoments]:
    """One FedAdam step; returns the new parameters and the new moments.

    Raises:
        ValueError: the moments do not have one entry per parameter.
    """
    if moments.m.shape != params.shape or moments.v.shape != params.shape:
        raise ValueError(
            f"FedAdam moments of shape {moments.m.shape} for {params.shape} parameters"
        )
    b1, b2 = rule.beta1, rule.beta2
    m = (b1 * moments.m + (1 - b1) * mean_update).astype(np.float32)
    v = (b2 * moments.v + (1 - b2) * mean_update**2).astype(np.float32)
    new = (params + rule.server_lr * m / (np.sqrt(v) + rule.tau)).astype(np.float32)
    return new, AdamMoments(m, v)


def server_step(
    rule: ServerRule, params: Params, mean_update: Params, state: AdamMoments | None
) -> tuple[Params, AdamMoments | None]:
    """Apply ``rule`` to ``params``; returns the new parameters and the new state.

    Args:
        rule: the server optimiser and its settings.
        params: the global model's flat float32 parameters.
        mean_update: Σw·Δ/Σw, float32, one entry per parameter.
        state: FedAdam's moments from the previous round (None before the first
            one); FedAvg keeps no state and returns ``state`` unchanged.
    """
    if isinstance(rule, FedAdam):
        return fedadam_step(params, mean_update, state or AdamMoments.zeros(len(params)), rule)
    return fedavg_step(params, mean_update, rule.server_lr), state
