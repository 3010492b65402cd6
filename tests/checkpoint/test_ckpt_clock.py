"""SegmentClock: the walltime signal and the deadline, chained handlers, and forked children left alone."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Optional

import pytest
from ckpt_support import no_chainrun_env, restore_signal_handlers, script_env  # noqa: F401

from chainrun.checkpoint import SegmentClock, parse_signal


class FakeTime:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_default_signals_without_chainrun_are_usr1_and_term() -> None:
    """A user who adopts the helper first gets SIGUSR1 and SIGTERM and no deadline."""
    clock = SegmentClock(install=False)
    assert clock.signals == (signal.SIGUSR1, signal.SIGTERM)
    assert clock.deadline is None
    assert not clock.should_stop()


def test_chainrun_signal_from_env_replaces_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """CHAINRUN_SIGNAL=USR2 makes USR2 (plus TERM) the walltime signals."""
    monkeypatch.setenv("CHAINRUN_SIGNAL", "USR2")
    assert SegmentClock(install=False).signals == (signal.SIGUSR2, signal.SIGTERM)


def test_chainrun_signal_is_handled_even_when_the_caller_names_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The signal chainrun will send is always caught, or it would kill the script."""
    monkeypatch.setenv("CHAINRUN_SIGNAL", "USR1")
    assert SegmentClock("USR2", install=False).signals == (signal.SIGUSR2, signal.SIGUSR1)


@pytest.mark.parametrize("value", ["USR1", "SIGUSR1", "usr1", signal.SIGUSR1, int(signal.SIGUSR1)])
def test_parse_signal_accepts_names_and_numbers(value: object) -> None:
    """The job file's 'USR1' and Python's signal constants mean the same."""
    assert parse_signal(value) is signal.SIGUSR1  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["INT", "KILL", "HUP", signal.SIGINT, 12345])
def test_parse_signal_refuses_other_signals_with_the_allowed_ones(value: object) -> None:
    """Only USR1, USR2 and TERM can be a walltime signal."""
    with pytest.raises(ValueError, match="USR1, USR2 or TERM"):
        parse_signal(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM])
def test_signal_makes_the_clock_stop_and_says_which(sig: signal.Signals) -> None:
    """Delivering the walltime signal turns should_stop() true; the process lives on."""
    clock = SegmentClock([sig])
    assert not clock
    os.kill(os.getpid(), sig)
    assert clock.should_stop() and bool(clock)
    assert clock.received is sig
    assert clock.reason == f"signal {sig.name}"


def test_previous_python_handler_is_still_called() -> None:
    """A handler installed before the clock keeps working (chained after ours)."""
    calls: list[int] = []

    def previous(signum: int, frame: Optional[FrameType]) -> None:
        calls.append(signum)

    signal.signal(signal.SIGUSR1, previous)
    clock = SegmentClock("USR1")
    os.kill(os.getpid(), signal.SIGUSR1)
    assert calls == [signal.SIGUSR1]
    assert clock.should_stop()


def test_uninstall_puts_the_previous_handler_back() -> None:
    """uninstall() (or leaving the with block) restores what was there."""

    def previous(signum: int, frame: Optional[FrameType]) -> None:
        pass

    signal.signal(signal.SIGUSR2, previous)
    with SegmentClock("USR2"):
        assert signal.getsignal(signal.SIGUSR2) is not previous
    assert signal.getsignal(signal.SIGUSR2) is previous


def test_deadline_from_env_stops_at_the_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    """CHAINRUN_DEADLINE minus the margin is when should_stop() turns true."""
    monkeypatch.setenv("CHAINRUN_DEADLINE", "1000")
    now = FakeTime(900.0)
    clock = SegmentClock(install=False, margin=30, now=now)
    assert clock.deadline == 1000.0
    now.now = 969.9
    assert not clock.should_stop()
    assert clock.remaining() == pytest.approx(0.1)
    now.now = 970.0
    assert clock.should_stop()
    assert clock.reason is not None and "deadline" in clock.reason


def test_default_margin_is_a_tenth_of_the_time_left_at_most_five_minutes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Short demo segments still get time to train; long ones stop five minutes early."""
    assert SegmentClock(install=False, deadline=1080.0, now=FakeTime(1000.0)).margin == pytest.approx(8.0)
    assert SegmentClock(install=False, deadline=4 * 3600.0, now=FakeTime(0.0)).margin == 300.0


def test_the_default_margin_is_half_the_grace_the_wrapper_gives_the_segment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The deadline stops the loop only after the walltime signal should have come (a
    script that stopped on it first and exited 0 would end a chain without a target):
    an adaptive grace of 10 s at a one-hour walltime is not undone by a 5-minute margin."""
    monkeypatch.setenv("CHAINRUN_GRACE", "10")
    assert SegmentClock(install=False, deadline=3600.0, now=FakeTime(0.0)).margin == 5.0


def test_the_clock_tells_the_wrapper_it_is_ready_once_its_handlers_are_set(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`ready` in the run directory gains a line with the segment's number, this machine and
    this process once the handlers are set (the runner holds the walltime signal until then);
    not before. Each process adds its own line (under DDP each rank does)."""
    import socket

    monkeypatch.setenv("CHAINRUN_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("CHAINRUN_SEGMENT", "7")
    (tmp_path / "ready").write_text("7 node2 99\n")  # another rank's, said first
    clock = SegmentClock(install=False)
    assert (tmp_path / "ready").read_text() == "7 node2 99\n"
    assert clock.install()
    assert (tmp_path / "ready").read_text() == f"7 node2 99\n7 {socket.gethostname()} {os.getpid()}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ready"]


def test_the_earlier_of_caller_and_chainrun_deadline_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A script's own deadline never postpones chainrun's."""
    monkeypatch.setenv("CHAINRUN_DEADLINE", "2000")
    assert SegmentClock(install=False, deadline=3000, now=FakeTime(0)).deadline == 2000
    assert SegmentClock(install=False, deadline=1500, now=FakeTime(0)).deadline == 1500


@pytest.mark.parametrize("value", ["soon", "nan", "inf"])
def test_bad_chainrun_deadline_is_an_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """A broken environment is reported, not silently ignored."""
    monkeypatch.setenv("CHAINRUN_DEADLINE", value)
    with pytest.raises(ValueError, match="CHAINRUN_DEADLINE"):
        SegmentClock(install=False)


def test_request_stop_makes_the_clock_stop() -> None:
    """Code can stop the clock too (a custom condition, a test)."""
    clock = SegmentClock(install=False)
    clock.request_stop("enough")
    assert clock.should_stop() and clock.reason == "enough"


def _fork_and_signal(sig: signal.Signals) -> tuple[int, bytes]:
    """Fork; the child sends itself ``sig`` and reports whether its clock copy stopped."""
    clock = SegmentClock()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: like a DataLoader worker forked from the training process
        try:
            os.close(read_end)
            os.kill(os.getpid(), sig)
            time.sleep(0.05)
            os.write(write_end, b"stopped" if clock.should_stop() else b"running")
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        report = f.read()
    _, status = os.waitpid(pid, 0)
    assert not clock.should_stop(), "the parent's clock must not see the child's signal"
    return status, report


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGUSR2])
def test_forked_child_neither_stops_nor_dies_on_the_walltime_signal(
    monkeypatch: pytest.MonkeyPatch, sig: signal.Signals
) -> None:
    """A worker that receives USR1/USR2 (a group-wide signal) keeps working and does not react."""
    monkeypatch.setenv("CHAINRUN_SIGNAL", sig.name[3:])
    status, report = _fork_and_signal(sig)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert report == b"running"


def test_forked_child_dies_of_sigterm_as_without_the_clock() -> None:
    """SIGTERM keeps its default meaning in workers: they terminate."""
    status, report = _fork_and_signal(signal.SIGTERM)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
    assert report == b""


def _install_in_child(queue: multiprocessing.Queue[bool]) -> None:
    clock = SegmentClock()
    queue.put(clock.install())


def test_clock_made_in_a_multiprocessing_child_installs_no_handlers() -> None:
    """A worker that builds its own clock (spawned workers re-import the script) does not catch signals."""
    ctx = multiprocessing.get_context("fork")
    queue: multiprocessing.Queue[bool] = ctx.Queue()
    proc = ctx.Process(target=_install_in_child, args=(queue,))
    proc.start()
    installed = queue.get(timeout=30)
    proc.join(30)
    assert installed is False


def test_clock_made_outside_the_main_thread_warns_and_uses_the_deadline_only() -> None:
    """Signal handlers can only be set from the main thread; the clock says so instead of failing."""
    results: list[object] = []

    def make() -> None:
        with pytest.warns(UserWarning, match="main thread"):
            results.append(SegmentClock(deadline=0.0, margin=0))

    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    clock = results[0]
    assert isinstance(clock, SegmentClock) and clock.should_stop()
    assert signal.getsignal(signal.SIGUSR1) is not clock._handle


LATE_SIGNAL_SCRIPT = """
import atexit, signal, sys, time
from chainrun.checkpoint import SegmentClock

class SlowTeardown:
    def __del__(self):
        time.sleep(1.0)  # module teardown, after Python has reset its signal handlers

atexit.register(lambda: print("exiting", flush=True))
clock = SegmentClock("USR1")
if sys.argv[1] == "plain-handler":
    clock.uninstall()
    signal.signal(signal.SIGUSR1, lambda signum, frame: None)
keeper = SlowTeardown()
"""


def exit_code_with_signal_during_teardown(tmp_path: Path, mode: str) -> int:
    script = tmp_path / "late.py"
    script.write_text(LATE_SIGNAL_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), mode], stdout=subprocess.PIPE, text=True, env=script_env()
    )
    assert proc.stdout is not None
    while "exiting" not in proc.stdout.readline():
        assert proc.poll() is None
    time.sleep(0.4)
    proc.send_signal(signal.SIGUSR1)
    return proc.wait(30)


def test_walltime_signal_during_interpreter_shutdown_does_not_kill_a_finished_run(tmp_path: Path) -> None:
    """A run that just finished exits 0 even if the walltime signal lands while Python tears down."""
    assert exit_code_with_signal_during_teardown(tmp_path, "plain-handler") == -signal.SIGUSR1, (
        "the window exists"
    )
    assert exit_code_with_signal_during_teardown(tmp_path, "clock") == 0
