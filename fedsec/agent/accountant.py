"""The privacy accountant: ε of a history of DP-SGD rounds, and the noise that makes a
budget last.

Accountant: Opacus' PRV accountant (Gopi, Lee, Wutschitz 2021), which composes the
privacy-loss distributions numerically and reports an upper bound within
``PRV_RELATIVE_ERROR`` of the true ε; RDP (Mironov 2017) is kept as a cross-check and a
cap.  Both bound the same mechanism from above, so the ledger spends the smaller: PRV in
every regime that matters (e.g. q = 0.25, σ = 2.3, 200 steps, δ = 1e-5: PRV 7.93, RDP
8.6), RDP only where PRV's absolute error floor is larger than ε itself (noise so large
that nothing is spent).  The same holds in local and distributed DP: the mechanism per
step is the subsampled Gaussian with noise multiplier z either way; what differs is who
adds the noise (see docs/privacy.md).

Pure functions of their arguments (cached per process); the durable record of what was
spent is :mod:`fedsec.agent.ledger`'s.
"""

from __future__ import annotations

import math
import warnings
from functools import lru_cache

import numpy as np
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.analysis import rdp as privacy_analysis
from opacus.accountants.utils import get_noise_multiplier

from fedsec.errors import ConfigError

# get_noise_multiplier stops once its epsilon is within this distance below the target;
# 0.01 is Opacus' default, fine against budgets of order 1-10.
NOISE_SEARCH_TOLERANCE = 0.01
# noise_for_budget: PRV never needs less than this fraction of RDP's noise at budgets
# people set (0.9 measured for eps 1-8); the bisection stops within 1 % of the noise.
NOISE_BISECTION_FLOOR = 0.75
NOISE_BISECTION_RTOL = 0.01
# PRV's ε is an upper bound whose error is fixed in absolute terms (eps_error); 0.1 % of ε
# keeps the ledger within the audit's 1 % agreement at every budget.  A first pass at
# 0.01 (Opacus' default, ~0.2 s for 200 steps) sizes the second.
PRV_RELATIVE_ERROR = 1e-3
PRV_COARSE_ERROR = 0.01
# Below ε = 0.1 the coarse bound (conservative by at most 0.01) is kept: refining costs
# ~0.4 s per history there, e.g. for the placeholder noise of a simulation without DP.
PRV_REFINE_ABOVE = 0.1


@lru_cache(maxsize=1024)
def _rdp_curve(noise_multiplier: float, sample_rate: float) -> tuple[float, ...]:
    """RDP of one step at Opacus' default orders; RDP composes linearly in steps."""
    return tuple(
        float(v)
        for v in privacy_analysis.compute_rdp(
            q=sample_rate,
            noise_multiplier=noise_multiplier,
            steps=1,
            orders=RDPAccountant.DEFAULT_ALPHAS,
        )
    )


def epsilon_of(history: list[tuple[float, float, int]], delta: float) -> float:
    """ε of a history of (noise multiplier, sample rate, steps): the smaller of PRV and
    RDP (see the module doc).

    Steps with the same (noise, sample rate) are merged first, and the answer is cached
    per merged history, so fifty agents of one simulation sharing a history pay once.
    """
    if not history:
        return 0.0
    steps: dict[tuple[float, float], int] = {}
    for noise, rate, n in history:
        steps[(noise, rate)] = steps.get((noise, rate), 0) + n
    merged = tuple(sorted((noise, rate, n) for (noise, rate), n in steps.items()))
    return min(_prv_epsilon(merged, delta), rdp_epsilon(history, delta))


@lru_cache(maxsize=4096)
def _prv_epsilon(
    merged: tuple[tuple[float, float, int], ...], delta: float, coarse: bool = False
) -> float:
    """PRV ε of ``merged`` (noise, rate, steps) entries; ∞ where PRV cannot answer.
    ``coarse``: the first pass only (an upper bound within PRV_COARSE_ERROR)."""
    accountant = PRVAccountant()
    accountant.history = list(merged)
    with warnings.catch_warnings():
        # PRV sizes its mesh with an RDP bound, which warns for heavy noise (see below)
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
        warnings.filterwarnings("ignore", message="divide by zero encountered in log")  # q = 1
        try:
            first = accountant.get_epsilon(delta, eps_error=PRV_COARSE_ERROR)
            error = PRV_RELATIVE_ERROR * first
            if coarse or first < PRV_REFINE_ABOVE or error >= PRV_COARSE_ERROR:
                return float(first)
            return float(accountant.get_epsilon(delta, eps_error=error))
        except (ValueError, RuntimeError, FloatingPointError, OverflowError):
            # PRV's mesh cannot represent the loss distribution (e.g. noise so large
            # that nothing is spent): RDP alone decides.
            return math.inf


def rdp_epsilon(history: list[tuple[float, float, int]], delta: float) -> float:
    """ε of the whole history with Opacus' RDP analysis alone (the cross-check, ≥ PRV).

    Steps with the same (noise, sample rate) are added up and each curve is computed
    once per process: a ledger of hundreds of rounds costs microseconds, not the
    seconds Opacus' accountant takes to re-derive every round each time.
    """
    if not history:
        return 0.0
    steps: dict[tuple[float, float], int] = {}
    for noise, rate, n in history:
        steps[(noise, rate)] = steps.get((noise, rate), 0) + n
    total = np.zeros(len(RDPAccountant.DEFAULT_ALPHAS))
    for (noise, rate), n in steps.items():
        total += n * np.asarray(_rdp_curve(noise, rate))
    with warnings.catch_warnings():
        # For heavy noise the best RDP order is the largest default one, so the bound is
        # slightly loose, i.e. conservative; the default orders keep the ledger equal to
        # what Opacus reports per round.
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
        eps, _ = privacy_analysis.get_privacy_spent(
            orders=RDPAccountant.DEFAULT_ALPHAS, rdp=total, delta=delta
        )
    return float(eps)


def validate_round(noise_multiplier: float, sample_rate: float, steps: int) -> None:
    if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
        raise ConfigError(f"noise_multiplier must be positive and finite, got {noise_multiplier}")
    if not 0.0 < sample_rate <= 1.0:
        raise ConfigError(f"sample_rate must be in (0, 1], got {sample_rate}")
    if steps < 1:
        raise ConfigError(f"steps must be >= 1, got {steps}")


def noise_for_budget(
    target_epsilon: float, delta: float, sample_rate: float, steps_per_round: int, rounds: int
) -> float:
    """The smallest noise multiplier (within tolerance) that lasts ``rounds`` rounds.

    Composing ``rounds`` identical rounds of ``steps_per_round`` steps is the same as one
    run of ``rounds * steps_per_round`` steps.  Opacus' RDP search gives a noise that
    surely lasts (RDP ≥ the ledger's ε); a bisection on the ledger's own ε then lowers it
    to within NOISE_BISECTION_RTOL, never below what the budget allows.  (Opacus' PRV
    search probes tiny noise levels where one PRV evaluation takes seconds; bracketing
    with RDP keeps the search to a few evaluations.)

    Raises:
        ConfigError: a non-positive argument or delta outside (0, 1).
    """
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ConfigError(f"target epsilon must be positive and finite, got {target_epsilon}")
    if not 0.0 < delta < 1.0:
        raise ConfigError(f"delta must be in (0, 1), got {delta}")
    if rounds < 1:
        raise ConfigError(f"rounds must be >= 1, got {rounds}")
    validate_round(1.0, sample_rate, steps_per_round)
    steps = steps_per_round * rounds
    with warnings.catch_warnings():
        # The search probes very large noise, where the RDP bound is loose (see rdp_epsilon).
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
        upper = float(
            get_noise_multiplier(
                target_epsilon=target_epsilon,
                target_delta=delta,
                sample_rate=sample_rate,
                steps=steps,
                accountant="rdp",
                epsilon_tolerance=NOISE_SEARCH_TOLERANCE,
            )
        )

    # The coarse PRV bound (≥ the ledger's ε) keeps each probe to one evaluation.
    def affordable(noise: float) -> bool:
        return _prv_epsilon(((noise, sample_rate, steps),), delta, coarse=True) <= target_epsilon

    lower = upper * NOISE_BISECTION_FLOOR
    if affordable(lower):
        return lower
    while upper - lower > NOISE_BISECTION_RTOL * upper:
        middle = (lower + upper) / 2
        if affordable(middle):
            upper = middle
        else:
            lower = middle
    return upper
