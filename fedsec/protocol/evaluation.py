"""Federated evaluation: a member's signed metric report on a new global model.

A member that took part in a round scores the model the round produced on its own
held-out split and reports, per metric of the task, the *sums* behind the value (the
metric's total and its weight, the record count unless the metric is a ratio of sums),
never a per-record output. The federation's value is then the pooled ratio, the
weighted mean of the members' values (:func:`pool`).

:func:`check_report` is the whole of what can be checked without the round's state
(the aggregator adds the round, the roster, the record bound and the signature): a
report that passes it cannot move a pooled value outside what its declared records
allow.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Annotated, ClassVar, Final

import msgspec

from fedsec.errors import PayloadError
from fedsec.protocol.body import Id, MemberId, _Signed
from fedsec.protocol.limits import MAX_COUNT

EVALUATION_REPORT_DOMAIN: Final = "evaluation-report"
#: Most metrics one report carries: a task's metrics and its loss. 64 is far above any
#: bundled task (at most 5) and keeps a report a few KB, well inside
#: ``server.max_json_bytes``.
MAX_REPORTED_METRICS: Final = 64
#: The name the loss is reported under, next to the task's own metrics.
LOSS_METRIC: Final = "loss"

#: A metric's name: as a Prometheus label value and a JSON key, short and plain.
MetricName = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[a-z0-9_]+$")]


class MetricSum(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One metric over a member's held-out records: ``total / weight`` is its value."""

    name: MetricName
    total: float
    weight: Annotated[float, msgspec.Meta(ge=0)]


class EvaluationReport(_Signed, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A member's signed score of the model that round ``round`` (attempt ``attempt``)
    produced, ``model_version``, on its own ``records`` held-out records."""

    DOMAIN: ClassVar[str] = EVALUATION_REPORT_DOMAIN

    federation_id: str
    round: Id
    attempt: Id
    member: MemberId
    model_version: Id
    records: Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)]
    metrics: Annotated[list[MetricSum], msgspec.Meta(max_length=MAX_REPORTED_METRICS)]
    signature: str = ""


def check_report(
    report: EvaluationReport,
    known: Mapping[str, tuple[float, float]],
    counted: Iterable[str],
) -> None:
    """Refuse a report that is not a sound set of sums for the task's metrics.

    Args:
        known: each metric the task reports (the loss included) and its value's bounds.
        counted: the metrics whose weight is the record count.

    Raises:
        PayloadError: a metric missing, unknown or repeated; a number that is not
            finite; a weight above the record count (each record adds at most 1) or,
            for a counted metric, other than it; a value outside the metric's bounds.
    """
    names = [m.name for m in report.metrics]
    if len(set(names)) != len(names):
        raise PayloadError(f"evaluation report repeats a metric: {sorted(names)}")
    if set(names) != set(known):
        missing, unknown = sorted(set(known) - set(names)), sorted(set(names) - set(known))
        raise PayloadError(
            f"evaluation report metrics differ from the task's: missing {missing}, "
            f"unknown {unknown}"
        )
    counted_names = set(counted)
    for m in report.metrics:
        if not (math.isfinite(m.total) and math.isfinite(m.weight)):
            raise PayloadError(f"evaluation report metric '{m.name}' is not a finite number")
        if m.weight > report.records or (m.name in counted_names and m.weight != report.records):
            raise PayloadError(
                f"evaluation report metric '{m.name}' has weight {m.weight:g} for "
                f"{report.records} records"
            )
        low, high = known[m.name]
        if m.weight == 0:
            if m.total != 0:
                raise PayloadError(f"evaluation report metric '{m.name}' has no weight")
        elif not low <= m.total / m.weight <= high:
            raise PayloadError(
                f"evaluation report metric '{m.name}' value {m.total / m.weight:g} is "
                f"outside its range [{low:g}, {high:g}]"
            )


class PooledScores:
    """Members' reports on one model, pooled: the records, each metric's summed total and
    weight, and who reported. Reports are added one by one (:meth:`add`), so a pool is
    kept up to date without reading the earlier reports again."""

    def __init__(self) -> None:
        self.records = 0
        self.members: set[str] = set()
        self._sums: dict[str, tuple[float, float]] = {}

    def add(self, report: EvaluationReport) -> None:
        """Pool one more member's report (checked, and the member's first)."""
        self.records += report.records
        self.members.add(report.member)
        for m in report.metrics:
            total, weight = self._sums.get(m.name, (0.0, 0.0))
            self._sums[m.name] = (total + m.total, weight + m.weight)

    def values(self) -> dict[str, float]:
        """Each metric's pooled value, the sum of totals over the sum of weights; a
        metric whose weights sum to 0 has no value and is left out."""
        return {name: t / w for name, (t, w) in sorted(self._sums.items()) if w > 0}


def pool(reports: Iterable[EvaluationReport]) -> PooledScores:
    """``reports`` pooled."""
    pooled = PooledScores()
    for report in reports:
        pooled.add(report)
    return pooled
