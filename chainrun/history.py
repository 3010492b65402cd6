"""``chainrun history``: a chain's events, every decision with its reason, then its segments'
times: how long each waited in the queue once it could start, how long it ran, and the
chain's training time when it ended, so that a gap between two timestamps never has to
be worked out by hand.

A segment's queue wait runs from when it could start (its submission, or for one queued
ahead, its predecessor's end) to its start; one that never started waited until it was
cancelled. Its running time runs from its start to its end; the training time after it
is the chain's running times added up to it (what ``status`` calls trained). The last
line counts the chain's preemptions: segments that ended preempted, and jobs the scheduler
preempted and requeued (each an event of kind "preempted").
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Optional

from chainrun.fields import format_duration
from chainrun.model import Chain, Outcome, Segment
from chainrun.store import Event

HEADER = ("SEGMENT", "JOB", "OUTCOME", "QUEUED", "RAN", "TRAINED")


def clock(at: float, date: bool = False) -> str:
    """A moment as local time: ``12:13:11``, with ``date`` ``2026-11-27 12:13:11``."""
    return datetime.fromtimestamp(at).strftime("%Y-%m-%d %H:%M:%S" if date else "%H:%M:%S")


def event_lines(events: Sequence[Event]) -> list[str]:
    return [f"{clock(ev.at, date=True)}  {ev.message}" for ev in events]


def waited(seg: Segment, before: Optional[Segment]) -> Optional[float]:
    """Seconds ``seg`` waited in the queue once it could start; None when that is not known
    (not submitted, or still waiting)."""
    if seg.submitted_at is None:
        return None
    ready = seg.submitted_at
    if seg.after is not None and before is not None:
        if before.ended_at is None:
            return None  # its predecessor still runs: it is not waiting for the queue yet
        ready = max(ready, before.ended_at)
    until = seg.started_at if seg.started_at is not None else seg.ended_at
    return None if until is None else max(0.0, until - ready)


def ran(seg: Segment) -> Optional[float]:
    """Seconds ``seg`` ran, once it has ended; None when it never started or still runs."""
    if seg.started_at is None or seg.ended_at is None:
        return None
    return max(0.0, seg.ended_at - seg.started_at)


def _outcome(seg: Segment) -> str:
    if seg.outcome is None:
        return seg.phase.value
    return seg.outcome.value + (", charged" if seg.charged else "")


def preemptions(chain: Chain, events: Sequence[Event]) -> tuple[int, int]:
    """How often the scheduler preempted the chain's jobs: in all, and of those how often
    it requeued the job instead of ending it."""
    requeued = sum(1 for ev in events if ev.kind == Outcome.PREEMPTED.value)
    ended = sum(1 for s in chain.segments if s.outcome is Outcome.PREEMPTED)
    return ended + requeued, requeued


def segment_lines(chain: Chain, events: Sequence[Event] = ()) -> list[str]:
    """The table of the chain's segments and their times, then the total."""
    rows = [HEADER]
    trained = queued = 0.0
    before: Optional[Segment] = None
    for seg in chain.segments:
        wait, time = waited(seg, before), ran(seg)
        trained += time or 0.0
        queued += wait or 0.0
        rows.append(
            (
                str(seg.n),
                seg.job_id or "-",
                _outcome(seg),
                "-" if wait is None else format_duration(wait),
                "-" if time is None else format_duration(time),
                format_duration(trained) if time is not None else "-",
            )
        )
        before = seg
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    count = sum(1 for s in chain.segments if ran(s) is not None)
    total, requeued = preemptions(chain, events)
    again = f" ({requeued} requeued)" if requeued else ""
    lines.append(
        f"trained {format_duration(chain.used)} of {format_duration(chain.spec.total_time)}"
        f" in {count} segment{'' if count == 1 else 's'}; waited {format_duration(queued)} in the queue;"
        f" preempted {total} time{'' if total == 1 else 's'}{again}"
    )
    return lines
