"""The grace: how long before its walltime a segment gets the signal to save and stop.

A job file's own ``grace`` is kept. Without one, the segments get the default
(``schema.default_grace``: a quarter of the walltime, at most 5 minutes) until the chain has
seen its command stop; from then on, twice the longest stop seen, at least ``FLOOR``, at most
the default, and never less than half the grace before: one segment's stop brings it down
one halving at most, so a lucky stop (a script that saves at the end of its epoch, signalled
just before one) is not learned at once, and the longest of several decides. A segment's
stop is what its end marker says: the seconds from the walltime signal to the command's end,
or its last save (the sidecar's ``save_seconds``), the longer. A
segment that the walltime's kill ended before it stopped needed more than it had: the default
again. The wrapper sends the signal by its own timer at walltime minus the grace it reads
(``grace`` in the run directory, written when this changes), so a scheduler's coarse warning
(Slurm checks its limits twice a minute) does not set the floor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Optional

from chainrun.fields import format_duration
from chainrun.model import Action, Chain, EndMarker, EndSegment, JobSpec, Outcome, Segment, SetGrace

FLOOR = 10  # seconds: a stop seen once may take longer next time (a busy file system)
FACTOR = 2
DEFAULT = "the default, a quarter of the walltime at most 5m"


@dataclass(frozen=True)
class Grace:
    """The grace segments get now, and where it came from."""

    seconds: int
    source: str

    def describe(self) -> str:
        return f"{format_duration(self.seconds)} ({self.source})"


def rule(spec: JobSpec) -> str:
    """How the chain's segments get their grace, in words (``check``)."""
    if not spec.adaptive_grace:
        return f"{format_duration(spec.grace)}, {_fixed(spec).source}"
    return (
        f"adaptive: {format_duration(spec.grace)} ({DEFAULT}) until a segment is seen stopping, then "
        f"{FACTOR} x the longest stop seen, at least {format_duration(min(FLOOR, spec.grace))} and half "
        f"the grace before, at most {format_duration(spec.grace)}"
    )


def stop_seen(spec: JobSpec, end: Optional[EndMarker], outcome: Outcome) -> Optional[float]:
    """The seconds an ended segment needed to stop, as far as it showed; None: it showed none."""
    if end is None:
        # The scheduler's kill ended it with no word from the wrapper: a save cut short.
        return float(spec.grace) if outcome is Outcome.TIMEOUT else None
    if end.skipped:
        return None
    stop = end.stop_seconds
    if stop is not None and end.grace is not None and stop >= end.grace - 1:
        return float(spec.grace)  # it was still stopping when the walltime's kill came
    seen = [s for s in (stop, end.save_seconds) if s is not None]
    return max(seen) if seen else None


def grace_in_force(spec: JobSpec, segments: Iterable[Segment]) -> Grace:
    """The grace the next segment gets, and why."""
    if not spec.adaptive_grace:
        return _fixed(spec)
    grace = Grace(spec.grace, f"{DEFAULT}, until a segment is seen stopping")
    longest: Optional[tuple[float, int]] = None
    for seg in sorted(segments, key=lambda s: s.n):
        if seg.stop is not None:
            longest = max(longest or (seg.stop, seg.n), (seg.stop, seg.n))
            grace = _after(spec, grace.seconds, *longest)
    return grace


def _fixed(spec: JobSpec) -> Grace:
    """The grace of a job file that sets its own, or whose signal is SIGTERM."""
    if spec.signal == "TERM":
        return Grace(spec.grace, "fixed: SIGTERM is never held back, it may be a preemption")
    return Grace(spec.grace, "set in the job file")


def _after(spec: JobSpec, before: int, longest: float, n: int) -> Grace:
    """The grace once a segment has stopped: from the longest stop seen (``longest``, by
    segment ``n``) and the grace before it."""
    wanted = math.ceil(FACTOR * longest)
    halved = math.ceil(before / 2)
    seen = f"the longest stop seen ({longest:.1f}s, segment {n})"
    seconds = min(spec.grace, max(FLOOR, wanted, halved))
    if seconds == spec.grace:
        return Grace(seconds, f"{DEFAULT}, as {FACTOR} x {seen} is no shorter")
    if seconds == FLOOR:
        return Grace(seconds, f"the floor, as {FACTOR} x {seen} is no longer")
    if seconds == halved and halved > wanted:
        return Grace(
            seconds,
            f"half the grace before, {format_duration(before)}: it comes down one halving a segment "
            f"towards {FACTOR} x {seen}",
        )
    return Grace(seconds, f"{FACTOR} x {seen}")


def change(chain: Chain, actions: list[Action]) -> list[Action]:
    """The grace later segments get, when the stops of the segments that just ended (among
    ``actions``) change it."""
    stops = {a.n: a.stop for a in actions if isinstance(a, EndSegment) and a.stop is not None}
    if not stops:  # a fixed grace is the same before and after: only a cost saved
        return []
    before = grace_in_force(chain.spec, chain.segments)
    after = grace_in_force(chain.spec, [replace(s, stop=stops.get(s.n, s.stop)) for s in chain.segments])
    return [SetGrace(after.seconds, after.source)] if after.seconds != before.seconds else []
