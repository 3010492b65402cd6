"""`chainrun status` for people and scripts: bar, ETA, next segment, budget, --json, --watch."""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import pty
import shutil
import struct
import subprocess
import sys
import termios
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

import pytest
from conftest import cli_env
from test_store import chains, one_line_error, raw

from chainrun import status as view
from chainrun.lock import InstanceLock
from chainrun.model import Chain, ChainState, JobSpec, Outcome, Phase, Progress, Segment
from chainrun.text import duration

NOW = 1_000_000.0
CLI = Callable[..., "subprocess.CompletedProcess[str]"]


def chain(
    epoch: Optional[int] = 10,
    target: Optional[int] = 40,
    used: float = 3600.0,
    total: int = 72000,
    segments: tuple[Segment, ...] = (),
    state: ChainState = ChainState.ACTIVE,
    failures: int = 1,
) -> Chain:
    spec = JobSpec(
        name="cifar",
        command="python train.py",
        workdir="/w",
        total_time=total,
        walltime=3600,
        target_epoch=target,
        max_failures=3,
        checkpoint_dir="/w/checkpoints",
        signal="USR1",
        grace=300,
    )
    return Chain(
        id="cifar-a1b2c3",
        spec=spec,
        state=state,
        created_at=0.0,
        segments=segments,
        failures=failures,
        used=used,
        latest=Progress(epoch=epoch),
        reason="" if state is ChainState.ACTIVE else "failure budget spent",
        ended_at=None if state is ChainState.ACTIVE else NOW,
    )


def seg(n: int, phase: Phase, **kw: object) -> Segment:
    return Segment(chain_id="cifar-a1b2c3", n=n, walltime=3600, phase=phase, **kw)  # type: ignore[arg-type]


def test_bar_shows_fraction_and_epochs() -> None:
    """The bar fills in proportion, caps when full, and degrades without a target or an epoch."""
    assert view.bar(3, 12) == "[##........] 3/12"
    assert view.bar(0, 12) == "[..........] 0/12"
    assert view.bar(15, 12) == "[##########] 15/12"
    assert view.bar(5, None) == "epoch 5"
    assert view.bar(None, 12) == "-"


def test_eta_is_epochs_left_over_the_epoch_rate_of_training_time() -> None:
    """10 epochs in 1 h of ended segments, 30 to go: 3 h."""
    c = chain(epoch=10, target=40, used=3600.0)
    assert view.epoch_rate(c, NOW) == 10 / 3600
    assert view.eta(c, NOW) == 3 * 3600
    assert view.row(c, NOW)[3] == "3h"


def test_eta_counts_only_the_epochs_trained_by_this_chain() -> None:
    """Submitted on a checkpoint at epoch 50, at 60 after 1 h: 10/h, so 40 to go is 4 h, not 40 min."""
    c = replace(chain(epoch=60, target=100, used=3600.0), baseline=Progress(epoch=50))
    assert view.epoch_rate(c, NOW) == 10 / 3600
    assert view.eta(c, NOW) == 4 * 3600
    assert view.eta(replace(c, latest=Progress(epoch=50)), NOW) is None  # nothing gained yet


def test_eta_counts_the_running_segment_time_so_far() -> None:
    """1 h ended plus 30 min running, 15 epochs: 25 left at 10/h is 2h30m."""
    running = seg(2, Phase.RUNNING, job_id="1234", started_at=NOW - 1800)
    c = chain(epoch=15, used=3600.0, segments=(running,))
    assert view.budget_used(c, NOW) == 5400
    assert view.eta(c, NOW) == 9000
    assert view.row(c, NOW)[3] == "2h30m"


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (0, "0s"),
        (44.6, "45s"),
        (59.5, "1m"),
        (150, "2m30s"),
        (599.4, "9m59s"),
        (599.6, "10m"),
        (629, "10m"),
        (630, "11m"),
        (3599, "1h"),
        (3929, "1h5m"),
        (3930, "1h6m"),
        (86370, "1d"),
        (95400, "1d3h"),
    ],
)
def test_a_duration_is_rounded_to_the_unit_shown_never_cut(seconds: float, shown: str) -> None:
    """Seconds below ten minutes, minutes below a day, then hours; each to the nearest, a half
    up, and a unit that rounds over carries (issue 36, finding 4: ``2m30s`` was ``2m``)."""
    assert duration(seconds) == shown
    assert view.when(NOW - seconds, NOW) in (f"{shown} ago", "just now")


def test_status_json_calls_the_time_counted_against_total_time_budget_used() -> None:
    """``budget_used_seconds``: ended segments and the running one so far, the TIME column's
    figure; ``trained_seconds`` is only the accounting's, the time the command trained
    (issue 36, finding 4: two "trained" that differ)."""
    running = seg(2, Phase.RUNNING, job_id="1234", started_at=NOW - 1800)
    data = view.to_json(chain(epoch=15, used=3600.0, segments=(running,)), NOW)
    assert data["budget_used_seconds"] == 5400 and data["used_seconds"] == 3600
    assert "trained_seconds" not in data and "trained_seconds" in data["accounting"]


def test_eta_beyond_what_is_left_of_the_budget_is_flagged() -> None:
    """At this rate the target comes after total_time runs out: say so."""
    c = chain(epoch=10, target=40, used=3600.0, total=7200)
    assert view.row(c, NOW)[3] == "3h > budget"


def test_eta_unknown_is_a_dash_and_completed_is_done() -> None:
    """No epoch yet, no target, or no time trained: "-"; a completed chain: "done"."""
    assert view.row(chain(epoch=None), NOW)[3] == "-"
    assert view.row(chain(target=None), NOW)[3] == "-"
    assert view.row(chain(used=0.0), NOW)[3] == "-"
    assert view.row(chain(state=ChainState.COMPLETED), NOW)[3] == "done"


def test_state_says_what_the_chain_is_doing_now() -> None:
    """Running for how long, queued with the scheduler's reason, retrying, submitting; once
    ended, how it ended."""
    running = seg(2, Phase.RUNNING, job_id="1234", started_at=NOW - 600)
    queued = seg(3, Phase.PENDING, job_id="1235", reason="Dependency")
    c = chain(segments=(running, queued))
    cells = dict(zip(view.HEADER, view.row(c, NOW)))
    assert cells["STATE"] == "running 10m"
    assert cells["JOBS"] == "1234,1235"
    waiting = chain(segments=(seg(1, Phase.PENDING, job_id="99", reason="Priority"),))
    assert view.state_cell(waiting, NOW) == "queued (Priority)"
    retry = chain(segments=(seg(4, Phase.SUBMITTING, retry_at=NOW + 40, reason="sbatch timed out"),))
    assert view.state_cell(retry, NOW) == "retry in 40s"
    assert view.state_cell(chain(segments=(seg(4, Phase.SUBMITTING),)), NOW) == "submitting"
    assert view.state_cell(chain(state=ChainState.FAILED), NOW) == "failed"


def test_segments_count_only_those_that_ran() -> None:
    """A successor cancelled while queued (the goal was met, or the chain was cancelled)
    never ran: it is not counted; the budget's most segments is shown as a bound."""
    ran = seg(1, Phase.ENDED, job_id="7", outcome=Outcome.TIMEOUT, started_at=NOW - 4000)
    fast = seg(2, Phase.ENDED, job_id="8", outcome=Outcome.FAILED, exit_code=1)  # start never seen
    never = seg(3, Phase.ENDED, job_id="9", outcome=Outcome.CANCELLED)
    running = seg(4, Phase.RUNNING, job_id="10")
    queued = seg(5, Phase.PENDING, job_id="11")
    c = chain(segments=(ran, fast, never, running, queued))
    assert view.segments_run(c) == 3
    assert dict(zip(view.HEADER, view.row(c, NOW)))["SEGMENTS"] == "3 of ≤20"
    assert [s["ran"] for s in view.to_json(c, NOW)["segments"]] == [True, True, False, True, False]


def test_failures_read_as_used_of_the_budget_and_the_one_past_it_as_over() -> None:
    """max_failures = 3 allows 3; the 4th fails the chain and reads "4 (budget 3)", never "4/3"."""
    assert view.failures_cell(chain(failures=0)) == "0 of 3"
    assert view.failures_cell(chain(failures=3)) == "3 of 3"
    assert view.failures_cell(chain(failures=4, state=ChainState.FAILED)) == "4 (budget 3)"


def test_time_is_trained_of_the_budget() -> None:
    """TIME is the training time so far of total_time, in short units."""
    cells = dict(zip(view.HEADER, view.row(chain(used=5400.0), NOW)))
    assert cells["TIME"] == "1h30m of 20h"


def test_times_are_relative_never_epoch_seconds() -> None:
    """A moment reads as an age or a wait; a saved checkpoint in a stored reason as a date."""
    assert view.when(NOW - 300, NOW) == "5m ago"
    assert view.when(NOW + 7200, NOW) == "in 2h"
    assert view.when(NOW, NOW) == "just now"
    saved = Progress(file="model.pt", saved_at=1795675338.0)
    assert saved.describe() == "checkpoint model.pt saved 2026-11-26 06:42:18 UTC"
    c = replace(chain(epoch=None), latest=saved)
    text = view.table([c], 1795675338.0 + 300, verbose=True)
    assert "progress: a checkpoint, saved 5m ago (model.pt)" in text
    assert "1795675338" not in text


# -- the whole frame ----------------------------------------------------------------


def realistic(name: str = "cifar", n: str = "a1b2c3") -> Chain:
    """A chain in its third segment: one ran to its walltime, one was cancelled while queued,
    one runs, the next waits on it."""
    segments = (
        seg(1, Phase.ENDED, job_id="4711", outcome=Outcome.TIMEOUT, started_at=NOW - 7800),
        seg(2, Phase.ENDED, job_id="4712", outcome=Outcome.CANCELLED, charged=True),
        seg(3, Phase.RUNNING, job_id="4713", started_at=NOW - 1500, after="4711"),
        seg(4, Phase.PENDING, job_id="4714", reason="Dependency", after="4713"),
    )
    c = chain(epoch=12, target=40, used=3600.0, segments=segments)
    return replace(c, id=f"{name}-{n}", spec=replace(c.spec, name=name))


def failed(name: str = "resnet50", n: str = "0f9e8d") -> Chain:
    """A chain that spent its failure budget; its last segment left the lines of a traceback."""
    tail = (
        "epoch 3: loss nan",
        "Traceback (most recent call last):",
        '  File "train.py", line 9',
        "ValueError: nan",
    )
    segments = tuple(
        seg(
            i,
            Phase.ENDED,
            job_id=str(500 + i),
            outcome=Outcome.FAILED,
            exit_code=1,
            charged=True,
            started_at=NOW - 3000 + 600 * i,
            ended_at=NOW - 2900 + 600 * i,
            tail=tail,
        )
        for i in range(1, 5)
    )
    c = chain(epoch=3, target=90, used=400.0, segments=segments, failures=4, state=ChainState.FAILED)
    reason = "failure budget spent: segment 4 failed (exit 1): the command exited 1 on its own"
    return replace(c, id=f"{name}-{n}", spec=replace(c.spec, name=name), reason=reason)


SERVICE = (
    "service: not running; chains advance only while one runs:\n"
    "  install and start it with `chainrun service install --now`"
)


@pytest.fixture(autouse=True)
def a_machine_with_systemd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The goldens' machine: a systemd user manager runs (its private socket is there), and
    no chainrun unit is installed. Returns the runtime directory."""
    runtime = tmp_path / "runtime"
    (runtime / "systemd").mkdir(parents=True)
    (runtime / "systemd" / "private").touch()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return runtime


def test_golden_one_chain_at_80_columns(tmp_path: Path) -> None:
    """The whole of `chainrun status` for one active chain: one line, no reason below it."""
    assert view.frame(tmp_path, [realistic()], NOW) == (
        "CHAIN         STATE        PROGRESS            ETA    FAILURES  SEGMENTS\n"
        "cifar-a1b2c3  running 25m  [###.......] 12/40  3h18m  1 of 3    2 of ≤20\n" + SERVICE
    )


def test_golden_two_chains_the_failed_one_with_its_reason(tmp_path: Path) -> None:
    """A failed chain gets the one line below the table that says why; the active one none."""
    assert view.frame(tmp_path, [realistic(), failed()], NOW) == (
        "CHAIN            STATE        PROGRESS            ETA    FAILURES      SEGMENTS\n"
        "cifar-a1b2c3     running 25m  [###.......] 12/40  3h18m  1 of 3        2 of ≤20\n"
        "resnet50-0f9e8d  failed       [..........] 3/90   -      4 (budget 3)  4 of ≤20\n"
        "resnet50-0f9e8d: failure budget spent: segment 4 failed (exit 1): the command\n"
        "    exited 1 on its own\n" + SERVICE
    )


def test_golden_one_failed_chain_shows_its_last_output_and_the_logs_command(tmp_path: Path) -> None:
    """`status CHAIN` of a failed chain: the reason, the failing segment's last lines, and
    the command that shows all of its output."""
    assert view.frame(tmp_path, [failed()], NOW, tails=True) == (
        "CHAIN            STATE   PROGRESS           ETA  FAILURES      SEGMENTS\n"
        "resnet50-0f9e8d  failed  [..........] 3/90  -    4 (budget 3)  4 of ≤20\n"
        "resnet50-0f9e8d: failure budget spent: segment 4 failed (exit 1): the command\n"
        "    exited 1 on its own\n"
        "  the last lines of segment 4's output:\n"
        "    epoch 3: loss nan\n"
        "    Traceback (most recent call last):\n"
        '      File "train.py", line 9\n'
        "    ValueError: nan\n"
        "  all of it: chainrun logs resnet50-0f9e8d -n 4\n"
        "service: not running"  # no chain left for one to advance: no advice to start one
    )


def test_a_wider_terminal_gets_more_columns_and_verbose_every_detail(tmp_path: Path) -> None:
    """At 120 columns the time and job ids fit too; -v adds every chain's facts."""
    lines = view.table([realistic(), failed()], NOW, width=120).splitlines()
    assert lines[0].split() == list(view.HEADER)
    assert lines[1].endswith("1h25m of 20h  4713,4714")
    text = view.table([realistic()], NOW, verbose=True)
    assert "\ncifar-a1b2c3:\n  segment 3: job 4713 running for 25m\n" in text
    assert "  next: segment 4: job 4714 queued (Dependency)\n" in text
    assert "  budget: used 1h25m of 20h; 2 of at most 20 segments run; failures 1 of 3\n" in text


def test_only_chains_that_need_a_person_get_a_line_by_default() -> None:
    """Failed, stuck, a submission being retried, a job held by the scheduler: a line each.
    Completed, cancelled, exhausted and plainly queued chains: none (-v shows them)."""
    quiet = [
        realistic(n="000001"),
        replace(realistic(n="000002"), state=ChainState.COMPLETED, reason="target epoch 40 reached"),
        replace(realistic(n="000003"), state=ChainState.CANCELLED, reason="cancelled by the user"),
        replace(realistic(n="000004"), state=ChainState.EXHAUSTED, reason="total_time used"),
    ]
    for c in quiet:
        assert view.attention(c, NOW) == ""
    retry = chain(segments=(seg(2, Phase.SUBMITTING, retry_at=NOW + 40, reason="sbatch: timed out"),))
    assert view.attention(retry, NOW) == "segment 2: submission failed (retry in 40s): sbatch: timed out"
    held = chain(segments=(seg(2, Phase.PENDING, job_id="88", reason="JobHeldUser"),))
    assert view.attention(held, NOW).startswith("segment 2: job 88 is held by the scheduler (JobHeldUser)")
    waits = seg(3, Phase.PENDING, job_id="89", reason="held (hqw)", after="88")
    running = seg(2, Phase.RUNNING, job_id="88")
    assert view.attention(chain(segments=(running, waits)), NOW) == ""  # SGE's -hold_jid: normal
    assert view.attention(chain(segments=(replace(waits, after="87"),)), NOW).startswith("segment 3: job 89")
    stuck = replace(chain(), state=ChainState.STUCK, reason="ticks keep failing: disk full")
    assert view.attention(stuck, NOW) == "ticks keep failing: disk full"
    lines = view.table([*quiet, retry], NOW).splitlines()
    assert len(lines) == 1 + len(quiet) + 1 + 1
    assert lines[-1].startswith("cifar-a1b2c3: segment 2: submission failed")


def test_every_line_fits_80_columns_with_long_names_ids_and_reasons(tmp_path: Path) -> None:
    """The longest names, 8-digit job ids, long pending reasons and reasons, verbose or not:
    no line is ever wider than 80 columns by default, nor than a terminal's 40 or 132."""
    long_name = "a" * 30 + "-imagenet-resnet152-mixed-precision-sweep"[: 64 - 30]
    busy = replace(
        realistic(long_name, "ffffff"),
        segments=(
            seg(7, Phase.RUNNING, job_id="12345678", started_at=NOW - 86000),
            seg(8, Phase.PENDING, job_id="12345679", reason="ReqNodeNotAvail, UnavailableNodes:gpu[001-128]"),
        ),
        failures=2,
    )
    big = replace(busy, spec=replace(busy.spec, target_epoch=1_000_000), latest=Progress(epoch=999_999))
    bad = replace(failed(long_name, "eeeeee"), reason="x" * 300)
    retry = replace(
        chain(segments=(seg(2, Phase.SUBMITTING, retry_at=NOW + 4000, reason="sbatch: " + "e " * 200),)),
        id=long_name + "-dddddd",
    )
    from chainrun.store import DamagedChain

    damaged = DamagedChain(
        long_name + "-cccccc", long_name, "state is 'paused', " * 10, ("1", "2"), "sqlite3 x"
    )
    chains = [busy, big, bad, retry]
    for width, verbose in itertools.product((40, 80, 132), (False, True)):
        text = view.frame(tmp_path, chains, NOW, [damaged], width=width, verbose=verbose, tails=True)
        for line in text.splitlines():
            if "remove it with: sqlite3" in line:
                continue  # a command to copy whole is never broken
            assert len(line) <= width, line
    text = view.frame(tmp_path, chains, NOW, [damaged], verbose=True, tails=True)
    assert max(len(line) for line in text.splitlines() if "sqlite3" not in line) <= 80
    table = view.table(chains, NOW).splitlines()
    assert table[1].startswith(long_name[:14]) and table[1].split()[0].endswith("…-ffffff")


def test_output_lines_of_a_failed_segment_are_shown_not_obeyed(tmp_path: Path) -> None:
    """A training script's escape sequences arrive as text, not as terminal commands."""
    c = failed()
    hostile = replace(c.segments[-1], tail=("\x1b[2Jclear\tscreen\x07",))
    text = view.table([replace(c, segments=(*c.segments[:-1], hostile))], NOW, tails=True)
    assert "\x1b" not in text and "\\x1b[2Jclear    screen\\x07" in text


def test_json_carries_eta_rate_and_next_segment() -> None:
    """--json gives scripts the same facts unrounded."""
    queued = seg(3, Phase.PENDING, job_id="1235", reason="Dependency")
    data = view.to_json(chain(segments=(queued,)), NOW)
    assert data["eta_seconds"] == 3 * 3600
    assert data["epochs_per_hour"] == 10.0
    assert data["next"] == {
        "n": 3,
        "job_id": "1235",
        "phase": "pending",
        "reason": "Dependency",
        "retry_at": None,
    }
    assert data["failures"] == 1 and data["max_failures"] == 3
    assert data["segments_run"] == 0 and data["attention"] is None
    assert view.to_json(failed(), NOW)["segments"][-1]["tail"][-1] == "ValueError: nan"


def test_a_damaged_chain_is_a_row_of_dashes_and_lines_saying_what_is_wrong() -> None:
    """It cannot be shown as a chain; it is shown all the same, with the way out."""
    from chainrun.store import DamagedChain

    damaged = DamagedChain(
        id="bad-000000",
        name="bad",
        problem="state is 'paused', not one of ...",
        jobs=(),
        removal="sqlite3 X '...'",
    )
    lines = view.table([chain()], NOW, [damaged]).splitlines()
    assert lines[2].split()[:2] == ["bad-000000", "damaged"] and set(lines[2].split()[2:]) == {"-"}
    assert lines[3] == "bad-000000: damaged: state is 'paused', not one of ...; the service skips it"
    assert lines[4] == "  `chainrun cancel` cannot act on it; remove it with: sqlite3 X '...'"
    frame = view.frame(Path("/nonexistent"), [], NOW, [damaged])
    assert not frame.startswith("no chains") and "bad-000000" in frame


def test_service_line_tells_running_from_stale(tmp_path: Path) -> None:
    """A service is running while it holds the lock, and then its status file has the news; a
    status file without the lock held (a service that stopped, or died and whose pid may be
    another process's by now) is not one running, and says when its last tick was."""
    assert view.service_line(tmp_path, NOW).startswith("service: not running; ")
    (tmp_path / "service.status").write_text(
        json.dumps({"pid": os.getpid(), "at": NOW - 4, "status": "1 running, 0 queued, 0 failed"})
    )
    assert view.service_line(tmp_path, NOW).startswith("service: not running (last tick 4s ago); ")
    lock = InstanceLock(tmp_path)
    lock.acquire()
    try:
        assert view.service_line(tmp_path, NOW) == (
            f"service: running (pid {os.getpid()}); last tick 4s ago: 1 running, 0 queued, 0 failed"
        )
    finally:
        lock.release()
    assert view.service_line(tmp_path, NOW).startswith("service: not running (last tick 4s ago); ")


def test_the_advice_to_start_a_service_comes_only_while_a_chain_has_not_ended(tmp_path: Path) -> None:
    """With no chains, or only ended ones, a service would have nothing to do: status says it
    is not running, and no more (issue 36: it gave the advice to start one)."""
    assert view.frame(tmp_path, [], NOW).splitlines()[-1] == "service: not running"
    assert view.frame(tmp_path, [failed()], NOW).splitlines()[-1] == "service: not running"
    assert view.frame(tmp_path, [failed(), realistic()], NOW).endswith(SERVICE)


def test_the_advice_on_starting_a_service_fits_the_machine(
    tmp_path: Path, a_machine_with_systemd: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Always "`chainrun service install --now`" was wrong on a machine without systemd, and
    for a user whose unit was installed. Now: install where a user manager runs and no unit
    is; start the unit where one is; else the command that starts the service by hand here,
    with this state directory."""
    home = tmp_path / "state"
    assert view.service_line(home, NOW).endswith(
        "\n  install and start it with `chainrun service install --now`"
    )
    unit = tmp_path / "config" / "systemd" / "user" / "chainrun.service"
    unit.parent.mkdir(parents=True)
    unit.write_text("[Service]\n")
    assert view.service_line(home, NOW).endswith(
        "\n  start it with `systemctl --user start chainrun.service`"
    )
    (a_machine_with_systemd / "systemd" / "private").unlink()
    advice = view.service_line(home, NOW).splitlines()[1:]
    assert advice[0] == "  no systemd user manager here; start one with:"
    assert f"CHAINRUN_HOME={home}" in advice[1] and "daemon" in advice[1]
    assert view.frame(home, [realistic()], NOW, width=40).splitlines()[-1] == advice[1]  # whole, to paste
    monkeypatch.setenv("PATH", str(tmp_path))  # no tmux
    assert " nohup " in view.service_line(home, NOW) and f">> {home}/daemon.out 2>&1 &" in view.service_line(
        home, NOW
    )


# -- through the CLI --------------------------------------------------------------


def cancelled_chain(tmp_path: Path, chainrun: CLI, name: str = "w") -> str:
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(Path(__file__).parent / "data" / "trainer.py", work)
    (work / "job.toml").write_text(
        f'name = "{name}"\ncommand = "python3 trainer.py"\ntotal_time = "1h"\nwalltime = "10m"\n'
        "target_epoch = 5\n"
    )
    chain_id: str = chainrun("submit", str(work / "job.toml"), check=True).stdout.strip()
    chainrun("cancel", chain_id, check=True)
    return chain_id


def test_status_table_through_the_cli_names_the_chain_and_the_service(tmp_path: Path, chainrun: CLI) -> None:
    """`chainrun status` prints the header, the chain, and whether a service runs."""
    chain_id = cancelled_chain(tmp_path, chainrun)
    out = chainrun("status", check=True).stdout.splitlines()
    assert out[0].split() == list(view.HEADER)  # a short id leaves room for every column
    assert out[1].startswith(chain_id) and " cancelled " in out[1]
    # Only an ended chain: nothing for a service to do, so no advice to start one (issue 36).
    assert out[-1] == "service: not running" and "service install" not in "\n".join(out)
    assert all(len(line) <= 80 for line in out)


def test_watch_and_json_together_are_refused(chainrun: CLI) -> None:
    """--watch is for people; combined with --json it is a one-line usage error."""
    result = chainrun("status", "--watch", "--json")
    assert result.returncode == 2 and "--watch draws a table" in result.stderr


@pytest.mark.parametrize("columns", [80, 132])
def test_watch_redraws_in_place_at_the_terminals_width_and_stops_when_the_chain_ends(
    tmp_path: Path, chainrun: CLI, home: Path, columns: int
) -> None:
    """On a TTY each frame homes the cursor and clears the rest, no line wider than the
    terminal (an 80-column one gets the short id; a wider one the whole id and more
    columns); watching an ended chain returns."""
    chain_id = cancelled_chain(tmp_path, chainrun, name="imagenet-resnet152-sweep-lr3")
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = cli_env(home)
    env.pop("COLUMNS", None)  # it would win over the terminal's own size
    proc = subprocess.Popen(
        [sys.executable, "-m", "chainrun", "status", chain_id, "--watch", "0.2"],
        stdout=follower,
        stderr=subprocess.PIPE,
        env=env,
    )
    os.close(follower)
    assert proc.wait(60) == 0, proc.stderr.read() if proc.stderr else ""
    output = b""
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:
            break
        if not data:
            break
        output += data
    os.close(leader)
    text = output.decode()
    assert text.startswith("\x1b[H") and text.endswith("\x1b[J")
    lines = text[len("\x1b[H") : -len("\x1b[J")].replace("\r\n", "\n").split("\x1b[K\n")
    assert all(len(line) <= columns for line in lines), lines
    header = next(line for line in lines if line.startswith("CHAIN"))
    row = lines[lines.index(header) + 1]
    if columns == 80:
        assert chain_id not in row and f"…{chain_id[-7:]}" in row
        assert "JOBS" not in header
    else:
        assert chain_id in text and header.split() == list(view.HEADER)


def test_status_shows_a_damaged_chain_beside_the_others_and_cancel_refuses_it_in_one_line(
    home: Path, chainrun: CLI
) -> None:
    """A row with bad JSON made `status` a traceback; now: the good chain's row, the damaged
    chain's row and its line, exit 0; `cancel` says it cannot, `history` still reads it."""
    bad, good = chains(home, "bad", "good")
    db = raw(home)
    db.execute("UPDATE chains SET spec = '{oops' WHERE id = ?", (bad,))
    db.close()
    out = chainrun("status", check=True).stdout.splitlines()
    assert out[1].startswith(good) and " active " in out[1]
    assert out[2].split()[:2] == [bad, "damaged"]
    assert out[3].startswith(f"{bad}: damaged: spec is not valid JSON")
    assert any(
        line.startswith("  `chainrun cancel` cannot act on it; remove it with: sqlite3 ") for line in out
    )
    assert out[-2].startswith("service: ")
    data = json.loads(chainrun("status", "--json", check=True).stdout)
    assert [(c["id"], c["state"]) for c in data] == [(good, "active"), (bad, "damaged")]
    line = one_line_error(chainrun("cancel", bad), 1)
    assert f"chain {bad} is damaged: spec is not valid JSON" in line
    assert "chain submitted" in chainrun("history", bad, check=True).stdout
    line = one_line_error(chainrun("status", bad), 1)
    assert "is damaged" in line


def test_status_of_an_empty_reference_is_a_usage_error(home: Path, chainrun: CLI) -> None:
    """`status ""` listed every chain, as if no chain had been named."""
    chains(home, "abc")
    assert "no chain given" in one_line_error(chainrun("status", ""), 2)


def test_status_of_a_failed_chain_shows_its_last_output_lines_and_the_logs_command(
    tmp_path: Path, chainrun: CLI
) -> None:
    """Through the real local runner: a command that fails ends the chain; `status CHAIN`
    shows its details (the reason first), the failing segment's last lines and `chainrun
    logs CHAIN -n 1`; `status` of all chains shows the reason only."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "job.toml").write_text(
        'name = "boom"\ncommand = "echo preparing; echo the data is gone >&2; exit 3"\n'
        'total_time = "2m"\nwalltime = "1m"\nmax_failures = 0\n'
    )
    result = chainrun("run", str(work / "job.toml"), "--interval", "0.3")
    assert result.returncode == 1, result.stderr
    chain_id = json.loads(chainrun("status", "--json", check=True).stdout)[0]["id"]
    out = chainrun("status", chain_id, check=True).stdout.splitlines()
    assert out[1].startswith(chain_id) and " failed " in out[1]
    assert out[2] == f"{chain_id}:" and out[3].startswith("  reason: failure budget spent")
    assert "    the data is gone" in out and "    preparing" in out, "\n".join(out)
    assert f"  all of it: chainrun logs {chain_id} -n 1" in out
    listing = chainrun("status", check=True).stdout
    assert f"{chain_id}: failure budget spent" in listing and "the data is gone" not in listing
