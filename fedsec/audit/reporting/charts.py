"""The report's charts: grouped bars and lines over rounds, as inline SVG (no script,
font or image to fetch)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from fedsec.audit.reporting.markup import escape as _e

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

    parts.extend(_round_labels(sorted(set(xs)), at, ticks[0]))
    parts.extend(_lines(series, colors, at))
    parts.append(
        f'<text x="{_ML + plot_w / 2:.0f}" y="{_H - 6}" class="axis" text-anchor="middle">'
        "round</text></svg>"
    )
    return "".join(parts)


def _round_labels(
    rounds: list[float], at: Callable[[float, float], tuple[float, float]], y0: float
) -> list[str]:
    """The x axis's round labels (at most about 30 of them)."""
    parts = []
    for r in rounds:
        px, _ = at(r, y0)
        if len(rounds) <= 30 or int(r) % math.ceil(len(rounds) / 30) == 0:
            parts.append(
                f'<text x="{px:.1f}" y="{_H - _MB + 16}" class="tick" text-anchor="middle">'
                f"{_fmt_tick(r)}</text>"
            )
    return parts


def _lines(
    series: Sequence[tuple[str, Sequence[tuple[float, float]]]],
    colors: list[str],
    at: Callable[[float, float], tuple[float, float]],
) -> list[str]:
    """Each series as a dashed-by-index polyline with a titled marker per point."""
    parts = []
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
    return parts
