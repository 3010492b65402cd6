"""The web page's charts, drawn here as SVG text: a chain's segment timeline (one bar a
segment against wall-clock time: queue wait, training, save after the signal, gap to the
next; coloured by outcome, each with a tooltip of its job, reason and output tail) and
plots of points (epoch against time, a metric against epoch or step, a parameter
against a metric). Every text that goes in is escaped; nothing is fetched from anywhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime
from html import escape
from typing import Optional

from chainrun.accounting import ChainAccount

# Colours by outcome: the failure colour for every ending that crashed.
FAILURE = "#d62728"
OUTCOME_COLOURS = {
    "completed": "#2ca02c",
    "timeout": "#1f77b4",
    "preempted": "#9467bd",
    "cancelled": "#7f7f7f",
    "skipped": "#bcbd22",
    "fenced": "#bcbd22",  # stopped by the fence, at no cost: like a skip
    "running": "#17becf",
    "failed": FAILURE,
    "oom": FAILURE,
    "node_fail": FAILURE,
    "lost": FAILURE,
    "rejected": FAILURE,
}
QUEUE, SAVE, GAP = "#c7c7c7", "#ff7f0e", "#f2e6c9"
_W, _ROW, _LEFT, _TOP = 800, 22, 46, 8


def colour(outcome: str) -> str:
    return OUTCOME_COLOURS.get(outcome, "#8c8c8c")


def _clock(at: float, span: float) -> str:
    return datetime.fromtimestamp(at).strftime("%H:%M:%S" if span < 86400 else "%m-%d %H:%M")


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About ``count`` round values from ``lo`` to ``hi``."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / count
    step = 10 ** math.floor(math.log10(raw))
    for mult in (1, 2, 5, 10):
        if raw <= step * mult:
            step *= mult
            break
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def timeline(acc: ChainAccount, details: Sequence[str], start: float, now: float) -> str:
    """The segments, one row each; ``details[i]`` is segment i's tooltip (job, reason, tail)."""
    stamps = [t for s in acc.segments for t in (s.submitted_at, s.started_at, s.ended_at) if t is not None]
    lo = min([start, *stamps])
    hi = max([now, *stamps, lo + 1])
    span = hi - lo
    width = _W - _LEFT - 10
    height = _TOP + _ROW * max(1, len(acc.segments)) + 24

    def x(t: float) -> float:
        return _LEFT + (t - lo) / span * width

    def rect(t0: float, t1: float, y: float, fill: str, part: str) -> str:
        w = max(1.5, x(t1) - x(t0))
        return (
            f'<rect class="{part}" x="{x(t0):.1f}" y="{y:.1f}" width="{w:.1f}" height="{_ROW - 6}" '
            f'fill="{fill}"/>'
        )

    out = [
        f'<svg id="timeline" class="chart" viewBox="0 0 {_W} {height}" role="img" '
        f'aria-label="segment timeline" preserveAspectRatio="xMinYMin meet">'
    ]
    for i, (seg, tip) in enumerate(zip(acc.segments, details)):
        y = _TOP + i * _ROW
        # The whole row answers hover and click, however thin the segment's bars.
        parts = [f'<rect class="row" x="0" y="{y - 3:.1f}" width="{_W}" height="{_ROW}" fill="transparent"/>']
        if seg.queued is not None and seg.started_at is not None:
            parts.append(rect(seg.started_at - seg.queued, seg.started_at, y, QUEUE, "queue"))
        if seg.started_at is not None and seg.training is not None:
            parts.append(
                rect(seg.started_at, seg.started_at + seg.training, y, colour(seg.outcome), "training")
            )
            if seg.saving:
                edge = seg.started_at + seg.training
                parts.append(rect(edge, edge + seg.saving, y, SAVE, "saving"))
        if seg.gap and seg.ended_at is not None:
            parts.append(rect(seg.ended_at, seg.ended_at + seg.gap, y, GAP, "gap"))
        out.append(
            f'<g class="segment" data-n="{seg.n}" data-outcome="{escape(seg.outcome)}" tabindex="0">'
            f"<title>{escape(tip)}</title>"
            f'<text x="{_LEFT - 6}" y="{y + _ROW - 10}" text-anchor="end">{seg.n}</text>'
            f"{''.join(parts)}</g>"
        )
    axis_y = _TOP + _ROW * max(1, len(acc.segments)) + 14
    for t in _ticks(lo, hi):
        out.append(
            f'<text class="tick" x="{x(t):.1f}" y="{axis_y}" text-anchor="middle">{_clock(t, span)}</text>'
        )
    out.append("</svg>")
    return "".join(out)


def plot(
    points: Sequence[tuple[float, float]],
    xlabel: str,
    ylabel: str,
    ident: str,
    xtime: bool = False,
    labels: Optional[Sequence[str]] = None,
) -> str:
    """A line of points (a scatter when ``labels`` name each point: its tooltip), with
    axes; ``xtime``: x is a wall-clock time."""
    w, h, left, bottom = 400, 220, 52, 34
    out = [
        f'<svg id="{escape(ident)}" class="chart plot" viewBox="0 0 {w} {h}" role="img" '
        f'aria-label="{escape(ylabel)} against {escape(xlabel)}">'
    ]
    if not points:
        out.append(f'<text x="{w / 2}" y="{h / 2}" text-anchor="middle">no points yet</text></svg>')
        return "".join(out)
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        y0, y1 = y0 - 1, y1 + 1

    def px(v: float) -> float:
        return left + (v - x0) / (x1 - x0) * (w - left - 12)

    def py(v: float) -> float:
        return 10 + (1 - (v - y0) / (y1 - y0)) * (h - bottom - 10)

    base = h - bottom
    out.append(f'<line x1="{left}" y1="{base}" x2="{w - 8}" y2="{base}" class="axis"/>')
    out.append(f'<line x1="{left}" y1="10" x2="{left}" y2="{base}" class="axis"/>')
    for t in _ticks(x0, x1, 4):
        text = _clock(t, x1 - x0) if xtime else f"{t:g}"
        out.append(f'<text class="tick" x="{px(t):.1f}" y="{base + 14}" text-anchor="middle">{text}</text>')
    for t in _ticks(y0, y1, 4):
        out.append(f'<text class="tick" x="{left - 4}" y="{py(t) + 4:.1f}" text-anchor="end">{t:.4g}</text>')
    out.append(
        f'<text class="label" x="{(w + left) / 2}" y="{h - 4}" text-anchor="middle">{escape(xlabel)}</text>'
    )
    out.append(
        f'<text class="label" x="12" y="{h / 2}" transform="rotate(-90 12 {h / 2})" '
        f'text-anchor="middle">{escape(ylabel)}</text>'
    )
    if labels is None:
        path = " ".join(f"{px(a):.1f},{py(b):.1f}" for a, b in points)
        out.append(f'<polyline points="{path}" class="line"/>')
    for i, (a, b) in enumerate(points):
        tip = labels[i] if labels is not None else f"{xlabel} {a:g}: {ylabel} {b:.6g}"
        if xtime and labels is None:
            tip = f"{_clock(a, 0)}: {ylabel} {b:.6g}"
        circle = f'<circle class="point" cx="{px(a):.1f}" cy="{py(b):.1f}" r="3">'
        out.append(f"{circle}<title>{escape(tip)}</title></circle>")
    out.append("</svg>")
    return "".join(out)
