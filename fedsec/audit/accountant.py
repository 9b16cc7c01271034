"""An independent privacy accountant, for checking what members report.

Members account with Opacus' RDP accountant (closed-form series).  The auditor
recomputes the Rényi divergence of the Poisson-subsampled Gaussian mechanism by
direct numerical integration instead (Mironov, Talwar, Zhang 2019, eq. for A_α):

    A_α = ∫ N(z; 0, σ²) · ((1 − q) + q · exp((2z − 1) / (2σ²)))^α dz
    ε_RDP(α) = log A_α / (α − 1)

composes it over every step of every round, and converts to (ε, δ) with the
same conversion (Balle et al. 2020, Thm 21) and the same order grid.

Members now spend the PRV bound (Opacus' PRV accountant, capped by RDP), which is
tighter; the auditor recomputes that one with a different implementation of a
different numerical method, Google's ``dp-accounting`` privacy-loss-distribution
accountant (:func:`pld_epsilon`).  A reported ε is consistent when it lies between the
tight value and the RDP value, each within 1%: a member that reports less than the
tight value under-reports its spending; one that reports more than RDP did not use its
logged parameters.  Members of earlier releases, which reported RDP, stay consistent.
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


def pld_epsilon(rounds: Iterable[tuple[float, float, int]], delta: float) -> float:
    """ε of ``rounds`` of (noise multiplier, sample rate, steps) by ``dp-accounting``'s
    PLD accountant (Poisson-subsampled Gaussian, composed numerically)."""
    merged: dict[tuple[float, float], int] = {}
    for sigma, q, steps in rounds:
        merged[(sigma, q)] = merged.get((sigma, q), 0) + steps
    return _pld(tuple(sorted((s, q, n) for (s, q), n in merged.items())), delta)


@lru_cache(maxsize=4096)
def _pld(merged: tuple[tuple[float, float, int], ...], delta: float) -> float:
    import dp_accounting

    events = [
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
        )
        for sigma, q, steps in merged
    ]
    pld = dp_accounting.pld.PLDAccountant()
    pld.compose(dp_accounting.ComposedDpEvent(events))
    return float(pld.get_epsilon(delta))


def epsilon_range(rounds: Iterable[tuple[float, float, int]], delta: float) -> tuple[float, float]:
    """(tight, RDP): the PLD ε (capped by RDP) and the RDP ε of ``rounds``; a member's
    reported ε is consistent when it lies between them (see the module doc)."""
    history = list(rounds)
    loose = epsilon(history, delta)
    return min(pld_epsilon(history, delta), loose), loose


def epsilon(rounds: Iterable[tuple[float, float, int]], delta: float) -> float:
    """RDP ε after composing ``rounds`` of (noise multiplier, sample rate, steps) at
    ``delta``."""
    total = np.zeros_like(ORDERS)
    for sigma, q, steps in rounds:
        total += rdp(q, sigma, steps)
    eps = total - (math.log(delta) + np.log(ORDERS)) / (ORDERS - 1) + np.log((ORDERS - 1) / ORDERS)
    return float(np.nanmin(eps))
