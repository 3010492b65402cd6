"""The local backend: the workstation's own little scheduler.

Builds ``python -m chainrun.localrunner`` commands and parses their output,
exactly as the Slurm and SGE backends do with sbatch and squeue, so the engine
treats a workstation like any other cluster (over SSH too).

A workstation reached over SSH needs no chainrun: the runner (one file,
standard library only) is copied to ``~/.chainrun/runner/`` (``helper_files``),
named by its content's hash, once per host and chainrun version, and the
commands run it with the host's ``python3``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import ClassVar, Optional

from chainrun.errors import SchedulerError
from chainrun.model import CommandResult, ListedJob, Outcome, Phase
from chainrun.schedulers.base import HelperFile
from chainrun.schedulers.segment import SegmentJob
from chainrun.schedulers.ship import LOCAL_RUNNER
from chainrun.starts import Start, cannot, expected, starts_now, unknown

RUNNER_DIR = ".chainrun/runner"  # on a remote host, relative to the login directory

_PHASES = {"pending": Phase.PENDING, "running": Phase.RUNNING, "ended": Phase.ENDED}


class LocalScheduler:
    kind: ClassVar[str] = "local"
    wrapper_signals: ClassVar[bool] = False
    preempting_shell: ClassVar[str] = "false"
    started_shell: ClassVar[str] = 'echo "${CHAINRUN_LOCAL_STARTED:-}"'  # its supervisor's start
    granted_shell: ClassVar[str] = ""  # a range runs for its longest

    def __init__(self, host: Optional[str] = None) -> None:
        self.host = host

    def _argv(self, *args: str) -> list[str]:
        if self.host is None:  # this machine: the interpreter chainrun runs under
            return [sys.executable, "-m", "chainrun.localrunner", *args]
        # A remote workstation: its login shell's python3, running the copy of ``helper_files``.
        return ["python3", runner_path(), *args]

    def gpus_asked(self, options: Sequence[str]) -> int:
        return 0  # a workstation's runs get GPUs from a pool's gpus_per_slot alone

    def helper_files(self) -> list[HelperFile]:
        """On a remote host, the runner's own copy (on this machine it is the package's)."""
        if self.host is None:
            return []
        return [HelperFile("~/" + runner_path(), LOCAL_RUNNER.data())]

    def directives(self, job: SegmentJob) -> list[str]:
        return [f"# local runner job {job.tag}"]

    def submit_argv(self, job: SegmentJob) -> list[str]:
        argv = self._argv(
            "submit",
            "--name",
            job.tag,
            "--output",
            job.log_path,
            "--walltime",
            str(job.walltime),
            "--signal",
            job.spec.signal,
            "--grace",
            str(job.spec.grace),
        )
        if job.after:
            argv += ["--after", job.after]
        sched = job.spec.scheduler
        if sched.slots is not None:
            argv += ["--slots", str(sched.slots)]
        if sched.gpus_per_slot is not None:
            argv += ["--gpus-per-slot", str(sched.gpus_per_slot)]
        return [*argv, job.script_path]

    def parse_submit(self, result: CommandResult) -> str:
        job_id = result.stdout.strip()
        if not result.ok or not job_id.isdigit():
            raise SchedulerError(f"local runner: {result.describe()}", transient=result.returncode != 2)
        return job_id

    def poll_argv(self) -> list[str]:
        return self._argv("poll")

    def parse_poll(self, result: CommandResult) -> dict[str, ListedJob]:
        if not result.ok:
            raise SchedulerError(f"local runner: {result.describe()}", transient=True)
        jobs = {}
        for line in result.stdout.splitlines():
            d = json.loads(line)
            job_id = str(d["id"])
            jobs[job_id] = ListedJob(
                job_id=job_id,
                name=d["name"],
                phase=_PHASES[d["state"]],
                outcome=Outcome(d["outcome"]) if d.get("outcome") else None,
                exit_code=d.get("exit_code"),
                started_at=d.get("started_at"),
                ended_at=d.get("ended_at"),
                reason=d.get("reason", ""),
                slot=d.get("slot"),
            )
        return jobs

    def start_argvs(self, job: SegmentJob) -> list[list[str]]:
        return [self.poll_argv()]

    def parse_start(self, job: SegmentJob, results: Sequence[CommandResult], now: float) -> Start:
        """Now when one of the machine's ``slots`` is free for it and every job waiting for one
        ahead of it; else when enough running jobs reach their walltime to free one (at the
        latest: they may end sooner). Without ``slots`` every job starts at once."""
        if not results[0].ok:
            return cannot(f"local runner does not answer: {results[0].describe()}")
        slots = job.spec.scheduler.slots
        if slots is None:
            return starts_now(now, "no slot limit on this machine")
        ends, waiting = [], 0
        for line in results[0].stdout.splitlines():
            d = json.loads(line)
            if d["state"] == "running" and d.get("slot") is not None:
                ends.append(d["started_at"] + d["walltime"] if d.get("walltime") else None)
            waiting += d["state"] == "pending" and d.get("reason") == "Resources"
        free = max(0, slots - len(ends))
        told = f"{free} of {slots} slot{'s' * (slots > 1)} free"
        told += f", {waiting} job{'s' * (waiting > 1)} waiting for one" if waiting else ""
        if free > waiting:
            return starts_now(now, told)
        known = sorted(end for end in ends if end is not None)
        needed = waiting - free  # the running jobs that must end first: this one's slot is the next
        if needed < len(known) and len(known) == len(ends):
            return expected(max(now, known[needed]), now, f"when running jobs reach their walltime; {told}")
        return unknown(now, told)

    def cancel_argv(self, job_ids: list[str]) -> list[str]:
        return self._argv("cancel", *job_ids)

    def accounting_argv(self, job_ids: list[str]) -> Optional[list[str]]:
        return None  # the listing keeps ended jobs for a week

    def parse_accounting(self, result: CommandResult) -> dict[str, ListedJob]:
        return {}

    def explain_argv(self, job_id: str) -> Optional[list[str]]:
        return None  # no state here holds a job forever

    def parse_explain(self, result: CommandResult) -> str:
        return ""


def runner_path() -> str:
    """Where the runner's copy lives on a remote host (relative to the login directory)."""
    return f"{RUNNER_DIR}/{LOCAL_RUNNER.name()}"
