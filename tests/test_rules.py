"""The rules beside decide(), as tables: which listed job is a segment's, when to try again (a failed submission, a chain whose
ticks keep failing, accounting that did not know a job, a cancel the scheduler did not
take) and where and when a new segment may
start (a pool's slots and hosts, a sweep's max_concurrent)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_decide import NOW, SPEC, chain, seg

from chainrun.decide import Facts
from chainrun.decide.chain import listed_as_its
from chainrun.decide.placement import (
    fenced,
    free_slots,
    held_back,
    observe_on,
    observed_on,
    place,
    settle,
    to_place,
    unplaced,
    uses_slot,
    waiting_change,
    waiting_reason,
)
from chainrun.decide.retry import (
    ACCOUNTING_FIRST,
    ACCOUNTING_MAX,
    CANCEL_OWED_FOR,
    STUCK_AFTER,
    STUCK_RETRY,
    accounting_again,
    after_fault,
    backoff,
    owed_given_up,
    owed_to_send,
)
from chainrun.model import (
    WAITING_FOR_A_SLOT,
    ChainState,
    ListedJob,
    MarkStuck,
    Outcome,
    Phase,
    Remove,
    SchedulerSpec,
    Submit,
    Wait,
)

POOL = replace(SPEC, scheduler=SchedulerSpec(hosts=("gpu1", "gpu2", "gpu3"), slots=2))
SHARED_POOL = replace(SPEC, scheduler=replace(POOL.scheduler, workdir_shared=True))


@pytest.mark.parametrize(
    ("attempts", "seconds"),
    [(0, 5), (1, 5), (2, 10), (3, 20), (4, 40), (5, 80), (6, 160), (7, 300), (8, 300)],
)
def test_a_failed_submission_waits_5_s_doubling_up_to_5_min(attempts: int, seconds: float) -> None:
    assert backoff(attempts) == seconds


def test_accounting_is_asked_again_after_10_s_doubling_up_to_2_min() -> None:
    waiting: dict[str, tuple[float, float]] = {}
    intervals = []
    for _ in range(6):
        waiting["j1"] = accounting_again("j1", waiting, NOW)
        intervals.append(waiting["j1"][1])
        assert waiting["j1"][0] == NOW + intervals[-1]
    assert (
        intervals
        == [ACCOUNTING_FIRST, 20.0, 40.0, 80.0, ACCOUNTING_MAX, ACCOUNTING_MAX]
        == [10, 20, 40, 80, 120, 120]
    )


def test_a_chain_whose_ticks_keep_failing_is_marked_stuck_once_and_tried_every_10_min() -> None:
    active = chain()
    assert [after_fault(active, n, "boom", NOW) for n in range(1, STUCK_AFTER)] == [(None, None)] * (
        STUCK_AFTER - 1
    )
    reason = f"{STUCK_AFTER} ticks in a row failed, the last with boom; tried again every 600s"
    assert after_fault(active, STUCK_AFTER, "boom", NOW) == (NOW + STUCK_RETRY, MarkStuck(reason))
    stuck = replace(active, state=ChainState.STUCK)
    assert after_fault(stuck, STUCK_AFTER + 1, "boom", NOW) == (NOW + 600.0, None)


def test_an_owed_cancel_is_sent_to_the_jobs_still_listed_as_not_ended_under_their_name_alone() -> None:
    listed = {
        "1": ListedJob("1", "cr.c.7", Phase.RUNNING),
        "2": ListedJob("2", "cr.c.8", Phase.PENDING, reason="Dependency"),
        "3": ListedJob("3", "cr.c.6", Phase.ENDED, outcome=Outcome.COMPLETED),
        "5": ListedJob("5", "cr.c.9", Phase.PENDING),  # listed, but owed no cancel
        "6": ListedJob("6", "preprocess", Phase.PENDING),  # took the id of a job owed one
    }
    why = "its cancel did not reach the scheduler, which did not answer; sent again now that it answers"
    owed = {
        "1": (7, "cr.c.7"),
        "2": (8, "cr.c.8"),
        "3": (6, "cr.c.6"),
        "4": (5, "cr.c.5"),
        "6": (4, "cr.c.4"),
    }
    # 3 ended, 4 is gone and 6 is another job under its id: owed nothing more.
    assert owed_to_send(owed, listed) == [Remove(7, "1", why), Remove(8, "2", why)]
    assert owed_to_send({k: owed[k] for k in "346"}, listed) == []


def test_a_listed_job_is_a_segments_only_under_its_id_and_the_name_it_was_given() -> None:
    """A cluster back with its state lost numbers jobs anew: a job of the user's that took a
    segment's id is not that segment's (not waited on, not cancelled with the chain)."""
    listed = {
        "j1": ListedJob("j1", "cr.c.1", Phase.RUNNING),
        "j2": ListedJob("j2", "preprocess", Phase.RUNNING),  # took segment 2's id
        "j3": ListedJob("j3", "cr.c.3", Phase.PENDING),  # under the tag of another segment
        "j4": ListedJob("j4", "cr.sweep.a", Phase.PENDING),  # an array's task
    }
    assert listed_as_its(listed, seg(1), "cr.c.1") is listed["j1"]
    assert listed_as_its(listed, seg(2), "cr.c.2") is None
    assert listed_as_its(listed, seg(3), "cr.c.4") is None
    assert listed_as_its(listed, seg(4, array="cr.sweep.a"), "cr.c.4") is listed["j4"]
    assert (
        listed_as_its(listed, seg(1, array="cr.sweep.a"), "cr.c.1") is None
    )  # a task goes by its array's name
    assert listed_as_its(listed, seg(5), "cr.c.5") is None  # not listed
    assert listed_as_its(listed, replace(seg(1), job_id=None), "cr.c.1") is None  # not submitted yet


@pytest.mark.parametrize(
    ("owed_for", "given_up"),
    [(0.0, False), (CANCEL_OWED_FOR - 1, False), (CANCEL_OWED_FOR, False), (CANCEL_OWED_FOR + 1, True)],
)
def test_an_owed_cancel_is_given_up_once_owed_for_over_a_week_saying_what_to_do(
    owed_for: float, given_up: bool
) -> None:
    assert CANCEL_OWED_FOR == 7 * 86400
    said = owed_given_up({"41": NOW - owed_for, "42": NOW}, "slurm on login1", NOW)
    expected = (
        "job 41: its cancel has not reached slurm on login1 in 7d of trying; given up: if the job is "
        "still there, cancel it by hand"
    )
    assert said == ({"41": expected} if given_up else {})


def test_a_job_uses_a_slot_while_it_runs_or_could_run_not_while_it_waits_for_its_predecessor() -> None:
    running, ready = (
        ListedJob("1", "a", Phase.RUNNING),
        ListedJob("2", "b", Phase.PENDING, reason="Resources"),
    )
    waiting = ListedJob("3", "c", Phase.PENDING, reason="Dependency")
    done = ListedJob("4", "d", Phase.ENDED)
    assert [uses_slot(j) for j in (running, ready, waiting, done)] == [True, True, False, False]
    assert free_slots(4, [running, ready, waiting, done], placed=1) == 1


def test_a_pools_new_segment_is_placed_a_successor_or_a_journaled_one_is_not() -> None:
    fresh = chain(spec=POOL)
    assert to_place(fresh, Submit(1, 100))
    after_one = chain(replace(seg(1, Phase.ENDED), host="gpu2"), spec=POOL)
    assert to_place(after_one, Submit(2, 100))
    assert not to_place(chain(seg(1), spec=POOL), Submit(2, 100, after="j1"))
    assert not to_place(chain(seg(1, Phase.SUBMITTING), spec=POOL), Submit(1, 100))
    assert not to_place(chain(), Submit(1, 100))  # no pool: the chain's one host


def test_place_and_where_a_chain_with_no_segment_under_way_is_looked_at() -> None:
    assert place([], None, {}) is None
    assert place(["gpu1", "gpu2"], None, {"gpu1": 0, "gpu2": 0}) is None
    moved = chain(replace(seg(1, Phase.ENDED), host="gpu2"), spec=SHARED_POOL)
    assert observed_on(moved, {"gpu1", "gpu2"}) == "gpu2"  # where it ran last
    assert observed_on(moved, {"gpu3", "gpu1"}) == "gpu1"  # else the first of its hosts that answered
    assert observed_on(moved, set()) is None
    kept = chain(replace(seg(1, Phase.ENDED), host="gpu2"), spec=POOL)  # the workdir not shared
    assert observed_on(kept, {"gpu1", "gpu2"}) == "gpu2"
    assert observed_on(kept, {"gpu3", "gpu1"}) is None  # its checkpoint is on gpu2's disk alone


def test_a_pool_chain_is_looked_at_on_its_host_elsewhere_once_that_is_gone_or_not_at_all() -> None:
    """observe_on: a live chain is read on its host; once that host has been silent for
    host_timeout, from the first host that answered, its segments lost; before that, not at
    all. One with no live segment goes where observed_on says, or, stranded, waits."""
    timeout = POOL.scheduler.host_timeout
    running = chain(replace(seg(1), host="gpu2"), spec=POOL)
    assert observe_on(running, {"gpu1", "gpu2"}, None, NOW) == ("gpu2", None)
    assert observe_on(running, {"gpu3", "gpu1"}, NOW - timeout + 1, NOW) is None  # not gone yet
    assert observe_on(running, {"gpu3", "gpu1"}, NOW - timeout, NOW) == (
        "gpu1",
        f"host gpu2 has not answered for {timeout // 60}m (host_timeout); its run is lost, at no cost",
    )
    assert observe_on(running, set(), NOW - timeout, NOW) is None  # nowhere to look from
    kept = chain(replace(seg(1, Phase.ENDED), host="gpu2"), spec=POOL)
    assert observe_on(kept, {"gpu1", "gpu2"}, None, NOW) == ("gpu2", None)
    assert observe_on(kept, {"gpu3", "gpu1"}, None, NOW) == ("gpu1", "")  # waits, saying why
    assert observe_on(kept, set(), None, NOW) is None
    assert observe_on(chain(spec=POOL), {"gpu3"}, None, NOW) == ("gpu3", None)


def test_settle_places_a_new_segment_or_has_it_wait_and_fences_a_returned_hosts_jobs() -> None:
    """What decide answers for a pool: the new segment on a host with a free slot, or no
    submission and why; a successor where its chain is; a sweep's first segment as an array
    task; and a Remove of each job a host that is back still runs of a segment lost there."""
    fresh = chain(spec=POOL)
    assert settle(fresh, Facts(free={"gpu1": 0, "gpu2": 1}), [Submit(1, 100)]) == [
        Submit(1, 100, host="gpu2")
    ]
    why = "waiting for a free slot on hosts gpu1, gpu2 (gpu3 not reached)"
    assert settle(fresh, Facts(free={"gpu1": 0, "gpu2": 0}), [Submit(1, 100)]) == [Wait(why)]
    waiting = replace(fresh, reason=why)
    assert settle(waiting, Facts(free={"gpu1": 0, "gpu2": 0}), [Submit(1, 100)]) == []  # said once
    assert settle(waiting, Facts(free={"gpu1": 1}), [Submit(1, 100)]) == [
        Wait(""),
        Submit(1, 100, host="gpu1"),
    ]
    running = chain(replace(seg(1), host="gpu2"), spec=POOL)
    assert settle(running, Facts(free={}), [Submit(2, 100, after="j1")]) == [Submit(2, 100, after="j1")]
    sweep = replace(SPEC, sweep_name="lr")
    assert settle(chain(spec=sweep), Facts(arrays=True), [Submit(1, 100)]) == [Submit(1, 100, task=True)]
    assert settle(chain(spec=sweep), Facts(), [Submit(1, 100)]) == [Submit(1, 100)]
    lost = replace(seg(1, Phase.ENDED), host="gpu1", outcome=Outcome.LOST)
    moved = chain(lost, replace(seg(2), host="gpu2"), spec=POOL)
    listed = {1: (ListedJob("j1", "cr.c.1", Phase.RUNNING),), 2: (ListedJob("j9", "cr.c.2", Phase.ENDED),)}
    assert settle(moved, Facts(pool_jobs={"gpu1": listed, "gpu2": listed}), []) == [
        Remove(1, "j1", "segment 1 was ended as lost while host gpu1 was away; the chain went on", "gpu1")
    ]


def test_a_chain_moves_to_another_host_only_when_its_workdir_is_shared() -> None:
    """Its host busy or gone: a chain whose workdir is shared goes to the freest host; one
    whose checkpoint is on its host's disk alone waits for that host, saying why."""
    hosts = ["gpu1", "gpu2"]
    assert place(hosts, "gpu2", {"gpu1": 2, "gpu2": 0}, shared=True) == "gpu1"
    assert place(hosts, "gpu2", {"gpu1": 2, "gpu2": 0}, shared=False) is None
    assert place(hosts, "gpu2", {"gpu1": 2}, shared=False) is None
    assert place(hosts, None, {"gpu1": 2}, shared=False) == "gpu1"  # never ran: anywhere
    kept = chain(replace(seg(1, Phase.ENDED), host="gpu2"), spec=POOL)
    assert waiting_reason(kept, {"gpu1"}) == (
        "waiting for host gpu2 to answer: the checkpoint is on its disk (the workdir is not shared by the pool)"
    )
    assert waiting_reason(kept, {"gpu1", "gpu2"}) == "waiting for a free slot on hosts gpu2"


def test_why_a_pools_chain_waits_names_the_hosts_that_answered_and_those_that_did_not() -> None:
    fresh = chain(spec=POOL)
    assert waiting_reason(fresh, set()) == "waiting for a host to answer"
    assert waiting_reason(fresh, {"gpu1"}) == "waiting for a free slot on hosts gpu1 (gpu2, gpu3 not reached)"
    assert (
        waiting_reason(fresh, set(POOL.scheduler.hosts))
        == "waiting for a free slot on hosts gpu1, gpu2, gpu3"
    )


def test_a_pools_chain_says_once_why_it_waits_and_clears_it_when_it_goes_on() -> None:
    why = waiting_reason(chain(spec=POOL), {"gpu1"})
    assert why.startswith(WAITING_FOR_A_SLOT)
    fresh = chain(spec=POOL)
    assert waiting_change(fresh, why) == Wait(why)
    assert waiting_change(replace(fresh, reason=why), why) is None
    assert waiting_change(replace(fresh, reason=why), "") == Wait("")
    assert waiting_change(replace(fresh, reason="something else"), "") is None
    assert waiting_change(chain(), why) is None  # no pool


def test_max_concurrent_holds_back_the_newest_of_a_sweeps_chains_that_have_not_started() -> None:
    sweep = replace(SPEC, sweep_name="lr", max_concurrent=1)
    other = chain()  # no sweep: never held, never counted
    started = replace(chain(seg(1), spec=sweep), id="a", created_at=1.0)
    first, second = (replace(chain(spec=sweep), id=i, created_at=at) for i, at in (("b", 2.0), ("c", 3.0)))
    assert held_back([other, started, first, second]) == {"b", "c"}
    assert held_back([other, first, second]) == {"c"}


def test_a_submission_another_claimant_holds_is_adopted_once_its_claim_names_the_job() -> None:
    """after_submit for a ClaimedError: the job the claim names is adopted, saying who queued
    it; while it names none (a submission under way), the segment is looked at again after
    the backoff; a claim that does not read is another's too, the segment before it."""
    from chainrun.decide.retry import after_submit
    from chainrun.errors import ClaimedError
    from chainrun.model import Adopt, Carried, RetryLater

    queued = Carried(job_id="77", walltime=60, after="41", by="segment 1")
    assert after_submit(2, 1, ClaimedError(2, queued), NOW) == Adopt(
        n=2, job_id="77", how="queued by segment 1 (its claim)"
    )
    under_way = replace(queued, job_id="")
    assert after_submit(2, 3, ClaimedError(2, under_way), NOW) == RetryLater(
        n=2, at=NOW + backoff(3), reason="segment 1 is queueing it (its claim)"
    )
    assert after_submit(2, 1, ClaimedError(2, None), NOW) == RetryLater(
        n=2, at=NOW + backoff(1), reason="the segment before it is queueing it (its claim)"
    )


def test_a_host_back_that_lists_nothing_of_a_lost_segment_has_nothing_to_fence() -> None:
    lost = replace(seg(1, Phase.ENDED), host="gpu1", outcome=Outcome.LOST)
    assert fenced(chain(lost, replace(seg(2), host="gpu2"), spec=POOL), "gpu1", {}) == []


def test_only_a_pool_chain_with_no_segment_under_way_may_start_on_any_host() -> None:
    assert [unplaced(c) for c in (chain(spec=POOL), chain(seg(1), spec=POOL), chain())] == [
        True,
        False,
        False,
    ]
