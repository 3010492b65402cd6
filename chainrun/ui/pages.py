"""The web page's HTML: the overview of every chain (sweeps grouped, each a collapsible
section), a chain's page (its timeline, curves, accounting, segments and job file), a
sweep's page (its configurations' best metrics in a sortable table, each metric's mean and
spread over repetitions per configuration, and a plot of a chosen parameter against a
chosen metric), and the confirmation before a cancel. Built from the
read model ``status`` uses, as text; every value from a chain (its name, reason, output
tail, job file) goes through ``escape``, and the page runs no inline script (the server
forbids it), so nothing a chain holds can become markup or script.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from html import escape
from typing import Optional
from urllib.parse import quote, urlencode

from chainrun import status as view
from chainrun.accounting import ChainAccount, SegmentAccount, account
from chainrun.decide.carry import carry_line
from chainrun.fields import format_duration
from chainrun.model import Chain, JobSpec, Progress
from chainrun.store import Glance
from chainrun.sweep import param_text
from chainrun.sweepstatus import lower_is_better, metric_names, scores, spread_text
from chainrun.text import duration
from chainrun.ui import charts

Log = Sequence[tuple[float, Progress]]


class Links:
    """Where the pages point (the session's token is in a cookie, not in the URLs)."""

    def __call__(self, path: str, **query: str) -> str:
        return escape(f"{path}?{urlencode(query)}" if query else path)

    def chain(self, chain_id: str) -> str:
        return self(f"/chain/{quote(chain_id, safe='')}")

    def sweep(self, name: str, **query: str) -> str:
        return self(f"/sweep/{quote(name, safe='')}", **query)


def layout(title: str, link: Links, main: str, live: bool = True) -> str:
    """A whole page: ``main`` is also what the page fetches again to update itself. It
    loads the chart library (``charts.vendored``), then the script that draws the plots
    with it, then the one that keeps the page current."""
    css, js = (link("/static/" + name) for name in charts.vendored())
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<meta name="referrer" content="no-referrer">'
        f"<title>{escape(title)} · chainrun</title>"
        f'<link rel="stylesheet" href="{css}"><link rel="stylesheet" href="{link("/static/ui.css")}">'
        f'<link rel="icon" href="{link("/static/icon.svg")}"></head>'
        f'<body data-live="{int(live)}">'
        f'<header><a class="home" href="{link("/")}">chainrun</a> <span id="live"></span></header>'
        f'<main id="main">{main}</main><script src="{js}"></script>'
        f'<script src="{link("/static/plots.js")}"></script><script src="{link("/static/ui.js")}"></script>'
        "</body></html>"
    )


def _trained_share(g: Glance, allocated: float, trained: float) -> str:
    """The share of the allocated time that trained, or ``-`` for a chain that has trained
    nothing: none of its segments ran, or it has saved no epoch past the one its checkpoint
    held at submission (it failed at once, or was cancelled before its first save): its
    segments' time from start to end was start-up, not a share that trained."""
    moved = g.epoch is not None and (g.baseline_epoch is None or g.epoch > g.baseline_epoch)
    return f"{trained / allocated:.0%}" if moved and allocated > 0 else "-"


def _progress(epoch: Optional[int], target: Optional[int]) -> str:
    if epoch is None:
        return "-"
    if not target:
        return f"epoch {epoch}"
    return f'<progress max="{target}" value="{min(epoch, target)}"></progress> {epoch}/{target}'


def _eta(g: Glance, now: float) -> str:
    seconds = view.eta(g, now)
    return "-" if seconds is None else duration(seconds)


_OVERVIEW_HEAD = (
    "<tr><th>chain</th><th>state</th><th>progress</th><th>ETA</th><th>failures</th><th>trained</th></tr>"
)


def _row(g: Glance, allocation: Optional[tuple[float, float]], link: Links, now: float) -> str:
    share = _trained_share(g, *(allocation or (0.0, 0.0)))
    return (
        f'<tr class="chain" data-id="{escape(g.id)}" data-state="{g.state.value}">'
        f'<td><a href="{link.chain(g.id)}">{escape(g.id)}</a></td>'
        f'<td class="state {g.state.value}">{escape(view.state_cell(g, now))}</td>'
        f"<td>{_progress(g.epoch, g.target_epoch)}</td><td>{_eta(g, now)}</td>"
        f"<td>{escape(view.failures_cell(g))}</td><td>{share}</td></tr>"
    )


def overview(
    chains: Sequence[Glance], allocations: Mapping[str, tuple[float, float]], link: Links, now: float
) -> str:
    """Every chain, one row each; a sweep's chains in a section of their own."""
    loose = [g for g in chains if not g.sweep]
    sweeps: dict[str, list[Glance]] = {}
    for g in chains:
        if g.sweep:
            sweeps.setdefault(g.sweep, []).append(g)
    counts: dict[str, int] = {}
    for g in chains:
        counts[g.state.value] = counts.get(g.state.value, 0) + 1
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no chains"
    out = [f'<h1>Chains</h1><p class="summary">{len(chains)} chains: {escape(summary)}</p>']
    if loose:
        rows = "".join(_row(g, allocations.get(g.id), link, now) for g in loose)
        out.append(f'<div class="scroll"><table class="chains">{_OVERVIEW_HEAD}{rows}</table></div>')
    for name, members in sweeps.items():
        done = sum(1 for g in members if g.state.value == "completed")
        rows = "".join(_row(g, allocations.get(g.id), link, now) for g in members)
        out.append(
            f'<details class="sweep" id="sweep-{escape(quote(name, safe=""))}" open><summary>'
            f"sweep {escape(name)}: {len(members)} chains, {done} completed "
            f'<a href="{link.sweep(name)}">compare</a></summary>'
            f'<div class="scroll"><table class="chains">{_OVERVIEW_HEAD}{rows}</table></div></details>'
        )
    return "".join(out)


def _tip(seg: SegmentAccount, chain: Chain) -> str:
    """What a segment's bar says on hover: job, outcome, times, reason, output tail."""
    stored = next(s for s in chain.segments if s.n == seg.n)
    lines = [
        f"segment {seg.n}: job {seg.job_id or '-'}, {seg.outcome}" + (" (charged)" if seg.charged else "")
    ]
    if chain.spec.places:  # several places: where it ran, and the checkpoint copied there first
        copied = (
            f"; checkpoint copied there in {duration(stored.copy_seconds)}" if stored.copy_seconds else ""
        )
        lines.append(f"at {stored.place or chain.spec.places[0].name}{copied}")
    for label, value in (
        ("queued", seg.queued),
        ("training", seg.training),
        ("saving", seg.saving),
        ("gap", seg.gap),
    ):
        if value is not None:
            lines.append(f"{label} {duration(value)}")
    if stored.reason:
        lines.append(stored.reason)
    lines += list(stored.tail)
    return "\n".join(lines)


def _seconds(value: Optional[float]) -> str:
    return "-" if value is None else escape(duration(value))


def _accounting(acc: ChainAccount, g: Glance) -> str:
    gpu = f"{acc.gpu_hours:.2f} ({acc.gpus} a job)" if acc.gpu_hours is not None else "none asked for"
    cells = (
        ("allocated", duration(acc.allocated)),
        ("trained", duration(acc.trained)),
        ("share trained", _trained_share(g, acc.allocated, acc.trained)),
        ("queued", duration(acc.queued)),
        ("saving", duration(acc.saving)),
        ("gaps", duration(acc.gaps)),
        ("GPU-hours", gpu),
    )
    items = "".join(f"<div><dt>{k}</dt><dd>{escape(v)}</dd></div>" for k, v in cells)
    return f'<dl class="totals" id="accounting">{items}</dl>'


def _segments_table(acc: ChainAccount, chain: Chain) -> str:
    rows = []
    for seg, stored in zip(acc.segments, chain.segments):
        tail = "".join(f"<div>{escape(line)}</div>" for line in stored.tail)
        rows.append(
            f'<tr data-n="{seg.n}"><td>{seg.n}</td><td>{escape(seg.job_id or "-")}</td>'
            f'<td class="outcome {escape(seg.outcome)}">{escape(seg.outcome)}</td>'
            f"<td>{_seconds(seg.queued)}</td><td>{_seconds(seg.training)}</td>"
            f"<td>{_seconds(seg.saving)}</td><td>{_seconds(seg.gap)}</td>"
            f'<td class="reason">{escape(stored.reason)}<div class="tail">{tail}</div></td></tr>'
        )
    head = (
        "<tr><th>seg</th><th>job</th><th>outcome</th><th>queued</th><th>training</th>"
        "<th>saving</th><th>gap</th><th>reason</th></tr>"
    )
    return f'<div class="scroll"><table class="segments">{head}{"".join(rows)}</table></div>'


def _metric_series(log: Log) -> dict[str, list[tuple[float, float]]]:
    """Each metric's values against epoch (else step), one point per epoch: its last value."""
    series: dict[str, dict[float, float]] = {}
    for _, p in log:
        x = p.epoch if p.epoch is not None else p.step
        if x is None:
            continue
        for name, value in p.metrics:
            series.setdefault(name, {})[float(x)] = value
    return {name: sorted(points.items()) for name, points in series.items()}


def epoch_points(log: Log) -> list[tuple[float, float]]:
    """Epoch against time: the first moment each epoch was seen."""
    seen: dict[int, float] = {}
    for at, p in log:
        if p.epoch is not None and p.epoch not in seen:
            seen[p.epoch] = at
    return sorted((at, float(epoch)) for epoch, at in seen.items())


def job_file(spec: JobSpec) -> str:
    """The job file as stored at submission, written out as TOML."""

    def value(v: object) -> str:
        return json.dumps(v) if not isinstance(v, tuple) else json.dumps(list(v))

    top = [
        ("name", spec.name),
        ("command", spec.command),
        ("workdir", spec.workdir),
        ("total_time", format_duration(spec.total_time)),
        ("walltime", format_duration(spec.walltime)),
        ("target_epoch", spec.target_epoch),
        ("max_failures", spec.max_failures),
        ("checkpoint_dir", spec.checkpoint_dir),
        ("signal", spec.signal),
        ("grace", format_duration(spec.grace)),
    ]
    lines = [f"{k} = {value(v)}" for k, v in top if v is not None]
    sched = spec.scheduler
    lines += ["", "[scheduler]", f"kind = {value(sched.kind)}"]
    for key, v in (("host", sched.host), ("queue", sched.queue), ("options", sched.options)):
        if v:
            lines.append(f"{key} = {value(v)}")
    if spec.env:
        lines += ["", "[env]", *(f"{k} = {value(v)}" for k, v in spec.env)]
    return "\n".join(lines)


def chain_page(
    chain: Chain, log: Log, link: Links, now: float, owed: Sequence[tuple[str, float]] = ()
) -> str:
    """A chain's own page (``owed``: its jobs whose cancel did not reach the scheduler)."""
    acc = account(chain, now)
    g = Glance.of(chain)
    actions = ""
    if not chain.state.final:
        actions = f'<a class="button danger" href="{link("/cancel", chain=chain.id)}">Cancel chain…</a>'
    sweep = ""
    if chain.spec.sweep_name:
        sweep = f' · sweep <a href="{link.sweep(chain.spec.sweep_name)}">{escape(chain.spec.sweep_name)}</a>'
    # Up to now while it runs; an ended chain's timeline ends where it did.
    until = chain.ended_at if chain.ended_at is not None else now
    names = [p.name for p in chain.spec.places]
    at = {s.n: s.place or names[0] for s in chain.segments} if names else {}
    where = [at[s.n] for s in acc.segments] if names else []
    timeline = charts.timeline(
        acc, [_tip(s, chain) for s in acc.segments], chain.created_at, until, where, names
    )
    legend = charts.legend({s.outcome for s in acc.segments}, [n for n in names if n in where])
    plots = [charts.plot(epoch_points(log), "time", "epoch", "epochs", xtime=True)]
    for i, (name, points) in enumerate(sorted(_metric_series(log).items())):
        plots.append(charts.plot(points, "epoch", name, f"metric-{i}"))
    reason = f'<p class="reason">{escape(chain.reason)}</p>' if chain.reason else ""
    problem = "" if chain.state.final else view.attention(g, now)
    if problem and problem != chain.reason:
        reason += f'<p class="problem" id="problem">{escape(problem)}</p>'

    if owed:
        reason += f'<p class="problem" id="cancel-owed">{escape(view.owed_line(owed, now))}</p>'
    off = "" if chain.state.final else carry_line(chain.spec)
    if off:
        reason += f'<p class="note" id="self-queue">{escape(off)}</p>'
    return (
        f'<h1 class="chain-id">{escape(chain.id)}</h1>'
        f'<p><span class="state {chain.state.value}" id="state">{escape(view.state_cell(g, now))}</span>'
        f" · {_progress(g.epoch, g.target_epoch)} · ETA {_eta(g, now)} · failures "
        f"{escape(view.failures_cell(g))}{sweep} {actions}</p>{reason}"
        f"<h2>Where the time went</h2>{_accounting(acc, g)}"
        f'<figure>{timeline}<figcaption class="legend">{legend}</figcaption></figure>'
        f'<pre id="detail" class="detail" hidden></pre>'
        f'<h2>Training</h2><div class="plots">{"".join(plots)}</div>'
        f"<h2>Segments</h2>{_segments_table(acc, chain)}"
        f'<h2>Job file</h2><pre class="jobfile">{escape(job_file(chain.spec))}</pre>'
    )


def _best(ranges: Mapping[str, tuple[float, float]], chain: Chain) -> dict[str, float]:
    """Each metric's best value over the chain's progress records (``ranges``: the lowest
    and highest of each), or its latest where none was recorded."""
    best = {name: low if lower_is_better(name) else high for name, (low, high) in ranges.items()}
    for name, value in chain.latest.metrics:
        best.setdefault(name, value)
    return best


def sweep_page(
    name: str,
    chains: Sequence[Chain],
    ranges: Mapping[str, Mapping[str, tuple[float, float]]],
    link: Links,
    now: float,
    x: str,
    y: str,
) -> str:
    params: dict[str, None] = {}
    metrics: dict[str, None] = {}
    bests = {c.id: _best(ranges.get(c.id, {}), c) for c in chains}
    for c in chains:
        params.update((k, None) for k, _ in c.spec.params)
        metrics.update((k, None) for k in bests[c.id])
    heads = ["chain", "state", *params, "rep", *(f"best {m}" for m in metrics)]
    head = "".join(f'<th data-col="{i}" tabindex="0">{escape(h)}</th>' for i, h in enumerate(heads))
    rows = []
    for c in chains:
        values = dict(c.spec.params)
        cells = [
            (c.id, f'<a href="{link.chain(c.id)}">{escape(c.id)}</a>'),
            (c.state.value, escape(view.state_cell(c, now))),
            *(
                (_sort_key(values.get(p)), escape(param_text(values[p])) if p in values else "-")
                for p in params
            ),
            (str(c.spec.rep), str(c.spec.rep)),
            *(
                (str(bests[c.id].get(m, "")), f"{bests[c.id][m]:.6g}" if m in bests[c.id] else "-")
                for m in metrics
            ),
        ]
        rows.append("<tr>" + "".join(f'<td data-v="{escape(v)}">{t}</td>' for v, t in cells) + "</tr>")
    table = f'<table class="sortable" id="configs"><tr>{head}</tr>{"".join(rows)}</table>'
    table = f'<div class="scroll">{table}</div>'
    xs, ys = list(params), list(metrics)
    x = x if x in params else (xs[0] if xs else "")
    y = y if y in metrics else (ys[0] if ys else "")
    points, labels = [], []
    for c in chains:
        raw = dict(c.spec.params).get(x)
        value = bests[c.id].get(y)
        number = _number(raw)
        if number is not None and value is not None:
            points.append((number, value))
            labels.append(f"{c.id}: {x} {param_text(raw or '')}, {y} {value:.6g}")
    chosen = ""
    if xs and ys:

        def options(items: Sequence[str], picked: str) -> str:
            return "".join(
                f'<option value="{escape(i)}"{" selected" if i == picked else ""}>{escape(i)}</option>'
                for i in items
            )

        chosen = (
            f'<form class="choose" method="get" action="{escape("/sweep/" + quote(name, safe=""))}">'
            f'<label>parameter <select name="x">{options(xs, x)}</select></label> '
            f'<label>metric <select name="y">{options(ys, y)}</select></label> '
            f'<button type="submit">plot</button></form>'
            + charts.plot(points, x, f"best {y}", "scatter", labels=labels)
        )
    unfinished = sum(1 for c in chains if not c.state.final)
    cancel = (
        f'<a class="button danger" href="{link("/cancel", sweep=name)}">Cancel sweep…</a>'
        if unfinished
        else ""
    )
    return (
        f"<h1>sweep {escape(name)}</h1><p>{len(chains)} chains, {unfinished} unfinished {cancel}</p>"
        f"<h2>Configurations</h2>{table}{_means(chains, list(params))}"
        f"<h2>Parameter against metric</h2>{chosen or '<p>no metrics yet</p>'}"
    )


def _means(chains: Sequence[Chain], params: Sequence[str]) -> str:
    """Each metric per configuration, as ``chainrun status SWEEP`` compares them: the mean
    and spread of its repetitions' latest values, the best configuration first."""
    out = []
    for metric in metric_names(chains):
        lower = lower_is_better(metric)
        head = "".join(f"<th>{escape(p)}</th>" for p in params) + "<th>mean</th><th>spread</th><th>reps</th>"
        rows = []
        for score in scores(metric, chains):
            values = dict(score.config)
            cells = [escape(param_text(values[p])) if p in values else "-" for p in params]
            cells += [f"{score.mean:.4g}", escape(spread_text(score)), f"{score.reported} of {score.reps}"]
            rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
        out.append(
            f'<table class="means" data-metric="{escape(metric)}"><caption>{escape(metric)}, '
            f"{'lowest' if lower else 'highest'} first</caption><tr>{head}</tr>{''.join(rows)}</table>"
        )
    if not out:
        return ""
    return "<h2>Mean ± spread over repetitions</h2>" + "".join(f'<div class="scroll">{t}</div>' for t in out)


def _number(raw: Optional[str]) -> Optional[float]:
    try:
        value = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _sort_key(raw: Optional[str]) -> str:
    number = _number(raw)
    return str(number) if number is not None else param_text(raw) if raw is not None else ""


def confirm(what: str, fields: Mapping[str, str], csrf: str, link: Links, back: str) -> str:
    """The question before a cancel, with the form that carries it out."""
    hidden = "".join(
        f'<input type="hidden" name="{escape(k)}" value="{escape(v)}">'
        for k, v in {**fields, "csrf": csrf}.items()
    )
    return (
        f"<h1>Cancel {escape(what)}?</h1><p>Its queued and running jobs are cancelled; a running "
        "segment keeps the time it ran and the progress it made. This cannot be undone.</p>"
        f'<form method="post" action="{link("/cancel")}">{hidden}'
        f'<button type="submit" class="danger" id="confirm">Yes, cancel {escape(what)}</button> '
        f'<a href="{back}">No, go back</a></form>'
    )


def message(text: str) -> str:
    return f"<h1>{escape(text)}</h1>"
