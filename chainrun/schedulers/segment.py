"""The segment protocol: what every backend's job shares.

A segment's names and paths (the tag ``cr.CHAIN.N`` that finds a job again
after a crash, the run directory next to the training, which only its user
may change: ``trust_run_dir``), the one wrapper
script every backend runs (``segment.sh``, rendered here in one pass), and
the markers the wrapper leaves: ``seg-NNNN.start`` and ``seg-NNNN.end``, each
with the checkpoint as the segment found and left it, and ``final``, written
when the chain ends so that a successor that starts anyway exits at once.
A sweep's first segments may share one array job (``render_array_script``):
its tasks run those same segment scripts, under the array's name ``cr@CHAIN``.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
import signal as signals
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Optional

from chainrun import container
from chainrun.errors import UnsafePathError
from chainrun.model import JobSpec, Outcome, Progress

if TYPE_CHECKING:
    from chainrun.schedulers.base import ArrayScheduler, Scheduler
    from chainrun.transport import FileInfo, Transport

RUN_DIR_NAME = ".chainrun"
FINAL_NAME = "final"
CODE_DIR = "code"  # in RUN_DIR_NAME: the code snapshots (snapshot = "git"), one per commit


@dataclass(frozen=True)
class SegmentJob:
    """One segment as the scheduler sees it: names, paths, limits."""

    chain_id: str
    n: int
    spec: JobSpec
    walltime: int
    after: Optional[str] = None

    @property
    def tag(self) -> str:
        """Deterministic job name: finds the job again after a crash."""
        return tag_for(self.chain_id, self.n)

    @property
    def run_dir(self) -> str:
        return run_dir(self.spec, self.chain_id)

    @property
    def stem(self) -> str:
        return posixpath.join(self.run_dir, f"seg-{self.n:04d}")

    @property
    def script_path(self) -> str:
        return self.stem + ".sh"

    @property
    def log_path(self) -> str:
        return self.stem + ".log"


def tag_for(chain_id: str, n: int) -> str:
    return f"cr.{chain_id}.{n}"


ARRAY_PREFIX = "cr@"


def array_tag(chain_id: str) -> str:
    """The name of an array job of first segments: its first chain's id (each chain is
    journaled into one array, ever), so that after a crash its tasks are found again."""
    return ARRAY_PREFIX + chain_id


def array_stem(spec: JobSpec, name: str) -> str:
    """Where an array's script and its own (normally empty) log go."""
    return posixpath.join(spec.workdir, RUN_DIR_NAME, "array-" + name[len(ARRAY_PREFIX) :])


def render_array_script(scheduler: ArrayScheduler, name: str, tasks: Sequence[tuple[int, SegmentJob]]) -> str:
    """An array job's script: each task runs its chain's own segment script (wrapper, markers
    and signal handling as for any segment; ``exec``, so the scheduler's signal reaches the
    wrapper) with its output in that segment's log, and tells it the id it runs as."""
    lines = ["#!/bin/bash", *scheduler.array_directives(tasks[0][1], name)]
    lines.append(f'case "{scheduler.task_index_shell}" in')
    lines += [f"{i}) script={quote(job.script_path)} log={quote(job.log_path)} ;;" for i, job in tasks]
    lines += [
        f'*) echo "chainrun: array task {scheduler.task_index_shell} has no segment" >&2 && exit 1 ;;',
        "esac",
        f'export CHAINRUN_JOB_ID="{scheduler.task_id_shell}"',
        'exec >>"$log" 2>&1',
        'exec "$script"',
    ]
    return "\n".join(lines) + "\n"


def run_dir(spec: JobSpec, chain_id: str) -> str:
    """Where a chain's scripts, logs and markers live, next to the training."""
    return posixpath.join(spec.workdir, RUN_DIR_NAME, chain_id)


def code_dir(spec: JobSpec) -> str:
    """Where the command runs: the workdir, or a snapshot chain's unpacked commit (at the
    job's subdirectory of its repository)."""
    if not spec.snapshot_commit:
        return spec.workdir
    base = posixpath.join(spec.workdir, RUN_DIR_NAME, CODE_DIR, spec.snapshot_commit)
    return posixpath.join(base, spec.snapshot_subdir) if spec.snapshot_subdir else base


def final_path(spec: JobSpec, chain_id: str) -> str:
    return posixpath.join(run_dir(spec, chain_id), FINAL_NAME)


def trust_run_dir(
    transport: Transport,
    spec: JobSpec,
    chain_id: Optional[str],
    create: bool = True,
    ran_there: bool = False,
) -> None:
    """Make sure ``WORKDIR/.chainrun`` (and the chain's directory in it, given ``chain_id``) is a
    directory only this user can change, creating what is missing (mode 0700) when ``create``.
    A workdir is often shared (a sticky scratch directory): an existing one that another user
    owns, that others may write, or that is a symlink is refused, and nothing is run from it.

    Once the chain has run there (``ran_there``) the workdir itself is never made again: a
    missing one was moved or purged, and the next segment would start over in an empty one."""
    if ran_there and transport.stat(spec.workdir) is None:
        raise UnsafePathError(
            f"workdir {spec.workdir} is gone (moved, removed or purged since the chain ran there); "
            "chainrun will not start over in an empty one: put it back and submit the job file again"
        )
    me = transport.user_id()
    paths = [posixpath.join(spec.workdir, RUN_DIR_NAME)]
    if chain_id is not None:
        paths.append(run_dir(spec, chain_id))
    for path in paths:
        info = transport.stat(path)
        if info is None and create:
            transport.makedirs(path, 0o700)
            info = transport.stat(path)  # and look again: another user may have been quicker
            if info is not None and path == paths[0] and info.uid == me:
                # Never part of the user's repository: `git status` stays as it was.
                transport.write_file(posixpath.join(path, ".gitignore"), b"*\n")
        if info is not None:
            _trust(info, path, me, directory=True)


def trust_script(transport: Transport, path: str) -> None:
    """Right before submission: the script is still a regular file of this user's alone."""
    _trust(transport.stat(path), path, transport.user_id(), directory=False)


def _trust(info: Optional[FileInfo], path: str, me: int, directory: bool) -> None:
    if info is None:
        problem = "is gone"
    elif stat.S_ISLNK(info.mode):
        problem = "is a symbolic link"
    elif directory and not info.is_dir:
        problem = "is not a directory"
    elif not directory and not info.is_file:
        problem = "is not a regular file"
    elif info.uid != me:
        problem = f"belongs to another user (uid {info.uid})"
    elif info.mode & 0o022:
        problem = f"can be changed by other users (mode {stat.S_IMODE(info.mode):o})"
    else:
        return
    raise UnsafePathError(
        f"{path} {problem}, so chainrun will not run scripts from it: remove it "
        "(or, if it is your own, `chmod go-w` it) and submit again"
    )


def quote(value: str) -> str:
    """shlex.quote, with each newline written as ``$'\\n'``: no value from the job
    file ever starts a line of the script (qsub reads ``#$`` at any line's start)."""
    return "$'\\n'".join(shlex.quote(part) for part in value.split("\n"))


_PLACEHOLDER = re.compile(r"@@([A-Z_]+)@@")


def param_text(value_json: str) -> str:
    """A sweep parameter's value as the command and environment see it: a string as it
    is, anything else as in JSON (``0.1``, ``true``)."""
    value = json.loads(value_json)
    return value if isinstance(value, str) else value_json


def sweep_environment(spec: JobSpec) -> list[tuple[str, str]]:
    """What a sweep chain's command gets: each parameter, all of them as JSON, the repetition."""
    if not spec.sweep_name:
        return []
    pairs = [(f"CHAINRUN_PARAM_{k.upper()}", param_text(v)) for k, v in spec.params]
    everything = json.dumps({k: json.loads(v) for k, v in spec.params}, separators=(",", ":"))
    return [*pairs, ("CHAINRUN_PARAMS", everything), ("CHAINRUN_REP", str(spec.rep))]


def render_script(scheduler: Scheduler, job: SegmentJob) -> str:
    """The batch script: shebang, the backend's directives, the shared wrapper.

    Placeholders are replaced in one pass over the template, so a value that
    holds ``@@NAME@@`` arrives as it is, never expanded again."""
    spec = job.spec
    q = quote
    values = {
        "CHAIN": q(job.chain_id),
        "SEGMENT": str(job.n),
        "SEGMENT_PADDED": f"{job.n:04d}",
        "PREVIOUS": str(job.n - 1),
        "PREVIOUS_PADDED": f"{job.n - 1:04d}",
        "CHECKPOINT_DIR": q(spec.checkpoint_dir),
        "SIGNAL": q(spec.signal),
        "RUN_DIR": q(job.run_dir),
        "WALLTIME": str(job.walltime),
        "GRACE": str(spec.grace),
        "WRAPPER_SIGNALS": "1" if scheduler.wrapper_signals else "",
        "INHERITED": "\n".join(f"export {key}={q(value)}" for key, value in spec.inherited),
        "ENV": "\n".join(f"export {key}={q(value)}" for key, value in (*sweep_environment(spec), *spec.env)),
        "TARGET": q("" if spec.target_epoch is None else str(spec.target_epoch)),
        "PROGRESS_FILE": q(spec.progress_file or ""),
        "PROGRESS_KEY": q(spec.progress_key),
        "WORKDIR": q(code_dir(spec)),
        "COMMAND": q(spec.command),
        "CONTAINER": "".join(f"{q(word)} " for word in container.argv(spec, code_dir(spec))),
    }
    template = resources.files("chainrun.schedulers").joinpath("segment.sh").read_text()
    body = _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)
    header = ["#!/bin/bash", *scheduler.directives(job)]
    return "\n".join(header) + "\n" + body


def _fields(data: bytes) -> dict[str, str]:
    """A marker's ``key=value`` lines (its ``tail=`` lines are read by ``_tail``)."""
    return dict(line.split("=", 1) for line in _lines(data) if "=" in line and not line.startswith("tail="))


def _lines(data: bytes) -> list[str]:
    return data.decode(errors="replace").split("\n")


def _tail(data: bytes) -> tuple[str, ...]:
    """The last lines of a failed command's output, as the end marker keeps them."""
    return tuple(line[len("tail=") :] for line in _lines(data) if line.startswith("tail="))


def _number(text: Optional[str], kind: type[float] | type[int]) -> Optional[float]:
    try:
        return kind(text) if text else None
    except ValueError:
        return None


def _snapshot(fields: dict[str, str]) -> Optional[Progress]:
    """The checkpoint as a marker recorded it; None for a marker without one."""
    if "ckpt_epoch" not in fields:
        return None
    epoch = _number(fields.get("ckpt_epoch"), int)
    step = _number(fields.get("ckpt_step"), int)
    saved = _number(fields.get("ckpt_saved"), float)
    mtime = _number(fields.get("ckpt_mtime"), float)
    if epoch is None and saved is None and mtime is None:
        return Progress()
    return Progress(
        epoch=None if epoch is None else int(epoch),
        step=None if step is None else int(step),
        saved_at=saved if epoch is not None or saved is not None else mtime,
        done=fields.get("ckpt_done") == "true",
    )


@dataclass(frozen=True)
class StartMarker:
    """The wrapper's record of a segment's start: its job, time and checkpoint."""

    job_id: str
    at: Optional[float]
    progress: Optional[Progress]

    @classmethod
    def parse(cls, data: bytes) -> StartMarker:
        fields = _fields(data)
        return cls(fields.get("job", "").strip(), _number(fields.get("at"), float), _snapshot(fields))


@dataclass(frozen=True)
class EndMarker:
    """The wrapper's record of how the command ended, and the checkpoint it left."""

    exit_code: int
    original: int
    signal: str
    skipped: bool
    at: Optional[float]
    progress: Optional[Progress] = None
    path: str = ""  # the PATH the command ran with
    tail: tuple[str, ...] = ()  # the last lines of the command's output, when it failed

    @classmethod
    def parse(cls, data: bytes) -> Optional[EndMarker]:
        fields = _fields(data)
        try:
            return cls(
                exit_code=int(fields["exit"]),
                original=int(fields.get("original") or fields["exit"]),
                signal=fields.get("signal", ""),
                skipped=fields.get("skipped") == "1",
                at=float(fields["at"]) if fields.get("at") else None,
                progress=_snapshot(fields),
                path=fields.get("path", ""),
                tail=_tail(data),
            )
        except (KeyError, ValueError):
            return None

    @property
    def stopped_by_signal(self) -> bool:
        """The walltime (or preemption) signal came and the command then stopped cleanly."""
        if not self.signal:
            return False
        signum = getattr(signals, "SIG" + self.signal, None)
        return self.original == 0 or (signum is not None and self.original == 128 + signum)

    @property
    def killed(self) -> bool:
        """The command died of a signal that was not the walltime one (a SIGKILL from the
        kernel's OOM killer, say): accounting may know better than "failed"."""
        return self.original > 128 and not self.stopped_by_signal

    def outcome(self) -> Outcome:
        if self.stopped_by_signal:
            return Outcome.TIMEOUT
        return Outcome.COMPLETED if self.original == 0 else Outcome.FAILED

    def describe(self) -> str:
        if self.skipped:
            return "skipped: the goal was already reached"
        how = f"after SIG{self.signal}" if self.signal else "on its own"
        return f"the command exited {self.original} {how}"
