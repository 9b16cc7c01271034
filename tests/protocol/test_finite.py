"""Every float of every message and log body is finite, whichever the encoding (issue 32
item 6): NaN and ±infinity, put into any float field of any sample body, are refused by
the JSON decoder, by msgpack decoding with the shared check, by the log's reader and
by its writer, each naming the field.

The samples are :data:`tests.protocol.test_log_entries.SAMPLES`, one per log kind: the
wire structs members sign (privacy reports with declared charges, data summaries, round
specs, quarantine orders, the custodian's statements) and every log body.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsec.errors import IntegrityError, PayloadError
from fedsec.protocol import compact, wire
from fedsec.protocol.log import make_entry, parse_line
from fedsec.protocol.log_entries import LogBody, decode_body, kind_of
from tests.protocol.test_log_entries import SAMPLES, H

NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
Path = tuple[str | int, ...]


def _float_paths(doc: Any, path: Path = ()) -> Iterator[Path]:
    if isinstance(doc, float):
        yield path
    elif isinstance(doc, dict):
        for key, value in doc.items():
            yield from _float_paths(value, (*path, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            yield from _float_paths(value, (*path, i))


def _with(doc: dict[str, Any], path: Path, value: float) -> dict[str, Any]:
    changed = copy.deepcopy(doc)
    node: Any = changed
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    return changed


def _step(key: str | int) -> str:
    """A path step as fedsec names it: ``.name`` for an identifier, else ``[key]``."""
    if isinstance(key, str) and key.isidentifier():
        return f".{key}"
    return f"[{key!r}]"


def _shown(path: Path) -> str:
    return "$" + "".join(_step(p) for p in path)


CASES = [(name, body, written, p) for name, body, written in SAMPLES for p in _float_paths(written)]


def test_the_samples_hold_floats_of_every_kind_that_has_one() -> None:
    kinds = {kind_of(body) for _, body, _, _ in CASES}
    assert {"privacy_report", "data_summary", "round_spec", "aggregate", "challenge"} <= kinds
    # the declared charges of a privacy report are reached too
    assert any(p[:1] == ("unreported",) for _, _, _, p in CASES)


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(CASES), number=NON_FINITE)
def test_a_non_finite_number_in_any_float_field_is_refused_everywhere(
    case: tuple[str, LogBody, dict[str, Any], Path], number: float
) -> None:
    _, body, written, path = case
    kind, cls = kind_of(body), type(body)
    doc = _with(written, path, number)
    # JSON: NaN and Infinity are not JSON; 1e999 is, and overflows
    for text in (json.dumps(doc), json.dumps(doc).replace("Infinity", "1e999")):
        with pytest.raises(PayloadError):
            wire.decode(text.encode(), cls, max_bytes=1 << 20, what="message")
    # msgpack carries them: a range refuses NaN, the shared check everything left
    try:
        decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(doc), type=cls)
    except msgspec.ValidationError as exc:
        assert str(path[-1]) in str(exc) or isinstance(path[-1], int)
    else:
        with pytest.raises(
            PayloadError, match=re.escape(f"not a finite number - at `{_shown(path)}`")
        ):
            wire.check_finite(decoded, "message")
    # the log: read from a line, or decoded from a body, it is refused naming the field
    with pytest.raises(IntegrityError, match=re.escape(f"at `{_shown(path)}`")):
        decode_body(kind, doc)
    line = make_entry(7, H, 1796168255.0, body).line.replace(
        json.dumps(written, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode(),
        json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode(),
    )
    with pytest.raises(IntegrityError, match=r"log line 8: log entry 7: .* not a finite number"):
        parse_line(line, 8, "log")


@settings(max_examples=100, deadline=None)
@given(case=st.sampled_from(CASES), number=NON_FINITE)
def test_the_log_writer_never_writes_nan_or_infinity(
    case: tuple[str, LogBody, dict[str, Any], Path], number: float
) -> None:
    _, body, _, path = case
    bad = _replace_at(body, path, number)  # unchecked, as a bug upstream of the writer would
    with pytest.raises(ValueError, match="not a finite number"):
        make_entry(7, H, 1796168255.0, bad)
    with pytest.raises(ValueError, match="time"):
        make_entry(7, H, number, body)


def _replace_at(value: Any, path: Path, number: float) -> Any:
    """``value`` with the float at ``path`` set to ``number``, struct or builtins, without
    running any check (structs are rebuilt field by field, dicts and lists copied)."""
    if not path:
        return number
    head, rest = path[0], path[1:]
    if isinstance(value, msgspec.Struct):
        assert isinstance(head, str)
        inner = _replace_at(getattr(value, head), rest, number)
        fields = {f: getattr(value, f) for f in value.__struct_fields__}
        fields[head] = inner
        new = copy.copy(value)
        for f, v in fields.items():
            msgspec.structs.force_setattr(new, f, v)
        return new
    changed = copy.copy(value)
    changed[head] = _replace_at(value[head], rest, number)
    return changed


# -- the compact upload a member sends ----------------------------------------------------------

_REPORT = next(body for name, body, _ in SAMPLES if name == "privacy_report_declaring_charges")


@given(path=st.sampled_from(list(_float_paths(msgspec.to_builtins(_REPORT)))), number=NON_FINITE)
def test_a_compact_shares_upload_with_a_non_finite_report_number_is_refused(
    path: Path, number: float
) -> None:
    assert isinstance(_REPORT, wire.PrivacyReport)
    report = _replace_at(_REPORT, path, number)
    raw = compact.encode(wire.ShareKeysBody([wire.OutgoingShare("agent-2", "ab" * 40)], report))
    with pytest.raises(PayloadError) as refused:
        compact.to_body(raw, wire.ShareKeysBody, max_bytes=1 << 20, what="encrypted shares")
    assert str(path[-1]) in refused.value.detail, refused.value.detail
    # the same report with every number finite goes through
    body = compact.to_body(
        compact.encode(wire.ShareKeysBody([], _REPORT)),
        wire.ShareKeysBody,
        max_bytes=1 << 20,
        what="encrypted shares",
    )
    assert body.report == _REPORT


# -- the search itself ----------------------------------------------------------------------------

_LEAVES = st.one_of(
    st.integers(), st.text(max_size=4), st.booleans(), st.none(), st.floats(-1e9, 1e9)
)
_TREES = st.recursive(
    _LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=20,
)


@given(tree=_TREES)
def test_finite_trees_have_no_non_finite_number(tree: Any) -> None:
    assert wire.non_finite(tree) is None


@given(tree=_TREES.filter(lambda t: isinstance(t, list | dict) and len(t) > 0), data=st.data())
def test_the_path_found_is_where_the_number_is(tree: Any, data: st.DataObject) -> None:
    """One NaN planted anywhere in a tree of finite values is found, at its path."""
    node, steps = tree, []
    while True:
        keys = list(range(len(node))) if isinstance(node, list) else list(node)
        key = data.draw(st.sampled_from(keys))
        steps.append(key)
        if not isinstance(node[key], list | dict) or not node[key]:
            node[key] = math.nan
            break
        node = node[key]
    found = wire.non_finite(tree)
    assert found is not None and math.isnan(found[1])
    assert found[0] == _shown(tuple(steps))
