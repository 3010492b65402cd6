"""The segment wrapper every backend runs, run here with bash as a scheduler would run it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import conftest
import pytest
from conftest import REPO, need, wait_for
from test_slurm_backend import hostile_spec

from chainrun.model import EndMarker, JobSpec, Progress
from chainrun.schedulers.segment import SegmentJob, parse_end_marker, parse_start_marker
from chainrun.schedulers.slurm import SlurmScheduler


def wrapper_spec(work: Path) -> JobSpec:
    """The hostile spec, with a grace that fits the one-minute segments run here (its own,
    five minutes, would have the wrapper's timer send the signal at once)."""
    return replace(hostile_spec(str(work)), grace=10)


def write_segment(job: SegmentJob) -> None:
    """The segment's batch script and the runner it runs, as ``Cluster.write_script`` leaves them."""
    conftest.write_segment(job, SlurmScheduler())


def run_wrapper(
    work: Path, command: str, n: int = 1, extra_env: Optional[dict[str, str]] = None
) -> tuple[subprocess.CompletedProcess[str], SegmentJob]:
    spec = replace(wrapper_spec(work), command=command)
    job = SegmentJob("hostile-1a2b3c", n, spec, 60)
    os.makedirs(job.run_dir, exist_ok=True)
    write_segment(job)
    proc = subprocess.run(
        ["bash", job.script_path],
        env={**wrapper_env(), **(extra_env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc, job


def wrapper_env() -> dict[str, str]:
    """This environment without what would make the wrapper think it runs in a job."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JOB_ID", "CHAINRUN_"))}


def start_logged(job: SegmentJob, **env: str) -> subprocess.Popen[bytes]:
    """The wrapper with its output in the segment's log, as the scheduler runs it."""
    os.makedirs(job.run_dir, exist_ok=True)
    write_segment(job)
    with open(job.log_path, "wb") as log:
        return subprocess.Popen(
            ["bash", job.script_path], env={**wrapper_env(), **env}, stdout=log, stderr=log
        )


def marker(job: SegmentJob) -> EndMarker:
    found = parse_end_marker(Path(job.stem + ".end").read_bytes())
    assert found is not None
    return found


@pytest.fixture
def work(tmp_path: Path) -> Path:
    path = tmp_path / "my run's dir $x"
    path.mkdir()
    return path


def test_hostile_values_reach_the_command_unchanged(work: Path) -> None:
    """The command and [env] arrive byte for byte; nothing in them is executed by the wrapper."""
    proc, job = run_wrapper(work, "printf '%s|%s' \"$NOTE\" \"$EMPTY\" > seen.txt; echo 'it''s' >> seen.txt")
    assert proc.returncode == 0, proc.stderr
    assert (work / "seen.txt").read_text() == "a'b\"c $(id) `id` ${X}\nline two|its\n"
    assert (marker(job).exit_code, marker(job).skipped) == (0, False)


def test_the_services_systemd_variables_do_not_reach_the_command(work: Path) -> None:
    """The job inherits the submitter's environment, but not the sd_notify socket or watchdog meant for the service."""
    service_env = {
        "NOTIFY_SOCKET": "@/x",
        "WATCHDOG_USEC": "30000000",
        "WATCHDOG_PID": "1",
        "JOURNAL_STREAM": "8:9",
    }
    proc, _ = run_wrapper(work, "env > env.txt", extra_env={**service_env, "MY_SETTING": "kept"})
    assert proc.returncode == 0, proc.stderr
    names = {line.split("=", 1)[0] for line in (work / "env.txt").read_text().splitlines()}
    assert "MY_SETTING" in names and "NOTE" in names  # the rest, and [env], arrive
    assert names.isdisjoint(service_env)


def test_every_variable_taken_from_the_submitting_shell_reaches_the_command(work: Path) -> None:
    """inherit_env's values, as the submitting shell had them, under [env] (which wins)."""
    spec = replace(
        wrapper_spec(work),
        command='printf "%s|%s|%s" "$FROM_SHELL" "$ALSO_FROM_SHELL" "$NOTE" > seen.txt',
        inherited=(("FROM_SHELL", "one $x"), ("ALSO_FROM_SHELL", "two"), ("NOTE", "overridden by [env]")),
    )
    job = SegmentJob("hostile-1a2b3c", 1, spec, 60)
    os.makedirs(job.run_dir)
    write_segment(job)
    proc = subprocess.run(
        ["bash", job.script_path], env=wrapper_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert (work / "seen.txt").read_text() == "one $x|two|a'b\"c $(id) `id` ${X}\nline two"


@pytest.mark.parametrize(
    ("setup", "why"),
    [
        ("progress", "epoch 30 already reached target_epoch 30"),
        ("done", "the checkpoint says training is done"),
        ("final", "the chain has already ended"),
    ],
)
def test_successor_that_starts_after_the_goal_exits_at_once_without_training(
    work: Path, setup: str, why: str
) -> None:
    """A successor the service could not cancel in time runs nothing and leaves a 'skipped' marker."""
    spec = wrapper_spec(work)
    job = SegmentJob("hostile-1a2b3c", 2, spec, 60)
    os.makedirs(job.run_dir, exist_ok=True)
    os.makedirs(spec.checkpoint_dir, exist_ok=True)
    sidecar = {"version": 1, "epoch": 30 if setup == "progress" else 3, "step": 0, "done": setup == "done"}
    Path(spec.checkpoint_dir, "chainrun-progress.json").write_text(json.dumps(sidecar))
    if setup == "final":
        Path(job.run_dir, "final").write_text("chain ended\n")
    proc, job = run_wrapper(work, "touch trained", n=2)
    assert proc.returncode == 0, proc.stderr
    assert f"segment 2 skipped: {why}" in proc.stdout
    assert not (work / "trained").exists()
    assert marker(job).skipped and marker(job).exit_code == 0


@pytest.mark.parametrize("code", [99, 100])
def test_exit_codes_sge_would_act_on_are_never_passed_on(work: Path, code: int) -> None:
    """99 (SGE: reschedule) and 100 (SGE: error state) leave the wrapper as 1; the marker keeps the original."""
    proc, job = run_wrapper(work, f"exit {code}")
    assert proc.returncode == 1
    assert (marker(job).exit_code, marker(job).original) == (1, code)


def test_walltime_signal_that_comes_early_is_passed_on_at_walltime_minus_grace(work: Path) -> None:
    """Slurm may send --signal up to 60 s early (seen here: before the command had started):
    the wrapper holds it until walltime - grace, so the command trains on and gets it then."""
    spec = replace(
        wrapper_spec(work),
        grace=3,
        command="echo $CHAINRUN_DEADLINE > deadline; trap 'date +%s > got; exit 0' USR1; "
        "while :; do sleep 0.1; done",
    )
    job = SegmentJob("hostile-1a2b3c", 1, spec, 15)  # held for up to 12 s: early even on a loaded machine
    os.makedirs(job.run_dir)
    write_segment(job)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JOB_ID", "CHAINRUN_"))}
    proc = subprocess.Popen(["bash", job.script_path], env=env, stdout=subprocess.PIPE, text=True)
    wait_for((work / "deadline").exists, 30, "the command to start")
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert "SIGUSR1 came" in out and "early" in out
    deadline = int((work / "deadline").read_text())
    assert int((work / "got").read_text()) >= deadline - 3
    assert marker(job).signal == "USR1" and marker(job).outcome().value == "timeout"


def test_a_walltime_signal_in_the_wrappers_first_seconds_is_held_too(work: Path, tmp_path: Path) -> None:
    """Slurm's --signal may come before the runner has even started the command (a one-minute
    job with grace 40 s got it in its first seconds): it must not kill the job (bash's and
    Python's default for SIGUSR1 is to die, unrecorded and charged as a crash). Here it lands
    while the runner asks Slurm when the job started (a slow `squeue`, as on a busy cluster)."""
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "squeue").write_text(f"#!/bin/sh\ntouch {tmp_path}/in-preamble\nsleep 2\n")
    (shims / "scontrol").write_text("#!/bin/sh\necho JobId=7 JobState=RUNNING\n")  # no PreemptTime
    for shim in shims.iterdir():
        shim.chmod(0o755)
    spec = replace(
        wrapper_spec(work),
        grace=3,
        command="trap 'date +%s > got; exit 0' USR1; touch started; while :; do sleep 0.1; done",
    )
    job = SegmentJob("hostile-1a2b3c", 1, spec, 15)
    write_segment(job)
    env = {**wrapper_env(), "PATH": f"{shims}:{os.environ['PATH']}", "SLURM_JOB_ID": "7"}
    proc = subprocess.Popen(["bash", job.script_path], env=env, stdout=subprocess.PIPE, text=True)
    wait_for((tmp_path / "in-preamble").exists, 30, "the runner to ask when the job started")
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert (work / "started").exists() and (work / "got").exists(), out
    assert marker(job).signal == "USR1" and marker(job).outcome().value == "timeout"


def _sidecar(epoch: int, saved_at: float) -> str:
    return json.dumps({"done": False, "epoch": epoch, "saved_at": saved_at, "step": 0, "version": 1}) + "\n"


def test_markers_record_the_checkpoint_each_segment_found_and_left(work: Path) -> None:
    """The start marker has the checkpoint at the start, the end marker the one the command left."""
    spec = wrapper_spec(work)
    os.makedirs(spec.checkpoint_dir, exist_ok=True)
    sidecar = Path(spec.checkpoint_dir, "chainrun-progress.json")
    sidecar.write_text(_sidecar(3, 1700000000.25))
    later = _sidecar(5, 1700000100.5).strip().replace('"', '\\"')
    proc, job = run_wrapper(
        work, f'printf "%s\\n" "{later}" > "$CHAINRUN_CHECKPOINT_DIR/chainrun-progress.json"'
    )
    assert proc.returncode == 0, proc.stderr
    start = parse_start_marker(Path(job.stem + ".start").read_bytes())
    assert start.progress == Progress(epoch=3, step=0, saved_at=1700000000.25)
    assert marker(job).progress == Progress(epoch=5, step=0, saved_at=1700000100.5)


@pytest.mark.parametrize("kind", ["fifo", "zero", "directory"])
def test_a_sidecar_that_is_no_regular_file_never_blocks_the_wrapper(work: Path, kind: str) -> None:
    """A FIFO with no writer, a link to /dev/zero or a directory as the sidecar: the wrapper
    neither hangs nor reads without end; the command runs and the markers say 'no checkpoint'."""
    spec = wrapper_spec(work)
    os.makedirs(spec.checkpoint_dir, exist_ok=True)
    sidecar = Path(spec.checkpoint_dir, "chainrun-progress.json")
    if kind == "fifo":
        os.mkfifo(sidecar)
    elif kind == "zero":
        sidecar.symlink_to("/dev/zero")
    else:
        sidecar.mkdir()
    proc, job = run_wrapper(work, "touch trained")
    assert proc.returncode == 0, proc.stderr
    assert (work / "trained").exists()
    assert marker(job).progress == Progress()


@pytest.mark.parametrize(
    ("before", "target", "skips"),
    [
        ("exit=0\noriginal=0\nsignal=\nskipped=0\n", None, True),  # finished on its own: done
        ("exit=0\noriginal=0\nsignal=USR1\nskipped=0\n", None, False),  # stopped by the walltime signal
        ("exit=1\noriginal=1\nsignal=\nskipped=0\n", None, False),  # crashed: run again
        ("exit=0\noriginal=0\nsignal=\nskipped=0\n", 30, False),  # with a target, exit 0 is not done
        ("exit=0\noriginal=0\nsignal=\nskipped=0\nckpt_epoch=12\n", 30, False),  # ... below it
        ("exit=0\noriginal=0\nsignal=\nskipped=0\nckpt_epoch=\n", 30, True),  # no epoch to compare: done
        ("exit=0\noriginal=0\nsignal=\nskipped=1\n", 30, True),  # it found the goal reached
    ],
)
def test_a_successor_skips_when_the_segment_before_it_ended_the_run(
    work: Path, before: str, target: Optional[int], skips: bool
) -> None:
    """Without target_epoch, a segment that exited 0 on its own ended the run: the successor
    queued after it starts at once and must not run the command again, even with no sidecar."""
    spec = replace(wrapper_spec(work), target_epoch=target, command="touch trained")
    job = SegmentJob("hostile-1a2b3c", 2, spec, 60)
    os.makedirs(job.run_dir, exist_ok=True)
    Path(job.run_dir, "seg-0001.end").write_text(before)
    write_segment(job)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JOB_ID", "CHAINRUN_"))}
    proc = subprocess.run(["bash", job.script_path], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (work / "trained").exists() is not skips
    assert marker(job).skipped is skips


def test_every_value_arrives_intact_and_none_is_read_by_the_shell(tmp_path: Path) -> None:
    """The settings travel as JSON in a quoted here-document: a value that holds the
    document's end on a line of its own, quotes, `$(...)` or an old template's placeholder
    arrives byte for byte, and nothing in it runs (before placeholders, `workdir =
    "/scratch/w;touch pwned;#"` with `V1 = "x @@WORKDIR@@"` ran touch)."""
    work = tmp_path / "w;touch pwned;#'"
    work.mkdir()
    hostile = [
        "x @@WORKDIR@@ y",
        "\nCHAINRUN_SETTINGS\ntouch pwned\n",
        "$(touch pwned) `touch pwned`",
        "'\"\\",
    ]
    env = (*((f"V{i}", value) for i, value in enumerate(hostile)), ("ALL", " ".join(hostile)))
    spec = replace(
        wrapper_spec(work),
        env=env,
        command="env -0 > env.bin; printf '%s' " + " ".join(f'"${key}"' for key, _ in env) + " > seen",
        checkpoint_dir=str(work / "ckpt\nCHAINRUN_SETTINGS\n$(touch pwned)"),
    )
    job = SegmentJob("hostile-1a2b3c", 1, spec, 60)
    write_segment(job)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JOB_ID", "CHAINRUN_"))}
    proc = subprocess.run(["bash", job.script_path], env=clean, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert not list(tmp_path.rglob("pwned")) and not Path("pwned").exists()
    assert (work / "seen").read_text() == "".join(value for _, value in env)
    seen_env = dict(e.split("=", 1) for e in (work / "env.bin").read_text().split("\0") if "=" in e)
    assert seen_env["CHAINRUN_CHECKPOINT_DIR"] == spec.checkpoint_dir


def test_a_failed_command_leaves_the_last_lines_of_its_output_in_its_end_marker(work: Path) -> None:
    """The last 5 non-blank lines, each the last state of a line a progress bar redrew with CR;
    a command that succeeds leaves none."""
    lines = "; ".join(f"echo line {i}" for i in range(1, 9))
    command = f"{lines}; printf 'epoch 3:  10%%\\r epoch 3:  90%%\\n\\n'; echo boom >&2; exit 3"
    job = SegmentJob("hostile-1a2b3c", 1, replace(wrapper_spec(work), command=command), 60)
    proc = start_logged(job)
    assert proc.wait(timeout=60) == 3
    assert marker(job).tail == ("line 7", "line 8", "epoch 3:  10%", " epoch 3:  90%", "boom")

    ok = SegmentJob("hostile-1a2b3c", 2, replace(wrapper_spec(work), command="echo fine"), 60)
    assert start_logged(ok).wait(timeout=60) == 0
    assert marker(ok).tail == ()


def ended(pid: int) -> bool:
    """The process is gone, or a zombie its adopter has yet to reap."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(") ", 1)[1].startswith("Z")


@pytest.mark.parametrize(
    "command",
    ["python3 prog.py; echo shell-went-on", "setsid --wait python3 prog.py; echo shell-went-on"],
    ids=["behind-a-shell", "in-its-own-session"],
)
def test_the_walltime_signal_reaches_the_program_and_the_segment_waits_for_it(
    work: Path, command: str
) -> None:
    """`prog; echo after` runs under a shell, which SIGUSR1 kills; a launcher (torchrun) starts
    its workers in sessions of their own and dies of SIGUSR1 too. The signal goes to the
    command's process group and to all it started, so the program gets it as well, and the end
    marker is written only once the program has finished its save, after the shell is gone."""
    (work / "prog.py").write_text(
        "import os, pathlib, signal, time\n"
        "def stop(*_):\n"
        "    time.sleep(2)  # a save that outlives the shell\n"
        "    pathlib.Path('saved').write_text(str(os.getpid()))\n"
        "    raise SystemExit(0)\n"
        "signal.signal(signal.SIGUSR1, stop)\n"
        "pathlib.Path('started').write_text('')\n"
        "time.sleep(60)\n"
    )
    spec = replace(wrapper_spec(work), command=command, grace=3)
    job = SegmentJob("hostile-1a2b3c", 1, spec, 6)
    proc = start_logged(job)
    wait_for((work / "started").exists, 30, "the command to start")
    proc.send_signal(signal.SIGUSR1)  # early: held, then passed on at walltime - grace
    assert proc.wait(timeout=60) == 128 + signal.SIGUSR1  # the shell's death
    end = marker(job)
    assert end.signal == "USR1" and end.stopped_by_signal
    assert ended(int((work / "saved").read_text()))
    log = Path(job.log_path).read_text()
    assert "shell-went-on" not in log and "waiting for the rest of the command" in log


def test_what_a_command_that_ended_on_its_own_left_running_ends_before_the_segment(work: Path) -> None:
    """A background process the command started and left is ended (SIGTERM) before the end
    marker, as a scheduler would at the job's end: nothing of a segment outlives it."""
    spec = replace(wrapper_spec(work), command="sleep 300 & echo $! > left.pid")
    job = SegmentJob("hostile-1a2b3c", 1, spec, 60)
    assert start_logged(job).wait(timeout=60) == 0
    assert marker(job).original == 0
    assert ended(int((work / "left.pid").read_text()))


def test_with_progress_file_key_the_markers_and_the_skip_read_the_scripts_own_json(work: Path) -> None:
    """progress = "FILE:KEY": the epoch in both markers comes from the script's own file (saved
    at its mtime), and a successor that finds it at the target skips."""
    state = work / "state.json"
    state.write_text('{"meta": {"epoch": 4}}')
    spec = replace(
        wrapper_spec(work),
        progress_file=str(state),
        progress_key="meta.epoch",
        target_epoch=9,
        command="""python3 -c 'import json; json.dump({"meta": {"epoch": 9}}, open("state.json", "w"))'""",
    )
    job = SegmentJob("hostile-1a2b3c", 1, spec, 60)
    assert start_logged(job).wait(timeout=60) == 0
    start = parse_start_marker(Path(job.stem + ".start").read_bytes())
    assert start.progress is not None and start.progress.epoch == 4
    assert marker(job).progress == Progress(epoch=9, saved_at=state.stat().st_mtime)

    nxt = SegmentJob("hostile-1a2b3c", 2, replace(spec, command="touch trained"), 60)
    assert start_logged(nxt).wait(timeout=60) == 0
    assert marker(nxt).skipped and not (work / "trained").exists()
    assert "epoch 9 already reached target_epoch 9" in Path(nxt.log_path).read_text()


def test_processes_ending_while_the_wrapper_looks_for_leftovers_leave_no_trace_in_the_output(
    work: Path,
) -> None:
    """The wrapper reads /proc for the command's leftovers while other processes come and go:
    one that ends under its eyes is skipped quietly, never an error line in the segment's log
    (which would also push the command's own last lines out of its failure tail)."""
    churn = subprocess.Popen(["bash", "-c", "while :; do /bin/true & /bin/true & wait; done"])
    try:
        for n in range(1, 6):
            spec = replace(wrapper_spec(work), command="echo last words; exit 3")
            job = SegmentJob("hostile-1a2b3c", n, spec, 60)
            assert start_logged(job).wait(timeout=60) == 3
            log = Path(job.log_path).read_text()
            assert "No such file" not in log, log
            assert marker(job).tail == ("last words",)
    finally:
        churn.kill()
        churn.wait()


LEFTOVER = """\
import pathlib, signal, subprocess, sys, time
signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a saver that outlives the command
victim = subprocess.Popen(["sleep", "300"], preexec_fn=lambda: signal.signal(signal.SIGUSR1, signal.SIG_DFL))
pathlib.Path("victim.pid").write_text(str(victim.pid))
victim.wait()  # it dies of the walltime signal and is reaped here: its PID is free again
pathlib.Path("victim.reaped").write_text("")
time.sleep(float(sys.argv[1]))
"""


def take_pid(pid: int) -> subprocess.Popen[bytes]:
    """A new process, not the segment's, with ``pid``: the kernel's next PID is set (root)
    and a process started, again until no other process on the machine took it first."""
    for _ in range(200):
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        proc = subprocess.Popen(["sleep", "120"])
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    raise AssertionError(f"PID {pid} could not be taken in 200 tries")


def test_a_pid_the_kernel_gave_again_is_not_taken_for_the_commands(work: Path) -> None:
    """A process the walltime signal reached ends, and the kernel gives its PID to someone
    else's new process (pid_max is 32768 on many nodes) while the wrapper waits for the
    command's saver: the wrapper ends when the saver does, not when the stranger does, and
    never signals it."""
    need("root (to choose the next PID)", os.geteuid() == 0, "sudo")
    (work / "leftover.py").write_text(LEFTOVER)
    command = (
        "python3 leftover.py 10 & trap 'exit 0' USR1; while [ ! -e victim.pid ]; do sleep 0.1; done; "
        "touch started; while :; do sleep 0.1; done"
    )
    spec = replace(wrapper_spec(work), command=command, grace=59)  # the signal is due at once
    job = SegmentJob("hostile-1a2b3c", 1, spec, 60)
    proc = start_logged(job)
    stranger = None
    try:
        wait_for((work / "started").exists, 60, "the command to start")
        proc.send_signal(signal.SIGUSR1)
        wait_for((work / "victim.reaped").exists, 60, "the signalled process to end")
        stranger = take_pid(int((work / "victim.pid").read_text()))
        assert proc.wait(timeout=90) == 0, Path(job.log_path).read_text()  # the stranger sleeps 120 s
        assert stranger.poll() is None  # never signalled
        assert "waiting for the rest of the command" in Path(job.log_path).read_text()
    finally:
        proc.kill()
        if stranger is not None:
            stranger.kill()
            stranger.wait()


@pytest.mark.parametrize(
    ("adaptive", "written", "grace"),
    [(True, "grace=4\n", 4), (True, "grace=50\n", 12), (False, "grace=4\n", 12), (True, "grace=x\n", 12)],
)
def test_the_wrappers_own_timer_signals_at_the_grace_the_service_made_at_most_the_default(
    work: Path, adaptive: bool, written: str, grace: int
) -> None:
    """With no grace in the job file the wrapper reads the one the service made of the
    chain's stops (`grace` in the run directory), at most the default (12 s here); a job
    file's own grace, or a file it cannot read, leaves the default. No scheduler sends
    anything here: the wrapper's own timer signals, so Slurm's coarse --signal sets no floor."""
    spec = replace(
        wrapper_spec(work),
        grace=12,
        adaptive_grace=adaptive,
        command="echo $CHAINRUN_DEADLINE $CHAINRUN_GRACE > seen; trap 'date +%s > got; exit 0' USR1; "
        "while :; do sleep 0.1; done",
    )
    job = SegmentJob("hostile-1a2b3c", 2, spec, 16)
    os.makedirs(job.run_dir)
    Path(job.run_dir, "grace").write_text(written)
    proc = start_logged(job)
    assert proc.wait(timeout=60) == 0, Path(job.log_path).read_text()
    deadline, told = map(int, (work / "seen").read_text().split())
    assert told == grace
    assert deadline - grace - 1 <= int((work / "got").read_text()) <= deadline - grace + 2
    end = marker(job)
    assert end.grace == grace and end.signal == "USR1" and end.outcome().value == "timeout"
    assert end.stop_seconds is not None and end.stop_seconds < grace


def test_a_grace_the_service_learns_while_the_segment_runs_is_taken_before_its_signal(work: Path) -> None:
    """A successor queued ahead starts as the segment before it ends, before the service has
    written the grace it learned from that segment's stop (up to a tick later): the runner
    takes the grace written while its command runs, until the signal is due, as a segment
    started a tick later would have. The command's CHAINRUN_GRACE stays what it was told."""
    spec = replace(
        wrapper_spec(work),
        grace=12,
        adaptive_grace=True,
        command="echo $CHAINRUN_DEADLINE $CHAINRUN_GRACE > seen; trap 'date +%s > got; exit 0' USR1; "
        "while :; do sleep 0.1; done",
    )
    job = SegmentJob("hostile-1a2b3c", 2, spec, 24)
    proc = start_logged(job)
    wait_for(lambda: (work / "seen").exists(), 30, "the command to start")
    Path(job.run_dir, "grace").write_text("grace=4\n")  # the service's tick after segment 1 ended
    assert proc.wait(timeout=60) == 0, Path(job.log_path).read_text()
    deadline, told = map(int, (work / "seen").read_text().split())
    assert told == 12
    assert deadline - 4 - 1 <= int((work / "got").read_text()) <= deadline - 4 + 2
    assert marker(job).grace == 4
    assert "grace 4s from now on (was 12s)" in Path(job.log_path).read_text()


TRAINER_THAT_IMPORTS_LATE = """\
import os, sys, time
time.sleep(float(sys.argv[1]))  # importing torch on a loaded node, say
from chainrun.checkpoint import SegmentClock
clock = SegmentClock(margin=0)  # the signal alone stops it here, not its deadline
while not clock.should_stop():
    time.sleep(0.05)
with open("stopped", "w") as f:
    f.write(clock.reason or "")
"""


def test_a_walltime_signal_due_while_the_command_still_starts_is_held_until_it_is_ready(work: Path) -> None:
    """Issue 24: a segment whose command had not yet set its handler died of SIGUSR1 (exit 138)
    and was charged "no progress". The chain's command said it was ready in segment 1 (its
    SegmentClock wrote `ready`); in segment 2 it sleeps before it imports the helper while the
    signal is due (2 s in), and the scheduler's own signal comes during that sleep too: both
    are held until the clock says it is ready, and the command stops on the signal, cleanly."""
    (work / "train.py").write_text(TRAINER_THAT_IMPORTS_LATE)
    command = f"echo $CHAINRUN_DEADLINE > deadline; exec {sys.executable} train.py 6"
    spec = replace(wrapper_spec(work), grace=12, command=command)
    job = SegmentJob("hostile-1a2b3c", 2, spec, 14)
    os.makedirs(job.run_dir)
    Path(job.run_dir, "ready").write_text("1\n")
    proc = start_logged(job, PYTHONPATH=str(REPO))
    wait_for(lambda: (work / "deadline").exists(), 30, "the command to start")
    due = int((work / "deadline").read_text()) - 12
    wait_for(lambda: time.time() >= due + 1, 30, "the signal's time to pass")  # the command sleeps on
    proc.send_signal(signal.SIGUSR1)  # as Slurm's --signal would
    assert proc.wait(timeout=60) == 0, Path(job.log_path).read_text()
    assert (work / "stopped").read_text() == "signal SIGUSR1"
    end = marker(job)
    assert (end.original, end.signal, end.ready) == (0, "USR1", "1")
    assert "held: the command has not yet said it is ready" in Path(job.log_path).read_text()


RANKS_ONE_STILL_IMPORTING = """\
import subprocess, sys, time
rank = int(sys.argv[1])
if rank:
    time.sleep(float(sys.argv[2]))  # this rank still imports torch when the signal is due
from chainrun.checkpoint import SegmentClock
clock = SegmentClock(margin=0)
# As Lightning's DDP launcher does: rank 0 starts rank 1 once it has made its own clock.
other = None if rank else subprocess.Popen([sys.executable, __file__, "1", sys.argv[2]])
while not clock.should_stop():
    time.sleep(0.05)
with open(f"stopped-{rank}", "w") as f:
    f.write(clock.reason or "")
sys.exit(other.wait() if other else 0)
"""


def test_the_signal_is_held_until_every_process_that_took_it_before_is_ready(work: Path) -> None:
    """The CI failure of the Lightning DDP chain: rank 0 said it was ready (`ready`), rank 1,
    still importing, died of SIGUSR1 (exit -10), Lightning killed rank 0 for it (exit 137),
    and the segment was charged a failure. Each process that sets its handlers says so; two
    did in segment 1, so in segment 2 the signal (due 2 s in) is held until both have, and
    both stop on it, cleanly."""
    (work / "train.py").write_text(RANKS_ONE_STILL_IMPORTING)
    spec = replace(wrapper_spec(work), grace=12, command=f"exec {sys.executable} train.py 0 6")
    job = SegmentJob("hostile-1a2b3c", 2, spec, 14)
    os.makedirs(job.run_dir)
    Path(job.run_dir, "ready").write_text("1 node1 4242\n1 node1 4243\n")
    proc = start_logged(job, PYTHONPATH=str(REPO))
    assert proc.wait(timeout=60) == 0, Path(job.log_path).read_text()
    assert [(work / f"stopped-{rank}").read_text() for rank in (0, 1)] == ["signal SIGUSR1"] * 2
    assert "held: the command has not yet said it is ready" in Path(job.log_path).read_text()
    end = marker(job)
    assert (end.original, end.signal, end.ready) == (0, "USR1", "1")
    # Ready once rank 1 was (6 s in), and the held signal passed on then.
    assert end.ready_at is not None and end.signalled_at is not None, end
    assert int(end.ready_at) <= end.signalled_at <= end.ready_at + 2, end
    said = [line.split() for line in Path(job.run_dir, "ready").read_text().splitlines()]
    assert sorted(n for n, _, _ in said) == ["1", "1", "2", "2"], said  # each rank once


def test_the_end_marker_never_puts_readiness_after_the_signal_it_came_before(
    work: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The load run at 1ce5373 failed the test above: ready at x.96 s, the signal passed on at
    once, and the marker said ready_at x+1.0 (rounded to tenths), signalled_at x (whole
    seconds, cut down): readiness after the signal it was held for, and a start-up longer
    than the time before the signal. Every time the marker records is cut down, never
    rounded up."""
    from chainrun.node import runner

    job = SegmentJob("hostile-1a2b3c", 2, wrapper_spec(work), 60)
    os.makedirs(job.run_dir)
    write_segment(job)
    monkeypatch.chdir(work)
    monkeypatch.setattr(os, "environ", wrapper_env())
    seg = runner.Segment(conftest.settings_of(Path(job.script_path).read_text()), [], 0)
    seg.ready_at, seg.sent, seg.got = 1796017082.96, 1796017082, "USR1"
    seg.end_marker(0, 0, skipped=False)
    end = marker(job)
    assert end.ready_at is not None and end.signalled_at is not None, end
    assert int(end.ready_at) <= end.signalled_at, end
    assert end.ready_at == pytest.approx(1796017082.9), end


def test_a_command_that_said_it_was_ready_before_and_never_does_again_is_not_signalled(work: Path) -> None:
    """Held to its end: no signal reaches a command that never says it is ready (the walltime's
    kill ends it, as the signal would have); its end marker says so, and the next segment
    gets the signal at its time again (`ready` is gone). A command that never said it was
    ready (no `ready` file) gets it at its time, as every other test here shows."""
    spec = replace(wrapper_spec(work), grace=8, command="sleep 4")
    job = SegmentJob("hostile-1a2b3c", 2, spec, 10)  # the signal is due 2 s in
    os.makedirs(job.run_dir)
    Path(job.run_dir, "ready").write_text("1\n")
    proc = start_logged(job)
    assert proc.wait(timeout=60) == 0, Path(job.log_path).read_text()
    end = marker(job)
    assert (end.original, end.signal, end.ready, end.signalled_at, end.ready_at) == (0, "", "0", None, None)
    assert not Path(job.run_dir, "ready").exists()


def test_a_walltime_signal_while_the_runner_exits_cannot_kill_it(work: Path) -> None:
    """Python's exit puts back the default action (death) of every signal a Python handler
    caught, a moment before the process ends. A command that exited 0 on its own just before
    walltime - grace left the runner exiting when the signal came: the job died of SIGUSR1 and
    the scheduler said `failed`, charging a segment that had finished (seen under load). When
    the runner returns, the walltime signals are ignored, which Python's exit leaves alone."""
    spec = replace(wrapper_spec(work), command="true")
    job = SegmentJob("hostile-1a2b3c", 1, spec, 60)
    os.makedirs(job.run_dir, exist_ok=True)
    write_segment(job)
    script = Path(job.script_path).read_text()
    settings = script.split("<<'CHAINRUN_SETTINGS'\n", 1)[1].rsplit("CHAINRUN_SETTINGS", 1)[0]
    after = subprocess.run(
        [
            sys.executable,
            "-c",
            "import signal\n"
            "from chainrun.node import runner\n"
            "runner.main()\n"
            "print(*(signal.getsignal(getattr(signal, 'SIG' + n)) == signal.SIG_IGN for n in ('USR1', 'USR2', 'ALRM')))\n",
        ],
        input=settings,
        env={**wrapper_env(), "PYTHONPATH": str(REPO)},
        cwd=work,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert after.returncode == 0, after.stderr
    assert after.stdout.split()[-3:] == ["True", "True", "True"], after.stdout


@pytest.mark.parametrize("deaf", [False, True])
def test_a_cancel_has_the_running_command_save_on_its_signal_and_kills_it_after_its_grace(
    work: Path, deaf: bool
) -> None:
    """The chain's final marker appears while the command runs (a cancel): the runner passes
    the walltime signal on at once, long before walltime - grace, and the command saves and
    exits; one deaf to it is killed once its grace (3 s) is over. The end marker says which."""
    (work / "prog.py").write_text(
        "import pathlib, signal, sys, time\n"
        "def stop(*_):\n"
        "    pathlib.Path('saved').write_text('')\n"
        "    sys.exit(0)\n"
        f"signal.signal(signal.SIGUSR1, {'signal.SIG_IGN' if deaf else 'stop'})\n"
        "pathlib.Path('started').write_text('')\n"
        "time.sleep(300)\n"
    )
    spec = replace(wrapper_spec(work), command="exec python3 prog.py", grace=3)
    job = SegmentJob("hostile-1a2b3c", 1, spec, 600)
    proc = start_logged(job)
    wait_for((work / "started").exists, 30, "the command to start")
    Path(job.run_dir, "final").write_text("chain ended\n")
    proc.wait(timeout=60)
    end = marker(job)
    assert end.signal == ("KILL" if deaf else "USR1") and end.signalled_at is not None, end
    assert (work / "saved").exists() is not deaf
    assert end.original == (128 + signal.SIGKILL if deaf else 0), end
    assert "the chain was cancelled" in Path(job.log_path).read_text()
