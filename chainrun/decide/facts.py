"""What ``decide`` is told of a chain each tick: plain facts the engine gathered, judged
by nobody yet."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional

from chainrun.model import NO_PROGRESS, Carried, EndMarker, ListedJob, Progress, Start, StartMarker


@dataclass(frozen=True)
class JobFacts:
    """What the engine learned of one job this tick, without judging it."""

    listed: Optional[ListedJob] = None  # as the scheduler's listing shows it; None: not in it
    end: Optional[EndMarker] = None  # the wrapper's end marker
    start: Optional[StartMarker] = None  # the wrapper's start marker
    # sacct/qacct, asked only for jobs gone from the view without a marker, or killed by a signal
    accounting: Optional[ListedJob] = None
    why_stuck: str = ""  # the scheduler's own words for a job held in an error state
    # Of a failed job's nodes, those the scheduler holds down now (``NodeStateProbe``).
    down: tuple[str, ...] = ()


@dataclass(frozen=True)
class Facts:
    """Everything ``decide`` needs to know about one chain now."""

    # By job id, the recorded jobs not ended that the engine looked at (one missing
    # here: nothing learned of it this tick).
    jobs: Mapping[str, JobFacts] = field(default_factory=dict)
    # Jobs the scheduler lists under the tag cr.CHAIN.N, by N: an interrupted
    # submission's job to adopt, or a second job of one segment to remove.
    tagged: Mapping[int, tuple[ListedJob, ...]] = field(default_factory=dict)
    # Job ids the start markers of segments being submitted name.
    found: Mapping[int, str] = field(default_factory=dict)
    # By N: segments that the segment before them queued while the service was away.
    carried: Mapping[int, Carried] = field(default_factory=dict)
    progress: Optional[Progress] = NO_PROGRESS  # the checkpoint now; None: unreadable
    # False for a sweep's chain not under way yet while max_concurrent of its chains are.
    may_start: bool = True
    # Why the pool host of the chain's live segments is gone (``placement.gone``): they are
    # lost, at no cost; "" while it answers.
    host_lost: str = ""
    # A pool's hosts that answered this tick: the free slots of each (what this tick placed
    # already taken off), and the jobs each lists of this chain, by N.
    free: Mapping[str, int] = field(default_factory=dict)
    pool_jobs: Mapping[str, Mapping[int, tuple[ListedJob, ...]]] = field(default_factory=dict)
    arrays: bool = False  # the chain's cluster queues job arrays
    # A chain with several places about to queue a segment: when each would start one, by
    # place name (empty: not asked this tick; the chain stays where it is).
    starts: Mapping[str, Start] = field(default_factory=dict)
