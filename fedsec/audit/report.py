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

import importlib.metadata
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedsec.audit.reporting.charts import MAX_LEGEND_ENTRIES, PALETTE, bar_chart, line_chart
from fedsec.audit.reporting.markup import escape as _e
from fedsec.audit.reporting.markup import when as _when
from fedsec.audit.reporting.sections import (
    challenges_section,
    charts_section,
    data_summaries_section,
    events_section,
    federation_section,
    privacy_section,
    rounds_section,
    verification_section,
)
from fedsec.audit.reporting.summary import (
    MAX_VERDICTS_BYTES,
    LogSummary,
    RoundRow,
    read_entries,
    read_verdicts,
    summarize,
)
from fedsec.audit.verify import VerifyResult, verify_log

__all__ = [
    "MAX_LEGEND_ENTRIES",
    "MAX_VERDICTS_BYTES",
    "PALETTE",
    "LogSummary",
    "RoundRow",
    "bar_chart",
    "build_report",
    "line_chart",
    "read_entries",
    "read_verdicts",
    "render_report",
    "summarize",
]


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
        f"{verification_section(result, inputs or {})}"
        f"{federation_section(summary)}"
        f"{rounds_section(rows, summary.primary_metric()[0])}"
        f"{charts_section(summary, rows)}"
        f"{privacy_section(summary)}"
        f"{data_summaries_section(summary)}"
        f"{challenges_section(summary, verdicts)}"
        f"{events_section(summary)}"
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
