"""The chain state machine: facts in, actions out.

``decide`` is pure: it takes a chain as stored, what the scheduler says about
the chain's jobs, what the checkpoint says, and the time, and returns the
actions that bring the chain forward. It does no I/O and reads no clock, so
every rule of DESIGN.md "Chain rules" is pinned by table-driven tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from chainrun.jobfile import format_duration
from chainrun.model import (
    Action,
    Cancel,
    Chain,
    ChainState,
    EndSegment,
    Finish,
    Observation,
    Outcome,
    Phase,
    Progress,
    Segment,
    Submit,
)


@dataclass(frozen=True)
class _End:
    seg: Segment
    obs: Observation
    charged: bool
    why: str


def decide(
    chain: Chain,
    observations: Mapping[str, Observation],
    progress: Optional[Progress],
    now: float,
) -> list[Action]:
    """The actions that move ``chain`` forward; ``progress`` None means unreadable."""
    if chain.state.final:
        return []
    spec = chain.spec
    if chain.cancel_requested:
        return _finish(chain.live, ChainState.CANCELLED, "cancelled by user")

    rejected = next((s for s in chain.segments if s.outcome is Outcome.REJECTED), None)
    if rejected is not None:
        return _finish(chain.live, ChainState.FAILED, rejected.reason)

    current = progress if progress is not None else chain.progress
    mark = chain.progress
    failures, used = chain.failures, chain.used
    actions: list[Action] = []
    ends: list[_End] = []
    # A successor that starts after the goal exits at once ("skipped"): free.
    goal_met = bool(_done_reason(chain, mark, []))
    for seg in sorted(chain.live, key=lambda s: s.n):
        obs = observations.get(seg.job_id) if seg.job_id else None
        if obs is None or obs.phase is not Phase.ENDED:
            continue
        assert obs.outcome is not None, "an ended observation carries its outcome"
        advanced = current.advanced_from(mark)
        finished_on_its_own = (
            spec.target_epoch is None and obs.outcome is Outcome.COMPLETED and obs.exit_code == 0
        )
        charged, why = _charge(seg, obs, advanced, finished_on_its_own, goal_met)
        elapsed = _elapsed(seg, obs, now)
        actions.append(
            EndSegment(
                n=seg.n,
                outcome=obs.outcome,
                exit_code=obs.exit_code,
                charged=charged,
                elapsed=elapsed,
                ended_at=obs.ended_at or now,
                reason=why,
                progress=current if advanced else mark,
            )
        )
        failures += charged
        used += elapsed
        if advanced:
            mark = current
        ends.append(_End(seg, obs, charged, why))
        # Its successor may have ended (skipped) in the same tick.
        goal_met = goal_met or bool(_done_reason(chain, mark, ends))

    ended = {e.seg.n for e in ends}
    live = [s for s in sorted(chain.live, key=lambda s: s.n) if s.n not in ended]

    done = _done_reason(chain, current, ends)
    if done:
        # A running segment may still be writing its final model or metrics:
        # let it end on its own (its walltime bounds it); cancel only the queue.
        running = [s for s in live if s.phase is Phase.RUNNING]
        if running:
            return actions + [
                Cancel(n=s.n, job_id=s.job_id, reason="target reached")
                for s in live
                if s.phase is not Phase.RUNNING
            ]
        return actions + _finish(live, ChainState.COMPLETED, done)
    if failures > spec.max_failures:
        last = [e for e in ends if e.charged][-1]
        reason = (
            f"failure budget spent ({failures} failures, max_failures = {spec.max_failures}): "
            f"segment {last.seg.n} {last.why}"
        )
        return actions + _finish(live, ChainState.FAILED, reason)

    left = spec.total_time - used
    if not live:
        if left <= spec.grace:
            reason = (
                f"time budget spent: {format_duration(used)} of total_time "
                f"{format_duration(spec.total_time)} used; {current.describe()}"
            )
            return actions + _finish([], ChainState.EXHAUSTED, reason)
        actions.append(Submit(n=chain.next_n, walltime=min(spec.walltime, int(left))))
        return actions

    for seg in live:
        if seg.phase is Phase.SUBMITTING and (seg.retry_at is None or now >= seg.retry_at):
            actions.append(Submit(n=seg.n, walltime=seg.walltime, after=seg.after))
    if len(live) == 1:
        actions.extend(_queue_ahead(chain, live[0], left, failures))
    return actions


def _queue_ahead(chain: Chain, current: Segment, left: float, failures: int) -> list[Action]:
    """Keep one successor queued behind ``current`` when the budgets allow it."""
    spec = chain.spec
    if current.job_id is None:
        return []  # the dependency needs the job id
    if failures >= spec.max_failures:
        # One more failure ends the chain: a successor queued now could start
        # and burn an allocation before the service sees that failure.
        return []
    after_current = left - current.walltime
    if after_current <= spec.grace:
        return []  # decided once the current segment has ended and its time is known
    return [Submit(n=chain.next_n, walltime=min(spec.walltime, int(after_current)), after=current.job_id)]


def _charge(
    seg: Segment, obs: Observation, advanced: bool, finished: bool, goal_met: bool
) -> tuple[bool, str]:
    """Whether a segment's end costs failure budget, and the words for it."""
    outcome = obs.outcome
    assert outcome is not None
    code = "" if obs.exit_code is None else f" (exit {obs.exit_code})"
    detail = f": {obs.reason}" if obs.reason else ""
    if outcome.crashed:
        return True, f"{outcome.value}{code}{detail}"
    if finished:
        return False, f"{outcome.value}{code}: the command finished on its own"
    if goal_met and not advanced:
        return False, f"{outcome.value}{code} after the goal was already reached{detail}"
    if not advanced:
        return True, f"{outcome.value}{code} and made no progress{detail}"
    return False, f"{outcome.value}{code} with progress{detail}"


def _elapsed(seg: Segment, obs: Observation, now: float) -> float:
    start = obs.started_at or seg.started_at
    if start is None:
        return float(seg.walltime) if obs.outcome is Outcome.TIMEOUT else 0.0
    end = obs.ended_at or now
    return max(0.0, end - start)


def _done_reason(chain: Chain, current: Progress, ends: list[_End]) -> str:
    target = chain.spec.target_epoch
    if current.done:
        return f"the training marked itself done at {current.describe()}"
    if target is not None and current.epoch is not None and current.epoch >= target:
        return f"target epoch {target} reached ({current.describe()})"
    if target is None:
        for e in ends:
            if e.obs.outcome is Outcome.COMPLETED and e.obs.exit_code == 0:
                return f"segment {e.seg.n} exited 0 before its walltime"
    return ""


def _finish(live: list[Segment] | tuple[Segment, ...], state: ChainState, reason: str) -> list[Action]:
    cancels: list[Action] = [Cancel(n=s.n, job_id=s.job_id, reason=f"chain {state.value}") for s in live]
    return [*cancels, Finish(state=state, reason=reason)]
