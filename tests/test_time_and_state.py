"""Time and state that add up: a cancelled segment keeps the time it ran and the progress it
made; with no service running, `status` shows the last known state as such; `cancel` says
what it did in one line; `history` shows each segment's durations; `run` following a
service tells a segment's start and end from the run directory's markers."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any, Callable

from conftest import wait_for
from test_decide import NOW
from test_run import chain_id_in, run_piped

from chainrun import status as view
from chainrun.model import (
    Phase,
)
from chainrun.text import duration

CLI = Callable[..., "subprocess.CompletedProcess[str]"]
Service = Callable[..., "subprocess.Popen[bytes]"]
DATA = Path(__file__).parent / "data"


# -- the rule, on the pure decide() -----------------------------------------------------


def test_the_state_cell_without_a_service_is_the_last_known_one_as_such() -> None:
    """No service since the last tick 100 s ago: "running as of 1m40s ago", and the time column
    counts the running segment up to that tick, not up to now."""
    from test_status import chain as status_chain
    from test_status import seg as status_seg

    c = status_chain(segments=(status_seg(1, Phase.RUNNING, started_at=NOW - 150),), used=0.0)
    assert view.state_cell(c, NOW) == "running 2m30s"
    assert view.state_cell(c, NOW, seen=NOW - 100) == "running as of 1m40s ago"
    cells = view.row(c, NOW, seen=NOW - 100)
    assert cells[view.HEADER.index("TIME")] == "50s of 20h"  # to the last tick, not 2m30s to now
    queued = status_chain(segments=(status_seg(1, Phase.PENDING, reason="Priority"),))
    assert view.state_cell(queued, NOW, seen=NOW - 5) == "queued as of 5s ago"


# -- through the CLI, on the local runner -----------------------------------------------


def trained_then_service_stopped(tmp_path: Path, chainrun: CLI, service: Service) -> str:
    """A chain whose segment 1 trained to epoch 3 or more under a service, which then stopped
    (its job runs on). Its id."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(DATA / "trainer.py", work)
    (work / "job.toml").write_text(
        'name = "ts"\ncommand = "python3 trainer.py --epochs 100000 --epoch-time 0.2"\n'
        'total_time = "1h"\nwalltime = "10m"\ntarget_epoch = 100000\n'
    )
    chain_id: str = chainrun("submit", str(work / "job.toml"), check=True).stdout.strip()
    daemon = service(0.5)

    def trained() -> bool:
        data = state(chainrun, chain_id)
        running = [s for s in data["segments"] if s["n"] == 1 and s["phase"] == "running"]
        return bool(running) and (data["epoch"] or 0) >= 3

    wait_for(trained, 120, "segment 1 running at epoch 3")
    daemon.send_signal(signal.SIGTERM)
    assert daemon.wait(60) == 0
    return chain_id


def state(chainrun: CLI, chain_id: str) -> dict[str, Any]:
    return json.loads(chainrun("status", chain_id, "--json", check=True).stdout)[0]  # type: ignore[no-any-return]


def test_status_without_a_service_says_as_of_when_and_stops_the_clock_there(
    tmp_path: Path, home: Path, chainrun: CLI, service: Service
) -> None:
    """The service stopped mid-segment: the chain is "running as of Ns ago", its running time
    and training time end at the last tick, and the service line says when that was."""
    chain_id = trained_then_service_stopped(tmp_path, chainrun, service)
    last_tick = json.loads((home / "service.status").read_text())["at"]
    started = state(chainrun, chain_id)["segments"][0]["started_at"]
    out = chainrun("status", check=True).stdout
    row = next(line for line in out.splitlines() if line.startswith(chain_id))
    ago = r"(\S+ ago|just now)"  # the last tick: a moment before, on a loaded machine longer
    assert re.search(rf" running as of {ago} ", row), out
    assert re.search(rf"^service: not running \(last tick {ago}\)", out, re.M), out
    verbose = chainrun("status", "-v", chain_id, check=True).stdout
    assert f"running for {duration(last_tick - started)}\n" in verbose, verbose
    assert f"budget: used {duration(last_tick - started)} of 1h;" in verbose, verbose
    assert "as of the last tick, " in verbose
    chainrun("cancel", chain_id, check=True)


def test_cancel_without_a_service_keeps_the_time_and_progress_and_says_so_in_one_line(
    tmp_path: Path, home: Path, chainrun: CLI, service: Service
) -> None:
    """Trained to epoch 3 or more, then cancelled with no service: a line while segment 1 saves
    on its signal, then one when the chain is cancelled, nothing on stderr; the chain keeps the
    time segment 1 ran, the signal's time and the epoch it saved on it, and its history shows
    that segment's queue wait, running time and training time."""
    chain_id = trained_then_service_stopped(tmp_path, chainrun, service)
    result = chainrun("cancel", chain_id)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    (saving, line) = result.stdout.splitlines()
    assert re.fullmatch(rf"chain {chain_id}: segment 1 has the signal to save and stop \(up to \S+\)", saving)
    match = re.fullmatch(rf"chain {chain_id} cancelled \(budget used (\S+), epoch (\d+)\)", line)
    assert match, line
    data = state(chainrun, chain_id)
    seg1 = data["segments"][0]
    assert seg1["outcome"] == "cancelled" and not seg1["charged"]
    assert seg1["signalled_at"] is not None and seg1["started_at"] < seg1["signalled_at"] <= seg1["ended_at"]
    ran = seg1["ended_at"] - seg1["started_at"]
    assert data["used_seconds"] == data["budget_used_seconds"] > 0
    assert abs(data["used_seconds"] - ran) < 1.0
    assert match.group(1) == duration(data["used_seconds"])
    assert int(match.group(2)) >= 3
    history = chainrun("history", chain_id, check=True).stdout.splitlines()
    assert any(
        h.endswith(
            f"segment 1 ended: chain cancelled; the command exited 0 after SIGUSR1; no cost; progress: epoch {match.group(2)}"
        )
        for h in history
    ), "\n".join(history)
    table = history[history.index("") + 1 :]
    assert table[0].split() == ["SEGMENT", "JOB", "OUTCOME", "QUEUED", "TRAINING", "SAVING", "GAP", "TRAINED"]
    cells = table[1].split()
    assert cells[:3] == ["1", seg1["job_id"], "cancelled"]
    account = json.loads(chainrun("history", chain_id, "--json", check=True).stdout)["segments"][0]
    assert abs(account["allocated_seconds"] - ran) < 1.0
    assert cells[4] == cells[7] == duration(account["training_seconds"])
    assert table[-1].startswith(f"budget used {duration(data['used_seconds'])} of 1h in 1 segment;")


def test_run_following_a_service_tells_segment_starts_and_ends_from_the_markers(
    tmp_path: Path, home: Path, chainrun: CLI, service: Service
) -> None:
    """`chainrun run` while a service drives the chain: with that service stopped (SIGSTOP),
    segment 1's end and segment 2's start and end are still told, from the run directory's
    markers; once the service goes on, the chain completes and `run` exits 0."""
    work = tmp_path / "work"
    work.mkdir()
    job = work / "job.toml"
    job.write_text(
        "name = \"mk\"\ncommand = 'while [ ! -e go ]; do sleep 0.1; done; echo finished'\n"
        'total_time = "5m"\nwalltime = "1m"\ngrace = "5s"\nmax_failures = 3\n'
    )
    daemon = service(0.5)
    wait_for(lambda: (home / "service.status").exists(), 60, "the service's first tick")
    proc, out = run_piped(job, "0.5", home)
    try:
        out.wait_for("segment 2 submitted after job")
        chain_id = chain_id_in(out.text)
        daemon.send_signal(signal.SIGSTOP)  # it ticks no more: what follows comes from the markers
        (work / "go").touch()
        out.wait_for("segment 1 stopped: the command exited 0 on its own", 60)
        out.wait_for("segment 2 is running", 60)
        out.wait_for("segment 2 stopped: ", 60)
        assert state(chainrun, chain_id)["segments"][0]["phase"] != "ended"  # the store has not seen it
        daemon.send_signal(signal.SIGCONT)
        assert proc.wait(120) == 0, out.text
        out.close()
        assert f"chain {chain_id} completed: " in out.text
    finally:
        daemon.send_signal(signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_run_as_the_service_ticks_when_a_marker_shows_a_start_or_an_end(
    tmp_path: Path, home: Path, chainrun: CLI
) -> None:
    """`chainrun run` as the service itself, ticking once an hour: a segment's start and end,
    written to the markers, bring the tick forward, so the chain is seen running, ending and
    completed long before the next tick was due."""
    work = tmp_path / "work"
    work.mkdir()
    job = work / "job.toml"
    job.write_text(
        "name = \"mi\"\ncommand = 'while [ ! -e go ]; do sleep 0.1; done; echo finished'\n"
        'total_time = "5m"\nwalltime = "1m"\ngrace = "5s"\nmax_failures = 3\n'
    )
    proc, out = run_piped(job, "3600", home)
    try:
        out.wait_for("segment 1 is running", 120)  # the first tick submitted it; no other was due
        (work / "go").touch()
        assert proc.wait(120) == 0, out.text
        out.close()
        assert re.search(r"segment 1 ended: completed \(exit 0\)", out.text), out.text
        assert f"chain {chain_id_in(out.text)} completed: " in out.text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
