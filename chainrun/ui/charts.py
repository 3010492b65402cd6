"""The web page's charts. A chain's segment timeline is drawn here as SVG text (one bar a
segment against wall-clock time: queue wait, training, save after the signal, gap to the
next; coloured by outcome, the save striped, each with a tooltip of its job, reason and
output tail). The plots of points (epoch against time, a metric against epoch or step, a
parameter against a metric) are drawn in the browser by uPlot, the chart library vendored
in ``static/vendor/uplot`` (its version, licence and checksums there), from the data
written here into each plot's element, with what is decided here: its size, and which
axis is log-scaled (``spans_decades``). Every text that goes in is escaped; nothing is
fetched from anywhere.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Collection, Sequence
from datetime import datetime
from html import escape
from pathlib import Path
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
# A chain with several places: each segment's row begins with its place's mark, in the order
# the job file lists the places (Okabe and Ito's colour-blind-safe hues, none an outcome's).
PLACE_COLOURS = ("#e69f00", "#56b4e9", "#009e73", "#f0e442", "#0072b2", "#d55e00", "#cc79a7", "#000000")
FAILURE = OUTCOME_COLOURS["failed"]
OTHER = "#c49c94"  # a phase that has no colour of its own (a segment not started)
QUEUE, GAP = "#c7c7c7", "#f2e6c9"
_STRIPES = (
    '<defs><pattern id="stripes" width="6" height="6" patternUnits="userSpaceOnUse" '
    'patternTransform="rotate(45)"><rect width="3" height="6" fill="#fff" fill-opacity="0.55"/>'
    "</pattern></defs>"
)
_W, _ROW, _LEFT, _TOP = 800, 22, 46, 8
PLOT_W, PLOT_H = 440, 250  # a plot's size in pixels (smaller only on a narrow screen)
CHAR = 6.6  # the width of a character of the timeline's 11px text, about: what keeps a label inside
UPLOT = Path(__file__).parent / "static" / "vendor" / "uplot"  # the vendored chart library


def colour(outcome: str) -> str:
    return OUTCOME_COLOURS.get(outcome, OTHER)


def place_colour(places: Sequence[str], place: str) -> str:
    """The mark of ``place``, by its order among the chain's ``places``."""
    return PLACE_COLOURS[places.index(place) % len(PLACE_COLOURS)] if place in places else OTHER


def legend(outcomes: Collection[str], places: Sequence[str] = ()) -> str:
    """The timeline's key: the queue wait, the save (striped), the gap, each of ``outcomes``
    in its colour, and each of a chain's several ``places`` in its mark's."""
    shown = [("queued", QUEUE, ""), ("saving", "#8c8c8c", "url(#stripes)"), ("gap", GAP, "")]
    shown += [(k, c, "") for k, c in OUTCOME_COLOURS.items() if k in outcomes]
    shown += [(f"at {p}", place_colour(places, p), "") for p in places]
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


def _anchor(x: float, text: str, width: float) -> str:
    """``x`` and the anchor that keep a tick's ``text`` inside ``width``: centred, else
    flush against the edge it would cross."""
    half = len(text) * CHAR / 2
    if x + half > width - 2:
        return f'x="{x:.1f}" text-anchor="end"'
    if x - half < 2:
        return f'x="{x:.1f}" text-anchor="start"'
    return f'x="{x:.1f}" text-anchor="middle"'


def timeline(
    acc: ChainAccount,
    details: Sequence[str],
    start: float,
    now: float,
    where: Sequence[str] = (),
    places: Sequence[str] = (),
) -> str:
    """The segments, one row each; ``details[i]`` is segment i's tooltip (job, reason, tail);
    for a chain with several ``places``, ``where[i]`` is the place segment i went to, marked
    at the start of its row in that place's colour."""
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
        at = ""
        if places and i < len(where):
            fill = place_colour(places, where[i])
            mark = f'<rect class="place" x="4" y="{y:.1f}" width="8" height="{_ROW - 6}" fill="{fill}"/>'
            parts.append(mark)
            at = f' data-place="{escape(where[i])}"'
        out.append(
            f'<g class="segment" data-n="{seg.n}" data-outcome="{escape(seg.outcome)}"{at} tabindex="0">'
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


@functools.cache
def vendored() -> dict[str, Path]:
    """The chart library's files by the name the page asks for under ``/static/``: the
    name carries the version (``static/vendor/uplot/VERSION``), so that a browser may keep
    a file for good, and a new version is a new name."""
    version = (UPLOT / "VERSION").read_text(encoding="utf-8").strip()
    return {f"vendor/uplot-{version}/{name}": UPLOT / name for name in ("uPlot.min.css", "uPlot.iife.min.js")}


def spans_decades(values: Sequence[float]) -> bool:
    """An axis is log-scaled where its values are all positive and span a decade or more
    (learning rates, losses); the one place that rule is kept (the page's script follows
    what ``plot`` writes)."""
    return bool(values) and min(values) > 0 and max(values) / min(values) >= 10


def plot(
    points: Sequence[tuple[float, float]],
    xlabel: str,
    ylabel: str,
    ident: str,
    xtime: bool = False,
    labels: Optional[Sequence[str]] = None,
) -> str:
    """A plot's element: a line of points (a scatter when ``labels`` name each point,
    shown on hover), ``PLOT_W`` by ``PLOT_H`` pixels; ``xtime``: x is a wall-clock time
    (never log-scaled). Its data and scales go in as JSON (``data-plot``), which the page's
    script (``static/plots.js``) draws with uPlot; without script, a line of text says
    what it would show."""
    # uPlot takes x ascending, each a number; a y that is none (NaN, infinite) is a gap.
    order = sorted((i for i, p in enumerate(points) if math.isfinite(p[0])), key=lambda i: points[i][0])
    xs = [points[i][0] for i in order]
    ys = [points[i][1] for i in order]
    spec = {
        "width": PLOT_W,
        "height": PLOT_H,
        "xlabel": xlabel,
        "ylabel": ylabel,
        "xtime": xtime,
        "xlog": not xtime and spans_decades(xs),
        "ylog": spans_decades([y for y in ys if math.isfinite(y)]),
        "x": xs,
        "y": [y if math.isfinite(y) else None for y in ys],  # JSON has no NaN
        "labels": [labels[i] for i in order] if labels is not None else None,
    }
    said = "no points yet"
    if xs:
        said = f"{len(xs)} points of {ylabel} against {xlabel} (the plot needs JavaScript)"
    return (
        f'<div id="{escape(ident)}" class="plot" role="img" aria-label="{escape(ylabel)} against '
        f'{escape(xlabel)}" data-plot="{escape(json.dumps(spec))}">'
        f'<p class="unplotted">{escape(said)}</p></div>'
    )
