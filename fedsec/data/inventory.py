"""The data map of one member: what each source holds and what the rules do with it.

Per source and column: kind, count, missing rate, distinct count, range or
categories, detected sensitive data, and what the rules do (kept, excluded, dropped,
hashed, generalised); per source the rows read.  When the federation schema is known,
also which columns train, the label distribution, and the rows kept and dropped by the
selection rules with the reason.  It works before any rule exists (its first use is to
help write them) and after (to show what they keep).  An image folder's inventory
(:mod:`fedsec.data.images`) is rendered here too, under ``images``.

The map stays with the owner: it holds category values and row numbers of this
member's data.  Only the data summary (:mod:`fedsec.data.summary`) leaves.
"""

from __future__ import annotations

import html
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fedsec.data import rules as column_rules
from fedsec.data.images import render_image_inventory
from fedsec.data.limits import CATEGORIES_SHOWN, MAX_DISTINCT
from fedsec.data.profile import ColumnProfile
from fedsec.data.sensitive import detect
from fedsec.data.settings import ColumnRules
from fedsec.data.sources import Source
from fedsec.data.table import build_table
from fedsec.errors import FedsecError
from fedsec.protocol.data_schema import DataSchema


def profile_source(source: Source) -> tuple[list[ColumnProfile], int]:
    """Every column's profile and the row count, in one streamed pass.

    Raises:
        ConfigError: the source cannot be read (naming it and the row).
    """
    profiles: dict[str, ColumnProfile] = {}
    rows = 0
    # Arrow's kernels release the GIL: the columns of a chunk are profiled in parallel.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for chunk in source.chunks():
            for name in chunk.columns:
                profiles.setdefault(name, ColumnProfile(name))
            work = [
                pool.submit(profiles[name].add, values, chunk.first_row)
                for name, values in chunk.columns.items()
            ]
            for done in work:
                done.result()
            rows += chunk.rows
    return list(profiles.values()), rows


def build_map(
    sources: Sequence[Source],
    rules: ColumnRules | None = None,
    schema: DataSchema | None = None,
    hash_key: bytes | None = None,
    label: str = "",
) -> dict[str, Any]:
    """The data map as plain JSON values.

    ``label``: the label column (after renaming) when there is no schema yet, so the map
    shows its distribution; the schema's label otherwise.

    Raises:
        ConfigError: a source cannot be read.
    """
    started = time.perf_counter()
    the_rules = rules or ColumnRules()
    used = set() if schema is None else {c.name for c in schema.columns} | {schema.label}
    label = schema.label if schema is not None else label
    out: dict[str, Any] = {"sources": [], "rules": rules is not None, "schema": schema is not None}
    for source in sources:
        profiles, rows = profile_source(source)
        actions = {a.column: a for a in column_rules.plan(the_rules, [p.name for p in profiles])}
        columns = [_column(p, actions[p.name], used, schema, label) for p in profiles]
        out["sources"].append({"name": source.name, "rows": rows, "columns": columns})
    if schema is not None:
        out["training"] = _training(sources, the_rules, schema, hash_key)
    out["seconds"] = round(time.perf_counter() - started, 3)
    return out


def _column(
    p: ColumnProfile,
    action: column_rules.RuleAction,
    used: set[str],
    schema: DataSchema | None,
    label: str,
) -> dict[str, Any]:
    finding = detect(p.name, p.sample)
    becomes = action.becomes
    if action.action.startswith(("excluded", "dropped")):
        role = "stays inside"
    elif becomes == label:
        role = "label"
    elif schema is None:
        role = "no schema yet"
    elif becomes in used:
        role = "feature"
    else:
        role = "not used (stays inside)"
    entry: dict[str, Any] = {
        "name": p.name,
        "kind": p.kind,
        "count": p.rows - p.missing,
        "missing_rate": round(p.missing_rate, 6),
        "distinct": p.distinct,
        "distinct_over": None if p.distinct is not None else MAX_DISTINCT,
        "rule": action.action,
        "becomes": becomes,
        "role": role,
        "sensitive": None
        if finding is None
        else {"category": finding.category, "by": finding.by, "evidence": finding.evidence},
    }
    if p.minimum is not None:
        entry["range"] = [p.minimum, p.maximum]
    if p.kind == "mixed":
        entry["first_numeric_row"] = p.first_numeric_row
        entry["first_text_row"] = p.first_text_row
    if p.counts is not None and p.kind != "numeric" and finding is None:
        top = p.counts.most_common(CATEGORIES_SHOWN)
        entry["categories"] = {str(k): v for k, v in top}
    if p.counts is not None and role == "label":
        entry["label_distribution"] = dict(sorted(p.counts.items()))
    if finding is not None and role in ("feature", "label"):
        entry["warning"] = "sensitive data would enter training; exclude, drop or anonymise it"
    return entry


def _training(
    sources: Sequence[Source], rules: ColumnRules, schema: DataSchema, key: bytes | None
) -> dict[str, Any]:
    try:
        table = build_table(sources, schema, rules, key)
    except FedsecError as exc:
        return {"refused": exc.detail}
    labels = {c: int((table.y == i).sum()) for i, c in enumerate(schema.classes)}
    return {
        "rows_read": table.selection.read,
        "rows_kept": table.selection.kept,
        "rows_dropped": dict(table.selection.dropped),
        "features": schema.feature_names(),
        "label_distribution": labels,
        "missing_rate": {k: round(v, 6) for k, v in table.missing_rate.items()},
        "fingerprint": table.fingerprint,
    }


# -- rendering --------------------------------------------------------------------------


def render_text(data_map: dict[str, Any]) -> str:
    """The data map for a terminal."""
    lines: list[str] = [render_image_inventory(i).rstrip() for i in data_map.get("images", [])]
    if lines:
        return "\n".join(lines) + "\n"
    for src in data_map["sources"]:
        lines.append(f"source {src['name']}: {src['rows']} rows, {len(src['columns'])} columns")
        for c in src["columns"]:
            distinct = c["distinct"] if c["distinct"] is not None else f">{c['distinct_over']}"
            flag = ""
            if c["sensitive"]:
                s = c["sensitive"]
                flag = f"  SENSITIVE {s['category']} (by {s['by']}: {s['evidence']})"
            lines.append(
                f"  {c['name']:<24} {c['kind']:<8} missing {c['missing_rate']:6.1%}  "
                f"distinct {distinct:<6} {c['rule']}; {c['role']}{flag}"
            )
            if c.get("warning"):
                lines.append(f"    ! {c['warning']}")
            if c.get("label_distribution"):
                lines.append(f"    label distribution: {c['label_distribution']}")
            if c["kind"] == "mixed":
                lines.append(
                    f"    ! mixed types: first number at row {c['first_numeric_row']}, "
                    f"first text at row {c['first_text_row']}"
                )
    training = data_map.get("training")
    if training is None:
        lines.append("no federation schema in [data.schema]: training selection not shown")
    elif "refused" in training:
        lines.append(f"training refused: {training['refused']}")
    else:
        lines.append(
            f"training: {training['rows_kept']} of {training['rows_read']} rows kept, "
            f"{len(training['features'])} features"
        )
        for reason, n in training["rows_dropped"].items():
            lines.append(f"  dropped {n}: {reason}")
        lines.append(f"  label distribution: {training['label_distribution']}")
    return "\n".join(lines) + "\n"


def render_html(data_map: dict[str, Any]) -> str:
    """The data map as one self-contained HTML page (no scripts, no external assets)."""
    e = html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>fedsec data map</title>",
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:.2em .5em;font-size:90%}"
        ".sens{background:#fde2e2}.warn{color:#a00}</style></head><body>",
        "<h1>Data map</h1><p>This page stays with the data owner.</p>",
    ]
    for folder in data_map.get("images", []):
        parts.append(f"<h2>{e(folder['root'])}</h2><pre>")
        parts.append(e(render_image_inventory(folder)) + "</pre>")
    for src in data_map["sources"]:
        parts.append(f"<h2>{e(src['name'])}</h2><p>{src['rows']} rows</p><table>")
        parts.append(
            "<tr><th>column</th><th>kind</th><th>count</th><th>missing</th><th>distinct</th>"
            "<th>range / categories</th><th>sensitive</th><th>rule</th><th>role</th></tr>"
        )
        for c in src["columns"]:
            sens = c["sensitive"]
            cls = " class='sens'" if sens else ""
            shown = c.get("range") or c.get("categories") or ""
            distinct = c["distinct"] if c["distinct"] is not None else f">{c['distinct_over']}"
            parts.append(
                f"<tr{cls}><td>{e(c['name'])}</td><td>{e(c['kind'])}</td><td>{c['count']}</td>"
                f"<td>{c['missing_rate']:.1%}</td><td>{distinct}</td><td>{e(str(shown))}</td>"
                f"<td>{e(sens['category'] + ' (' + sens['by'] + ')') if sens else ''}</td>"
                f"<td>{e(c['rule'])}</td><td>{e(c['role'])}"
                + (f" <span class='warn'>{e(c['warning'])}</span>" if c.get("warning") else "")
                + "</td></tr>"
            )
        parts.append("</table>")
    training = data_map.get("training")
    if training is not None:
        parts.append("<h2>Training selection</h2>")
        if "refused" in training:
            parts.append(f"<p class='warn'>{e(training['refused'])}</p>")
        else:
            parts.append(
                f"<p>{training['rows_kept']} of {training['rows_read']} rows kept; "
                f"{len(training['features'])} features.</p><ul>"
            )
            for reason, n in training["rows_dropped"].items():
                parts.append(f"<li>dropped {n}: {e(reason)}</li>")
            parts.append(
                f"</ul><p>label distribution: {e(str(training['label_distribution']))}</p>"
            )
    parts.append("</body></html>")
    return "\n".join(parts)
