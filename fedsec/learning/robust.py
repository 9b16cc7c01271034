"""Robust aggregation rules, for trusted mode (``secure_sum = "none"``) only: there the
aggregator sees each member's update, so it can judge them one by one.  In the secure
modes it sees only their sum, and none of this applies (``docs/robustness.md``).

Each rule takes the members' updates Δ_i as the rows of an ``(n, d)`` float64 array and
their weights w_i > 0 (sample volume, capped), and returns a :class:`RobustAggregate`:
the aggregate update and one :class:`MemberOutcome` per row (accepted with its share of
the aggregate and the rule's score, or refused with the reason), so the aggregator can
log every refusal and answer the member.  :func:`aggregate` is the whole rule as the
aggregator and the auditor both run it, from the codec's (w·Δ, w) rows.

Rules (n rows, weights normalised to shares s_i = w_i / Σw):

- ``fedavg``: Σ s_i Δ_i.
- ``trimmed_mean`` (β): per coordinate, cut the ⌊βn⌋ lowest and highest values and take
  the weighted mean of the rest (Yin et al. 2018); β = 0 is ``fedavg``.
- ``median``: the coordinate-wise median (Yin et al. 2018); weights do not enter.
- ``multi_krum`` (f, m): score each update by the summed squared distances to its
  n − f − 2 nearest others, average the m best (Blanchard et al. 2017; m = 0: n − f).
- ``centered_clipping`` (τ, iterations): v ← v + Σ s_i clip_τ(Δ_i − v) from v = 0, the
  update that changes nothing (Karimireddy et al. 2021).
- ``dnc`` (f): refuse the f updates that lie farthest along the top principal direction
  of the centred updates, average the rest (Divide-and-Conquer's spectral filter,
  Shejwalkar & Houmansadr 2021, over every coordinate in one pass).
- ``fltrust`` (reference g₀): trust t_i = ReLU(cos(Δ_i, g₀)), each Δ_i rescaled to ‖g₀‖,
  aggregate Σ t_i Δ_i ‖g₀‖/‖Δ_i‖ / Σ t_i (Cao et al. 2021); weights do not enter.

Determinism: the auditor re-derives an aggregate bit for bit by running this code on
the same rows in the same order.  So the arithmetic is numpy's elementwise operations
and reductions, never a BLAS product (``@``, ``dot``, ``linalg.norm``), whose rounding
depends on the machine's kernels and thread count.

Memory: every rule holds the ``n × d`` rows (float64) plus about as much again for its
temporaries (``trimmed_mean``: about four times, for the sort); n is bounded by the
cohort cap ``round.max_agents``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from fedsec.errors import AggregationImpossible, ConfigError

# the rules' parameters are declared in rule_parameters; callers read them from here too
from fedsec.learning.rule_parameters import EVERY_RULE as EVERY_RULE
from fedsec.learning.rule_parameters import LEAST_UPDATES as LEAST_UPDATES
from fedsec.learning.rule_parameters import PARAMETERS as PARAMETERS
from fedsec.learning.rule_parameters import RULE_PARAMETERS as RULE_PARAMETERS
from fedsec.learning.rule_parameters import ParameterRange as ParameterRange
from fedsec.learning.rule_parameters import RuleParameters as RuleParameters
from fedsec.learning.rule_parameters import check_parameter as check_parameter
from fedsec.learning.rule_parameters import describe as describe

Rows = npt.NDArray[np.float64]
Vector = npt.NDArray[np.float64]


# -- outcomes --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MemberOutcome:
    """What a rule made of one member's update.

    ``weight`` is its share of the aggregate (the accepted shares sum to 1; for the
    coordinate-wise rules, its nominal share), 0 when refused.  ``score`` is the rule's
    own measure: the share of coordinates kept (``trimmed_mean``), the Krum score,
    the last clipping factor (``centered_clipping``), the trust score (``fltrust``).
    """

    accepted: bool
    weight: float
    score: float | None = None
    reason: str = ""  # why it was refused


@dataclass(frozen=True, slots=True)
class RobustAggregate:
    """A rule's aggregate update (float64, length d) and one outcome per input row."""

    update: Vector
    outcomes: tuple[MemberOutcome, ...]

    @property
    def accepted(self) -> list[int]:
        """The rows whose updates are in the aggregate."""
        return [i for i, o in enumerate(self.outcomes) if o.accepted]


def _refused(reason: str, score: float | None = None) -> MemberOutcome:
    return MemberOutcome(False, 0.0, score, reason)


def _check_rows(updates: Rows, weights: Vector) -> tuple[Rows, Vector]:
    """Raises ValueError: not (n, d) rows with n >= 1 matching finite weights > 0."""
    x = np.asarray(updates, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    if x.ndim != 2 or len(x) < 1 or w.shape != (len(x),):
        raise ValueError(f"expected (n, d) updates and n weights, got {x.shape} and {w.shape}")
    if not (np.all(np.isfinite(w)) and np.all(w > 0)):
        raise ValueError("every weight must be finite and > 0")
    return x, w


def _row_norms(x: Rows) -> Vector:
    norms: Vector = np.sqrt(np.einsum("ij,ij->i", x, x))
    return norms


def _weighted_mean(x: Rows, w: Vector) -> Vector:
    mean: Vector = (x * w[:, None]).sum(axis=0) / w.sum()
    return mean


def _shares(w: Vector) -> list[float]:
    return [float(v) for v in w / w.sum()]


# -- the rules -------------------------------------------------------------------------------


def fedavg(updates: Rows, weights: Vector) -> RobustAggregate:
    """The weighted mean Σ w_i Δ_i / Σ w_i.

    Raises:
        ValueError: malformed rows or weights (every rule).
    """
    x, w = _check_rows(updates, weights)
    return RobustAggregate(_weighted_mean(x, w), tuple(MemberOutcome(True, s) for s in _shares(w)))


def trimmed_mean(updates: Rows, weights: Vector, trim_fraction: float) -> RobustAggregate:
    """Per coordinate, the weighted mean of the values left after cutting the
    ⌊βn⌋ lowest and the ⌊βn⌋ highest (ties cut in row order).

    Raises:
        ConfigError: β outside [0, 1/2).
    """
    check_parameter("trim_fraction", trim_fraction)
    x, w = _check_rows(updates, weights)
    n, d = x.shape
    cut = int(trim_fraction * n)
    order = np.argsort(x, axis=0, kind="stable")[cut : n - cut]
    kept_x = np.take_along_axis(x, order, axis=0)
    kept_w = w[order]
    mean: Vector = (kept_x * kept_w).sum(axis=0) / kept_w.sum(axis=0)
    kept = np.bincount(order.ravel(), minlength=n) / max(d, 1)
    outcomes = tuple(
        MemberOutcome(True, s, float(k)) for s, k in zip(_shares(w), kept, strict=True)
    )
    return RobustAggregate(mean, outcomes)


def median(updates: Rows, weights: Vector) -> RobustAggregate:
    """The coordinate-wise median (of an even count, the mean of the middle two).
    Weights do not enter: each member counts once."""
    x, _ = _check_rows(updates, weights)
    n = len(x)
    middle: Vector = np.median(x, axis=0)
    return RobustAggregate(middle, tuple(MemberOutcome(True, 1.0 / n) for _ in range(n)))


def _squared_distances(x: Rows) -> npt.NDArray[np.float64]:
    """‖Δ_i − Δ_j‖² for every pair, from differences (no Gram matrix: no BLAS, and no
    cancellation between large norms)."""
    n = len(x)
    dist = np.zeros((n, n))
    for i in range(n - 1):
        diff = x[i + 1 :] - x[i]
        dist[i, i + 1 :] = np.einsum("ij,ij->i", diff, diff)
    return dist + dist.T


def multi_krum(
    updates: Rows, weights: Vector, byzantine: int, krum_selected: int = 0
) -> RobustAggregate:
    """Multi-Krum: the weighted mean of the ``m`` updates with the lowest Krum scores
    (summed squared distances to their n − f − 2 nearest others; ties by row order).

    Raises:
        ConfigError: f or m outside their ranges.
        AggregationImpossible: n <= 2f + 2, or m > n − f.
    """
    check_parameter("byzantine", byzantine)
    check_parameter("krum_selected", krum_selected)
    x, w = _check_rows(updates, weights)
    n, f = len(x), int(byzantine)
    if n < 2 * f + LEAST_UPDATES["multi_krum"][0]:
        raise AggregationImpossible(
            f"multi_krum with byzantine={f} needs at least {2 * f + 3} updates "
            f"(n > 2f + 2), got {n}"
        )
    m = int(krum_selected) or n - f
    if m > n - f:
        raise AggregationImpossible(
            f"multi_krum cannot average {m} of {n} updates when {f} may be Byzantine "
            f"(at most n - f = {n - f})"
        )
    dist = _squared_distances(x)
    np.fill_diagonal(dist, np.inf)
    scores = np.sort(dist, axis=1)[:, : n - f - 2].sum(axis=1)
    return _keep_lowest(
        x,
        w,
        scores,
        m,
        lambda score, cutoff: (
            f"multi_krum (byzantine={f}, selected {m} of {n}): its score {score:.4g} "
            f"(squared distances to its {n - f - 2} nearest updates) is not among the "
            f"{m} lowest (at most {cutoff:.4g}; an equal score goes to the earlier member)"
        ),
    )


def _keep_lowest(
    x: Rows, w: Vector, scores: Vector, keep: int, why: Callable[[float, float], str]
) -> RobustAggregate:
    """The weighted mean of the ``keep`` rows with the lowest scores (an equal score
    keeps the earlier row); every other row refused with ``why(its score, the highest
    kept score)``."""
    chosen = np.sort(np.argsort(scores, kind="stable")[:keep])
    mean = _weighted_mean(x[chosen], w[chosen])
    shares = dict(zip(chosen.tolist(), _shares(w[chosen]), strict=True))
    cutoff = float(scores[chosen].max())
    outcomes = tuple(
        MemberOutcome(True, shares[i], float(scores[i]))
        if i in shares
        else _refused(why(float(scores[i]), cutoff), float(scores[i]))
        for i in range(len(x))
    )
    return RobustAggregate(mean, outcomes)


def centered_clipping(
    updates: Rows,
    weights: Vector,
    clip_radius: float,
    clip_iterations: int,
    start: Vector | None = None,
) -> RobustAggregate:
    """Centered clipping: from ``start`` (default 0, the update that changes nothing),
    ``clip_iterations`` times v ← v + Σ s_i (Δ_i − v) min(1, τ / ‖Δ_i − v‖).  It bounds
    each member's pull rather than refusing anyone.

    Raises:
        ConfigError: τ <= 0 or iterations outside 1..100.
    """
    check_parameter("clip_radius", clip_radius)
    check_parameter("clip_iterations", clip_iterations)
    x, w = _check_rows(updates, weights)
    centre = np.zeros(x.shape[1]) if start is None else np.array(start, dtype=np.float64)
    share = w / w.sum()
    factor = np.ones(len(x))
    for _ in range(int(clip_iterations)):
        diff = x - centre
        norms = _row_norms(diff)
        factor = np.minimum(1.0, clip_radius / np.maximum(norms, np.finfo(np.float64).tiny))
        centre = centre + (diff * (share * factor)[:, None]).sum(axis=0)
    outcomes = tuple(
        MemberOutcome(True, float(s), float(c)) for s, c in zip(share, factor, strict=True)
    )
    return RobustAggregate(centre, outcomes)


#: Power iterations for the top eigenvector of dnc's n x n Gram matrix: fixed, so the
#: auditor's run takes the same steps; the error shrinks as (λ₂/λ₁)^k, and where λ₂ is
#: close to λ₁ either direction spreads the updates about as far.
DNC_POWER_ITERATIONS: Final = 100


def dnc(updates: Rows, weights: Vector, byzantine: int) -> RobustAggregate:
    """Divide-and-Conquer's spectral filter: centre the updates on their mean, find the
    top right singular vector v of the centred rows c_i, score each update by
    ⟨c_i, v⟩², refuse the f highest scores (an equal score refuses the later member)
    and take the weighted mean of the rest.

    Attacks that stay inside the honest spread coordinate by coordinate (ALIE) still
    share one direction, which the top singular vector finds.  v comes from power
    iteration on the n x n Gram matrix of the c_i (einsum, no BLAS), from its largest
    column, for :data:`DNC_POWER_ITERATIONS` steps; ⟨c_i, v⟩² = (Gu)_i² / uᵀGu for the
    top eigenvector u of the Gram matrix G.  Every coordinate is used, once: the
    paper's random coordinate subsets and repeated passes trade accuracy for speed at
    d in the millions, which a trusted-mode cohort's n x d rows already exceed in memory.

    Raises:
        ConfigError: f outside its range.
        AggregationImpossible: n <= 2f (the honest majority the filter relies on).
    """
    check_parameter("byzantine", byzantine)
    x, w = _check_rows(updates, weights)
    n, f = len(x), int(byzantine)
    if n < 2 * f + LEAST_UPDATES["dnc"][0]:
        raise AggregationImpossible(
            f"dnc with byzantine={f} needs more than 2f = {2 * f} updates (an honest "
            f"majority sets the spread it filters against), got {n}"
        )
    centred = x - x.sum(axis=0) / n
    gram = np.einsum("ik,jk->ij", centred, centred)
    u = gram[:, int(np.argmax(np.diagonal(gram)))].copy()
    scores = np.zeros(n)
    length = float(np.sqrt(np.einsum("i,i->", u, u)))
    if length > 0:  # else every update is the mean: nothing to filter, ties refuse the last
        for _ in range(DNC_POWER_ITERATIONS):
            u = np.einsum("ij,j->i", gram, u / length)
            length = float(np.sqrt(np.einsum("i,i->", u, u)))
        u = u / length
        gu = np.einsum("ij,j->i", gram, u)
        spread = float(np.einsum("i,i->", u, gu))
        if spread > 0:
            scores = gu * gu / spread
    return _keep_lowest(
        x,
        w,
        scores,
        n - f,
        lambda score, cutoff: (
            f"dnc (byzantine={f}): its update lies {math.sqrt(score):.4g} from the mean "
            f"along the updates' top principal direction, among the {f} farthest of {n} "
            f"(the kept lie at most {math.sqrt(cutoff):.4g} from it)"
        ),
    )


def fltrust(
    updates: Rows, weights: Vector, reference: Vector, min_trust_score: float = 0.0
) -> RobustAggregate:
    """FLTrust: trust t_i = ReLU(cos(Δ_i, g₀)) against the aggregator's reference g₀;
    each update rescaled to ‖g₀‖; the aggregate Σ t_i Δ_i ‖g₀‖/‖Δ_i‖ / Σ t_i.  Updates
    with trust 0 (pointing away, or zero) or below ``min_trust_score`` are refused.
    Weights do not enter.

    Raises:
        ConfigError: ``min_trust_score`` outside [0, 1].
        ValueError: ``reference`` is not a vector of length d.
        AggregationImpossible: the reference is zero, or every trust score is 0 (no
            update points the reference's way), so no aggregate can be formed.
    """
    check_parameter("min_trust_score", min_trust_score)
    x, _ = _check_rows(updates, weights)
    g0 = np.asarray(reference, dtype=np.float64)
    if g0.shape != (x.shape[1],):
        raise ValueError(f"the reference has shape {g0.shape}, the updates {x.shape[1]} values")
    g0_norm = float(np.sqrt(np.einsum("i,i->", g0, g0)))
    if not (math.isfinite(g0_norm) and g0_norm > 0):
        raise AggregationImpossible(
            "fltrust: the reference update trained on the root dataset is zero, so no "
            "update can be judged against it"
        )
    norms = _row_norms(x)
    safe = np.where(norms > 0, norms, 1.0)
    cosine = np.where(norms > 0, np.einsum("ij,j->i", x, g0) / (safe * g0_norm), 0.0)
    trust = np.maximum(cosine, 0.0)
    refused = {
        i: _distrust(float(norms[i]), float(cosine[i]), min_trust_score) for i in range(len(x))
    }
    refused = {i: r for i, r in refused.items() if r}
    accepted = np.array([i for i in range(len(x)) if i not in refused], dtype=np.int64)
    total = float(trust[accepted].sum()) if len(accepted) else 0.0
    if total <= 0:
        raise AggregationImpossible(
            f"fltrust: no update is trusted (every one of the {len(x)} has trust score 0 or "
            f"below {min_trust_score:g}): none points the way the root dataset's reference does"
        )
    t = trust[accepted]
    scaled = x[accepted] * (t * (g0_norm / norms[accepted]))[:, None]
    aggregate_: Vector = scaled.sum(axis=0) / total
    outcomes = tuple(
        _refused(refused[i], float(trust[i]))
        if i in refused
        else MemberOutcome(True, float(trust[i]) / total, float(trust[i]))
        for i in range(len(x))
    )
    return RobustAggregate(aggregate_, outcomes)


def _distrust(norm: float, cosine: float, min_trust: float) -> str:
    """Why FLTrust refuses an update with this norm and cosine, or '' if it does not."""
    if norm == 0:
        return "fltrust: a zero update has no direction to trust (trust score 0)"
    if cosine <= 0:
        return (
            f"fltrust: its update does not point the reference's way (cosine {cosine:.4f}), "
            "so its trust score is 0"
        )
    if cosine < min_trust:
        return (
            f"fltrust: its trust score {cosine:.4f} (cosine with the reference) is below the "
            f"minimum {min_trust:g}"
        )
    return ""


def norm_outliers(updates: Rows, max_norm_ratio: float) -> dict[int, str]:
    """The acceptance threshold on length: the rows whose norm exceeds ``max_norm_ratio``
    times the median row norm, each with the reason (none when the ratio is 0, off).

    Raises:
        ConfigError: a ratio that is neither 0 nor >= 1.
    """
    check_parameter("max_norm_ratio", max_norm_ratio)
    if max_norm_ratio == 0:
        return {}
    norms = _row_norms(np.asarray(updates, dtype=np.float64))
    middle = float(np.median(norms))
    limit = max_norm_ratio * middle
    return {
        i: f"its norm {norm:.4g} is over {max_norm_ratio:g} times the median update norm "
        f"{middle:.4g} (at most {limit:.4g})"
        for i, norm in enumerate(norms.tolist())
        if norm > limit
    }


# -- the whole rule --------------------------------------------------------------------------

_RULES: Final[
    dict[str, Callable[[RuleParameters, Rows, Vector, Vector | None], RobustAggregate]]
] = {
    "fedavg": lambda p, x, w, g0: fedavg(x, w),
    "trimmed_mean": lambda p, x, w, g0: trimmed_mean(x, w, p.trim_fraction),
    "median": lambda p, x, w, g0: median(x, w),
    "multi_krum": lambda p, x, w, g0: multi_krum(x, w, p.byzantine, p.krum_selected),
    "centered_clipping": lambda p, x, w, g0: centered_clipping(
        x, w, p.clip_radius, p.clip_iterations
    ),
    "dnc": lambda p, x, w, g0: dnc(x, w, p.byzantine),
    "fltrust": lambda p, x, w, g0: fltrust(x, w, _need(g0), p.min_trust_score),
}


def _need(reference: Vector | None) -> Vector:
    if reference is None:
        raise ValueError("fltrust needs the reference update")
    return reference


def aggregate(
    params: RuleParameters,
    weighted_updates: Rows,
    weights: Vector,
    reference: Vector | None = None,
) -> RobustAggregate:
    """The federation's rule over the codec's rows (w_i·Δ_i, w_i), in the caller's order.

    First a member whose weight is 0 is refused (its row is rounding noise, not an
    update); then Δ_i = (w_i·Δ_i) / w_i; then the acceptance threshold on length
    (``max_norm_ratio``); then the rule on what is left.

    Args:
        params: the rule and its parameters.
        weighted_updates: ``(n, d)`` dequantized w·Δ rows.
        weights: the n dequantized weights, >= 0.
        reference: ``fltrust``: the aggregator's reference update g₀.

    Returns:
        the aggregate update and one outcome per row.

    Raises:
        ConfigError: a parameter outside its range.
        AggregationImpossible: too few updates for the rule, or nothing is left.
        ValueError: malformed rows, or fltrust without its reference.
    """
    wx = np.asarray(weighted_updates, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    if wx.ndim != 2 or w.shape != (len(wx),):
        raise ValueError(f"expected (n, d) rows and n weights, got {wx.shape} and {w.shape}")
    outcomes: dict[int, MemberOutcome] = {
        i: _refused("its weight is 0, so its row holds rounding noise, not an update")
        for i in range(len(w))
        if not w[i] > 0
    }
    live = np.array([i for i in range(len(w)) if i not in outcomes], dtype=np.int64)
    x = wx[live] / w[live][:, None]
    for i, why in norm_outliers(x, params.max_norm_ratio).items():
        outcomes[int(live[i])] = _refused(why)
    rest = np.array([i for i in range(len(live)) if int(live[i]) not in outcomes], dtype=np.int64)
    if len(rest) == 0:
        raise AggregationImpossible(
            f"{params.rule}: no update is left to aggregate ({len(w)} refused before the rule)"
        )
    rule = _RULES.get(params.rule)
    if rule is None:
        raise ConfigError(
            f"rule: expected one of {', '.join(RULE_PARAMETERS)}, got {params.rule!r}"
        )
    result = rule(params, x[rest], w[live[rest]], reference)
    for i, outcome in zip(live[rest].tolist(), result.outcomes, strict=True):
        outcomes[i] = outcome
    return RobustAggregate(result.update, tuple(outcomes[i] for i in range(len(w))))


def as_weighted_sum(result: RobustAggregate, weights: Vector) -> tuple[Vector, float]:
    """The aggregate as a round's (Σ w·Δ, Σ w): Σ w over the accepted members, and the
    aggregate scaled by it, which model application divides out again.  The aggregator
    and the auditor both take this pair, so the logged sum hashes the same for both.

    Raises:
        AggregationImpossible: the accepted members' weights sum to 0.
    """
    w = np.asarray(weights, dtype=np.float64)
    total = float(w[result.accepted].sum())
    if not total > 0:
        raise AggregationImpossible("the accepted updates' weights sum to 0")
    return result.update * total, total
