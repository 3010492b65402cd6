"""`chainrun run`'s view: plain lines off a terminal, the Ctrl-C prompt through a real pty,
and the last lines of a failed chain's output under its final line."""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import cli_env, wait_for
from test_engine import SPEC, World

from chainrun.model import Chain, ChainState, Outcome, Phase, Progress, Segment
from chainrun.run import (
    OUTPUT_BYTES,
    PROMPT,
    Follower,
    View,
    final_lines,
    last_lines,
    plain_line,
    read_tail,
)
from chainrun.schedulers import scheduler_for
from chainrun.schedulers.segment import SegmentJob
from chainrun.sweeprun import sweep_frame
from chainrun.transport import LocalTransport

CLI = Callable[..., "subprocess.CompletedProcess[str]"]
CLOCK = r"\d\d:\d\d:\d\d  "
# Waits for a file `go` in its workdir, then exits 0: the test decides when the chain completes.
SYS_TGKILL = {"x86_64": 234, "aarch64": 131}[os.uname().machine]  # a signal to one thread of a process
WAIT_FOR_GO = "while [ ! -e go ]; do sleep 0.1; done; echo finished"


@pytest.fixture
def utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Local time is UTC, so the clock of each line is known."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


# -- what is shown, from values -------------------------------------------------------


def chain_with(*segments: Segment, **fields: Any) -> Chain:
    return Chain(
        id="t-1a2b3c", spec=SPEC, state=ChainState.ACTIVE, created_at=0.0, segments=segments, **fields
    )


def test_plain_line_shows_epoch_eta_segment_job_and_output() -> None:
    """Epochs of the target, the ETA from the rate so far, the segment and its job, the output."""
    running = Segment("t-1a2b3c", 2, 100, Phase.RUNNING, job_id="17", started_at=1000.0)
    chain = chain_with(running, used=100.0, latest=Progress(epoch=4))
    # 4 epochs in 100 s + 50 s: 6 left at 4 per 150 s take 225 s.
    assert plain_line(chain, "epoch 4 loss 0.5", 1050.0) == (
        "epoch 4/10 40%, ETA 3m45s; segment 2 of 10 running as job 17; output: epoch 4 loss 0.5"
    )


def test_plain_line_without_a_target_shows_the_budget_used_and_the_queue_reason() -> None:
    """No target: the bar is the budget used of total_time, rounded, never cut (issue 36,
    finding 4: ``time 4m/16m``); a queued job shows why it waits."""
    spec = replace(SPEC, target_epoch=None)
    queued = Segment("t-1a2b3c", 3, 100, Phase.PENDING, job_id="18", reason="Dependency")
    chain = replace(chain_with(queued, used=250.0), spec=spec)
    assert (
        plain_line(chain, "", 5000.0)
        == "budget used 4m10s/17m 25%; segment 3 of 10 queued as job 18 (Dependency)"
    )


def test_output_lines_are_what_a_terminal_shows() -> None:
    """A redrawn progress bar keeps its last state; colours, control characters and blank lines go."""
    text = "epoch 1\n\n step 1/9\r step 9/9\x1b[32m ok\x1b[0m\x07\nlast\x1b]0;title\x07 one\n"
    assert last_lines(text, 5) == ["epoch 1", " step 9/9 ok", "last one"]
    assert last_lines(text, 1) == ["last one"]


def test_final_lines_of_a_failed_chain_show_its_output_and_the_logs_command() -> None:
    """The failing segment's last 5 lines, indented, then the command that shows all of it."""
    failed = Segment(
        "t-1a2b3c",
        1,
        100,
        Phase.ENDED,
        outcome=Outcome.FAILED,
        exit_code=3,
        charged=True,
        tail=(*(f"line{i}" for i in range(1, 8)), "\x1b[31mTraceback\x1b[0m"),
    )
    chain = replace(chain_with(failed), state=ChainState.FAILED, reason="failure budget spent")
    assert final_lines(chain) == [
        "chain t-1a2b3c failed: failure budget spent",
        *(f"    line{i}" for i in range(4, 8)),
        "    Traceback",
        "see all of it: chainrun logs t-1a2b3c -n 1",
    ]
    done = replace(chain_with(), state=ChainState.COMPLETED, reason="target epoch 10 reached")
    assert final_lines(done) == ["chain t-1a2b3c completed: target epoch 10 reached"]


# -- the plain view of a whole chain, on the scripted cluster -------------------------


def test_plain_view_prints_each_event_and_a_line_per_change_of_progress(
    tmp_path: Path, utc: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """Off a terminal: event lines, and a progress line only when epoch, segment, job state or
    output changed; time passing alone prints nothing."""
    world = World(tmp_path / "home")
    chain_id = world.add()
    follower = Follower(world.store, chain_id, world.cluster.transport)
    view = View(tty=False)
    log = SegmentJob(chain_id, 1, SPEC, 0).log_path

    def tick(seconds: float = 10.0) -> None:
        world.tick(seconds)
        lines, chain, output = follower.poll()
        for line in lines:
            view.event(line)
        view.show(chain, output, world.clock())

    tick()  # segment 1 submitted
    tick()  # and its successor queued behind it
    world.cluster.start("1", epoch=0)
    world.cluster.files[log] = b"loading\n"
    tick()
    tick()  # nothing new: no line
    world.cluster.checkpoint("/w/ckpt", epoch=2)
    world.cluster.files[log] += b"epoch 1\nepoch 2 \x1b[1mloss\x1b[0m 0.5\n"
    tick()
    tick()  # time alone: no line
    world.cluster.end("1", "failed", exit_code=3, epoch=2)
    tick()
    world.store.close()
    shown = [line for line in capsys.readouterr().out.splitlines() if re.match(CLOCK, line)]  # not logs
    assert [line.replace(chain_id, "CHAIN") for line in shown] == [
        "13:46:40  chain submitted from ",
        "13:46:50  segment 1 submitted as job 1",
        "13:46:50  epoch -/10 0%; segment 1 of 10 queued as job 1",
        "13:47:00  segment 2 submitted after job 1 as job 2",
        "13:47:00  epoch -/10 0%; segment 1 of 10 queued as job 1 (Priority)",
        "13:47:00  segment 1 is running",  # when it started, found out at the next tick
        "13:47:10  epoch -/10 0%; segment 1 of 10 running as job 1; output: loading",
        # 2 epochs in the 30 s since the job started: 8 more take 2 minutes.
        "13:47:30  epoch 2/10 20%, ETA 2m; segment 1 of 10 running as job 1; output: epoch 2 loss 0.5",
        "13:47:40  segment 1 ended: failed (exit 3): the command exited 3 on its own; costs one failure;"
        " progress: epoch 2",
        "13:47:50  segment 3 submitted after job 2 as job 3",
        # Segment 1 ran 40 s in all: 8 more epochs at that rate take 2m40s.
        "13:47:50  epoch 2/10 20%, ETA 2m40s; segment 2 of 10 queued as job 2 (Dependency);"
        " output: epoch 2 loss 0.5",
    ]


# -- real processes: the local runner, a pipe, a pty -----------------------------------


def write_job(tmp_path: Path, command: str, extra: str = "") -> Path:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    path = work / "job.toml"
    path.write_text(
        f"name = \"t\"\ncommand = '{command}'\n"
        f'total_time = "5m"\nwalltime = "1m"\ngrace = "5s"\nmax_failures = 0\n{extra}'
    )
    return path


class Reader:
    """Everything a process writes to one descriptor, read in a thread as it comes."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.data = b""
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:  # a pty whose other side closed: EIO
                return
            if not chunk:
                return
            self.data += chunk

    @property
    def text(self) -> str:
        return self.data.decode(errors="replace")

    def wait_for(self, what: str, timeout: float = 120) -> None:
        wait_for(lambda: what in self.text, timeout, f"{what!r} in:\n{self.text[-3000:]}")

    def close(self) -> None:
        self._thread.join(timeout=30)
        os.close(self.fd)


def run_piped(job: Path, interval: str, home: Path) -> tuple[subprocess.Popen[bytes], Reader]:
    """`chainrun run JOB` with no terminal, its output read as it comes."""
    read, write = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-m", "chainrun", "run", str(job), "--interval", interval],
        stdin=subprocess.DEVNULL,
        stdout=write,
        stderr=write,
        cwd=job.parent,
        env=cli_env(home),
    )
    os.close(write)
    return proc, Reader(read)


def chain_id_in(text: str) -> str:
    match = re.search(r"chain (\S+) submitted", text)
    assert match, text
    return match.group(1)


def state(chainrun: CLI, chain_id: str) -> dict[str, Any]:
    return json.loads(chainrun("status", chain_id, "--json", check=True).stdout)[0]  # type: ignore[no-any-return]


def live_jobs(chain_id: str) -> list[str]:
    """The chain's jobs the local runner still has queued or running."""
    scheduler = scheduler_for("local", None)
    jobs = scheduler.parse_poll(LocalTransport().run(scheduler.poll_argv(), timeout=60))
    return [j.job_id for j in jobs.values() if j.name.startswith(f"cr.{chain_id}.") and j.phase.live]


def _controlling_tty() -> None:
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Terminal:
    """`chainrun run JOBFILE` on a pseudo-terminal of its own, as a person runs it."""

    def __init__(self, home: Path, job: Path) -> None:
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        env = dict(cli_env(home), TERM="xterm")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "chainrun", "run", str(job), "--interval", "0.5"],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            cwd=job.parent,
            env=env,
            start_new_session=True,  # a session of its own, whose terminal this pty is:
            preexec_fn=_controlling_tty,  # Ctrl-C typed there reaches it as SIGINT
        )
        os.close(slave)
        self.out = Reader(master)

    def type(self, keys: str) -> None:
        os.write(self.out.fd, keys.encode())

    def exit_code(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout:.0f}s:\n{self.out.text[-3000:]}") from None
        finally:
            self.out.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def terminal(home: Path, chainrun: CLI) -> Iterator[Callable[[Path], Terminal]]:
    """Start `chainrun run` on a pty; at the end it is killed, and its chains cancelled."""
    started: list[Terminal] = []

    def start(job: Path) -> Terminal:
        started.append(Terminal(home, job))
        return started[-1]

    yield start
    for term in started:
        term.kill()
    cancel_active(chainrun)


def cancel_active(chainrun: CLI) -> None:
    """Leave no job waiting for a `go` that never comes, whatever the test did."""
    for chain in json.loads(chainrun("status", "--json", check=True).stdout):
        if chain["state"] == "active":
            chainrun("cancel", chain["id"], check=True)


def interrupt_when_running(term: Terminal) -> str:
    """Wait for the first segment to run, type Ctrl-C, wait for the question; the chain's id."""
    term.out.wait_for("segment 1 is running")
    term.type("\x03")
    term.out.wait_for(PROMPT)
    return chain_id_in(term.out.text)


@pytest.mark.parametrize("elsewhere", [False, True], ids=["run-is-the-service", "a-service-runs"])
def test_ctrl_c_then_c_cancels_the_chain_and_leaves_no_job(
    tmp_path: Path,
    terminal: Callable[[Path], Terminal],
    chainrun: CLI,
    service: Callable[..., subprocess.Popen[bytes]],
    home: Path,
    elsewhere: bool,
) -> None:
    """Answering `c` cancels the chain as `chainrun cancel` does: cancelled, no job left, exit 1;
    carried out by `run` itself, or by the service that runs elsewhere while `run` follows."""
    if elsewhere:
        service()
        wait_for(lambda: (home / "service.status").exists(), 120, "the service's first tick")
    term = terminal(write_job(tmp_path, WAIT_FOR_GO))
    chain_id = interrupt_when_running(term)
    assert ("a chainrun service is running; following the chain" in term.out.text) is elsewhere
    term.type("c\r")
    assert term.exit_code() == 1, term.out.text
    assert f"chain {chain_id} cancelled: cancelled by user" in term.out.text
    assert state(chainrun, chain_id)["state"] == "cancelled"
    # The runner's supervisor ends the cancelled job (TERM, then KILL after KILL_WAIT).
    wait_for(lambda: live_jobs(chain_id) == [], 60, "the cancelled job to end")


def test_ctrl_c_then_enter_stops_watching_and_the_chain_goes_on(
    tmp_path: Path,
    terminal: Callable[[Path], Terminal],
    chainrun: CLI,
    service: Callable[..., subprocess.Popen[bytes]],
) -> None:
    """Enter (as `w`) stops watching: exit 130, how to look again, and a service later completes it."""
    job = write_job(tmp_path, WAIT_FOR_GO)
    term = terminal(job)
    chain_id = interrupt_when_running(term)
    term.type("\r")
    assert term.exit_code() == 130, term.out.text
    assert f"chain {chain_id} goes on; see it with: chainrun status {chain_id}" in term.out.text
    assert "advances only while a service runs" in term.out.text and "chainrun daemon" in term.out.text
    assert state(chainrun, chain_id)["state"] == "active"
    (job.parent / "go").touch()
    service()
    wait_for(lambda: state(chainrun, chain_id)["state"] == "completed", 120, "the service to complete it")


def test_a_second_ctrl_c_at_the_question_stops_watching(
    tmp_path: Path, terminal: Callable[[Path], Terminal], chainrun: CLI
) -> None:
    """Ctrl-C twice: stop watching, never cancel."""
    term = terminal(write_job(tmp_path, WAIT_FOR_GO))
    chain_id = interrupt_when_running(term)
    term.type("\x03")
    try:
        assert term.exit_code() == 130, term.out.text
        assert "goes on; see it with: chainrun status" in term.out.text
        assert state(chainrun, chain_id)["state"] == "active" and live_jobs(chain_id)
    finally:
        cancel_active(chainrun)


def thread_started_last(pid: int) -> int:
    """The thread of process ``pid``, not its main one, started last: one that lives on while
    the question waits (the service's ticks', APScheduler's, the markers' watcher's).

    Not the first one started: that is rich's refresh thread, which the question stops, and
    which may still be ending as the question shows (under load, for a while). A signal to
    it then finds no such process, or is lost with it, and the question waits for nothing."""
    threads = []
    for name in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{name}/stat").read_text()
        except FileNotFoundError:  # it ended as we looked
            continue
        # After the name in parentheses: state is field 3, starttime (clock ticks) field 22.
        started = int(stat.rsplit(")", 1)[1].split()[19])
        if int(name) != pid:
            threads.append((started, int(name)))
    assert threads, f"process {pid} has no thread besides its main one"
    return max(threads)[1]


def test_a_ctrl_c_the_kernel_hands_to_another_thread_still_ends_the_question(
    tmp_path: Path, terminal: Callable[[Path], Terminal]
) -> None:
    """The second Ctrl-C may reach a thread other than the one waiting for the answer (a
    tick's, rich's): it stops watching all the same, never leaving the question hanging."""
    term = terminal(write_job(tmp_path, WAIT_FOR_GO))
    interrupt_when_running(term)
    pid = term.proc.pid
    tid = thread_started_last(pid)
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(SYS_TGKILL, pid, tid, signal.SIGINT) == 0, os.strerror(ctypes.get_errno())
    assert term.exit_code() == 130, term.out.text
    assert "goes on; see it with: chainrun status" in term.out.text


def test_ctrl_c_without_a_terminal_stops_watching_without_asking(
    tmp_path: Path, home: Path, chainrun: CLI
) -> None:
    """No terminal on stdin: SIGINT stops watching at once; nothing is asked, the chain goes on."""
    job = write_job(tmp_path, WAIT_FOR_GO)
    proc, out = run_piped(job, "0.5", home)
    try:
        out.wait_for("segment 1 is running")
        chain_id = chain_id_in(out.text)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 130, out.text
        out.close()
        assert PROMPT.strip() not in out.text
        assert f"chain {chain_id} goes on; see it with: chainrun status {chain_id}" in out.text
        assert state(chainrun, chain_id)["state"] == "active"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        cancel_active(chainrun)


def test_run_off_a_terminal_prints_plain_lines_and_the_failure_tail(tmp_path: Path, chainrun: CLI) -> None:
    """Piped: only event and progress lines (no escape sequence, no repeated line); a failed
    chain ends with its last 5 lines of output and the `chainrun logs` command."""
    lines = "; ".join(f"echo line{i}" for i in range(1, 8))
    job = write_job(tmp_path, f"sleep 1; {lines}; exit 3")
    result = chainrun("run", str(job), "--interval", "0.3", timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout.splitlines()
    chain_id = chain_id_in(result.stdout)
    assert "\x1b" not in result.stdout
    assert out[0] == f"chain {chain_id} submitted"
    body = out[1 : out.index(next(line for line in out if line.startswith(f"chain {chain_id} failed: ")))]
    assert body and all(re.match(CLOCK, line) for line in body), out
    progress = [line[len("00:00:00  ") :] for line in body if "; segment " in line]
    assert progress and all(
        re.fullmatch(r"budget used \S+/5m \d+%; segment 1 of 5 .+", p) for p in progress
    ), progress
    assert all(a != b for a, b in zip(progress, progress[1:])), progress
    assert out[-7:] == [
        out[-7],
        *(f"    line{i}" for i in range(3, 8)),
        f"see all of it: chainrun logs {chain_id} -n 1",
    ]
    assert out[-7].startswith(f"chain {chain_id} failed: ")


def test_the_log_is_read_again_only_when_it_changed(tmp_path: Path) -> None:
    """The output line comes from the running segment's log, read only when its size or
    mtime changed: a log rewritten behind the same size and mtime is not read again."""
    world = World(tmp_path / "home")
    chain_id = world.add()
    follower = Follower(world.store, chain_id, world.cluster.transport)
    log = SegmentJob(chain_id, 1, SPEC, 0).log_path
    world.tick()
    world.cluster.start("1", epoch=0)
    world.cluster.files[log] = b"epoch 1\n"
    world.tick()
    assert follower.poll()[2] == "epoch 1"
    world.cluster.files[log] = b"epoch 2\n"  # same size, and the fake's mtime is its clock
    assert follower.poll()[2] == "epoch 1"
    world.clock.advance(1)
    assert follower.poll()[2] == "epoch 2"
    world.store.close()


def test_the_end_of_a_large_log_is_read_alone(tmp_path: Path) -> None:
    """Of a log larger than OUTPUT_BYTES only the end is read, starting at a whole line."""
    path = tmp_path / "seg.log"
    path.write_text("".join(f"line {i} {'x' * 60}\n" for i in range(5000)))  # about 340 kB
    text = read_tail(LocalTransport(), str(path), path.stat().st_size)
    assert len(text) <= OUTPUT_BYTES and text.startswith("line ")
    assert last_lines(text, 2) == [f"line {i} {'x' * 60}" for i in (4998, 4999)]


# -- a sweep in the foreground ----------------------------------------------------------

EXAMPLE_TRAINER = Path(__file__).resolve().parent.parent / "examples" / "python-api" / "train.py"
SWEEP_PROMPT = "Stop watching (the sweep goes on) or cancel the whole sweep? [w/c] "


def sweep_chain(lr: str, *segments: Segment, **fields: Any) -> Chain:
    spec = replace(SPEC, sweep_name="sw", params=(("lr", lr),), rep=0)
    return replace(chain_with(*segments, **fields), id=f"sw-{lr}", spec=spec)


def test_a_sweep_s_frame_shows_its_share_done_eta_counts_best_and_running_chains() -> None:
    """A chain running at epoch 4 of 10, one waiting, one completed: 46% done; the ETA is the
    running chain's 225 s plus, for the one not started, what the others take on average
    (375 s and 300 s), one at a time; the lowest loss is the best; the running chain's line."""
    running = Segment("sw-0.1", 1, 100, Phase.RUNNING, job_id="17", started_at=1000.0)
    chains = [
        sweep_chain("0.1", running, used=100.0, latest=Progress(epoch=4, metrics=(("loss", 0.5),))),
        sweep_chain("0.2", Segment("sw-0.2", 1, 100, Phase.PENDING, job_id="18", reason="Priority")),
        replace(
            sweep_chain("0.3", used=300.0, latest=Progress(epoch=10, metrics=(("loss", 0.25),))),
            state=ChainState.COMPLETED,
        ),
    ]
    frame = sweep_frame("sw", chains, 1050.0)
    assert (frame.done, frame.total, frame.head) == (1.4, 3, "46% of 3 chains  ETA 9m23s")
    tally = "1 running, 1 queued, 1 completed; best loss 0.25 (lr=0.3 rep 0)"
    assert frame.plain == f"sweep sw: 46% of 3 chains, ETA 9m23s; {tally}"
    assert frame.lines == (
        tally,
        "  lr=0.1 rep 0  epoch 4/10 40%  segment 1 of 10 running as job 17  loss 0.5",
    )
    assert not frame.final and sweep_frame("sw", chains[2:], 1050.0).final


def write_sweep(tmp_path: Path, command: str, values: str, extra: str = "") -> Path:
    """A sweep ``sw`` of ``command`` over ``lr = [values]``, its chains two at a time."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    shutil.copy(EXAMPLE_TRAINER, work / "train.py")
    path = work / "sweep.toml"
    path.write_text(
        f"name = \"sw\"\ncommand = '{command}'\n"
        f'total_time = "5m"\nwalltime = "1m"\ngrace = "5s"\nmax_failures = 0\n{extra}'
        f"[sweep]\nmax_concurrent = 2\n[sweep.grid]\nlr = [{values}]\n"
    )
    return path


def sweep_states(chainrun: CLI) -> dict[str, str]:
    return {c["id"]: c["state"] for c in json.loads(chainrun("status", "sw", "--json", check=True).stdout)}


def test_run_of_a_sweep_off_a_terminal_shows_the_sweep_and_ends_with_its_comparison(
    tmp_path: Path, chainrun: CLI
) -> None:
    """`run SWEEP` supervises every chain: each event names its chain; a progress line per
    change gives the sweep's share done of its chains, its chains by state and the best
    loss; it ends with the sweep's comparison and a line for the chain that failed; exit 1."""
    job = write_sweep(
        tmp_path,
        "python3 train.py --lr {lr} --epochs 3 --epoch-time 0.3",
        '0.1, 0.5, "bad"',
        "target_epoch = 3\n",
    )
    result = chainrun("run", str(job), "--interval", "0.3", timeout=300)
    out = result.stdout.splitlines()
    assert result.returncode == 1, result.stdout + result.stderr
    assert out[0] == "sweep sw: 3 chains submitted"
    states = sweep_states(chainrun)
    assert sorted(states.values()) == ["completed", "completed", "failed"], states
    (failed,) = [chain_id for chain_id, st in states.items() if st == "failed"]
    for chain_id in states:
        assert re.search(rf"^{CLOCK}{chain_id}: segment 1 is running$", result.stdout, re.M), chain_id
    progress = [line[len("00:00:00  ") :] for line in out if re.match(rf"{CLOCK}sweep sw: ", line)]
    assert progress and all(re.fullmatch(r"sweep sw: \d+% of 3 chains(, ETA \S+)?; .+", p) for p in progress)
    assert all(a != b for a, b in zip(progress, progress[1:])), progress
    assert any(re.search(r"; \d running", p) for p in progress), progress
    assert any("queued" in p for p in progress), progress  # two at a time: the third waits
    assert any(re.search(r"; best loss [\d.e-]+ \(lr=0\.[15] rep 0\)", p) for p in progress), progress
    assert "sweep sw: [######....] 2/3 completed; 2 completed, 1 failed" in out
    assert "loss, lowest first (mean and spread over repetitions):" in out
    assert out[-1].startswith(f"chain {failed} failed: ")


@pytest.mark.parametrize("elsewhere", [False, True], ids=["run-is-the-service", "a-service-runs"])
def test_ctrl_c_then_c_at_a_sweep_cancels_every_chain_and_leaves_no_job(
    tmp_path: Path,
    terminal: Callable[[Path], Terminal],
    chainrun: CLI,
    service: Callable[..., subprocess.Popen[bytes]],
    home: Path,
    elsewhere: bool,
) -> None:
    """On a terminal the area shows the sweep (its bar, its chains by state, a line per running
    chain); Ctrl-C asks about the whole sweep, and `c` cancels all of its chains, the one still
    waiting for a slot too: no job left, exit 1; carried out by `run`, or by the service that
    runs elsewhere while `run` follows."""
    if elsewhere:
        service()
        wait_for(lambda: (home / "service.status").exists(), 120, "the service's first tick")
    term = terminal(write_sweep(tmp_path, WAIT_FOR_GO, "1, 2, 3"))
    term.out.wait_for("segment 1 is running")
    term.out.wait_for("of 3 chains")
    term.out.wait_for("lr=1 rep 0")  # a running chain's line
    term.type("\x03")
    term.out.wait_for(SWEEP_PROMPT)
    assert ("a chainrun service is running; following the sweep" in term.out.text) is elsewhere
    term.type("c\r")
    assert term.exit_code() == 1, term.out.text
    states = sweep_states(chainrun)
    assert list(states.values()) == ["cancelled"] * 3, states
    assert "sweep sw: [..........] 0/3 completed; 3 cancelled" in term.out.text
    wait_for(lambda: all(live_jobs(c) == [] for c in states), 60, "the cancelled jobs to end")
