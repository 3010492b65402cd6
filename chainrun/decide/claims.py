"""One chain per checkpoint directory: which active chain a job would share its checkpoints with.

Two chains training into one directory each resume from what the other saved: a corrupted
run and twice the allocation. A chain *claims* its checkpoint directory from submission
until it ends; the claim is where the directory is (the machines that see it, this one
written "") and the directory, resolved by the caller where it can be (a path on this
machine, symlinks followed). Submitting a job file whose chain still holds the claim
returns that chain; any other claim on the same directory is refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

from chainrun.model import JobSpec


@dataclass(frozen=True)
class Claim:
    """The checkpoint directory a chain trains into, and where it is."""

    machines: frozenset[str]  # the hosts it is seen from; "" is this machine
    path: str  # absolute, normalised; resolved where the caller could

    def clashes(self, other: Claim) -> bool:
        return self.path == other.path and bool(self.machines & other.machines)


def claim(spec: JobSpec, path: str) -> Claim:
    """``spec``'s claim, its checkpoint directory resolved to ``path``: a pool's hosts, the
    one host, or this machine (a cluster without ``host`` is reached from this one, so its
    paths are this machine's paths)."""
    where = spec.scheduler.hosts or (spec.scheduler.host or "",)
    return Claim(frozenset(where), path)


@dataclass(frozen=True)
class Holder:
    """An active chain and its claim."""

    chain_id: str
    name: str
    claim: Claim


def holder(name: str, mine: Claim, active: Iterable[Holder]) -> Optional[Holder]:
    """The active chain that holds the claim a new chain named ``name`` would make: the
    chain of the same name first (the same job file submitted again), else any other."""
    clashing = [h for h in active if h.claim.clashes(mine)]
    same = [h for h in clashing if h.name == name]
    return next(iter(same or clashing), None)
