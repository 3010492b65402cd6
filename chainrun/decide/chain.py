"""The chain state machine: facts in, actions out.

``decide`` is pure: it takes a chain as stored and the plain facts the engine
gathered this tick (what the scheduler's listing, the wrapper's markers and
accounting say of each job, which jobs carry the chain's tags, what the
checkpoint says now) and returns the actions that bring the chain forward,
each with its reason: track a job, adopt one an interrupted service left
behind, submit, remove a stuck or duplicate job, end a segment (charged or
not, lost included), cancel, end the chain, and mark a stuck chain active
again. It does no I/O and reads no clock, so every rule of DESIGN.md "Chain
rules" is pinned by table tests.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Optional

from chainrun.decide import charge as costs
from chainrun.decide import placement, places
from chainrun.decide.charge import Ending
from chainrun.decide.facts import Facts, JobFacts
from chainrun.decide.goal import finished_on_its_own, goal_reached
from chainrun.decide.grace import change as grace_change
from chainrun.decide.grace import grace_in_force, stop_seen
from chainrun.decide.segment import shorter_limit
from chainrun.fields import format_duration
from chainrun.model import (
    Action,
    Adopt,
    Cancel,
    Chain,
    ChainState,
    EndSegment,
    Finish,
    JobSpec,
    ListedJob,
    Move,
    Outcome,
    Phase,
    Progress,
    Remove,
    Segment,
    Submit,
    Track,
    Unstick,
)
from chainrun.schema import MIN_START

LOST_AFTER = 180.0  # seconds a job may be gone without a trace before it is "lost"
# Seconds a cancelled chain's running segment has, beyond its grace, to stop and be seen ended:
# its runner looks for the final marker every 2 s, and a snapshot's outputs go home after.
CANCEL_SLACK = 30.0


def decide(chain: Chain, facts: Facts, now: float) -> list[Action]:
    """The actions that move ``chain`` forward; a stuck chain's tick works again, so it is
    active again first."""
    if chain.state.final:
        return []
    actions = placement.settle(chain, facts, _moves(chain, facts, now))
    if chain.state is ChainState.STUCK:
        return [Unstick("a tick succeeded again"), *actions]
    return actions


def _moves(chain: Chain, facts: Facts, now: float) -> list[Action]:
    adopted = _adopt_carried(chain, facts)
    if adopted:
        return [*adopted]  # judged from next tick on, in order, as if the service had queued them
    spec = chain.spec
    live = sorted(chain.live, key=lambda s: s.n)
    current = facts.progress if facts.progress is not None else chain.progress
    mark = chain.progress
    refused = places.refused_everywhere(chain)
    if refused is not None:
        return _finish(facts, live, ChainState.FAILED, refused, current, mark, now)
    # A place that refused the chain for good is never chosen again; where the chain is now
    # refused it, no segment is queued there, and the next waits for the places' answers.
    barred = False
    if spec.places:
        facts = replace(facts, starts=places.without_refused(chain, facts.starts))
        barred = spec.place_name in places.refused(chain)

    switched = _duplicates(facts, live)
    if switched is not None:
        return switched
    actions: list[Action] = [a for s in live for a in _removals(s, facts)]

    failures, used = chain.failures, chain.used
    ended: set[int] = set()
    charged_last = ""
    # The first segment could not even start the command (its number, and why): no use going on.
    unrunnable: Optional[tuple[int, str]] = None
    finished_segment: Optional[int] = None  # without a target: the first that exited 0 on its own
    found_reached = ""  # the first segment whose runner skipped the command: the goal met, and why
    # How each ended segment crashed, by number (None: not a crash that may repeat as it is).
    crashes = {s.n: costs.crash(s.outcome, s.exit_code, s.tail) for s in chain.segments if not s.phase.live}
    repeated = ""  # why a segment that failed as the one before it ends the chain
    goal_met = bool(_done_reason(chain, mark, None))  # a successor that starts after the goal skips: free
    for i, seg in enumerate(live):
        if facts.host_lost:
            # The machine is gone (power, network): not the training's fault, so free. What it
            # saved is in the checkpoint, which the next segment reads wherever it runs.
            elapsed = min(now - seg.started_at, float(seg.walltime)) if seg.started_at is not None else 0.0
            saved = current if current.advanced_from(mark) else mark
            actions.append(EndSegment(seg.n, Outcome.LOST, None, False, elapsed, now, facts.host_lost, saved))
            mark = saved
            used += elapsed
            ended.add(seg.n)
            continue
        if seg.job_id is None or seg.job_id not in facts.jobs:
            continue  # not submitted yet, or nothing learned of it this tick
        job = facts.jobs[seg.job_id]
        ending = _ending(job)
        if ending is None:
            actions.extend(_track(seg, job, now))
            lost = _lost(seg, job, now)
            if lost is None:
                continue
            ending = lost
        if ending.remove:
            actions.append(
                Remove(n=seg.n, job_id=seg.job_id, reason=f"held by the scheduler: {ending.reason}")
            )
        # Each segment is judged on its own progress: from the checkpoint it
        # found to the one it left (the wrapper's markers), so segments that
        # ended while the service was away are each credited what they did.
        following = live[i + 1] if i + 1 < len(live) else None
        end_progress = _end_progress(job, following, facts, current)
        start = job.start.progress if job.start is not None and job.start.progress is not None else mark
        advanced = end_progress.advanced_from(start)
        # Exit 0 before the walltime ends the run when there is no target, or no
        # epoch to compare with it: running the command again would only repeat that.
        skipped = job.end is not None and job.end.skipped  # it never ran the command
        # Whether the walltime signal came, as the runner saw it: its job may still time out
        # after the command exited 0 on its own (bringing outputs home, a slow node).
        signalled = bool(job.end.signal) if job.end is not None else ending.outcome is not Outcome.COMPLETED
        finished = not skipped and finished_on_its_own(
            ending.exit_code, signalled, end_progress.epoch, spec.target_epoch
        )
        tail = job.end.tail if job.end is not None else ()
        if unrunnable is not None and costs.cannot_start(spec, ending, tail):
            # Queued behind the first segment, it started and failed alike before the
            # service saw that segment end: one fault, charged once.
            charged, why = (
                False,
                f"{ending.outcome.value} (exit {ending.exit_code}): the same as segment {unrunnable[0]}",
            )
        else:
            # Readable now (a node lost mid-save may have left it torn, or behind).
            intact = costs.intact(end_progress, start) if facts.progress is not None else None
            charged, why = costs.charge(ending, advanced, finished, goal_met or skipped, intact)
        cancelled = not (finished or skipped) and _stopped_by_cancel(chain, job, ending, now)
        outcome = Outcome.CANCELLED if cancelled else ending.outcome
        crashes[seg.n] = costs.crash(outcome, ending.exit_code, tail)
        if not repeated and not advanced:
            repeated = costs.repeated(chain, seg.n, crashes, mark)
        elapsed = _elapsed(seg, job, ending, now)
        if cancelled:  # free: the user's doing, and it keeps what it saved
            charged, why = False, "; ".join(["chain cancelled", *([ending.reason] if ending.reason else [])])
        if advanced and end_progress.key > mark.key:
            mark = end_progress
        actions.append(
            EndSegment(
                n=seg.n,
                outcome=outcome,
                exit_code=ending.exit_code,
                charged=charged,
                elapsed=elapsed,
                ended_at=ending.ended_at or now,
                reason=why,
                progress=end_progress if advanced else mark,
                tail=tail,
                signalled_at=job.end.signalled_at if job.end is not None else None,
                stop=stop_seen(spec, job.end, ending.outcome),
                ready_at=job.end.ready_at if job.end is not None else None,
            )
        )
        failures += charged
        used += elapsed
        ended.add(seg.n)
        if unrunnable is None:
            why_not = costs.unrunnable(chain, seg, job, ending)
            unrunnable = (seg.n, why_not) if why_not else None
        if charged:
            charged_last = f"segment {seg.n} {why}"
        if finished:
            goal_met = True
            finished_segment = finished_segment or seg.n
        if (
            skipped
            and job.end is not None
            and job.end.skip
            and not found_reached
            and not chain.cancel_requested
        ):
            # Its runner applied the same rule to what it found: a successor would skip again.
            # (Cancelled, the chain has its final marker, which every successor skips for.)
            goal_met = True
            found_reached = f"segment {seg.n} found the goal already reached: {job.end.skip}"
        goal_met = goal_met or bool(_done_reason(chain, mark, None))

    if not chain.cancel_requested:  # no later segment to give a grace to
        actions.extend(grace_change(chain, actions))
    still = [s for s in live if s.n not in ended]
    best = current if current.key >= mark.key or current.done else mark
    done = _done_reason(chain, best, finished_segment) or found_reached
    if done:
        # A running segment may still be writing its final model or metrics:
        # let it end on its own (its walltime bounds it); cancel only the queue.
        if any(s.phase is Phase.RUNNING for s in still):
            return actions + [
                Cancel(n=s.n, job_id=_job_of(s, facts), reason="target reached")
                for s in still
                if s.phase is not Phase.RUNNING
            ]
        return actions + _finish(facts, still, ChainState.COMPLETED, done, current, mark, now)
    if chain.cancel_requested_at is not None:
        return actions + _cancelling(chain, chain.cancel_requested_at, facts, still, current, mark, now)
    if unrunnable is not None:
        return actions + _finish(facts, still, ChainState.FAILED, unrunnable[1], current, mark, now)
    if repeated:
        return actions + _finish(facts, still, ChainState.FAILED, repeated, current, mark, now)
    if failures > spec.max_failures:
        reason = (
            f"failure budget spent ({failures} failures, max_failures = {spec.max_failures}): {charged_last}"
        )
        return actions + _finish(facts, still, ChainState.FAILED, reason, current, mark, now)

    left = spec.total_time - used
    if not chain.segments and not facts.may_start:
        return actions  # it starts when one of its sweep's chains ends
    moving = _moving(chain, facts)
    if barred and moving is None and not still:
        return actions
    if not still:
        walltime = next_walltime(spec.at(moving), left)
        if walltime is None:
            short = ""
            if left >= 1:
                short = (
                    f"; the {format_duration(left)} left is too short for a segment "
                    f"(grace {format_duration(spec.grace)} + {MIN_START}s to start)"
                )
            reason = (
                f"time budget spent: {format_duration(used)} of total_time "
                f"{format_duration(spec.total_time)} used{short}; {best.describe()}"
            )
            return [*actions, Finish(ChainState.EXHAUSTED, reason)]
        if moving is not None:
            why = places.move_reason(chain, moving, facts.starts, now)
            return [*actions, Move(n=chain.next_n, walltime=walltime, place=moving, reason=why)]
        return [*actions, Submit(n=chain.next_n, walltime=walltime)]

    leaving = places.leave(chain, facts.starts, now)
    queued = [s for s in still if s.phase is Phase.PENDING and s.started_at is None and s.job_id is not None]
    if leaving is not None and queued:
        why = f"left for {leaving}: {places.move_reason(chain, leaving, facts.starts, now)}"
        return actions + [_stopped(s, facts, current, mark, now, why) for s in queued]

    for seg in still:
        if seg.phase is Phase.SUBMITTING:
            found = _job_of(seg, facts)
            if found is not None:
                actions.append(Adopt(n=seg.n, job_id=found, how="adopted after a restart"))
            elif seg.retry_at is not None and now < seg.retry_at:
                continue
            elif seg.attempts >= places.MOVE_TRIES and places.copy_from(chain, seg) is not None:
                # Its checkpoint could not be copied there: the chain chooses again.
                actions.append(Cancel(n=seg.n, job_id=None, reason=f"not moved; {seg.reason}"))
            else:
                actions.append(Submit(n=seg.n, walltime=seg.walltime, after=seg.after))
    if len(still) == 1 and moving is None and not barred:
        may_repeat = crashes.get(still[0].n - 1) is not None and not mark.advanced_from(chain.baseline)
        actions.extend(_queue_ahead(chain, still[0], left, failures, may_repeat))
    return actions


def quiet_until(chain: Chain, now: float) -> float:
    """Until when ``decide(chain, facts, t)`` still returns no action, for the same chain and
    facts, given that it returned none at ``now``: the first clock rule due (inf: none is).

    While nothing happens, only two rules read the clock: a job gone without a trace is
    lost at ``_lost_at``, and a failed submission is tried again at its ``retry_at``.
    Every other rule reads the chain and the facts alone (an answer with actions holds
    ``now`` itself: this is only for an empty one). The engine skips ``decide`` for a
    chain whose stored row and facts did not change until then."""
    times = [lost_at(s.missing_since) for s in chain.live if s.missing_since is not None]
    times += [s.retry_at for s in chain.live if s.phase is Phase.SUBMITTING and s.retry_at is not None]
    return min(times, default=math.inf)


# -- what happened to a job ----------------------------------------------------------


def _ending(job: JobFacts) -> Optional[Ending]:
    """How the job ended, or None while it has not (or nothing says so yet).

    Evidence in order: the scheduler's listing (it knows timeouts, OOM and node
    failures), the wrapper's end marker (the real exit code and whether the
    walltime signal came first), accounting; a failed job whose node the scheduler
    holds down now is a node failure."""
    listed = job.listed
    if listed is not None and listed.stuck:
        return Ending(
            listed.outcome or Outcome.FAILED,
            listed.exit_code,
            listed.started_at,
            listed.ended_at,
            job.why_stuck or listed.reason,
            remove=True,
        )
    if listed is not None and listed.phase is not Phase.ENDED:
        return None
    view = listed if listed is not None else job.accounting
    if view is not None and view.phase is not Phase.ENDED:
        view = None
    marker = job.end
    if marker is not None:
        exit_code: Optional[int] = marker.original
    elif view is not None:
        exit_code = view.exit_code
    else:
        return None
    outcome = view.outcome if view is not None else None
    overridable = outcome is None or outcome in (Outcome.COMPLETED, Outcome.FAILED)
    if (
        marker is not None
        and overridable
        and (
            outcome is None or marker.stopped_by_signal or marker.preempted or marker.fenced or marker.skipped
        )
    ):
        outcome = marker.outcome()
    reasons = [r for r in (view.reason if view else "", marker.describe() if marker else "") if r]
    if outcome is Outcome.FAILED and job.down:
        # A node of its allocation died before the scheduler noticed, and the job ended on its
        # own with it (a step that could not start there, a rank that lost its peer): the
        # machine's fault, as a node failure the scheduler saw in time is.
        outcome = Outcome.NODE_FAIL
        nodes = f"node {job.down[0]} is" if len(job.down) == 1 else f"nodes {', '.join(job.down)} are"
        reasons.append(f"{nodes} down now, a node failure the scheduler had not noticed yet")
    return Ending(
        outcome=outcome or Outcome.LOST,
        exit_code=exit_code,
        started_at=view.started_at if view else None,
        ended_at=(view.ended_at if view else None) or (marker.at if marker else None),
        reason="; ".join(reasons),
        died_of=marker.signal if marker is not None and marker.died_of_signal else "",
        held_back=marker is not None and marker.ready == "0",
    )


def _lost(seg: Segment, job: JobFacts, now: float) -> Optional[Ending]:
    """A job gone from the scheduler with no record of its end, for long enough."""
    if job.listed is not None or seg.missing_since is None or now < lost_at(seg.missing_since):
        return None
    return Ending(
        Outcome.LOST,
        None,
        None,
        None,
        f"gone from the scheduler for {now - seg.missing_since:.0f}s with no record of how it ended",
    )


def listed_as_its(jobs: Mapping[str, ListedJob], seg: Segment, tag: str) -> Optional[ListedJob]:
    """Segment ``seg``'s job in the listing ``jobs``: under its id and with the name it was
    given (``tag``; an array task, its array's). None: not listed, or the id is another job's
    (a cluster back with its state lost numbers jobs anew): the segment's job is gone."""
    job = jobs.get(seg.job_id) if seg.job_id is not None else None
    name = seg.array if seg.array is not None else tag
    return job if job is not None and job.name == name else None


def lost_at(missing_since: float) -> float:
    """When a job gone from the scheduler since ``missing_since`` (and not back) is lost."""
    return missing_since + LOST_AFTER


def _track(seg: Segment, job: JobFacts, now: float) -> list[Action]:
    """Record what changed about a job that has not ended. A job queued again after it
    started was requeued by the scheduler: the same segment runs again from the
    checkpoint, as the same job (its successor waits for it), so nothing has ended."""
    listed = job.listed
    if listed is None:  # gone from the scheduler's listing, no record of its end yet
        if seg.missing_since is not None:
            return []
        return [Track(seg.n, seg.phase, "gone from the queue", None, now)]
    started = listed.started_at if listed.started_at and not seg.started_at else None
    reason = listed.reason
    preempted = False
    if listed.phase is Phase.PENDING and seg.started_at is not None:
        preempted = job.end is not None and job.end.preempted
        reason = ("preempted, requeued" if preempted else "requeued") + (f"; {reason}" if reason else "")
    # Started with a shorter limit than asked (walltime = "MIN..MAX", backfill): its runner's clock
    # counts from that one, and so does the chain's time.
    granted = shorter_limit(job.start.walltime if job.start is not None else None, seg.walltime)
    if (listed.phase, reason) == (seg.phase, seg.reason) and not (seg.missing_since or started or granted):
        return []
    return [Track(seg.n, listed.phase, reason, started, None, preempted, granted)]


def _end_progress(job: JobFacts, following: Optional[Segment], facts: Facts, current: Progress) -> Progress:
    """The checkpoint a segment left: its end marker's, else what the next segment found
    at its start, else the checkpoint now."""
    if job.end is not None and job.end.progress is not None:
        return job.end.progress
    if following is not None and following.job_id is not None:
        nxt = facts.jobs.get(following.job_id)
        if nxt is not None and nxt.start is not None and nxt.start.progress is not None:
            return nxt.start.progress
    return current


def _elapsed(seg: Segment, job: JobFacts, ending: Optional[Ending], now: float) -> float:
    """The time a job ran: from its start to its end, or to ``now`` while it runs (at most
    its walltime then). Unknown for a timeout: its walltime; for a job never started: 0."""
    start = (
        (ending.started_at if ending is not None else None)
        or seg.started_at
        or (job.listed.started_at if job.listed is not None else None)
        or (job.start.at if job.start is not None else None)
    )
    if start is None:
        return float(seg.walltime) if ending is not None and ending.outcome is Outcome.TIMEOUT else 0.0
    if ending is None:
        return max(0.0, min(now - start, float(seg.walltime)))
    return max(0.0, (ending.ended_at or now) - start)


def _stopped_by_cancel(chain: Chain, job: JobFacts, ending: Ending, now: float) -> bool:
    """A segment that ended once a cancel was asked for, stopped by it: its runner passed the
    signal on once the final marker was there (not before: its walltime's), or it left no end
    marker (the cancel's kill). One that ended on its own keeps how it ended."""
    if chain.cancel_requested_at is None:
        return False
    asked = math.floor(chain.cancel_requested_at)  # the runner's markers keep whole seconds
    if (ending.ended_at or now) < asked:
        return False
    end = job.end
    return end is None or (bool(end.signal) and (end.signalled_at is None or end.signalled_at >= asked))


def _cancelling(
    chain: Chain,
    asked: float,
    facts: Facts,
    still: list[Segment],
    current: Progress,
    mark: Progress,
    now: float,
) -> list[Action]:
    """A cancel asked for at ``asked``: what is queued is cancelled at once. A running segment
    was told to stop (the final marker, which its runner watches: the walltime signal at once,
    the kill after its grace) and is judged as it ended once it has; one still running its
    grace and ``CANCEL_SLACK`` after the cancel is cancelled as it stands. Then the chain ends."""
    until = asked + grace_in_force(chain.spec, chain.segments).seconds + CANCEL_SLACK
    stopping = [s for s in still if now < until and _running(s, facts)]
    if not stopping:
        return _finish(facts, still, ChainState.CANCELLED, "cancelled by user", current, mark, now)
    return [_stopped(s, facts, current, mark, now, "chain cancelled") for s in still if s not in stopping]


def _running(seg: Segment, facts: Facts) -> bool:
    """The segment's job runs, as the store or this tick's listing says."""
    job = facts.jobs.get(seg.job_id) if seg.job_id is not None else None
    listed = job.listed if job is not None else None
    return seg.phase is Phase.RUNNING or (listed is not None and listed.phase is Phase.RUNNING)


def _stopped(
    seg: Segment, facts: Facts, current: Progress, mark: Progress, now: float, reason: str
) -> Cancel:
    """What cancelling segment ``seg`` now leaves on record: a job that ran keeps the time it
    ran and the progress it made past ``mark`` (its end marker's, else the checkpoint now)."""
    job = facts.jobs.get(seg.job_id, JobFacts()) if seg.job_id is not None else JobFacts()
    elapsed = _elapsed(seg, job, _ending(job), now)
    end = _end_progress(job, None, facts, current)
    start = job.start.progress if job.start is not None and job.start.progress is not None else mark
    made = elapsed > 0 and end.advanced_from(start) and end.key > mark.key
    if elapsed > 0:
        reason += f"; ran {format_duration(elapsed)}; progress: {end.describe() if made else 'none made'}"
    return Cancel(
        n=seg.n, job_id=_job_of(seg, facts), reason=reason, elapsed=elapsed, progress=end if made else None
    )


def charge_by_markers(job: JobFacts, mark: Progress) -> Optional[tuple[bool, Progress, float]]:
    """What a segment that ended as its markers alone say costs, as ``decide`` charges it:
    whether it is charged, the checkpoint it left and the time it ran (its end minus its
    start); None while it has no end marker."""
    marker = job.end
    if marker is None:
        return None
    ending = _ending(job)
    if ending is None:  # the listing shows it has not ended yet
        return None
    end = marker.progress if marker.progress is not None else mark
    start = job.start.progress if job.start is not None and job.start.progress is not None else mark
    intact = costs.intact(marker.progress, start) if marker.progress is not None else None
    charged, _ = costs.charge(ending, end.advanced_from(start), False, marker.skipped, intact)
    began = job.start.at if job.start is not None else None
    elapsed = max(0.0, marker.at - began) if marker.at is not None and began is not None else 0.0
    return charged, end if end.key > mark.key else mark, elapsed


def _done_reason(chain: Chain, progress: Progress, finished_segment: Optional[int]) -> str:
    target = chain.spec.target_epoch
    if goal_reached(progress, target):
        if progress.done:
            return f"the training marked itself done at {progress.describe()}"
        return f"target epoch {target} reached ({progress.describe()})"
    if finished_segment is not None and target is not None:
        return (
            f"segment {finished_segment} exited 0 before its walltime, and chainrun cannot read an epoch "
            f'to compare with target_epoch {target} (to read one: progress = "FILE.json:KEY")'
        )
    if finished_segment is not None:
        return f"segment {finished_segment} exited 0 before its walltime"
    return ""


# -- jobs of a segment -----------------------------------------------------------------


def _job_of(seg: Segment, facts: Facts) -> Optional[str]:
    """Segment ``seg``'s job: the recorded one, else one the scheduler shows under its tag
    (a live one first, else the newest), else the one its start marker names."""
    if seg.job_id is not None:
        return seg.job_id
    tagged = facts.tagged.get(seg.n, ())
    running = [j for j in tagged if j.phase is not Phase.ENDED]
    pick = running or sorted(tagged, key=lambda j: (j.ended_at or 0.0, j.job_id))[-1:]
    if pick:
        return pick[0].job_id
    carried = facts.carried.get(seg.n)
    return (carried.job_id if carried is not None else "") or facts.found.get(seg.n)


def _adopt_carried(chain: Chain, facts: Facts) -> list[Adopt]:
    """The segments that queued each other while the service was away, from the next one
    on: recorded first, so that the store holds every job of the chain before any of them
    is judged, and before the chain ends (cancelling those still queued). One whose
    submission never answered, and that no listing shows, is left to the usual submission
    (the local runner's submit by name, or a second job of one segment, removed)."""
    actions: list[Adopt] = []
    n = chain.next_n
    while n in facts.carried:
        carried = facts.carried[n]
        tagged = facts.tagged.get(n)
        job_id = carried.job_id or (tagged[0].job_id if tagged else "")
        if not job_id:
            break
        how = f"queued by segment {n - 1} while the service was away"
        actions.append(
            Adopt(n, job_id, how, walltime=carried.walltime, after=carried.after, submitted_at=carried.at)
        )
        n += 1
    return actions


def _extras(seg: Segment, facts: Facts) -> list[ListedJob]:
    """Jobs of segment ``seg`` besides its recorded one that have not ended."""
    return [j for j in facts.tagged.get(seg.n, ()) if j.job_id != seg.job_id and j.phase is not Phase.ENDED]


def _duplicates(facts: Facts, live: list[Segment]) -> Optional[list[Action]]:
    """When a second job of a queued segment already runs it (a submission an interrupted
    service left behind), keep that one: it runs the checkpoint. Its recorded job and
    the successors queued after it go, and are queued again behind the one kept."""
    for seg in live:
        if seg.job_id is None:
            continue
        recorded = facts.jobs.get(seg.job_id, JobFacts()).listed
        running = [j for j in _extras(seg, facts) if j.phase is Phase.RUNNING]
        if not running or recorded is None or recorded.phase is not Phase.PENDING:
            continue
        keep = running[0]
        why = f"segment {seg.n} already runs as job {keep.job_id}"
        actions: list[Action] = [Adopt(n=seg.n, job_id=keep.job_id, how="kept: it runs the segment")]
        actions += [
            Remove(n=seg.n, job_id=j.job_id, reason=f"a second job of segment {seg.n}; {why}")
            for j in [recorded, *_extras(seg, facts)]
            if j.job_id != keep.job_id
        ]
        actions += [
            Cancel(n=s.n, job_id=s.job_id, reason=f"queued after a job of segment {seg.n} that was removed")
            for s in live
            if s.n > seg.n
        ]
        return actions
    return None


def _removals(seg: Segment, facts: Facts) -> list[Action]:
    """A second job of a segment, not ended (an interrupted submission that landed late) goes."""
    if seg.job_id is None:
        return []
    return [
        Remove(
            n=seg.n,
            job_id=j.job_id,
            reason=f"a second job of segment {seg.n}, left by an interrupted submission; "
            f"job {seg.job_id} runs it",
        )
        for j in _extras(seg, facts)
    ]


def _moving(chain: Chain, facts: Facts) -> Optional[str]:
    """The place a chain with several goes to for its next segment, when not where it is."""
    chosen = places.choose(chain.spec.places, facts.starts)
    return chosen if chosen is not None and chosen != chain.spec.place_name else None


def _queue_ahead(
    chain: Chain, current: Segment, left: float, failures: int, may_repeat: bool
) -> list[Action]:
    """Keep one successor queued behind ``current`` when the budgets allow it, and when
    ``current`` cannot end the chain by repeating the crash of the segment before it
    (``may_repeat``)."""
    spec = chain.spec
    if current.job_id is None:
        return []  # the dependency needs the job id
    if failures >= spec.max_failures or may_repeat:
        # One more failure (or the same crash again) ends the chain: a successor queued
        # now could start and burn an allocation before the service sees that failure.
        return []
    walltime = next_walltime(spec, left - current.walltime)
    if walltime is None:
        return []  # decided once the current segment has ended and its time is known
    return [Submit(n=chain.next_n, walltime=walltime, after=current.job_id)]


def _finish(
    facts: Facts,
    live: list[Segment],
    state: ChainState,
    reason: str,
    current: Progress,
    mark: Progress,
    now: float,
) -> list[Action]:
    """End the chain: the jobs of ``live`` are cancelled, each one that ran credited what it
    did (``_stopped``), free of charge whoever ended the chain."""
    actions: list[Action] = []
    for seg in live:
        cancel = _stopped(seg, facts, current, mark, now, f"chain {state.value}")
        mark = cancel.progress or mark
        actions.append(cancel)
    return [*actions, Finish(state=state, reason=reason)]


def next_walltime(spec: JobSpec, left: float) -> Optional[int]:
    """The walltime of a new segment when ``left`` seconds of total_time remain: the job
    file's, or what remains; None when that leaves under ``MIN_START`` after the grace, too
    short to start the command and save (a segment signalled as it starts dies unsaved)."""
    walltime = min(spec.walltime, int(left))
    return walltime if walltime - spec.grace >= MIN_START else None


def questions(chain: Chain) -> list[tuple[str, JobSpec, int]]:
    """What each place of a chain with several is asked (``Cluster.expected_start``): its name,
    the chain's spec as seen there, and the walltime of a next segment there
    (``next_walltime``); a place where none fits in the time left is not asked."""
    left = chain.spec.total_time - chain.used
    asked = []
    for place in chain.spec.places:
        there = chain.spec.at(place.name)
        walltime = next_walltime(there, left)
        if walltime is not None:
            asked.append((place.name, there, walltime))
    return asked
