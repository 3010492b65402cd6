"""When to try again: a failed submission (backoff, or rejected for good), an array the
scheduler refuses (its chains go one by one), a chain whose ticks keep failing (stuck, and
tried again now and then), accounting that did not know a job yet (asked again after
growing intervals, and always in the tick that would find the job lost), and a cancel that
did not reach its scheduler (sent again once it answers, to the jobs it still lists; given
up after ``CANCEL_OWED_FOR``).

Every function is pure: the engine keeps what it needs across ticks and passes ``now``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Dict, Optional, Tuple  # noqa: UP035

from chainrun.decide.chain import lost_at
from chainrun.errors import ClaimedError, SchedulerError, TransportError, UnsafePathError
from chainrun.fields import format_duration
from chainrun.model import (
    Action,
    Adopt,
    Carried,
    Chain,
    ChainState,
    ListedJob,
    MarkStuck,
    Phase,
    Reject,
    Remove,
    RetryLater,
)

STUCK_AFTER = 3  # failing ticks in a row before a chain is marked stuck
STUCK_RETRY = 600.0  # seconds between tries of a stuck chain
ACCOUNTING_FIRST = 10.0  # seconds before accounting is asked again of a job it did not know
ACCOUNTING_MAX = 120.0  # the interval doubles up to this
# Seconds a cancel that did not reach its scheduler is sent again for, once it answers: a
# week covers a cluster's maintenance, and a host gone for good is not polled forever.
CANCEL_OWED_FOR = 7 * 86400.0

# Per job gone from the listing without an end marker that accounting did not know:
# when to ask again, and the interval after that.
# (typing's Dict and Tuple: the carrier runs on Python 3.8)
Unaccounted = Dict[str, Tuple[float, float]]  # noqa: UP006


def backoff(attempts: int) -> float:
    """Seconds before retrying a submission that failed ``attempts`` times."""
    return float(min(300, 5 * 2 ** max(0, attempts - 1)))


def after_submit(
    n: int, attempts: int, error: SchedulerError | TransportError | UnsafePathError | ClaimedError, now: float
) -> Action:
    """What the ``attempts``-th failed submission of segment ``n`` means: retry later,
    or rejected for good (the scheduler refused it, or its run directory is not safe). A
    segment another claimant holds (the segment before it, carrying the chain) is theirs:
    adopted once its claim names the job, looked at again until then."""
    if isinstance(error, ClaimedError):
        held = error.held if isinstance(error.held, Carried) else None
        who = (held.by if held is not None else "") or "the segment before it"
        if held is not None and held.job_id:
            return Adopt(n=n, job_id=held.job_id, how=f"queued by {who} (its claim)")
        return RetryLater(n=n, at=now + backoff(attempts), reason=f"{who} is queueing it (its claim)")
    if isinstance(error, UnsafePathError) or (isinstance(error, SchedulerError) and not error.transient):
        return Reject(n=n, reason=str(error))
    return RetryLater(n=n, at=now + backoff(attempts), reason=str(error))


def array_refused(error: SchedulerError) -> bool:
    """An array the scheduler refuses for good (a site's MaxArraySize below its size, say) is
    sent again as single jobs, so that each chain gets the scheduler's own verdict; a passing
    failure is retried as an array."""
    return not error.transient


def after_fault(
    chain: Chain, count: int, message: str, now: float
) -> tuple[Optional[float], Optional[MarkStuck]]:
    """A chain's tick failed ``count`` times in a row, the last with ``message``: when to try
    it again (None: next tick), and, the first time it has failed too often, marking it stuck."""
    if count < STUCK_AFTER:
        return None, None
    if chain.state is ChainState.STUCK:
        return now + STUCK_RETRY, None
    reason = f"{count} ticks in a row failed, the last with {message}; tried again every {STUCK_RETRY:.0f}s"
    return now + STUCK_RETRY, MarkStuck(reason)


def accounting_due(
    unknown: Sequence[str],
    killed: Sequence[str],
    waiting: Unaccounted,
    missing: Mapping[str, Optional[float]],
    now: float,
) -> list[str]:
    """The jobs to ask accounting about now: every one whose end marker says a signal killed
    the command (``killed``: asked once, as its segment ends now), and of those gone from
    the listing without a marker (``unknown``) each one not asked before, due again, or
    about to be lost (gone since ``missing``)."""
    return list(killed) + [
        job_id
        for job_id in unknown
        if job_id not in waiting or now >= waiting[job_id][0] or _lost_now(missing.get(job_id), now)
    ]


def _lost_now(missing_since: Optional[float], now: float) -> bool:
    return missing_since is not None and now >= lost_at(missing_since)


def accounting_again(job_id: str, waiting: Unaccounted, now: float) -> tuple[float, float]:
    """Accounting did not know ``job_id``: when to ask again, and the interval after that
    (doubling from ``ACCOUNTING_FIRST`` up to ``ACCOUNTING_MAX``)."""
    interval = min(2 * waiting[job_id][1], ACCOUNTING_MAX) if job_id in waiting else ACCOUNTING_FIRST
    return now + interval, interval


def owed_to_send(owed: Mapping[str, Tuple[int, str]], jobs: Mapping[str, ListedJob]) -> list[Remove]:  # noqa: UP006
    """The cancels owed on a cluster that now answers (job: its segment, and the name it was
    listed with) to send: to each job it still lists as not ended under that name (the
    others ended or are gone: owed nothing more; a job listed under another name took the
    id, once the cluster lost its state, and is not the one owed), as a ``Remove`` each, for
    its chain's history."""
    why = "its cancel did not reach the scheduler, which did not answer; sent again now that it answers"
    return [
        Remove(n, job_id, why)
        for job_id, (n, name) in owed.items()
        if job_id in jobs and jobs[job_id].phase is not Phase.ENDED and jobs[job_id].name == name
    ]


def owed_given_up(owed: Mapping[str, float], where: str, now: float) -> Dict[str, str]:  # noqa: UP006
    """Of the cancels owed on ``where`` (job: owed since), those given up now, owed for
    longer than ``CANCEL_OWED_FOR`` (a host gone for good): job, what its chain's history
    says of it."""
    return {
        job_id: (
            f"job {job_id}: its cancel has not reached {where} in {format_duration(CANCEL_OWED_FOR)} "
            "of trying; given up: if the job is still there, cancel it by hand"
        )
        for job_id, since in owed.items()
        if now - since > CANCEL_OWED_FOR
    }
