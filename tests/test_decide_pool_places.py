"""A pool as one of several places (issue 39): table tests of the pure rules. A move to a pool
is placed on one of its hosts before the copy (the copy goes to that host); a copy from a
pool reads the checkpoint on the host the chain ran on there; a pool answers when its
soonest host would start the segment; a pool whose workdir is each host's own shares its
checkpoint directory with no other place; a chain's host is the one at the place it is at."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from test_decide_places import LATER, NOW, NOW_, SGE
from test_decide_places import SPEC as TWO_PLACES

from chainrun.decide import Facts, JobFacts, decide, placement
from chainrun.decide import places as rules
from chainrun.model import (
    Chain,
    ChainState,
    JobSpec,
    ListedJob,
    Move,
    Phase,
    PlaceSpec,
    Progress,
    SchedulerSpec,
    Segment,
    Start,
    Submit,
    Wait,
)

LAB = SchedulerSpec(kind="local", hosts=("gpu1", "gpu2"), slots=1, workdir_shared=False)
POOL = PlaceSpec("lab", LAB, "/home/me/w", "/home/me/w/ckpt", 90)
# The two-place tables' chain, at SGE first and the lab's pool second.
SPEC = replace(
    TWO_PLACES, walltime=90, checkpoint_dir=SGE.checkpoint_dir, scheduler=SGE.scheduler, places=(SGE, POOL)
)


def seg(n: int, phase: Phase, place: str, host: Optional[str] = None, **kw: object) -> Segment:
    fields: dict[str, object] = {"job_id": f"j{n}"}
    fields.update(kw)
    return Segment(chain_id="c", n=n, walltime=90, phase=phase, place=place, host=host, **fields)  # type: ignore[arg-type]


def chain(*segments: Segment, spec: JobSpec = SPEC) -> Chain:
    at = spec.at(rules.current(segments, spec.places))
    return Chain(id="c", spec=at, state=ChainState.ACTIVE, created_at=0.0, segments=segments)


def test_every_pool_of_a_chains_places_is_polled_whatever_place_it_is_at() -> None:
    assert placement.pools(SPEC) == (LAB,)
    assert placement.pools(SPEC.at("lab")) == (LAB,)  # at the pool: its own scheduler, once
    assert placement.pools(replace(SPEC, places=())) == ()


def test_a_move_to_a_pool_is_placed_on_a_host_with_a_free_slot_before_its_copy() -> None:
    """The host it ran on there before, when free; else the one with the most free slots (any
    host: the checkpoint is copied to whichever it is); none free: no move this tick."""
    move = Move(3, 90, "lab", "lab starts now")
    fresh = chain(seg(1, Phase.ENDED, "sge"), seg(2, Phase.ENDED, "sge"))
    assert placement.moved_to(fresh, move, {"gpu1": 1, "gpu2": 2}) == replace(move, host="gpu2")
    before = chain(seg(1, Phase.ENDED, "lab", "gpu1"), seg(2, Phase.ENDED, "sge"))
    assert placement.moved_to(before, move, {"gpu1": 1, "gpu2": 2}) == replace(move, host="gpu1")
    assert placement.moved_to(before, move, {"gpu1": 0, "gpu2": 1}) == replace(move, host="gpu2")
    assert placement.moved_to(before, move, {"gpu1": 0}) is None
    away = Move(3, 90, "sge", "sge starts now")
    assert placement.moved_to(before, away, {}) == away  # not a pool: as decided


def test_decide_moves_a_chain_to_the_pool_host_it_places_it_on_or_waits_for_a_slot() -> None:
    ended = seg(1, Phase.ENDED, "sge")
    starts = {"sge": LATER, "lab": NOW_}
    facts = Facts(progress=Progress(epoch=1), starts=starts, free={"gpu1": 0, "gpu2": 1})
    (action,) = decide(chain(ended), facts, NOW)
    assert isinstance(action, Move) and (action.n, action.place, action.host) == (2, "lab", "gpu2")
    # No slot free: not moved, and the chain says what it waits for (it said nothing).
    full = replace(facts, free={"gpu1": 0, "gpu2": 0})
    waiting = "waiting for a free slot on hosts gpu1, gpu2 at lab, where it moves next"
    assert decide(chain(ended), full, NOW) == [Wait(waiting)]
    said = replace(chain(ended), reason=waiting)
    assert decide(said, full, NOW) == []  # said once
    assert decide(said, replace(full, free={"gpu1": 1}), NOW)[0] == Wait("")  # moves: cleared
    # The other place became the sooner: the chain goes there, and no longer waits.
    there = decide(said, replace(full, starts={"sge": NOW_, "lab": LATER}), NOW)
    assert there[0] == Wait("") and isinstance(there[1], Submit), there
    assert decide(said, replace(full, free={"gpu2": 0}), NOW) == [
        Wait("waiting for a free slot on hosts gpu2 (gpu1 not reached) at lab, where it moves next")
    ]


def test_a_chain_at_a_pool_place_keeps_to_the_host_its_checkpoint_is_on() -> None:
    """At the pool (its workdir each host's own), a new segment is placed on the host it ran
    on; its successor queues behind it there."""
    ran = seg(2, Phase.RUNNING, "lab", "gpu2", started_at=NOW - 10)
    c = chain(seg(1, Phase.ENDED, "sge"), ran)
    assert (c.spec.place_name, c.placed, c.host, c.cluster_key) == ("lab", "gpu2", "gpu2", ("local", "gpu2"))
    facts = Facts(
        jobs={"j2": JobFacts(listed=ListedJob("j2", "j2", Phase.RUNNING))},
        progress=Progress(epoch=1),
        starts={"sge": LATER, "lab": NOW_},
        free={"gpu1": 1, "gpu2": 0},
    )
    assert decide(c, facts, NOW) == [Submit(3, 90, after="j2")]


def test_a_chain_that_left_a_pool_is_at_its_new_place_not_on_the_pools_host() -> None:
    c = chain(seg(1, Phase.ENDED, "lab", "gpu1"), seg(2, Phase.RUNNING, "sge"))
    assert (c.spec.place_name, c.placed, c.host, c.cluster_key) == ("sge", None, None, ("sge", ""))
    assert c.host_at("lab") == "gpu1" and c.host_at("sge") is None


def test_a_copy_from_a_pool_reads_the_host_the_chain_ran_on_there() -> None:
    moving = seg(3, Phase.SUBMITTING, "sge", job_id=None)
    c = chain(seg(1, Phase.ENDED, "lab", "gpu1"), seg(2, Phase.ENDED, "lab", "gpu2"), moving)
    assert rules.copy_from(c, moving) == "lab"
    assert rules.copy_host(c, "lab") == "gpu2"
    # Never ran there: the host that held the checkpoint at submit, else the pool's first.
    first = chain(seg(1, Phase.SUBMITTING, "sge", job_id=None))
    assert rules.copy_host(first, "lab") == "gpu1"
    held = replace(SPEC, places=(SGE, replace(POOL, scheduler=replace(LAB, checkpoint_host="gpu2"))))
    assert rules.copy_host(chain(spec=held), "lab") == "gpu2"
    remote = SchedulerSpec(kind="sge", host="login")
    login = replace(SPEC, scheduler=remote, places=(replace(SGE, scheduler=remote), POOL))
    assert rules.copy_host(chain(spec=login), "sge") == "login"
    assert rules.copy_host(c, "sge") is None  # this machine


def test_a_pool_starts_a_segment_as_soon_as_its_soonest_host() -> None:
    c = chain(seg(1, Phase.ENDED, "sge"))
    soon = rules.pool_start(c, "lab", {"gpu1": LATER, "gpu2": Start(NOW, "starts now (1 of 1 slot free)")})
    assert soon == Start(NOW, "on gpu2: starts now (1 of 1 slot free)")
    tie = rules.pool_start(c, "lab", {"gpu1": NOW_, "gpu2": NOW_})
    assert tie.reason.startswith("on gpu1:")
    none = rules.pool_start(c, "lab", {"gpu1": Start(None, "does not answer"), "gpu2": Start(None, "down")})
    assert none == Start(None, "no host of the pool can start it (gpu1: does not answer; gpu2: down)")
    assert rules.pool_start(c, "lab", {}) == Start(None, "no host of the pool can start it (none answered)")


def test_a_chain_at_a_pool_whose_workdir_is_not_shared_is_answered_for_by_its_host_alone() -> None:
    at = chain(seg(1, Phase.RUNNING, "lab", "gpu1"))
    answers = {"gpu1": LATER, "gpu2": NOW_}
    assert rules.pool_start(at, "lab", answers).reason == f"on gpu1: {LATER.reason}"
    shared = replace(SPEC, places=(SGE, replace(POOL, scheduler=replace(LAB, workdir_shared=True))))
    at_shared = chain(seg(1, Phase.RUNNING, "lab", "gpu1"), spec=shared)
    assert rules.pool_start(at_shared, "lab", answers).reason == "on gpu2: starts now"


def test_a_pool_whose_hosts_each_have_their_own_workdir_shares_no_checkpoint_directory() -> None:
    """Even the same real path, seen from a machine in common: each pool host has its own disk."""
    pool = replace(SPEC.at("lab"), checkpoint_real="/home/me/w/ckpt", checkpoint_machines=("id:m1",))
    other = replace(SPEC, checkpoint_real="/home/me/w/ckpt", checkpoint_machines=("id:m1",))
    assert not rules.shared(pool, other) and not rules.shared(other, pool)
    on_nfs = replace(pool, scheduler=replace(LAB, workdir_shared=True))
    assert rules.shared(on_nfs, other)
