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
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from conftest import wait_for
from test_decide import BEFORE, NOW, SPEC, chain, seg
from test_run import chain_id_in, run_piped

from chainrun import status as view
from chainrun.decide import Facts, JobFacts, decide
from chainrun.decide.chain import CANCEL_SLACK
from chainrun.fields import format_duration
from chainrun.model import (
    Cancel,
    ChainState,
    EndMarker,
    EndSegment,
    Finish,
    ListedJob,
    Outcome,
    Phase,
    Progress,
    StartMarker,
)

CLI = Callable[..., "subprocess.CompletedProcess[str]"]
Service = Callable[..., "subprocess.Popen[bytes]"]
DATA = Path(__file__).parent / "data"


# -- the rule, on the pure decide() -----------------------------------------------------


def test_a_cancelled_running_segment_is_credited_its_time_and_progress_a_queued_one_nothing() -> None:
    """A user's cancel ends the running segment with the time it ran (from its start to now)
    and the checkpoint it reached (once its grace to stop is over, here: it was asked for long
    ago); the successor queued behind it never ran: nothing."""
    c = chain(seg(1, started_at=NOW - 40), seg(2, Phase.PENDING, after="j1"), cancel_requested_at=0.0)
    reached = Progress(epoch=8, saved_at=NOW - 1)
    jobs = {
        "j1": JobFacts(
            listed=ListedJob("j1", "j1", Phase.RUNNING, started_at=NOW - 40),
            start=StartMarker("j1", NOW - 40, BEFORE),
        ),
        "j2": JobFacts(listed=ListedJob("j2", "j2", Phase.PENDING)),
    }
    assert decide(c, Facts(jobs=jobs, progress=reached), NOW) == [
        Cancel(
            n=1,
            job_id="j1",
            reason="chain cancelled; ran 40s; progress: epoch 8",
            elapsed=40.0,
            progress=reached,
        ),
        Cancel(n=2, job_id="j2", reason="chain cancelled"),
        Finish(state=ChainState.CANCELLED, reason="cancelled by user"),
    ]


def test_a_cancel_cancels_the_queue_at_once_and_gives_the_running_segment_its_grace_to_save() -> None:
    """Issue 36, findings 1 and 2. Asked for 5 s ago: the successor queued behind the running
    segment is cancelled at once, the running one is left to stop (its runner has the final
    marker: the signal now, the kill after its grace), and the chain goes on until it has."""
    c = chain(seg(1, started_at=NOW - 40), seg(2, Phase.PENDING, after="j1"), cancel_requested_at=NOW - 5)
    jobs = {
        "j1": JobFacts(listed=ListedJob("j1", "j1", Phase.RUNNING, started_at=NOW - 40)),
        "j2": JobFacts(listed=ListedJob("j2", "j2", Phase.PENDING)),
    }
    assert decide(c, Facts(jobs=jobs, progress=BEFORE), NOW) == [
        Cancel(n=2, job_id="j2", reason="chain cancelled")
    ]
    # Its grace (SPEC's) and the slack after it are over: cancelled as it stands.
    late = NOW + SPEC.grace + CANCEL_SLACK
    assert [type(a) for a in decide(c, Facts(jobs=jobs, progress=BEFORE), late)] == [Cancel, Cancel, Finish]


def test_a_segment_the_cancel_stopped_keeps_what_it_saved_and_its_times_free_of_charge() -> None:
    """It saved on the signal (epoch 5) and exited: recorded cancelled, not charged, with its
    progress, its signal's time and the time it ran; then the chain ends. A segment that ended
    on its walltime before the cancel keeps its own outcome."""
    saved = Progress(epoch=5, saved_at=NOW - 3)
    end = EndMarker(0, 0, "USR1", False, NOW - 2, progress=saved, signalled_at=NOW - 4)
    c = chain(seg(1, started_at=NOW - 30), cancel_requested_at=NOW - 5)
    stopped = JobFacts(
        listed=ListedJob(
            "j1", "j1", Phase.ENDED, Outcome.COMPLETED, 0, started_at=NOW - 30, ended_at=NOW - 2
        ),
        start=StartMarker("j1", NOW - 30, BEFORE),
        end=end,
    )
    (ended, finish) = decide(c, Facts(jobs={"j1": stopped}, progress=saved), NOW)
    assert isinstance(ended, EndSegment) and finish == Finish(ChainState.CANCELLED, "cancelled by user")
    assert (ended.outcome, ended.charged, ended.progress, ended.signalled_at, ended.elapsed) == (
        Outcome.CANCELLED, False, saved, NOW - 4, 28.0
    ), ended  # fmt: skip
    assert ended.reason == "chain cancelled; the command exited 0 after SIGUSR1"
    # Its walltime's signal came before the cancel: a timeout with progress, as it was.
    early = replace(stopped, end=replace(end, signalled_at=NOW - 6))
    (ended, _) = decide(c, Facts(jobs={"j1": early}, progress=saved), NOW)
    assert isinstance(ended, EndSegment) and ended.outcome is Outcome.TIMEOUT and not ended.charged, ended


def test_a_successor_that_skipped_for_the_cancels_final_marker_leaves_the_chain_cancelled() -> None:
    """The successor started as the cancelled segment ended, found the final marker and ran
    nothing: skipped, free, and the chain ends cancelled, not completed ("the goal reached")."""
    skip = EndMarker(0, 0, "", True, NOW - 1, skip="the chain has already ended")
    c = chain(seg(2, started_at=NOW - 2), cancel_requested_at=NOW - 5)
    listed = ListedJob("j2", "j2", Phase.ENDED, Outcome.COMPLETED, 0, started_at=NOW - 2, ended_at=NOW - 1)
    (ended, finish) = decide(c, Facts(jobs={"j2": JobFacts(listed=listed, end=skip)}, progress=BEFORE), NOW)
    assert isinstance(ended, EndSegment) and ended.outcome is Outcome.SKIPPED and not ended.charged, ended
    assert finish == Finish(ChainState.CANCELLED, "cancelled by user")


def test_a_cancelled_segment_that_made_no_progress_keeps_its_time_and_the_mark() -> None:
    """Time is credited whatever the checkpoint says; the mark moves only forward."""
    c = chain(seg(1, started_at=NOW - 30), cancel_requested_at=0.0)
    (cancel, _) = decide(c, Facts(jobs={}, progress=BEFORE), NOW)
    assert cancel == Cancel(
        n=1, job_id="j1", reason="chain cancelled; ran 30s; progress: none made", elapsed=30.0, progress=None
    )
    # A segment still running after its walltime (100 s) is credited its walltime alone.
    (cancel, _) = decide(chain(seg(1, started_at=NOW - 500), cancel_requested_at=0.0), Facts(), NOW)
    assert isinstance(cancel, Cancel) and cancel.elapsed == 100.0


def test_the_state_cell_without_a_service_is_the_last_known_one_as_such() -> None:
    """No service since the last tick a minute ago: "running as of 1m ago", and the time column
    counts the running segment up to that tick, not up to now."""
    from test_status import chain as status_chain
    from test_status import seg as status_seg

    c = status_chain(segments=(status_seg(1, Phase.RUNNING, started_at=NOW - 150),), used=0.0)
    assert view.state_cell(c, NOW) == "running 2m"
    assert view.state_cell(c, NOW, seen=NOW - 100) == "running as of 1m ago"
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
    assert f"running for {view.short(last_tick - started)}\n" in verbose, verbose
    assert f"budget: trained {view.short(last_tick - started)} of 1h;" in verbose, verbose
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
    match = re.fullmatch(rf"chain {chain_id} cancelled \(trained (\S+), epoch (\d+)\)", line)
    assert match, line
    data = state(chainrun, chain_id)
    seg1 = data["segments"][0]
    assert seg1["outcome"] == "cancelled" and not seg1["charged"]
    assert seg1["signalled_at"] is not None and seg1["started_at"] < seg1["signalled_at"] <= seg1["ended_at"]
    ran = seg1["ended_at"] - seg1["started_at"]
    assert data["used_seconds"] == data["trained_seconds"] > 0
    assert abs(data["used_seconds"] - ran) < 1.0
    assert match.group(1) == format_duration(data["used_seconds"])
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
    assert cells[4] == cells[7] == format_duration(account["training_seconds"])
    assert table[-1].startswith(f"trained {format_duration(data['used_seconds'])} of 1h in 1 segment;")


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
