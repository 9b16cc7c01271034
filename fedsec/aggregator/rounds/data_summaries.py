"""Members' signed data summaries: checked against the federation schema at join, logged.

In a federation with a ``[schema]`` (task ``table``) every join carries the member's
signed :class:`~fedsec.protocol.wire.DataSummary`.  The aggregator checks the signature
against the member's roster key, then compares the observed schema inside it with the
federation's (:func:`~fedsec.protocol.data_schema.schema_differences`, the comparison the
agent made before sending) and refuses the join naming each difference.  An accepted
summary is logged as a ``data_summary`` entry when it differs from the member's last
one, so the log holds each member's data statement once per change, the auditor can
check its signature, and ``fedsec aggregator inventory`` lists the latest per member.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from fedsec.aggregator.rounds.context import RoundContext, log
from fedsec.errors import PayloadError, TaskMismatch
from fedsec.protocol import wire
from fedsec.protocol.data_schema import DataSchema, schema_differences
from fedsec.protocol.log import entry_from_line
from fedsec.protocol.log_entries import kind_of


class DataSummaryDesk:
    """Checks and logs members' data summaries."""

    def __init__(self, ctx: RoundContext) -> None:
        self._ctx = ctx
        self._logged: dict[str, wire.DataSummary] | None = None  # member -> last logged

    def check(self, member: str, summary: wire.DataSummary | None) -> None:
        """Refuse a join whose data does not match the federation schema.

        Raises:
            TaskMismatch: the federation has a schema and the member sent no summary, or
                its data differs (each difference named: column, expected, found).
            PayloadError: the summary names another member or federation, or holds
                rates or counts out of range.
            SignatureError: the summary is not signed by the member's roster key.
        """
        schema = self._ctx.cfg.schema
        if schema is None:
            return
        if summary is None:
            raise TaskMismatch(
                f"{member}: this federation trains on a data schema (task table); the join "
                "must carry the member's signed data summary"
            )
        ws = self._ctx.ws
        if (summary.member, summary.federation_id) != (member, ws.federation_id):
            raise PayloadError(f"{member}: the data summary names another member or federation")
        entry = ws.roster.get(member)
        assert entry is not None  # authenticated callers are roster members
        summary.verify(entry.public_key_bytes)
        _check_ranges(member, summary, schema)
        diffs = schema_differences(schema, summary.observed)
        if diffs:
            raise TaskMismatch(
                f"{member}'s data does not match the federation schema: "
                + "; ".join(d.sentence() for d in diffs)
            )
        if summary.schema_fingerprint != schema.fingerprint():
            raise TaskMismatch(
                f"{member} encoded its data with schema {summary.schema_fingerprint[:16]}…, "
                f"the federation's is {schema.fingerprint()[:16]}… (its [data.schema] copy "
                "differs: units, missing-value rules or category order)"
            )

    def record(self, member: str, summary: wire.DataSummary | None) -> None:
        """Log a checked summary unless it is the member's last logged one."""
        if summary is None or self._ctx.cfg.schema is None:
            return
        logged = self._last_logged()
        if member in logged and wire.encode(logged[member]) == wire.encode(summary):
            return
        self._ctx.trail.append(summary)
        logged[member] = summary
        log.info(
            "data_summary member=%s records=%d quality=%.3f",
            member,
            summary.records,
            summary.quality_score,
        )

    def latest(self) -> dict[str, wire.DataSummary]:
        """Each member's last logged summary (for the dashboard)."""
        return dict(self._last_logged())

    def _last_logged(self) -> dict[str, wire.DataSummary]:
        if self._logged is None:
            lines = (line for _, line in self._ctx.ws.state.log.log_lines())
            self._logged = latest_summaries(lines)
        return self._logged


def latest_summaries(lines: Iterable[bytes]) -> dict[str, wire.DataSummary]:
    """The last logged data summary of each member, from the log's lines."""
    kind = kind_of(wire.DataSummary)
    out: dict[str, wire.DataSummary] = {}
    marker = f'"kind":"{kind}"'.encode()  # canonical JSON: skip other lines unparsed
    for line in lines:
        if marker not in line:
            continue
        entry = entry_from_line(line)
        if entry.kind == kind:
            body = entry.decode()
            assert isinstance(body, wire.DataSummary)
            out[body.member] = body
    return out


def _check_ranges(member: str, summary: wire.DataSummary, schema: DataSchema) -> None:
    rates = [*summary.missing_rate.values(), summary.label_coverage, summary.quality_score]
    if not all(math.isfinite(r) and 0.0 <= r <= 1.0 for r in rates):
        raise PayloadError(f"{member}: data summary rates and scores must lie in [0, 1]")
    unknown = sorted(set(summary.label_counts) - set(schema.classes))
    if unknown:
        raise PayloadError(f"{member}: data summary counts labels {unknown} outside the classes")
    columns = {c.name for c in schema.columns} | {schema.label}
    strange = sorted(set(summary.missing_rate) - columns)
    if strange:
        raise PayloadError(f"{member}: data summary has missing rates of unknown columns")
    if not (math.isfinite(summary.count_epsilon) and summary.count_epsilon >= 0):
        raise PayloadError(f"{member}: data summary count_epsilon must be a number >= 0")
    if summary.count_epsilon == 0 and sum(summary.label_counts.values()) != summary.records:
        raise PayloadError(
            f"{member}: data summary label counts add up to {sum(summary.label_counts.values())}"
            f", not its {summary.records} records"
        )
