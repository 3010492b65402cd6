"""A tiny batch scheduler for one workstation: ``python -m chainrun.localrunner``.

It plays the part slurmd plays on a cluster, so the local backend is the same
kind of command builder and parser as the Slurm and SGE ones. ``submit``
queues a script and starts a detached supervisor (its own session), which
waits for the job's dependency (afterany), runs the script, enforces the
walltime (the configured signal at walltime minus grace, SIGTERM at walltime,
SIGKILL after a short wait) and records the end in files. Jobs therefore keep
running, and their outcome is still known, when the chainrun service stops.

State lives under ``$CHAINRUN_HOME/local/machines/<machine-id>/``, one
directory per machine (``/etc/machine-id``, else the hostname), so that the
machines of a lab can share one home over NFS: each keeps its own job
numbers, records, slot locks and logs, and a job is only ever judged on the
machine that started it. Two machines with one id (a cloned image) would judge each
other's jobs: ``machine.json`` there names the boot that uses the directory (its boot id,
hostname, and when it last said so: at each command, and every few seconds while a job is
supervised), and a machine whose id another boot used after this machine started is
refused (``judge``). A job is ``jobs/<id>/``: ``job.json`` (what was
asked), ``supervisor.pid`` (the supervisor's PID, its start time and the
machine's boot id: a PID alone may name another process after a reboot or
in a new PID namespace), ``start.json``, ``end.json``, and a ``cancel``
request file. A job's directory is made under ``new/`` and moved into
``jobs/`` once complete.

``--slots N`` makes a job take one of the machine's N slots (one per GPU, say)
before it starts: a job whose dependency is met waits until one is free, as a
scheduler waits for resources, so no more than N such jobs ever run at once,
whether the chainrun service runs or not. A slot is a ``flock`` on
``slots/<s>``, held by the supervisor and the job, so it frees itself when
they end, however they end. The job gets its slot as ``CHAINRUN_SLOT`` and,
with ``--gpus-per-slot G``, ``CUDA_VISIBLE_DEVICES`` = GPUs s*G .. s*G+G-1.

This module imports the standard library alone, and of chainrun only ``home``
and ``node.proc``: on a remote workstation it is copied into place with them, as
one archive run as ``python3 FILE``, with no chainrun installed.

A full or read-only state directory costs a job nothing: the supervisor keeps
enforcing the walltime whatever happens to its record writes, tries a failed
one again every second, and once the job has ended keeps trying ``end.json``
for hours; while it lives the job is never reported ended. A submit that
cannot write exits 1 (try again later) and leaves no job behind.

Submit is idempotent by name, like adopting a job by its deterministic name
on a cluster: while a job called NAME has not ended, ``submit --name NAME``
prints that job's id instead of queueing a second copy of the segment.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from chainrun.home import HomeError, default_home, private_dir, short_path
from chainrun.node import proc

KILL_WAIT = 10.0  # seconds between SIGTERM and SIGKILL, like Slurm's KillWait
PR_SET_CHILD_SUBREAPER = 36  # prctl(2)
TICK = 0.2
KEEP_ENDED = 7 * 86400
RETRY = 1.0  # seconds between tries of a record that could not be written
END_PATIENCE = 6 * 3600  # how long an ended job's supervisor keeps trying to write end.json
MACHINE_FILE = "machine.json"  # in the machine's directory: the boot that uses it (``judge``)
REFRESH = 5.0  # seconds between a boot's notes that it still uses its directory
SILENT = 600.0  # a boot that has not said so for this long is gone
SLACK = 5.0  # seconds of clock difference allowed across a restart


def machine_id() -> str:
    """This machine's stable identity: its systemd/dbus machine id, else its hostname."""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text and text.isalnum():
            return text
    return os.uname().nodename


def boot_id() -> str:
    """This boot of the machine: a new one after every restart."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def booted_at() -> Optional[float]:
    """When this boot began (by this machine's clock; a time namespace's own boot in one)."""
    try:
        return time.time() - float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def judge(
    record: Optional[dict[str, Any]], me: dict[str, str], booted: Optional[float], now: float
) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """Whether this boot (``me``: boot id and hostname, ``booted`` at) may use a machine
    directory whose ``machine.json`` says ``record``: (what to write there, or None; the host
    of another machine that uses it, or None). One machine never runs two boots at once, so
    another boot that noted its use after this one began is another machine with the same
    id: this one is refused, and the other keeps the directory. Else the directory is this
    boot's: after a restart, a rename, or the other boot gone quiet for ``SILENT``."""
    mine = {**me, "seen": now}
    if record is None:
        return mine, None
    seen = _number(record.get("seen"))
    if record.get("boot") == me["boot"]:
        return (mine if now - seen >= REFRESH or record.get("host") != me["host"] else None), None
    if booted is not None and seen > booted + SLACK and now - seen < SILENT:
        return None, str(record.get("host"))
    return mine, None


def _number(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def claim_machine(path: Path) -> None:
    """Note in machine directory ``path`` that this boot uses it (``judge``); HomeError when
    another machine with the same id does. A failed write costs nothing: it is noted again."""
    me = {"boot": boot_id(), "host": os.uname().nodename}
    write, other = judge(_read_json(path / MACHINE_FILE), me, booted_at(), time.time())
    if write is not None:
        with contextlib.suppress(OSError):
            _write_json(path / MACHINE_FILE, write)
    if other is not None:
        raise HomeError(
            f"machine id {path.name} is also used by host {other}, up at the same time: two machines"
            f" with one /etc/machine-id (a cloned image?) cannot share {short_path(path.parent)};"
            " give one its own (rm /etc/machine-id; systemd-machine-id-setup) and restart it"
        )


def machine_dir(base: Path) -> Path:
    """The state directory of this machine under the runner's ``base`` (``$CHAINRUN_HOME/local``)."""
    return base / "machines" / machine_id()


def home() -> Path:
    base = private_dir(default_home()) / "local"
    path = machine_dir(base)
    if not path.exists():
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        with contextlib.suppress(OSError):  # numbered on from the jobs of before (``_job_dirs``)
            shutil.copyfile(base / "next_id", path / "next_id")
    claim_machine(path)
    return path


def _write_atomic(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all; a failed write leaves no temporary file."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # two writers never share one
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _write_json(path: Path, data: dict[str, Any]) -> None:
    _write_atomic(path, json.dumps(data))


def _read_json(path: Path) -> Optional[dict[str, Any]]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def identity(pid: int) -> str:
    """What names process ``pid`` for good: its PID, start time and the machine's boot id."""
    return f"{pid} {proc.started_at(pid) or 0} {boot_id()}\n"


def _supervisor_alive(path: Path, legacy: bool = False) -> bool:
    """Whether the supervisor ``path`` records runs: the same PID, started at the same
    time, in this very boot. A PID reused by another process, or a record from before a
    restart, is not it. A ``legacy`` record (a job of a runner before machines had their
    own state) has its PID alone, and is judged by it."""
    if legacy:
        with contextlib.suppress(OSError, ValueError):
            return proc.alive(int(path.read_text().split()[0]))
    try:
        pid, start, boot = path.read_text().split()
        identity = (int(pid), int(start), boot)
    except (OSError, ValueError):
        return False
    return (
        identity[2] == boot_id() and proc.started_at(identity[0]) == identity[1] and proc.alive(identity[0])
    )


def _restarted(path: Path) -> bool:
    """Whether the supervisor ``path`` records ran in an earlier boot of this machine."""
    try:
        return path.read_text().split()[2] != boot_id()
    except (OSError, IndexError):
        return False


def _next_id(root: Path) -> int:
    counter = root / "next_id"
    try:
        n = int(counter.read_text().strip() or "1")
    except (OSError, ValueError):
        n = 1
    _write_atomic(counter, f"{n + 1}\n")
    return n


def _legacy(root: Path) -> Path:
    """Where a runner before machines had their own state kept its jobs: they are still
    listed, cancelled and waited for, so that an upgrade loses none that run."""
    return root.parent.parent / "jobs"


def _job_dir(root: Path, job_id: str) -> Path:
    """Job ``job_id``'s directory: this machine's, else one of before (``_legacy``)."""
    mine = root / "jobs" / job_id
    old = _legacy(root) / job_id
    return old if not mine.exists() and old.exists() else mine


def _job_dirs(root: Path) -> list[Path]:
    """Every job's directory, by id: the jobs of before (``_legacy``) first."""
    found: dict[str, Path] = {}
    for jobs in (_legacy(root), root / "jobs"):
        for jobdir in jobs.iterdir() if jobs.is_dir() else []:
            if jobdir.name.isdigit():
                found[jobdir.name] = jobdir
    return [found[k] for k in sorted(found, key=int)]


def _queued(root: Path, name: str) -> Optional[int]:
    """The id of a job called ``name`` that has not ended, if there is one."""
    for jobdir in _job_dirs(root):
        job = _read_json(jobdir / "job.json")
        if job is not None and job["name"] == name and not _ended(root, jobdir.name):
            return int(job["id"])
    return None


def _this_runner(*args: str) -> list[str]:
    """The command that runs this runner again: isolated (-I: no script directory, no PYTHON*
    variables), from where it was loaded (the package's directory, or the archive it was
    shipped in), so that it runs the same where chainrun is not installed."""
    where = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (
        f"import sys; sys.path.insert(0, {where!r}); from chainrun.localrunner import main; sys.exit(main())"
    )
    return [sys.executable, "-I", "-c", code, *args]


def _create(root: Path, args: argparse.Namespace) -> int:
    """Queue a new job: made in ``new/`` and moved into ``jobs/`` whole. On a
    failed write nothing is queued, and the error is raised."""
    job_id = _next_id(root)
    (root / "jobs").mkdir(mode=0o700, exist_ok=True)
    jobdir = root / "jobs" / str(job_id)
    stage = root / "new"
    shutil.rmtree(stage, ignore_errors=True)  # what a submit killed half-way left
    stage.mkdir(mode=0o700)
    try:
        with open(stage / "supervisor.log", "ab") as log:
            supervisor = subprocess.Popen(
                _this_runner("supervise", str(jobdir)),
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=log,
                start_new_session=True,
                close_fds=True,
            )
        assert supervisor.stdin is not None
        with supervisor.stdin:  # closing it lets the supervisor go on: to run the job, or to exit without one
            _write_atomic(stage / "supervisor.pid", identity(supervisor.pid))
            _write_json(
                stage / "job.json",
                {
                    "id": job_id,
                    "name": args.name,
                    "script": os.path.abspath(args.script),
                    "output": os.path.abspath(args.output),
                    "walltime": args.walltime,
                    "signal": args.signal,
                    "grace": args.grace,
                    "after": args.after,
                    "slots": args.slots,
                    "gpus_per_slot": args.gpus_per_slot,
                    "submitted_at": time.time(),
                },
            )
            stage.rename(jobdir)
    except OSError:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return job_id


def submit(args: argparse.Namespace) -> int:
    root = home()
    _prune(root)
    with open(root / "lock", "a+") as lock:
        # One submit at a time, so that two with the same name cannot both create a job.
        fcntl.flock(lock, fcntl.LOCK_EX)
        job_id = _queued(root, args.name)
        if job_id is None:
            job_id = _create(root, args)
        else:
            print(f"localrunner: job {args.name} already queued as {job_id}", file=sys.stderr)
    # Widens the window between "queued" and "id reported", so tests can kill
    # the service inside it and check that the job is adopted, not duplicated.
    time.sleep(float(os.environ.get("CHAINRUN_LOCAL_SUBMIT_DELAY", "0")))
    print(job_id)
    return 0


def _ended(root: Path, job_id: Optional[str]) -> bool:
    if not job_id:
        return True
    jobdir = _job_dir(root, str(job_id))
    if not jobdir.exists() or (jobdir / "end.json").exists():
        return True
    return not _supervisor_alive(jobdir / "supervisor.pid", jobdir.parent != root / "jobs")


def _become_subreaper() -> None:
    """What the job leaves orphaned, in whatever session, is re-parented to the supervisor
    (not init), so it can still be found and ended, as a cgroup keeps it for Slurm."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the job's session only
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _supervisors(root: Path) -> set[int]:
    """The supervisors of the jobs queued here: one that a job submitted (its successor,
    queued while the service is away) is the scheduler's, never part of that job."""
    found = set()
    for jobdir in _job_dirs(root):
        if not (jobdir / "end.json").exists():
            with contextlib.suppress(OSError, ValueError, IndexError):
                found.add(int((jobdir / "supervisor.pid").read_text().split()[0]))
    return found


def _kill_job(job: subprocess.Popen[bytes], root: Path) -> None:
    """SIGKILL all the job started: its session, and what it orphaned in any session, which
    the supervisor (a subreaper) inherits, other jobs' supervisors aside; then wait, up to
    KILL_WAIT, until they are gone, reaping the orphans. The job's own exit status is left
    for ``job.poll`` to collect."""
    me = os.getpid()
    processes = proc.table()
    killed = {pid for pid, p in processes.items() if p.session == job.pid} | proc.below(me, processes)
    killed -= _supervisors(root)
    for pid in killed:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    give_up = time.monotonic() + KILL_WAIT
    while killed and time.monotonic() < give_up:
        processes = proc.table()
        for pid in proc.below(me, processes) - {job.pid}:
            with contextlib.suppress(OSError):
                os.waitpid(pid, os.WNOHANG)
        killed = {pid for pid in killed if pid in processes and processes[pid].state != "Z"}
        if killed:
            time.sleep(TICK)


class _Records:
    """The supervisor's record files. A write that fails (a full or read-only
    disk) is kept and tried again later, never raised: enforcing the walltime
    matters more than writing down that the job runs."""

    def __init__(self, jobdir: Path) -> None:
        self.jobdir = jobdir
        self.owed: dict[str, dict[str, Any]] = {}
        self.retry_at = 0.0

    def write(self, name: str, data: dict[str, Any]) -> None:
        self.owed[name] = data
        self.retry_at = 0.0
        self.flush()

    def flush(self) -> bool:
        """Try the owed writes, at most every RETRY seconds; whether all are written."""
        if self.owed and time.monotonic() >= self.retry_at:
            for name, data in list(self.owed.items()):
                try:
                    _write_json(self.jobdir / name, data)
                except OSError:
                    self.retry_at = time.monotonic() + RETRY
                    break
                del self.owed[name]
        return not self.owed

    def end(self, data: dict[str, Any]) -> int:
        """Write end.json, trying for up to END_PATIENCE; exit status 1 if it never could."""
        self.write("end.json", data)
        give_up = time.monotonic() + END_PATIENCE
        while not self.flush():
            if time.monotonic() >= give_up:
                return 1
            time.sleep(TICK)
        return 0


def supervise(jobdir: Path) -> int:
    sys.stdin.buffer.read()  # submit closes this pipe once job.json is written, or has failed
    root = jobdir.parent.parent
    job = _read_json(jobdir / "job.json")
    if job is None:
        return 1
    records = _Records(jobdir)
    cancel = jobdir / "cancel"
    beat = _beat(root, -REFRESH)
    while not _ended(root, job["after"]) and not cancel.exists():
        beat = _beat(root, beat)
        time.sleep(TICK * 2)
    slot: Optional[tuple[int, int]] = None  # (index, the fd that holds its lock)
    while job.get("slots") and not cancel.exists():
        beat = _beat(root, beat)
        slot = _take_slot(root, job["slots"])
        if slot is not None:
            break
        time.sleep(TICK * 2)
    if cancel.exists():
        return records.end({"outcome": "cancelled", "exit_code": None, "ended_at": time.time()})

    _become_subreaper()
    # The walltime counts from here; the job's script reads when (a whole second, never later).
    started = time.time()
    env = dict(os.environ, CHAINRUN_LOCAL_JOB_ID=str(job["id"]), CHAINRUN_LOCAL_STARTED=str(int(started)))
    if slot is not None:
        env["CHAINRUN_SLOT"] = str(slot[0])
        gpus = job.get("gpus_per_slot")
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(slot[0] * gpus + g) for g in range(gpus))
    where = {} if slot is None else {"slot": slot[0]}
    try:
        with open(job["output"], "ab") as out:
            child = subprocess.Popen(
                ["bash", job["script"]],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=os.path.dirname(job["script"]),
                env=env,
                start_new_session=True,
                # The job holds its slot too: should the supervisor die, the slot stays taken
                # while the job runs.
                pass_fds=(slot[1],) if slot is not None else (),
            )
    except OSError as exc:  # its directory is gone (a scheduler says "can't chdir" too)
        reason = f"could not start the job: {exc.strerror}: {exc.filename}"
        return records.end(
            {"outcome": "failed", "exit_code": None, "ended_at": time.time(), "reason": reason}
        )
    warn_at = started + job["walltime"] - job["grace"]
    stop_at = started + job["walltime"]
    warned = False
    term_at: Optional[float] = None
    why = ""
    try:
        records.write("start.json", {"pid": child.pid, "started_at": started, **where})
        while child.poll() is None:
            now = time.time()
            if term_at is None and cancel.exists():
                why, term_at = "cancelled", now
                child.send_signal(signal.SIGTERM)
            if not warned and now >= warn_at and term_at is None:
                warned = True
                child.send_signal(getattr(signal, "SIG" + job["signal"]))
            if term_at is None and now >= stop_at:
                why, term_at = "timeout", now
                child.send_signal(signal.SIGTERM)
            if term_at is not None and now >= term_at + KILL_WAIT:
                _kill_job(child, root)
            records.flush()
            beat = _beat(root, beat)
            time.sleep(TICK)
    finally:
        # Like a scheduler: nothing outlives the job, nor a supervisor that failed.
        _kill_job(child, root)
    rc = child.returncode
    outcome = why or ("completed" if rc == 0 else "failed")
    end = {"outcome": outcome, "exit_code": rc, "started_at": started, "ended_at": time.time()}
    return records.end({**end, **where})


def _beat(root: Path, last: float) -> float:
    """Every REFRESH seconds while a job is supervised, note that this boot of the machine
    uses its directory (``claim_machine``): another machine with the same id, started since,
    is then refused before it judges this one's jobs. When it was noted (monotonic)."""
    now = time.monotonic()
    if now - last < REFRESH:
        return last
    with contextlib.suppress(HomeError):  # the job is this machine's all the same: it goes on
        claim_machine(root)
    return now


def _take_slot(root: Path, slots: int) -> Optional[tuple[int, int]]:
    """A free one of the machine's first ``slots`` slots, locked: (its index, the lock's fd)."""
    directory = root / "slots"
    directory.mkdir(mode=0o700, exist_ok=True)
    for index in range(slots):
        fd = os.open(directory / str(index), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        return index, fd
    return None


def poll(args: argparse.Namespace) -> int:
    """One JSON line per job: id, name, state, outcome, times, reason."""
    root = home()
    for jobdir in _job_dirs(root):
        job = _read_json(jobdir / "job.json")
        if job is None:
            continue
        line: dict[str, Any] = {"id": job["id"], "name": job["name"]}
        end = _read_json(jobdir / "end.json")
        start = _read_json(jobdir / "start.json")
        if end is not None:
            line.update(state="ended", outcome=end["outcome"], exit_code=end.get("exit_code"))
            line.update(reason=end.get("reason", ""))
            line.update(started_at=end.get("started_at"), ended_at=end.get("ended_at"), slot=end.get("slot"))
        elif _restarted(jobdir / "supervisor.pid"):
            line.update(
                state="ended", outcome="node_fail", reason="the machine restarted while the job was on it"
            )
        elif not _supervisor_alive(jobdir / "supervisor.pid", jobdir.parent != root / "jobs"):
            line.update(state="ended", outcome="node_fail", reason="the local supervisor died")
        elif start is not None:
            line.update(state="running", started_at=start["started_at"], slot=start.get("slot"))
            line.update(walltime=job.get("walltime"))  # when its slot frees at the latest
        elif job["after"] and not _ended(root, job["after"]):
            line.update(state="pending", reason="Dependency")
        else:  # ready to run: starting, or waiting for one of the machine's slots
            line.update(state="pending", reason="Resources" if job.get("slots") else "Starting")
        print(json.dumps(line))
    return 0


def cancel(args: argparse.Namespace) -> int:
    root = home()
    status = 0
    for job_id in args.ids:
        jobdir = _job_dir(root, str(job_id))
        if not (jobdir / "job.json").exists():
            print(f"localrunner: no job {job_id}", file=sys.stderr)
            status = 1
            continue
        (jobdir / "cancel").touch()
    return status


def _prune(root: Path) -> None:
    cutoff = time.time() - KEEP_ENDED
    for jobdir in _job_dirs(root):
        end = jobdir / "end.json"
        try:
            if end.stat().st_mtime < cutoff:
                shutil.rmtree(jobdir, ignore_errors=True)
        except OSError:
            pass


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="chainrun local runner")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("submit")
    p.add_argument("--name", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--walltime", type=int, required=True)
    p.add_argument("--signal", default="USR1")
    p.add_argument("--grace", type=int, default=0)
    p.add_argument("--after")
    p.add_argument("--slots", type=int, help="jobs with --slots that may run on this machine at once")
    p.add_argument("--gpus-per-slot", type=int, help="CUDA_VISIBLE_DEVICES: GPUs s*G .. s*G+G-1 for slot s")
    p.add_argument("script")
    p.set_defaults(func=submit)
    p = sub.add_parser("poll")
    p.set_defaults(func=poll)
    p = sub.add_parser("cancel")
    p.add_argument("ids", nargs="+")
    p.set_defaults(func=cancel)
    p = sub.add_parser("supervise")
    p.add_argument("jobdir", type=Path)
    p.set_defaults(func=lambda a: supervise(a.jobdir))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except HomeError as exc:  # e.g. a state directory open to others: one line, exit 2
        print(f"chainrun local runner: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. a full or read-only disk: one line, exit 1 (try again later)
        print(f"chainrun local runner: {args.cmd}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
