"""The chain goes on while the service is away (issue 24 part 3).

``decide.carry`` is the small rule a segment applies alone, pinned by table tests here; the
service adopts what the segments queued when it returns (``decide`` reconciles). The whole
runs on the local runner, the real Slurm and the real SGE: the service is stopped (SIGSTOP,
or SIGKILL with no restart) while a chain needs five segments and more; the chain goes on,
segment after segment, and completes; back, the service shows every segment with its
outcome and charges what ``decide`` charges, and no two segments ever ran at once (the
trainer's lock). A crash-looping command beside it stops after its failure budget.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import pytest
import test_contract
from conftest import wait_for
from test_contract import ALL, CLI, Cluster, Service, status, write_job
from test_decide import NOW, SPEC, chain, seg

from chainrun.decide import Facts, JobFacts, decide
from chainrun.decide.carry import (
    AWAY_CAP,
    DEADLINE_MARGIN,
    CarryAnswer,
    Recorded,
    SegmentView,
    applies,
    away_bound,
    carry,
    off_because,
)
from chainrun.fields import format_duration
from chainrun.model import (
    NO_PROGRESS,
    Adopt,
    Carried,
    CommandResult,
    EndMarker,
    ListedJob,
    Phase,
    Progress,
    SchedulerSpec,
    StartMarker,
    Submit,
)
from chainrun.schedulers.sge import SgeScheduler
from chainrun.schedulers.slurm import SlurmScheduler

HOWS = ("SIGSTOP", "SIGKILL")
cluster = test_contract.cluster  # the contract's fixtures: the scheduler, shared, and the workdir
work = test_contract.work

# -- the rule a segment applies alone ------------------------------------------------------

LONG = replace(SPEC, walltime=3600, total_time=100 * 3600, max_failures=2, target_epoch=100)
BOUND = away_bound(LONG, 10.0)
NOTHING_KNOWN = Recorded(0, 0, 0.0, NO_PROGRESS)


def marked(start: int, end: Optional[int], code: int = 0, signal_: str = "USR1") -> JobFacts:
    """A segment by its markers: the epoch it found, and the one it left (None: still running)."""
    found = StartMarker("j", NOW - 3000, Progress(epoch=start, saved_at=float(start)))
    if end is None:
        return JobFacts(start=found)
    left = Progress(epoch=end, saved_at=float(end))
    return JobFacts(
        start=found, end=EndMarker(code, code, signal_ if code == 0 else "", False, NOW - 60, left)
    )


def alone(
    *since: JobFacts,
    heard: Optional[float] = NOW - BOUND - 1,
    known: Recorded = NOTHING_KNOWN,
    **kw: object,
) -> SegmentView:
    fields: dict[str, object] = dict(
        spec=LONG, n=len(since), job_id="41", known=known, since=since, progress=NO_PROGRESS, final=False
    )
    fields.update(kw)
    return SegmentView(heard_at=heard, interval=10.0, **fields)  # type: ignore[arg-type]


def test_the_bound_is_the_smaller_of_a_few_minutes_and_half_a_walltime_and_never_under_three_ticks() -> None:
    """Half a walltime for a short one, a few minutes for a long one, three ticks at least."""
    assert away_bound(replace(SPEC, walltime=60), None) == 30
    assert away_bound(LONG, None) == AWAY_CAP
    assert away_bound(replace(SPEC, walltime=60), 20.0) == 60


def test_a_running_segment_waits_while_the_service_ticks_then_queues_its_successor_after_its_job() -> None:
    """Heard within the bound: ask again later; silent past it: the next segment, after this job."""
    running = marked(0, None)
    heard = carry(alone(running, heard=NOW - 20), NOW)
    assert heard.submit is None and heard.again is not None and 0 < heard.again <= 30
    silent = carry(alone(running), NOW)
    assert silent.submit == Submit(n=2, walltime=3600, after="41"), silent.reason


def test_an_ended_segment_leaves_a_ticking_service_to_it_and_waits_for_one_that_missed_its_ticks() -> None:
    """Its command has ended: a service heard a tick ago queues the next itself (nothing to
    wait for); one silent for three ticks is waited for up to the bound, and not past the walltime."""
    done = marked(0, 5)
    ticking = carry(alone(done, heard=NOW - 5, ended=True), NOW)
    assert ticking.submit is None and ticking.again is None
    missed = carry(alone(done, heard=NOW - 40, deadline=NOW + 3600, ended=True), NOW)
    assert missed.submit is None and missed.again is not None
    late = carry(alone(done, heard=NOW - 40, deadline=NOW + 60, ended=True), NOW)
    assert late.submit is not None and late.submit.n == 2
    judged = carry(alone(heard=NOW - 5, n=1, known=Recorded(1, 0, 600.0, NO_PROGRESS), ended=True), NOW)
    assert judged.submit is None and judged.again is None  # the service already judged it: there


def test_the_bound_for_a_walltime_of_seconds_is_half_of_it_with_no_interval_known() -> None:
    """No interval known (no beat read yet) adds no ticks to the bound: a 4 s walltime's is 2 s."""
    assert away_bound(replace(SPEC, walltime=4), None) == 2


def ended_on_its_own(epoch: Optional[int], signal_: str = "") -> JobFacts:
    """Segment 1 ended exit 0, on its own or after the signal, leaving ``epoch`` (None: no
    progress at all in its marker)."""
    left = Progress(epoch=epoch, saved_at=1.0) if epoch is not None else None
    start = StartMarker("j", NOW - 3000, Progress(epoch=0, saved_at=0.5))
    return JobFacts(start=start, end=EndMarker(0, 0, signal_, False, NOW - 60, left))


@pytest.mark.parametrize(
    ("target", "job", "finished"),
    [
        (None, ended_on_its_own(5), True),  # a plain chain whose command ended by itself: done
        (None, ended_on_its_own(5, "USR1"), False),  # it ended because of the walltime signal
        (100, ended_on_its_own(5), False),  # an epoch short of the target: not done
        (100, ended_on_its_own(None), True),  # no epoch to compare with the target: done
    ],
)
def test_a_segment_that_exited_0_finishes_the_chain_exactly_when_decide_says_so(
    target: Optional[int], job: JobFacts, finished: bool
) -> None:
    """The completion rule the carrier applies to the segments since the service's record is
    ``goal.finished_on_its_own``, with the marker's exit, signal and epoch and the target."""
    answer = carry(alone(job, ended=True, heard=NOW - 4000, spec=replace(LONG, target_epoch=target)), NOW)
    assert (answer.reason == "the command finished on its own") == finished, answer.reason
    assert (answer.submit is None) == finished, answer


@pytest.mark.parametrize(
    ("scheduler", "off"),
    [
        (SchedulerSpec(kind="slurm"), ""),
        (SchedulerSpec(kind="slurm", host="login1"), ""),
        (
            SchedulerSpec(kind="local", hosts=("a", "b")),
            "a pool's segments are placed on its hosts by the service alone",
        ),
        (
            SchedulerSpec(kind="local", host="ws1"),
            "a remote workstation's local runner takes its jobs from the service alone",
        ),
        (SchedulerSpec(kind="local"), ""),
    ],
)
def test_where_a_chain_may_carry_itself_and_why_not_in_exact_words(
    scheduler: SchedulerSpec, off: str
) -> None:
    spec = replace(LONG, scheduler=scheduler)
    assert off_because(spec) == off
    assert applies(spec) == (off == "")


@pytest.mark.parametrize(
    ("since", "kw", "why"),
    [
        ((marked(0, None),), {"final": True}, "ended"),
        ((marked(0, None),), {"spec": replace(LONG, self_queue=False)}, "off"),
        ((marked(0, None),), {"progress": Progress(epoch=100)}, "goal"),
        ((marked(90, 100),), {"ended": True}, "goal"),
        ((marked(0, None),), {"known": Recorded(0, 2, 0.0, NO_PROGRESS)}, "may fail"),
        ((marked(0, 0, code=1), marked(0, 0, code=1), marked(0, 0, code=1)), {"ended": True}, "3 failures"),
        ((marked(0, None),), {"known": Recorded(0, 0, 99 * 3600.0, NO_PROGRESS)}, "time budget"),
        ((marked(0, None),), {"n": 100}, "segments"),
        ((marked(0, None),), {"heard": None}, "no beat of the service can be read in the run root"),
        (
            (marked(0, 5, signal_=""),),
            {"ended": True, "spec": replace(LONG, target_epoch=None)},
            "on its own",
        ),
    ],
    ids=[
        "final",
        "off",
        "goal-now",
        "goal-left",
        "budget-if-it-fails",
        "crash-loop",
        "time",
        "count",
        "no-heartbeat",
        "exit-0",
    ],
)
def test_a_segment_never_queues_past_the_target_final_budgets_or_segment_count(
    since: tuple[JobFacts, ...], kw: dict[str, object], why: str
) -> None:
    """Each limit stops it for good (no asking again), saying which."""
    verdict = carry(alone(*since, **kw), NOW)
    assert verdict.submit is None and verdict.again is None and why in verdict.reason, verdict


def test_crashes_since_the_service_last_recorded_count_against_the_budget_as_decide_counts_them() -> None:
    """Two crashes after the service's record: one more failure is allowed (max_failures 2), so
    the segment that ended third queues the next; a third crash spends the budget."""
    crash = marked(0, 0, code=1)
    assert carry(alone(crash, crash, ended=True), NOW).submit is not None
    assert carry(alone(crash, crash, marked(0, None)), NOW).submit is None  # and this one may fail
    progressed = carry(alone(crash, crash, marked(0, 3), ended=True), NOW)
    assert progressed.submit is not None and progressed.submit.n == 4


def test_back_the_service_adopts_every_segment_queued_while_it_was_away_before_judging_any() -> None:
    """Segments 2 and 3 were queued by the segment before each: recorded first, in order,
    with their walltime and dependency; nothing is submitted, nothing judged in that tick."""
    c = chain(seg(1, job="j1"))
    ran = JobFacts(listed=ListedJob("j1", "cr.x.1", Phase.ENDED, exit_code=0))
    carried = {2: Carried("j2", 600, "j1"), 3: Carried("", 600, "j2"), 5: Carried("j5", 600, "j4")}
    listed = ListedJob("j3", "cr.x.3", Phase.RUNNING)
    facts = Facts(jobs={"j1": ran}, carried=carried, tagged={3: (listed,)}, progress=NO_PROGRESS)
    actions = decide(c, facts, NOW)
    assert [(a.n, a.job_id, a.walltime, a.after) for a in actions if isinstance(a, Adopt)] == [
        (2, "j2", 600, "j1"),
        (3, "j3", 600, "j2"),  # its claim never got the job id: the listing has it under its tag
    ]
    assert all(isinstance(a, Adopt) for a in actions)
    # A cancel meanwhile (`chainrun cancel` ticking alone): adopted all the same, so that its
    # next tick judges each as it ended (a segment that ended before the cancel keeps its end).
    assert decide(replace(c, cancel_requested_at=0.0), facts, NOW) == actions


# -- the whole, on every scheduler ----------------------------------------------------------


def run_dir(work: Path, chain_id: str) -> Path:
    return work / ".chainrun" / chain_id


def judged_alone(work: Path, chain_id: str) -> int:
    """Segments whose command ran to its end (skips aside), by their end markers."""
    ends = run_dir(work, chain_id).glob("seg-*.end")
    return sum(1 for end in ends if "skipped=0" in end.read_text())


def carried(work: Path, chain_id: str) -> int:
    """Segments that the segment before them queued (the service claims those it queues too)."""
    claims = run_dir(work, chain_id).glob("seg-*.queued")
    return sum(1 for claim in claims if "\nby=segment " in claim.read_text())


def gone(cluster: Cluster, chain_id: str) -> bool:
    return cluster.live_jobs(chain_id) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("cluster", "how"),
    [
        *[
            pytest.param(*c.values, how, marks=c.marks, id=f"{c.values[0]}-{how}")
            for c in ALL
            for how in HOWS
        ],
        # Over SSH the carrier runs on the cluster, from the archive the service left there.
        pytest.param("sge-ssh", "SIGKILL", marks=[pytest.mark.sge, pytest.mark.ssh], id="sge-ssh-SIGKILL"),
    ],
    indirect=["cluster"],
)
def test_the_chain_carries_itself_while_the_service_is_away_and_the_service_reconciles(
    cluster: Cluster, work: Path, chainrun: CLI, service: Service, how: str
) -> None:
    """Stopped (SIGSTOP) or killed with no restart while a chain has five segments and more to
    go, the service misses them all: each segment queues the next, the chain completes, and
    the crash-looping chain beside it (SIGSTOP) stops after its budget, not at its segment
    limit. Back, the service adopts them: every segment has its outcome, the failures are
    what decide charges, and the trainer's lock never saw two segments at once."""
    # Each segment trains at most 8 s (Slurm's shortest walltime is a minute, and its signal
    # comes 10-40 s into it; the timeout's USR1 makes the trainer save and exit 0): forty
    # epochs take five segments and more on every scheduler.
    target = 40
    command = (
        f"timeout --preserve-status -s USR1 8 python3 trainer.py --exclusive --epochs {target} --epoch-time 1"
    )
    training = write_job(work, cluster, command, target_epoch=target)
    chains = {"training": chainrun("submit", str(training), check=True).stdout.strip()}
    if how == "SIGSTOP":
        crashing = write_job(
            work,
            cluster,
            "echo try $CHAINRUN_SEGMENT; sleep 2; python3 trainer.py --mode crash",
            name="crashing",
            checkpoint_dir="crash-checkpoints",
            max_failures=2,
        )
        chains["crashing"] = chainrun("submit", str(crashing), check=True).stdout.strip()
    proc = service(interval=0.5)

    def queued_ahead(ref: str) -> bool:
        return sum(1 for s in status(chainrun, ref)["segments"] if s["job_id"]) >= 2

    wait_for(lambda: all(queued_ahead(c) for c in chains.values()), 180, "successors queued ahead")
    proc.send_signal(getattr(signal, how))
    if how == "SIGKILL":
        proc.wait()
    training_id = chains["training"]
    wait_for(
        lambda: judged_alone(work, training_id) >= 2 and all(gone(cluster, c) for c in chains.values()),
        20 * cluster.walltime + 300,
        "the chains to end with the service away",
    )
    assert carried(work, training_id) >= 4, "five segments and more went on without the service"
    sidecar = (work / "checkpoints" / "chainrun-progress.json").read_text()
    assert f'"epoch": {target}' in sidecar, sidecar
    if how == "SIGSTOP":
        proc.send_signal(signal.SIGCONT)
    else:
        service(interval=0.5)
    wait_for(
        lambda: all(status(chainrun, c)["state"] != "active" for c in chains.values()),
        180,
        "the service to reconcile",
    )
    st = status(chainrun, training_id)
    assert st["state"] == "completed", st["reason"]
    numbers = [s["n"] for s in st["segments"]]
    assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) >= 6, numbers
    assert all(s["phase"] == "ended" and s["outcome"] for s in st["segments"]), st["segments"]
    assert st["failures"] == 0 and not any(s["charged"] for s in st["segments"]), st["segments"]
    history = chainrun("history", training_id, check=True).stdout
    assert history.count("while the service was away") == carried(work, training_id), history
    assert not (work / "overlaps.log").exists(), (work / "overlaps.log").read_text()
    if how == "SIGSTOP":
        crash = status(chainrun, chains["crashing"])
        assert crash["state"] == "failed" and "failure budget spent" in crash["reason"], crash["reason"]
        logs = run_dir(work, crash["id"])
        starts = [(logs / f"seg-{n:04d}.log").read_text().count("of chain") for n in (1, 2, 3)]
        assert crash["failures"] == 3 and starts == [1, 1, 1] and not (logs / "seg-0004.log").exists()
        assert [s["charged"] for s in crash["segments"] if s["started_at"]] == [True] * 3, crash["segments"]


def test_the_silence_rule_at_its_edges_with_the_exact_words() -> None:
    """When to ask again and when to act, at each boundary of the bound, the ticks and the
    deadline, with what the segment's log says."""
    running = marked(0, None)
    assert carry(alone(running, heard=NOW - 290), NOW) == CarryAnswer(None, 11.0, "the service is there")
    assert carry(alone(running, heard=NOW - BOUND), NOW).submit is not None  # silent the whole bound: acts
    slow = carry(replace(alone(running, heard=NOW - 400), interval=200.0), NOW)
    assert slow == CarryAnswer(None, 30.0, "the service is there")  # three of its 200 s ticks: 600 s
    done = marked(0, 5)
    ticking = carry(alone(done, heard=NOW - 29, ended=True), NOW)
    assert ticking == CarryAnswer(None, None, "the service is there: it queues the next segment")
    missed = carry(alone(done, heard=NOW - 30, ended=True), NOW)  # three ticks of 10 s missed
    assert missed == CarryAnswer(None, 30.0, "the service missed its ticks")
    # It acts once waiting out the bound would reach the last DEADLINE_MARGIN of its walltime.
    edge = NOW + (BOUND - 40) + DEADLINE_MARGIN
    assert carry(alone(done, heard=NOW - 40, ended=True, deadline=edge), NOW).submit is not None
    assert carry(alone(done, heard=NOW - 40, ended=True, deadline=edge + 1), NOW).submit is None


def test_what_a_segment_counts_and_says_before_it_queues_the_next() -> None:
    """A segment that ended with no trace is charged a failure and a whole walltime; the time
    adds up from what the service knew; the segment count, the failure budget and the goal
    each stop it in exactly these words."""
    unknown = JobFacts(start=StartMarker("j", NOW - 7200, Progress(epoch=0, saved_at=0.0)))
    running = marked(0, None)
    known = Recorded(0, 1, 0.0, NO_PROGRESS)
    assert carry(alone(unknown, running, known=known), NOW) == CarryAnswer(
        None,
        None,
        "2 failures (and this segment may fail); max_failures = 2: the service decides when it is back",
    )
    spent = Recorded(0, 0, 98.5 * 3600, NO_PROGRESS)
    assert carry(alone(unknown, running, known=spent), NOW) == CarryAnswer(
        None, None, "the time budget is spent (4d4h30m used)"
    )
    assert carry(alone(running, n=99), NOW).submit == Submit(n=100, walltime=3600, after="41")
    assert carry(alone(running, n=100), NOW) == CarryAnswer(
        None, None, "segment 101 would pass the 100 segments"
    )
    crashed = [marked(0, 0, code=1)] * 3
    assert carry(alone(*crashed, ended=True), NOW).reason == (
        "3 failures; max_failures = 2: the service decides when it is back"
    )
    assert carry(alone(running, final=True), NOW) == CarryAnswer(None, None, "the chain has ended")
    assert carry(alone(running, spec=replace(LONG, self_queue=False)), NOW) == CarryAnswer(
        None, None, "self-queueing is off (self_queue = false)"
    )
    assert carry(alone(running, heard=None), NOW).reason == (
        "no beat of the service can be read in the run root: the service queues the next segment"
    )
    plain = replace(LONG, target_epoch=None)
    assert carry(alone(marked(0, 5, signal_=""), ended=True, spec=plain), NOW) == CarryAnswer(
        None, None, "the command finished on its own"
    )
    assert carry(alone(running), NOW).reason == f"service heard not for {format_duration(BOUND + 1)}"


# -- clusters whose nodes cannot submit, and the setting that turns it off ------------------


def answer(out: str, rc: int = 0) -> CommandResult:
    return CommandResult(("probe",), rc, out, "")


PARTITION = (
    "PartitionName=gpu AllowGroups=ALL AllocNodes={alloc} Default=YES QoS=N/A Nodes={nodes} State=UP\n"
    "PartitionName=cpu AllowGroups=ALL AllocNodes=ALL Default=NO Nodes=c[1-4] State=UP\n"
)


@pytest.mark.parametrize(
    ("alloc", "nodes", "allowed"),
    [
        ("ALL", "gpu[01-08]", True),
        ("login[1-2]", "gpu[01-08]", False),
        ("login1,gpu[01-08,10]", "gpu[01-08]", True),
        ("login1,gpu[01-07]", "gpu[01-08]", False),
    ],
)
def test_slurm_nodes_may_submit_when_the_partitions_allocnodes_include_them(
    alloc: str, nodes: str, allowed: bool
) -> None:
    """A partition's AllocNodes (scontrol show partition) lists where jobs may be submitted from."""
    slurm = SlurmScheduler()
    assert slurm.node_submit_argvs("gpu") == [["scontrol", "show", "partition", "--oneliner", "gpu"]]
    why = slurm.parse_node_submit([answer(PARTITION.format(alloc=alloc, nodes=nodes))])
    assert (why == "") is allowed, why
    if not allowed:
        assert f"AllocNodes={alloc}" in why and "gpu" in why
    assert slurm.parse_node_submit([answer("", rc=1)]) == ""  # cannot tell: the segment finds out


def test_sge_nodes_may_submit_when_every_execution_host_is_a_submit_host() -> None:
    """qconf -ss (submit hosts) must hold every host of qconf -sel (execution hosts)."""
    sge = SgeScheduler()
    assert sge.node_submit_argvs(None) == [["qconf", "-ss"], ["qconf", "-sel"]]
    assert sge.parse_node_submit([answer("login1\nnode1.cluster\n"), answer("node1\n")]) == ""
    why = sge.parse_node_submit([answer("login1\n"), answer("node1\nnode2\n")])
    assert "node1, node2" in why and "qconf -ss" in why


@pytest.mark.parametrize("cluster", ALL, indirect=True)
def test_check_says_what_happens_while_the_service_is_away(
    cluster: Cluster, work: Path, chainrun: CLI
) -> None:
    """On this machine's local runner, Slurm and SGE the nodes may submit: `check` says a
    running segment queues the next itself; self_queue = false turns it off, and says so."""
    path = write_job(work, cluster, "python3 trainer.py")
    out = chainrun("check", str(path), check=True).stdout
    assert "a running segment queues the next itself once the service is silent for" in out, out
    path.write_text("self_queue = false\n" + path.read_text())
    out = chainrun("check", str(path), check=True).stdout
    assert "the chain waits for the service (self-queueing off: self_queue = false)" in out, out


@pytest.mark.slow
def test_with_self_queue_false_the_chain_waits_for_the_service_as_before(
    work: Path, chainrun: CLI, service: Service
) -> None:
    """Turned off, a chain goes one successor ahead without the service, and no further."""
    path = write_job(work, test_contract.CLUSTERS["local"], "python3 trainer.py --epochs 1000 --epoch-time 1")
    path.write_text("self_queue = false\n" + path.read_text())
    chain_id = chainrun("submit", str(path), check=True).stdout.strip()
    proc = service(interval=0.5)
    wait_for(
        lambda: sum(1 for s in status(chainrun, chain_id)["segments"] if s["job_id"]) >= 2, 60, "a successor"
    )
    proc.send_signal(signal.SIGSTOP)
    wait_for(lambda: judged_alone(work, chain_id) >= 2, 120, "two segments to end")
    assert carried(work, chain_id) == 0 and not (run_dir(work, chain_id) / "carry").exists()
    proc.send_signal(signal.SIGCONT)
    chainrun("cancel", chain_id, check=True)


@pytest.mark.slow
def test_a_cancel_while_the_service_is_gone_ends_the_segments_it_queued_too(
    work: Path, chainrun: CLI, service: Service
) -> None:
    """The service killed, a segment queues the next itself; `chainrun cancel` (no service: it
    ticks alone) adopts and cancels it with the rest, and nothing of the chain runs on."""
    local = test_contract.CLUSTERS["local"]
    path = write_job(work, local, "python3 trainer.py --exclusive --epochs 1000 --epoch-time 1")
    chain_id = chainrun("submit", str(path), check=True).stdout.strip()
    proc = service(interval=0.5)
    wait_for(
        lambda: sum(1 for s in status(chainrun, chain_id)["segments"] if s["job_id"]) >= 2, 60, "a successor"
    )
    proc.kill()
    proc.wait()
    wait_for(lambda: carried(work, chain_id) >= 1, 120, "a segment to queue the next itself")
    claims = [c for c in run_dir(work, chain_id).glob("seg-*.queued") if "\nby=segment " in c.read_text()]
    wait_for(lambda: "job=" in claims[0].read_text(), 30, "its job")
    chainrun("cancel", chain_id, check=True)
    st = status(chainrun, chain_id)
    assert st["state"] == "cancelled" and all(s["phase"] == "ended" for s in st["segments"]), st["segments"]
    assert len(st["segments"]) >= 3, st["segments"]
    wait_for(lambda: gone(local, chain_id), 60, "the chain's jobs to end")


def test_a_claim_is_taken_over_only_when_it_names_no_job_and_is_older_than_a_submission() -> None:
    from chainrun.decide.carry import STALE_CLAIM, abandoned
    from chainrun.model import Carried

    pending = Carried(job_id="", walltime=60, after="41", by="segment 1")
    assert not abandoned(pending, STALE_CLAIM - 1) and abandoned(pending, STALE_CLAIM)
    assert not abandoned(replace(pending, job_id="77"), 10 * STALE_CLAIM)  # it queued one: never
    assert abandoned(None, STALE_CLAIM) and not abandoned(None, 0.0)  # one that does not read
    assert abandoned(pending, None)  # gone meanwhile


# -- carry only where it is safe (issue 35 item 3) -------------------------------------------


def beats(work: Path) -> list[Path]:
    """The service's beats in the run root of chains in ``work``."""
    return list((work / ".chainrun").glob("service-*.beat"))


def launcher_answer(work: Path, chain_id: str, n: int, job_id: str, stale_status: Optional[Path]) -> str:
    """What the chain's launcher answers for segment ``n`` (job ``job_id``) running, asked as
    a node asks it; with ``stale_status``, on a node that sees that file as the service's
    state directory's status (a copy, or another machine's), in a mount namespace of its own."""
    import subprocess

    where = run_dir(work, chain_id)
    ask = ["sh", str(where / "carry"), str(where), str(n), job_id, "running"]
    if stale_status is not None:
        home = Path(os.environ["CHAINRUN_HOME"])
        script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
        ask = [
            "unshare",
            "-m",
            "sh",
            "-c",
            script,
            "-",
            str(stale_status),
            str(home / "service.status"),
            *ask,
        ]
    result = subprocess.run(ask, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip() + result.stderr


@pytest.mark.slow
def test_a_node_that_sees_a_stale_copy_of_the_state_directory_never_queues_while_the_service_ticks(
    work: Path, chainrun: CLI, service: Service, tmp_path: Path
) -> None:
    """The state directory is on the service's own disk (as the README advises); a node sees
    an old copy of its status there (another machine's file, a stale mount). The service
    ticks, so a segment asked whether to queue the next must leave it to the service: it reads
    the service's beat in the run root, beside its own script, which the service writes
    each tick, and never the state directory."""
    local = test_contract.CLUSTERS["local"]
    path = write_job(work, local, "python3 trainer.py --epochs 1000 --epoch-time 1")
    chain_id = chainrun("submit", str(path), check=True).stdout.strip()
    service(interval=0.5)
    wait_for(
        lambda: any(s["n"] == 1 and s["phase"] == "running" for s in status(chainrun, chain_id)["segments"]),
        60,
        "segment 1 to run",
    )
    stale = tmp_path / "stale.status"
    stale.write_text(json.dumps({"pid": 1, "at": time.time() - 86400, "status": "old", "interval": 0.5}))
    os.utime(stale, (time.time() - 86400, time.time() - 86400))
    # Segment 2 asks as though it ran (its job, queued ahead, is its dependency): nothing is
    # queued after it yet.
    second = next(s for s in status(chainrun, chain_id)["segments"] if s["n"] == 2)
    said = launcher_answer(work, chain_id, 2, second["job_id"], stale)
    assert said.isdigit(), said  # "ask again in N s": the service is there
    assert not (run_dir(work, chain_id) / "seg-0003.queued").exists()
    [beat] = beats(work)
    written = beat.stat().st_mtime
    wait_for(lambda: beat.stat().st_mtime > written, 30, "the service to beat again")
    assert beat.stat().st_mode & 0o077 == 0, oct(beat.stat().st_mode)
    chainrun("cancel", chain_id, check=True)


@pytest.mark.slow
@pytest.mark.sge
def test_a_chain_carries_itself_where_the_services_interpreter_is_not_on_the_nodes(
    work: Path, chainrun: CLI, home: Path, tmp_path: Path
) -> None:
    """The service runs from a Python the cluster's nodes do not have (a virtual environment on
    its own disk, here removed once it started): killed, its chain still goes on segment
    after segment, its carrier run by the segment runner's own interpreter."""
    import shutil
    import subprocess
    import sys

    from conftest import cli_env

    sge = test_contract.CLUSTERS["sge"]
    with test_contract.holding_scheduler("sge"):
        test_contract.need("a running sge", sge.available(), "sudo scripts/start-sge")
        venv = tmp_path / "service-venv"
        (venv / "bin").mkdir(parents=True)
        real = Path(sys.prefix)
        shutil.copy(real / "pyvenv.cfg", venv / "pyvenv.cfg")
        (venv / "lib").symlink_to(real / "lib")
        (venv / "bin" / "python").symlink_to(Path(sys.executable).resolve())
        path = write_job(work, sge, "python3 trainer.py --exclusive --epochs 1000 --epoch-time 1")
        chain_id = chainrun("submit", str(path), check=True).stdout.strip()
        env = cli_env(home)
        proc = subprocess.Popen(
            [str(venv / "bin" / "python"), "-m", "chainrun", "daemon", "--interval", "0.5"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_for(
                lambda: sum(1 for s in status(chainrun, chain_id)["segments"] if s["job_id"]) >= 2,
                120,
                "a successor queued ahead",
            )
        finally:
            proc.kill()
            proc.wait()
        shutil.rmtree(venv)  # what the nodes see of it: nothing
        wait_for(lambda: carried(work, chain_id) >= 2, 30 * sge.walltime + 120, "segments queued by segments")
        chainrun("cancel", chain_id, check=True)
        wait_for(lambda: gone(sge, chain_id), 120, "the chain's jobs to end")


@pytest.mark.sge
def test_where_the_carrier_cannot_run_submit_status_and_the_page_say_self_queueing_is_off(
    work: Path, chainrun: CLI, home: Path, tmp_path: Path
) -> None:
    """Where the segments' python3 cannot run the carrier (a Python 3.8, which runs the segment
    runner but not the carrier, played by a script), the probe at submit
    turns self-queueing off for the chain and says why in one line; `status` and the web
    page say it too."""
    import subprocess
    import sys

    from conftest import cli_env
    from test_ui import _get

    sge = test_contract.CLUSTERS["sge"]
    with test_contract.holding_scheduler("sge"):
        test_contract.need("a running sge", sge.available(), "sudo scripts/start-sge")
        old = tmp_path / "old-python"
        old.mkdir()
        (old / "python3").write_text(
            "#!/bin/sh\n"
            f'[ "$1" = -c ] && exec {sys.executable} "$@"  # the segment runner\'s check passes\n'
            "echo \"AttributeError: module 'functools' has no attribute 'cache'\" >&2; exit 1\n"
        )
        (old / "python3").chmod(0o755)
        env = cli_env(home)
        env["PATH"] = f"{old}{os.pathsep}{env['PATH']}"
        path = write_job(work, sge, "python3 trainer.py --epochs 1000 --epoch-time 1")
        submitted = subprocess.run(
            [sys.executable, "-m", "chainrun", "submit", str(path)], env=env, capture_output=True, text=True
        )
        assert submitted.returncode == 0, submitted.stderr
        chain_id = submitted.stdout.strip()
        line = (
            "t: self-queueing off (the carrier does not run with python3 there "
            "(AttributeError: module 'functools' has no attribute 'cache')): after one walltime without "
            "the service, "
            "the chain waits for it"
        )
        assert submitted.stderr.splitlines()[0] == line, submitted.stderr
        assert "the carrier does not run with python3 there" in status(chainrun, chain_id)["self_queue_off"]
        verbose = chainrun("status", "-v", chain_id, check=True).stdout
        assert line[len("t: ") :] in " ".join(verbose.split()), verbose  # wrapped to the terminal
        ui = subprocess.Popen(
            [sys.executable, "-m", "chainrun", "ui"], env=cli_env(home), stdout=subprocess.PIPE, text=True
        )
        try:
            assert ui.stdout is not None
            url = ui.stdout.readline().strip()
            _, body = _get(url.replace("/?", f"/chain/{chain_id}?"))  # as a browser: keeps the cookie
        finally:
            ui.kill()
            ui.wait()
        assert "self-queueing off (the carrier does not run with python3 there" in body, body
        chainrun("cancel", chain_id, check=True)
