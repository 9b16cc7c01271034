"""What leaves the member about its data: the data summary and its quality score.

:func:`data_quality` is the one definition of the quality statistics (records, label
coverage, missing-value rate, score) that the data summary carries and that quality
weights may be derived from.  :func:`data_summary` builds the summary the member signs
and sends at join; with ``count_epsilon`` > 0 its counts carry Laplace noise drawn from
the operating system's CSPRNG, and its rates (missing rates, label coverage, quality
score) are computed from noised counts only: an exact rate k/n with small numbers gives
back the n the noise hides, and whether a rare class is present at all.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

from fedsec.data.table import TrainingTable
from fedsec.protocol import wire
from fedsec.protocol.data_schema import DataSchema

#: L1 sensitivity of (records, label counts, rows read), before the missing counts: one
#: row read changes the rows read by 1 and, when kept, the records and its label's count
#: by 1 each.  Each used column's missing count adds 1 more (see count_sensitivity).
COUNT_SENSITIVITY = 3.0


def count_sensitivity(used_columns: int) -> float:
    """L1 sensitivity of everything a noised summary is computed from: the records, the
    label counts, the rows read and the missing count of each of ``used_columns``."""
    return COUNT_SENSITIVITY + used_columns


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
        count_epsilon: > 0 adds Laplace(:func:`count_sensitivity` / ε) noise to the
            record and label counts, the rows read and each used column's missing count
            (rounded, floored at 0), one ε-DP release; the rates are then computed from
            these noised counts alone (post-processing, no further ε).  The caller
            charges ε to the ledger.
    """
    if count_epsilon <= 0:
        quality = data_quality(table, schema)
        return _summary(
            table,
            schema,
            member,
            federation_id,
            0.0,
            quality,
            _label_counts(table, schema),
            {k: round(v, 6) for k, v in table.missing_rate.items()},
        )
    read = table.selection.read
    missing = {k: round(v * read) for k, v in table.missing_rate.items()}
    scale = count_sensitivity(len(missing)) / count_epsilon
    records = _noisy(len(table.y), scale)
    counts = {c: _noisy(n, scale) for c, n in _label_counts(table, schema).items()}
    noisy_read = max(1, _noisy(read, scale))
    rates = {k: min(1.0, _noisy(n, scale) / noisy_read) for k, n in missing.items()}
    present = sum(1 for n in counts.values() if n > 0)
    coverage = present / len(schema.classes) if schema.classes else 0.0
    mean_rate = sum(rates.values()) / len(rates) if rates else 0.0
    quality = DataQuality(
        records=records,
        label_coverage=coverage,
        missing_rate=mean_rate,
        score=max(0.0, min(1.0, coverage * (1.0 - mean_rate))),
    )
    return _summary(
        table,
        schema,
        member,
        federation_id,
        count_epsilon,
        quality,
        counts,
        {k: round(v, 6) for k, v in rates.items()},
    )


def _label_counts(table: TrainingTable, schema: DataSchema) -> dict[str, int]:
    return {c: int((table.y == i).sum()) for i, c in enumerate(schema.classes)}


def _summary(
    table: TrainingTable,
    schema: DataSchema,
    member: str,
    federation_id: str,
    count_epsilon: float,
    quality: DataQuality,
    counts: dict[str, int],
    missing_rate: dict[str, float],
) -> wire.DataSummary:
    return wire.DataSummary(
        federation_id=federation_id,
        member=member,
        records=quality.records,
        label_counts=counts,
        missing_rate=missing_rate,
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
