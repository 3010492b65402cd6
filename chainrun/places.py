"""Where a chain runs: a scheduler table (``SchedulerSpec``), a place of several a job file
lists (``PlaceSpec``, its ``[[cluster]]`` table). Plain values, no I/O, below ``model``
(whose ``JobSpec`` holds them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from chainrun.values import SLOTS

HOST_TIMEOUT = 600  # a pool host's default host_timeout: 10 minutes without an answer


@dataclass(frozen=True, **SLOTS)
class SchedulerSpec:
    """The `[scheduler]` table: which backend, where, and its pass-through options."""

    kind: str = "local"
    host: Optional[str] = None
    queue: Optional[str] = None
    options: tuple[str, ...] = ()
    # A pool (kind "local" only): the hosts a chain's segments may be placed on, the
    # runs each host takes at once, and the GPUs each of those runs gets.
    hosts: tuple[str, ...] = ()
    slots: Optional[int] = None  # None: no limit (the local runner on one machine)
    gpus_per_slot: Optional[int] = None
    # Seconds a pool's host may not answer before its running segments count as lost.
    host_timeout: int = HOST_TIMEOUT
    # Whether the workdir is one directory on every host of the pool, as found at submit by
    # a probe file (None: not found out; a chain then keeps to the host it ran on).
    workdir_shared: Optional[bool] = None
    # A pool chain whose workdir is not shared: the host whose disk held its checkpoint at
    # submit (None: none did), where it starts and is looked at before any segment ran.
    checkpoint_host: Optional[str] = None

    @property
    def cluster_key(self) -> tuple[str, str]:
        """Chains with the same key are polled together, once per tick (a pool's chains:
        by the host of their segment, ``Chain.cluster_key``)."""
        return (self.kind, self.host or "")

    @property
    def remote(self) -> bool:
        """Whether the chain runs on other machines, over SSH: paths there are absolute."""
        return self.host is not None or bool(self.hosts)

    @property
    def where(self) -> str:
        """Where the chain runs, in words: ``this machine``, the host, or the pool."""
        if not self.hosts:
            text = self.host or "this machine"
        else:
            runs = "1 run" if self.slots == 1 else f"{self.slots} runs"
            text = f"a pool of {', '.join(self.hosts)}; {runs} at a time on each"
        if self.gpus_per_slot:
            text += f", {self.gpus_per_slot} GPU{'s' if self.gpus_per_slot > 1 else ''} per run"
        elif self.slots and not self.hosts:
            text += f", {self.slots} run{'s' if self.slots > 1 else ''} at a time"
        return text

    @property
    def first_host(self) -> Optional[str]:
        """Where the checkpoint is looked at before any segment ran: the host, or for a pool the
        one that held the checkpoint at submit, else its first."""
        return self.host or self.checkpoint_host or (self.hosts[0] if self.hosts else None)

    @classmethod
    def from_json(cls, sched: dict[str, Any]) -> SchedulerSpec:
        return cls(
            kind=sched["kind"],
            host=sched["host"],
            queue=sched["queue"],
            options=tuple(sched["options"]),
            hosts=tuple(sched.get("hosts", ())),
            slots=sched.get("slots"),
            gpus_per_slot=sched.get("gpus_per_slot"),
            host_timeout=sched.get("host_timeout", HOST_TIMEOUT),
            workdir_shared=sched.get("workdir_shared"),
            checkpoint_host=sched.get("checkpoint_host"),
        )


@dataclass(frozen=True, **SLOTS)
class PlaceSpec:
    """One ``[[cluster]]`` of a job file that lists several: its name (unique in the job
    file) and everything a segment there sees differently, each in full (the job file's
    value where the table gives none). The first place's are the job spec's own."""

    name: str
    scheduler: SchedulerSpec
    workdir: str
    checkpoint_dir: str
    walltime: int  # min(the job file's walltime, the place's limit)
    container: Optional[str] = None
    # Set at submit (``chainrun.location``), as ``JobSpec``'s own.
    checkpoint_real: str = ""
    checkpoint_machines: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PlaceSpec:
        return cls(
            **{k: v for k, v in data.items() if k not in ("scheduler", "checkpoint_machines")},
            scheduler=SchedulerSpec.from_json(data["scheduler"]),
            checkpoint_machines=tuple(data.get("checkpoint_machines", ())),
        )
