"""What every scheduler backend provides, and what they all share.

A backend is a set of pure command builders and output parsers: it never runs
anything itself. The engine runs the commands it builds through a transport
and hands the results back to its parsers. Shared here: the segment job's
names and paths, the one wrapper script every backend runs, and reading the
wrapper's markers.
"""

from __future__ import annotations

import posixpath
import re
import shlex
import signal as signals
from dataclasses import dataclass
from importlib import resources
from typing import ClassVar, Optional, Protocol

from chainrun.errors import SchedulerError
from chainrun.model import JobSpec, Observation, Outcome, Phase
from chainrun.transport import CommandResult

RUN_DIR_NAME = ".chainrun"


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


def run_dir(spec: JobSpec, chain_id: str) -> str:
    """Where a chain's scripts, logs and markers live, next to the training."""
    return posixpath.join(spec.workdir, RUN_DIR_NAME, chain_id)


@dataclass(frozen=True)
class LiveJob:
    """One line of the scheduler's live view (squeue, qstat, the local runner)."""

    job_id: str
    name: str
    phase: Phase
    outcome: Optional[Outcome] = None  # set when the live view shows a finished job
    exit_code: Optional[int] = None
    started_at: Optional[float] = None
    ended_at: Optional[float] = None
    reason: str = ""
    # Held by the scheduler in an error state (SGE's Eqw): it will never run
    # on its own. The engine asks why (explain_argv), then removes it.
    stuck: bool = False


class Scheduler(Protocol):
    """A backend: builds commands, parses their output. Never runs anything."""

    kind: ClassVar[str]
    # True when the scheduler cannot send the warning signal ``grace`` seconds
    # before its walltime kill; the wrapper then sends it to itself.
    wrapper_signals: ClassVar[bool]

    def directives(self, job: SegmentJob) -> list[str]:
        """Header lines (``#SBATCH ...``) placed right after the shebang."""

    def submit_argv(self, job: SegmentJob) -> list[str]:
        """The command that queues ``job.script_path``, after ``job.after`` if set."""

    def parse_submit(self, result: CommandResult) -> str:
        """The new job id; raises SchedulerError (transient or permanent)."""

    def poll_argv(self) -> list[str]:
        """One command listing all of this user's jobs on the cluster."""

    def parse_poll(self, result: CommandResult) -> dict[str, LiveJob]:
        """Job id -> live view; raises SchedulerError when the poll failed."""

    def cancel_argv(self, job_ids: list[str]) -> list[str]:
        """One command cancelling all of ``job_ids``."""

    def accounting_argv(self, job_ids: list[str]) -> Optional[list[str]]:
        """One command asking accounting about finished jobs, or None if none."""

    def parse_accounting(self, result: CommandResult) -> dict[str, LiveJob]:
        """Job id -> final state from accounting; empty when it knows nothing yet."""

    def explain_argv(self, job_id: str) -> Optional[list[str]]:
        """One command saying why a stuck job is stuck, or None if there is none."""

    def parse_explain(self, result: CommandResult) -> str:
        """The scheduler's reason from explain_argv's output; empty if none."""


def command_error(
    tool: str, result: CommandResult, transient: re.Pattern[str], missing: str
) -> SchedulerError:
    """A failed scheduler command as one line in the tool's own words; transient when
    ``transient`` matches it; a tool not found (exit 127) is permanent, with ``missing``."""
    text = result.stderr.strip() or result.stdout.strip() or f"exit {result.returncode}"
    lines = [line.strip() for line in text.splitlines() if line.strip() not in ("", "Exiting.")]
    message = f"{tool}: " + " ".join(lines[-3:])
    if result.returncode == 127:
        return SchedulerError(f"{tool} not found: {missing} ({message})", transient=False)
    return SchedulerError(message, transient=bool(transient.search(message)))


def submitted_id(tool: str, result: CommandResult, separator: str) -> str:
    """The job id a successful submit printed on its last line, before ``separator``."""
    lines = result.stdout.strip().splitlines()
    job_id = lines[-1].split(separator)[0].strip() if lines else ""
    if not job_id.isdigit():
        raise SchedulerError(f"{tool}: unexpected output {result.stdout.strip()!r}", transient=True)
    return job_id


def quote(value: str) -> str:
    """shlex.quote, with each newline written as ``$'\\n'``: no value from the job
    file ever starts a line of the script (qsub reads ``#$`` at any line's start)."""
    return "$'\\n'".join(shlex.quote(part) for part in value.split("\n"))


def render_script(scheduler: Scheduler, job: SegmentJob) -> str:
    """The batch script: shebang, the backend's directives, the shared wrapper."""
    spec = job.spec
    q = quote
    env = "\n".join(f"export {key}={q(value)}" for key, value in spec.env)
    values = {
        "CHAIN": q(job.chain_id),
        "SEGMENT": str(job.n),
        "SEGMENT_PADDED": f"{job.n:04d}",
        "CHECKPOINT_DIR": q(spec.checkpoint_dir),
        "SIGNAL": q(spec.signal),
        "RUN_DIR": q(job.run_dir),
        "WALLTIME": str(job.walltime),
        "GRACE": str(spec.grace),
        "WRAPPER_SIGNALS": "1" if scheduler.wrapper_signals else "",
        "ENV": env,
        "TARGET": q("" if spec.target_epoch is None else str(spec.target_epoch)),
        "WORKDIR": q(spec.workdir),
        "COMMAND": q(spec.command),
    }
    body = resources.files("chainrun.schedulers").joinpath("segment.sh").read_text()
    for key, value in values.items():
        body = body.replace(f"@@{key}@@", value)
    header = ["#!/bin/bash", *scheduler.directives(job)]
    return "\n".join(header) + "\n" + body


@dataclass(frozen=True)
class EndMarker:
    """The wrapper's record of how the command ended."""

    exit_code: int
    original: int
    signal: str
    skipped: bool
    at: Optional[float]

    @classmethod
    def parse(cls, data: bytes) -> Optional[EndMarker]:
        fields = dict(
            line.split("=", 1) for line in data.decode(errors="replace").splitlines() if "=" in line
        )
        try:
            return cls(
                exit_code=int(fields["exit"]),
                original=int(fields.get("original") or fields["exit"]),
                signal=fields.get("signal", ""),
                skipped=fields.get("skipped") == "1",
                at=float(fields["at"]) if fields.get("at") else None,
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

    def outcome(self) -> Outcome:
        if self.stopped_by_signal:
            return Outcome.TIMEOUT
        return Outcome.COMPLETED if self.original == 0 else Outcome.FAILED

    def describe(self) -> str:
        if self.skipped:
            return "skipped: the goal was already reached"
        how = f"after SIG{self.signal}" if self.signal else "on its own"
        return f"the command exited {self.original} {how}"


def resolve(live: Optional[LiveJob], marker: Optional[EndMarker]) -> Optional[Observation]:
    """An ended job's observation from the live view and the end marker, if either knows."""
    if live is not None and live.phase is not Phase.ENDED:
        return None
    if live is None and marker is None:
        return None
    outcome = live.outcome if live is not None and live.outcome else None
    # The scheduler knows timeouts, OOM and node failures; the marker knows
    # the real exit code and whether the walltime signal came first.
    overridable = outcome is None or (outcome in (Outcome.COMPLETED, Outcome.FAILED))
    if marker is not None and overridable and (outcome is None or marker.stopped_by_signal):
        outcome = marker.outcome()
    if outcome is None:
        outcome = Outcome.LOST
    reasons = [r for r in (live.reason if live else "", marker.describe() if marker else "") if r]
    exit_code = marker.original if marker is not None else (live.exit_code if live else None)
    return Observation(
        job_id=live.job_id if live else "",
        phase=Phase.ENDED,
        outcome=outcome,
        exit_code=exit_code,
        started_at=live.started_at if live else None,
        ended_at=(live.ended_at if live else None) or (marker.at if marker else None),
        reason="; ".join(reasons),
    )
