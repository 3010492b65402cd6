"""A warning before a week is lost: segments whose command spends most of its time starting.

A segment's start-up is the time from its job's start until every process of its command had
said it takes the walltime signal (``ready_at``: the helper's ``SegmentClock``, as the
segment runner saw it); the time it had to train is the time until the signal came. When
the last two segments that ran were each stopped by the signal after more than
``SLOW_START`` of that time went on starting (imports, data loading, a slow file system),
the chain spends most of its allocations starting: ``status``, ``run``, the web page and the
notification say so, with the numbers and what to change. A command that does not use the
helper says nothing of its start-up, and is never warned of. Pure, as the rest of ``decide``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from chainrun.model import Outcome, Segment
from chainrun.text import duration

SLOW_START = 0.5  # of the time before the signal
IN_A_ROW = 2


def starting(seg: Segment) -> Optional[tuple[float, float]]:
    """A segment stopped by the signal: how long its command took to start, and how long it
    had before the signal; None for any other, or where either is not known."""
    started, ready, signalled = seg.started_at, seg.ready_at, seg.signalled_at
    if seg.outcome is not Outcome.TIMEOUT or started is None or ready is None or signalled is None:
        return None
    window = signalled - started
    return (max(0.0, ready - started), window) if window > 0 else None


def slow_start(segments: Sequence[Segment]) -> str:
    """Why the chain's segments barely train, if the last ``IN_A_ROW`` that ran (of
    ``segments``, in order) each spent more than ``SLOW_START`` of their time before the
    signal starting; "" otherwise."""
    ran = [s for s in segments if s.started_at is not None and s.outcome is not None][-IN_A_ROW:]
    found = [starting(s) for s in ran]
    if len(ran) < IN_A_ROW or any(f is None or f[0] <= SLOW_START * f[1] for f in found):
        return ""
    numbers = ", ".join(
        f"segment {s.n} {duration(f[0])} of {duration(f[1])}" for s, f in zip(ran, found) if f is not None
    )
    return (
        f"start-up takes most of each segment: the command was ready for the walltime signal only "
        f"after more than {SLOW_START:.0%} of the time before it ({numbers}); use a longer walltime, "
        "a smaller grace, or less work before the SegmentClock is made (imports, data loading)"
    )
