"""The local backend: the workstation's own little scheduler.

Builds ``python -m chainrun.localrunner`` commands and parses their output,
exactly as the Slurm and SGE backends do with sbatch and squeue, so the engine
treats a workstation like any other cluster (over SSH too).
"""

from __future__ import annotations

import json
import sys
from typing import ClassVar, Optional

from chainrun.errors import SchedulerError
from chainrun.model import CommandResult, LiveJob, Outcome, Phase
from chainrun.schedulers.segment import SegmentJob

_PHASES = {"pending": Phase.PENDING, "running": Phase.RUNNING, "ended": Phase.ENDED}


class LocalScheduler:
    kind: ClassVar[str] = "local"
    wrapper_signals: ClassVar[bool] = False

    def __init__(self, python: Optional[str] = None) -> None:
        # On this machine, the interpreter chainrun runs under; on a remote
        # workstation, whatever python3 its login shell finds.
        self.python = python or sys.executable

    def _argv(self, *args: str) -> list[str]:
        return [self.python, "-m", "chainrun.localrunner", *args]

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
        return [*argv, job.script_path]

    def parse_submit(self, result: CommandResult) -> str:
        job_id = result.stdout.strip()
        if not result.ok or not job_id.isdigit():
            raise SchedulerError(f"local runner: {result.describe()}", transient=result.returncode != 2)
        return job_id

    def poll_argv(self) -> list[str]:
        return self._argv("poll")

    def parse_poll(self, result: CommandResult) -> dict[str, LiveJob]:
        if not result.ok:
            raise SchedulerError(f"local runner: {result.describe()}", transient=True)
        jobs = {}
        for line in result.stdout.splitlines():
            d = json.loads(line)
            job_id = str(d["id"])
            jobs[job_id] = LiveJob(
                job_id=job_id,
                name=d["name"],
                phase=_PHASES[d["state"]],
                outcome=Outcome(d["outcome"]) if d.get("outcome") else None,
                exit_code=d.get("exit_code"),
                started_at=d.get("started_at"),
                ended_at=d.get("ended_at"),
                reason=d.get("reason", ""),
            )
        return jobs

    def cancel_argv(self, job_ids: list[str]) -> list[str]:
        return self._argv("cancel", *job_ids)

    def accounting_argv(self, job_ids: list[str]) -> Optional[list[str]]:
        return None  # the live view keeps ended jobs for a week

    def parse_accounting(self, result: CommandResult) -> dict[str, LiveJob]:
        return {}

    def explain_argv(self, job_id: str) -> Optional[list[str]]:
        return None  # no state here holds a job forever

    def parse_explain(self, result: CommandResult) -> str:
        return ""
