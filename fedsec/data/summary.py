"""What leaves the member about its data: the data summary and its quality score.

:func:`data_quality` is the one definition of the quality statistics (records, label
coverage, missing-value rate, score) that the data summary carries and that quality
weights may be derived from.  :func:`data_summary` builds the summary the member signs
and sends at join; with ``count_epsilon`` > 0 its counts carry Laplace noise drawn from
the operating system's CSPRNG.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

from fedsec.data.table import TrainingTable
from fedsec.protocol import wire
from fedsec.protocol.data_schema import DataSchema

#: L1 sensitivity of (records, label counts): one record changes the total and one
#: label's count by 1 each.
COUNT_SENSITIVITY = 2.0


@dataclass(frozen=True)
class DataQuality:
    """Quality statistics of a member's training data.

    ``score`` = ``label_coverage`` × (1 − ``missing_rate``), in [0, 1]: a member holding
    every class with no gaps scores 1; one holding half the classes, or missing half its
    values, scores 0.5.
    """

    records: int
    label_coverage: float  # share of the federation's classes present locally
    missing_rate: float  # mean over the used columns of the share of rows missing them
    score: float


def data_quality(table: TrainingTable, schema: DataSchema) -> DataQuality:
    """The quality statistics of ``table`` against the federation's ``schema``."""
    present = {int(c) for c in set(table.y.tolist())}
    coverage = len(present) / len(schema.classes) if schema.classes else 0.0
    rates = list(table.missing_rate.values())
    missing = sum(rates) / len(rates) if rates else 0.0
    return DataQuality(
        records=len(table.y),
        label_coverage=coverage,
        missing_rate=missing,
        score=max(0.0, min(1.0, coverage * (1.0 - missing))),
    )


def data_summary(
    table: TrainingTable,
    schema: DataSchema,
    member: str,
    federation_id: str = "",
    count_epsilon: float = 0.0,
) -> wire.DataSummary:
    """The unsigned summary of this member's data (sign it with ``.sign(identity)``).

    Args:
        count_epsilon: > 0 adds Laplace(2/ε) noise to the record and label counts
            (rounded, floored at 0); the caller charges ε to the ledger.
    """
    quality = data_quality(table, schema)
    counts = {c: int((table.y == i).sum()) for i, c in enumerate(schema.classes)}
    records = quality.records
    if count_epsilon > 0:
        scale = COUNT_SENSITIVITY / count_epsilon
        records = _noisy(records, scale)
        counts = {c: _noisy(n, scale) for c, n in counts.items()}
    return wire.DataSummary(
        federation_id=federation_id,
        member=member,
        records=records,
        label_counts=counts,
        missing_rate={k: round(v, 6) for k, v in table.missing_rate.items()},
        schema_fingerprint=schema.fingerprint(),
        observed=table.observed,
        label_coverage=round(quality.label_coverage, 6),
        quality_score=round(quality.score, 6),
        count_epsilon=count_epsilon,
    )


def _noisy(count: int, scale: float) -> int:
    """``count`` + Laplace(scale), by inverse CDF from a CSPRNG uniform in (-1/2, 1/2)."""
    u = (secrets.randbits(53) + 0.5) / (1 << 53) - 0.5
    noise = -scale * math.copysign(1.0, u) * math.log1p(-2.0 * abs(u))
    return max(0, round(count + noise))
