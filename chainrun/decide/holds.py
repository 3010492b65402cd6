"""One chain per checkpoint directory: which active chain a job would share its checkpoints with.

Two chains training into one directory each resume from what the other saved: a corrupted
run and twice the allocation. A chain *holds* its checkpoint directory from submission
until it ends; the hold is where the directory is (the names of the machines that see it,
``machines``) and the directory, resolved there by the caller at submit (symlinks followed
on the host the chain runs on) and kept in the chain's spec. A directory inside another's
clashes with it too: their files mix, and ``--fresh`` on the outer one moves the inner
one's checkpoints aside. Submitting a job file whose chain still holds the
same directory returns that chain; any other clashing hold is refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

from chainrun.model import JobSpec


@dataclass(frozen=True)
class Hold:
    """The checkpoint directory a chain trains into, and where it is."""

    machines: frozenset[str]  # the hosts it is seen from; "" is this machine
    path: str  # absolute, normalised; resolved where the caller could

    def clashes(self, other: Hold) -> bool:
        """Seen from a machine in common, one directory, or one inside the other."""
        return bool(self.machines & other.machines) and (
            self.path == other.path or inside(self.path, other.path) or inside(other.path, self.path)
        )


def inside(path: str, directory: str) -> bool:
    """Whether ``path`` is strictly within ``directory`` (both absolute and normalised)."""
    return path != directory and path.startswith(directory.rstrip("/") + "/")


def ancestors(path: str) -> list[str]:
    """The directories ``path`` is within, nearest first (``/a/b`` -> ``/a``, ``/``)."""
    found = []
    while path not in ("/", ""):
        path = path.rsplit("/", 1)[0] or "/"
        found.append(path)
    return found


HERE = ""  # this machine, in a hold's machines


def hosts(spec: JobSpec) -> tuple[str, ...]:
    """Where ``spec``'s checkpoint directory is seen from, as the job file names it: a pool's
    hosts, the one host, or this machine (a cluster without ``host`` is reached from this
    one, so its paths are this machine's paths)."""
    return spec.scheduler.hosts or (spec.scheduler.host or HERE,)


def machines(canonical: str, identity: str, here: str) -> frozenset[str]:
    """The names one machine goes by in holds: ``canonical`` (a host as ssh resolves its
    alias, ``hostname:port``, so that two aliases of one machine are one name; ``HERE`` for
    this machine) and, where known, its ``identity`` (its machine id), so that one machine
    reached by two names is one; a host whose identity is ``here``'s is this machine too."""
    names = {canonical}
    if identity:
        names.add(f"id:{identity}")
        if identity == here:
            names.add(HERE)
    return frozenset(names)


def hold(spec: JobSpec) -> Optional[Hold]:
    """``spec``'s hold as settled at its submit; None for a chain stored before holds were."""
    if not spec.checkpoint_real:
        return None
    return Hold(frozenset(spec.checkpoint_machines), spec.checkpoint_real)


def written(spec: JobSpec, path: str) -> Hold:
    """``spec``'s hold by its hosts as written, its checkpoint directory resolved to ``path``:
    how a chain stored before holds were settled at submit is compared."""
    return Hold(frozenset(hosts(spec)), path)


@dataclass(frozen=True)
class Holder:
    """An active chain and its hold (at its place ``place``; "": its first, or its only one)."""

    chain_id: str
    name: str
    hold: Hold
    place: str = ""


def holder(name: str, mine: Hold, active: Iterable[Holder]) -> Optional[Holder]:
    """The active chain that holds what a new chain named ``name`` would hold: the
    chain of the same name in the same directory first (the same job file submitted again),
    else any other."""
    clashing = [h for h in active if h.hold.clashes(mine)]
    same = [h for h in clashing if same_job(name, mine, h)]
    return next(iter(same or clashing), None)


def clashing(name: str, mine: Sequence[Hold], active: Iterable[Holder]) -> Optional[tuple[int, Holder]]:
    """The active chain a new chain named ``name`` meets, holding ``mine`` (one hold per
    place, its first place's first), and which of ``mine`` it meets: the chain of the same
    job file in the same directory first, else the first that clashes with any; None: none."""
    held = list(active)
    found = [(i, h) for i, one in enumerate(mine) if (h := holder(name, one, held)) is not None]
    same = [(i, h) for i, h in found if same_job(name, mine[i], h)]
    return next(iter(same or found), None)


def same_job(name: str, mine: Hold, held: Holder) -> bool:
    """``held`` is the chain of this very job file (its name, its directory), submitted before."""
    return held.name == name and held.hold.path == mine.path
