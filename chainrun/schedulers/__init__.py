"""Scheduler backends: pure command builders and parsers, one per kind."""

from __future__ import annotations

from typing import Optional

from chainrun.errors import JobFileError, SchedulerError
from chainrun.model import JobSpec
from chainrun.schedulers.base import Scheduler
from chainrun.schedulers.segment import SegmentJob, render_script, trust_run_dir
from chainrun.store import new_chain_id
from chainrun.transport import LocalTransport


def scheduler_for(kind: str, host: Optional[str]) -> Scheduler:
    """The backend for one cluster: a job file's ``scheduler.kind`` and ``host``."""
    if kind == "local":
        from chainrun.schedulers.local import LocalScheduler

        return LocalScheduler(host=host or None)
    if kind == "slurm":
        from chainrun.schedulers.slurm import SlurmScheduler

        return SlurmScheduler()
    if kind == "sge":
        from chainrun.schedulers.sge import SgeScheduler

        return SgeScheduler()
    raise ValueError(f"unknown scheduler kind {kind!r}")


def preflight(spec: JobSpec) -> tuple[str, list[str]]:
    """Build the first segment's script and submit command without running them, so what the
    backend refuses (a job name, a path SGE would rewrite) is a job file error before any chain
    exists; and, for a chain on this machine, refuse a run directory someone else could change.
    Returns the script and the submit command, for ``check --show-script``."""
    scheduler = scheduler_for(spec.scheduler.kind, spec.scheduler.first_host)
    job = SegmentJob(new_chain_id(spec.name), 1, spec, spec.walltime)
    try:
        script = render_script(scheduler, job)
        argv = scheduler.submit_argv(job)
        scheduler.submit_argv(SegmentJob(job.chain_id, 2, spec, spec.walltime, after="1"))
    except SchedulerError as exc:
        raise JobFileError(f"{spec.source}: {exc}") from None
    if not spec.scheduler.remote:
        trust_run_dir(LocalTransport(), spec, None, create=False)
    return script, argv
