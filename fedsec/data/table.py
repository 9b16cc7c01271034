"""From the owner's sources to the matrix a model trains on, per the federation schema.

One pass over every source, chunk by chunk: the rules run, then each schema column is
typed (numbers parsed, categories looked up in the federation's list, label classes
too).  What the member's data turned out to be is an :class:`ObservedSchema`; if it
differs from the federation's, training is refused with every difference named
(:func:`~fedsec.protocol.data_schema.schema_differences`, the aggregator's check too),
plus the source and row where a wrong value first appears.  Then rows are selected
(missing label; missing value where the schema says ``drop``) and encoded: numbers as
they are (standardised later by the task), categories one-hot over the federation's
categories, missing values imputed with a statistic of this member's own data.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from fedsec.data import rules as column_rules
from fedsec.data.profile import NUMBER_PATTERN
from fedsec.data.settings import ColumnRules
from fedsec.data.sources import Source
from fedsec.errors import TaskMismatch
from fedsec.protocol.data_schema import (
    MAX_CATEGORIES,
    DataSchema,
    ObservedColumn,
    ObservedSchema,
    SchemaColumn,
    schema_differences,
)


@dataclass
class Selection:
    """Rows read, kept, and dropped with the reason."""

    read: int = 0
    kept: int = 0
    dropped: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class TrainingTable:
    """The encoded records of this member, ready for a task."""

    x: npt.NDArray[np.float32]
    y: npt.NDArray[np.int64]
    observed: ObservedSchema
    missing_rate: dict[str, float]  # used column (label included) -> share missing
    selection: Selection
    fingerprint: str  # of the sources, to catch a change between inventory and training


@dataclass
class _Column:
    """One schema column gathered over all chunks."""

    spec: SchemaColumn
    parts: list[np.ndarray] = field(default_factory=list)  # floats (NaN) or codes (-1)
    missing: int = 0
    present: bool = False  # the column exists in every source
    seen: set[str] = field(default_factory=set)  # categorical: values present
    first_bad: str = ""  # where the first value the schema does not allow is


def build_table(
    sources: Sequence[Source],
    schema: DataSchema,
    rules: ColumnRules,
    hash_key: bytes | None,
) -> TrainingTable:
    """Read, check and encode this member's records.

    Raises:
        TaskMismatch: the data differs from the federation schema; names each
            difference (column, expected, found) and the source and row of the first
            offending value.
        ConfigError: a source cannot be read (naming the source and row).
    """
    columns = {c.name: _Column(c) for c in schema.columns}
    label = _Column(SchemaColumn(name=schema.label, kind="categorical", categories=schema.classes))
    every = [*columns.values(), label]
    for col in every:
        col.present = True
    rows = 0
    for source in sources:
        seen_columns: set[str] = set()
        for chunk in source.chunks():
            texts = column_rules.apply(rules, chunk.columns, hash_key)
            seen_columns |= set(texts)
            n = chunk.rows
            rows += n
            for col in every:
                text = texts.get(col.spec.name)
                if text is None:
                    col.parts.append(np.full(n, np.nan if col.spec.kind == "numeric" else -1))
                    col.missing += n
                    continue
                _gather(col, text, source.name, chunk.first_row)
        for col in every:
            if col.spec.name not in seen_columns:
                col.present = False
    observed = _observed(schema, rules, columns, label)
    diffs = schema_differences(schema, observed)
    if diffs:
        where = [f"{c.spec.name}: {c.first_bad}" for c in every if c.first_bad]
        hint = f" (first offending values: {'; '.join(where)})" if where else ""
        raise TaskMismatch(
            "this member's data does not match the federation schema: "
            + "; ".join(d.sentence() for d in diffs)
            + hint
        )
    return _encode(schema, rules, columns, label, rows, sources)


def _gather(col: _Column, text: pa.Array, source: str, first_row: int) -> None:
    present = pc.is_valid(text)
    col.missing += len(text) - int(pc.sum(present).as_py() or 0)
    spec = col.spec
    if spec.kind == "numeric":
        is_number = pc.fill_null(pc.match_substring_regex(text, NUMBER_PATTERN), False)
        bad = pc.and_(present, pc.invert(is_number))
        if pc.any(bad).as_py():
            col.seen.update(str(v) for v in pc.unique(pc.filter(text, bad)).to_pylist()[:5])
            if not col.first_bad:
                row = first_row + int(pc.index(bad, True).as_py())
                col.first_bad = f"{source} row {row} holds a non-number"
        numbers = pc.cast(pc.if_else(is_number, text, None), pa.float64())
        col.parts.append(numbers.to_numpy(zero_copy_only=False).astype(np.float64))
        return
    codes = pc.index_in(text, value_set=pa.array(spec.categories, type=pa.string()))
    unknown = pc.and_(present, pc.is_null(codes))
    if pc.any(unknown).as_py() and not col.first_bad:
        row = first_row + int(pc.index(unknown, True).as_py())
        col.first_bad = f"{source} row {row} holds a value outside the federation's list"
    if len(col.seen) <= MAX_CATEGORIES:
        col.seen.update(v for v in pc.unique(pc.drop_null(text)).to_pylist())
    col.parts.append(pc.fill_null(codes, -1).to_numpy(zero_copy_only=False).astype(np.int64))


def _observed(
    schema: DataSchema, rules: ColumnRules, columns: dict[str, _Column], label: _Column
) -> ObservedSchema:
    observed = []
    for name, col in columns.items():
        if not col.present:
            continue
        kind = col.spec.kind
        if kind == "numeric" and col.seen:
            kind = "categorical"  # text values where numbers belong
        observed.append(
            ObservedColumn(
                name=name,
                kind=kind,
                unit=rules.units.get(name, col.spec.unit),
                categories=sorted(col.seen)[:MAX_CATEGORIES],
            )
        )
    return ObservedSchema(
        label=schema.label if label.present else "",
        classes=sorted(label.seen)[:MAX_CATEGORIES],
        columns=observed,
    )


def _encode(
    schema: DataSchema,
    rules: ColumnRules,
    columns: dict[str, _Column],
    label: _Column,
    rows: int,
    sources: Sequence[Source],
) -> TrainingTable:
    selection = Selection(read=rows)
    y_codes = np.concatenate(label.parts) if label.parts else np.zeros(0, np.int64)
    keep = y_codes >= 0
    selection.dropped[f"label '{schema.label}' missing"] = int((~keep).sum())
    stacked = {name: np.concatenate(col.parts) for name, col in columns.items()}
    for name, col in columns.items():
        if col.spec.missing != "drop":
            continue
        values = stacked[name]
        absent = np.isnan(values) if col.spec.kind == "numeric" else values < 0
        newly = absent & keep
        if newly.any():
            selection.dropped[f"'{name}' missing (the schema drops such rows)"] = int(newly.sum())
        keep &= ~absent
    selection.dropped = Counter({k: v for k, v in selection.dropped.items() if v})
    selection.kept = int(keep.sum())
    features: list[np.ndarray] = []
    for name, col in columns.items():
        values = stacked[name][keep]
        if col.spec.kind == "numeric":
            absent = np.isnan(values)
            fill = _statistic(values[~absent], rules.impute)
            features.append(np.where(absent, fill, values)[:, None])
        else:
            absent = values < 0
            onehot = np.zeros((len(values), len(col.spec.categories)))
            onehot[np.flatnonzero(~absent), values[~absent]] = 1.0
            features.append(onehot)
        if col.spec.missing == "indicator":
            features.append(absent.astype(np.float64)[:, None])
    x = np.hstack(features) if features else np.zeros((int(keep.sum()), 0))
    missing_rate = {
        c.spec.name: (c.missing / rows if rows else 0.0) for c in [*columns.values(), label]
    }
    return TrainingTable(
        x=x.astype(np.float32),
        y=y_codes[keep].astype(np.int64),
        observed=_observed(schema, rules, columns, label),
        missing_rate=missing_rate,
        selection=selection,
        fingerprint=sources_fingerprint(sources),
    )


def _statistic(values: np.ndarray, how: str) -> float:
    if not len(values):
        return 0.0
    return float(np.median(values) if how == "median" else np.mean(values))


def sources_fingerprint(sources: Sequence[Source]) -> str:
    """What changes when any source's records may have changed."""
    return "|".join(f"{s.name}={s.fingerprint()}" for s in sources)
