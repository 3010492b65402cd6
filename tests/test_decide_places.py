"""One chain, several places: where its next segment goes (``decide.places``), as table
tests of the pure rules and of ``decide``; and the store's view of such a chain (its spec
as seen at the place it is at)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional

import pytest

from chainrun.decide import Facts, JobFacts, decide
from chainrun.decide import places as rules
from chainrun.decide.chain import questions
from chainrun.model import (
    NO_PROGRESS,
    Adopt,
    Cancel,
    Chain,
    ChainState,
    Finish,
    JobSpec,
    ListedJob,
    Move,
    Outcome,
    Phase,
    PlaceSpec,
    Progress,
    SchedulerSpec,
    Segment,
    Start,
    Submit,
    Track,
)
from chainrun.store import Store

NOW = 100_000.0
SLURM = PlaceSpec("slurm", SchedulerSpec(kind="slurm", queue="debug"), "/w", "/w/ckpt", 120)
SGE = PlaceSpec("sge", SchedulerSpec(kind="sge"), "/w", "/w/ckpt-sge", 90)
SPEC = JobSpec(
    name="t",
    command="python train.py",
    workdir="/w",
    total_time=1000,
    walltime=120,
    target_epoch=10,
    max_failures=2,
    checkpoint_dir="/w/ckpt",
    signal="USR1",
    grace=10,
    scheduler=SLURM.scheduler,
    places=(SLURM, SGE),
)
NOW_ = Start(NOW, "starts now")
LATER = Start(NOW + 3600, "the scheduler's forecast")
NEVER = Start(None, "sbatch: error: Invalid partition name specified")


def seg(n: int, phase: Phase = Phase.RUNNING, place: Optional[str] = None, **kw: object) -> Segment:
    fields: dict[str, object] = {"job_id": f"j{n}"}
    fields.update(kw)
    return Segment(chain_id="c", n=n, walltime=100, phase=phase, place=place, **fields)  # type: ignore[arg-type]


def chain(*segments: Segment) -> Chain:
    spec = SPEC.at(rules.current(segments, SPEC.places))
    return Chain(id="c", spec=spec, state=ChainState.ACTIVE, created_at=0.0, segments=segments)


def facts(starts: dict[str, Start], **jobs: Phase) -> Facts:
    return Facts(
        jobs={j: JobFacts(listed=ListedJob(j, j, phase)) for j, phase in jobs.items()},
        progress=Progress(epoch=1),
        starts=starts,
    )


@pytest.mark.parametrize(
    ("starts", "chosen"),
    [
        ({}, None),  # not asked: the chain stays where it is
        ({"slurm": NOW_, "sge": NOW_}, "slurm"),  # a tie: the first listed
        ({"slurm": Start(NOW + 59, ""), "sge": NOW_}, "slurm"),  # within the slack: still a tie
        ({"slurm": Start(NOW + 61, ""), "sge": NOW_}, "sge"),
        ({"slurm": LATER, "sge": Start(NOW + 600, "")}, "sge"),
        ({"slurm": NEVER, "sge": LATER}, "sge"),  # a place that cannot start it is skipped
        ({"slurm": NEVER, "sge": Start(None, "qsub: no answer")}, None),
        ({"sge": NOW_}, "sge"),  # a place not asked is not chosen
    ],
)
def test_the_place_that_starts_soonest_then_the_one_listed_first(
    starts: dict[str, Start], chosen: Optional[str]
) -> None:
    assert rules.choose(SPEC.places, starts) == chosen


def test_a_chain_is_at_its_newest_queued_segments_place() -> None:
    assert rules.current((), SPEC.places) == "slurm"
    assert rules.current((seg(1, Phase.ENDED), seg(2, place="sge")), SPEC.places) == "sge"
    # A move that never got a job (its copy failed, it was cancelled) does not count.
    never = seg(2, Phase.ENDED, place="sge", job_id=None)
    assert rules.current((seg(1, Phase.ENDED), never), SPEC.places) == "slurm"
    assert rules.current((seg(1),), ()) is None


def test_the_checkpoint_is_copied_from_where_the_chain_ran_last_once() -> None:
    first = seg(1, Phase.ENDED)
    moving = seg(2, Phase.SUBMITTING, place="sge", job_id=None)
    c = chain(first, moving)
    assert rules.copy_from(c, moving) == "slurm"
    assert rules.copy_from(c, replace(moving, copy_seconds=1.5, copy_digest="ab")) is None
    back = seg(3, Phase.SUBMITTING, place="slurm", job_id=None)
    assert rules.copy_from(chain(first, replace(moving, phase=Phase.ENDED, job_id="j2"), back), back) == "sge"
    assert rules.copy_from(chain(first, seg(2, Phase.SUBMITTING, job_id=None)), seg(2, job_id=None)) is None


def test_a_chain_with_no_segment_moves_its_first_to_the_place_that_starts_it() -> None:
    actions = decide(chain(), facts({"slurm": NEVER, "sge": NOW_}), NOW)
    assert actions == [Move(1, 90, "sge", actions[0].reason)]  # type: ignore[union-attr]
    assert "sge starts now; slurm cannot start it (sbatch: error: Invalid partition" in (
        actions[0].reason  # type: ignore[union-attr]
    )


def test_not_asked_or_staying_submits_as_a_chain_with_one_place() -> None:
    assert decide(chain(), facts({}), NOW) == [Submit(1, 120)]
    assert decide(chain(), facts({"slurm": NOW_, "sge": NOW_}), NOW) == [Submit(1, 120)]


def test_staying_the_successor_is_queued_ahead_moving_it_waits_for_the_end() -> None:
    running = seg(1, Phase.RUNNING, started_at=NOW - 10)
    stay = decide(chain(running), facts({"slurm": NOW_, "sge": NOW_}, j1=Phase.RUNNING), NOW)
    assert stay == [Submit(2, 120, after="j1")]
    move = decide(chain(running), facts({"slurm": LATER, "sge": NOW_}, j1=Phase.RUNNING), NOW)
    assert move == []


def test_a_queued_successor_is_left_for_a_place_that_starts_it_now() -> None:
    queued = seg(1, Phase.PENDING)
    actions = decide(chain(queued), facts({"slurm": LATER, "sge": NOW_}, j1=Phase.PENDING), NOW)
    assert [type(a) for a in actions] == [Cancel] and actions[0].job_id == "j1"  # type: ignore[union-attr]
    assert "left for sge" in actions[0].reason  # type: ignore[union-attr]
    # A place that starts it soon keeps it (and the one after it goes to the sooner place once
    # it has ended: none is queued behind it); a chain whose places were not asked keeps it too.
    soon = {"slurm": Start(NOW + rules.SOON - 1, ""), "sge": NOW_}
    assert decide(chain(queued), facts(soon, j1=Phase.PENDING), NOW) == []
    assert decide(chain(queued), facts({}, j1=Phase.PENDING), NOW) == [Submit(2, 120, after="j1")]


def test_a_move_whose_copy_keeps_failing_is_given_up_and_the_chain_chooses_again() -> None:
    first = seg(1, Phase.ENDED)
    failing = seg(2, Phase.SUBMITTING, place="sge", job_id=None, attempts=rules.MOVE_TRIES, retry_at=NOW - 1)
    failing = replace(failing, reason="checkpoint not copied from slurm: no space left")
    actions = decide(chain(first, failing), facts({"slurm": LATER, "sge": NOW_}), NOW)
    assert actions == [Cancel(2, None, "not moved; checkpoint not copied from slurm: no space left")]
    fewer = replace(failing, attempts=1)
    assert decide(chain(first, fewer), facts({}), NOW) == [Submit(2, 100, after=None)]


def test_the_store_gives_a_chain_its_spec_at_the_place_it_is_at(tmp_path: Path) -> None:
    store = Store(tmp_path / "home")
    made = store.add_chain(SPEC, Progress(), NOW)
    assert made.spec == SPEC
    store.journal_submit(made.id, Submit(1, 90), NOW, place="sge")
    moved = store.chain(made.id)
    assert moved.spec == SPEC.at("sge") and moved.spec.checkpoint_dir == "/w/ckpt-sge"
    assert moved.segments[0].place == "sge"
    store.record_copy(made.id, 1, 1.25, 4096, "abc", "checkpoint copied", NOW)
    store.record(made.id, [Track(1, Phase.PENDING, "", None, None)], None, [], NOW)
    again = store.chain(made.id)
    assert (again.segments[0].copy_seconds, again.segments[0].copy_bytes) == (1.25, 4096)
    assert [e.kind for e in store.events(made.id)][-1:] == ["copy"] or "copy" in [
        e.kind for e in store.events(made.id)
    ]


def test_the_places_are_asked_for_a_chain_that_may_queue_a_segment_this_tick() -> None:
    assert rules.asks(chain())
    # A segment running with its successor queued: the next is queued in the tick that sees
    # the running one end, and that tick must know where it goes.
    assert rules.asks(chain(seg(1, Phase.RUNNING), seg(2, Phase.PENDING)))
    assert not rules.asks(chain(seg(1, Phase.ENDED), seg(2, Phase.SUBMITTING, job_id=None)))
    one = Chain(id="c", spec=replace(SPEC, places=()), state=ChainState.ACTIVE, created_at=0.0)
    assert not rules.asks(one)


def test_a_segment_queued_by_the_one_before_it_is_at_that_ones_place(tmp_path: Path) -> None:
    """A successor a segment queued itself while the service was away (``Carried``) runs
    where that segment ran: adopted, it is recorded at that place, and the chain stays there."""
    store = Store(tmp_path / "home")
    made = store.add_chain(SPEC, Progress(), NOW)
    store.journal_submit(made.id, Submit(1, 90), NOW, place="sge")
    store.record(made.id, [Adopt(1, "j1", "submitted")], None, [], NOW)
    store.record(made.id, [Adopt(2, "j2", "queued by segment 1", walltime=90, after="j1")], None, [], NOW)
    chain = store.chain(made.id)
    assert [s.place for s in chain.segments] == ["sge", "sge"] and chain.spec.place_name == "sge"


def test_the_web_pages_timeline_says_where_each_segment_ran_and_the_copy_there() -> None:
    from chainrun.accounting import account
    from chainrun.ui.pages import _tip

    first = seg(1, Phase.ENDED, started_at=NOW - 300, ended_at=NOW - 200)
    moved = seg(2, Phase.RUNNING, place="sge", started_at=NOW - 100, copy_seconds=12.0, copy_bytes=9)
    c = chain(first, moved)
    tips = [_tip(s, c) for s in account(c, NOW).segments]
    assert "\nat slurm\n" in tips[0] + "\n" and "\nat sge; checkpoint copied there in 12s" in tips[1]


@pytest.mark.parametrize(
    ("start", "said"),
    [
        (None, "was not asked"),
        (Start(None, ""), "cannot start it (no reason given)"),
        (Start(None, "partition gpu is down"), "cannot start it (partition gpu is down)"),
        (Start(NOW - 5, ""), "starts it now"),
        (Start(NOW + rules.SLACK, ""), "starts it now"),  # the slack's edge is still now
        (Start(NOW + rules.SLACK + 1, ""), "would start it in 1m1s"),
        (Start(NOW + 3600, ""), "would start it in 1h"),
        (
            Start(NOW + 3600, "about 15:00, in 1h (sbatch --test-only)"),
            "about 15:00, in 1h (sbatch --test-only)",
        ),
    ],
)
def test_when_a_place_would_start_a_segment_is_said_in_words(start: Optional[Start], said: str) -> None:
    assert rules.when(start, NOW) == said


def test_a_moves_reason_says_what_both_places_answered() -> None:
    starts = {"slurm": Start(NOW + 3600, ""), "sge": Start(NOW, "")}
    assert rules.move_reason(chain(), "sge", starts, NOW) == "sge starts it now; slurm would start it in 1h"
    assert rules.move_reason(chain(), "sge", {"sge": Start(NOW + 120, "")}, NOW) == (
        "sge would start it in 2m; slurm was not asked"
    )


def test_starts_exactly_the_slack_apart_are_a_tie_and_a_queued_successor_is_kept_at_the_edges() -> None:
    assert rules.choose(SPEC.places, {"slurm": Start(NOW + rules.SLACK, ""), "sge": NOW_}) == "slurm"
    edge = {"slurm": Start(NOW + rules.SOON, ""), "sge": NOW_}  # starts it within SOON, just: kept
    assert rules.leave(chain(seg(1, Phase.PENDING)), edge, NOW) is None
    late = {"slurm": Start(NOW + rules.SOON + 1, ""), "sge": Start(NOW + rules.SLACK, "")}
    assert rules.leave(chain(seg(1, Phase.PENDING)), late, NOW) == "sge"  # the other starts it now, just
    later = {"slurm": Start(NOW + rules.SOON + 1, ""), "sge": Start(NOW + rules.SLACK + 1, "")}
    assert rules.leave(chain(seg(1, Phase.PENDING)), later, NOW) is None  # the other not now either


def _at(ckpt: str, real: str = "", machines: tuple[str, ...] = (), host: Optional[str] = None) -> JobSpec:
    return replace(
        SPEC,
        checkpoint_dir=ckpt,
        checkpoint_real=real,
        checkpoint_machines=machines,
        scheduler=SchedulerSpec(kind="slurm", host=host),
    )


@pytest.mark.parametrize(
    ("a", "b", "one"),
    [
        (_at("/w/ck", "/real/ck", ("m1", "m2")), _at("/x/ck", "/real/ck", ("m2", "m3")), True),
        (
            _at("/w/ck", "/real/ck", ("m1",)),
            _at("/w/ck", "/real/ck", ("m2",)),
            False,
        ),  # seen from no one machine
        (_at("/w/ck", "/real/ck", ("m1",)), _at("/w/ck", "/real/other", ("m1",)), False),
        (_at("/w/ck", "/real/ck", ("m1",)), _at("/w/ck"), True),  # one side unsettled: by host and path
        (_at("/w/ck", "/real/ck", ("m1",)), _at("/w/ck", host="login"), False),
        (_at("/w/ck"), _at("/w/ck2"), False),
    ],
)
def test_two_places_share_a_checkpoint_directory_only_when_it_is_one_directory(
    a: JobSpec, b: JobSpec, one: bool
) -> None:
    assert rules.shared(a, b) is one
    assert rules.shared(b, a) is one


def test_a_copy_is_due_until_both_its_time_and_digest_are_recorded_and_only_from_before() -> None:
    first = seg(1, Phase.ENDED)
    moving = seg(2, Phase.SUBMITTING, place="sge", job_id=None)
    c = chain(first, moving)
    assert (
        rules.copy_from(c, replace(moving, copy_seconds=1.5)) is None
    )  # recorded (a copy of nothing has no digest)
    assert rules.copy_from(c, replace(moving, copy_digest="ab")) is None
    # A later segment at the new place with a job does not make the copy's source the new place.
    ran = replace(moving, phase=Phase.RUNNING, job_id="j2")
    assert rules.copy_from(chain(first, ran, seg(3, Phase.PENDING, place="sge")), ran) == "slurm"
    # Moving to a place whose checkpoint directory is the first's: nothing to copy.
    same = replace(SGE, name="sge", checkpoint_dir=SLURM.checkpoint_dir)
    spec = replace(SPEC, places=(SLURM, same))
    onto = Chain(
        id="c", spec=spec.at("sge"), state=ChainState.ACTIVE, created_at=0.0, segments=(first, moving)
    )
    assert rules.copy_from(onto, moving) is None
    # A segment whose own place is not recorded is at the first place.
    unplaced = seg(3, Phase.SUBMITTING, job_id=None)
    assert rules.copy_from(chain(first, ran, unplaced), unplaced) == "sge"


def test_a_move_and_a_left_successor_say_in_words_when_each_place_would_start() -> None:
    """Places that answer with a time and no words of their own: the reasons count from now."""
    starts = {"slurm": Start(NOW + 3600, ""), "sge": Start(NOW + 5, "")}
    (move,) = decide(chain(), facts(starts), NOW)
    assert isinstance(move, Move) and move.reason == "sge starts it now; slurm would start it in 1h"
    # Segment 1 runs (its start not yet seen) with segment 2 queued behind it: only the queued
    # one, which never started, is left for the other place.
    running, queued = seg(1, Phase.RUNNING), seg(2, Phase.PENDING, after="j1")
    actions = decide(chain(running, queued), facts(starts, j1=Phase.RUNNING, j2=Phase.PENDING), NOW)
    assert [(type(a), a.n) for a in actions] == [(Cancel, 2)]  # type: ignore[union-attr]
    assert actions[0].reason == "left for sge: sge starts it now; slurm would start it in 1h"  # type: ignore[union-attr]


def test_a_place_that_refuses_the_chain_for_good_is_struck_and_the_chain_goes_on_elsewhere() -> None:
    """Slurm rejects a segment for good (its account closed since the estimate): no failure,
    no end; that place answers "cannot" from then on, whatever its estimate, and the segment
    goes to SGE. Refused at every place, the chain fails with every place's words."""
    rejected = seg(
        1, Phase.ENDED, job_id=None, outcome=Outcome.REJECTED, reason="sbatch: error: Invalid account"
    )
    c = chain(rejected)
    assert rules.refused(c) == {"slurm": "sbatch: error: Invalid account"}
    assert rules.refused_everywhere(c) is None
    starts = {"slurm": NOW_, "sge": Start(NOW + 120, "")}
    assert rules.without_refused(c, starts) == {
        "slurm": Start(None, "refused it for good: sbatch: error: Invalid account"),
        "sge": starts["sge"],
    }
    assert rules.without_refused(c, {}) == {}  # not asked: nothing to strike
    assert rules.without_refused(chain(), starts) is starts  # nothing refused: the very answers
    (move,) = decide(c, facts(starts), NOW)
    assert isinstance(move, Move) and (move.n, move.place) == (2, "sge"), move
    assert "slurm cannot start it (refused it for good: sbatch: error: Invalid account)" in move.reason
    # Not asked yet: nothing is queued at the place that refused it; the places are asked first.
    assert decide(c, facts({}), NOW) == []
    # Running at SGE after the move, its successor is queued there, never at Slurm.
    at_sge = chain(rejected, seg(2, Phase.RUNNING, place="sge", started_at=NOW - 5))
    assert decide(at_sge, facts(starts, j2=Phase.RUNNING), NOW) == [Submit(3, 90, after="j2")]
    # Refused at SGE too: the chain ends, failed, with both places' words.
    both = chain(
        rejected, seg(2, Phase.ENDED, place="sge", job_id=None, outcome=Outcome.REJECTED, reason="qsub: bad")
    )
    assert rules.refused_everywhere(both) == (
        "every place refused it: slurm: sbatch: error: Invalid account; sge: qsub: bad"
    )
    (end,) = decide(both, facts(starts), NOW)
    assert isinstance(end, Finish) and end.state is ChainState.FAILED and end.reason.startswith("every place")


def test_a_chain_that_stays_at_a_place_that_refused_it_queues_nothing_there() -> None:
    """Slurm refused segment 2 (queued ahead) for good while segment 1 runs there: no successor
    is queued at Slurm again; with the places' answers, the next goes to SGE after segment 1."""
    running = seg(1, Phase.RUNNING, started_at=NOW - 5)
    refused = seg(2, Phase.ENDED, job_id=None, outcome=Outcome.REJECTED, reason="sbatch: error: QOS gone")
    c = chain(running, refused)
    assert c.spec.place_name == "slurm"
    assert decide(c, facts({}, j1=Phase.RUNNING), NOW) == []
    assert (
        decide(c, facts({"slurm": NOW_, "sge": NOW_}, j1=Phase.RUNNING), NOW) == []
    )  # moving: after the end
    one = replace(c, spec=replace(SPEC, places=()))  # one place: a refusal ends the chain, as before
    (end,) = [a for a in decide(one, facts({}, j1=Phase.RUNNING), NOW) if isinstance(a, Finish)]
    assert end.reason == "sbatch: error: QOS gone"


@pytest.mark.parametrize(
    ("used", "asked"),
    [
        (0.0, [("slurm", 120), ("sge", 90)]),  # each place's own limit
        (900.0, [("slurm", 100), ("sge", 90)]),  # what is left, where it is under a limit
        (995.0, []),  # under the grace and a start: no place is asked
    ],
)
def test_each_place_is_asked_about_the_next_segment_it_would_run(
    used: float, asked: list[tuple[str, int]]
) -> None:
    asks = questions(replace(chain(), used=used))
    assert [(name, walltime) for name, _, walltime in asks] == asked
    assert all(there == SPEC.at(name) for name, there, _ in asks)


@pytest.mark.parametrize(
    ("found", "mark", "seen", "saved"),
    [
        (NO_PROGRESS, NO_PROGRESS, NO_PROGRESS, None),  # never saved: nothing to copy is right
        (Progress(epoch=3), NO_PROGRESS, NO_PROGRESS, Progress(epoch=3)),  # found at submit
        (NO_PROGRESS, Progress(epoch=2), NO_PROGRESS, Progress(epoch=2)),  # a segment ended with it
        (Progress(epoch=1), Progress(epoch=2), Progress(epoch=4), Progress(epoch=4)),  # the newest
        (NO_PROGRESS, NO_PROGRESS, Progress(saved_at=5.0), Progress(saved_at=5.0)),  # a file's time
    ],
)
def test_a_chain_that_saved_needs_its_checkpoint_where_it_moves_from(
    found: Progress, mark: Progress, seen: Progress, saved: Optional[Progress]
) -> None:
    assert rules.saved(replace(chain(), baseline=found, progress=mark, latest=seen)) == saved
