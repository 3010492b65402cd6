// chainrun ui: keeps the page current without a reload (server-sent events say when the
// state changed; the page's main part is fetched again and its plots given their new data,
// plots.js), sorts tables by any column, and shows a segment's details when its bar is
// clicked. No other script than plots.js and the chart library it uses, nothing remote.
"use strict";
(function () {
  const main = document.getElementById("main");
  const live = document.getElementById("live");

  function withParam(url, key, value) {
    const u = new URL(url, location.href);
    u.searchParams.set(key, value);
    return u.pathname + u.search;
  }

  // -- sorting ----------------------------------------------------------------------------
  const sorted = {}; // table id -> [column, direction], kept across refreshes
  function sortTable(table, col, dir) {
    const rows = Array.from(table.rows).slice(1);
    const num = (v) => (v !== "" && !isNaN(Number(v)) ? Number(v) : null);
    rows.sort((a, b) => {
      const x = a.cells[col].dataset.v ?? a.cells[col].textContent;
      const y = b.cells[col].dataset.v ?? b.cells[col].textContent;
      const nx = num(x), ny = num(y);
      const c = nx !== null && ny !== null ? nx - ny : nx !== null ? -1 : ny !== null ? 1 : x.localeCompare(y);
      return dir === "asc" ? c : -c;
    });
    rows.forEach((r) => table.tBodies[0].appendChild(r));
    table.querySelectorAll("th").forEach((th) => th.removeAttribute("data-sorted"));
    table.rows[0].cells[col].dataset.sorted = dir;
  }
  function wireTables() {
    document.querySelectorAll("table.sortable").forEach((table) => {
      if (sorted[table.id]) sortTable(table, ...sorted[table.id]);
      table.querySelectorAll("th[data-col]").forEach((th) => {
        const go = () => {
          const col = Number(th.dataset.col);
          const dir = th.dataset.sorted === "asc" ? "desc" : "asc";
          sorted[table.id] = [col, dir];
          sortTable(table, col, dir);
        };
        th.addEventListener("click", go);
        th.addEventListener("keydown", (e) => { if (e.key === "Enter") go(); });
      });
    });
  }

  // -- a segment's details ----------------------------------------------------------------
  let shown = null; // the segment whose details are open, kept across refreshes
  function showSegment(n) {
    const detail = document.getElementById("detail");
    const bar = document.querySelector(`#timeline .segment[data-n="${n}"]`);
    if (!detail || !bar) return;
    shown = n;
    detail.textContent = bar.querySelector("title").textContent;
    detail.hidden = false;
  }
  function wireTimeline() {
    document.querySelectorAll("#timeline .segment").forEach((g) => {
      g.addEventListener("click", () => showSegment(g.dataset.n));
      g.addEventListener("keydown", (e) => { if (e.key === "Enter") showSegment(g.dataset.n); });
    });
    if (shown !== null) showSegment(shown);
  }
  function wireSelects() {
    document.querySelectorAll("form.choose select").forEach((s) => s.addEventListener("change", () => s.form.submit()));
  }

  // -- staying current --------------------------------------------------------------------
  let busy = false, again = false;
  async function refresh() {
    if (busy) { again = true; return; }
    busy = true;
    try {
      const answer = await fetch(withParam(location.href, "fragment", "1"), { cache: "no-store" });
      if (answer.ok) {
        const open = {};
        document.querySelectorAll("details[id]").forEach((d) => (open[d.id] = d.open));
        main.innerHTML = await answer.text();
        document.querySelectorAll("details[id]").forEach((d) => { if (d.id in open) d.open = open[d.id]; });
        wireTables(); wireTimeline(); wireSelects();
        if (window.chainrunPlots) window.chainrunPlots.draw();
        live.textContent = "updated " + new Date().toLocaleTimeString();
        document.body.dataset.refreshed = String(Number(document.body.dataset.refreshed || 0) + 1);
      }
    } catch (e) {
      live.textContent = "cannot reach chainrun ui";
    } finally {
      busy = false;
      if (again) { again = false; refresh(); }
    }
  }
  wireTables(); wireTimeline(); wireSelects();
  if (document.body.dataset.live === "1") {
    const events = new EventSource("/events");
    events.addEventListener("change", refresh);
    events.addEventListener("open", () => (live.textContent = "live"));
    events.addEventListener("error", () => {
      // Closed for good when refused (too many live pages open): the refresh below goes on.
      live.textContent = events.readyState === EventSource.CLOSED ? "not live: updated every 30 s" : "reconnecting…";
    });
    setInterval(refresh, 30000); // running times move on without a write
  }
})();
