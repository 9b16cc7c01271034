"""The federation's data schema and the comparison both sides make against it.

The federation fixes, in ``federation.toml`` ``[schema]``, the columns every member
trains on (in model-input order), their kind and unit, how a missing value is handled,
the categories of each categorical column and the label's classes.  Fixing the
categories is what makes every member one-hot encode alike; fixing the missing-value
handling is what makes every member's input vector the same length.

A member describes the data it would train on as an :class:`ObservedSchema` (after its
own column rules: renames, exclusions, anonymisation).  :func:`schema_differences`
compares the two and names each difference as (column, expected, found); the agent
runs it before anything is sent, and the aggregator runs it again at join on the
observed schema inside the member's signed data summary.  One function, so the two
sides cannot disagree on what "matches" means.

Pure: no I/O.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal

import msgspec

from fedsec.crypto.identity import canonical_json
from fedsec.errors import ConfigError

ColumnKind = Literal["numeric", "categorical"]
#: drop: rows missing the value are left out; impute: a member-local statistic (mean
#: for numbers, no category for categories) fills it; indicator: impute and add a 0/1
#: feature saying the value was missing.
MissingRule = Literal["drop", "impute", "indicator"]

#: Columns, categories and classes a schema may list.  Generous for tabular data
#: (a wide EHR export has a few hundred columns; ICD chapters are ~20 categories,
#: a country list ~250), small enough that a schema stays a readable config file and a
#: signed summary a small JSON body.
MAX_COLUMNS = 1000
MAX_CATEGORIES = 1000
MAX_NAME = 128

ColumnName = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME)]
Categories = Annotated[list[ColumnName], msgspec.Meta(max_length=MAX_CATEGORIES)]

#: Suffix of the 0/1 feature added for a column whose missing rule is ``indicator``.
MISSING_SUFFIX = "__missing"


class SchemaColumn(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One feature column of the federation schema."""

    name: ColumnName
    kind: ColumnKind = "numeric"
    unit: str = ""  # documentation and agreement: "years" and "months" are different columns
    missing: MissingRule = "drop"
    categories: Categories = []  # categorical only: the fixed categories, encoding order


class DataSchema(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[schema]`` of ``federation.toml``: what every member trains on."""

    label: ColumnName
    """Task table: the label column every member must have."""
    classes: Categories
    """Task table: the label's classes, fixed so every member maps them to the same index; a
    member may lack some."""
    columns: Annotated[list[SchemaColumn], msgspec.Meta(max_length=MAX_COLUMNS)]
    """Task table: the feature columns in model-input order, each with kind (`numeric`,
    `categorical`), unit, missing-value rule (`drop`, `impute`, `indicator`) and, if
    categorical, its fixed categories."""

    def fingerprint(self) -> str:
        """sha256 hex of the canonical JSON of the schema (units and rules included)."""
        return hashlib.sha256(canonical_json(msgspec.to_builtins(self))).hexdigest()

    def feature_names(self) -> list[str]:
        """The model's input features in order: a numeric column is one feature, a
        categorical column one per category (``name=category``), and an ``indicator``
        column adds ``name__missing``."""
        names: list[str] = []
        for col in self.columns:
            if col.kind == "numeric":
                names.append(col.name)
            else:
                names.extend(f"{col.name}={c}" for c in col.categories)
            if col.missing == "indicator":
                names.append(col.name + MISSING_SUFFIX)
        return names

    def check(self) -> None:
        """Refuse a schema that cannot be encoded.

        Raises:
            ConfigError: duplicate or label-named columns, a categorical column without
                categories (or a numeric one with some), duplicate categories, fewer
                than two classes.
        """
        problems: list[str] = []
        names = [c.name for c in self.columns]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            problems.append(f"columns listed twice: {dupes}")
        if self.label in names:
            problems.append(f"the label '{self.label}' is also a feature column")
        if not self.columns:
            problems.append("no feature columns")
        if len(set(self.classes)) != len(self.classes) or len(self.classes) < 2:
            problems.append(f"classes must be at least two distinct values, got {self.classes}")
        for col in self.columns:
            if col.kind == "categorical" and not col.categories:
                problems.append(f"column '{col.name}' is categorical but lists no categories")
            if col.kind == "numeric" and col.categories:
                problems.append(f"column '{col.name}' is numeric but lists categories")
            if len(set(col.categories)) != len(col.categories):
                problems.append(f"column '{col.name}' lists a category twice")
        if problems:
            raise ConfigError("schema: " + "; ".join(problems))


class ObservedColumn(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A column as a member's data holds it after its rules."""

    name: ColumnName
    kind: ColumnKind
    unit: str = ""
    categories: Categories = []  # categorical: the values present locally


class ObservedSchema(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What a member would train on: its used columns, label and local classes."""

    label: ColumnName
    classes: Categories
    columns: Annotated[list[ObservedColumn], msgspec.Meta(max_length=MAX_COLUMNS)]


class SchemaDifference(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One way a member's data differs from the federation schema."""

    column: str
    expected: str
    found: str

    def sentence(self) -> str:
        return f"column '{self.column}': expected {self.expected}, found {self.found}"


def schema_differences(expected: DataSchema, observed: ObservedSchema) -> list[SchemaDifference]:
    """Every difference between the federation schema and a member's data.

    A member may lack categories or classes (a small hospital without a rare diagnosis
    still trains); it may not have values the federation does not know, a column of
    another kind or unit, a missing column or an extra one.
    """
    diffs: list[SchemaDifference] = []
    if observed.label != expected.label:
        diffs.append(SchemaDifference(expected.label, "the label column", "no such label"))
    unseen = [c for c in observed.classes if c not in expected.classes]
    if unseen:
        diffs.append(
            SchemaDifference(expected.label, f"classes within {expected.classes}", f"also {unseen}")
        )
    found = {c.name: c for c in observed.columns}
    for col in expected.columns:
        have = found.pop(col.name, None)
        if have is None:
            diffs.append(SchemaDifference(col.name, f"a {col.kind} column", "no such column"))
            continue
        if have.kind != col.kind:
            diffs.append(SchemaDifference(col.name, col.kind, have.kind))
        elif col.kind == "categorical":
            extra = [c for c in have.categories if c not in col.categories]
            if extra:
                diffs.append(
                    SchemaDifference(
                        col.name, f"categories within {col.categories}", f"also {extra}"
                    )
                )
        if have.unit != col.unit:
            diffs.append(SchemaDifference(col.name, f"unit {col.unit!r}", f"unit {have.unit!r}"))
    for name, have in found.items():
        diffs.append(SchemaDifference(name, "no such column", f"a {have.kind} column"))
    return diffs
