"""`chainrun ui`, the web page, as a user sees it: in a real headless Chromium (selenium)
over the real `chainrun ui` and service and local runner, and over plain HTTP for what a
page does not show (every request without the token refused, the cancel's CSRF check).
Screenshots of each page go to the test's own directory; with CHAINRUN_UPDATE_SCREENSHOT=1
the chain page's is also written to docs/ui.png and the sweep page's to docs/sweep.png
(the docs' pictures of the web page).
"""

from __future__ import annotations

import html
import json
import re
import shutil
import sqlite3
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from http.cookiejar import CookieJar
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
from conftest import REPO, cli_env, have, need, wait_for

from chainrun.ui import charts
from chainrun.ui.charts import FAILURE

CLI = Callable[..., "subprocess.CompletedProcess[str]"]
Service = Callable[..., "subprocess.Popen[bytes]"]

# Trains toward argv[1] epochs, argv[2] seconds each, saving progress and two metrics
# through the helper; its segment 2 crashes at once, leaving markup in its output.
TRAIN = """\
import os, signal, sys, time
from chainrun.checkpoint import load_progress, write_progress
ck = os.environ["CHAINRUN_CHECKPOINT_DIR"]
os.makedirs(ck, exist_ok=True)
if os.environ["CHAINRUN_SEGMENT"] == os.environ.get("CRASH_IN", "0"):
    print("<script>window.pwned = 1</script> CUDA error: device-side assert", flush=True)
    sys.exit(3)
stop = []
signal.signal(getattr(signal, "SIG" + os.environ["CHAINRUN_SIGNAL"]), lambda *_: stop.append(1))
found = load_progress(ck)
epoch = found["epoch"] if found else 0
lr = float(os.environ.get("CHAINRUN_PARAM_LR", "0.1"))
lr *= 1 + 0.1 * int(os.environ.get("CHAINRUN_REP", "0"))  # repetitions differ a little
while epoch < int(sys.argv[1]) and not stop:
    until = time.time() + float(sys.argv[2])
    while time.time() < until and not stop:
        time.sleep(0.05)
    if stop:
        break
    epoch += 1
    with open(os.path.join(ck, "model.ckpt"), "w") as f:
        f.write(str(epoch))
    write_progress(ck, epoch=epoch, step=0, file="model.ckpt", metrics={"loss": lr / epoch, "acc": 1 - lr / epoch})
"""


def _job(work: Path, name: str, body: str) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    (work / "train.py").write_text(TRAIN)
    job = work / f"{name}.toml"
    job.write_text(f'name = "{name}"\n{body}\n[env]\nPYTHONPATH = "{REPO}"\n')
    return job


def start_ui(home: Path, *args: str) -> tuple[subprocess.Popen[str], str]:
    """`chainrun ui` with ``args``, and its one line of output, the URL (within 60 s)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "chainrun", "ui", *args],
        env=cli_env(home),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(60)
    if not (line and line[0].startswith("http://127.0.0.1:")):
        proc.kill()
        raise AssertionError((line, proc.wait(30)))
    return proc, line[0].strip()


@pytest.fixture
def ui(home: Path) -> Iterator[Callable[..., str]]:
    """Start `chainrun ui` (with ``args``); its one line of output, the URL. Stopped at the end."""
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str) -> str:
        proc, url = start_ui(home, *args)
        procs.append(proc)
        return url

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(30)


@pytest.fixture
def browser() -> Iterator[Any]:
    """A headless Chromium from the system's packages, driven by selenium."""
    need(
        "Chromium and chromedriver",
        have("chromium") and have("chromedriver"),
        "apt-get install chromium chromium-driver (scripts/test installs them)",
    )
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service as Driver

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Driver(shutil.which("chromedriver")), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _get(
    url: str,
    data: Optional[bytes] = None,
    headers: Optional[dict[str, str]] = None,
    jar: Optional[CookieJar] = None,
) -> tuple[int, str]:
    """GET (or POST ``data``) as a browser would: cookies kept in ``jar`` (else a new one),
    and the redirect of a first visit followed (a posted form's is not)."""
    request = urllib.request.Request(url, data=data, headers=headers or {})

    class Stay(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, req: Any, *args: Any, **kwargs: Any) -> Any:
            return None if req.data is not None else super().redirect_request(req, *args, **kwargs)

    cookies = urllib.request.HTTPCookieProcessor(jar if jar is not None else CookieJar())
    try:
        with urllib.request.build_opener(Stay, cookies).open(request, timeout=30) as answer:
            return answer.status, answer.read(200_000).decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _chain(url: str, chain_id: str) -> dict[str, Any]:
    base, token = url.split("/?token=")
    status, body = _get(f"{base}/api/chain/{chain_id}?token={token}")
    assert status == 200, body
    return json.loads(body)  # type: ignore[no-any-return]


def test_the_page_shows_a_chain_its_timeline_and_curves_and_follows_it_live(
    tmp_path: Path, chainrun: CLI, service: Service, ui: Callable[..., str], browser: Any
) -> None:
    """A chain on the local runner crosses three segments, the second crashing: the overview
    lists it with its state; its page draws one bar per segment, the crash in the failure
    colour, its output tail as text (the <script> in it never runs), the epoch plot (uPlot)
    with a point per saved epoch; and the open page shows segment 3 once it starts, without a
    reload, its plots the same charts given the new points."""
    from selenium.webdriver.common.by import By

    job = _job(
        tmp_path / "work",
        "looks",
        'command = "CRASH_IN=2 python3 train.py 5 3"\ntotal_time = "1h"\nwalltime = "15s"\ngrace = "5s"\n'
        "target_epoch = 5\nmax_failures = 2",
    )
    chain_id = chainrun("submit", str(job), check=True).stdout.strip()
    service(0.3)
    url = ui()
    wait_for(
        lambda: any(s["phase"] == "running" for s in _chain(url, chain_id)["segments"]), 120, "segment 1"
    )
    browser.get(url)
    row = browser.find_element(By.CSS_SELECTOR, f'tr.chain[data-id="{chain_id}"]')
    assert row.find_element(By.CSS_SELECTOR, "td.state").text.startswith("running"), row.text
    browser.save_screenshot(str(tmp_path / "overview.png"))

    record_text(browser)
    browser.get(url.replace("/?", f"/chain/{chain_id}?"))
    browser.execute_script("window.notReloaded = true")
    wait_for(lambda: plotted(browser, "epochs", "u.data[0].length"), 120, "the first epoch plotted")
    browser.execute_script("window.firstChart = window.chainrunPlots.get('epochs')")
    wait_for(lambda: len(_chain(url, chain_id)["segments"]) >= 3, 180, "segment 3 submitted")

    def bars() -> int:
        return len(browser.find_elements(By.CSS_SELECTOR, "#timeline g.segment"))

    wait_for(lambda: bars() >= 3, 60, "the open page showing segment 3")
    assert browser.execute_script("return window.notReloaded") is True  # updated in place
    wait_for(lambda: _chain(url, chain_id)["state"] == "completed", 180, "the chain to complete")
    data = _chain(url, chain_id)
    wait_for(lambda: bars() == len(data["segments"]) and "completed" in _state(browser), 60, "the final page")
    crashed = browser.find_element(By.CSS_SELECTOR, '#timeline g.segment[data-n="2"]')
    assert crashed.get_attribute("data-outcome") == "failed"
    assert crashed.find_element(By.CSS_SELECTOR, "rect.training").get_attribute("fill") == FAILURE
    saved = {p["epoch"] for p in data["progress_log"] if p["epoch"] is not None}
    assert saved == set(range(1, data["epoch"] + 1))  # every epoch the script saved was seen
    # The chart drawn at the first epoch, given each epoch since (setData), not drawn anew.
    assert plotted(browser, "epochs", "u === window.firstChart && u.data[0].length") == len(saved)
    assert plotted(browser, "metric-0", "u.data[0].length") == len(saved)  # the metrics too
    assert plotted(browser, "metric-1", "u.data[0].length") == len(saved)
    tail = browser.find_element(By.CSS_SELECTOR, 'table.segments tr[data-n="2"] .tail').text
    assert "<script>window.pwned = 1</script> CUDA error" in tail
    assert browser.execute_script("return window.pwned") is None
    _labels_fit(browser)  # the timeline's last time label among them
    crashed.click()
    assert "job " in browser.find_element(By.ID, "detail").text
    assert browser.execute_script("return window.notReloaded") is True
    browser.save_screenshot(str(tmp_path / "chain.png"))
    _keep_for_docs(tmp_path / "chain.png", "ui.png")


# Installed before a page loads (devtools' addScriptToEvaluateOnNewDocument): every text
# on a canvas (uPlot's ticks and axis labels) since the canvas was last cleared, with its
# box as drawn, in the canvas's own pixels, from the browser's own measure of the text and
# the transform it was drawn with.
RECORD_TEXT = """
(() => {
  let texts = (window.chainrunTexts = []);
  const proto = CanvasRenderingContext2D.prototype, fill = proto.fillText, clear = proto.clearRect;
  proto.clearRect = function (x, y, w, h) {
    if (x <= 0 && y <= 0 && w >= this.canvas.width && h >= this.canvas.height)
      texts = window.chainrunTexts = texts.filter((t) => t.canvas !== this.canvas);
    return clear.call(this, x, y, w, h);
  };
  proto.fillText = function (text, x, y, ...rest) {
    const m = this.measureText(text), t = this.getTransform(), xs = [], ys = [];
    for (const a of [x - m.actualBoundingBoxLeft, x + m.actualBoundingBoxRight])
      for (const b of [y - m.actualBoundingBoxAscent, y + m.actualBoundingBoxDescent]) {
        xs.push(t.a * a + t.c * b + t.e);
        ys.push(t.b * a + t.d * b + t.f);
      }
    texts.push({ canvas: this.canvas, text: String(text), font: this.font,
      box: [Math.min(...xs), Math.min(...ys), Math.max(...xs), Math.max(...ys)] });
    return fill.call(this, text, x, y, ...rest);
  };
})();
"""


def record_text(browser: Any) -> None:
    """From the next page on, every text drawn on a canvas is recorded (``RECORD_TEXT``)."""
    browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": RECORD_TEXT})


# Every text of every chart that lies outside its chart's box, as the browser drew them:
# the timeline's (SVG) and the plots' (a canvas each, still on the page).
_OUTSIDE = """
const out = [];
for (const svg of document.querySelectorAll("svg.chart")) {
  const box = svg.getBoundingClientRect();
  for (const t of svg.querySelectorAll("text")) {
    const r = t.getBoundingClientRect();
    if (r.left < box.left - 0.5 || r.right > box.right + 0.5 || r.top < box.top - 0.5 || r.bottom > box.bottom + 0.5)
      out.push(svg.id + ": " + t.textContent);
  }
}
const drawn = window.chainrunTexts.filter((t) => t.canvas.isConnected);
for (const t of drawn) {
  const [left, top, right, bottom] = t.box;
  if (left < -0.5 || top < -0.5 || right > t.canvas.width + 0.5 || bottom > t.canvas.height + 0.5)
    out.push(t.canvas.closest("[data-plot]").id + ": " + t.text);
  for (const u of drawn) {  // nor drawn over another (a tick label over the axis's name)
    const [l, tp, r, b] = u.box;
    if (u !== t && u.canvas === t.canvas && left < r - 0.5 && l < right - 0.5 && top < b - 0.5 && tp < bottom - 0.5)
      out.push(t.canvas.closest("[data-plot]").id + ": " + t.text + " over " + u.text);
  }
}
return out;
"""


def _labels_fit(browser: Any) -> None:
    """Every label of every chart on the page is drawn whole, inside its chart and clear of
    the others, at a size a reader expects (no larger than 16 px); the plots' labels among
    them (``record_text``)."""
    assert browser.execute_script(_OUTSIDE) == []
    sizes = browser.execute_script(
        "return window.chainrunTexts.filter((t) => t.canvas.isConnected)"
        ".map((t) => parseFloat(t.font.match(/([0-9.]+)px/)[1]) / devicePixelRatio)"
    )
    assert sizes and max(sizes) <= 16, sizes


def plotted(browser: Any, ident: str, what: str) -> Any:
    """``what`` (a JavaScript expression of ``u``) of the uPlot chart drawn for the plot
    ``ident``, or None while there is none."""
    return browser.execute_script(
        f"const u = window.chainrunPlots.get({json.dumps(ident)}); return u && ({what});"
    )


def _state(browser: Any) -> str:
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By

    try:
        return str(browser.find_element(By.ID, "state").text)
    except WebDriverException:  # the part was being replaced
        return ""


def _keep_for_docs(shot: Path, name: str) -> None:
    """With CHAINRUN_UPDATE_SCREENSHOT=1, the docs' picture ``name`` is this page at a laptop's size."""
    import os

    if os.environ.get("CHAINRUN_UPDATE_SCREENSHOT") == "1":
        (REPO / "docs").mkdir(exist_ok=True)
        shutil.copy(shot, REPO / "docs" / name)


def test_a_sweep_page_compares_configurations_and_a_cancel_asks_first(
    tmp_path: Path, chainrun: CLI, service: Service, ui: Callable[..., str], browser: Any
) -> None:
    """A sweep of two learning rates, two repetitions each: its section on the overview, its
    page's table sorted by a click on a column, each metric's mean and spread per learning
    rate, its plot of lr against the best loss with a point per chain (a log axis: the
    rates are a decade apart) at its own size, every label inside;
    then "Cancel sweep…" asks, and only the confirmation cancels it."""
    from selenium.webdriver.common.by import By

    job = _job(
        tmp_path / "work",
        "sw",
        # Three epochs, then nothing more to show: the page holds still while it is read.
        'command = "python3 train.py 3 0.3 && sleep 600"\ntotal_time = "1h"\nwalltime = "5m"\n'
        "target_epoch = 4\n[sweep]\nreps = 2\n[sweep.grid]\nlr = [0.5, 0.05]",
    )
    chainrun("submit", str(job), check=True)
    service(0.3)
    url = ui()
    base, token = url.split("/?token=")

    def points() -> int:
        status, body = _get(f"{base}/sweep/sw?token={token}&fragment=1")
        data = re.search(r'id="scatter"[^>]* data-plot="([^"]*)"', body) if status == 200 else None
        return len(json.loads(html.unescape(data.group(1)))["x"]) if data else 0

    wait_for(lambda: points() == 4, 120, "every chain reporting its metrics")
    wait_for(
        lambda: all(c["epoch"] == 3 for c in json.loads(chainrun("status", "--json").stdout)),
        120,
        "every chain at its last epoch",
    )
    record_text(browser)
    browser.get(url)
    assert browser.find_element(By.CSS_SELECTOR, "details.sweep summary").text.startswith(
        "sweep sw: 4 chains"
    )
    browser.find_element(By.CSS_SELECTOR, "details.sweep summary a").click()
    table = browser.find_element(By.ID, "configs")
    lr = [th.text for th in table.find_elements(By.TAG_NAME, "th")].index("lr")
    header = table.find_elements(By.TAG_NAME, "th")[lr]
    header.click()
    column = [r.find_elements(By.TAG_NAME, "td")[lr].text for r in table.find_elements(By.TAG_NAME, "tr")[1:]]
    assert column == ["0.05", "0.05", "0.5", "0.5"]
    header.click()
    column = [r.find_elements(By.TAG_NAME, "td")[lr].text for r in table.find_elements(By.TAG_NAME, "tr")[1:]]
    assert column == ["0.5", "0.5", "0.05", "0.05"]
    assert plotted(browser, "scatter", "u.data[0].length") == 4
    means = browser.find_element(By.CSS_SELECTOR, 'table.means[data-metric="loss"]')
    assert [r.text for r in means.find_elements(By.TAG_NAME, "tr")[1:]] == [
        "0.05 0.0175 ±0.0012 2 of 2",  # the loss is lr / 3 at epoch 3, 10% more in rep 1
        "0.5 0.175 ±0.012 2 of 2",
    ]
    canvas = browser.find_element(By.CSS_SELECTOR, "#scatter canvas")
    assert (canvas.rect["width"], canvas.rect["height"]) == (440, 250)  # its own size, not the page's
    assert plotted(browser, "scatter", "u.scales.x.distr") == 3  # log: 0.05 and 0.5, a decade apart
    _labels_fit(browser)
    browser.set_window_size(1280, 1240)  # the whole page, its plot included
    browser.save_screenshot(str(tmp_path / "sweep.png"))
    _keep_for_docs(tmp_path / "sweep.png", "sweep.png")
    browser.set_window_size(1280, 900)
    browser.find_element(By.LINK_TEXT, "Cancel sweep…").click()
    assert browser.find_element(By.TAG_NAME, "h1").text == "Cancel sweep sw?"
    assert all(c["state"] == "active" for c in json.loads(chainrun("status", "--json", check=True).stdout))
    browser.find_element(By.ID, "confirm").click()
    wait_for(
        lambda: all(c["state"] == "cancelled" for c in json.loads(chainrun("status", "--json").stdout)),
        120,
        "the sweep cancelled",
    )


def test_without_the_token_nothing_is_served_and_a_cancel_needs_its_form(
    tmp_path: Path, home: Path, chainrun: CLI, ui: Callable[..., str]
) -> None:
    """403 for the page, the event stream, the JSON, the static files and a posted cancel
    without the token (or with a wrong one); a cancel with the token but not the form's
    CSRF check, or from another site, is refused too, and only the whole form cancels.
    A chain id and a reason holding markup come back escaped."""
    job = _job(
        tmp_path / "work", "tok", 'command = "python3 train.py 1000 1"\ntotal_time = "1h"\nwalltime = "5m"'
    )
    chain_id = chainrun("submit", str(job), check=True).stdout.strip()
    hostile = "<script>alert(1)</script>"
    db = sqlite3.connect(home / "chainrun.db")
    with db:
        db.execute(
            "UPDATE chains SET reason = ? WHERE id = ?", (f"{hostile} <img src=x onerror=alert(2)>", chain_id)
        )
        db.execute(
            "INSERT INTO chains (id, name, spec, state, created_at) SELECT ?, name, spec, state, created_at "
            "FROM chains WHERE id = ?",
            (hostile, chain_id),
        )
    db.close()
    url = ui()
    base, token = url.split("/?token=")
    paths = ["/", "/events", "/api/chains", f"/api/chain/{chain_id}", f"/chain/{chain_id}", "/static/ui.js"]
    for path in paths:
        for query in ("", "?token=", "?token=" + token[:-1] + ("A" if token[-1] != "A" else "B")):
            status, _ = _get(base + path + query)
            assert status == 403, (path, query)
    form = urllib.parse.urlencode({"chain": chain_id, "csrf": "guess"}).encode()
    assert _get(f"{base}/cancel", form)[0] == 403
    assert _get(f"{base}/cancel?token={token}", form)[0] == 403  # a post is let in by the cookie alone
    jar = CookieJar()
    assert _get(url, jar=jar)[0] == 200  # the first visit: the cookie
    assert _get(f"{base}/cancel", form, jar=jar)[0] == 403
    status, page = _get(f"{base}/", jar=jar)
    assert status == 200 and hostile not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    status, page = _get(f"{base}/chain/{chain_id}", jar=jar)
    assert status == 200 and "<img" not in page and "&lt;img src=x onerror=alert(2)&gt;" in page
    status, confirm = _get(f"{base}/cancel?chain={chain_id}", jar=jar)
    csrf = confirm.split('name="csrf" value="')[1].split('"')[0]
    good = urllib.parse.urlencode({"chain": chain_id, "csrf": csrf}).encode()
    assert _get(f"{base}/cancel", good, {"Sec-Fetch-Site": "cross-site"}, jar)[0] == 403
    assert json.loads(chainrun("status", chain_id, "--json", check=True).stdout)[0]["state"] == "active"
    status, _ = _get(f"{base}/cancel", good, {"Sec-Fetch-Site": "same-origin"}, jar)
    assert status == 303
    # Asked for at once, carried out beside the page (the running segment has its grace to save).
    wait_for(
        lambda: (
            json.loads(chainrun("status", chain_id, "--json", check=True).stdout)[0]["state"] == "cancelled"
        ),
        120,
        "the chain cancelled",
    )


def test_another_bind_address_needs_the_option_and_warns(home: Path) -> None:
    """--bind 0.0.0.0 listens there, and says on stderr who can then reach the page."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "chainrun", "ui", "--bind", "0.0.0.0"],
        env=cli_env(home),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None and proc.stdout is not None
        warning = proc.stderr.readline()
        assert "warning: the page listens on 0.0.0.0" in warning
        assert proc.stdout.readline().startswith("http://127.0.0.1:")
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.ssh
@pytest.mark.slow
def test_the_page_on_a_login_node_is_forwarded_here_and_survives_a_dropped_link(
    tmp_path: Path, home: Path, chainrun: CLI
) -> None:
    """`chainrun ui --host ALIAS` starts the page over SSH where the state is (here a private
    sshd whose sessions see this test's state directory) and prints one local URL: it shows
    the chain, refuses a request without the token, serves again after sshd restarted, and
    Ctrl-C stops the page on the host."""
    from private_sshd import ALIAS, PrivateSSHD

    job = _job(tmp_path / "work", "far", 'command = "true"\ntotal_time = "1h"\nwalltime = "5m"')
    chain_id = chainrun("submit", str(job), check=True).stdout.strip()
    sshd = PrivateSSHD(tmp_path, server=f"SetEnv CHAINRUN_HOME={home}")
    sshd.start()
    program = f"env PYTHONPATH={REPO} {sys.executable} -m chainrun"
    err = tmp_path / "ui-stderr.txt"
    with open(err, "w") as errors:
        proc = subprocess.Popen(
            [sys.executable, "-m", "chainrun", "ui", "--host", ALIAS, "--program", program],
            env={**cli_env(home), "CHAINRUN_SSH_CONFIG": str(sshd.config)},
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
        )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:") and "?token=" in url, err.read_text()
        base = url.split("/?token=")[0]
        assert chain_id in _get(url)[1]
        assert _get(base + "/")[0] == 403
        remote_port = int(err.read_text().split("from its port ")[1].split(";")[0])  # the host's own

        def serves() -> bool:
            try:
                return _get(url)[0] == 200
            except OSError:
                return False

        sshd.stop()
        wait_for(lambda: not serves(), 30, "the URL to stop serving while sshd is down")
        sshd.start()
        wait_for(serves, 60, "the same URL to serve again after sshd restarted")
        assert "connection lost" in err.read_text()
        proc.send_signal(2)
        assert proc.wait(120) == 0, err.read_text()
        assert "chainrun ui stopped" in err.read_text()
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{remote_port}/", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
        sshd.stop()


def _svg(text: str) -> Any:
    import xml.etree.ElementTree as ET

    return ET.fromstring(text)


def test_a_sweep_page_shows_each_metrics_mean_and_spread_per_configuration(tmp_path: Path) -> None:
    """The sweep page compares the configurations as `chainrun status SWEEP` does: per
    metric, one row a configuration with the mean and spread of its repetitions' latest
    values and how many reported, the best first (the same numbers as the CLI's table)."""
    import re

    from test_sweep import sweep_chains

    from chainrun.ui import pages

    chains = sweep_chains(
        tmp_path,
        [
            {"val_loss": 0.5},  # lr 0.1, batch 64, r0
            {"val_loss": 0.7},  # r1
            {"val_loss": 0.25},  # lr 0.1, batch 128
            {"val_loss": 0.25},
            {"val_loss": 1.5},  # lr 0.01, batch 64
            {"val_loss": 0.5},
            {"val_loss": 1.25},  # lr 0.01, batch 128: only r0 reported
            {},
        ],
    )
    page = pages.sweep_page("lr", chains, {}, pages.Links(), 0.0, "", "")
    table = page.split('<table class="means" data-metric="val_loss">')[1].split("</table>")[0]
    rows = [re.findall(r"<t[dh]>(.*?)</t[dh]>", row) for row in table.split("<tr>")[1:]]
    assert rows == [
        ["lr", "batch", "mean", "spread", "reps"],
        ["0.1", "128", "0.25", "±0", "2 of 2"],
        ["0.1", "64", "0.6", "±0.14", "2 of 2"],
        ["0.01", "64", "1", "±0.71", "2 of 2"],
        ["0.01", "128", "1.25", "-", "1 of 2"],
    ]
    assert "val_loss, lowest first" in table


def test_no_trained_share_for_a_chain_that_trained_nothing(tmp_path: Path) -> None:
    """A chain whose one segment crashed two seconds after it started, and one whose
    checkpoint is still at the epoch it held at submission, show no share trained ("-", not
    the 100% their start-to-end time made), on the overview and on their own page; a chain
    that saved an epoch shows its share."""
    import re
    from dataclasses import replace

    from test_sweep import sweep_chains

    from chainrun.model import NO_PROGRESS, ChainState, Outcome, Phase, Segment
    from chainrun.store import Glance
    from chainrun.ui import pages

    ran = Segment("x", 1, 600, Phase.ENDED, "7", submitted_at=100.0, started_at=101.0, ended_at=103.0)
    base = sweep_chains(tmp_path, [{"loss": 1.0}] * 3)[:3]  # each at epoch 3
    crashed, trained, stayed = (
        replace(
            c,
            state=ChainState.FAILED,
            ended_at=103.0,
            segments=(replace(ran, chain_id=c.id, outcome=Outcome.FAILED if i != 1 else Outcome.TIMEOUT),),
        )
        for i, c in enumerate(base)
    )
    crashed = replace(crashed, latest=NO_PROGRESS)
    stayed = replace(stayed, baseline=stayed.latest)  # it resumed epoch 3 and saved nothing more
    link = pages.Links()
    shown = pages.overview(
        [Glance.of(c) for c in (crashed, trained, stayed)], {c.id: (2.0, 2.0) for c in base}, link, 200.0
    )
    cells = {
        m.group(1): m.group(2)
        for m in re.finditer(r'<tr class="chain" data-id="([^"]+)".*?<td>([^<]*)</td></tr>', shown)
    }
    assert cells == {crashed.id: "-", trained.id: "100%", stayed.id: "-"}
    for chain, share in ((crashed, "-"), (trained, "100%"), (stayed, "-")):
        page = pages.chain_page(chain, [], link, 200.0)
        assert "<dt>share trained</dt><dd>" + share + "</dd>" in page, chain.id


def test_a_chains_page_and_its_json_name_the_jobs_whose_cancel_is_owed(tmp_path: Path) -> None:
    """A chain whose cancel did not reach the scheduler: its page says which jobs are still
    there and that the service sends the cancel again, and its JSON lists them; a chain
    owed none shows no such line."""
    from test_sweep import sweep_chains

    from chainrun.ui import pages
    from chainrun.ui.server import _chain_json

    (chain,) = sweep_chains(tmp_path, [{"loss": 1.0}])[:1]
    owed = [("41", 100.0), ("42", 130.0)]
    page = pages.chain_page(chain, [], pages.Links(), 200.0, owed)
    line = re.search(r'<p class="problem" id="cancel-owed">([^<]*)</p>', page)
    assert line is not None, page
    assert html.unescape(line.group(1)).startswith("cancel owed: jobs 41, 42, since ")
    assert "sends it again once it answers" in line.group(1)
    assert 'id="cancel-owed"' not in pages.chain_page(chain, [], pages.Links(), 200.0)
    assert _chain_json(chain, [], owed, 200.0)["cancel_owed"] == [
        {"job_id": "41", "since": 100.0},
        {"job_id": "42", "since": 130.0},
    ]


def test_each_outcome_has_a_colour_of_its_own_and_a_crash_while_saving_keeps_it() -> None:
    """Every outcome (and a running segment) has a colour no other outcome, the queue wait
    or the gap has; a segment that got the walltime signal and then crashed is drawn in the
    crash's colour from its start to its end (its save striped over it), never in a colour
    that reads as a save."""
    from chainrun.accounting import ChainAccount, SegmentAccount
    from chainrun.model import Outcome

    colours = charts.OUTCOME_COLOURS
    assert {o.value for o in Outcome} | {"running"} <= set(colours)
    assert len(set(colours.values())) == len(colours)
    assert not {charts.QUEUE, charts.GAP} & set(colours.values())
    crashed = SegmentAccount(1, "9", "failed", True, 0.0, 10.0, 70.0, 100.0, 10.0, 60.0, 30.0, None)
    svg = _svg(charts.timeline(ChainAccount((crashed,), 0), ["crashed while saving"], 0.0, 100.0))
    fills = {r.get("class"): r.get("fill") for r in svg.iter("rect") if r.get("class") != "row"}
    assert fills["training"] == fills["saving"] == charts.FAILURE, fills
    assert fills["stripes"] == "url(#stripes)"


def test_a_chain_with_several_places_marks_each_segments_place_in_its_colour_and_names_it() -> None:
    """Each row of a chain with several places begins with its place's mark, a colour per
    place by the job file's order, none an outcome's; the legend names the places that ran."""
    from chainrun.accounting import ChainAccount, SegmentAccount

    assert not set(charts.PLACE_COLOURS) & set(charts.OUTCOME_COLOURS.values())
    assert len(set(charts.PLACE_COLOURS)) == len(charts.PLACE_COLOURS)
    segs = tuple(
        SegmentAccount(n, str(n), "timeout", False, 0.0, 10.0 * n, None, 10.0 * n + 5, 0.0, 5.0, 0.0, None)
        for n in (1, 2, 3)
    )
    svg = _svg(
        charts.timeline(
            ChainAccount(segs, 0), ["a", "b", "c"], 0.0, 40.0, ["uni", "hpc", "uni"], ["uni", "hpc"]
        )
    )
    rows = [g for g in svg.iter() if g.get("class") == "segment"]
    assert [g.get("data-place") for g in rows] == ["uni", "hpc", "uni"]
    marks = [next(r.get("fill") for r in g.iter() if r.get("class") == "place") for g in rows]
    assert marks == [charts.PLACE_COLOURS[0], charts.PLACE_COLOURS[1], charts.PLACE_COLOURS[0]]
    key = charts.legend({"timeout"}, ["uni", "hpc"])
    assert "at uni" in key and "at hpc" in key and charts.PLACE_COLOURS[1] in key
    one = _svg(charts.timeline(ChainAccount(segs, 0), ["a", "b", "c"], 0.0, 40.0))  # one place: no mark
    assert not [r for r in one.iter() if r.get("class") == "place"]
    assert "at " not in charts.legend({"timeout"})


def test_the_url_is_kept_across_restarts_unless_told_otherwise(home: Path) -> None:
    """`chainrun ui` started again serves at the same URL (port and token, kept in the state
    directory in a file only the user can read), so a bookmark still opens the page;
    --new-token changes the token (the old URL is refused), --port 0 the port; while the
    kept port is taken, it says so and serves on a free one, with the same token; a kept
    file others could read gives a new token."""
    import stat

    running: list[subprocess.Popen[str]] = []

    def start(*args: str) -> tuple[str, str]:
        """The URL it printed, and its port and token."""
        proc, url = start_ui(home, *args)
        running.append(proc)
        return url, url.split("127.0.0.1:")[1]

    def stop() -> None:
        proc = running.pop()
        proc.terminate()
        proc.wait(30)

    def port(where: str) -> str:
        return where.split("/?token=")[0]

    def token(where: str) -> str:
        return where.split("/?token=")[1]

    try:
        first, at = start()
        stop()
        kept = home / "ui.json"
        assert stat.S_IMODE(kept.stat().st_mode) == 0o600
        assert start()[0] == first
        assert _get(first)[0] == 200  # the bookmark opens the page
        stop()
        renewed, now = start("--new-token")
        assert port(now) == port(at) and token(now) != token(at)
        assert _get(first)[0] == 403 and _get(renewed)[0] == 200
        # The kept port is taken (by the page still running): another start says so, serves elsewhere.
        _, beside = start()
        assert running[-1].stderr is not None and "is taken" in running[-1].stderr.readline()
        assert token(beside) == token(now) and port(beside) != port(now)
        stop()
        stop()
        _, moved = start("--port", "0")
        assert token(moved) == token(now)
        assert json.loads(kept.read_text()) == {"port": int(port(moved)), "token": token(now)}
        stop()
        kept.chmod(0o644)  # a token others could read is not used again
        _, fresh = start()
        assert port(fresh) == port(moved) and token(fresh) != token(now)
        assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    finally:
        while running:
            stop()
