"""Scheduler backends: pure command builders and parsers, one per kind."""

from __future__ import annotations

from typing import Optional

from chainrun.schedulers.base import Scheduler


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


def will_not_start(reason: str) -> str:
    """What to change for a job the scheduler keeps pending for ``reason``, when that reason
    will not clear by itself (Slurm's PartitionNodeLimit, PartitionTimeLimit, ...); "" for
    one that may. Only Slurm names such states in its listing: SGE's is its error state,
    which ends the segment (``ListedJob.stuck``)."""
    from chainrun.schedulers.slurm import NEVER_CLEARS

    return NEVER_CLEARS.get(reason.split(",")[0].strip(), "")
