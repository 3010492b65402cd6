"""Where and when a chain's new segment may start: the hosts of a pool (their free slots,
the host a chain is placed on and observed on, why it waits), a sweep's ``max_concurrent``,
and which first segments go out as tasks of one array job.

Every function is pure. The engine asks ``observe_on`` where to look at a pool's chain;
``decide`` passes its answer through ``settle``, which says where each new segment goes
(from the free slots in the facts) and what a host that is back must cancel. A pool may be
one of a chain's several places (``pools``): a segment moved there is placed as it moves.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Optional

from chainrun.decide.facts import Facts
from chainrun.fields import format_duration
from chainrun.model import (
    WAITING_FOR_A_SLOT,
    Action,
    Chain,
    JobSpec,
    ListedJob,
    Move,
    Outcome,
    Phase,
    Remove,
    SchedulerSpec,
    Submit,
    Wait,
)


def held_back(active: Iterable[Chain]) -> set[str]:
    """The chains of sweeps with ``max_concurrent`` that wait to start: as many of a sweep's
    chains are under way (a segment submitted, not ended) as it allows, the first ones
    (by creation, then id) that have not started counted in."""
    room: dict[str, int] = {}
    waiting: dict[str, list[Chain]] = {}
    for chain in active:
        limit, sweep = chain.spec.max_concurrent, chain.spec.sweep_name
        if limit is None:
            continue
        room[sweep] = room.get(sweep, limit) - bool(chain.segments)
        if not chain.segments:
            waiting.setdefault(sweep, []).append(chain)
    held: set[str] = set()
    for sweep, chains in waiting.items():
        chains.sort(key=lambda c: (c.created_at, c.id))
        held.update(c.id for c in chains[max(0, room[sweep]) :])
    return held


def as_array_task(chain: Chain, sub: Submit, arrays: bool) -> bool:
    """A sweep's first segment, on a backend with job arrays, goes out as an array task."""
    return sub.n == 1 and bool(chain.spec.sweep_name) and arrays


def uses_slot(job: ListedJob) -> bool:
    """Whether a job takes one of its host's slots: running, or ready to run (a job waiting
    for its predecessor takes that one's slot, so it is not counted)."""
    return job.phase is Phase.RUNNING or (job.phase is Phase.PENDING and job.reason != "Dependency")


def free_slots(slots: int, jobs: Iterable[ListedJob], placed: int) -> int:
    """A pool host's slots not in use by its jobs nor taken by the ``placed`` segments of this tick."""
    return slots - sum(1 for job in jobs if uses_slot(job)) - placed


def to_place(chain: Chain, sub: Submit) -> bool:
    """Whether a pool's segment is placed on a host now: a new one with no predecessor (a
    successor queues behind its predecessor, on its host; one journaled already keeps the
    host it was journaled on)."""
    return (
        bool(chain.spec.scheduler.hosts) and sub.after is None and all(s.n != sub.n for s in chain.segments)
    )


def place(
    hosts: Sequence[str], previous: Optional[str], free: Mapping[str, int], shared: bool = True
) -> Optional[str]:
    """The pool host for a chain's next segment, from each reachable host's free slots
    (``free``; a host missing there did not answer): the host it ran on before when that
    one has a free slot, else (only when the workdir is ``shared``: the checkpoint is
    reachable from every host) the one with the most free slots (the first listed, on a
    tie); None when no host may take it now."""
    if previous is not None and free.get(previous, 0) > 0:
        return previous
    if previous is not None and not shared:
        return None  # its checkpoint is on that host's disk alone
    best = max(hosts, key=lambda h: free.get(h, 0), default=None)
    return best if best is not None and free.get(best, 0) > 0 else None


def pools(spec: JobSpec) -> tuple[SchedulerSpec, ...]:
    """The pools a chain's segments may be placed in: its own scheduler's, when it is at one,
    and each of its places that is one (each pool host is polled, its free slots counted)."""
    found = [s for s in (spec.scheduler, *(p.scheduler for p in spec.places)) if s.hosts]
    return tuple(dict.fromkeys(found))


def moved_to(chain: Chain, move: Move, free: Mapping[str, int]) -> Optional[Move]:
    """A move as it is made: to a pool, placed on one of its hosts with a free slot (the one
    the chain ran on there before, when free: the copy goes to whichever it is, so any may
    take it); None when none has one now (not moved: the chain chooses again)."""
    hosts = chain.spec.at(move.place).scheduler.hosts
    if not hosts:
        return move
    host = place(hosts, chain.host_at(move.place), free, shared=True)
    return None if host is None else replace(move, host=host)


def unplaced(chain: Chain) -> bool:
    """A pool's chain with no segment under way: its next segment may go to any of its hosts."""
    return bool(chain.spec.scheduler.hosts) and not chain.live


def shared(chain: Chain) -> bool:
    """Whether a pool chain's checkpoint is reachable from every host (its workdir was found
    shared at submit), so that it may move: else it keeps to the host it ran on."""
    return chain.spec.scheduler.workdir_shared is True


def observed_on(chain: Chain, reached: Collection[str]) -> Optional[str]:
    """Where a pool's chain with no live segment is looked at this tick: the host it ran on
    last (its checkpoint may be on that host's disk), else the first of its hosts that
    answered; None when none did (it waits, like any chain whose cluster did not answer),
    or when its checkpoint is on a host that did not answer (``stranded``)."""
    if stranded(chain, reached):
        return None
    return next((h for h in [chain.host, *chain.spec.scheduler.hosts] if h in reached), None)


def stranded(chain: Chain, reached: Collection[str]) -> bool:
    """A pool chain whose checkpoint is on the disk of a host that did not answer."""
    return not shared(chain) and chain.placed is not None and chain.placed not in reached


def gone(since: float, timeout: float, now: float) -> bool:
    """Whether a host that has not answered since ``since`` is gone: its running segments
    are lost (a dead machine is not the training's fault: they cost nothing)."""
    return now - since >= timeout


def gone_reason(host: str, timeout: float) -> str:
    """Why a gone host's segments ended."""
    return (
        f"host {host} has not answered for {format_duration(int(timeout))} (host_timeout); "
        f"its run is lost, at no cost"
    )


def fenced(chain: Chain, host: str, tagged: Mapping[int, Sequence[ListedJob]]) -> list[tuple[int, str]]:
    """Jobs a pool host that is back still lists as not ended, of segments that were ended
    as lost there while it was gone: they must not run on beside the chain, which has gone
    on elsewhere (a host cut off, not dead). Each with its segment's number, to cancel."""
    lost = {s.n for s in chain.segments if s.host == host and s.outcome is Outcome.LOST and not s.phase.live}
    return [(n, j.job_id) for n in sorted(lost) for j in tagged.get(n, ()) if j.phase is not Phase.ENDED]


def observe_on(
    chain: Chain, reached: Collection[str], silent_since: Optional[float], now: float
) -> Optional[tuple[str, Optional[str]]]:
    """Where a pool's chain is looked at this tick, from the hosts that answered (``reached``)
    and since when its own host has not (``silent_since``; None: it answered). ``(host,
    None)``: its facts are read there. ``(host, why)``: it is looked at from another host
    than its own, with ``why`` its live segments are lost (its host is ``gone``), or ""
    for one with none whose checkpoint is on a host that did not answer (it waits, saying
    so). None: not this tick (it waits, like any chain whose cluster did not answer)."""
    sched = chain.spec.scheduler
    first = next((h for h in sched.hosts if h in reached), None)
    if chain.live:
        own = chain.host or ""
        if own in reached:
            return own, None
        if first is None or silent_since is None or not gone(silent_since, sched.host_timeout, now):
            return None
        return first, gone_reason(own, sched.host_timeout)
    home = observed_on(chain, reached)
    if home is not None:
        return home, None
    if stranded(chain, reached) and first is not None:
        return first, ""
    return None


def settle(chain: Chain, facts: Facts, actions: list[Action]) -> list[Action]:
    """``actions`` as a tick carries them out: a sweep's first segment as an array task where
    the cluster takes arrays; a pool's new segment on a host with a free slot
    (``facts.free``), or, with none, not submitted and a ``Wait`` that says why; a move to a
    pool on a host with a free slot (``moved_to``), or, with none, not made and a ``Wait``;
    and, first,
    a ``Remove`` of each job a pool host that is back still runs of a segment ended as lost
    there (``fenced``), so that the cancel is in the chain's history."""
    sched = chain.spec.scheduler
    settled: list[Action] = [
        Remove(
            n, job_id, f"segment {n} was ended as lost while host {host} was away; the chain went on", host
        )
        for host, tagged in facts.pool_jobs.items()
        for n, job_id in fenced(chain, host, tagged)
    ]
    waiting = ""
    for action in actions:
        if isinstance(action, Submit) and as_array_task(chain, action, facts.arrays):
            action = replace(action, task=True)
        elif isinstance(action, Submit) and to_place(chain, action):
            host = place(sched.hosts, chain.placed, facts.free, shared(chain))
            if host is None:
                waiting = waiting_reason(chain, facts.free.keys())
                continue
            action = replace(action, host=host)
        elif isinstance(action, Move):
            moved = moved_to(chain, action, facts.free)
            if moved is None:
                hosts = chain.spec.at(action.place).scheduler.hosts
                waiting = f"{_slot_wait(hosts, facts.free.keys())} at {action.place}, where it moves next"
                continue
            action = moved
        settled.append(action)
    wait = waiting_change(chain, waiting)
    return settled if wait is None else [wait, *settled]


def waiting_reason(chain: Chain, reached: Collection[str]) -> str:
    """Why a pool's chain waits unsubmitted: no free slot on the hosts that answered, or its
    checkpoint is on a host that did not answer (the workdir is not shared)."""
    hosts = chain.spec.scheduler.hosts
    if stranded(chain, reached):
        return (
            f"waiting for host {chain.placed} to answer: the checkpoint is on its disk "
            "(the workdir is not shared by the pool)"
        )
    if chain.placed is not None and not shared(chain):
        hosts = (chain.placed,)
    return _slot_wait(hosts, reached)


def _slot_wait(hosts: Sequence[str], reached: Collection[str]) -> str:
    """Waiting for a free slot on those of ``hosts`` that answered (those ``reached``)."""
    up = [h for h in hosts if h in reached]
    down = [h for h in hosts if h not in up]
    text = f"waiting for a free slot on hosts {', '.join(up)}" if up else "waiting for a host to answer"
    return text + (f" ({', '.join(down)} not reached)" if down and up else "")


def waiting_change(chain: Chain, waiting: str) -> Optional[Wait]:
    """A chain that waits for a pool's slot (at a pool, or to move to one) says why
    (``waiting``), once; one that goes on again clears it."""
    if not pools(chain.spec) or chain.reason == waiting:
        return None
    if waiting or chain.reason.startswith(WAITING_FOR_A_SLOT):
        return Wait(waiting)
    return None
