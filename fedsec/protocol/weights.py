"""A member's weight in the round's sum: one definition for the member that applies it
and the auditor that checks it.

w = min(1, samples / max_weight_samples) × quality, capped by the roster's max weight
(the spec's ``weight_caps``).  The member computes it from its own declared, signed
statistics: ``samples`` is the record count of its signed privacy report; ``quality``
in [0, 1] comes from its signed data summary (label coverage × (1 − mean missing
rate), ``DataSummary.quality_score``) when it has one, else 1 (volume only).

The weight travels as the last coordinate of the quantized update, so the member's
signed contribution statement commits to it (the commitment is H(salt ‖ quantized)):
the auditor reads it from a revealed update and checks it against these inputs
(``fedsec.audit.control``, test ``weight``).  A member can only lower its own weight
without being caught, which costs only itself; inflating it is caught.
"""

from __future__ import annotations

import math

from fedsec.protocol.wire import DataSummary, RoundSpec


def quality_factor(summary: DataSummary | None) -> float:
    """The quality a member's weight is scaled by: its signed data summary's
    ``quality_score`` clamped to [0, 1], or 1 without a summary (volume only).

    This is the one hook for data quality: a richer score (issue 19's data summary)
    changes only what ``DataSummary.quality_score`` holds.
    """
    if summary is None:
        return 1.0
    q = float(summary.quality_score)
    return min(max(q, 0.0), 1.0) if math.isfinite(q) else 0.0


def contribution_weight(
    samples: int, spec: RoundSpec, member: str, summary: DataSummary | None = None
) -> float:
    """w = min(min(1, samples / max_weight_samples) × quality, roster cap)."""
    cap = float(spec.weight_caps.get(member, 1.0))
    volume = min(1.0, samples / spec.max_weight_samples)
    return float(max(0.0, min(volume * quality_factor(summary), cap)))


def volume_weight(samples: int, spec: RoundSpec, member: str) -> float:
    """The weight from volume alone, capped (quality 1): what a member's weight may not
    exceed whatever its quality."""
    return contribution_weight(samples, spec, member)
