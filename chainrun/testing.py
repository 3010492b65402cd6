"""A scripted cluster for tests: a fake scheduler and transport, no processes, no sleeps.

``FakeCluster`` holds jobs and files in memory. ``FakeScheduler`` is a backend
like the Slurm one (it builds ``fake-*`` commands and parses their output)
and ``FakeTransport`` runs those commands against the cluster, so the engine
drives whole chains through exactly the code path it uses for a real
cluster. A test plays the world: it starts and ends jobs (leaving the
wrapper's markers, with the checkpoint they saw), makes them vanish or get
stuck, fails the next submission, and moves the ``FakeClock``::

    cluster, clock = FakeCluster(), FakeClock()
    engine = Engine(store, clock=clock, transports=cluster.transport, schedulers=cluster.scheduler)
    engine.tick()                      # submits segment 1
    cluster.start("1")
    cluster.end("1", "timeout", epoch=3)

``FakeCluster(arrays=True)`` gives a backend with job arrays (``FakeArrayScheduler``):
a task's id is ``BASE_INDEX``, and its markers go where its chain's segment script's do.
"""

from __future__ import annotations

import io
import json
import posixpath
import re
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import ClassVar, Optional

from chainrun.checkpoint import SIDECAR_NAME
from chainrun.checkpoint._progress import encode_progress
from chainrun.errors import SchedulerError, TransportError
from chainrun.model import CommandResult, ListedJob, Outcome, Phase
from chainrun.schedulers.base import HelperFile, ListingMemo
from chainrun.schedulers.segment import SegmentJob
from chainrun.starts import Start, cannot, expected
from chainrun.transport import FileInfo

_STEM = re.compile(r"\.sh\Z")
_ARRAY_NAME = re.compile(r"^# fake array (\S+) ", re.MULTILINE)
_TASK = re.compile(r"^(\d+)\) script=(\S+) ", re.MULTILINE)  # a line of an array script's case
USER = 1000  # who the fake cluster's files belong to


class FakeClock:
    """Time that moves only when told to."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


@dataclass
class FakeJob:
    job_id: str
    name: str
    stem: str  # where its markers go: the script path without ".sh"
    after: Optional[str]
    live: ListedJob
    in_view: bool = True  # False: gone from the listing (accounting may still know it)
    accounted: bool = False


class FakeCluster:
    """Jobs and files of one pretend cluster, and every command run against it."""

    def __init__(self, clock: Optional[FakeClock] = None, arrays: bool = False) -> None:
        self.clock = clock or FakeClock()
        self.arrays = arrays
        self.jobs: dict[str, FakeJob] = {}
        self.files: dict[str, bytes] = {}
        self.mtimes: dict[str, float] = {}  # when a file was written through the transport (else: now)
        self.dirs: set[str] = set()  # what makedirs made (files need none)
        self.commands: list[list[str]] = []
        self.next_id = 1
        self.submit_failures: list[SchedulerError | TransportError] = []
        self.down = False  # polls and submissions fail as an unreachable controller's would
        self.cancels_fail = False  # cancels fail, as a controller's that stopped answering after the poll
        # When a job asked about now would start (``Cluster.expected_start``): this many seconds
        # from the clock's now; None: the cluster refuses it (a partition down, say).
        self.start_in: Optional[float] = 0.0

    # -- the engine's side ---------------------------------------------------------

    def scheduler(self, kind: str = "fake", host: Optional[str] = None) -> FakeScheduler:
        return FakeArrayScheduler() if self.arrays else FakeScheduler()

    def transport(self, host: Optional[str] = None) -> FakeTransport:
        return FakeTransport(self)

    # -- the world's side ----------------------------------------------------------

    def submitted(self) -> list[FakeJob]:
        """Every job ever submitted, oldest first."""
        return sorted(self.jobs.values(), key=lambda j: tuple(int(p) for p in j.job_id.split("_")))

    def add_job(self, name: str, stem: str, after: Optional[str] = None, task: Optional[int] = None) -> str:
        """A job in the queue, as a submission (perhaps an interrupted one) leaves it; with
        ``task``, that task of a new array job (add the others with ``add_task``)."""
        job_id = str(self.next_id)
        self.next_id += 1
        if task is not None:
            job_id = f"{job_id}_{task}"
        reason = "Dependency" if after else "Priority"
        self.jobs[job_id] = FakeJob(
            job_id, name, stem, after, ListedJob(job_id, name, Phase.PENDING, reason=reason)
        )
        return job_id

    def add_task(self, base: str, index: int, name: str, stem: str) -> str:
        """Task ``index`` of the array job ``base``, pending."""
        job_id = f"{base}_{index}"
        self.jobs[job_id] = FakeJob(job_id, name, stem, None, ListedJob(job_id, name, Phase.PENDING))
        return job_id

    def start(self, job_id: str, **checkpoint: object) -> None:
        """The job starts: the wrapper's start marker records the checkpoint it finds."""
        job = self.jobs[job_id]
        now = self.clock()
        job.live = replace(job.live, phase=Phase.RUNNING, started_at=now, reason="")
        self.files[job.stem + ".start"] = _marker({"job": job_id, "at": now}, checkpoint)

    def end(
        self,
        job_id: str,
        outcome: str = "timeout",
        exit_code: int = 0,
        *,
        marker: bool = True,
        signal: str = "",
        skipped: bool = False,
        **checkpoint: object,
    ) -> None:
        """The job ends; with ``marker``, the wrapper's end marker records how and the
        checkpoint it leaves (``epoch=``, ``saved=``, ``done=``)."""
        job = self.jobs[job_id]
        now = self.clock()
        if job.live.phase is not Phase.RUNNING:
            self.start(job_id)
        job.live = replace(
            job.live, phase=Phase.ENDED, outcome=Outcome(outcome), exit_code=exit_code, ended_at=now
        )
        if marker:
            signal = signal or ("USR1" if outcome == "timeout" else "")
            fields = {
                "exit": exit_code,
                "original": exit_code,
                "signal": signal,
                "skipped": int(skipped),
                "job": job_id,
                "at": now,
            }
            self.files[job.stem + ".end"] = _marker(fields, checkpoint)

    def vanish(self, job_id: str, accounted: bool = False) -> None:
        """The job leaves the listing (MinJobAge passed); accounting knows it or not."""
        self.jobs[job_id].in_view = False
        self.jobs[job_id].accounted = accounted

    def stick(self, job_id: str) -> None:
        """The scheduler holds the job in an error state, forever."""
        job = self.jobs[job_id]
        job.live = replace(job.live, stuck=True, outcome=Outcome.FAILED, reason="Eqw")

    def fail_next_submit(self, message: str = "controller not responding", transient: bool = True) -> None:
        self.submit_failures.append(SchedulerError(f"fake-submit: {message}", transient=transient))

    def checkpoint(self, directory: str, epoch: int, step: int = 0, done: bool = False) -> None:
        """What the training saves now: the helper's progress sidecar."""
        sidecar = {
            "version": 1,
            "epoch": epoch,
            "step": step,
            "file": f"ckpt-e{epoch:04d}.pt",
            "size": 1,
            "sha256": "0" * 64,
            "saved_at": self.clock(),
            "done": done,
            "segment": None,
            "metrics": {},
        }
        self.files[posixpath.join(directory, SIDECAR_NAME)] = encode_progress(sidecar)

    # -- what the fake commands do -------------------------------------------------

    def _run(self, argv: Sequence[str]) -> CommandResult:
        self.commands.append(list(argv))
        verb, args = argv[0], list(argv[1:])
        if self.down and verb in ("fake-poll", "fake-submit", "fake-array", "fake-start"):
            return CommandResult(tuple(argv), 1, "", "fake: controller not responding\n")
        if verb in ("fake-submit", "fake-array") and self.submit_failures:
            error = self.submit_failures.pop(0)
            if isinstance(error, TransportError):
                raise error
            return CommandResult(tuple(argv), 75 if error.transient else 2, "", str(error) + "\n")
        if verb == "fake-submit":
            name, after, script = args[0], args[1] or None, args[2]
            job_id = self.add_job(name, _STEM.sub("", script), after)
            return CommandResult(tuple(argv), 0, job_id + "\n", "")
        if verb == "fake-array":  # indices, limit, array script: one task per index
            indices, script = [int(i) for i in args[0].split(",")], self.files[args[2]].decode()
            name = _ARRAY_NAME.search(script).group(1)  # type: ignore[union-attr]
            stems = {int(i): _STEM.sub("", path) for i, path in _TASK.findall(script)}
            base = str(self.next_id)
            self.next_id += 1
            for index in indices:
                self.add_task(base, index, name, stems[index])
            return CommandResult(tuple(argv), 0, base + "\n", "")
        if verb == "fake-poll":
            lines = [_line(j.live) for j in self.submitted() if j.in_view]
            return CommandResult(tuple(argv), 0, "".join(lines), "")
        if verb == "fake-acct":
            lines = [_line(self.jobs[i].live) for i in args if i in self.jobs and self.jobs[i].accounted]
            return CommandResult(tuple(argv), 0, "".join(lines), "")
        if verb == "fake-cancel" and (self.down or self.cancels_fail):
            return CommandResult(tuple(argv), 1, "", "fake: controller not responding\n")
        if verb == "fake-cancel":
            now = self.clock()
            for job_id in args:
                job = self.jobs[job_id]
                if job.live.phase is not Phase.ENDED:
                    job.live = replace(
                        job.live, phase=Phase.ENDED, outcome=Outcome.CANCELLED, ended_at=now, stuck=False
                    )
            return CommandResult(tuple(argv), 0, "", "")
        if verb == "fake-start":
            at = "none" if self.start_in is None else str(self.clock() + self.start_in)
            return CommandResult(tuple(argv), 0, at + "\n", "")
        if verb == "fake-explain":
            return CommandResult(tuple(argv), 0, f"job {args[0]}: cannot enter the working directory\n", "")
        if verb == "tar":  # tar -x -f ARCHIVE -C DIR: a code snapshot unpacked where a chain runs
            with tarfile.open(fileobj=io.BytesIO(self.files[args[2]])) as tar:
                for member in tar.getmembers():
                    data = tar.extractfile(member) if member.isfile() else None
                    if data is not None:
                        self.files[posixpath.join(args[4], member.name)] = data.read()
            return CommandResult(tuple(argv), 0, "", "")
        if verb == "rm":  # rm -f -- PATH...
            for path in args[2:]:
                self.files.pop(path, None)
            return CommandResult(tuple(argv), 0, "", "")
        raise AssertionError(f"no such fake command: {argv}")


class FakeScheduler:
    """A backend for the fake cluster: builds ``fake-*`` commands and parses their output."""

    kind: ClassVar[str] = "fake"
    wrapper_signals: ClassVar[bool] = False
    preempting_shell: ClassVar[str] = "false"
    started_shell: ClassVar[str] = "true"
    granted_shell: ClassVar[str] = ""

    def gpus_asked(self, options: Sequence[str]) -> int:
        return 0

    def helper_files(self) -> list[HelperFile]:
        return []  # its tools are the cluster's own

    def directives(self, job: SegmentJob) -> list[str]:
        return [f"# fake job {job.tag}"]

    def submit_argv(self, job: SegmentJob) -> list[str]:
        return ["fake-submit", job.tag, job.after or "", job.script_path]

    def parse_submit(self, result: CommandResult) -> str:
        if not result.ok:
            raise SchedulerError(result.stderr.strip(), transient=result.returncode == 75)
        return result.stdout.strip()

    def poll_argv(self) -> list[str]:
        return ["fake-poll"]

    def parse_poll(self, result: CommandResult) -> dict[str, ListedJob]:
        if not result.ok:
            raise SchedulerError(result.stderr.strip(), transient=True)
        return _POLLED.jobs(result.stdout)

    def cancel_argv(self, job_ids: list[str]) -> list[str]:
        return ["fake-cancel", *job_ids]

    def accounting_argv(self, job_ids: list[str]) -> Optional[list[str]]:
        return ["fake-acct", *job_ids]

    def parse_accounting(self, result: CommandResult) -> dict[str, ListedJob]:
        return _parse(result.stdout)

    def start_argvs(self, job: SegmentJob) -> list[list[str]]:
        return [["fake-start"]]

    def parse_start(self, job: SegmentJob, results: Sequence[CommandResult], now: float) -> Start:
        if not results[0].ok:
            return cannot(f"fake controller does not answer: {results[0].stderr.strip()}")
        at = results[0].stdout.strip()
        return cannot("the fake cluster refuses it") if at == "none" else expected(float(at), now, "fake")

    def explain_argv(self, job_id: str) -> Optional[list[str]]:
        return ["fake-explain", job_id]

    def parse_explain(self, result: CommandResult) -> str:
        return result.stdout.strip()


class FakeArrayScheduler(FakeScheduler):
    """The fake backend with job arrays, as Slurm's: ``BASE_INDEX`` task ids."""

    max_tasks: ClassVar[int] = 4  # small, so that tests see a sweep split over arrays
    task_index_shell: ClassVar[str] = "${FAKE_TASK}"
    task_id_shell: ClassVar[str] = "${FAKE_BASE}_${FAKE_TASK}"

    def array_directives(self, job: SegmentJob, name: str) -> list[str]:
        return [f"# fake array {name} walltime {job.walltime}"]

    def array_submit_argv(
        self, script_path: str, log_path: str, workdir: str, indices: Sequence[int], limit: Optional[int]
    ) -> list[str]:
        return ["fake-array", ",".join(map(str, indices)), str(limit or ""), script_path]

    def task_id(self, base: str, index: int) -> str:
        return f"{base}_{index}"

    def task_index(self, job_id: str) -> Optional[int]:
        return int(job_id.partition("_")[2]) if "_" in job_id else None


class FakeTransport:
    """Runs the fake commands and keeps files in the cluster's memory."""

    host: Optional[str] = None

    def __init__(self, cluster: FakeCluster) -> None:
        self.cluster = cluster

    def run(
        self,
        argv: Sequence[str],
        *,
        input: Optional[str] = None,
        timeout: float = 60.0,
        env: Optional[Mapping[str, str]] = None,
    ) -> CommandResult:
        return self.cluster._run(argv)

    def read_file(self, path: str, limit: Optional[int] = None) -> Optional[bytes]:
        return self.cluster.files.get(path)

    def write_file(self, path: str, data: bytes, mode: int = 0o600) -> None:
        self.cluster.files[path] = data
        self.cluster.mtimes[path] = self.cluster.clock()

    def create_file(self, path: str, data: bytes, mode: int = 0o600) -> bool:
        if path in self.cluster.files:
            return False
        self.write_file(path, data, mode)
        return True

    def stat(self, path: str) -> Optional[FileInfo]:
        data = self.cluster.files.get(path)
        if data is not None:
            mtime = self.cluster.mtimes.get(path, self.cluster.clock())
            return FileInfo(posixpath.basename(path), len(data), mtime, True, 0o100700, USER)
        if path.rstrip("/") in self.cluster.dirs:
            return FileInfo(
                posixpath.basename(path.rstrip("/")), 0, self.cluster.clock(), False, 0o040700, USER
            )
        return None

    def listdir(self, path: str) -> Optional[list[FileInfo]]:
        prefix = path.rstrip("/") + "/"
        names = [
            p[len(prefix) :]
            for p in self.cluster.files
            if p.startswith(prefix) and "/" not in p[len(prefix) :]
        ]
        return [
            FileInfo(
                n,
                len(self.cluster.files[prefix + n]),
                self.cluster.mtimes.get(prefix + n, self.cluster.clock()),
                True,
            )
            for n in sorted(names)
        ]

    def makedirs(self, path: str, mode: int = 0o700) -> None:
        path = path.rstrip("/")
        while path and path not in self.cluster.dirs:
            self.cluster.dirs.add(path)
            path = posixpath.dirname(path).rstrip("/")

    def remove(self, path: str) -> None:
        self.cluster.files.pop(path, None)

    def rename(self, path: str, new_path: str, *, replace: bool = False) -> None:
        """Move the file at ``path``, or every file under it as a directory; onto a file
        there only with ``replace``, as the real transports."""
        if not replace and (self.stat(new_path) is not None or self.listdir(new_path)):
            raise TransportError(f"cannot rename {path} on the fake cluster: {new_path} exists")
        prefix = path.rstrip("/")
        for name in [p for p in self.cluster.files if p == prefix or p.startswith(prefix + "/")]:
            self.cluster.files[new_path.rstrip("/") + name[len(prefix) :]] = self.cluster.files.pop(name)
        for name in [d for d in self.cluster.dirs if d == prefix or d.startswith(prefix + "/")]:
            self.cluster.dirs.remove(name)
            self.cluster.dirs.add(new_path.rstrip("/") + name[len(prefix) :])

    def open_read(self, path: str) -> io.BytesIO:
        """The file's bytes as they are now, read in pieces (``BytesIO.read(size)``)."""
        data = self.cluster.files.get(path)
        if data is None:
            raise TransportError(f"cannot read {path} on the fake cluster: no such file")
        return io.BytesIO(data)

    def open_new(self, path: str, mode: int = 0o600) -> FakeWriter:
        if self.stat(path) is not None:
            raise TransportError(f"cannot create {path} on the fake cluster: it exists")
        self.write_file(path, b"", mode)  # there at once, as an exclusive create makes it
        return FakeWriter(self.cluster, path)

    def user_id(self) -> int:
        return USER

    def close(self) -> None:
        pass


class FakeWriter:
    """A new file of the fake cluster written in pieces: each lands at once, as on a disk."""

    def __init__(self, cluster: FakeCluster, path: str) -> None:
        self.cluster, self.path = cluster, path

    def write(self, data: bytes) -> None:
        self.cluster.files[self.path] = self.cluster.files.get(self.path, b"") + data

    def commit(self, mtime: Optional[float] = None) -> None:
        self.cluster.mtimes[self.path] = self.cluster.clock() if mtime is None else mtime

    def close(self) -> None:
        pass


def _marker(fields: Mapping[str, object], checkpoint: Mapping[str, object]) -> bytes:
    """A marker as the wrapper writes it, with the checkpoint it saw (``ckpt_*``), if told."""
    if not checkpoint:
        return "".join(f"{k}={v}\n" for k, v in fields.items()).encode()
    saw = {
        "ckpt_epoch": checkpoint.get("epoch", ""),
        "ckpt_step": checkpoint.get("step", ""),
        "ckpt_saved": checkpoint.get("saved", ""),
        "ckpt_done": "true" if checkpoint.get("done") else "",
        "ckpt_mtime": checkpoint.get("mtime", ""),
    }
    return "".join(f"{k}={v}\n" for k, v in {**fields, **saw}.items()).encode()


def _line(job: ListedJob) -> str:
    data = {
        "id": job.job_id,
        "name": job.name,
        "phase": job.phase.value,
        "outcome": job.outcome.value if job.outcome else None,
        "exit_code": job.exit_code,
        "started_at": job.started_at,
        "ended_at": job.ended_at,
        "reason": job.reason,
        "stuck": job.stuck,
    }
    return json.dumps(data) + "\n"


def _job(line: str) -> ListedJob:
    d = json.loads(line)
    return ListedJob(
        job_id=d["id"],
        name=d["name"],
        phase=Phase(d["phase"]),
        outcome=Outcome(d["outcome"]) if d["outcome"] else None,
        exit_code=d["exit_code"],
        started_at=d["started_at"],
        ended_at=d["ended_at"],
        reason=d["reason"],
        stuck=d["stuck"],
    )


_POLLED = ListingMemo(_job)  # the fake poll's last listing, kept as a backend's (Slurm's) is


def _parse(text: str) -> dict[str, ListedJob]:
    return {job.job_id: job for job in map(_job, text.splitlines())}
