// chainrun ui: draws each plot with uPlot (vendored in static/vendor/uplot) from the JSON
// its element carries (data-plot, written by chainrun/ui/charts.py, which also chose the
// size and which axis is log-scaled): hover a point for its values (in the legend), drag
// across to zoom in, double-click to zoom out. ui.js calls draw() again after each
// refresh: a plot drawn before keeps its chart, and its zoom, and takes the new data.
"use strict";
window.chainrunPlots = (function () {
  const PAD = 0.06; // the share of an axis's range left free at each end: no point on the frame
  const COLOUR = "#1f77b4";
  const FONT = "11px system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif";
  const drawn = new Map(); // element id -> {u, shape, spec, zoomed}

  // A tick's value, short: three significant digits, 1e-4 rather than 0.0001.
  function short(v) {
    if (v === 0) return "0";
    const big = Math.abs(v) >= 1000 || Math.abs(v) < 1e-3;
    const text = big ? v.toExponential(2) : String(Number(v.toPrecision(3)));
    return text.replace(/\.?0+e/, "e").replace("e+", "e");
  }
  // A value under the cursor: six significant digits.
  function precise(v) {
    if (v == null) return "-";
    return Math.abs(v) >= 1e6 || (v !== 0 && Math.abs(v) < 1e-4) ? short(v) : String(Number(v.toPrecision(6)));
  }

  // A time's tick as the timeline writes it: to the second where ticks are seconds
  // apart, the day too where the axis spans days.
  const DAY = 86400;
  function clock(u, splits, axisIdx, space, incr) {
    const span = u.scales.x.max - u.scales.x.min;
    const fmt = uPlot.fmtDate(span >= DAY ? "{MM}-{DD} {HH}:{mm}" : incr < 60 ? "{HH}:{mm}:{ss}" : "{HH}:{mm}");
    return splits.map((v) => (v == null ? null : fmt(new Date(v * 1000))));
  }

  // The range of an axis: its values padded by PAD (on a log axis, in decades, then out
  // to round values, so that its ticks are round too).
  function range(log) {
    return (u, lo, hi) => {
      if (lo == null || hi == null) return [0, 1];
      if (log) {
        let a = Math.log10(lo), b = Math.log10(hi);
        if (a === b) { a -= 1; b += 1; }
        const pad = (b - a) * PAD;
        return uPlot.rangeLog(10 ** (a - pad), 10 ** (b + pad), 10, false);
      }
      if (lo === hi) { lo -= 1; hi += 1; }
      const pad = (hi - lo) * PAD;
      return [lo - pad, hi + pad];
    };
  }

  // Which ticks of a log axis are labelled: as many of each decade's 1, 2, 5 (and the
  // rest) as there is room for, else every so many powers of ten. (uPlot's own choice
  // measures room along a vertical axis only: a horizontal one got powers of ten alone.)
  function logLabels(u, splits, axisIdx) {
    const axis = u.axes[axisIdx], room = axis._space;
    const gap = (m) => Math.abs(u.valToPos(m, axis.scale) - u.valToPos(10, axis.scale));
    const keep = gap(9) >= room ? /./ : gap(7) >= room ? /[12357]/ : gap(5) >= room ? /[125]/ : /1/;
    const every = keep.source === "1" ? Math.max(1, Math.ceil(room / gap(1))) : 1;
    return splits.map((v) => {
      const lead = v.toExponential()[0];
      if (!keep.test(lead)) return null;
      return lead !== "1" || every === 1 || Math.round(Math.log10(v)) % every === 0 ? v : null;
    });
  }

  // An axis as wide as its widest tick label needs, so that every label is drawn whole.
  function fit(u, values, axisIdx) {
    const axis = u.axes[axisIdx];
    u.ctx.font = axis.font[0];
    const widest = Math.max(0, ...(values || []).map((v) => (v ? u.ctx.measureText(v).width : 0)));
    return Math.ceil(axis.ticks.size + axis.gap + widest / devicePixelRatio) + 2;
  }

  // On a scatter, the point nearest the cursor (several may share an x).
  function nearest(u, seriesIdx, closestIdx) {
    const [xs, ys] = u.data;
    let best = closestIdx, dist = Infinity;
    for (let i = 0; i < xs.length; i++) {
      if (ys[i] == null) continue;
      const dx = u.valToPos(xs[i], "x") - u.cursor.left, dy = u.valToPos(ys[i], "y") - u.cursor.top;
      if (dx * dx + dy * dy < dist) { dist = dx * dx + dy * dy; best = i; }
    }
    return best;
  }

  function build(el, entry) {
    const spec = entry.spec;
    const ink = getComputedStyle(el).color;
    const axis = (label, size) => ({
      label, size, font: FONT, labelFont: FONT, labelSize: 18, stroke: ink,
      values: (u, splits) => splits.map((v) => (v == null ? null : short(v))),
      // A grid line at each labelled tick only (a log axis has a tick at each 1..9 of a decade).
      grid: { stroke: "rgba(127,127,127,.18)", filter: (u, splits, i, ...rest) => u.axes[i].filter(u, splits, i, ...rest) },
      ticks: { stroke: "rgba(127,127,127,.4)" },
    });
    const xaxis = axis(spec.xlabel, 34);
    if (spec.xlog) xaxis.filter = logLabels;
    if (spec.xtime) Object.assign(xaxis, { values: clock, space: (u, i, lo, hi) => (hi - lo >= DAY ? 100 : 60) });
    const yaxis = axis(spec.ylabel, fit);
    if (spec.ylog) yaxis.filter = logLabels;
    const scatter = spec.labels != null;
    const opts = {
      width: Math.min(spec.width, el.clientWidth || spec.width), // smaller only on a narrow screen
      height: spec.height,
      scales: {
        x: { time: spec.xtime, distr: spec.xlog ? 3 : 1, range: range(spec.xlog) },
        y: { distr: spec.ylog ? 3 : 1, range: range(spec.ylog) },
      },
      axes: [xaxis, yaxis],
      series: [
        scatter
          ? { label: "chain", value: (u, v, si, idx) => (idx == null ? "-" : entry.spec.labels[idx]) }
          : { label: spec.xlabel, value: spec.xtime ? "{HH}:{mm}:{ss}" : (u, v) => precise(v) },
        {
          label: spec.ylabel, stroke: COLOUR, width: 1.5, value: (u, v) => precise(v),
          points: { show: true, size: 6, fill: COLOUR },
          ...(scatter ? { paths: () => null } : {}),
        },
      ],
      cursor: {
        drag: { x: true, y: false },
        ...(scatter ? { dataIdx: nearest } : {}),
      },
      hooks: {
        setSelect: [(u) => { if (u.select.width > 0) entry.zoomed = true; }],
        ready: [(u) => u.over.addEventListener("dblclick", () => { entry.zoomed = false; })],
      },
    };
    el.replaceChildren();
    entry.u = new uPlot(opts, [spec.x, spec.y], el);
  }

  // Draw every plot on the page: a new one built, one drawn before given its new data (its
  // zoom kept while zoomed), one whose scales changed built again, one gone destroyed.
  function draw() {
    if (typeof uPlot === "undefined") return; // the library did not load: the plots' text stays
    const seen = new Set();
    document.querySelectorAll("[data-plot]").forEach((el) => {
      const spec = JSON.parse(el.dataset.plot);
      const shape = JSON.stringify([spec.width, spec.height, spec.xlabel, spec.ylabel, spec.xtime, spec.xlog, spec.ylog, spec.labels != null]);
      const old = drawn.get(el.id);
      seen.add(el.id);
      if (old && old.shape === shape && spec.x.length) {
        old.spec = spec;
        el.replaceChildren(old.u.root);
        old.u.setData([spec.x, spec.y], !old.zoomed);
        return;
      }
      if (old) { old.u.destroy(); drawn.delete(el.id); }
      if (!spec.x.length) return; // "no points yet" stays
      const entry = { shape, spec, zoomed: false, u: null };
      build(el, entry);
      drawn.set(el.id, entry);
    });
    for (const [id, entry] of drawn) {
      if (!seen.has(id)) { entry.u.destroy(); drawn.delete(id); }
    }
  }

  draw();
  return { draw, get: (id) => (drawn.has(id) ? drawn.get(id).u : null) };
})();
