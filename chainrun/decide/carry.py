"""What a segment may do alone while the service is away: queue its own successor.

One successor is queued ahead, so the chain goes on through one walltime without the
service. For longer, the running segment's wrapper asks ``carry`` (through ``chainrun.carry``)
now and then, and once more when its command has ended: once the service has not been heard
from for longer than ``away_bound``, and no successor of this segment is queued, it queues
one, under the same tag as the service would, for the service to adopt when it returns
(``chain._adopt_carried``). The rule is deliberately smaller than ``decide``'s: never past
the target, the final marker, the time budget or the segment count; the failures the
service recorded, plus those the markers of the segments since show (charged as ``decide``
charges them, ``charge_by_markers``), plus the running segment's own should it fail, stay
within ``max_failures``, as for a successor queued ahead. What it leaves out (a crash that
repeats word for word, what accounting knows) ``decide`` applies when the service is back.

The service is heard from by its beat in the chain's run root (``chainrun.carry.beat_path``),
which it writes each tick on the cluster's file system, through the transport that writes
the chain's scripts. Its age is the beat file's mtime against the node's clock. Older than
the bound: the service is away. Missing or unreadable (a file system fault, or a service
too old to write it, since the service writes it before any segment can start): the service
is taken to be there, and the segment never queues its successor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from chainrun.decide.chain import charge_by_markers, next_walltime
from chainrun.decide.facts import JobFacts
from chainrun.decide.goal import finished_on_its_own, goal_reached
from chainrun.fields import format_duration
from chainrun.model import Carried, JobSpec, Progress, Submit

AWAY_CAP = 300.0  # a few minutes: the longest the service may be silent before a segment acts
TICKS_AWAY = 3  # ...and never less than this many of the service's ticks
ASK_EVERY = 30.0  # the longest wait between two questions of a segment
DEADLINE_MARGIN = 10.0  # an ended segment acts this long before its walltime ends, at the latest
# A successor's claim that names no job this long after it was made (the longest a submission
# may take, 120 s, and a minute): its claimant stopped before it queued anything.
STALE_CLAIM = 180.0


@dataclass(frozen=True)
class Recorded:
    """The chain as the service recorded it when it last submitted (the run directory's
    ``carry.json``): segments up to ``through`` are judged there."""

    through: int
    failures: int
    used: float
    mark: Progress  # the progress when segment ``through`` ended


@dataclass(frozen=True)
class SegmentView:
    """What a segment's wrapper can read in the run directory, for ``carry``."""

    spec: JobSpec
    n: int  # the asking segment
    job_id: str  # its job: the successor's dependency
    known: Recorded
    # The markers of segments ``known.through + 1`` .. ``n``, in order (the asking one's end
    # marker absent while its command runs).
    since: Sequence[JobFacts]
    progress: Progress  # the checkpoint now
    final: bool  # the chain has ended (the final marker)
    heard_at: Optional[float]  # the service's last beat in the run root; None: missing or unreadable
    interval: Optional[float] = None  # the service's tick interval, as its heartbeat says
    deadline: Optional[float] = None  # when the asking segment's walltime ends
    ended: bool = False  # the asking segment's command has ended (its end marker written)


@dataclass(frozen=True)
class CarryAnswer:
    """``submit``: queue it now; else ask again in ``again`` seconds (None: never, for
    this segment); ``reason`` in words either way."""

    submit: Optional[Submit]
    again: Optional[float]
    reason: str


def applies(spec: JobSpec) -> bool:
    """Whether a chain's segments may queue their successors: not when the job file says
    ``self_queue = false``, the probes at submit found that the nodes cannot submit or that
    the carrier does not run there, and not where the service alone can place a segment
    (a pool, a remote workstation's local runner)."""
    return not off_because(spec)


def off_because(spec: JobSpec) -> str:
    """Why a chain's segments never queue their successors; "" when they may."""
    if not spec.self_queue:
        return "self_queue = false"
    if spec.nodes_cannot_submit:
        return f"the cluster's nodes cannot submit jobs: {spec.nodes_cannot_submit}"
    if spec.carrier_cannot_run:
        return spec.carrier_cannot_run
    if spec.scheduler.hosts:
        return "a pool's segments are placed on its hosts by the service alone"
    if spec.scheduler.remote and spec.scheduler.kind == "local":
        return "a remote workstation's local runner takes its jobs from the service alone"
    return ""


def carry_line(spec: JobSpec) -> str:
    """What ``submit``, ``status`` and the web page say of a chain that may not carry itself
    ("" for one that may)."""
    off = off_because(spec)
    return (
        f"self-queueing off ({off}): after one walltime without the service, the chain waits for it"
        if off
        else ""
    )


def abandoned(held: Optional[Carried], age: Optional[float]) -> bool:
    """Whether another claimant's claim on a successor (``held``; None: it does not read) made
    ``age`` seconds ago (None: gone meanwhile) may be taken over: it names no job, and its
    claimant has had longer than a submission takes."""
    return (held is None or not held.job_id) and (age is None or age >= STALE_CLAIM)


def away_bound(spec: JobSpec, interval: Optional[float]) -> float:
    """How long the service may be silent before a segment queues its own successor: the
    smaller of a few minutes and half a walltime, and at least a few of its ticks."""
    return max(min(AWAY_CAP, spec.walltime / 2), TICKS_AWAY * (interval or 0.0))


def carry(alone: SegmentView, now: float) -> CarryAnswer:
    """Whether segment ``alone.n`` queues its successor now, and why (not)."""
    spec = alone.spec
    off = off_because(spec)
    if off:
        return CarryAnswer(None, None, f"self-queueing is off ({off})")
    if alone.final:
        return CarryAnswer(None, None, "the chain has ended")
    if alone.heard_at is None:
        # Not "never heard": the service writes its beat in the run root before the first
        # segment can start, so a beat missing or unreadable beside a readable record is a
        # fault of the file system (or of a service too old to write it), not a silence.
        # Queueing then could race a service that ticks.
        return CarryAnswer(
            None,
            None,
            "no beat of the service can be read in the run root: the service queues the next segment",
        )
    waiting = _silence(alone, now)
    if waiting is not None:
        return waiting
    silent = now - alone.heard_at
    failures, used, mark = alone.known.failures, alone.known.used, alone.known.mark
    running = not alone.ended  # then the asking segment may still fail, and use its walltime
    for i, job in enumerate(alone.since):
        judged = charge_by_markers(job, mark)
        if judged is None and running and i == len(alone.since) - 1:
            break  # the asking segment, still running
        if judged is None:  # ended without a trace (a node lost, say): the worst
            charged, elapsed = True, float(spec.walltime)
        else:
            charged, mark, elapsed = judged
            if _finished(spec, job):
                return CarryAnswer(None, None, "the command finished on its own")
        failures += charged
        used += elapsed
    if running:
        used += spec.walltime
    best = alone.progress if alone.progress.key > mark.key or alone.progress.done else mark
    if goal_reached(best, spec.target_epoch):
        return CarryAnswer(None, None, f"the goal is reached ({best.describe()})")
    if failures + running > spec.max_failures:
        return CarryAnswer(
            None,
            None,
            f"{failures} failures{' (and this segment may fail)' if running else ''}; "
            f"max_failures = {spec.max_failures}: the service decides when it is back",
        )
    if alone.n + 1 > spec.max_segments:
        return CarryAnswer(None, None, f"segment {alone.n + 1} would pass the {spec.max_segments} segments")
    walltime = next_walltime(spec, spec.total_time - used)
    if walltime is None:
        return CarryAnswer(None, None, f"the time budget is spent ({format_duration(used)} used)")
    return CarryAnswer(
        Submit(n=alone.n + 1, walltime=walltime, after=alone.job_id),
        None,
        f"service heard not for {format_duration(silent)}",
    )


def _silence(alone: SegmentView, now: float) -> Optional[CarryAnswer]:
    """None once the service has been silent long enough for the segment to act; else what
    to do meanwhile. While the command runs: ask again once the bound may have passed. Once
    it has ended (a crash, or the walltime signal), the segment cannot wait long: a service
    that ticks (its last tick within a few intervals) queues the next segment itself; one
    that missed its ticks is waited for up to the bound, never past the walltime."""
    bound = away_bound(alone.spec, alone.interval)
    assert alone.heard_at is not None
    if now - alone.heard_at >= bound:
        return None
    silent = now - alone.heard_at
    again = min(ASK_EVERY, bound - silent + 1)
    if not alone.ended:
        return CarryAnswer(None, again, "the service is there")
    if alone.interval is None or silent < TICKS_AWAY * alone.interval:
        return CarryAnswer(None, None, "the service is there: it queues the next segment")
    if alone.deadline is not None and now + (bound - silent) >= alone.deadline - DEADLINE_MARGIN:
        return None  # the walltime ends before the bound: the missed ticks must do
    return CarryAnswer(None, again, "the service missed its ticks")


def _finished(spec: JobSpec, job: JobFacts) -> bool:
    """Exit 0 before the walltime with no target, or no epoch to compare it with: the run
    is over (``decide`` ends such a chain completed)."""
    end = job.end
    return (
        end is not None
        and not end.skipped
        and finished_on_its_own(
            end.original, bool(end.signal), end.progress.epoch if end.progress else None, spec.target_epoch
        )
    )
