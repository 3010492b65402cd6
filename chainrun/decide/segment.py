"""What a segment decides for itself while it runs: when its walltime began, the grace it
keeps, when the walltime signal goes to the command and when it is held, whether it runs at
all, and the exit status it leaves.

The segment runner (``chainrun.node.runner``) applies these in the job, where chainrun may not be
installed: this module and ``goal`` are shipped with it, so they import nothing but the
standard library. Pure, like every rule:
the runner reads the clock, the files and the signals, and passes them in.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from chainrun.decide.goal import finished_on_its_own, goal_reached

# A scheduler's signal up to this many seconds before walltime - grace is clock granularity:
# passed on. Slurm's --signal may come up to 60 s early (its limit checks are that coarse).
EARLY_SLACK = 2
# The adaptive grace the service writes to ``grace`` in the run directory (decide/grace.py).
_LEARNED = re.compile(r"^grace=([1-9][0-9]{0,6})$", re.MULTILINE)
# The leftovers of a command that ended on its own get SIGTERM, and SIGKILL this much later.
LEFTOVER_KILL_AFTER = 30
# SGE reschedules a job that exits 99 and puts one that exits 100 in error state.
_SCHEDULER_CODES = (99, 100)


def walltime_start(started: Optional[int], now: int, walltime: int) -> int:
    """When the job's walltime began: when the scheduler says it started the job (before a
    prolog ran and the runner began), unless it does not say, or says something impossible
    (in the future, or a whole walltime ago): then ``now``."""
    if started is None or started > now or started <= now - walltime:
        return now
    return started


def shorter_limit(granted: Optional[int], asked: int) -> Optional[int]:
    """The limit the scheduler granted, where it is one and shorter than the one ``asked``
    (``walltime = "MIN..MAX"``, Slurm's backfill); None otherwise: the segment counts from
    what it asked. The runner's clock and the chain's record both take it from here."""
    return granted if granted is not None and 0 < granted < asked else None


def all_ready(said: int, expected: int) -> bool:
    """Whether a segment's command takes the walltime signal: as many of its processes said
    so as in the latest segment before (``expected``), and at least one."""
    return said >= max(expected, 1)


def grace(default: int, adaptive: bool, learned: Optional[str]) -> int:
    """The seconds before the deadline the command gets the walltime signal: the job file's
    (``default``), or, without one in the job file (``adaptive``), the one the service made of
    the chain's earlier stops (``learned``: the ``grace`` file's text), at most the default."""
    found = _LEARNED.search(learned or "") if adaptive else None
    return min(default, int(found.group(1))) if found else default


@dataclass(frozen=True)
class Found:
    """The checkpoint as the runner finds it (the ``goal`` rule reads ``epoch`` and ``done``)."""

    epoch: Optional[int] = None
    step: Optional[int] = None
    saved_at: Optional[float] = None
    done: bool = False
    save_seconds: Optional[float] = None
    mtime: Optional[float] = None  # the newest file in the checkpoint directory


def skip_reason(
    n: int, final: bool, before: Optional[Mapping[str, str]], found: Found, target: Optional[int]
) -> str:
    """Why segment ``n`` runs nothing, or "" when it runs: a successor queued ahead never burns
    an allocation once the goal is met, also when it starts before the service has noticed.
    ``final``: the chain's final marker exists; ``before``: the end marker of segment ``n-1``
    (its fields), if there is one."""
    if final:
        return "the chain has already ended"
    if before is not None:
        if before.get("skipped") == "1":
            return f"segment {n - 1} found the goal already reached"
        epoch = before.get("ckpt_epoch", "")
        if ("ckpt_epoch" in before or target is None) and finished_on_its_own(
            0 if before.get("original") == "0" else None,
            bool(before.get("signal", "x")),
            int(epoch) if epoch.isdigit() else None,
            target,
        ):
            return f"segment {n - 1} finished on its own (exit 0 before its walltime)"
    if not goal_reached(found, target):
        return ""
    if found.done:
        return "the checkpoint says training is done"
    return f"epoch {found.epoch} already reached target_epoch {target}"


def pass_on(now: float, signal_at: float, *, already: bool, preempted: bool, held: bool, ready: bool) -> str:
    """What becomes of the walltime signal the scheduler sends (Slurm's ``--signal``): "" it
    goes to the command now; else why not. A command that once said it takes the signal
    (``held``) gets it only once it says so again (``ready``): a Python still importing would
    die of it. A signal that comes because the job is being preempted is never held."""
    if already:
        return "sent"  # ours, at its time, came first: never passed on twice
    if preempted:
        return ""
    if now < signal_at - EARLY_SLACK:
        return "early"
    if held and not ready:
        return "not ready"
    return ""


def timer(now: float, signal_at: float, deadline: float, *, held: bool, ready: bool) -> str:
    """The runner's own walltime signal: "wait" before ``signal_at``; "send" then (to a
    command that is ready, where it once said it would be: ``held``); "hold" while it is not
    ready yet; "never" once it is a second before the deadline and still not ready: the
    walltime's own kill ends it, as the signal would have."""
    if now < signal_at:
        return "wait"
    if not held or ready:
        return "send"
    return "hold" if now < deadline - 1 else "never"


def kill_due(now: float, deadline: float, wrapper_signals: bool, stop_by: Optional[float] = None) -> bool:
    """Where the scheduler's walltime kill reaches only the runner's process group, not the
    command's (SGE), the runner kills the command a second before it; and at ``stop_by``, the
    end of the grace a cancelled chain's command had to save in."""
    return (wrapper_signals and now >= deadline - 1) or (stop_by is not None and now >= stop_by)


def leftover_signal(signalled: bool, waited: float) -> str:
    """What the processes a command left running get once it has ended ("" nothing): after the
    walltime signal, nothing (a launcher the signal killed leaves its ranks still saving); after
    a command that ended on its own, SIGTERM at once and SIGKILL after ``LEFTOVER_KILL_AFTER``
    seconds, as a scheduler would at the job's end."""
    if signalled:
        return ""
    return "KILL" if waited >= LEFTOVER_KILL_AFTER else "TERM"


def exit_status(code: int) -> int:
    """What the job exits with for a command that exited ``code``: never a code the scheduler
    acts on (SGE's 99 and 100), which the end marker keeps as the original."""
    return 1 if code in _SCHEDULER_CODES else code


def wait_for_preemption(preempted: bool, signal: str) -> bool:
    """A preempted job waits for the scheduler to end or requeue it at the end of its grace
    time (SIGTERM): one that ended first would count as completed, and never be requeued."""
    return preempted and signal != "TERM"
