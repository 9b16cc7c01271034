"""An independent privacy accountant, for checking what members report.

Members account with Opacus' RDP accountant (closed-form series).  The auditor
recomputes the Rényi divergence of the Poisson-subsampled Gaussian mechanism by
direct numerical integration instead (Mironov, Talwar, Zhang 2019, eq. for A_α):

    A_α = ∫ N(z; 0, σ²) · ((1 − q) + q · exp((2z − 1) / (2σ²)))^α dz
    ε_RDP(α) = log A_α / (α − 1)

composes it over every step of every round, and converts to (ε, δ) with the
same conversion (Balle et al. 2020, Thm 21) and the same order grid.  Agreement
within 1% means the member's numbers come from the parameters it logged.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import lru_cache

import numpy as np

ORDERS = np.array([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)), dtype=np.float64)


def _log_a(q: float, sigma: float, alpha: float) -> float:
    if q == 0:
        return 0.0
    if q == 1.0:
        return alpha * (alpha - 1) / (2 * sigma**2)
    lo = -40.0 * sigma - 2.0
    hi = alpha + 40.0 * sigma + 2.0
    z = np.linspace(lo, hi, 20_001)  # trapezoid error ~1e-9 relative on this grid
    log_mu0 = -(z**2) / (2 * sigma**2) - math.log(sigma * math.sqrt(2 * math.pi))
    ratio = np.logaddexp(math.log1p(-q), math.log(q) + (2 * z - 1) / (2 * sigma**2))
    log_f = log_mu0 + alpha * ratio
    peak = float(log_f.max())
    return peak + math.log(float(np.trapezoid(np.exp(log_f - peak), z)))


@lru_cache(maxsize=256)
def _rdp_step(q: float, sigma: float) -> tuple[float, ...]:
    return tuple(_log_a(q, sigma, float(a)) / (a - 1) for a in ORDERS)


def rdp(q: float, sigma: float, steps: int) -> np.ndarray:
    """RDP at :data:`ORDERS` of ``steps`` steps with sampling rate q and noise σ."""
    return np.array(_rdp_step(q, sigma)) * steps


def epsilon(rounds: Iterable[tuple[float, float, int]], delta: float) -> float:
    """ε after composing ``rounds`` of (noise multiplier, sample rate, steps) at ``delta``."""
    total = np.zeros_like(ORDERS)
    for sigma, q, steps in rounds:
        total += rdp(q, sigma, steps)
    eps = total - (math.log(delta) + np.log(ORDERS)) / (ORDERS - 1) + np.log((ORDERS - 1) / ORDERS)
    return float(np.nanmin(eps))
