"""``fedsec audit report``: one self-contained HTML page a compliance officer can open offline.

The page holds the verification result (:func:`fedsec.audit.verify.verify_log` is
run first, and its verdict heads the page), a summary of the federation from the
genesis and roster entries, a table of every round attempt, four charts and the
outcome of any control-sample challenges.  Everything is inline: CSS in a
``<style>`` element, charts as inline SVG, no scripts, fonts, images or links to
fetch, so the file can be archived with the records and read on an air-gapped
machine.

The figures come from the log entries themselves (``round_spec``, ``accepted``,
``refused``, ``privacy_report``, ``aggregate``, ``model_version``, ``round_aborted``,
``challenge``, ``reveal``, and a homomorphic federation's ``he_context`` and
``he_decryption``, listed with the events).  The log is read leniently for display (a malformed
line is counted, not fatal), because a tampered log must still produce a report
that says FAILED; only what :func:`verify_log` accepted is vouched for, and the
page says so when verification failed.  Every string taken from the log or from
the verdicts file is HTML-escaped.
"""

from __future__ import annotations

import html
import importlib.metadata
import json
import math
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from fedsec.audit.verify import VerifyResult, verify_log
from fedsec.errors import ConfigError, FedsecError
from fedsec.protocol import wire
from fedsec.protocol.log import MAX_LINE_BYTES
from fedsec.protocol.log_entries import (
    AcceptedEntry,
    AggregateEntry,
    AlertEntry,
    ArchivePrunedEntry,
    ChallengeEntry,
    GenesisEntry,
    HeadEntry,
    ModelVersionEntry,
    QuarantineEntry,
    RefusedEntry,
    RevealEntry,
    RollbackEntry,
    RoundAbortedEntry,
    decode_body,
    encode_body,
)
from fedsec.protocol.roster import RosterEntry

# A verdicts file lists one verdict per challenged (member, round); 64 MiB is far more
# than any real audit produces and bounds what a wrong file can cost to parse.
MAX_VERDICTS_BYTES = 64 << 20
# Chart legends beyond this many members would crowd out the plot; the rest are counted.
MAX_LEGEND_ENTRIES = 12
# Okabe-Ito colours: distinguishable with the common colour-vision deficiencies.
PALETTE = (
    "#0072B2",
    "#E69F00",
    "#009E73",
    "#D55E00",
    "#CC79A7",
    "#56B4E9",
    "#999933",
    "#000000",
)


#: The entries that belong to one round attempt (``round``, ``attempt``).
RoundKeyed = (
    wire.RoundSpec
    | AcceptedEntry
    | RefusedEntry
    | wire.PrivacyReport
    | AggregateEntry
    | RoundAbortedEntry
)


def _e(value: Any) -> str:
    """HTML-escape anything for text or attribute context."""
    return html.escape(str(value), quote=True)


# -- reading the log for display ------------------------------------------------------------------


@dataclass
class RoundRow:
    """One round attempt as the log records it."""

    round: int
    attempt: int
    status: str = "open"  # open | closed | aborted
    cohort: int = 0
    survivors: int | None = None
    dropped: list[str] = field(default_factory=list)
    accepted: int = 0  # contributions (masked inputs) accepted
    refused: int = 0  # contributions refused
    model_version: int | None = None
    accuracy: float | None = None
    epsilon_max: float | None = None
    spec_time: float | None = None
    last_message_time: float | None = None
    close_time: float | None = None
    detail: str = ""

    @property
    def duration_s(self) -> float | None:
        """Cohort fixed (signed spec) to round closed or aborted."""
        if self.spec_time is None or self.close_time is None:
            return None
        return self.close_time - self.spec_time

    @property
    def aggregation_s(self) -> float | None:
        """Last accepted message to the aggregate entry: unmasking, model update, validation."""
        if self.status != "closed" or self.last_message_time is None or self.close_time is None:
            return None
        return self.close_time - self.last_message_time


@dataclass
class LogSummary:
    """What the report shows, gathered from the log entries."""

    entries: int = 0
    unreadable: int = 0  # lines that are not a JSON log entry
    first_time: float | None = None
    last_time: float | None = None
    genesis: GenesisEntry | None = None
    roster: dict[str, RosterEntry] = field(default_factory=dict)
    rounds: dict[tuple[int, int], RoundRow] = field(default_factory=dict)
    # member -> round -> (epsilon, dataset, delta), the last report of each round
    epsilon: dict[str, dict[int, tuple[float, str, float]]] = field(default_factory=dict)
    dp: dict[str, Any] = field(default_factory=dict)  # from the latest round spec
    data_summaries: dict[str, wire.DataSummary] = field(default_factory=dict)  # latest each
    challenges: list[ChallengeEntry] = field(default_factory=list)
    quarantines: list[QuarantineEntry] = field(default_factory=list)
    reveals: set[tuple[int, int, str, str]] = field(default_factory=set)
    events: list[tuple[int, str, str]] = field(default_factory=list)  # (index, kind, text)
    last_head: tuple[int, str] | None = None  # (index, signed hash)
    latest_version: int | None = None


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def read_entries(log_path: Path) -> tuple[list[dict[str, Any]], int]:
    """Every line of the log that parses as an entry, and how many did not."""
    docs: list[dict[str, Any]] = []
    unreadable = 0
    with Path(log_path).open("rb") as fh:
        for raw in fh:
            if len(raw) > MAX_LINE_BYTES:
                unreadable += 1
                continue
            try:
                doc = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError):
                unreadable += 1
                continue
            if isinstance(doc, dict) and isinstance(doc.get("body"), dict) and "kind" in doc:
                docs.append(doc)
            else:
                unreadable += 1
    return docs, unreadable


def summarize(docs: Iterable[dict[str, Any]]) -> LogSummary:
    """Gather the report's figures; an entry with unexpected fields is skipped."""
    s = LogSummary()
    for doc in docs:
        s.entries += 1
        t = _num(doc.get("time"))
        if t is not None:
            s.first_time = t if s.first_time is None else min(s.first_time, t)
            s.last_time = t if s.last_time is None else max(s.last_time, t)
        try:
            _add(s, doc, t)
        except (FedsecError, KeyError, TypeError, ValueError, AttributeError):
            s.events.append((_index(doc), "unreadable", f"{doc.get('kind')} entry not understood"))
    return s


def _index(doc: dict[str, Any]) -> int:
    value = doc.get("index")
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


def _row(s: LogSummary, body: RoundKeyed) -> RoundRow:
    key = (body.round, body.attempt)
    if key not in s.rounds:
        s.rounds[key] = RoundRow(*key)
    return s.rounds[key]


def _add(s: LogSummary, doc: dict[str, Any], t: float | None) -> None:
    """Take one entry into the summary.

    Raises:
        IntegrityError: its body does not match its kind (or the kind is unknown).
    """
    kind = str(doc["kind"])
    match decode_body(kind, doc["body"]):
        case GenesisEntry() as genesis:
            s.genesis = genesis
        case RosterEntry() as member:
            s.roster[member.agent_id] = member
        case wire.RoundSpec() as spec:
            row = _row(s, spec)
            row.cohort = len(spec.cohort)
            row.spec_time = t
            s.dp = {
                **msgspec.to_builtins(spec.dp),
                "training": msgspec.to_builtins(spec.training),
                "secure_sum": spec.secure_sum,
                "quant_bits": spec.quant_bits,
                "clip_norm": spec.clip_norm,
            }
        case AcceptedEntry() as accepted:
            row = _row(s, accepted)
            row.last_message_time = t
            if accepted.stage == "masked_input":
                row.accepted += 1
        case RefusedEntry() as refused:
            # an aggregate entry stands for the `suppressed` refusals not logged one by one
            _row(s, refused).refused += 1 if refused.suppressed is None else refused.suppressed
        case wire.PrivacyReport() as report:
            _add_privacy_report(s, report)
        case wire.DataSummary() as data:
            s.data_summaries[data.member] = data
        case AggregateEntry() as aggregate:
            row = _row(s, aggregate)
            row.status, row.close_time = "closed", t
            row.survivors = len(aggregate.survivors)
            row.dropped = list(aggregate.dropped)
        case RoundAbortedEntry() as aborted:
            row = _row(s, aborted)
            row.status, row.close_time, row.detail = "aborted", t, aborted.detail
            s.events.append((_index(doc), kind, f"round {row.round} attempt {row.attempt} aborted"))
        case ModelVersionEntry() as manifest:
            _add_model_version(s, manifest)
        case RollbackEntry() as rollback:
            text = (
                f"version {rollback.version} rolls back to the weights of "
                f"version {rollback.weights_of}: {rollback.note}"
            )
            s.events.append((_index(doc), kind, text))
        case AlertEntry() as alert:
            s.events.append((_index(doc), kind, json.dumps(encode_body(alert), sort_keys=True)))
        case ArchivePrunedEntry() as pruning:
            text = (
                f"archive of round(s) {pruning.rounds} deleted under retention "
                f"({pruning.retention_rounds} rounds kept; {len(pruning.objects)} objects); "
                "these rounds can no longer be re-aggregated"
            )
            s.events.append((_index(doc), kind, text))
        case ChallengeEntry() as challenge:
            s.challenges.append(challenge)
        case QuarantineEntry() as quarantine:
            s.quarantines.append(quarantine)
            text = (
                f"{quarantine.member} quarantined by {quarantine.issuer} since round "
                f"{quarantine.round}.{quarantine.attempt}; rollback offered to version "
                f"{quarantine.rollback_to}"
            )
            s.events.append((_index(doc), kind, text))
        case RevealEntry() as reveal:
            s.reveals.add((reveal.round, reveal.attempt, reveal.member, reveal.auditor))
        case wire.HeContextStatement() as context:
            text = (
                f"key custodian {context.custodian} published the public CKKS context "
                f"{context.context_sha256[:16]}… (N = {context.poly_modulus_degree}, moduli "
                f"{list(context.coeff_mod_bit_sizes)} bits, scale 2^{context.scale_bits})"
            )
            s.events.append((_index(doc), kind, text))
        case wire.DecryptionStatement() as decryption:
            text = (
                f"key custodian {decryption.custodian} decrypted the sum of "
                f"{len(decryption.contributors)} contributions of round {decryption.round} "
                f"attempt {decryption.attempt} ({', '.join(decryption.contributors)}); "
                f"plaintext {decryption.plaintext_sha256[:16]}…"
            )
            s.events.append((_index(doc), kind, text))
        case HeadEntry() as head:
            s.last_head = (_index(doc), head.signed_hash)


def _add_privacy_report(s: LogSummary, report: wire.PrivacyReport) -> None:
    row = _row(s, report)
    eps = _num(report.epsilon)
    if eps is not None:
        row.epsilon_max = eps if row.epsilon_max is None else max(row.epsilon_max, eps)
        delta = _num(report.delta) or 0.0
        s.epsilon.setdefault(report.member, {})[row.round] = (eps, report.dataset_id, delta)


def _add_model_version(s: LogSummary, manifest: ModelVersionEntry) -> None:
    version = manifest.version
    s.latest_version = version if s.latest_version is None else max(s.latest_version, version)
    if manifest.kind == "aggregate" and manifest.round is not None:
        closed = [
            r for r in s.rounds.values() if r.round == manifest.round and r.status == "closed"
        ]
        if closed:
            row = max(closed, key=lambda r: r.attempt)
            row.model_version = version
            row.accuracy = _num(manifest.metrics.get("accuracy"))


# -- verdicts -------------------------------------------------------------------------------------


def read_verdicts(path: Path) -> list[dict[str, Any]]:
    """Verdicts of ``fedsec audit check``: a JSON list of objects, or ``{"verdicts": [...]}``.

    Each verdict names ``member`` and ``round`` (``attempt`` optional), says ``passed``
    and lists the ``failed`` tests, with optional ``scores`` (test -> number).

    Raises:
        ConfigError: unreadable, too large, or not in that shape (the file is named).
    """
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"verdicts file {path}: cannot be read ({exc.strerror})") from None
    if len(raw) > MAX_VERDICTS_BYTES:
        raise ConfigError(f"verdicts file {path}: over {MAX_VERDICTS_BYTES} bytes")
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"verdicts file {path}: not JSON ({exc})") from None
    items = doc.get("verdicts") if isinstance(doc, dict) else doc
    if not isinstance(items, list) or not all(
        isinstance(v, dict) and "member" in v and "round" in v and "passed" in v for v in items
    ):
        raise ConfigError(
            f"verdicts file {path}: expected a list of objects with member, round and passed"
        )
    return items


# -- charts ---------------------------------------------------------------------------------------

_W, _H = 520, 260
_DASHES = ("", "7 4", "2 3", "9 3 2 3")
_ML, _MR, _MT, _MB = 52, 16, 40, 44


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi]."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    ticks = []
    v = start
    while v <= hi + step * 1e-9:
        ticks.append(round(v, 10))
        v += step
    if ticks[-1] < hi:
        ticks.append(round(v, 10))
    return ticks


def _fmt_tick(v: float) -> str:
    return f"{v:.0f}" if abs(v - round(v)) < 1e-9 else f"{v:g}"


def _frame(
    title: str, y_label: str, y_ticks: list[float], legend: Sequence[tuple[str, str]]
) -> list[str]:
    y0, y1 = y_ticks[0], y_ticks[-1]
    plot_h = _H - _MT - _MB
    parts = [
        f'<svg viewBox="0 0 {_W} {_H}" width="{_W}" '
        f'height="{_H}" role="img" aria-label="{_e(title)}">',
        f"<title>{_e(title)}</title>",
        f'<text x="{_ML}" y="16" class="ct">{_e(title)}</text>',
    ]
    for v in y_ticks:
        y = _MT + plot_h - (v - y0) / (y1 - y0) * plot_h
        parts.append(
            f'<line x1="{_ML}" x2="{_W - _MR}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
            f'<text x="{_ML - 6}" y="{y + 4:.1f}" class="tick" text-anchor="end">'
            f"{_fmt_tick(v)}</text>"
        )
    parts.append(
        f'<text transform="translate(12 {_MT + plot_h / 2:.0f}) rotate(-90)" class="axis" '
        f'text-anchor="middle">{_e(y_label)}</text>'
    )
    x = _ML
    shown = list(legend[:MAX_LEGEND_ENTRIES])
    for name, color in shown:
        parts.append(
            f'<rect x="{x}" y="24" width="10" height="10" fill="{color}"/>'
            f'<text x="{x + 14}" y="33" class="legend">{_e(name)}</text>'
        )
        x += 22 + 7 * len(name)
    if len(legend) > len(shown):
        parts.append(f'<text x="{x}" y="33" class="legend">+{len(legend) - len(shown)} more</text>')
    return parts


def bar_chart(
    title: str,
    labels: Sequence[str],
    series: Sequence[tuple[str, Sequence[float]]],
    y_label: str,
) -> str:
    """Grouped bars: one group per label, one bar per series."""
    colors = [PALETTE[i % len(PALETTE)] for i in range(len(series))]
    top = max((v for _, values in series for v in values), default=0.0)
    ticks = _ticks(0.0, max(top * 1.1, 1.0))  # headroom above the tallest bar
    parts = _frame(
        title, y_label, ticks, [(n, c) for (n, _), c in zip(series, colors, strict=True)]
    )
    if not labels:
        parts.append(f'<text x="{_W / 2}" y="{_H / 2}" class="empty">no rounds</text></svg>')
        return "".join(parts)
    plot_w, plot_h = _W - _ML - _MR, _H - _MT - _MB
    group = plot_w / len(labels)
    bar = min(28.0, group * 0.8 / max(len(series), 1))
    for i, label in enumerate(labels):
        gx = _ML + i * group + (group - bar * len(series)) / 2
        for j, ((name, values), color) in enumerate(zip(series, colors, strict=True)):
            v = values[i]
            h = v / ticks[-1] * plot_h
            parts.append(
                f'<rect x="{gx + j * bar:.1f}" y="{_MT + plot_h - h:.1f}" width="{bar - 1:.1f}" '
                f'height="{h:.1f}" fill="{color}"><title>{_e(label)} {_e(name)}: '
                f"{_fmt_tick(v)}</title></rect>"
            )
        if len(labels) <= 30 or i % math.ceil(len(labels) / 30) == 0:
            parts.append(
                f'<text x="{_ML + (i + 0.5) * group:.1f}" y="{_H - _MB + 16}" class="tick" '
                f'text-anchor="middle">{_e(label)}</text>'
            )
    parts.append(
        f'<text x="{_ML + plot_w / 2:.0f}" y="{_H - 6}" class="axis" text-anchor="middle">'
        "round</text></svg>"
    )
    return "".join(parts)


def line_chart(
    title: str,
    series: Sequence[tuple[str, Sequence[tuple[float, float]]]],
    y_label: str,
    y_min: float | None = None,
    y_max: float | None = None,
) -> str:
    """Lines with markers over rounds; ``series`` holds (name, [(round, value)]).

    Each series has its own colour and dash pattern, so members whose lines coincide
    (same data, same ε) stay distinguishable.
    """
    colors = [PALETTE[i % len(PALETTE)] for i in range(len(series))]
    points = [p for _, pts in series for p in pts]
    if not points:
        parts = _frame(title, y_label, [0.0, 1.0], [])
        parts.append(f'<text x="{_W / 2}" y="{_H / 2}" class="empty">no data</text></svg>')
        return "".join(parts)
    xs = [x for x, _ in points]
    ys = [y for _, y in points]
    lo = min(ys) if y_min is None else min(y_min, min(ys))
    ticks = _ticks(lo, max(ys) if y_max is None else max(y_max, max(ys)))
    x0, x1 = min(xs), max(xs)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    parts = _frame(
        title, y_label, ticks, [(n, c) for (n, _), c in zip(series, colors, strict=True)]
    )
    plot_w, plot_h = _W - _ML - _MR, _H - _MT - _MB

    def at(x: float, y: float) -> tuple[float, float]:
        return (
            _ML + 10 + (x - x0) / (x1 - x0) * (plot_w - 20),
            _MT + plot_h - (y - ticks[0]) / (ticks[-1] - ticks[0]) * plot_h,
        )

    for r in sorted(set(xs)):
        px, _ = at(r, ticks[0])
        if len(set(xs)) <= 30 or int(r) % math.ceil(len(set(xs)) / 30) == 0:
            parts.append(
                f'<text x="{px:.1f}" y="{_H - _MB + 16}" class="tick" text-anchor="middle">'
                f"{_fmt_tick(r)}</text>"
            )
    for i, ((name, pts), color) in enumerate(zip(series, colors, strict=True)):
        coords = [at(x, y) for x, y in sorted(pts)]
        if len(coords) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)
            dash = _DASHES[i % len(_DASHES)]
            dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
            parts.append(
                f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"'
                f"{dash_attr}/>"
            )
        for (x, y), (px, py) in zip(sorted(pts), coords, strict=True):
            parts.append(
                f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3.5" fill="{color}">'
                f"<title>{_e(name)}, round {_fmt_tick(x)}: {y:.4g}</title></circle>"
            )
    parts.append(
        f'<text x="{_ML + plot_w / 2:.0f}" y="{_H - 6}" class="axis" text-anchor="middle">'
        "round</text></svg>"
    )
    return "".join(parts)


# -- the page -------------------------------------------------------------------------------------

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;
 margin:0;color:#1d2430;background:#f4f6f9;font-size:14px;line-height:1.45}
main{max-width:1120px;margin:0 auto;padding:24px 28px 48px}
h1{font-size:22px;margin:0 0 4px}
h2{font-size:17px;margin:28px 0 10px;padding-bottom:4px;border-bottom:2px solid #d8dee8}
.sub{color:#5a6578;margin:0 0 18px}
.card{background:#fff;border:1px solid #d8dee8;border-radius:8px;padding:14px 18px;
 margin-bottom:14px}
.verdict{border-radius:8px;padding:14px 18px;margin:14px 0;font-size:15px}
.verdict b{font-size:18px;margin-right:8px}
.ok{background:#e6f4ea;border:1px solid #7cc08c;color:#14532d}
.failed{background:#fdecea;border:1px solid #e08a80;color:#7f1d1d}
.warn{background:#fff7e0;border:1px solid #e3c46b;color:#5b4500;border-radius:8px;
 padding:10px 14px;margin:10px 0}
table{border-collapse:collapse;width:100%;background:#fff}
th,td{padding:5px 9px;border-bottom:1px solid #e4e8ef;text-align:left;vertical-align:top}
th{background:#eef1f6;font-weight:600;font-size:13px}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}
table.kv th{width:230px;background:#f7f8fb}
.mono{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px;
 word-break:break-all}
.pill{display:inline-block;padding:0 8px;border-radius:10px;font-size:12px;font-weight:600}
.p-closed,.p-passed,.p-active{background:#e6f4ea;color:#14532d}
.p-aborted,.p-failed,.p-revoked{background:#fdecea;color:#7f1d1d}
.p-open,.p-pending{background:#eef1f6;color:#394457}
.charts{display:grid;grid-template-columns:repeat(auto-fit,minmax(520px,1fr));gap:14px}
.charts .card{padding:8px}
svg{width:100%;max-width:100%;height:auto;display:block}
svg .ct{font-size:13px;font-weight:600;fill:#1d2430}
svg .tick,svg .legend{font-size:11px;fill:#394457}
svg .axis{font-size:11px;fill:#5a6578}
svg .grid{stroke:#e4e8ef;stroke-width:1}
svg .empty{font-size:13px;fill:#8a94a6;text-anchor:middle}
.note{color:#5a6578;font-size:12px;margin-top:6px}
footer{color:#5a6578;font-size:12px;margin-top:32px}
@media print{body{background:#fff}.card{break-inside:avoid}main{padding:0}}
"""


def _version() -> str:
    try:
        return importlib.metadata.version("fedsec")
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def _fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _when(t: float | None) -> str:
    if t is None:
        return "–"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _key_cell(hex_key: Any) -> str:
    from fedsec.crypto.identity import key_id

    try:
        kid = key_id(bytes.fromhex(str(hex_key)))
    except (ValueError, FedsecError):  # a malformed key is shown as it stands
        return f'<span class="mono">{_e(hex_key)}</span>'
    return f'{_e(kid)}<br><span class="mono">{_e(hex_key)}</span>'


def _kv(rows: Iterable[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in rows)
    return f'<table class="kv">{body}</table>'


def _verification(result: VerifyResult, inputs: dict[str, str]) -> str:
    if result.ok:
        banner = (
            '<div class="verdict ok"><b>VERIFIED</b>every check holds: chain, signed heads, '
            "roster and signatures, archived messages, re-aggregation, model re-derivation, "
            "privacy reports and receipts.</div>"
        )
    else:
        banner = (
            f'<div class="verdict failed"><b>FAILED</b>{_e(result.problem)}</div>'
            '<div class="warn">Verification stopped at the first problem. The figures below '
            "are read from the log as it stands and are <b>not vouched for</b>.</div>"
        )
    counts = _kv(
        [
            ("entries checked", str(result.entries)),
            ("signed heads verified", str(result.heads)),
            ("rounds re-aggregated", str(result.rounds_verified)),
            ("model versions re-derived", str(result.models_verified)),
            ("privacy reports checked", str(result.privacy_reports)),
            ("receipts checked", str(result.receipts_checked)),
            *((k, _e(v)) for k, v in inputs.items()),
        ]
    )
    return f'<h2>Verification</h2>{banner}<div class="card">{counts}</div>'


def _federation(s: LogSummary) -> str:
    g = s.genesis
    server = g.server if g is not None else {}
    round_cfg = g.round if g is not None else {}
    dp = s.dp
    training = dp.get("training") if isinstance(dp.get("training"), dict) else None
    rows = [
        ("federation", _e(g.federation_id if g is not None else "–")),
        (
            "task",
            f"{_e(g.task)} (version {_e(g.task_version)})" if g is not None else "– (version –)",
        ),
        (
            "data schema fingerprint",
            f'<span class="mono">{_e(g.schema_fingerprint if g is not None else None)}</span>',
        ),
        ("aggregator key", _key_cell(g.aggregator_public_key if g is not None else None)),
        ("roster admin key", _key_cell(g.admin_public_key if g is not None else None)),
        (
            "server optimiser",
            f"{_e(server.get('optimizer', '–'))}, server learning rate "
            f"{_e(server.get('server_lr', '–'))}",
        ),
        (
            "rounds",
            f"{sum(1 for r in s.rounds.values() if r.status == 'closed')} closed of "
            f"{_e(round_cfg.get('rounds', '–'))} planned; cohort "
            f"{_e(round_cfg.get('min_agents', '–'))}–{_e(round_cfg.get('max_agents', '–'))} "
            f"members; secure summation {_e(round_cfg.get('secure_sum', '–'))}",
        ),
        (
            "differential privacy",
            (
                f"{'enabled' if dp.get('enabled') else 'disabled'}; noise multiplier "
                f"{_e(dp.get('noise_multiplier'))}, clipping norm {_e(dp.get('max_grad_norm'))},"
                f" δ = {_e(dp.get('delta'))}"
            )
            if dp
            else "–",
        ),
        (
            "local training",
            ", ".join(f"{_e(k)} {_e(v)}" for k, v in sorted(training.items())) if training else "–",
        ),
        ("latest model version", _e(s.latest_version if s.latest_version is not None else "–")),
        ("log", f"{s.entries} entries, {_when(s.first_time)} to {_when(s.last_time)}"),
    ]
    if s.unreadable:
        rows.append(("unreadable lines", f"<b>{s.unreadable}</b>"))
    if s.last_head is not None:
        rows.append(
            (
                "last signed head",
                f'entry {s.last_head[0]}, signing <span class="mono">{_e(s.last_head[1])}</span>',
            )
        )
    roster_rows = "".join(
        f"<tr><td>{_e(m)}</td><td>{_e(b.role)}</td>"
        f'<td><span class="pill p-{_e(b.status)}">{_e(b.status)}</span></td>'
        f"<td>{_key_cell(b.public_key)}</td>"
        f"<td>{_when(_num(b.added_at))}</td></tr>"
        for m, b in sorted(s.roster.items())
    )
    roster = (
        "<table><tr><th>member</th><th>role</th><th>status</th><th>key</th><th>added</th></tr>"
        f"{roster_rows}</table>"
        if roster_rows
        else "<p>no roster entries</p>"
    )
    return (
        f'<h2>Federation</h2><div class="card">{_kv(rows)}</div>'
        f'<h2>Roster</h2><div class="card">{roster}</div>'
    )


def _rounds_table(rows: list[RoundRow]) -> str:
    head = (
        "<tr><th class='n'>round</th><th class='n'>attempt</th><th>status</th>"
        "<th class='n'>cohort</th><th class='n'>survivors</th><th>dropped</th>"
        "<th class='n'>accepted</th><th class='n'>refused</th><th class='n'>model version</th>"
        "<th class='n'>accuracy</th><th class='n'>ε max</th><th class='n'>duration (s)</th>"
        "<th class='n'>aggregation (s)</th></tr>"
    )
    body = "".join(
        f'<tr id="round-{r.round}-{r.attempt}"><td class="n">{r.round}</td>'
        f'<td class="n">{r.attempt}</td>'
        f'<td><span class="pill p-{_e(r.status)}">{_e(r.status)}</span>'
        f"{'<br>' + _e(r.detail) if r.detail else ''}</td>"
        f'<td class="n">{r.cohort}</td>'
        f'<td class="n">{"–" if r.survivors is None else r.survivors}</td>'
        f"<td>{_e(', '.join(r.dropped)) or '–'}</td>"
        f'<td class="n">{r.accepted}</td><td class="n">{r.refused}</td>'
        f'<td class="n">{"–" if r.model_version is None else r.model_version}</td>'
        f'<td class="n">{_fmt(r.accuracy, 4)}</td><td class="n">{_fmt(r.epsilon_max)}</td>'
        f'<td class="n">{_fmt(r.duration_s, 2)}</td>'
        f'<td class="n">{_fmt(r.aggregation_s, 3)}</td></tr>'
        for r in rows
    )
    note = (
        '<p class="note">Times come from the log entries: duration is from the signed round '
        "spec (cohort fixed) to the aggregate or abort entry; aggregation is from the last "
        "accepted message to the aggregate entry (unmasking, model update and validation). "
        "Accepted and refused count contributions (masked inputs). ε max is the largest "
        "cumulative ε any member reported in the attempt.</p>"
    )
    if not rows:
        return '<h2>Rounds</h2><div class="card"><p>no rounds</p></div>'
    return f'<h2>Rounds</h2><div class="card"><table>{head}{body}</table>{note}</div>'


def _charts(s: LogSummary, rows: list[RoundRow]) -> str:
    by_round: dict[int, list[RoundRow]] = defaultdict(list)
    for r in rows:
        by_round[r.round].append(r)
    rounds = sorted(by_round)
    labels = [str(r) for r in rounds]
    final = {r: max(by_round[r], key=lambda x: x.attempt) for r in rounds}
    participants = bar_chart(
        "Participants per round",
        labels,
        [
            ("cohort", [float(final[r].cohort) for r in rounds]),
            ("survivors", [float(final[r].survivors or 0) for r in rounds]),
        ],
        "members",
    )
    contributions = bar_chart(
        "Contributions accepted / refused per round",
        labels,
        [
            ("accepted", [float(sum(x.accepted for x in by_round[r])) for r in rounds]),
            ("refused", [float(sum(x.refused for x in by_round[r])) for r in rounds]),
        ],
        "contributions",
    )
    accuracy = line_chart(
        "Validation accuracy per round",
        [
            (
                "accuracy",
                [(float(r), a) for r in rounds if (a := final[r].accuracy) is not None],
            )
        ],
        "accuracy",
        y_min=0.0,
        y_max=1.0,  # the whole scale: small changes are not drawn as large ones
    )
    epsilon = line_chart(
        "ε per member over rounds",
        [
            (member, [(float(r), eps) for r, (eps, _, _) in sorted(per_round.items())])
            for member, per_round in sorted(s.epsilon.items())
        ],
        "ε (cumulative)",
        y_min=0.0,
    )
    cards = "".join(f'<div class="card">{c}</div>' for c in (participants, contributions))
    cards += "".join(f'<div class="card">{c}</div>' for c in (accuracy, epsilon))
    return f'<h2>Charts</h2><div class="charts">{cards}</div>'


def _privacy(s: LogSummary) -> str:
    if not s.epsilon:
        return '<h2>Privacy</h2><div class="card"><p>no privacy reports</p></div>'
    rows = []
    for member, per_round in sorted(s.epsilon.items()):
        last = max(per_round)
        eps, dataset, delta = per_round[last]
        rows.append(
            f"<tr><td>{_e(member)}</td><td>{_e(dataset)}</td><td class='n'>{len(per_round)}</td>"
            f"<td class='n'>{last}</td><td class='n'>{eps:.4f}</td><td class='n'>{delta:g}</td>"
            "</tr>"
        )
    return (
        '<h2>Privacy</h2><div class="card"><table><tr><th>member</th><th>dataset</th>'
        "<th class='n'>rounds reported</th><th class='n'>last round</th>"
        "<th class='n'>ε spent</th><th class='n'>δ</th></tr>"
        f"{''.join(rows)}</table><p class='note'>ε is what each member reported, signed, after "
        "its last round; verification recomputes it from the logged noise, sampling rate and "
        "steps with an independent accountant.</p></div>"
    )


def _data_summaries(s: LogSummary) -> str:
    """Each member's latest signed data summary: what it declared about its data."""
    if not s.data_summaries:
        return ""
    rows = "".join(
        f"<tr><td>{_e(d.member)}</td><td class='n'>{_e(d.records)}</td>"
        f"<td>{_e(', '.join(f'{k}: {v}' for k, v in d.label_counts.items()))}</td>"
        f"<td class='n'>{_fmt(d.label_coverage)}</td>"
        f"<td class='n'>{_fmt(max(d.missing_rate.values(), default=0.0))}</td>"
        f"<td class='n'>{_fmt(d.quality_score)}</td>"
        f"<td class='n'>{_e(d.count_epsilon or 'exact')}</td>"
        f"<td class='mono'>{_e(d.schema_fingerprint[:16])}</td></tr>"
        for d in sorted(s.data_summaries.values(), key=lambda d: d.member)
    )
    return (
        "<h2>Data summaries</h2><div class='card'><table><tr><th>member</th>"
        "<th class='n'>records</th><th>label counts</th><th class='n'>label coverage</th>"
        "<th class='n'>worst missing rate</th><th class='n'>quality</th>"
        "<th class='n'>count noise ε</th><th>schema</th></tr>"
        f"{rows}</table></div>"
    )


def _challenges(s: LogSummary, verdicts: list[dict[str, Any]] | None) -> str:
    logged = ""
    if s.challenges:
        items = []
        for c in s.challenges:
            revealed = (c.round, c.attempt, c.member, c.auditor) in s.reveals
            items.append(
                f"<tr><td class='n'>{_e(c.round)}</td><td class='n'>{_e(c.attempt)}"
                f"</td><td>{_e(c.member)}</td><td>{_e(c.auditor)}</td>"
                f"<td class='n'>{_e(c.rate)}</td><td class='n'>{_e(c.beacon_index)}"
                f"</td><td><span class='pill p-{'passed' if revealed else 'pending'}'>"
                f"{'revealed' if revealed else 'awaiting reveal'}</span></td></tr>"
            )
        logged = (
            "<h3>Challenges in the log</h3><table><tr><th class='n'>round</th>"
            "<th class='n'>attempt</th><th>member</th><th>auditor</th><th class='n'>rate</th>"
            f"<th class='n'>beacon entry</th><th>reveal</th></tr>{''.join(items)}</table>"
        )
    if verdicts is None:
        found = "<h3>Verdicts</h3><p>none (no verdicts file was given)</p>"
    elif not verdicts:
        found = "<h3>Verdicts</h3><p>none (the verdicts file lists no challenge)</p>"
    else:
        rows = []
        for v in verdicts:
            passed = v.get("passed") is True
            failed = v.get("failed") or []
            scores = v.get("scores") if isinstance(v.get("scores"), dict) else {}
            assert isinstance(scores, dict)
            score_text = ", ".join(
                f"{_e(k)} {x:.3g}" if isinstance(x, int | float) else f"{_e(k)} {_e(x)}"
                for k, x in sorted(scores.items())
            )
            rows.append(
                f"<tr><td class='n'>{_e(v.get('round'))}</td>"
                f"<td class='n'>{_e(v.get('attempt', '–'))}</td><td>{_e(v.get('member'))}</td>"
                f"<td><span class='pill p-{'passed' if passed else 'failed'}'>"
                f"{'passed' if passed else 'FAILED'}</span></td>"
                f"<td>{_e(', '.join(map(str, failed)) if isinstance(failed, list) else failed)}"
                f"</td><td class='mono'>{score_text}</td></tr>"
            )
        bad = sum(1 for v in verdicts if v.get("passed") is not True)
        found = (
            f"<h3>Verdicts</h3><p>{len(verdicts)} checked, {bad} failed</p>"
            "<table><tr><th class='n'>round</th><th class='n'>attempt</th><th>member</th>"
            "<th>verdict</th><th>failed tests</th><th>scores</th></tr>"
            f"{''.join(rows)}</table>"
        )
    return (
        f'<h2>Control-sample challenges</h2><div class="card">{logged}{found}'
        f"{_quarantines(s)}</div>"
    )


def _quarantines(s: LogSummary) -> str:
    if not s.quarantines:
        return "<h3>Quarantined members</h3><p>none</p>"
    rows = "".join(
        f"<tr><td>{_e(q.member)}</td><td class='n'>{_e(q.round)}.{_e(q.attempt)}</td>"
        f"<td>{_e(', '.join(q.failed))}</td><td>{_e(q.issuer)}"
        f"{' (signed order)' if q.order is not None else ' (failed verdict)'}</td>"
        f"<td class='n'>{_e(q.rollback_to)}</td><td>{_e(q.reason)}</td></tr>"
        for q in s.quarantines
    )
    return (
        "<h3>Quarantined members</h3><table><tr><th>member</th><th class='n'>first failed "
        "round</th><th>failed tests</th><th>ordered by</th><th class='n'>rollback to "
        f"version</th><th>reason</th></tr>{rows}</table>"
    )


def _events(s: LogSummary) -> str:
    if not s.events:
        return ""
    rows = "".join(
        f"<tr><td class='n'>{i}</td><td>{_e(kind)}</td><td>{_e(text)}</td></tr>"
        for i, kind, text in s.events
    )
    return (
        "<h2>Aborts, rollbacks, alerts, archive pruning and decryptions</h2>"
        "<div class='card'><table><tr>"
        f"<th class='n'>entry</th><th>kind</th><th>what</th></tr>{rows}</table></div>"
    )


def render_report(
    summary: LogSummary,
    result: VerifyResult,
    *,
    inputs: dict[str, str] | None = None,
    verdicts: list[dict[str, Any]] | None = None,
    generated_at: float | None = None,
) -> str:
    """The HTML page for ``summary`` and its verification ``result``."""
    rows = [summary.rounds[k] for k in sorted(summary.rounds)]
    fid = summary.genesis.federation_id if summary.genesis else "unknown federation"
    status = "VERIFIED" if result.ok else "FAILED"
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>fedsec audit report: {_e(fid)} ({status})</title>"
        f"<style>{_CSS}</style></head><body><main>"
        f"<h1>Audit report: federation {_e(fid)}</h1>"
        f'<p class="sub">Generated {_when(generated_at or time.time())} by fedsec '
        f"{_e(_version())} from the transparency log and its archive.</p>"
        f"{_verification(result, inputs or {})}"
        f"{_federation(summary)}"
        f"{_rounds_table(rows)}"
        f"{_charts(summary, rows)}"
        f"{_privacy(summary)}"
        f"{_data_summaries(summary)}"
        f"{_challenges(summary, verdicts)}"
        f"{_events(summary)}"
        "<footer>Re-run the checks with <code>fedsec audit verify --workspace DIR</code> "
        "(or <code>--log</code>, <code>--archive</code>, <code>--models</code>, "
        "<code>--receipts</code>); the log format is documented in docs/audit-log.md."
        "</footer></main></body></html>\n"
    )


def build_report(
    log_path: Path,
    archive_dir: Path | None = None,
    models_root: Path | None = None,
    receipts: Sequence[Path] = (),
    aggregator_key: bytes | None = None,
    verdicts_path: Path | None = None,
) -> tuple[str, VerifyResult]:
    """Verify the log, then render the report; return (HTML, verification result).

    Raises:
        ConfigError: the verdicts file is unreadable or malformed.
    """
    verdicts = read_verdicts(verdicts_path) if verdicts_path is not None else None
    result = verify_log(log_path, archive_dir, models_root, receipts, aggregator_key)
    docs, unreadable = read_entries(log_path)
    summary = summarize(docs)
    summary.unreadable = unreadable
    inputs = {
        "log": str(log_path),
        "archive": str(archive_dir) if archive_dir is not None else "not given (no re-aggregation)",
        "models": str(models_root) if models_root is not None else "not given (no re-derivation)",
        "receipts presented": str(len(receipts)),
        "aggregator key": aggregator_key.hex()
        if aggregator_key
        else "taken from the genesis entry",
    }
    return render_report(summary, result, inputs=inputs, verdicts=verdicts), result
