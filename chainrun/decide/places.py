"""One chain, several places (``[[cluster]]``): where its next segment goes, and when the
checkpoint must follow it there. Every function is pure.

A chain with several places is at one place at a time: the place of its newest segment that
is under way or was queued (``current``; before any, its first place), where all its live
segments are. Each next segment goes where it is expected to start soonest (``choose``,
from each place's ``Start``), a tie within ``SLACK`` to the place listed first. Staying,
the successor is queued one ahead as for any chain; moving, it is queued only once the
segment before it has ended (``decide``'s ``Move``), after its checkpoint was copied to the
new place (``copy_from``). A successor queued at a place that cannot start it soon, while
another can start one now, is cancelled (``leave``), so that the next goes there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Optional

from chainrun.fields import format_duration
from chainrun.model import NO_PROGRESS, Chain, JobSpec, Outcome, Phase, PlaceSpec, Progress, Segment, Start

SLACK = 60.0  # seconds within which two places' starts count as the same: preference decides
SOON = 600.0  # a queued successor's place that starts it later than this, while another starts now, is left
ASK_EVERY = 60.0  # seconds a chain's estimates are kept before the places are asked again
MOVE_TRIES = 3  # failed copies to a place before the chain chooses again


def current(segments: Sequence[Segment], places: Sequence[PlaceSpec]) -> Optional[str]:
    """The place a chain is at: its newest segment's that is under way or was queued (one
    that ended without a job, a move that never got there, does not count); its first place
    before any; None for a chain with one place."""
    if not places:
        return None
    for seg in sorted(segments, key=lambda s: s.n, reverse=True):
        if seg.phase.live or seg.job_id is not None:
            return seg.place or places[0].name
    return places[0].name


def copy_from(chain: Chain, seg: Segment) -> Optional[str]:
    """The place segment ``seg``'s checkpoint must be copied from before it is submitted at
    its own: where the newest segment before it that was queued ran (the first place before
    any), when that is another place and no copy was recorded yet; else None."""
    if not chain.spec.places or seg.copy_digest is not None or seg.copy_seconds is not None:
        return None
    before = [s for s in chain.segments if s.n < seg.n and s.job_id is not None]
    source = current(before, chain.spec.places)
    here = seg.place or chain.spec.places[0].name
    if source is None or source == here:
        return None
    return None if shared(chain.spec.at(source), chain.spec.at(here)) else source


def saved(chain: Chain) -> Optional[Progress]:
    """The newest progress a chain's checkpoint is known to hold (found there at submit, or
    seen since); None when it never held any. A chain that saved must find its checkpoint
    at the place it moves from: it never starts from nothing at the new place."""
    newest = max((chain.baseline, chain.progress, chain.latest), key=lambda p: p.key)
    return newest if newest.key > NO_PROGRESS.key else None


def shared(a: JobSpec, b: JobSpec) -> bool:
    """Whether two places' checkpoint directories are one directory (a file system both
    reach, as found at submit: the same real path, seen from a machine of both; else the
    same path on the same host): nothing to copy between them. A pool whose workdir is not
    one directory on all its hosts shares it with no other place: each host has its own."""
    if any(s.scheduler.hosts and s.scheduler.workdir_shared is not True for s in (a, b)):
        return False
    if a.checkpoint_real and b.checkpoint_real:
        seen = set(a.checkpoint_machines) & set(b.checkpoint_machines)
        return a.checkpoint_real == b.checkpoint_real and bool(seen)
    return (a.scheduler.host, a.checkpoint_dir) == (b.scheduler.host, b.checkpoint_dir)


def copy_host(chain: Chain, source: str) -> Optional[str]:
    """Where a copy from place ``source`` reads the checkpoint: at a pool, on the host its
    newest segment there ran on (the checkpoint is on that host's disk, or reachable there),
    else the host that held it at submit, or its first; elsewhere on the place's host (None:
    this machine)."""
    there = chain.spec.at(source).scheduler
    return (chain.host_at(source) if there.hosts else None) or there.first_host


def pool_start(chain: Chain, place: str, answers: Mapping[str, Start]) -> Start:
    """When pool ``place`` would start the chain's next segment, from what each of its hosts
    answered (a host not reached is not in ``answers``): as soon as its soonest host, named
    (the first listed on a tie); for a chain at that pool whose checkpoint is on one host's
    own disk (its workdir not shared), as soon as that host. None: it cannot start it, with
    each host's reason."""
    sched = chain.spec.at(place).scheduler
    if place == chain.spec.place_name and sched.workdir_shared is not True and chain.placed is not None:
        answers = {host: start for host, start in answers.items() if host == chain.placed}
    able = [(host, start) for host, start in answers.items() if start.at is not None]
    if able:
        host, start = min(able, key=lambda a: a[1].key)
        return Start(start.at, f"on {host}: {start.reason}")
    why = "; ".join(f"{host}: {start.reason}" for host, start in answers.items())
    return Start(None, f"no host of the pool can start it ({why or 'none answered'})")


def asks(chain: Chain) -> bool:
    """Whether a chain with several places may queue a segment this tick, so that its places
    are asked when they would start one: any such chain but one whose submission is under
    way. (One with a segment running and its successor queued queues the next in the tick
    that sees the running one end; a queued one may be left for a place that starts it.)"""
    return bool(chain.spec.places) and all(s.phase is not Phase.SUBMITTING for s in chain.live)


def choose(places: Sequence[PlaceSpec], starts: Mapping[str, Start]) -> Optional[str]:
    """The place that starts a segment soonest (a tie within ``SLACK`` goes to the one listed
    first); None when no place was asked (``starts`` empty) or none can start one."""
    able = [(p.name, starts[p.name].at) for p in places if p.name in starts and starts[p.name].at is not None]
    if not able:
        return None
    soonest = min(at for _, at in able if at is not None)
    return next(name for name, at in able if at is not None and at <= soonest + SLACK)


def when(start: Optional[Start], now: float) -> str:
    """When a place would start a segment, in words that follow its name."""
    if start is None:
        return "was not asked"
    if start.at is None:
        return f"cannot start it ({start.reason or 'no reason given'})"
    if start.reason:  # the place's own words: "starts now (...)", "about 14:05, in 2h (...)"
        return start.reason
    if start.at <= now + SLACK:
        return "starts it now"
    return f"would start it in {format_duration(int(start.at - now))}"


def move_reason(chain: Chain, place: str, starts: Mapping[str, Start], now: float) -> str:
    """Why the next segment goes to ``place`` rather than where the chain is."""
    here = chain.spec.place_name
    return f"{place} {when(starts.get(place), now)}; {here} {when(starts.get(here), now)}"


def leave(chain: Chain, starts: Mapping[str, Start], now: float) -> Optional[str]:
    """The place to leave a queued successor for: it waits at a place that cannot start it
    within ``SOON`` while another starts one now; None to keep it."""
    chosen = choose(chain.spec.places, starts)
    here = chain.spec.place_name
    if chosen is None or chosen == here:
        return None
    mine, there = starts.get(here), starts[chosen]
    soon = mine is not None and mine.at is not None and mine.at <= now + SOON
    return chosen if not soon and there.at is not None and there.at <= now + SLACK else None


def refused(chain: Chain) -> dict[str, str]:
    """The places whose scheduler refused a segment of the chain for good (its submission
    rejected: an account closed, a partition gone since the estimate), each with why. A chain
    with several goes on at the others; one with one place, or refused at every place, ends."""
    first = chain.spec.places[0].name if chain.spec.places else ""
    return {s.place or first: s.reason for s in chain.segments if s.outcome is Outcome.REJECTED}


def refused_everywhere(chain: Chain) -> Optional[str]:
    """Why the chain cannot go on because its submissions were refused: the first refusal of a
    chain with one place, the refusals of every place of one with several; None while a place
    has not refused it."""
    why = refused(chain)
    if not why:
        return None
    if not chain.spec.places:
        return next(iter(why.values()))
    if len(why) < len(chain.spec.places):
        return None
    return "every place refused it: " + "; ".join(f"{p.name}: {why[p.name]}" for p in chain.spec.places)


def without_refused(chain: Chain, starts: Mapping[str, Start]) -> Mapping[str, Start]:
    """The places' answers with each place that refused the chain for good answering that it
    cannot start it (whatever its estimate said), so that it is never chosen again."""
    why = refused(chain)
    if not why or not starts:
        return starts
    return {
        **starts,
        **{place: Start(None, f"refused it for good: {reason}") for place, reason in why.items()},
    }
