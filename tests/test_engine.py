"""Whole chains through the real engine and store, on the scripted cluster of chainrun.testing:
every action decide() can return, carried out and recorded, with no process and no sleep."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from test_decide import SPEC as DECIDE_SPEC

from chainrun import rundir
from chainrun.cluster import Cluster
from chainrun.decide import LOST_AFTER, Facts, backoff, decide
from chainrun.decide.carry import STALE_CLAIM
from chainrun.decide.retry import ACCOUNTING_FIRST, CANCEL_OWED_FOR, STUCK_AFTER, STUCK_RETRY
from chainrun.engine import Engine
from chainrun.engine.observe import Polled
from chainrun.errors import TransportError
from chainrun.model import (
    NO_PROGRESS,
    Action,
    Chain,
    ChainState,
    JobSpec,
    Outcome,
    Phase,
    SchedulerSpec,
    Submit,
)
from chainrun.progress import PROGRESS_EVERY
from chainrun.schedulers.segment import SegmentJob, grace_path
from chainrun.store import Store
from chainrun.testing import FakeClock, FakeCluster

SPEC = replace(DECIDE_SPEC, scheduler=SchedulerSpec(kind="fake"))


class World:
    """A store, a fake cluster and clock, and an engine over them."""

    def __init__(self, home: Path, arrays: bool = False) -> None:
        self.clock = FakeClock()
        self.cluster = FakeCluster(self.clock, arrays=arrays)
        self.store = Store(home)
        self.engine = self.new_engine()
        self.ticks = 0

    def new_engine(self) -> Engine:
        """A fresh engine over the same store and cluster: the service after a restart."""
        return Engine(
            self.store, clock=self.clock, transports=self.cluster.transport, schedulers=self.cluster.scheduler
        )

    def add(self, spec: JobSpec = SPEC) -> str:
        return self.store.add_chain(spec, NO_PROGRESS, self.clock()).id

    def tick(self, seconds: float = 10.0) -> Chain:
        """Time passes, then one tick; the chain (the newest) as stored after it."""
        self.clock.advance(seconds)
        self.engine.tick()
        self.ticks += 1
        return self.store.chains()[-1]

    def phases(self, chain_id: str) -> list[tuple[int, str, str]]:
        return [(s.n, s.job_id or "-", s.phase.value) for s in self.store.chain(chain_id).segments]

    def history(self, chain_id: str) -> str:
        return "\n".join(e.message for e in self.store.events(chain_id))


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path / "home")
    yield w
    w.store.close()


def test_events_are_stamped_when_they_happened_not_when_the_service_found_out(world: World) -> None:
    """Issue 36, finding 5: the service ticks 30 s after the segment started and 40 s after it
    ended; its history says when each happened (the scheduler's and the markers' times)."""
    chain_id = world.add()
    world.tick()
    world.tick()
    world.cluster.start("1", epoch=0)
    started = world.clock()
    world.tick(30)
    world.cluster.end("1", "timeout", epoch=4, saved=world.clock())
    ended = world.clock()
    world.tick(40)
    at = {e.message.split(":")[0].split(" (")[0]: e.at for e in world.store.events(chain_id)}
    assert (at["segment 1 is running"], at["segment 1 ended"]) == (started, ended), at


def test_a_chain_runs_to_its_target_with_one_successor_queued_ahead(world: World) -> None:
    """Submit, queue ahead, track, end each segment free with progress, complete, cancel the queue."""
    chain_id = world.add()
    world.tick()
    assert world.phases(chain_id) == [(1, "1", "pending")]
    world.tick()
    assert world.phases(chain_id) == [(1, "1", "pending"), (2, "2", "pending")]
    assert world.cluster.jobs["2"].after == "1"
    world.cluster.start("1", epoch=0)
    world.tick()
    assert world.phases(chain_id)[0] == (1, "1", "running")
    for n, epoch in ((1, 4), (2, 8)):
        world.cluster.end(str(n), "timeout", epoch=epoch, saved=world.clock())
        world.cluster.start(str(n + 1), epoch=epoch, saved=world.clock())
        chain = world.tick()
        ended = chain.segments[n - 1]
        assert (ended.outcome, ended.charged) == (Outcome.TIMEOUT, False)
        assert chain.progress.epoch == epoch
        world.tick()  # the next successor is queued behind the one now running
    world.cluster.checkpoint("/w/ckpt", epoch=10)
    # The target is reached while segment 3 runs: only the queue goes. The chain had no sidecar
    # so far: one that comes while its segment runs is seen at the directory's next listing.
    chain = world.tick(PROGRESS_EVERY)
    assert chain.state is ChainState.ACTIVE
    assert world.cluster.jobs["4"].live.outcome is Outcome.CANCELLED
    world.cluster.end("3", "completed", epoch=10, saved=world.clock())
    chain = world.tick()
    assert chain.state is ChainState.COMPLETED and "target epoch 10 reached" in chain.reason
    assert chain.failures == 0
    assert world.cluster.files["/w/.chainrun/" + chain_id + "/final"] == b"chain ended\n"
    polls = [c for c in world.cluster.commands if c[0] == "fake-poll"]
    assert len(polls) == world.ticks  # one per tick


def test_one_poll_per_cluster_per_tick_serves_every_chain(world: World) -> None:
    """Three chains on one cluster: each tick runs one poll, whatever the chains need."""
    for _ in range(3):
        world.add()
    world.tick()
    world.tick()
    assert [c[0] for c in world.cluster.commands].count("fake-poll") == 2
    assert [c[0] for c in world.cluster.commands].count("fake-submit") == 6


def test_segments_that_ended_in_one_tick_are_each_judged_on_their_own_markers(world: World) -> None:
    """Both ended while the service was away: each trained (its markers say so), neither is charged;
    one that found and left the checkpoint unchanged is charged 'no progress'."""
    chain_id = world.add()
    world.tick()
    world.tick()
    world.cluster.start("1", epoch=0)
    world.cluster.end("1", "timeout", epoch=3, saved=1.0)
    world.cluster.start("2", epoch=3, saved=1.0)
    world.cluster.end("2", "timeout", epoch=6, saved=2.0)
    chain = world.tick(3600)
    assert [(s.n, s.charged) for s in chain.segments[:2]] == [(1, False), (2, False)]
    assert chain.progress.epoch == 6
    world.cluster.start("3", epoch=6, saved=2.0)
    world.cluster.end("3", "timeout", epoch=6, saved=2.0)
    chain = world.tick()
    assert chain.segments[2].charged and "made no progress" in chain.segments[2].reason
    assert world.phases(chain_id)[-1][2] == "pending"


def test_a_failed_submission_is_retried_after_its_backoff_and_says_when(world: World) -> None:
    """RetryLater: a passing error is recorded with its retry time; the tick asks to come back then."""
    chain_id = world.add()
    world.cluster.fail_next_submit()
    world.clock.advance(10)
    summary = world.engine.tick()
    seg = world.store.chain(chain_id).segments[0]
    assert (seg.phase, seg.job_id, seg.retry_at) == (Phase.SUBMITTING, None, world.clock() + backoff(1))
    assert summary.next_in == backoff(1)
    assert "retrying in 5s: fake-submit: controller not responding" in world.history(chain_id)
    world.tick(1)  # too early: nothing is submitted
    assert [c[0] for c in world.cluster.commands].count("fake-submit") == 1
    world.tick(backoff(1))
    assert world.phases(chain_id) == [(1, "1", "pending")]
    assert world.store.chain(chain_id).failures == 0


def test_a_permanent_rejection_ends_the_chain_in_the_schedulers_words(world: World) -> None:
    """Reject, then Finish(failed) with the scheduler's message."""
    world.add()
    world.cluster.fail_next_submit("invalid partition specified: nosuch", transient=False)
    chain = world.tick()
    assert chain.segments[0].outcome is Outcome.REJECTED
    chain = world.tick()
    assert (
        chain.state is ChainState.FAILED
        and chain.reason == "fake-submit: invalid partition specified: nosuch"
    )


def test_an_interrupted_submission_is_adopted_never_submitted_twice(world: World) -> None:
    """The journal says 'submitting' and the scheduler has a job with the segment's tag: adopt it."""
    chain_id = world.add()
    world.store.journal_submit(chain_id, Submit(1, 100), world.clock())  # then the service died
    world.cluster.add_job(f"cr.{chain_id}.1", f"/w/.chainrun/{chain_id}/seg-0001")
    world.tick()
    assert world.phases(chain_id)[0] == (1, "1", "pending")
    assert [c[0] for c in world.cluster.commands].count("fake-submit") == 0
    assert "segment 1 adopted after a restart as job 1" in world.history(chain_id)


def test_a_successor_the_segment_queued_between_the_services_read_and_its_submit_is_adopted(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One claim protocol: the service read the chain (no claim, no job of segment 2 yet) and
    stalled; meanwhile segment 1, carrying the chain, claimed segment 2 and queued it. The
    service's own submission finds the claim taken: it adopts that job and queues none."""
    chain_id = world.add()
    world.tick()
    world.cluster.start("1", epoch=0)
    observe = world.engine.observer.facts

    def read_then_the_carrier_queues(polled: Polled, chain: Chain, now: float) -> Facts:
        facts = observe(polled, chain, now)
        if len(chain.segments) == 1:  # the carrier, between the service's read and its submit
            carrier = Cluster(world.cluster.scheduler("fake", None), world.cluster.transport())
            carrier.submit(SegmentJob(chain_id, 2, chain.spec, 100, "1"), by="segment 1")
        return facts

    monkeypatch.setattr(world.engine.observer, "facts", read_then_the_carrier_queues)
    world.tick()
    tagged = [j.job_id for j in world.cluster.jobs.values() if j.name == f"cr.{chain_id}.2"]
    assert tagged == ["2"]  # one successor
    assert world.phases(chain_id) == [(1, "1", "running"), (2, "2", "pending")]
    assert "segment 2 queued by segment 1 (its claim) as job 2" in world.history(chain_id)


def test_a_second_job_of_a_segment_that_shows_up_late_is_removed(world: World) -> None:
    """Remove: an interrupted submission landed after the restart submitted anew; the one
    recorded (running) stays, the late one goes."""
    chain_id = world.add()
    world.tick()
    world.cluster.start("1")
    world.tick()
    late = world.cluster.add_job(f"cr.{chain_id}.1", f"/w/.chainrun/{chain_id}/seg-0001")
    world.tick()
    assert world.cluster.jobs[late].live.outcome is Outcome.CANCELLED
    assert world.cluster.jobs["1"].live.phase is Phase.RUNNING
    assert f"job {late} removed: a second job of segment 1" in world.history(chain_id)


def test_when_the_late_job_already_runs_the_segment_it_is_kept(world: World) -> None:
    """The late job runs while the recorded one still waits: keep the one running the
    checkpoint; the recorded job and the successor queued after it go, and the chain goes on."""
    chain_id = world.add()
    world.tick()
    late = world.cluster.add_job(f"cr.{chain_id}.1", f"/w/.chainrun/{chain_id}/seg-0001")
    world.cluster.start(late)
    world.tick()
    assert world.cluster.jobs["1"].live.outcome is Outcome.CANCELLED
    assert world.phases(chain_id)[0] == (1, late, "pending")
    chain = world.tick()
    assert [s.job_id for s in chain.live] == [late, str(world.cluster.next_id - 1)]
    assert world.cluster.jobs[chain.live[1].job_id].after == late


def test_a_stuck_job_is_explained_removed_and_charged(world: World) -> None:
    """Remove + EndSegment: a job the scheduler holds in an error state, in its own words."""
    chain_id = world.add()
    world.tick()
    world.cluster.stick("1")
    chain = world.tick()
    seg = chain.segments[0]
    assert (seg.outcome, seg.charged) == (Outcome.FAILED, True)
    assert "cannot enter the working directory" in seg.reason
    assert ["fake-cancel", "1"] in world.cluster.commands
    assert "job 1 removed: held by the scheduler" in world.history(chain_id)


def test_a_job_gone_without_a_trace_is_lost_after_a_while_unless_accounting_knows(world: World) -> None:
    """Track(missing), then EndSegment(lost) after LOST_AFTER; accounting's record wins when there."""
    world.add()
    world.tick()
    world.cluster.start("1")
    world.tick()
    world.cluster.vanish("1")
    chain = world.tick()
    assert chain.segments[0].missing_since == world.clock() and chain.segments[0].phase is Phase.RUNNING
    chain = world.tick(LOST_AFTER - 20)
    assert chain.segments[0].phase is Phase.RUNNING
    chain = world.tick(20)
    seg = chain.segments[0]
    assert (seg.outcome, seg.charged) == (Outcome.LOST, True) and "with no record" in seg.reason

    other = world.add()
    world.tick()
    job = world.phases(other)[0][1]
    world.cluster.start(job)
    world.cluster.end(job, "oom", 137, marker=False)
    world.cluster.vanish(job, accounted=True)
    chain = world.store.chain(other)
    world.tick()
    seg = world.store.chain(other).segments[0]
    assert (seg.outcome, seg.exit_code, seg.charged) == (Outcome.OOM, 137, True)
    asked = [c for c in world.cluster.commands if c[0] == "fake-acct"]
    assert asked and all(len(c) == 2 for c in asked)  # one command for every unknown job
    assert chain.state is ChainState.ACTIVE


def test_jobs_that_took_the_ids_of_a_chains_segments_are_not_taken_for_them(world: World) -> None:
    """The cluster comes back with its state lost (a pool host re-imaged, a controller's
    state lost): it numbers jobs from 1 again, and jobs of the user's take the ids of the
    chain's running segment and of its successor. They are not the chain's (their names are not its segments'): its segments are gone, lost once
    ``LOST_AFTER`` has passed, the chain goes on with a new segment, and the other jobs are
    left alone, never cancelled for it."""
    chain_id = world.add()
    world.tick()
    world.cluster.start("1")
    world.tick()
    world.cluster.down = True
    world.tick()
    world.cluster.jobs.clear()
    world.cluster.next_id = 1
    mine = [world.cluster.add_job("my-preprocessing", "pre") for _ in range(2)]
    assert mine == ["1", "2"]
    world.cluster.start("1")
    world.cluster.down = False
    sent = len(world.cluster.commands)
    world.tick()
    chain = world.tick(LOST_AFTER)
    assert [(s.n, s.outcome) for s in chain.segments[:2]] == [(1, Outcome.LOST), (2, Outcome.LOST)]
    assert chain.state is ChainState.ACTIVE and chain.live
    assert all(j.name.startswith("cr.") for j in world.cluster.submitted()[2:])
    assert [world.cluster.jobs[j].live.phase for j in mine] == [Phase.RUNNING, Phase.PENDING]
    assert not [c for c in world.cluster.commands[sent:] if c[0] == "fake-cancel"]
    assert "my-preprocessing" not in world.history(chain_id)


def test_a_command_killed_by_a_signal_is_named_by_accounting_once_the_view_forgot_it(world: World) -> None:
    """The usual OOM under cgroups: the kernel SIGKILLs the command, the wrapper writes exit 137,
    and by the time the service looks the live view has forgotten the job. Accounting is asked in
    that tick and its OUT_OF_MEMORY wins over "failed"; where it knows nothing, "failed" stands,
    without waiting. A command that exited 1, or stopped after the walltime signal, costs no command."""
    oom, crash, unknown = world.add(), world.add(), world.add()
    world.tick()
    jobs = {c: world.phases(c)[0][1] for c in (oom, crash, unknown)}
    for job in jobs.values():
        world.cluster.start(job)
    world.tick()
    world.cluster.end(jobs[oom], "oom", 137)
    world.cluster.end(jobs[crash], "failed", 1)
    world.cluster.end(jobs[unknown], "failed", 137)
    world.cluster.vanish(jobs[oom], accounted=True)
    world.cluster.vanish(jobs[crash], accounted=True)
    world.cluster.vanish(jobs[unknown])
    before = len(world.cluster.commands)
    world.tick()
    asked = [c for c in world.cluster.commands[before:] if c[0] == "fake-acct"]
    assert [sorted(c[1:]) for c in asked] == [sorted([jobs[oom], jobs[unknown]])]
    ends = {c: world.store.chain(c).segments[0] for c in jobs}
    assert (ends[oom].outcome, ends[oom].exit_code, ends[oom].charged) == (Outcome.OOM, 137, True)
    assert (ends[crash].outcome, ends[crash].exit_code) == (Outcome.FAILED, 1)
    assert (ends[unknown].outcome, ends[unknown].exit_code) == (Outcome.FAILED, 137)
    before = len(world.cluster.commands)
    world.tick(ACCOUNTING_FIRST)
    assert not [c for c in world.cluster.commands[before:] if c[0] == "fake-acct"]  # asked once only


def test_accounting_is_asked_once_per_tick_for_every_gone_job_and_then_less_often(world: World) -> None:
    """Three jobs gone without a marker that accounting does not know: one command for all three,
    asked again after growing intervals (it used to be every tick for LOST_AFTER), and always in the
    tick that would find them lost, so that a record that came late still wins over "lost"."""
    ids = [world.add() for _ in range(3)]
    world.tick()
    jobs = [world.phases(c)[0][1] for c in ids]
    for job in jobs:
        world.cluster.start(job)
    world.tick()
    for job in jobs:
        world.cluster.vanish(job)
    asked_at: list[float] = []

    def tick() -> None:
        before = len(world.cluster.commands)
        world.tick()
        asked = [c for c in world.cluster.commands[before:] if c[0] == "fake-acct"]
        assert len(asked) <= 1  # one command per tick, whatever the number of jobs
        if asked:
            assert sorted(asked[0][1:]) == sorted(jobs)
            asked_at.append(world.clock())

    tick()
    gone = world.store.chain(ids[0]).segments[0].missing_since
    assert gone == world.clock() and asked_at == [gone]  # asked at once
    while world.clock() - gone < LOST_AFTER - 20:
        tick()
    gaps = [b - a for a, b in zip(asked_at, asked_at[1:])]
    assert gaps == sorted(gaps) and gaps[-1] >= 4 * gaps[0] and len(asked_at) <= 6
    # Accounting learns of the jobs now: the tick that would find them lost asks first.
    for job in jobs:
        world.cluster.end(job, "node_fail", 0, marker=False)
        world.cluster.vanish(job, accounted=True)
    while world.clock() - gone < LOST_AFTER:
        world.tick()
    for chain_id in ids:
        seg = world.store.chain(chain_id).segments[0]
        assert seg.outcome is Outcome.NODE_FAIL, seg.reason


def test_a_quiet_tick_reads_the_store_in_a_few_statements_whatever_the_chains_and_writes_nothing(
    world: World,
) -> None:
    """One load of the active chains per tick, never one per chain: the number of SQL statements of
    a tick in which nothing happens is the same for 2 chains and for 8, and none of them writes."""

    def tick() -> list[str]:
        statements: list[str] = []
        world.clock.advance(10)
        world.store.db.set_trace_callback(statements.append)
        try:
            world.engine.tick()
        finally:
            world.store.db.set_trace_callback(None)
        return statements

    quiet = []
    for n in (2, 8):
        while len(world.store.chains()) < n:
            world.add()
        for _ in range(3):  # segment 1 submitted; its successor queued; their reasons noted
            tick()
        tick()  # reads the chains changed by the last tick's record
        statements = tick()
        assert not [s for s in statements if s.lstrip().upper().startswith(("INSERT", "UPDATE", "BEGIN IMM"))]
        quiet.append(statements)
    assert quiet[0] == quiet[1] and len(quiet[0]) <= 6


def test_cancel_and_exhaustion_end_the_chain(world: World) -> None:
    """Cancel + Finish(cancelled) for a user's cancel; Finish(exhausted) when time is spent."""
    chain_id = world.add()
    world.tick()
    world.tick()
    world.store.request_cancel(chain_id, world.clock())
    chain = world.tick()
    assert chain.state is ChainState.CANCELLED
    assert all(j.live.outcome is Outcome.CANCELLED for j in world.cluster.jobs.values())

    short = world.add(replace(SPEC, total_time=150))
    world.tick()
    job = world.phases(short)[0][1]
    world.cluster.start(job, epoch=0)
    world.clock.advance(100)
    world.cluster.end(job, "timeout", epoch=2, saved=world.clock())
    chain = world.tick()  # 100 s used, 50 left: one more, clamped
    assert chain.live[0].walltime == 50
    job = chain.live[0].job_id
    assert job is not None
    world.cluster.start(job, epoch=2)
    world.clock.advance(50)
    world.cluster.end(job, "timeout", epoch=3, saved=world.clock())
    chain = world.tick()
    assert chain.state is ChainState.EXHAUSTED and "time budget spent" in chain.reason


def test_no_target_a_segment_that_exits_zero_on_its_own_completes_the_chain(world: World) -> None:
    """Without target_epoch, exit 0 before the walltime is done; the skipped successor is free."""
    chain_id = world.add(replace(SPEC, target_epoch=None))
    world.tick()
    world.tick()
    world.cluster.end("1", "completed", 0)
    world.cluster.end("2", "completed", 0, skipped=True)
    chain = world.tick()
    assert chain.state is ChainState.COMPLETED and chain.failures == 0
    assert [s.charged for s in chain.segments] == [False, False]
    assert "segment 1 exited 0 before its walltime" in world.history(chain_id)


def test_a_cluster_that_cannot_be_polled_costs_nothing(world: World) -> None:
    """The controller is down: the tick says so, nothing is charged or submitted, and it goes on after."""
    chain_id = world.add()
    world.tick()
    world.cluster.down = True
    summary = world.engine.tick()
    assert summary.errors and world.store.chain(chain_id).failures == 0
    world.cluster.down = False
    world.tick()
    assert world.phases(chain_id) == [(1, "1", "pending"), (2, "2", "pending")]


def owe_a_cancel(world: World) -> str:
    """A chain reaches its target while its controller takes no cancel: the successor queued
    ahead (job 2) stays queued, its cancel owed. The chain's id."""
    chain_id = world.add(replace(SPEC, target_epoch=2))
    world.tick()
    world.tick()
    world.cluster.start("1", epoch=0)
    world.cluster.end("1", "timeout", epoch=2, saved=world.clock())
    world.cluster.cancels_fail = True
    assert world.tick().state is ChainState.COMPLETED
    return chain_id


def test_a_cancel_the_scheduler_did_not_take_is_sent_again_once_it_answers(world: World) -> None:
    """The chain reaches its target while its controller takes no cancel: the successor queued
    ahead stays queued, the cancel owed. The engine polls that cluster each tick (the chain
    has ended) and, once it answers, cancels the job it still lists, once, and says so."""
    chain_id = owe_a_cancel(world)
    world.tick()  # still refused: still owed
    assert world.cluster.jobs["2"].live.phase is Phase.PENDING
    world.cluster.cancels_fail = False
    world.tick()
    assert world.cluster.jobs["2"].live.outcome is Outcome.CANCELLED
    told = world.history(chain_id)
    assert (
        "could not cancel jobs 2 (" in told
        and "job 2 removed: its cancel did not reach the scheduler" in told
    )
    sent = len(world.cluster.commands)
    world.tick()
    assert world.cluster.commands[sent:] == []  # owed nothing more: not even polled


def test_a_cancel_owed_is_sent_by_the_service_after_a_restart(world: World) -> None:
    """The chain reaches its target while its controller takes no cancel, and the service is
    restarted before the controller answers again: the new service still owes the cancel (it
    is kept in the store) and sends it once the cluster answers, so the successor queued ahead
    never runs and never holds the queue."""
    chain_id = owe_a_cancel(world)
    world.engine = world.new_engine()  # the service restarted
    world.tick()  # still refused: still owed
    assert world.cluster.jobs["2"].live.phase is Phase.PENDING
    world.engine = world.new_engine()
    world.cluster.cancels_fail = False
    world.tick()
    assert world.cluster.jobs["2"].live.outcome is Outcome.CANCELLED
    assert "job 2 removed: its cancel did not reach the scheduler" in world.history(chain_id)
    world.engine = world.new_engine()
    sent = len(world.cluster.commands)
    world.tick()
    assert world.cluster.commands[sent:] == []  # owed nothing more, after a restart too


def test_a_cancel_owed_is_not_sent_to_another_job_that_took_its_id(world: World) -> None:
    """The cluster is away while a cancel is owed and comes back with its state lost (a
    re-imaged pool host's runner, a controller whose state was lost: job ids start again),
    the owed job's id taken by another job of the user's. The owed cancel is for the job
    listed under that id with the name it had; that one is gone: owed nothing more, and the
    other job runs on."""
    chain_id = owe_a_cancel(world)
    world.cluster.down = True
    world.tick()
    world.cluster.jobs.clear()
    world.cluster.next_id = 1
    world.cluster.cancels_fail = False
    by_hand = [world.cluster.add_job("my-preprocessing", "pre") for _ in range(2)]
    assert by_hand == ["1", "2"]
    world.cluster.down = False
    sent = len(world.cluster.commands)
    world.tick()
    assert world.cluster.jobs["2"].live.phase is Phase.PENDING
    assert not [c for c in world.cluster.commands[sent:] if c[0] == "fake-cancel"]
    assert "job 2 removed" not in world.history(chain_id)
    assert world.store.owed_cancels() == {}


def test_a_cancel_owed_for_over_a_week_is_given_up_and_said(world: World) -> None:
    """A cluster that never answers again (a host gone for good) is not polled forever for a
    cancel it is owed: after ``CANCEL_OWED_FOR`` the cancel is given up, once, in the chain's
    history, with what to do, and that cluster is polled no more."""
    chain_id = owe_a_cancel(world)
    world.cluster.down = True
    world.tick(CANCEL_OWED_FOR - 60)
    assert "given up" not in world.history(chain_id)
    world.engine = world.new_engine()  # it is kept since when it is owed, across a restart
    world.tick(120)
    told = world.history(chain_id)
    assert told.count("job 2: its cancel has not reached fake in 7d of trying; given up") == 1
    assert "cancel it by hand" in told
    assert world.store.owed_cancels() == {}
    sent = len(world.cluster.commands)
    world.tick()
    assert world.cluster.commands[sent:] == []  # polled no more


def test_a_chain_decide_is_skipped_for_is_one_that_decide_and_the_tick_leave_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine skips decide() (and the rest of the chain's tick) for a chain whose row and
    facts have not changed, until a clock rule is due (lost, a submission's retry). Over a
    whole life of chains on the fake cluster, ticked every 7 s (so ticks fall on both sides
    of each timer), every chain skipped is one for which decide() answers nothing at that
    moment and the tick has nothing to record (no new progress, not stuck)."""
    calls: list[str] = []

    def counted(chain: Chain, facts: Facts, now: float) -> list[Action]:
        calls.append(chain.id)
        return decide(chain, facts, now)

    monkeypatch.setattr("chainrun.engine.decide", counted)
    skipped: list[str] = []
    wrong: list[tuple[str, float, list[Action]]] = []  # (a failed assert here would be the chain's fault)

    class Checked(Engine):
        def _quiet(self, chain: Chain, facts: Facts, now: float) -> bool:
            quiet = super()._quiet(chain, facts, now)
            if quiet:
                skipped.append(chain.id)
                answer = decide(chain, facts, now)
                news = facts.progress is not None and facts.progress != chain.latest
                if answer or news or chain.state is ChainState.STUCK:
                    wrong.append((chain.id, now, answer))
            return quiet

    world = World(tmp_path / "home")
    world.engine = Checked(
        world.store, clock=world.clock, transports=world.cluster.transport, schedulers=world.cluster.scheduler
    )
    cluster = world.cluster
    lost, retried, done = world.add(), world.add(), world.add()
    for _ in range(3):
        world.tick(7)
    jobs = {c: world.phases(c)[0][1] for c in (lost, retried, done)}
    for job in jobs.values():
        cluster.start(job, epoch=0)
    for _ in range(5):
        world.tick(7)
    cluster.vanish(jobs[lost])  # lost LOST_AFTER later; its successor goes on
    cluster.end(jobs[retried], "timeout", epoch=4, saved=world.clock())
    cluster.fail_next_submit()  # the successor's successor waits for its backoff
    for _ in range(int(LOST_AFTER // 7) + 5):
        world.tick(7)
    cluster.checkpoint("/w/ckpt", epoch=10)  # the target: all three chains read this directory
    for _ in range(5):
        world.tick(7)
    for job in cluster.submitted():
        if job.live.phase is Phase.RUNNING:
            cluster.end(job.job_id, "completed", epoch=10, saved=world.clock())
    for _ in range(3):
        world.tick(7)
    assert wrong == []
    assert len(skipped) > len(calls) and len(calls) > 10, (len(skipped), len(calls))
    seg = world.store.chain(lost).segments[0]
    assert (seg.outcome, seg.charged) == (Outcome.LOST, True)
    assert "retrying in 5s" in world.history(retried)
    assert all(world.store.chain(c).state is ChainState.COMPLETED for c in (lost, retried, done))
    world.store.close()


def test_every_change_of_a_chain_in_a_tick_is_one_transaction(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stuck chain whose tick works again is active again in the same transaction as the rest
    of what that tick learned (its job started): one write per chain and tick, the submission
    journal aside. (Marking it stuck, or active again, used to be a transaction of its own.)"""
    chain_id = world.add()
    world.tick()  # segment 1 submitted, and its successor next tick
    world.tick()
    observe = world.engine.observer.facts

    def broken(polled: object, chain: Chain, now: float) -> Facts:
        raise RuntimeError("cannot make sense of the cluster")

    monkeypatch.setattr(world.engine.observer, "facts", broken)
    for _ in range(STUCK_AFTER):
        world.tick()
    assert world.store.chain(chain_id).state is ChainState.STUCK
    monkeypatch.setattr(world.engine.observer, "facts", observe)
    world.cluster.start("1", epoch=0)
    world.clock.advance(STUCK_RETRY)
    statements: list[str] = []
    world.store.db.set_trace_callback(statements.append)
    try:
        chain = world.tick()
    finally:
        world.store.db.set_trace_callback(None)
    assert chain.state is ChainState.ACTIVE and chain.segments[0].phase is Phase.RUNNING
    assert [s for s in statements if s.startswith("BEGIN IMMEDIATE")] == ["BEGIN IMMEDIATE"]
    events = [e.message for e in world.store.events(chain_id)]
    assert events[-2:] == ["chain active: a tick succeeded again", "segment 1 is running"]


def test_a_grace_that_could_not_be_written_is_written_at_a_later_tick(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Segment 1 stopped 4 s after its signal: later segments get 2m30s (half the default,
    on the way to twice the stop). The run
    directory refuses the write once: the history says so, once, and the next tick writes it
    (before, later segments kept the default for good)."""
    spec = replace(SPEC, walltime=3600, grace=300, adaptive_grace=True)
    chain_id = world.add(spec)
    world.tick()
    world.cluster.start("1", epoch=0)
    world.tick()
    world.cluster.end("1", "timeout", marker=False)
    now = world.clock()
    stem = world.cluster.jobs["1"].stem
    marker = f"exit=0\noriginal=0\nsignal=USR1\nsignalled_at={now - 5}\nskipped=0\njob=1\nat={now - 1}\ngrace=300\n"
    world.cluster.files[stem + ".end"] = (marker + "ckpt_epoch=1\nckpt_saved=" + str(now - 2) + "\n").encode()
    refused = [TransportError("disk quota exceeded")]
    write = rundir.write_grace

    def full_once(*args: object) -> None:
        if refused:
            raise refused.pop()
        write(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(rundir, "write_grace", full_once)
    world.tick()
    path = grace_path(spec, chain_id)
    assert path not in world.cluster.files
    assert "could not write the grace for later segments (disk quota exceeded)" in world.history(chain_id)
    world.tick()
    assert world.cluster.files[path] == b"grace=150\n"
    assert world.history(chain_id).count("could not write the grace") == 1


def test_a_claim_whose_claimant_stopped_before_it_queued_anything_is_taken_over(world: World) -> None:
    """A claim of segment 2 that names no job: while it is young its claimant may still be
    submitting, and the service waits, saying so; once it is older than STALE_CLAIM (its
    claimant was killed between making it and submitting), the service takes it over and
    queues the segment, once."""
    chain_id = world.add()
    world.clock.now = time.time()  # the claim's age is told by this machine's clock
    world.tick(0)
    world.cluster.start("1", epoch=0)
    claim = f"/w/.chainrun/{chain_id}/seg-0002.queued"
    world.cluster.files[claim] = b"walltime=100\nafter=1\nby=segment 1\n"
    world.cluster.mtimes[claim] = time.time()
    world.tick(0)
    assert "segment 1 is queueing it (its claim)" in world.history(chain_id)
    assert f"cr.{chain_id}.2" not in [j.name for j in world.cluster.jobs.values()]
    world.cluster.mtimes[claim] = time.time() - STALE_CLAIM - 1
    world.clock.now = time.time() + 600  # past the retry's backoff
    world.tick(0)
    assert [j.name for j in world.cluster.jobs.values()].count(f"cr.{chain_id}.2") == 1
    assert b"by=service\n" in world.cluster.files[claim] and b"job=" in world.cluster.files[claim]
