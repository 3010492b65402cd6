"""Scheduler backends: pure command builders and parsers, one per kind."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # the backends load only when one is asked for
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
