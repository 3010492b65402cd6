"""decide() at its edges, each answer compared whole (every action, number, job id and
reason): the second jobs of a segment, jobs found under a segment's tag, jobs held by the
scheduler, each kind of evidence of how a job ended and what it says about the time it
trained, segments judged from the checkpoint they found, the time budget at its boundary.
The mutation score (benchmarks/mutation.py) showed these as rules no test held."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

import pytest
from test_decide import AFTER, BEFORE, NOW, SPEC, chain, ended, seg, shown

from chainrun.decide import Facts, JobFacts, decide, quiet_until
from chainrun.decide.chain import CANCEL_SLACK, charge_by_markers
from chainrun.decide.startup import slow_start, starting
from chainrun.fields import format_duration
from chainrun.model import (
    Adopt,
    Cancel,
    Carried,
    ChainState,
    EndMarker,
    EndSegment,
    Finish,
    ListedJob,
    Outcome,
    Phase,
    Progress,
    Remove,
    Segment,
    StartMarker,
    Submit,
    Track,
)
from chainrun.schema import MIN_START


def unsubmitted(n: int, **kw: object) -> object:
    """Segment ``n`` journaled, its job not known."""
    return replace(seg(n, Phase.SUBMITTING, **kw), job_id=None)


def listed(job: str, phase: Phase, **kw: object) -> ListedJob:
    return ListedJob(job, f"cr.c.{job}", phase, **kw)  # type: ignore[arg-type]


def end(
    outcome: Outcome,
    code: Optional[int],
    reason: str,
    elapsed: float,
    at: float,
    progress: Progress,
    n: int = 1,
    stop: Optional[float] = None,
) -> EndSegment:
    charged = outcome.crashed or "made no progress" in reason
    return EndSegment(n, outcome, code, charged, elapsed, at, reason, progress, stop=stop)


# A timeout with no end marker: the kill came before the command stopped (decide/grace.py).
KILLED_STOPPING = float(SPEC.grace)


# -- second jobs of a segment ------------------------------------------------------------


def test_a_second_job_that_runs_the_segment_is_kept_and_the_rest_go() -> None:
    """The recorded job waits while another job of the segment runs: that one is kept, the
    recorded one and any other spare go, and what was queued after the segment goes too."""
    c = chain(unsubmitted(1, retry_at=NOW + 60), seg(2, Phase.PENDING), seg(3, Phase.PENDING, after="j2"))
    facts = Facts(
        jobs={"j2": shown("j2", Phase.PENDING), "j3": shown("j3", Phase.PENDING, "Dependency")},
        tagged={2: (listed("j9", Phase.RUNNING), listed("j8", Phase.PENDING))},
        progress=BEFORE,
    )
    why = "a second job of segment 2; segment 2 already runs as job j9"
    assert decide(c, facts, NOW) == [
        Adopt(2, "j9", "kept: it runs the segment"),
        Remove(2, "j2", why),
        Remove(2, "j8", why),
        Cancel(3, "j3", "queued after a job of segment 2 that was removed"),
    ]


def test_a_second_job_beside_a_running_recorded_one_is_removed_and_the_chain_goes_on() -> None:
    """Both run: the recorded one runs the segment; the other is removed, nothing else changes.
    A segment before it with nothing odd stops nobody looking at the next."""
    c = chain(seg(1), seg(2, Phase.PENDING, after="j1"))
    facts = Facts(
        jobs={"j1": shown("j1", Phase.RUNNING), "j2": shown("j2", Phase.PENDING, "Dependency")},
        tagged={1: (listed("j9", Phase.RUNNING),), 2: (listed("j7", Phase.RUNNING),)},
        progress=BEFORE,
    )
    assert decide(c, facts, NOW) == [
        Adopt(2, "j7", "kept: it runs the segment"),
        Remove(2, "j2", "a second job of segment 2; segment 2 already runs as job j7"),
    ]
    facts = replace(facts, tagged={1: (listed("j9", Phase.RUNNING),)})
    removed = "a second job of segment 1, left by an interrupted submission; job j1 runs it"
    assert decide(c, facts, NOW) == [
        Remove(1, "j9", removed),
        Track(2, Phase.PENDING, "Dependency", None, None),
    ]


# -- jobs found under a segment's tag ----------------------------------------------------


def test_a_cancel_cancels_the_job_a_segment_being_submitted_has_under_its_tag() -> None:
    c = replace(chain(seg(1), unsubmitted(2, after="j1")), cancel_requested_at=0.0)
    facts = Facts(tagged={2: (listed("j7", Phase.PENDING),)})
    assert decide(c, facts, NOW) == [
        Cancel(1, "j1", "chain cancelled"),
        Cancel(2, "j7", "chain cancelled"),
        Finish(ChainState.CANCELLED, "cancelled by user"),
    ]


def test_the_target_reached_cancels_a_queued_successor_found_under_its_tag() -> None:
    c = chain(seg(1), unsubmitted(2, after="j1"))
    facts = Facts(
        jobs={"j1": shown("j1", Phase.RUNNING)},
        tagged={2: (listed("j7", Phase.PENDING),)},
        progress=Progress(epoch=10, saved_at=300.0),
    )
    assert decide(c, facts, NOW) == [Cancel(2, "j7", "target reached")]


def test_of_a_segments_tagged_jobs_a_live_one_is_taken_else_the_newest_that_ended() -> None:
    """Ended jobs by when they ended (one with no time counts as earliest), then by id."""
    c = replace(chain(unsubmitted(1)), cancel_requested_at=0.0)

    def cancelled(*jobs: ListedJob) -> Optional[str]:
        first = decide(c, Facts(tagged={1: jobs}), NOW)[0]
        assert isinstance(first, Cancel)
        return first.job_id

    early, untimed, late = (
        listed("j4", Phase.ENDED, ended_at=0.25),
        listed("j6", Phase.ENDED),
        listed("j5", Phase.ENDED, ended_at=0.5),
    )
    assert cancelled(late, untimed, early) == "j5"
    assert cancelled(untimed, late) == "j5"
    assert cancelled(late, listed("j3", Phase.PENDING), early) == "j3"
    assert cancelled() is None


def test_a_segment_being_submitted_adopts_the_job_its_start_marker_names() -> None:
    c = chain(unsubmitted(1))
    assert decide(c, Facts(found={1: "j4"}, progress=BEFORE), NOW) == [
        Adopt(1, "j4", "adopted after a restart")
    ]


def test_a_submission_sent_again_keeps_its_dependency() -> None:
    c = chain(seg(1), unsubmitted(2, after="j1", retry_at=NOW - 1))
    facts = Facts(jobs={"j1": shown("j1", Phase.RUNNING)}, progress=BEFORE)
    assert decide(c, facts, NOW) == [Submit(2, 100, after="j1")]


# -- jobs held, and how a job ended ------------------------------------------------------


def test_a_successor_rejected_for_good_ends_the_chain_and_the_running_segment_keeps_what_it_did() -> None:
    """Segment 2's submission was refused for good while segment 1 runs: the chain fails in
    the scheduler's words, and segment 1 is cancelled, credited the time it ran and the
    checkpoint it has saved since its start."""
    rejected = replace(
        seg(2, Phase.ENDED), job_id=None, outcome=Outcome.REJECTED, reason="sbatch: error: invalid account"
    )
    running = JobFacts(
        listed=listed("j1", Phase.RUNNING, started_at=NOW - 50), start=StartMarker("j1", NOW - 50, BEFORE)
    )
    facts = Facts(jobs={"j1": running}, progress=AFTER)
    assert decide(chain(seg(1, started_at=NOW - 50), rejected), facts, NOW) == [
        Cancel(1, "j1", "chain failed; ran 50s; progress: epoch 4", elapsed=50.0, progress=AFTER),
        Finish(ChainState.FAILED, "sbatch: error: invalid account"),
    ]


def test_a_job_held_by_the_scheduler_is_removed_and_ends_in_its_words() -> None:
    held = listed(
        "j1", Phase.ENDED, exit_code=3, started_at=NOW - 50, ended_at=NOW - 10, reason="Eqw", stuck=True
    )
    facts = Facts(jobs={"j1": JobFacts(listed=held, why_stuck="can't chdir")}, progress=BEFORE)
    assert decide(chain(seg(1, Phase.PENDING)), facts, NOW) == [
        Remove(1, "j1", "held by the scheduler: can't chdir"),
        end(Outcome.FAILED, 3, "failed (exit 3): can't chdir", 40.0, NOW - 10, BEFORE),
        Submit(2, 100),
    ]


def test_a_listing_that_says_completed_is_a_timeout_when_the_marker_saw_the_signal() -> None:
    """The local runner and SGE show a command that exited 0 after the walltime signal as
    completed; the marker knows better. The listing's words and the marker's both go in."""
    after = Progress(epoch=4, saved_at=200.0)
    marker = EndMarker(0, 0, "USR1", False, NOW - 2, progress=after)
    job = JobFacts(
        listed=listed(
            "j1",
            Phase.ENDED,
            outcome=Outcome.COMPLETED,
            exit_code=0,
            started_at=NOW - 90,
            ended_at=NOW - 1,
            reason="COMPLETED",
        ),
        end=marker,
    )
    actions = decide(chain(seg(1)), Facts(jobs={"j1": job}, progress=after), NOW)
    why = "timeout (exit 0) with progress: COMPLETED; the command exited 0 after SIGUSR1"
    assert actions == [end(Outcome.TIMEOUT, 0, why, 89.0, NOW - 1, after), Submit(2, 100)]


def test_a_job_gone_from_the_listing_ends_by_its_marker_and_trains_from_its_start() -> None:
    """No listing, no accounting: the end marker says how and when; the time trained runs
    from the start the store recorded, else from the start marker."""
    marker = EndMarker(1, 1, "", False, NOW - 5)
    why = "failed (exit 1): the command exited 1 on its own"
    recorded = chain(seg(1, started_at=NOW - 65))
    assert decide(recorded, Facts(jobs={"j1": JobFacts(end=marker)}, progress=BEFORE), NOW)[0] == end(
        Outcome.FAILED, 1, why, 60.0, NOW - 5, BEFORE
    )
    started = JobFacts(end=marker, start=StartMarker("j1", NOW - 30, None))
    assert decide(chain(seg(1)), Facts(jobs={"j1": started}, progress=BEFORE), NOW)[0] == end(
        Outcome.FAILED, 1, why, 25.0, NOW - 5, BEFORE
    )


def test_a_job_with_no_times_trains_nothing_unless_it_ran_to_its_walltime() -> None:
    """Ended with no start or end known: a failure trained 0 s and ends now; a timeout used
    its whole walltime. A start equal to its end trained 0 s."""
    failed = JobFacts(listed=listed("j1", Phase.ENDED, outcome=Outcome.FAILED, exit_code=2))
    assert decide(chain(seg(1)), Facts(jobs={"j1": failed}, progress=BEFORE), NOW)[0] == end(
        Outcome.FAILED, 2, "failed (exit 2)", 0.0, NOW, BEFORE
    )
    timeout = JobFacts(listed=listed("j1", Phase.ENDED, outcome=Outcome.TIMEOUT))
    assert decide(chain(seg(1)), Facts(jobs={"j1": timeout}, progress=BEFORE), NOW)[0] == end(
        Outcome.TIMEOUT, None, "timeout and made no progress", 100.0, NOW, BEFORE, stop=KILLED_STOPPING
    )
    instant = JobFacts(
        listed=listed(
            "j1", Phase.ENDED, outcome=Outcome.FAILED, exit_code=2, started_at=NOW - 3, ended_at=NOW - 3
        )
    )
    assert decide(chain(seg(1)), Facts(jobs={"j1": instant}, progress=BEFORE), NOW)[0] == end(
        Outcome.FAILED, 2, "failed (exit 2)", 0.0, NOW - 3, BEFORE
    )


def test_a_job_accounting_shows_queued_again_has_not_ended() -> None:
    """Gone from the listing, and accounting says it waits to run again (SGE rescheduled it):
    it is only missing for now."""
    again = JobFacts(accounting=listed("j1", Phase.PENDING))
    assert decide(chain(seg(1)), Facts(jobs={"j1": again}, progress=BEFORE), NOW) == [
        Track(1, Phase.RUNNING, "gone from the queue", None, NOW),
        Submit(2, 100, after="j1"),
    ]


def test_a_job_is_tracked_when_it_comes_back_and_when_it_starts_without_a_time() -> None:
    back = chain(seg(1, missing_since=NOW - 30))
    assert decide(back, Facts(jobs={"j1": shown("j1", Phase.RUNNING)}, progress=BEFORE), NOW)[0] == Track(
        1, Phase.RUNNING, "", None, None
    )
    starting = chain(seg(1, Phase.PENDING))
    assert decide(starting, Facts(jobs={"j1": shown("j1", Phase.RUNNING)}, progress=BEFORE), NOW)[0] == Track(
        1, Phase.RUNNING, "", None, None
    )


# -- what each segment trained -----------------------------------------------------------


def test_a_segment_ended_while_its_successor_runs_is_credited_what_the_successor_found() -> None:
    """No end marker: the checkpoint segment 2 found at its start is what segment 1 left, not
    the checkpoint now (segment 2 has trained since)."""
    found = Progress(epoch=5, saved_at=250.0)
    second = JobFacts(
        listed=listed("j2", Phase.RUNNING, started_at=NOW - 5), start=StartMarker("j2", NOW - 5, found)
    )
    facts = Facts(
        jobs={"j1": ended("j1", Outcome.TIMEOUT), "j2": second}, progress=Progress(epoch=6, saved_at=300.0)
    )
    assert decide(chain(seg(1), seg(2, Phase.PENDING, after="j1")), facts, NOW) == [
        end(Outcome.TIMEOUT, 0, "timeout (exit 0) with progress", 89.0, NOW - 1, found, stop=KILLED_STOPPING),
        Track(2, Phase.RUNNING, "", NOW - 5, None),
        Submit(3, 100, after="j2"),
    ]


def test_segments_queued_while_the_service_was_away_are_adopted_in_order_up_to_the_first_unknown_job() -> (
    None
):
    """From the chain's next segment on, each claim is adopted with its walltime and dependency
    (its job from the claim, else the first the listing shows under its tag), and judged from
    the next tick on; the first with no job known ends the adoption (the usual submission
    takes it), and so nothing after it is adopted."""
    c = chain(seg(1, Phase.PENDING), seg(2, after="j1"))
    carried = {
        2: Carried("k2", 100, "j1"),  # recorded already: never adopted again
        3: Carried("j3", 600, "j2", at=NOW - 50),  # its claim says when: its submission's time
        4: Carried("", 500, "j3"),
        5: Carried("", 400, "j4"),
        6: Carried("j6", 300, "j5"),
    }
    tagged = {4: (listed("j4", Phase.PENDING), listed("j9", Phase.PENDING))}
    facts = Facts(jobs={"j2": ended("j2", Outcome.TIMEOUT)}, carried=carried, tagged=tagged, progress=BEFORE)
    adopted = [
        Adopt(
            3,
            "j3",
            "queued by segment 2 while the service was away",
            walltime=600,
            after="j2",
            submitted_at=NOW - 50,
        ),
        Adopt(4, "j4", "queued by segment 3 while the service was away", walltime=500, after="j3"),
    ]
    assert decide(c, facts, NOW) == adopted
    # A cancel asked for meanwhile: adopted all the same, so that the next tick judges every
    # segment as it ended (segment 2 timed out before the cancel: never recorded as cancelled).
    assert decide(replace(c, cancel_requested_at=0.0), facts, NOW) == adopted


def test_three_live_segments_after_an_adoption_are_each_credited_what_the_next_one_found() -> None:
    """Segments 2 and 3 were queued by the segment before each while the service was away and
    adopted: three are live. Neither 1 nor 2 left an end marker (killed at the walltime), so
    each left what the segment after it found at its start, not what the one before it found,
    nor the last one's."""
    five, six = Progress(epoch=5, saved_at=250.0), Progress(epoch=6, saved_at=300.0)

    def timed_out(job: str, found: Progress) -> JobFacts:
        return replace(ended(job, Outcome.TIMEOUT), start=StartMarker(job, NOW - 90, found))

    facts = Facts(
        jobs={
            "j1": timed_out("j1", BEFORE),
            "j2": timed_out("j2", five),
            "j3": JobFacts(
                listed=listed("j3", Phase.RUNNING, started_at=NOW - 5), start=StartMarker("j3", NOW - 5, six)
            ),
        },
        progress=Progress(epoch=7, saved_at=350.0),
    )
    c = chain(seg(1), seg(2, Phase.PENDING, after="j1"), seg(3, Phase.PENDING, after="j2"))
    why = "timeout (exit 0) with progress"
    assert decide(c, facts, NOW) == [
        end(Outcome.TIMEOUT, 0, why, 89.0, NOW - 1, five, stop=KILLED_STOPPING),
        end(Outcome.TIMEOUT, 0, why, 89.0, NOW - 1, six, n=2, stop=KILLED_STOPPING),
        Track(3, Phase.RUNNING, "", NOW - 5, None),
        Submit(4, 100, after="j3"),
    ]


def test_each_segment_is_judged_from_the_checkpoint_it_found_not_the_chains_mark() -> None:
    """Both found epoch 5 and left epoch 5: neither trained, though the chain's mark is epoch 3.
    The second is judged against the same mark, not the first one's checkpoint."""
    five = Progress(epoch=5, saved_at=250.0)
    jobs = {
        f"j{n}": JobFacts(
            end=EndMarker(0, 0, "USR1", False, NOW - 1, progress=five),
            start=StartMarker(f"j{n}", NOW - at, five),
        )
        for n, at in ((1, 60), (2, 30))
    }
    why = "timeout (exit 0) and made no progress: the command exited 0 after SIGUSR1"
    assert decide(chain(seg(1), seg(2, Phase.PENDING, after="j1")), Facts(jobs=jobs, progress=five), NOW) == [
        end(Outcome.TIMEOUT, 0, why, 59.0, NOW - 1, BEFORE),
        end(Outcome.TIMEOUT, 0, why, 29.0, NOW - 1, BEFORE, n=2),
        Submit(3, 100),
    ]


def test_a_successor_that_ends_after_the_command_finished_on_its_own_is_not_charged() -> None:
    """No target: segment 1 exited 0 on its own, so segment 2 (queued, then cut by its
    walltime without progress) ended after the goal: free, and the chain completes."""
    spec = replace(SPEC, target_epoch=None)
    jobs = {
        "j1": replace(ended("j1", Outcome.COMPLETED), end=EndMarker(0, 0, "", False, NOW - 1)),
        "j2": ended("j2", Outcome.TIMEOUT),
    }
    assert decide(
        chain(seg(1), seg(2, Phase.PENDING, after="j1"), spec=spec), Facts(jobs=jobs, progress=BEFORE), NOW
    ) == [
        end(
            Outcome.COMPLETED, 0, "completed (exit 0): the command finished on its own", 89.0, NOW - 1, BEFORE
        ),
        end(
            Outcome.TIMEOUT,
            0,
            "timeout (exit 0) after the goal was already reached",
            89.0,
            NOW - 1,
            BEFORE,
            n=2,
            stop=KILLED_STOPPING,
        ),
        Finish(ChainState.COMPLETED, "segment 1 exited 0 before its walltime"),
    ]


def test_the_target_in_the_end_marker_completes_even_when_the_checkpoint_read_now_is_older() -> None:
    """The sidecar read this tick says epoch 8 (a read before the last save landed); the end
    marker saw epoch 10, the target: that is the progress that counts."""
    ten = Progress(epoch=10, saved_at=500.0)
    job = JobFacts(
        end=EndMarker(0, 0, "USR1", False, NOW - 1, progress=ten),
        start=StartMarker("j1", NOW - 61, Progress(epoch=9, saved_at=400.0)),
    )
    facts = Facts(jobs={"j1": job}, progress=Progress(epoch=8, saved_at=300.0))
    assert decide(chain(seg(1)), facts, NOW) == [
        end(
            Outcome.TIMEOUT,
            0,
            "timeout (exit 0) with progress: the command exited 0 after SIGUSR1",
            60.0,
            NOW - 1,
            ten,
        ),
        Finish(ChainState.COMPLETED, "target epoch 10 reached (epoch 10)"),
    ]


def test_a_segment_nothing_was_learned_of_does_not_stop_the_judging_of_the_next() -> None:
    """Segment 2, queued, was cancelled by someone else while segment 1 runs: charged, and a
    new successor is queued behind segment 1, whether or not segment 1 was looked at."""
    cancelled = JobFacts(listed=listed("j2", Phase.ENDED, outcome=Outcome.CANCELLED, ended_at=NOW - 1))
    expected = [
        end(Outcome.CANCELLED, None, "cancelled", 0.0, NOW - 1, BEFORE, n=2),
        Submit(3, 100, after="j1"),
    ]
    c = chain(seg(1), seg(2, Phase.PENDING, after="j1"))
    assert decide(c, Facts(jobs={"j2": cancelled}, progress=BEFORE), NOW) == expected
    looked = {"j1": shown("j1", Phase.RUNNING), "j2": cancelled}
    assert decide(c, Facts(jobs=looked, progress=BEFORE), NOW) == expected


# -- the budgets at their boundaries ------------------------------------------------------


def test_no_successor_when_what_is_left_after_the_current_segment_is_only_grace() -> None:
    running = Facts(jobs={"j1": shown("j1", Phase.RUNNING)}, progress=BEFORE)
    left = SPEC.total_time - SPEC.walltime - SPEC.grace  # then exactly grace remains after segment 1
    assert decide(chain(seg(1), used=float(left)), running, NOW) == []
    assert decide(chain(seg(1), used=float(left - MIN_START + 1)), running, NOW) == []
    assert decide(chain(seg(1), used=float(left - MIN_START)), running, NOW) == [
        Submit(2, SPEC.grace + MIN_START, after="j1")
    ]


def test_a_last_segment_always_has_the_time_to_start_and_save_after_its_grace() -> None:
    """With 10.5 s of total_time left and a 10 s grace, the last segment went out with a 10 s
    walltime: signalled as it started, it died before it could save, and cost a failure. A
    segment now gets at least grace + MIN_START, as `check` asks of the walltime; less than
    that left spends the time budget."""
    spent = (
        "time budget spent: 16m30s of total_time 16m40s used; the 10s left is too short for a "
        "segment (grace 10s + 2s to start); epoch 3"
    )
    assert decide(chain(used=SPEC.total_time - 10.5), Facts(progress=BEFORE), NOW) == [
        Finish(ChainState.EXHAUSTED, spent)
    ]
    spent_all = "time budget spent: 16m40s of total_time 16m40s used; epoch 3"  # nothing left to say is short
    assert decide(chain(used=SPEC.total_time), Facts(progress=BEFORE), NOW) == [
        Finish(ChainState.EXHAUSTED, spent_all)
    ]
    one = "time budget spent: 16m39s of total_time 16m40s used; the 1s left is too short for a segment"
    assert decide(chain(used=SPEC.total_time - 1), Facts(progress=BEFORE), NOW) == [
        Finish(ChainState.EXHAUSTED, f"{one} (grace 10s + 2s to start); epoch 3")
    ]
    (short,) = decide(chain(used=SPEC.total_time - SPEC.grace - MIN_START + 0.5), Facts(progress=BEFORE), NOW)
    assert isinstance(short, Finish) and short.state is ChainState.EXHAUSTED
    assert decide(chain(used=SPEC.total_time - SPEC.grace - MIN_START), Facts(progress=BEFORE), NOW) == [
        Submit(1, SPEC.grace + MIN_START)
    ]


def test_command_not_found_ends_the_chain_naming_the_path_it_was_looked_up_in() -> None:
    message = (
        "command not found or not executable (exit 127): python train.py ({}); "
        "run it by hand in the workdir, or list what it needs in inherit_env or [env]"
    )
    failed = ended("j1", Outcome.FAILED, 127)
    cases = [
        (
            JobFacts(listed=failed.listed, end=EndMarker(127, 127, "", False, NOW - 1, path="/usr/bin:/bin")),
            SPEC,
            "PATH was /usr/bin:/bin",
        ),
        (failed, replace(SPEC, inherited=(("PATH", "/opt/bin"),)), "PATH was /opt/bin"),
        (failed, SPEC, "PATH was the service's own"),
    ]
    for job, spec, where in cases:
        actions = decide(chain(seg(1), spec=spec), Facts(jobs={"j1": job}, progress=BEFORE), NOW)
        assert actions[-1] == Finish(ChainState.FAILED, message.format(where)), actions


def test_a_retry_time_left_on_a_segment_that_is_no_longer_being_submitted_is_no_clock_rule() -> None:
    assert math.isinf(quiet_until(chain(seg(1, Phase.PENDING, retry_at=NOW + 5)), NOW))
    assert quiet_until(chain(unsubmitted(1, retry_at=NOW + 5)), NOW) == NOW + 5


def test_a_chain_that_ends_cancels_the_job_its_next_segment_has_under_its_tag() -> None:
    """Completed, failed at its budget, or unrunnable: the segment being submitted after the one
    that ended it is cancelled by the job the scheduler shows under its tag."""
    ten = Progress(epoch=10, saved_at=500.0)
    marker = EndMarker(0, 0, "USR1", False, NOW - 1, progress=ten)
    endings = [
        (JobFacts(listed=ended("j1", Outcome.TIMEOUT).listed, end=marker), 0, ChainState.COMPLETED),
        (ended("j1", Outcome.FAILED, 1), SPEC.max_failures, ChainState.FAILED),
        (ended("j1", Outcome.FAILED, 127), 0, ChainState.FAILED),
    ]
    for job, failures, state in endings:
        c = chain(seg(1), unsubmitted(2, after="j1", retry_at=NOW + 60), failures=failures)
        facts = Facts(jobs={"j1": job}, tagged={2: (listed("j7", Phase.PENDING),)}, progress=BEFORE)
        actions = decide(c, facts, NOW)
        assert actions[-2:-1] == [Cancel(2, "j7", f"chain {state.value}")], actions
        assert isinstance(actions[-1], Finish) and actions[-1].state is state


def test_a_segment_that_resumed_from_an_older_checkpoint_is_credited_what_it_left() -> None:
    """It found epoch 2 (the newest checkpoint would not load) and left epoch 4: it trained,
    free; the chain's progress is what it left, epoch 4, though the chain had seen epoch 5."""
    found, left = Progress(epoch=2, saved_at=150.0), Progress(epoch=4, saved_at=250.0)
    job = JobFacts(
        end=EndMarker(0, 0, "USR1", False, NOW - 1, progress=left), start=StartMarker("j1", NOW - 61, found)
    )
    c = chain(seg(1), progress=Progress(epoch=5, saved_at=200.0))
    assert decide(c, Facts(jobs={"j1": job}, progress=left), NOW)[0] == end(
        Outcome.TIMEOUT,
        0,
        "timeout (exit 0) with progress: the command exited 0 after SIGUSR1",
        60.0,
        NOW - 1,
        left,
    )


# -- what a segment cancelled as the chain ends keeps ---------------------------------------


def running(job: str, since: float, found: Optional[Progress], listed_at: Optional[float] = None) -> JobFacts:
    """The listing shows ``job`` running (since ``listed_at``); its start marker says ``since``
    and the checkpoint it found."""
    return JobFacts(
        listed=listed(job, Phase.RUNNING, started_at=listed_at), start=StartMarker(job, since, found)
    )


def cancelled(c: object, jobs: dict[str, JobFacts], progress: Progress, asked: float = 0.0) -> list[object]:
    """The actions of a cancel asked for at ``asked`` (long ago: a running segment's grace is
    over), less the tracking of what the listing says of a job's start."""
    actions = decide(replace(c, cancel_requested_at=asked), Facts(jobs=jobs, progress=progress), NOW)  # type: ignore[type-var]
    return [a for a in actions if not isinstance(a, Track)]


def test_a_cancel_credits_each_running_segment_the_time_it_ran_and_the_progress_past_the_mark() -> None:
    """Cancelled while it runs: the time from its start (the listing's, else the start
    marker's) to now, at most its walltime, none before it started or with a clock ahead;
    the checkpoint now where it is past both what the segment found and the chain's mark."""
    epoch2, epoch5 = Progress(epoch=2, saved_at=50.0), Progress(epoch=5, saved_at=250.0)
    cases = [
        # (its start marker, the listing's start, the checkpoint it found, the checkpoint now): (Cancel's words, time, progress)
        ((NOW - 40, NOW - 50, BEFORE, AFTER), ("ran 50s; progress: epoch 4", 50.0, AFTER)),
        ((NOW - 40, None, BEFORE, AFTER), ("ran 40s; progress: epoch 4", 40.0, AFTER)),
        ((NOW - 500, None, BEFORE, AFTER), ("ran 1m40s; progress: epoch 4", 100.0, AFTER)),
        ((NOW - 1, None, BEFORE, AFTER), ("ran 1s; progress: epoch 4", 1.0, AFTER)),
        (
            (NOW - 40, None, epoch5, epoch5),
            ("ran 40s; progress: none made", 40.0, None),
        ),  # found it: not its own
        ((NOW - 40, None, epoch2, BEFORE), ("ran 40s; progress: none made", 40.0, None)),  # the mark already
        ((NOW + 5, None, BEFORE, AFTER), ("", 0.0, None)),  # its clock ahead of the service's
    ]
    for (since, listed_at, found, now), (words, elapsed, progress) in cases:
        jobs = {"j1": running("j1", since, found, listed_at)}
        reason = "chain cancelled" + (f"; {words}" if words else "")
        assert cancelled(chain(seg(1)), jobs, now) == [
            Cancel(1, "j1", reason, elapsed=elapsed, progress=progress),
            Finish(ChainState.CANCELLED, "cancelled by user"),
        ], (since, listed_at, found, now)


def test_a_cancel_of_a_job_that_ended_meanwhile_credits_its_run_to_its_end() -> None:
    """The listing says it ended 1 s ago after 89 s: that, not the time to now. Ended after the
    cancel was asked for, the cancel stopped it: cancelled, free. Ended before, it keeps how it
    ended (its progress judged as ever). A segment not yet submitted, with nothing under its
    tag, is cancelled as it is."""
    jobs = {"j1": ended("j1", Outcome.TIMEOUT)}
    c = chain(seg(1), unsubmitted(2, after="j1"))
    rest = [Cancel(2, None, "chain cancelled"), Finish(ChainState.CANCELLED, "cancelled by user")]
    words = "chain cancelled"
    stopped = EndSegment(1, Outcome.CANCELLED, 0, False, 89.0, NOW - 1, words, BEFORE, stop=KILLED_STOPPING)
    assert cancelled(c, jobs, BEFORE, asked=NOW - 2) == [stopped, *rest]
    (before, *after) = cancelled(c, jobs, BEFORE, asked=NOW)
    assert isinstance(before, EndSegment) and (before.outcome, before.charged) == (Outcome.TIMEOUT, True), (
        before
    )
    assert after == rest


def ends_the_chain(kind: str) -> tuple[object, dict[str, JobFacts], str]:
    """A chain whose segment 1 ends it, by ``kind``, while segment 2 (recorded as queued)
    has started: its job, its start marker, and the words the chain ends with."""
    target = Progress(epoch=10, saved_at=900.0)
    if kind == "completed":
        first = replace(
            ended("j1", Outcome.TIMEOUT), end=EndMarker(0, 0, "USR1", False, NOW - 1, progress=target)
        )
        return (
            chain(seg(1), seg(2, Phase.PENDING, after="j1")),
            {"j1": first},
            "target epoch 10 reached (epoch 10)",
        )
    if kind == "not found":
        first = replace(
            ended("j1", Outcome.FAILED, 127), end=EndMarker(127, 127, "", False, NOW - 1, path="/bin")
        )
        why = "command not found or not executable (exit 127): python train.py (PATH was /bin); "
        why += "run it by hand in the workdir, or list what it needs in inherit_env or [env]"
        return chain(seg(1), seg(2, Phase.PENDING, after="j1")), {"j1": first}, why
    tail = ("Traceback", "KeyError: 'lr'")
    crashed = replace(
        ended("j2", Outcome.FAILED, 1), end=EndMarker(1, 1, "", False, NOW - 1, progress=BEFORE, tail=tail)
    )
    if kind == "repeated":
        before = replace(seg(1, Phase.ENDED), outcome=Outcome.FAILED, exit_code=1, tail=tail)
        why = "segment 2 failed (exit 1) as segment 1 did, with the same output, before any progress: "
        why += "running it again cannot help; fix it and submit the job file again. Output: Traceback | KeyError: 'lr'"
        return chain(before, seg(2), seg(3, Phase.PENDING, after="j2"), baseline=BEFORE), {"j2": crashed}, why
    why = "failure budget spent (3 failures, max_failures = 2): segment 2 failed (exit 1): the command exited 1 on its own"
    return chain(seg(2), seg(3, Phase.PENDING, after="j2"), failures=2), {"j2": crashed}, why


def test_each_way_a_chain_ends_cancels_a_successor_that_started_crediting_what_it_did() -> None:
    """Completed, a command not found, a crash repeated, the failure budget spent: the
    successor recorded as queued has started meanwhile (its start marker says so) and is
    cancelled, credited the time it ran and the checkpoint it saved past what it found and
    past the chain's mark."""
    found, saved = Progress(epoch=5, saved_at=250.0), Progress(epoch=6, saved_at=300.0)
    for kind, state in (
        ("completed", ChainState.COMPLETED),
        ("not found", ChainState.FAILED),
        ("repeated", ChainState.FAILED),
        ("budget", ChainState.FAILED),
    ):
        c, jobs, why = ends_the_chain(kind)
        last = max(s.n for s in c.segments)  # type: ignore[attr-defined]
        jobs[f"j{last}"] = JobFacts(start=StartMarker(f"j{last}", NOW - 30, found))
        actions = decide(c, Facts(jobs=jobs, progress=saved), NOW)  # type: ignore[arg-type]
        credit = None if kind == "completed" else saved  # past the target reached, epoch 6 is none
        words = f"chain {state.value}; ran 30s; progress: {'epoch 6' if credit else 'none made'}"
        assert actions[-2:] == [
            Cancel(last, f"j{last}", words, elapsed=30.0, progress=credit),
            Finish(state, why),
        ], kind


# -- what the markers alone say a segment costs (the carrier's view) -------------------------


def test_charge_by_markers_charges_as_decide_from_the_end_and_start_markers_alone() -> None:
    """Whether it is charged, the checkpoint it left (its end marker's where that is past the
    mark, else the mark) and the time from its start marker to its end marker: what a
    segment that queues the next one reads of the one before it. None without an end marker."""
    older = Progress(epoch=2, saved_at=50.0)

    def judged(end: Optional[EndMarker], found: Optional[Progress] = BEFORE, **kw: object) -> object:
        start = StartMarker("j1", NOW - 61, found) if found is not None else None
        return charge_by_markers(JobFacts(end=end, start=start, **kw), older)  # type: ignore[arg-type]

    def stopped(code: int, progress: Optional[Progress], **kw: object) -> EndMarker:
        return EndMarker(code, code, "USR1", False, NOW - 1, progress=progress, **kw)  # type: ignore[arg-type]

    assert judged(None) is None
    still = JobFacts(listed=listed("j1", Phase.RUNNING), end=stopped(0, AFTER))  # the listing knows better
    assert charge_by_markers(still, older) is None
    assert [
        judged(stopped(0, AFTER)),  # a timeout with progress: free
        judged(stopped(0, BEFORE)),  # no progress past what it found: charged; past the mark
        judged(stopped(0, older), found=older),  # none, and not past the mark: the mark
        judged(stopped(0, None)),  # no checkpoint named: the mark
        judged(EndMarker(1, 1, "", False, NOW - 1, progress=AFTER)),  # a crash costs, progress or not
        judged(EndMarker(0, 0, "", True, NOW - 1)),  # skipped: the goal reached before it
        judged(stopped(0, AFTER), found=None),  # no start marker: from the mark; no time known
        judged(EndMarker(0, 0, "USR1", False, None, progress=AFTER)),  # no end time: no time known
        judged(EndMarker(0, 0, "USR1", False, NOW - 70, progress=AFTER)),  # an end before the start: none
    ] == [
        (False, AFTER, 60.0),
        (True, BEFORE, 60.0),
        (True, older, 60.0),
        (True, older, 60.0),
        (True, AFTER, 60.0),
        (False, older, 60.0),
        (False, AFTER, 0.0),
        (False, AFTER, 0.0),
        (False, AFTER, 0.0),
    ]
    node_fail = ListedJob("j1", "j1", Phase.ENDED, Outcome.NODE_FAIL, 1, NOW - 61, NOW - 1)
    # A node failure that left an intact checkpoint costs nothing; one that left none costs.
    assert judged(EndMarker(1, 1, "", False, NOW - 1, progress=BEFORE), accounting=node_fail) == (
        False,
        BEFORE,
        60.0,
    )
    assert judged(EndMarker(1, 1, "", False, NOW - 1), accounting=node_fail) == (True, older, 60.0)
    empty = Progress()  # a checkpoint that holds nothing is not intact
    assert judged(EndMarker(1, 1, "", False, NOW - 1, progress=empty), found=empty, accounting=node_fail) == (
        True,
        older,
        60.0,
    )


# -- how each segment ended, word for word -----------------------------------------------


def test_a_lost_host_ends_its_segments_lost_for_free_each_credited_its_time_and_the_checkpoint() -> None:
    """The pool host is gone: the running segment is lost at no cost, credited the time since
    it started (at most its walltime; none if it never started) and the checkpoint now where
    that is past the mark; the time counts against total_time, so the next segment gets
    what is left."""
    gone = "host gpu2 has not answered for 10m (host_timeout); its run is lost, at no cost"
    c = chain(seg(1, started_at=NOW - 50), used=880.0)
    facts = Facts(jobs={}, progress=AFTER, host_lost=gone)
    assert decide(c, facts, NOW) == [
        EndSegment(1, Outcome.LOST, None, False, 50.0, NOW, gone, AFTER),
        Submit(2, 70),  # 1000 - 880 - 50
    ]
    behind = Progress(epoch=2, saved_at=50.0)  # the checkpoint read now is behind the mark
    assert decide(chain(seg(1, started_at=NOW - 500)), replace(facts, progress=behind), NOW) == [
        EndSegment(1, Outcome.LOST, None, False, 100.0, NOW, gone, BEFORE),
        Submit(2, 100),
    ]
    assert decide(chain(seg(1, Phase.PENDING)), facts, NOW)[0] == EndSegment(
        1, Outcome.LOST, None, False, 0.0, NOW, gone, AFTER
    )


def test_a_job_queued_again_after_it_started_is_tracked_as_requeued_in_the_listings_words() -> None:
    """Requeued (the end marker of its first run says whether a preemption did it): the
    segment has not ended; the listing's reason follows."""
    again = [
        (None, ""),
        (EndMarker(0, 0, "USR1", False, NOW - 5), "BeginTime"),
        (EndMarker(0, 0, "USR1", False, NOW - 5, preempted=True), "Priority"),
    ]
    tracked = [
        decide(
            chain(seg(1, started_at=NOW - 60)),
            Facts(jobs={"j1": JobFacts(listed=listed("j1", Phase.PENDING, reason=reason), end=end)}),
            NOW,
        )[0]
        for end, reason in again
    ]
    assert tracked == [
        Track(1, Phase.PENDING, "requeued", None, None, False),
        Track(1, Phase.PENDING, "requeued; BeginTime", None, None, False),
        Track(1, Phase.PENDING, "preempted, requeued; Priority", None, None, True),
    ]


def test_the_words_and_the_charge_of_a_fenced_a_preempted_and_a_held_back_segment() -> None:
    """Fenced: free, whatever it left. Preempted: free with or without progress, said so.
    Killed by the walltime signal it had said it was ready for, the last time it held
    it back: charged, saying so. Every end keeps when the signal came."""

    def ending(marker: EndMarker, progress: Progress = BEFORE) -> EndSegment:
        job = JobFacts(listed=listed("j1", Phase.ENDED, started_at=NOW - 61, ended_at=NOW - 1), end=marker)
        first = decide(chain(seg(1)), Facts(jobs={"j1": job}, progress=progress), NOW)[0]
        assert isinstance(first, EndSegment)
        return first

    fenced = ending(EndMarker(75, 75, "", False, NOW - 1, fenced="segment 2 (job j2)"))
    assert (fenced.outcome, fenced.charged, fenced.reason) == (
        Outcome.FENCED,
        False,
        "fenced: fenced: segment 2 (job j2) of the chain owns the checkpoint; stopped without committing: free",
    )
    preempted = [
        ending(EndMarker(0, 0, "TERM", False, NOW - 1, progress=p, preempted=True, signalled_at=NOW - 9))
        for p in (AFTER, BEFORE)
    ]
    assert [(e.outcome, e.charged, e.reason, e.signalled_at) for e in preempted] == [
        (
            Outcome.PREEMPTED,
            False,
            "preempted (exit 0) with progress: the command exited 0 after SIGTERM (the job was preempted)",
            NOW - 9,
        ),
        (
            Outcome.PREEMPTED,
            False,
            "preempted (exit 0) before any progress: not charged: the command exited 0 after SIGTERM "
            "(the job was preempted)",
            NOW - 9,
        ),
    ]
    held = ending(EndMarker(138, 138, "USR1", False, NOW - 1, ready="0", signalled_at=NOW - 3))
    assert (held.outcome, held.charged, held.reason, held.signalled_at) == (
        Outcome.TIMEOUT,
        True,
        "timeout (exit 138) and made no progress: SIGUSR1 killed the command which never said it was ready "
        "for the walltime signal (held back until then: the command was still starting, or no longer makes "
        "its SegmentClock)",
        NOW - 3,
    )


def test_a_preemption_the_marker_saw_overrides_a_listing_that_says_failed() -> None:
    """The listing says failed (exit 1), the end marker says the preemption signal came first:
    preempted, free. Gone from the listing, accounting's start counts before the start marker's."""
    marker = EndMarker(1, 1, "TERM", False, NOW - 1, preempted=True)
    failed = listed(
        "j1", Phase.ENDED, outcome=Outcome.FAILED, exit_code=1, started_at=NOW - 61, ended_at=NOW - 1
    )
    for job in (
        JobFacts(listed=failed, end=marker),
        JobFacts(accounting=failed, end=marker, start=StartMarker("j1", NOW - 31, None)),
    ):
        assert decide(chain(seg(1)), Facts(jobs={"j1": job}, progress=BEFORE), NOW)[0] == EndSegment(
            1,
            Outcome.PREEMPTED,
            1,
            False,
            60.0,
            NOW - 1,
            "preempted (exit 1) before any progress: not charged: the command exited 1 after SIGTERM "
            "(the job was preempted)",
            BEFORE,
        )


def test_the_time_a_segment_trained_comes_from_the_best_evidence_of_its_last_run() -> None:
    """The listing's start of the run that ended counts before the start the store recorded
    (an earlier run, requeued since); a job held by the scheduler counts from the listing's start."""
    c = chain(seg(1, started_at=NOW - 200))
    job = ended("j1", Outcome.FAILED, 1)  # started NOW - 90, ended NOW - 1
    assert decide(c, Facts(jobs={"j1": job}, progress=BEFORE), NOW)[0] == end(
        Outcome.FAILED, 1, "failed (exit 1)", 89.0, NOW - 1, BEFORE
    )
    held = listed("j1", Phase.ENDED, exit_code=3, started_at=NOW - 50, ended_at=NOW - 10, stuck=True)
    gone = JobFacts(listed=held, start=StartMarker("j1", NOW - 20, None))
    assert decide(chain(seg(1)), Facts(jobs={"j1": gone}, progress=BEFORE), NOW)[1] == end(
        Outcome.FAILED, 3, "failed (exit 3)", 40.0, NOW - 10, BEFORE
    )


def test_a_segment_being_submitted_adopts_the_job_its_claim_names() -> None:
    """Its submission never answered, but its claim (taken before the submission) names the job."""
    c = chain(seg(1), unsubmitted(2, after="j1"))
    facts = Facts(
        jobs={"j1": shown("j1", Phase.RUNNING)}, carried={2: Carried("j7", 100, "j1", by="service")}
    )
    assert decide(c, facts, NOW) == [Adopt(2, "j7", "adopted after a restart")]


def test_a_crash_repeats_only_with_a_status_below_128_and_the_same_output_clipped_to_200() -> None:
    """Exit 0 or 128 and over (a signal) may go another way next time: charged, the chain goes
    on. Exit 1 to 127 with the same last lines ends it, the lines shown clipped to 200
    characters; the segment after it (which ran first: a dependency dropped) counts too."""
    long = "E" * 250
    for code, repeats in ((0, False), (1, True), (127, True), (128, False)):
        before = replace(seg(1, Phase.ENDED), outcome=Outcome.FAILED, exit_code=code, tail=(long,))
        crash = replace(
            ended("j2", Outcome.FAILED, code), end=EndMarker(code, code, "", False, NOW - 1, tail=(long,))
        )
        c = chain(before, seg(2), baseline=BEFORE)
        last = decide(c, Facts(jobs={"j2": crash}, progress=BEFORE), NOW)[-1]
        assert isinstance(last, Finish) is repeats, code
    after = replace(seg(3, Phase.ENDED), outcome=Outcome.FAILED, exit_code=1, tail=(long,))
    crash = replace(ended("j2", Outcome.FAILED, 1), end=EndMarker(1, 1, "", False, NOW - 1, tail=(long,)))
    last = decide(chain(seg(2), after, baseline=BEFORE), Facts(jobs={"j2": crash}, progress=BEFORE), NOW)[-1]
    assert last == Finish(
        ChainState.FAILED,
        "segment 3 failed (exit 1) as segment 2 did, with the same output, before any progress: running it "
        f"again cannot help; fix it and submit the job file again. Output: {'E' * 199}…",
    )


def test_a_container_that_cannot_start_ends_the_chain_once_and_its_queued_successor_is_free() -> None:
    """The runtime's own failure (apptainer: exit 255, FATAL) in the chain's first segment ends
    it in the runtime's words; the successor queued behind it, which failed alike before the
    service saw the first end, is not charged again."""
    spec = replace(SPEC, container="img.sif", container_runtime="apptainer")
    fatal = ("FATAL:   could not open image img.sif: no such file",)

    def failed(job: str) -> JobFacts:
        return replace(
            ended(job, Outcome.FAILED, 255), end=EndMarker(255, 255, "", False, NOW - 1, tail=fatal)
        )

    c = chain(seg(1), seg(2, Phase.PENDING, after="j1"), spec=spec)
    actions = decide(c, Facts(jobs={"j1": failed("j1"), "j2": failed("j2")}, progress=BEFORE), NOW)
    assert [(a.n, a.charged, a.reason) for a in actions if isinstance(a, EndSegment)] == [
        (1, True, "failed (exit 255): the command exited 255 on its own"),
        (2, False, "failed (exit 255): the same as segment 1"),
    ]
    assert actions[-1] == Finish(
        ChainState.FAILED,
        f"apptainer could not start the command in img.sif (exit 255): {fatal[0]}; fix the image or runtime "
        "on the machine the segments run on, then submit again",
    )


# -- a cancel: the queue at once, the running segment its grace to save (issue 36) --------------


def test_a_cancelled_running_segment_is_credited_its_time_and_progress_a_queued_one_nothing() -> None:
    """A user's cancel ends the running segment with the time it ran (from its start to now)
    and the checkpoint it reached (once its grace to stop is over, here: it was asked for long
    ago); the successor queued behind it never ran: nothing."""
    c = chain(seg(1, started_at=NOW - 40), seg(2, Phase.PENDING, after="j1"), cancel_requested_at=0.0)
    reached = Progress(epoch=8, saved_at=NOW - 1)
    jobs = {
        "j1": JobFacts(
            listed=ListedJob("j1", "j1", Phase.RUNNING, started_at=NOW - 40),
            start=StartMarker("j1", NOW - 40, BEFORE),
        ),
        "j2": JobFacts(listed=ListedJob("j2", "j2", Phase.PENDING)),
    }
    assert decide(c, Facts(jobs=jobs, progress=reached), NOW) == [
        Cancel(
            n=1,
            job_id="j1",
            reason="chain cancelled; ran 40s; progress: epoch 8",
            elapsed=40.0,
            progress=reached,
        ),
        Cancel(n=2, job_id="j2", reason="chain cancelled"),
        Finish(state=ChainState.CANCELLED, reason="cancelled by user"),
    ]


def test_a_cancel_cancels_the_queue_at_once_and_gives_the_running_segment_its_grace_to_save() -> None:
    """Issue 36, findings 1 and 2. Asked for 5 s ago: the successor queued behind the running
    segment is cancelled at once, the running one is left to stop (its runner has the final
    marker: the signal now, the kill after its grace), and the chain goes on until it has."""
    c = chain(seg(1, started_at=NOW - 40), seg(2, Phase.PENDING, after="j1"), cancel_requested_at=NOW - 5)
    jobs = {
        "j1": JobFacts(listed=ListedJob("j1", "j1", Phase.RUNNING, started_at=NOW - 40)),
        "j2": JobFacts(listed=ListedJob("j2", "j2", Phase.PENDING)),
    }
    assert decide(c, Facts(jobs=jobs, progress=BEFORE), NOW) == [
        Cancel(n=2, job_id="j2", reason="chain cancelled")
    ]
    # Just started (the store has it queued, the listing running): it is given its grace too.
    queued = chain(seg(1, Phase.PENDING), seg(2, Phase.PENDING, after="j1"), cancel_requested_at=NOW - 5)
    waits = [a for a in decide(queued, Facts(jobs=jobs, progress=BEFORE), NOW) if not isinstance(a, Track)]
    assert waits == [Cancel(n=2, job_id="j2", reason="chain cancelled")]
    # Its grace (SPEC's) and the slack after it are over, to the second: cancelled as it stands.
    late = NOW - 5 + SPEC.grace + CANCEL_SLACK
    assert [type(a) for a in decide(c, Facts(jobs=jobs, progress=BEFORE), late - 0.5)] == [Cancel]
    ran = late - (NOW - 40)
    assert decide(c, Facts(jobs=jobs, progress=BEFORE), late) == [
        Cancel(1, "j1", f"chain cancelled; ran {format_duration(ran)}; progress: none made", ran),
        Cancel(2, "j2", "chain cancelled"),
        Finish(ChainState.CANCELLED, "cancelled by user"),
    ]


def test_a_segment_the_cancel_stopped_keeps_what_it_saved_and_its_times_free_of_charge() -> None:
    """It saved on the signal (epoch 5) and exited: recorded cancelled, not charged, with its
    progress, its signal's time and the time it ran; then the chain ends. A segment that ended
    on its walltime before the cancel keeps its own outcome."""
    saved = Progress(epoch=5, saved_at=NOW - 3)
    end = EndMarker(0, 0, "USR1", False, NOW - 2, progress=saved, signalled_at=NOW - 4)
    c = chain(seg(1, started_at=NOW - 30), cancel_requested_at=NOW - 5)
    stopped = JobFacts(
        listed=ListedJob(
            "j1", "j1", Phase.ENDED, Outcome.COMPLETED, 0, started_at=NOW - 30, ended_at=NOW - 2
        ),
        start=StartMarker("j1", NOW - 30, BEFORE),
        end=end,
    )
    (ended, finish) = decide(c, Facts(jobs={"j1": stopped}, progress=saved), NOW)
    assert isinstance(ended, EndSegment) and finish == Finish(ChainState.CANCELLED, "cancelled by user")
    assert (ended.outcome, ended.charged, ended.progress, ended.signalled_at, ended.elapsed) == (
        Outcome.CANCELLED, False, saved, NOW - 4, 28.0
    ), ended  # fmt: skip
    assert ended.reason == "chain cancelled; the command exited 0 after SIGUSR1"
    # Asked for in the very second it ended (the markers keep whole seconds): the cancel's too.
    same = replace(stopped, end=replace(end, signalled_at=NOW - 2))
    (ended, _) = decide(
        replace(c, cancel_requested_at=NOW - 1.5), Facts(jobs={"j1": same}, progress=saved), NOW
    )
    assert isinstance(ended, EndSegment) and ended.outcome is Outcome.CANCELLED, ended
    # Its walltime's signal came before the cancel: a timeout with progress, as it was.
    early = replace(stopped, end=replace(end, signalled_at=NOW - 6))
    (ended, _) = decide(c, Facts(jobs={"j1": early}, progress=saved), NOW)
    assert isinstance(ended, EndSegment) and ended.outcome is Outcome.TIMEOUT and not ended.charged, ended
    # It crashed on its own, no signal passed on: failed, charged, as it would be uncancelled.
    crashed = replace(
        stopped,
        listed=replace(stopped.listed, outcome=Outcome.FAILED, exit_code=1),
        end=replace(end, exit_code=1, original=1, signal="", signalled_at=None),
    )
    (ended, _) = decide(c, Facts(jobs={"j1": crashed}, progress=BEFORE), NOW)
    assert isinstance(ended, EndSegment) and ended.outcome is Outcome.FAILED, ended
    # Its signal's time unknown (a runner that does not record it): stopped by the cancel.
    unknown = replace(stopped, end=replace(end, signalled_at=None))
    (ended, _) = decide(c, Facts(jobs={"j1": unknown}, progress=saved), NOW)
    assert isinstance(ended, EndSegment) and ended.outcome is Outcome.CANCELLED, ended


def test_a_successor_that_skipped_for_the_cancels_final_marker_leaves_the_chain_cancelled() -> None:
    """The successor started as the cancelled segment ended, found the final marker and ran
    nothing: skipped, free, and the chain ends cancelled, not completed ("the goal reached")."""
    skip = EndMarker(0, 0, "", True, NOW - 1, skip="the chain has already ended")
    c = chain(seg(2, started_at=NOW - 2), cancel_requested_at=NOW - 5)
    listed = ListedJob("j2", "j2", Phase.ENDED, Outcome.COMPLETED, 0, started_at=NOW - 2, ended_at=NOW - 1)
    (ended, finish) = decide(c, Facts(jobs={"j2": JobFacts(listed=listed, end=skip)}, progress=BEFORE), NOW)
    assert isinstance(ended, EndSegment) and ended.outcome is Outcome.SKIPPED and not ended.charged, ended
    assert finish == Finish(ChainState.CANCELLED, "cancelled by user")


def test_a_cancelled_segment_that_made_no_progress_keeps_its_time_and_the_mark() -> None:
    """Time is credited whatever the checkpoint says; the mark moves only forward."""
    c = chain(seg(1, started_at=NOW - 30), cancel_requested_at=0.0)
    (cancel, _) = decide(c, Facts(jobs={}, progress=BEFORE), NOW)
    assert cancel == Cancel(
        n=1, job_id="j1", reason="chain cancelled; ran 30s; progress: none made", elapsed=30.0, progress=None
    )
    # A segment still running after its walltime (100 s) is credited its walltime alone.
    (cancel, _) = decide(chain(seg(1, started_at=NOW - 500), cancel_requested_at=0.0), Facts(), NOW)
    assert isinstance(cancel, Cancel) and cancel.elapsed == 100.0


# -- start-up that eats the segments (decide/startup.py) --------------------------------------


def started(
    n: int, ready: Optional[float], outcome: Outcome = Outcome.TIMEOUT, signal: float = 80.0
) -> Segment:
    """Segment ``n``, started at 1000 n, its signal ``signal`` s later, ready ``ready`` s in."""
    at = 1000.0 * n
    return seg(
        n,
        Phase.ENDED,
        outcome=outcome,
        started_at=at,
        signalled_at=at + signal,
        ready_at=None if ready is None else at + ready,
        ended_at=at + signal + 5,
    )


def test_two_segments_in_a_row_that_started_for_most_of_their_time_are_warned_of_with_the_numbers() -> None:
    warning = slow_start([started(1, 10), started(2, 41), started(3, 79)])
    assert warning.startswith("start-up takes most of each segment: ")
    assert "more than 50% of the time before it (segment 2 41s of 1m20s, segment 3 1m19s of 1m20s)" in warning
    assert warning.endswith(
        "; use a longer walltime, a smaller grace, or less work before the SegmentClock is made (imports, data loading)"
    )


@pytest.mark.parametrize(
    ("segments", "why"),
    [
        ([started(1, 41)], "one segment alone"),
        ([started(1, 41), started(2, 40)], "half its time exactly is not more than half"),
        ([started(1, 41), started(2, 79), started(3, 10)], "the last one started quickly"),
        ([started(1, 41), started(2, None)], "a command that never said it was ready"),
        (
            [started(1, 41), started(2, 79, Outcome.COMPLETED)],
            "finished on its own: no signal to train up to",
        ),
        ([started(1, 41), started(2, 79, Outcome.FAILED)], "a crash: its own problem, said as such"),
        ([started(1, 41), started(2, 5, signal=0)], "no time before the signal: nothing to measure"),
        ([started(1, 41), started(2, 5, signal=-3)], "a signal before the start (a clock askew)"),
    ],
)
def test_no_warning_unless_the_last_two_that_ran_started_for_over_half_their_time(
    segments: list[Segment], why: str
) -> None:
    assert slow_start(segments) == "", why


def test_segments_that_never_ran_between_two_slow_ones_do_not_break_the_row() -> None:
    """A successor cancelled while queued, or one not ended yet, ran nothing: the row is of
    the segments that ran."""
    never = seg(2, Phase.ENDED, outcome=Outcome.CANCELLED)
    running = seg(4, Phase.RUNNING, started_at=4000.0)
    assert slow_start([started(1, 41), never, started(3, 60), running]) != ""
    assert starting(started(1, 90, signal=80)) == (90.0, 80.0)  # held past its time: all of it
    assert slow_start([started(1, 0.9, signal=1), started(2, 0.6, signal=1)]) != ""  # a second is a time
    assert starting(replace(started(1, 30), ready_at=999.0)) == (0.0, 80.0)  # a clock askew


def test_a_segments_end_records_when_its_command_was_ready_from_its_end_marker() -> None:
    marker = EndMarker(0, 0, "USR1", False, NOW - 1, progress=AFTER, signalled_at=NOW - 20, ready_at=NOW - 70)
    (done, *_) = decide(chain(seg(1)), Facts(jobs={"j1": JobFacts(end=marker)}, progress=AFTER), NOW)
    assert isinstance(done, EndSegment) and done.ready_at == NOW - 70 and done.signalled_at == NOW - 20


# -- a shorter limit granted (walltime = "MIN..MAX", Slurm's backfill) -----------------------


@pytest.mark.parametrize(
    ("granted", "recorded"),
    [
        (60, 60),  # shorter than the 100 s asked: the segment's walltime from now on
        (1, 1),  # a second is a limit
        (99, 99),
        (100, None),  # what it asked for: nothing to record
        (150, None),  # longer: never (the scheduler cannot grant more than asked)
        (0, None),  # no limit read
        (None, None),  # a start marker that says none (no range, or not Slurm)
    ],
)
def test_a_running_segment_records_a_shorter_limit_granted_and_nothing_else(
    granted: Optional[int], recorded: Optional[int]
) -> None:
    running = seg(1, started_at=NOW - 30)
    listed = ListedJob("j1", "j1", Phase.RUNNING, started_at=NOW - 30)
    job = JobFacts(listed=listed, start=StartMarker("j1", NOW - 30, None, granted))
    tracks = [
        a
        for a in decide(chain(running), Facts(jobs={"j1": job}, progress=BEFORE), NOW)
        if isinstance(a, Track)
    ]
    assert tracks == ([Track(1, Phase.RUNNING, "", None, None, walltime=recorded)] if recorded else []), (
        tracks
    )
    # Tracked for another reason (it started), it carries the limit only as above.
    queued = seg(1, Phase.PENDING)
    (started,) = [
        a
        for a in decide(chain(queued), Facts(jobs={"j1": job}, progress=BEFORE), NOW)
        if isinstance(a, Track)
    ]
    assert started.phase is Phase.RUNNING and started.walltime == recorded, started
    unmarked = JobFacts(listed=listed)  # no start marker yet
    assert not [
        a
        for a in decide(chain(running), Facts(jobs={"j1": unmarked}, progress=BEFORE), NOW)
        if isinstance(a, Track)
    ]
