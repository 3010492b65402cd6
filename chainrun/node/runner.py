"""The segment runner: what every segment's job runs, on every backend.

The batch script (``schedulers.script``) holds the scheduler's directives and one
``exec python3 -I runner-HASH.pyz`` with the segment's settings as JSON on its stdin. The
runner is shipped beside the chain's run directory as that archive, with the rules it
applies (``decide.segment`` and ``decide.goal``): a node needs a ``python3`` (3.8 or later)
and nothing else, not chainrun. It imports the standard library alone.

It does what the service cannot do from afar: it learns when the walltime began, sets the
command's environment, writes the start marker, skips a segment whose goal was met before
it started, runs the command in a process group of its own, passes the walltime signal on
at ``deadline - grace`` (holding a scheduler's early one, and holding it until as many of
the command's processes as took it last time say they take it again), ends what the command
left running, moves a snapshot chain's outputs home, writes the end marker (how the
command ended, the checkpoint as it was left, the last lines of a failed command's output),
and asks the chain's carrier to queue the successor while the service is away.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pwd
import select
import signal
import socket
import stat
import subprocess
import sys
import time
from typing import Any, Optional

from chainrun.checkpoint import _fence as fence
from chainrun.checkpoint import _ready as readiness
from chainrun.decide import segment as rules
from chainrun.node import proc
from chainrun.node.carrier import Carrier, ignore_walltime_signals
from chainrun.node.granted import granted
from chainrun.node.share import share
from chainrun.node.tracking import continue_runs

# What systemd gave the service is not the job's (--export=ALL and -V pass it on): a job
# answering NOTIFY_SOCKET would speak for the service.
SERVICE_ONLY = (
    "NOTIFY_SOCKET",
    "WATCHDOG_PID",
    "WATCHDOG_USEC",
    "LISTEN_PID",
    "LISTEN_FDS",
    "LISTEN_FDNAMES",
    "JOURNAL_STREAM",
    "INVOCATION_ID",
    "MANAGERPID",
)
CAUGHT = ("USR1", "USR2", "TERM", "ALRM")  # ALRM: caught so that the command is not born ignoring it
SIDECAR = "chainrun-progress.json"
READ_AT_MOST = 1 << 20  # of a sidecar: a FIFO or a link to a device planted there never blocks
WAKE_EVERY = 0.5  # seconds, at most, between two looks at the clock
FENCE_EVERY = 2.0  # seconds between two looks at the checkpoint directory's fence
TAIL_BYTES, TAIL_LINES, TAIL_WIDTH = 8192, 5, 300


def say(text: str, err: bool = False) -> None:
    stream = sys.stderr if err else sys.stdout
    stream.write(f"chainrun: {text}\n")
    stream.flush()


def read_regular(path: str, limit: int) -> Optional[bytes]:
    """At most ``limit`` bytes of a regular file that is no symbolic link; None otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks: list[bytes] = []
        size = 0
        while size < limit:
            chunk = os.read(fd, limit - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def write_atomically(path: str, text: str) -> None:
    """Write ``path`` (this user's alone) whole or not at all: a temporary file, then a rename.
    One that cannot be written (a full or read-only disk) is said in a line; the segment goes on."""
    tmp = path + ".tmp"
    old = os.umask(0o077)
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        say(f"cannot write {path}: {exc.strerror}", err=True)
    finally:
        os.umask(old)


def fields(data: Optional[bytes]) -> Optional[dict[str, str]]:
    """A marker's ``key=value`` lines (the first of each key); None for no marker."""
    if data is None:
        return None
    found: dict[str, str] = {}
    for line in data.decode(errors="replace").split("\n"):
        key, eq, value = line.partition("=")
        if eq and key not in found:
            found[key] = value
    return found


def _json(data: Optional[bytes]) -> Any:
    try:
        return json.loads(data.decode()) if data else None
    except ValueError:
        return None


def _whole(value: Any) -> Optional[int]:
    return value if type(value) is int and value >= 0 else None


def _number(value: Any) -> Optional[float]:
    return value if type(value) in (int, float) and value == value and abs(value) != float("inf") else None


class Segment:
    """One segment's run: its settings (``schedulers.script``'s JSON) and what it has seen."""

    def __init__(self, settings: dict[str, Any], received: list[str], wake: int) -> None:
        self.s = settings
        self.received = received  # the signals caught, oldest first
        self.wake = wake  # readable once a signal came
        self.n: int = settings["segment"]
        self.run_dir: str = settings["run_dir"]
        self.stem = os.path.join(self.run_dir, f"seg-{self.n:04d}")
        self.ready_file = os.path.join(self.run_dir, readiness.READY_NAME)
        self.signal: str = settings["signal"]
        self.got = ""  # the signal last passed on to the command
        self.sent: Optional[int] = None  # when the first one was
        self.preempted = False
        self.child: Optional[subprocess.Popen[bytes]] = None
        self.child_start: Optional[int] = None
        self.signalled: set[tuple[int, int]] = set()  # every process signalled: (PID, start)
        self.timer = "wait"
        self.killed = False
        self.stop_by: Optional[float] = None  # the chain ended (a cancel): killed at this time
        self.ready_at: Optional[float] = None  # when its processes had all said they take the signal
        self.fenced: Optional[str] = None  # who owns the checkpoint directory once this one is fenced
        self.beside: list[str] = []  # a snapshot chain's files kept beside the workdir's own
        self.env = self._environment()

    # ---- what the job is told ----

    def _environment(self) -> dict[str, str]:
        s = self.s
        env = {k: v for k, v in os.environ.items() if k not in SERVICE_ONLY}
        env.update(
            CHAINRUN_CHAIN=s["chain"],
            CHAINRUN_CHAIN_ID=s["chain"],
            CHAINRUN_RUN_ID=s["run_id"],  # the chain's id as trackers take it (segment.tracker_run_id)
            CHAINRUN_SEGMENT=str(self.n),
            CHAINRUN_SEED=str(s["seed"]),  # the chain's own, the same in each segment; [env] may set another
            CHAINRUN_CHECKPOINT_DIR=s["checkpoint_dir"],
            CHAINRUN_SIGNAL=self.signal,
            CHAINRUN_RUN_DIR=self.run_dir,
            CHAINRUN_WORKDIR=s["workdir"],
        )
        now = int(time.time())
        self.walltime = granted(self._shell(s["granted"], env), s["walltime"])  # backfill's
        self.deadline = rules.walltime_start(self._started(env), now, self.walltime) + self.walltime
        self.grace = self.grace_in_force()
        self.signal_at = self.deadline - self.grace
        env["CHAINRUN_DEADLINE"] = str(self.deadline)
        env["CHAINRUN_GRACE"] = str(self.grace)
        if not env.get("USER"):  # not every scheduler sets it; ch-run refuses to start without it
            env["USER"] = pwd.getpwuid(os.getuid()).pw_name
        # Once a chain's command has said it takes the signal, it is held until as many of its
        # processes say so again; the lines of this segment's number (a requeued job's) go.
        found = readiness.said(read_regular(self.ready_file, readiness.READ_AT_MOST) or b"")
        self.expected, kept = readiness.before(found, self.n)
        if found:
            write_atomically(self.ready_file, kept)
        self.held = self.expected > 0
        env.update(s["env"])  # what the submitting shell had (inherit_env), then [env], which wins
        # An array task's id as the scheduler lists it (its script exports it), not the job's own.
        self.job = next(
            (
                env[k]
                for k in ("CHAINRUN_JOB_ID", "SLURM_JOB_ID", "JOB_ID", "CHAINRUN_LOCAL_JOB_ID")
                if env.get(k)
            ),
            "",
        )
        env.pop("CHAINRUN_JOB_ID", None)
        # A requeued job runs again as the same segment: its restart makes it the newer one.
        restart = next(
            (env[k] for k in ("SLURM_RESTART_COUNT", "RESTARTED") if env.get(k, "").isdigit()), "0"
        )
        self.token = fence.Token(s["chain"], self.n, int(restart), self.job)
        env[fence.FENCE_VAR] = self.token.text().strip()
        return env

    def grace_in_force(self) -> int:
        """The grace the service last wrote for the chain's segments (``grace`` in the run
        directory), or the job file's."""
        s = self.s
        learned = read_regular(os.path.join(self.run_dir, "grace"), 4096) if s["adaptive"] else None
        return rules.grace(s["grace"], s["adaptive"], learned.decode(errors="replace") if learned else None)

    def _shell(self, command: str, env: dict[str, str]) -> Optional[subprocess.CompletedProcess[bytes]]:
        """One of the backend's questions to its scheduler, asked in the job."""
        if command in ("", "true", "false"):
            return None
        try:
            return subprocess.run(
                ["bash", "-c", command],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env=env,
                timeout=30,
            )
        except (OSError, subprocess.SubprocessError):
            return None

    def _started(self, env: dict[str, str]) -> Optional[int]:
        """When the scheduler started the job (epoch seconds), where it tells."""
        done = self._shell(self.s["started"], env)
        answer = done.stdout.strip() if done is not None else b""
        return int(answer) if answer.isdigit() else None

    def preempting(self) -> bool:
        """The scheduler is preempting the job (it then sends the signal early, and ends or
        requeues the job at the end of its grace time)."""
        done = self._shell(self.s["preempting"], {**self.env, "CHAINRUN_JOB_ID": self.job})  # as listed
        return done is not None and done.returncode == 0

    def ready(self) -> bool:
        """As many of the command's processes said they take the signal in this segment as in
        the latest one before (``SegmentClock`` writes ``ready``; ``checkpoint._ready``)."""
        found = readiness.said(read_regular(self.ready_file, readiness.READ_AT_MOST) or b"")
        return rules.all_ready(len(found.get(self.n, ())), self.expected)

    # ---- the checkpoint as found ----

    def found(self) -> rules.Found:
        s = self.s
        raw = read_regular(os.path.join(s["checkpoint_dir"], SIDECAR), READ_AT_MOST)
        side = _json(raw)
        side = side if isinstance(side, dict) else {}
        own = s["progress_file"]
        if own:  # progress = "FILE:KEY": the script's own JSON file and its epoch's key
            value = _json(read_regular(own, READ_AT_MOST))
            for part in s["progress_key"].split("."):
                value = value.get(part) if isinstance(value, dict) else None
            epoch = _whole(value)
            try:
                saved: Optional[float] = os.stat(own).st_mtime if os.path.isfile(own) else None
            except OSError:
                saved = None
        else:
            epoch, saved = _whole(side.get("epoch")), _number(side.get("saved_at"))
        return rules.Found(
            epoch=epoch,
            step=_whole(side.get("step")),
            saved_at=saved,
            done=side.get("done") is True,
            save_seconds=_number(side.get("save_seconds")),
            # A sidecar, even one that does not read, is the source: no file's mtime stands in
            # for it (as in the service's reader), or a half-written one would be progress.
            mtime=None if raw is not None else self._newest(),
        )

    def _newest(self) -> Optional[float]:
        """When the newest file of the checkpoint directory was written (no partial one)."""
        newest = None
        try:
            with os.scandir(self.s["checkpoint_dir"]) as entries:
                for entry in entries:
                    name = entry.name
                    if name.startswith(".") or name.endswith((".tmp", ".partial", ".lock", "~")):
                        continue
                    if entry.is_file(follow_symlinks=False):
                        mtime = entry.stat(follow_symlinks=False).st_mtime
                        newest = mtime if newest is None else max(newest, mtime)
        except OSError:
            pass
        return newest

    def progress_fields(self) -> str:
        f = self.found()

        def text(value: Any) -> str:
            return "" if value is None else repr(value)

        return (
            f"ckpt_epoch={text(f.epoch)}\nckpt_step={text(f.step)}\nckpt_saved={text(f.saved_at)}\n"
            f"ckpt_done={'true' if f.done else ''}\nckpt_save={text(f.save_seconds)}\n"
            f"ckpt_mtime={text(f.mtime)}\n"
        )

    # ---- markers ----

    def start_marker(self) -> None:
        host = socket.gethostname()
        lines = f"job={self.job}\nhost={host}\nat={int(time.time())}\nwalltime={self.walltime}\n"
        write_atomically(self.stem + ".start", lines + self.progress_fields())

    def end_marker(self, code: int, original: int, skipped: bool, why: str = "") -> None:
        """How the command ended and the checkpoint it left: how chainrun learns the real exit
        code and whether the walltime signal came first. A failed command leaves the last lines
        of its output there too, so its failure explains itself."""
        ready = "1" if self.ready() else "0" if self.held else ""
        path = self.env.get("PATH", "").replace("\n", " ")
        text = (
            f"exit={code}\noriginal={original}\nsignal={self.got}\n"
            f"signalled_at={'' if self.sent is None else self.sent}\nskipped={int(skipped)}\n"
            f"preempted={'1' if self.preempted else ''}\njob={self.job}\nat={int(time.time())}\n"
            f"path={path}\ngrace={self.grace}\nready={ready}\nfenced={self.fenced or ''}\nskip={why}\n"
            # Cut down to tenths, as the other times are to whole seconds: never after the moment.
            f"ready_at={'' if self.ready_at is None else f'{math.floor(self.ready_at * 10) / 10:.1f}'}\n"
            + self.progress_fields()
            + "".join("beside=" + " ".join(where.splitlines()) + "\n" for where in self.beside)
        )
        if original != 0:
            text += "".join(f"tail={line}\n" for line in self.tail())
        write_atomically(self.stem + ".end", text)

    def tail(self) -> list[str]:
        """The last lines of the segment's log (the last part of each line a progress bar
        redrew with CR), chainrun's own lines and blank ones left out."""
        try:
            with open(self.stem + ".log", "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - TAIL_BYTES))
                data = f.read(TAIL_BYTES)
        except OSError:
            return []
        lines = data.decode(errors="replace").replace("\r", "\n").split("\n")
        kept = [line for line in lines if line.strip() and not line.startswith("chainrun: segment ")]
        return [line[:TAIL_WIDTH] for line in kept[-TAIL_LINES:]]

    # ---- signals ----

    def own_group(self) -> bool:
        """The command's process group is still its own: the kernel keeps a group's number
        from new processes while any member lives, but not once the group is empty."""
        assert self.child is not None
        now = proc.started_at(self.child.pid)
        return now is None or now == self.child_start

    def command_pids(self) -> set[tuple[int, int]]:
        """The command's processes that have not ended: its process group, and the descendants
        of the command and of every process signalled before, in whatever group or session
        (torchrun starts each rank in a session of its own and dies of SIGUSR1 without passing
        it on; a shell dies of it and leaves its program behind)."""
        assert self.child is not None
        # Living processes only: ranks orphaned by a launcher the signal killed are reaped by
        # whoever adopts them, maybe never.
        table = {pid: p for pid, p in proc.table().items() if p.state != "Z"}
        mine = self.child.pid if self.own_group() else None
        found = set()
        for pid, process in table.items():
            up: Optional[int] = pid
            for _ in range(64):
                if not up:
                    break
                at = table.get(up)
                ours = at is not None and (
                    (mine is not None and at.group == mine) or (up, at.start) in self.signalled
                )
                if up == mine or ours:
                    found.add((pid, process.start))
                    break
                up = at.parent if at is not None else None
        return found

    def deliver(self, name: str) -> None:
        """Pass a signal on to every process of the command."""
        self.got = name
        if self.child is None:
            return
        if self.sent is None:
            self.sent = int(time.time())
        number = getattr(signal, "SIG" + name)
        pids = self.command_pids()
        self.signalled |= pids
        group = self.child.pid if self.own_group() else None
        if group is not None:
            with contextlib.suppress(OSError):
                os.killpg(group, number)
        for pid, _ in pids:  # once each: a second signal may come as Python exits, and kill it
            with contextlib.suppress(OSError):
                if os.getpgid(pid) != group:
                    os.kill(pid, number)

    def forward(self, name: str) -> None:
        """A signal the scheduler (or our own timer) sent: passed on, or held until its time.
        TERM is never held: it may be a preemption or a cancel."""
        if name == "ALRM":
            return
        if name == self.signal and name != "TERM":
            if not self.preempted and self.preempting():
                self.preempted = True
            now = time.time()
            why = rules.pass_on(
                now, self.signal_at, already=self.sent is not None, preempted=self.preempted,
                held=self.held, ready=self.ready(),
            )  # fmt: skip
            if why == "early":
                say(f"SIG{name} came {int(self.signal_at - now)}s early; passing it on at walltime - grace")
            if why:
                return
        self.deliver(name)
        # Where Slurm signals a preemption only at the end of its grace time, with SIGTERM.
        if name == "TERM" and not self.preempted and self.preempting():
            self.preempted = True

    def tick(self) -> None:
        """The signals that came, then the runner's own clock: the walltime signal at
        ``deadline - grace`` (a scheduler's early one is held until then; one that sends none,
        SGE, gets only ours), and SGE's kill a second before the deadline."""
        while self.received:
            self.forward(self.received.pop(0))
        now = time.time()
        if self.ready_at is None and self.ready():
            self.ready_at = now  # how long the command took to start: a measure, for status
        if self.timer in ("wait", "hold"):
            was, self.timer = (
                self.timer,
                rules.timer(now, self.signal_at, self.deadline, held=self.held, ready=self.ready()),
            )
            if self.timer == "hold" and was == "wait":
                say(f"SIG{self.signal} held: the command has not yet said it is ready for it")
            if self.timer == "send":
                self.timer = "sent"
                self.forward(self.signal)
        if not self.killed and rules.kill_due(now, self.deadline, self.s["wrapper_signals"], self.stop_by):
            self.killed = True
            self.deliver("KILL")  # in the end marker, exit 137 after SIGKILL: a timeout

    def nap(self, seconds: float) -> None:
        """Sleep until a signal comes or ``seconds`` pass, whichever is first."""
        ready, _, _ = select.select([self.wake], [], [], seconds)
        if ready:
            with contextlib.suppress(OSError):
                os.read(self.wake, 512)

    # ---- the run ----

    def run(self) -> int:
        s = self.s
        # A job the scheduler requeued runs this again: the end marker of its earlier run is not this run's.
        with contextlib.suppress(OSError):
            os.unlink(self.stem + ".end")
        self.start_marker()
        before = fields(read_regular(os.path.join(self.run_dir, f"seg-{self.n - 1:04d}.end"), READ_AT_MOST))
        final = os.path.exists(os.path.join(self.run_dir, "final"))
        skip = rules.skip_reason(self.n, final, before, self.found(), s["target"])
        if skip:
            say(f"segment {self.n} skipped: {skip}")
            self.end_marker(0, 0, skipped=True, why=skip)
            return 0
        try:
            os.chdir(s["workdir"])
        except OSError:
            say(f"cannot enter workdir {s['workdir']}", err=True)
            self.end_marker(2, 2, skipped=False)
            return 2
        old = os.umask(0o077)
        for directory in [s["checkpoint_dir"], *s["made_dirs"]]:
            try:
                os.makedirs(directory, exist_ok=True)
            except OSError as exc:
                say(f"cannot make {directory}: {exc.strerror}", err=True)
        os.umask(old)
        if not self.take_fence():
            self.end_marker(0, 0, skipped=True)
            return 0
        try:
            self.share()
            os.chdir(s["code"])
        except OSError as exc:
            say(f"cannot make the snapshot's working copy {s['code']}: {exc.strerror or exc}", err=True)
            self.end_marker(2, 2, skipped=False)
            return 2
        for line in continue_runs(s["tracking"], s["container"], s["command"], self.env):  # [tracking]
            say(f"segment {self.n}: {line}")
        rc = self.run_command()
        self.fenced = self.fenced or self.usurped()  # the helper's commit may have found it first
        self.share()
        code = 0 if self.fenced else rules.exit_status(rc)  # fenced: stopped on purpose
        say(f"segment {self.n} command exited {rc}" + (f" after SIG{self.got}" if self.got else ""))
        self.end_marker(code, rc, skipped=False)
        # Held to the end and never ready: the next segment's command gets the signal at its time again.
        if self.held and not self.ready():
            with contextlib.suppress(OSError):
                os.unlink(self.ready_file)
        if rules.wait_for_preemption(self.preempted, self.got):
            say(f"segment {self.n} preempted: waiting for the scheduler to end or requeue the job")
            while time.time() < self.deadline:
                if "TERM" in self.received:
                    return code
                self.nap(1.0)
        if self.fenced is None:  # a fenced segment queues nothing: the newer one carries the chain
            Carrier(self.run_dir, self.n, self.job, self.env).until_done()  # with this segment's end known
        return code

    def take_fence(self) -> bool:
        """Take the checkpoint directory's fence for this segment; False when a newer segment
        of the chain holds it (this one is fenced before it starts). Where the fence cannot be
        written, the segment runs unfenced, and says so."""
        directory = self.s["checkpoint_dir"]
        try:
            owner = fence.take(directory, self.token)
        except OSError as exc:
            say(
                f"cannot write the fence in {directory} ({exc.strerror}); this segment runs unfenced",
                err=True,
            )
            self.env.pop(fence.FENCE_VAR, None)
            return True
        if owner is None:
            return True
        self.fenced = owner.describe()
        say(f"segment {self.n} fenced before it started: {self.fenced} of the chain owns {directory}")
        return False

    def usurped(self) -> Optional[str]:
        """Who owns the checkpoint directory, once it is no longer this segment (None while
        it is, or where the fence could not be written)."""
        directory = self.s["checkpoint_dir"]
        if fence.FENCE_VAR not in self.env or fence.holds(directory, self.token):
            return None
        owner = fence.read(directory)
        return owner.describe() if owner is not None else "another run"

    def watch_grace(self) -> None:
        """A grace the service learned after this segment started (from the stop of the one
        before, which ended as this one, queued ahead, began) is this segment's too, until its
        signal is due: a successor gets what it would have got a tick later. (The command's
        ``CHAINRUN_GRACE`` stays as it was told.)"""
        if not self.s["adaptive"] or self.timer != "wait":
            return
        grace = self.grace_in_force()
        if grace != self.grace:
            say(f"segment {self.n}: grace {grace}s from now on (was {self.grace}s), as the service learned")
            self.grace, self.signal_at = grace, self.deadline - grace

    def watch_end(self) -> None:
        """The chain ended (a cancel) while the command runs: the signal now, to save, and the
        kill once its grace is over."""
        if self.stop_by is None and os.path.exists(os.path.join(self.run_dir, "final")):
            self.stop_by, self.timer = time.time() + self.grace, "sent"
            say(f"segment {self.n}: the chain was cancelled; SIG{self.signal} now, SIGKILL in {self.grace}s")
            self.deliver(self.signal)

    def watch_fence(self) -> None:
        """Stop the command (SIGKILL: no save may follow) once another segment owns the
        checkpoint directory: for a script that saves without the helper, whose commit
        would not check the fence itself."""
        if self.fenced is not None:
            return
        self.fenced = self.usurped()
        if self.fenced is None:
            return
        directory = self.s["checkpoint_dir"]
        say(f"segment {self.n} fenced: {self.fenced} of the chain owns {directory}; stopping the command")
        assert self.child is not None
        if self.own_group():
            with contextlib.suppress(OSError):
                os.killpg(self.child.pid, signal.SIGKILL)
        self._kill(self.command_pids(), signal.SIGKILL)

    def run_command(self) -> int:
        """Run the command (in a process group of its own, so that a scheduler's kill of the
        job's group leaves it to us) until it and all it started have ended; its exit status,
        128 + N for a signal N."""
        s = self.s
        host, job = socket.gethostname(), self.job or "?"
        say(f"segment {self.n} of chain {s['chain']} starting on {host} as job {job}")
        argv = [*s["container"], "bash", "-c", s["command"]]
        try:
            self.child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=self.env, preexec_fn=os.setpgrp)
        except OSError as exc:
            say(f"cannot start {argv[0]}: {exc.strerror}", err=True)
            return 127
        self.child_start = proc.started_at(self.child.pid)
        carrier = Carrier(self.run_dir, self.n, self.job, self.env)
        fence_at = 0.0
        while self.child.poll() is None:
            self.tick()
            if time.monotonic() >= fence_at:
                fence_at = time.monotonic() + FENCE_EVERY
                self.watch_fence()
                self.watch_end()
                self.watch_grace()
            if self.fenced is None:
                carrier.poll(time.time(), "running")
            self.nap(WAKE_EVERY)
        rc = self.child.returncode
        rc = 128 - rc if rc < 0 else rc
        # The segment ends when the whole command has: a launcher that the signal killed leaves
        # its ranks still saving. What a command that ended on its own left running is ended,
        # as a scheduler would at the job's end.
        left = self.command_pids()
        if left:
            say(f"segment {self.n} waiting for the rest of the command's processes to end")
        began, given = time.time(), set()
        while left:
            due = rules.leftover_signal(bool(self.got), time.time() - began)
            if due and due not in given:
                given.add(due)
                self._kill(left, getattr(signal, "SIG" + due))
            self.tick()
            self.nap(1.0)
            left = self.command_pids()
        carrier.finish()
        return rc

    @staticmethod
    def _kill(pids: set[tuple[int, int]], number: int) -> None:
        for pid, _ in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, number)

    def share(self) -> None:
        """A snapshot chain's working copy: made, what the command left there brought home
        (what was kept beside the workdir's own file is named in the end marker), and the
        workdir linked in (``node.share``). OSError when the copy cannot be made."""
        copy = share(self.s["share"])
        if copy is None:
            return
        self.beside += [b for b in copy.beside if b not in self.beside]
        for what in copy.beside:
            say(f"segment {self.n} kept {what} beside the workdir's own file, which is not this chain's")
        for what in copy.left:
            say(f"segment {self.n} could not bring {what} home; it stays in the working copy", err=True)


def main() -> int:
    received: list[str] = []
    wake, woken = os.pipe()
    os.set_blocking(woken, False)
    signal.set_wakeup_fd(woken)

    def caught(number: int, _frame: Any) -> None:
        received.append(signal.Signals(number).name[3:])

    # From the first moment: bash's own answer to SIGUSR1 is to die, and Slurm may send
    # --signal in the job's first seconds (when walltime - grace is under its 60 s check interval).
    for name in CAUGHT:
        signal.signal(getattr(signal, "SIG" + name), caught)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the nap when the command ends
    settings = json.loads(sys.stdin.read())
    try:
        return Segment(settings, received, wake).run()
    finally:
        # Python's exit gives each signal a Python handler caught its default action (death)
        # back a moment before the process ends, when the walltime signal may still come (the
        # command exited on its own just before it): ignored, it stays ignored.
        ignore_walltime_signals()


if __name__ == "__main__":
    sys.exit(main())
