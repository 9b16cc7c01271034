"""Per-column statistics of a source, accumulated chunk by chunk in bounded memory.

Typing is by content, not by declared type: a text cell that parses as a number is a
number, so CSV and SQL ``VARCHAR`` exports are profiled alike.  A column is
``numeric`` when every present value is a number, ``text`` when none is, and
``mixed`` otherwise (the first row of each kind is kept so the owner can look).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from fedsec.data.limits import MAX_DISTINCT, MISSING_TOKENS, VALUE_SAMPLE

# Every case variant, so matching needs no lower-casing pass over the column.
_MISSING = pa.array(
    sorted({v for t in MISSING_TOKENS for v in (t, t.upper(), t.capitalize(), t.title())}),
    type=pa.string(),
)
# What float() accepts, in the forms exports write: 12, -3.5, .5, 1e-3, 1,234 is text.
NUMBER_PATTERN = r"^[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?$"


@dataclass
class ColumnProfile:
    """What the data map says about one column."""

    name: str
    rows: int = 0
    missing: int = 0
    numeric: int = 0  # present values that are numbers
    text: int = 0  # present values that are not
    first_numeric_row: int | None = None
    first_text_row: int | None = None
    minimum: float | None = None
    maximum: float | None = None
    counts: Counter[str] | None = field(default_factory=Counter)  # None: over MAX_DISTINCT
    sample: list[str] = field(default_factory=list)  # for sensitive-value detection

    @property
    def kind(self) -> str:
        if self.numeric and self.text:
            return "mixed"
        if self.numeric:
            return "numeric"
        if self.text:
            return "text"
        return "empty"

    @property
    def missing_rate(self) -> float:
        return self.missing / self.rows if self.rows else 0.0

    @property
    def distinct(self) -> int | None:
        """Exact distinct count, or None when above :data:`MAX_DISTINCT`."""
        return None if self.counts is None else len(self.counts)

    def add(self, values: pa.Array, first_row: int) -> None:
        """Account for one chunk of this column whose first record is ``first_row``."""
        self.rows += len(values)
        text = _as_text(values)
        present_mask = _present(text)
        present = pc.filter(text, present_mask)
        self.missing += len(text) - len(present)
        if not len(present):
            return
        numbers = self._all_numbers(present)
        if numbers is not None:  # the common case of a clean numeric column: one kernel
            is_number = pa.array(np.ones(len(present), dtype=bool))
            n_num = len(present)
        else:
            is_number = pc.match_substring_regex(present, NUMBER_PATTERN)
            n_num = int(pc.sum(is_number).as_py() or 0)
            if n_num:
                numbers = pc.cast(pc.filter(present, is_number), pa.float64())
        self.numeric += n_num
        self.text += len(present) - n_num
        if numbers is not None and n_num:
            bounds = pc.min_max(numbers).as_py()
            lo, hi = bounds["min"], bounds["max"]
            self.minimum = lo if self.minimum is None else min(self.minimum, lo)
            self.maximum = hi if self.maximum is None else max(self.maximum, hi)
        if (self.first_numeric_row is None and n_num) or (
            self.first_text_row is None and n_num < len(present)
        ):
            self._first_rows(present_mask, is_number, first_row)
        self._count(present)
        if len(self.sample) < VALUE_SAMPLE:
            take = VALUE_SAMPLE - len(self.sample)
            self.sample.extend(str(v) for v in present.slice(0, take).to_pylist())

    def _all_numbers(self, present: pa.Array) -> pa.Array | None:
        """Every value as a float, when the column has held only numbers so far and
        this chunk does too (a failed cast is slower than the regex: tried only then)."""
        if self.text:
            return None
        try:
            numbers = pc.cast(present, pa.float64())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return None
        # the cast also takes "inf" and "nan", which the number pattern does not
        if pc.any(pc.is_nan(numbers)).as_py() or pc.any(pc.is_inf(numbers)).as_py():
            return None
        return numbers

    def _first_rows(self, present_mask: pa.Array, is_number: pa.Array, first_row: int) -> None:
        rows = np.flatnonzero(present_mask.to_numpy(zero_copy_only=False)) + first_row
        flags = is_number.to_numpy(zero_copy_only=False)
        if self.first_numeric_row is None and flags.any():
            self.first_numeric_row = int(rows[int(np.argmax(flags))])
        if self.first_text_row is None and not flags.all():
            self.first_text_row = int(rows[int(np.argmin(flags))])

    def _count(self, present: pa.Array) -> None:
        if self.counts is None:
            return
        counted = pc.value_counts(present)
        if len(counted) > MAX_DISTINCT:  # no need to merge what is over the limit alone
            self.counts = None
            return
        for value, n in zip(
            counted.field("values").to_pylist(), counted.field("counts").to_pylist(), strict=True
        ):
            self.counts[value] += n
        if len(self.counts) > MAX_DISTINCT:
            self.counts = None


def _as_text(values: pa.Array) -> pa.Array:
    """The column as trimmed text; integral floats written without ".0"."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        return pc.utf8_trim_whitespace(values.cast(pa.string()))
    if pa.types.is_floating(values.type):
        values = pc.if_else(pc.is_nan(values), None, values)
        integral = pc.equal(pc.floor(values), values)
        as_int = pc.if_else(integral, values, None).cast(pa.int64(), safe=False)
        return pc.coalesce(as_int.cast(pa.string()), values.cast(pa.string()))
    if pa.types.is_dictionary(values.type):
        return _as_text(values.dictionary_decode())
    if pa.types.is_binary(values.type) or pa.types.is_large_binary(values.type):
        return pc.utf8_trim_whitespace(values.cast(pa.string()))
    return values.cast(pa.string())


def _present(text: pa.Array) -> pa.Array:
    return pc.invert(pc.or_(pc.is_null(text), pc.is_in(text, value_set=_MISSING)))


def as_text(values: pa.Array) -> pa.Array:
    """A column as trimmed text with missing cells as nulls (the rules' view of it)."""
    text = _as_text(values)
    return pc.if_else(_present(text), text, None)
