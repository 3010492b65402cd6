"""The web page's charts, drawn here as SVG text: a chain's segment timeline (one bar a
segment against wall-clock time: queue wait, training, save after the signal, gap to the
next; coloured by outcome, the save striped, each with a tooltip of its job, reason and
output tail) and plots of points (epoch against time, a metric against epoch or step, a parameter
against a metric), each at its own size, an axis log-scaled where its values span a
decade or more, every label kept inside its chart. Every text that goes in is escaped;
nothing is fetched from anywhere.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from datetime import datetime
from html import escape
from typing import Optional

from chainrun.accounting import ChainAccount

# One colour per outcome, none shared with another outcome or with the queue wait and the
# gap; a segment's save after the signal is drawn in its outcome's colour, striped, so a
# segment that crashed while saving is the crash's colour from end to end.
OUTCOME_COLOURS = {
    "completed": "#2ca02c",
    "timeout": "#1f77b4",
    "preempted": "#9467bd",
    "cancelled": "#7f7f7f",
    "skipped": "#bcbd22",
    "fenced": "#98df8a",  # stopped by the fence, at no cost
    "running": "#17becf",
    "failed": "#d62728",
    "oom": "#e377c2",
    "node_fail": "#8c564b",
    "lost": "#393b79",
    "rejected": "#bd9e39",
}
FAILURE = OUTCOME_COLOURS["failed"]
OTHER = "#c49c94"  # a phase that has no colour of its own (a segment not started)
QUEUE, GAP = "#c7c7c7", "#f2e6c9"
_STRIPES = (
    '<defs><pattern id="stripes" width="6" height="6" patternUnits="userSpaceOnUse" '
    'patternTransform="rotate(45)"><rect width="3" height="6" fill="#fff" fill-opacity="0.55"/>'
    "</pattern></defs>"
)
_W, _ROW, _LEFT, _TOP = 800, 22, 46, 8
PLOT_W, PLOT_H = 440, 250  # a plot's size in pixels (its text at the style sheet's 11px)
CHAR = 6.6  # the width of a character of that text, about: what keeps a label inside
PAD = 0.06  # the share of an axis's range left free at each end


def colour(outcome: str) -> str:
    return OUTCOME_COLOURS.get(outcome, OTHER)


def legend(outcomes: Collection[str]) -> str:
    """The timeline's key: the queue wait, the save (striped), the gap, and each of
    ``outcomes`` in its colour."""
    shown = [("queued", QUEUE, ""), ("saving", "#8c8c8c", "url(#stripes)"), ("gap", GAP, "")]
    shown += [(k, c, "") for k, c in OUTCOME_COLOURS.items() if k in outcomes]
    return "".join(
        f'<span><svg class="swatch" viewBox="0 0 10 10"><rect width="10" height="10" fill="{c}"/>'
        + (f'<rect width="10" height="10" fill="{over}"/>' if over else "")
        + f"</svg>{escape(k)}</span>"
        for k, c, over in shown
    )


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
        f'aria-label="segment timeline" preserveAspectRatio="xMinYMin meet">{_STRIPES}'
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
                parts.append(rect(edge, edge + seg.saving, y, colour(seg.outcome), "saving"))
                parts.append(rect(edge, edge + seg.saving, y, "url(#stripes)", "stripes"))
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
        text = _clock(t, span)
        out.append(f'<text class="tick" {_anchor(x(t), text, _W)} y="{axis_y}">{text}</text>')
    out.append("</svg>")
    return "".join(out)


class Axis:
    """One axis of a plot: the values' range, padded so that no point sits on the frame,
    on a log scale when the values are all positive and span a decade or more (learning
    rates, losses), else a linear one."""

    def __init__(self, values: Sequence[float], may_log: bool = True) -> None:
        lo, hi = min(values), max(values)
        self.log = may_log and lo > 0 and hi / lo >= 10
        if self.log:
            lo, hi = math.log10(lo), math.log10(hi)
        if hi == lo:
            lo, hi = lo - 1, hi + 1
        pad = (hi - lo) * PAD
        self.lo, self.hi = lo - pad, hi + pad

    def share(self, v: float) -> float:
        """Where ``v`` lies, from 0 (the low end) to 1."""
        return ((math.log10(v) if self.log else v) - self.lo) / (self.hi - self.lo)

    def ticks(self, count: int) -> list[float]:
        """About ``count`` round values in range: powers of ten on a log scale."""
        if not self.log:
            return _ticks(self.lo, self.hi, count)
        first, last = math.ceil(self.lo), math.floor(self.hi)
        if last - first < 1:  # less than two powers of ten in range: 1, 2 and 5 of each
            return [
                m * 10.0**e
                for e in range(first - 1, last + 1)
                for m in (1, 2, 5)
                if self.lo <= math.log10(m * 10.0**e) <= self.hi
            ]
        every = max(1, math.ceil((last - first + 1) / count))
        return [10.0**e for e in range(first, last + 1, every)]


def number(v: float) -> str:
    """A tick's value, short: three significant digits, ``1e-4`` rather than ``0.0001``."""
    text = f"{v:.2e}" if v and abs(v) < 1e-3 else f"{v:.3g}"
    if "e" in text:
        mantissa, exponent = text.split("e")
        if "." in mantissa:
            mantissa = mantissa.rstrip("0").rstrip(".")
        text = f"{mantissa}e{int(exponent)}"
    return text


def _anchor(x: float, text: str, width: float) -> str:
    """``x`` and the anchor that keep a tick's ``text`` inside ``width``: centred, else
    flush against the edge it would cross."""
    half = len(text) * CHAR / 2
    if x + half > width - 2:
        return f'x="{x:.1f}" text-anchor="end"'
    if x - half < 2:
        return f'x="{x:.1f}" text-anchor="start"'
    return f'x="{x:.1f}" text-anchor="middle"'


def plot(
    points: Sequence[tuple[float, float]],
    xlabel: str,
    ylabel: str,
    ident: str,
    xtime: bool = False,
    labels: Optional[Sequence[str]] = None,
) -> str:
    """A line of points (a scatter when ``labels`` name each point: its tooltip), with
    axes, drawn at its own size (``PLOT_W`` by ``PLOT_H`` pixels, smaller only on a narrow
    screen); ``xtime``: x is a wall-clock time."""
    w, h, bottom = PLOT_W, PLOT_H, 34
    head = (
        f'id="{escape(ident)}" class="chart plot" viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img"'
    )
    out = [f'<svg {head} aria-label="{escape(ylabel)} against {escape(xlabel)}"']
    if not points:
        out.append(f'><text x="{w / 2}" y="{h / 2}" text-anchor="middle">no points yet</text></svg>')
        return "".join(out)
    ax = Axis([p[0] for p in points], may_log=not xtime)
    ay = Axis([p[1] for p in points])
    out.append(
        f' data-xscale="{"log" if ax.log else "linear"}" data-yscale="{"log" if ay.log else "linear"}">'
    )
    yticks = [(t, number(t)) for t in ay.ticks(4)]
    left = 20 + CHAR * max(len(text) for _, text in yticks)  # room for the widest label
    base = h - bottom

    def px(v: float) -> float:
        return left + ax.share(v) * (w - left - 12)

    def py(v: float) -> float:
        return 10 + (1 - ay.share(v)) * (base - 10)

    out.append(f'<line x1="{left}" y1="{base}" x2="{w - 8}" y2="{base}" class="axis"/>')
    out.append(f'<line x1="{left}" y1="10" x2="{left}" y2="{base}" class="axis"/>')
    xs = [p[0] for p in points]
    for t in ax.ticks(4):
        text = _clock(t, max(xs) - min(xs)) if xtime else number(t)
        out.append(f'<text class="tick" {_anchor(px(t), text, w)} y="{base + 14}">{text}</text>')
    for t, text in yticks:
        out.append(f'<text class="tick" x="{left - 4}" y="{py(t) + 4:.1f}" text-anchor="end">{text}</text>')
    out.append(
        f'<text class="label" x="{(w + left) / 2}" y="{h - 4}" text-anchor="middle">{escape(xlabel)}</text>'
    )
    out.append(
        f'<text class="label" x="12" y="{base / 2}" transform="rotate(-90 12 {base / 2})" '
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
