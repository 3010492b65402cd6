"""What a segment's end costs: whether it is charged against the failure budget, and the
words for it; and the ends that stop a chain at once (a command that could never start, a
crash that repeats unchanged before any progress). Pure, as the rest of ``decide``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from chainrun import container
from chainrun.decide.facts import JobFacts
from chainrun.model import NO_PROGRESS, Chain, JobSpec, Outcome, Progress, Segment
from chainrun.text import one_line

# Where the docs tell how to keep the walltime signal from killing a script still importing.
CLOCK_FIRST = 'docs/resuming.md "Make the clock first when the start is slow"'


@dataclass(frozen=True)
class Ending:
    """How a job ended, from the best evidence there is."""

    outcome: Outcome
    exit_code: Optional[int]
    started_at: Optional[float]
    ended_at: Optional[float]
    reason: str
    remove: bool = False  # still held by the scheduler (stuck): remove it
    died_of: str = ""  # the signal (USR1) that killed the command, as the end marker says
    # The command had said it was ready for the signal before, not this time (EndMarker.ready "0").
    held_back: bool = False


def intact(end: Progress, start: Progress) -> Optional[Progress]:
    """The checkpoint a segment left, when it holds progress and is not behind the one the
    segment started from; None otherwise."""
    return end if NO_PROGRESS.key < end.key and start.key <= end.key else None


def charge(
    ending: Ending, advanced: bool, finished: bool, goal_met: bool, intact: Optional[Progress]
) -> tuple[bool, str]:
    """Whether a segment's end costs failure budget, and the words for it. ``intact``: the
    checkpoint the segment left, where it is readable and not behind the one it started from."""
    outcome = ending.outcome
    code = "" if ending.exit_code is None else f" (exit {ending.exit_code})"
    detail = f": {ending.reason}" if ending.reason else ""
    if goal_met and not advanced and outcome is Outcome.CANCELLED:
        # Cancelled because the goal was reached, by a service that died before
        # it could record the cancel: that was chainrun's own doing.
        return False, f"{outcome.value} after the goal was already reached{detail}"
    if outcome is Outcome.SKIPPED:
        return False, f"{outcome.value}, the goal already reached{detail}"
    if outcome is Outcome.FENCED:
        # A newer segment of the chain owns the checkpoint: this one was stopped by chainrun's
        # fence, never by the training's fault.
        return False, f"{outcome.value}{detail}: free"
    if outcome is Outcome.NODE_FAIL and intact is not None:
        # The machine's fault, not the command's, and nothing saved was lost: only the
        # time since the last save, which counts against total_time as any segment does.
        return False, f"{outcome.value}{code}{detail}; the checkpoint is intact ({intact.describe()}): free"
    if outcome.crashed:
        return True, f"{outcome.value}{code}{detail}"
    if outcome is Outcome.PREEMPTED:
        # The scheduler took the allocation back: not the training's fault, progress or not.
        made = "with progress" if advanced else "before any progress: not charged"
        return False, f"{outcome.value}{code} {made}{detail}"
    if finished:
        return False, f"{outcome.value}{code}: the command finished on its own"
    if goal_met and not advanced:
        return False, f"{outcome.value}{code} after the goal was already reached{detail}"
    if not advanced and ending.died_of:
        why = (
            "which never said it was ready for the walltime signal (held back until then: the command "
            "was still starting, or no longer makes its SegmentClock)"
            if ending.held_back
            else "before it saved anything, likely while it was still starting (imports, data) with "
            f"no handler set yet; see {CLOCK_FIRST}"
        )
        return (
            True,
            f"{outcome.value}{code} and made no progress: SIG{ending.died_of} killed the command {why}",
        )
    if not advanced:
        return True, f"{outcome.value}{code} and made no progress{detail}"
    return False, f"{outcome.value}{code} with progress{detail}"


def cannot_start(spec: JobSpec, ending: Ending, tail: tuple[str, ...]) -> bool:
    """The command was never started: not found or not executable (exit 126 or 127), or
    its container runtime could not start it (``container.start_failure``)."""
    if ending.outcome is not Outcome.FAILED:
        return False
    return ending.exit_code in (126, 127) or bool(container.start_failure(spec, ending.exit_code, tail))


def unrunnable(chain: Chain, seg: Segment, job: JobFacts, ending: Ending) -> str:
    """Why the chain's first run of the command could not start it (exit 126 or 127, or the
    container runtime's own failure: the image or the runtime missing where it ran), if so:
    every later segment would fail the same way, so the chain ends at once."""
    tail = job.end.tail if job.end is not None else ()
    if not cannot_start(chain.spec, ending, tail):
        return ""
    earlier = [s for s in chain.segments if s.n < seg.n]
    if any(s.outcome not in (Outcome.CANCELLED, Outcome.REJECTED) for s in earlier):
        return ""
    runtime = container.start_failure(chain.spec, ending.exit_code, tail)
    if runtime:
        return f"{runtime}; fix the image or runtime on the machine the segments run on, then submit again"
    path = job.end.path if job.end is not None and job.end.path else dict(chain.spec.inherited).get("PATH")
    where = f"PATH was {path}" if path else "PATH was the service's own"
    return (
        f"command not found or not executable (exit {ending.exit_code}): {chain.spec.command} ({where}); "
        "run it by hand in the workdir, or list what it needs in inherit_env or [env]"
    )


def crash(
    outcome: Optional[Outcome], exit_code: Optional[int], tail: tuple[str, ...]
) -> Optional[tuple[int, tuple[str, ...]]]:
    """A crash of the command itself, as what would show it repeat unchanged: its exit status
    and last output lines. None for an end the scheduler or the machine caused (timeout,
    preemption, OOM, node failure, a cancel, lost), for a command killed by a signal (the
    kernel's OOM killer, someone's kill: exit over 128), and for a crash with no output to
    compare: any of these may go another way next time."""
    if outcome is not Outcome.FAILED or exit_code is None or not 0 < exit_code < 128 or not tail:
        return None
    return exit_code, tail


def repeated(
    chain: Chain, n: int, crashes: Mapping[int, Optional[tuple[int, tuple[str, ...]]]], mark: Progress
) -> str:
    """Why segment ``n`` ends the chain, if it crashed exactly as the segment before it did
    (the same exit status and last output lines; or the one after it, where that ended first:
    a dependency the scheduler dropped) before the chain made any progress past the
    checkpoint it was submitted with: the command never ran here, and running it again would
    repeat that. After progress the budget applies as ever: the command did run, so a
    repeated crash may be the cluster's (a file system gone a while) or fixed meanwhile."""
    crash = crashes.get(n)
    if crash is None or mark.advanced_from(chain.baseline):
        return ""
    other = next((m for m in (n - 1, n + 1) if crashes.get(m) == crash), None)
    if other is None:
        return ""
    code, tail = crash
    first, then = sorted((n, other))
    output = " | ".join(one_line(line, 200) for line in tail)
    return (
        f"segment {then} failed (exit {code}) as segment {first} did, with the same output, before any "
        f"progress: running it again cannot help; fix it and submit the job file again. Output: {output}"
    )
