"""When a segment would start at one place: the answer ``Cluster.expected_start`` gives.

A chain with several places sends its next segment where it starts soonest, then by
preference (issue 39). Each place answers with a ``Start``: a time, or None when it cannot
start the segment now (its controller does not answer, its partition or queue is down, it
refuses the segment's shape). The backends build the answer through the few constructors
here, so every place says "now", "about then" and "not known when" alike:

- within ``NOW_SLACK`` of now is "starts now", at ``now`` exactly, so that two places that
  could both start it at once tie and preference decides;
- a place that could start it later but cannot say when (an SGE queue full of jobs without
  a run-time limit) is taken to start ``UNKNOWN_WAIT`` from now: later than "now" and than
  a wait a scheduler reckons within a day, sooner than a place that cannot start it at all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from chainrun.text import duration

NOW_SLACK = 60.0  # a start this close to now is "now" (Slurm answers now + 1 s)
UNKNOWN_WAIT = 86400.0  # "later, not known when" ranks as a day's wait


@dataclass(frozen=True)
class Start:
    """When a segment would start at one place (epoch seconds; None: it cannot start there
    now), and why, in one line."""

    at: Optional[float]
    reason: str

    @property
    def key(self) -> tuple[bool, float]:
        """Sorts soonest first, every place that cannot start it last."""
        return (self.at is None, self.at if self.at is not None else 0.0)


def starts_now(now: float, detail: str) -> Start:
    return Start(now, f"starts now ({detail})")


def expected(at: float, now: float, how: str) -> Start:
    """A start a scheduler reckons for ``at``, "now" when that is within ``NOW_SLACK``."""
    if at - now <= NOW_SLACK:
        return starts_now(now, how)
    clock = time.strftime("%H:%M" if at - now < 86400 else "%Y-%m-%d %H:%M", time.localtime(at))
    return Start(at, f"about {clock}, in {duration(at - now)} ({how})")


def unknown(now: float, why: str) -> Start:
    """It could start later, but nothing tells when."""
    return Start(now + UNKNOWN_WAIT, f"later, not known when ({why})")


def cannot(reason: str) -> Start:
    """It cannot start there now: down, refused, not answering."""
    return Start(None, reason)
