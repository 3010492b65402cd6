"""The web page's plots: drawn by uPlot, vendored from the npm registry (the files as
published, checked by their SHA-256), from the data and scales `chainrun.ui.charts` writes
into each plot's element; in a real headless Chromium (the `browser` of test_ui), with the
page's own style sheet and scripts: the size kept, a log axis where values span decades,
every label drawn whole, hover values, drag to zoom, and new data taken in place."""

from __future__ import annotations

import hashlib
import html
import json
import re
from pathlib import Path
from typing import Any

from conftest import REPO
from test_ui import _labels_fit, plotted, record_text
from test_ui import browser as browser  # the fixture: a headless Chromium

from chainrun.ui import charts

STATIC = REPO / "chainrun" / "ui" / "static"


def test_the_vendored_chart_library_is_the_published_one() -> None:
    """Every vendored file is listed in SHA256SUMS with its checksum (taken from the npm
    registry's package, README.md), so an edited file is caught; the script is the version
    VERSION names, under the MIT licence; and the page is served that version's files."""
    sums = charts.UPLOT / "SHA256SUMS"
    listed = dict(reversed(line.split()) for line in sums.read_text().splitlines())
    kept = {p.name for p in charts.UPLOT.iterdir()} - {"SHA256SUMS", "VERSION", "README.md"}
    assert set(listed) == kept == {"uPlot.iife.min.js", "uPlot.min.css", "LICENSE"}
    for name, digest in listed.items():
        assert hashlib.sha256((charts.UPLOT / name).read_bytes()).hexdigest() == digest, name
    version = (charts.UPLOT / "VERSION").read_text().strip()
    assert re.fullmatch(r"[0-9]+\.[0-9]+\.[0-9]+", version)
    script = (charts.UPLOT / "uPlot.iife.min.js").read_text()
    assert script.startswith(f"/*! https://github.com/leeoniya/uPlot (v{version}) */")
    assert (charts.UPLOT / "LICENSE").read_text().startswith("The MIT License (MIT)")
    assert version in (charts.UPLOT / "README.md").read_text()
    assert (
        f"[uPlot](https://github.com/leeoniya/uPlot) {version}" in (REPO / "docs" / "web-page.md").read_text()
    )
    assert set(charts.vendored()) == {
        f"vendor/uplot-{version}/uPlot.iife.min.js",
        f"vendor/uplot-{version}/uPlot.min.css",
    }


def test_every_file_the_page_loads_ships_in_the_package() -> None:
    """Every file under ``chainrun/ui/static`` (the vendored library's among them) matches
    a pattern of setup.cfg's package_data for ``chainrun.ui``, so that a wheel holds it (a
    wheel built with ``pip wheel . --no-deps`` listed them all)."""
    import configparser

    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    patterns = [p.strip() for p in config["options.package_data"]["chainrun.ui"].split(",")]
    shipped = {p for pattern in patterns for p in STATIC.parent.glob(pattern)}  # "*" within a folder
    files = {p for p in STATIC.rglob("*") if p.is_file()}
    assert charts.UPLOT / "uPlot.iife.min.js" in files
    assert files - shipped == set()


def _refuse(constant: str) -> None:
    raise AssertionError(f"{constant} is not JSON: a browser refuses it")


def _spec(element: str) -> dict[str, Any]:
    """The data a plot's element carries, read as strictly as a browser reads JSON."""
    found = re.search(r'data-plot="([^"]*)"', element)
    assert found, element
    return json.loads(html.unescape(found.group(1)), parse_constant=_refuse)  # type: ignore[no-any-return]


def test_a_plots_data_is_json_a_browser_reads_whatever_the_values() -> None:
    """A loss that went NaN or infinite is a gap in the line (null: JSON has no NaN, and a
    browser's parser refuses the whole plot's data over one), not counted in the choice of
    scale; a point with no x is left out; the points go in by x, each label with its point.
    Without script, a line of text stands for the plot."""
    element = charts.plot(
        [(3, 0.5), (1, float("nan")), (2, 50.0), (float("nan"), 1.0), (4, float("inf"))],
        "epoch",
        "loss",
        "m",
        labels=["c", "a", "b", "none", "d"],
    )
    spec = _spec(element)
    assert (spec["x"], spec["y"], spec["labels"]) == (
        [1, 2, 3, 4],
        [None, 50.0, 0.5, None],
        ["a", "b", "c", "d"],
    )
    assert spec["ylog"] is True  # 0.5 to 50, the gaps aside
    # Without script, the page says what the plot holds; the script replaces that with the plot.
    assert "4 points of loss against epoch (the plot needs JavaScript)" in element
    assert "no points yet" in charts.plot([], "epoch", "loss", "m")


def _show(browser: Any, tmp_path: Path, body: str) -> None:
    """``body`` in a page with the web page's style sheets and scripts, as it loads them."""
    css, js = (path.as_uri() for path in charts.vendored().values())
    ours = STATIC.as_uri()
    page = tmp_path / "plots.html"
    page.write_text(
        f'<!doctype html><html><head><link rel="stylesheet" href="{css}">'
        f'<link rel="stylesheet" href="{ours}/ui.css"></head><body><main id="main">{body}</main>'
        f'<script src="{js}"></script><script src="{ours}/plots.js"></script></body></html>'
    )
    record_text(browser)
    browser.get(page.as_uri())


def test_a_plot_keeps_its_size_and_values_spanning_decades_get_a_log_axis(
    tmp_path: Path, browser: Any
) -> None:
    """The rule is the page's one (``charts.spans_decades``, written into the plot's data):
    learning rates a decade apart each get a log axis, a loss over a few tenths a linear
    one, a loss over three decades a log one, a time never. Drawn, a plot is 440 by 250
    pixels (not stretched to the page), the rates are evenly spaced on its log axis, ticked
    at powers of ten (and at 1, 2 and 5 of each where there is room), and no point sits on
    the frame, however few there are."""
    lrs = [1e-4, 1e-3, 1e-2, 1e-1]
    scatter = charts.plot(
        [(lr, 1.0 / (i + 1)) for i, lr in enumerate(lrs)], "lr", "best loss", "s", labels=list("abcd")
    )
    loss = charts.plot([(1, 0.9), (2, 0.5), (3, 0.3)], "epoch", "loss", "m")
    decades = charts.plot([(1, 2.3), (2, 0.1), (3, 0.004)], "epoch", "loss", "d")
    times = charts.plot([(1.7e9, 1.0), (1.7e9 + 3600, 20.0)], "time", "epoch", "t", xtime=True)
    two = charts.plot([(0.05, 0.9), (0.5, 0.8)], "lr", "best acc", "r", labels=["a", "b"])
    assert (_spec(scatter)["xlog"], _spec(scatter)["ylog"]) == (True, False)
    assert (_spec(loss)["xlog"], _spec(loss)["ylog"]) == (False, False)
    assert _spec(decades)["ylog"] is True
    assert (_spec(times)["xlog"], _spec(times)["ylog"]) == (False, True)

    _show(browser, tmp_path, f'<div class="plots">{scatter}{loss}{decades}{times}{two}</div>')
    for ident in ("s", "m", "d", "t", "r"):
        box = browser.execute_script(
            f"const r = document.querySelector('#{ident} canvas').getBoundingClientRect(); return [r.width, r.height]"
        )
        assert box == [440, 250], ident
    assert plotted(browser, "s", "[u.scales.x.distr, u.scales.y.distr]") == [3, 1]  # 3: log
    assert plotted(browser, "m", "[u.scales.x.distr, u.scales.y.distr]") == [1, 1]
    assert plotted(browser, "d", "u.scales.y.distr") == 3
    assert plotted(browser, "t", "[u.scales.x.time, u.scales.y.distr]") == [True, 3]
    xs = plotted(browser, "s", "u.data[0].map((x) => u.valToPos(x, 'x'))")
    steps = [b - a for a, b in zip(xs, xs[1:])]
    assert max(steps) - min(steps) < 0.5, xs  # evenly spaced: one decade each
    ticks = plotted(browser, "s", "u.axes[0]._values.filter((v) => v)")
    assert {"1e-4", "0.001", "0.01", "0.1"} <= set(ticks), ticks
    ticks = plotted(browser, "r", "u.axes[0]._values.filter((v) => v)")  # room for 1, 2 and 5
    assert {"0.05", "0.1", "0.2", "0.5"} <= set(ticks), ticks
    for ident in ("s", "m", "d", "t", "r"):  # every point off the frame, by more than its radius
        frame = plotted(browser, ident, "[u.bbox.width / devicePixelRatio, u.bbox.height / devicePixelRatio]")
        spots = plotted(
            browser, ident, "u.data[0].map((x, i) => [u.valToPos(x, 'x'), u.valToPos(u.data[1][i], 'y')])"
        )
        for x, y in spots:
            assert 3 < x < frame[0] - 3 and 3 < y < frame[1] - 3, (ident, x, y, frame)


def test_every_label_of_a_chart_is_drawn_whole(tmp_path: Path, browser: Any) -> None:
    """In Chromium, with the page's own style sheet and scripts: a timeline whose end falls
    on a round time keeps its last time label inside (it was cut in half), and plots, at
    their own size on a wide page, keep their long tick labels (a loss in the hundred
    thousands, a learning rate of 1e-5, times of day) and their axis labels inside their
    canvas, each text as the browser measured it drawn."""
    from chainrun.accounting import ChainAccount, SegmentAccount

    start = 1_699_999_200.0  # on the hour: the timeline's ticks fall on both of its ends
    segs = tuple(
        SegmentAccount(
            n,
            str(n),
            "timeout",
            False,
            start + 200 * (n - 1),
            start + 200 * (n - 1),
            None,
            start + 200 * n,
            0.0,
            200.0,
            0.0,
            0.0,
        )
        for n in (1, 2, 3)
    )
    timeline = charts.timeline(ChainAccount(segs, 0), ["a", "b", "c"], start, start + 600)
    big = charts.plot(
        [(1e-5, 123456.7), (3e-3, 2345.6), (0.1, 98765.4)], "lr", "best loss", "scatter", labels=list("abc")
    )
    clock = charts.plot(
        [(start + 37 * i, float(i)) for i in range(1, 30)], "time", "epoch", "epochs", xtime=True
    )
    wide = charts.plot([(1, 123456.7), (2, 112345.6), (3, 98765.4)], "epoch", "loss", "wide")  # linear
    _show(browser, tmp_path, f"{timeline}{big}{clock}{wide}")
    assert plotted(browser, "wide", "u.scales.y.distr") == 1
    assert plotted(browser, "scatter", "u.axes[1]._values.filter((v) => v).length")  # ticks drawn
    drawn = browser.execute_script("return window.chainrunTexts.map((t) => t.text)")
    assert {"lr", "best loss", "time", "epoch"} <= set(drawn), drawn
    _labels_fit(browser)
    canvas = browser.find_element("css selector", "#scatter canvas").rect
    assert (canvas["width"], canvas["height"]) == (440, 250)  # not the page's 1168 px
    browser.save_screenshot(str(tmp_path / "plots.png"))


def test_hovering_shows_a_points_values_a_drag_zooms_and_new_data_keeps_the_zoom(
    tmp_path: Path, browser: Any
) -> None:
    """With the real mouse (selenium's actions): over a point, the legend shows its x and y;
    over a scatter, the nearest chain's label, where chains share an x; a drag across
    zooms the x axis in, and new data (as a refresh brings) keeps that zoom on the same
    chart; a double-click zooms out to all the points."""
    from selenium.webdriver.common.action_chains import ActionChains

    loss = charts.plot([(1, 0.9), (2, 0.5), (3, 0.3), (4, 0.25)], "epoch", "loss", "m")
    rates = charts.plot(
        [(0.05, 0.4), (0.05, 0.2), (0.5, 0.3)], "lr", "best loss", "s", labels=["a", "b", "c"]
    )
    _show(browser, tmp_path, f'<div class="plots">{loss}{rates}</div>')

    def hover(ident: str, index: int) -> list[str]:
        over = browser.find_element("css selector", f"#{ident} .u-over")
        x, y = plotted(
            browser, ident, f"[u.valToPos(u.data[0][{index}], 'x'), u.valToPos(u.data[1][{index}], 'y')]"
        )
        size = over.size
        ActionChains(browser).move_to_element_with_offset(
            over, round(x - size["width"] / 2), round(y - size["height"] / 2)
        ).perform()
        return browser.execute_script(  # type: ignore[no-any-return]
            f"return Array.from(document.querySelectorAll('#{ident} .u-legend .u-value'), (v) => v.textContent)"
        )

    assert browser.find_elements("css selector", ".plot canvas")
    assert not browser.find_elements("css selector", ".plot .unplotted")  # replaced by the plots
    assert hover("m", 1) == ["2", "0.5"]
    assert hover("m", 3) == ["4", "0.25"]
    assert hover("s", 1) == ["b", "0.2"]  # lr 0.05 twice: the point under the cursor, not the first
    assert hover("s", 0) == ["a", "0.4"]

    whole = plotted(browser, "m", "[u.scales.x.min, u.scales.x.max]")
    over = browser.find_element("css selector", "#m .u-over")
    width = over.size["width"]
    ActionChains(browser).move_to_element_with_offset(
        over, round(-width * 0.3), 0
    ).click_and_hold().move_by_offset(round(width * 0.4), 0).release().perform()
    zoomed = plotted(browser, "m", "[u.scales.x.min, u.scales.x.max]")
    assert whole[0] < zoomed[0] < zoomed[1] < whole[1], (whole, zoomed)
    browser.execute_script("window.before = window.chainrunPlots.get('m')")
    more = charts.plot([(1, 0.9), (2, 0.5), (3, 0.3), (4, 0.25), (5, 0.2)], "epoch", "loss", "m")
    browser.execute_script(
        "document.getElementById('m').dataset.plot = arguments[0]; window.chainrunPlots.draw()",
        json.dumps(_spec(more)),
    )
    assert plotted(browser, "m", "u === window.before && u.data[0].length") == 5
    assert plotted(browser, "m", "[u.scales.x.min, u.scales.x.max]") == zoomed
    ActionChains(browser).double_click(browser.find_element("css selector", "#m .u-over")).perform()
    reset = plotted(browser, "m", "[u.scales.x.min, u.scales.x.max]")
    assert reset[0] < 1 and reset[1] > 5, reset  # every point again, the new one included
