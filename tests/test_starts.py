"""When a segment would start at one place (issue 39): ``Cluster.expected_start`` asks the real
Slurm (``sbatch --test-only``), the real SGE (its queues' slots and pending jobs) and the local
runner (its slots), queueing nothing; a place that is full answers a later start, one that is
down or refuses the segment answers None with its reason. The parse tests read outputs copied
from the real schedulers here (tests/cluster/slurm_facts.md and sge_facts.md, "When a job would
start")."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import pytest
from conftest import answers, have, holding_scheduler, need, slurm_answers, wait_for

from chainrun.cluster import Cluster
from chainrun.model import CommandResult, JobSpec, SchedulerSpec
from chainrun.schedulers import scheduler_for
from chainrun.schedulers.local import LocalScheduler
from chainrun.schedulers.segment import SegmentJob
from chainrun.schedulers.sge import SgeScheduler
from chainrun.schedulers.slurm import SlurmScheduler
from chainrun.starts import NOW_SLACK, UNKNOWN_WAIT, Start, cannot, expected, starts_now, unknown
from chainrun.testing import FakeClock, FakeCluster
from chainrun.transport import transport_for

NOW = 1795946316.0  # 2026-11-29 09:58:36 UTC, when the outputs below were recorded
SSH_CONFIG = "/var/lib/chainrun-test/ssh/config"  # root-local: this machine over the test sshd


def spec(kind: str, queue: Optional[str] = None, options: tuple[str, ...] = (), **sched: int) -> JobSpec:
    return JobSpec(
        name="est",
        command="true",
        workdir="/tmp",
        total_time=3600,
        walltime=600,
        target_epoch=None,
        max_failures=1,
        checkpoint_dir="/tmp/ck",
        signal="USR1",
        grace=60,
        scheduler=SchedulerSpec(kind=kind, queue=queue, options=options, **sched),  # type: ignore[arg-type]
        env=(),
    )


def job(kind: str, queue: Optional[str] = None, options: tuple[str, ...] = (), **sched: int) -> SegmentJob:
    return SegmentJob("est-0a1b2c", 2, spec(kind, queue, options, **sched), 600)


def out(stdout: str = "", stderr: str = "", rc: int = 0) -> CommandResult:
    return CommandResult(("x",), rc, stdout, stderr)


# -- the answer itself --------------------------------------------------------------------


def test_now_beats_later_beats_not_known_when_beats_cannot() -> None:
    """The places' choice is by soonest start: "now", then a reckoned start, then "not known
    when" (a day), and a place that cannot start it at all last."""
    now = starts_now(NOW, "free")
    later = expected(NOW + 3600, NOW, "behind a job")
    vague = unknown(NOW, "full")
    down = cannot("slurmctld does not answer")
    assert sorted([down, vague, later, now], key=lambda s: s.key) == [now, later, vague, down]
    assert now.at == NOW and vague.at == NOW + UNKNOWN_WAIT and down.at is None
    assert expected(NOW + NOW_SLACK, NOW, "sbatch").at == NOW  # Slurm answers now + 1 s: "now"
    assert expected(NOW + NOW_SLACK, NOW, "sbatch").reason == "starts now (sbatch)"
    assert re.fullmatch(r"about \d\d:\d\d, in 1h \(behind a job\)", later.reason), later.reason


# -- Slurm: sbatch --test-only, sinfo, squeue (outputs copied from the test Slurm) --------

FREE = "sbatch: Job 5432 to start at 1795946317 using 1 processors on nodes node1 in partition multi\n"
BEHIND = "sbatch: Job 5429 to start at 1795946616 using 1 processors on nodes node3 in partition multi\n"
SINFO = "debug|up\nlow-requeue|up\nlow-cancel|up\nhigh|up\nslow-start|up\nmulti|up\n"


def test_slurm_asks_test_only_with_the_segments_own_directives_then_sinfo_and_squeue() -> None:
    a_job = job("slurm", "gpu", ("--gres=gpu:1",))
    test_only, sinfo, squeue = SlurmScheduler().start_argvs(a_job)
    assert test_only[:2] == ["env", "SLURM_TIME_FORMAT=%s"]
    assert test_only[2:] == SlurmScheduler().shape_argv(a_job)  # the one shape question, reused
    assert "--partition=gpu" in test_only and "--gres=gpu:1" in test_only and "--time=0-00:10:00" in test_only
    assert sinfo[0] == "sinfo" and squeue[0] == "squeue" and "--states=PENDING" in squeue


def test_slurm_reads_the_start_test_only_answers() -> None:
    slurm, a_job = SlurmScheduler(), job("slurm", "multi")
    now = slurm.parse_start(a_job, [out(stderr=FREE), out(SINFO), out("")], NOW)
    assert now == Start(NOW, "starts now (on node1 in partition multi, sbatch --test-only)")
    later = slurm.parse_start(a_job, [out(stderr=BEHIND), out(SINFO), out("")], NOW)
    assert later.at == 1795946616 and later.reason.startswith("about ") and "in 5m" in later.reason


def test_slurm_counts_the_jobs_pending_in_the_partition_which_test_only_does_not_see() -> None:
    """slurm_facts.md: --test-only does not see pending jobs' backfill reservations, so its
    start may be early; the jobs pending there for their turn are named beside it (not those
    waiting for a dependency, a hold or a begin time, nor those of other partitions)."""
    pending = "multi|Resources\nmulti,debug|Priority\nmulti|Dependency\ndebug|Resources\nmulti|JobHeldUser\n"
    answer = SlurmScheduler().parse_start(
        job("slurm", "multi"), [out(stderr=BEHIND), out(SINFO), out(pending)], NOW
    )
    assert answer.at == 1795946616
    assert "2 jobs pending there, which it does not count" in answer.reason, answer.reason


@pytest.mark.parametrize("state", ["down", "drain", "inact"])
def test_slurm_a_partition_sinfo_does_not_show_up_cannot_start_it(state: str) -> None:
    """Whatever --test-only reckons, a partition that is down (maintenance) starts nothing."""
    answer = SlurmScheduler().parse_start(
        job("slurm", "multi"),
        [out(stderr=FREE), out(SINFO.replace("multi|up", f"multi|{state}")), out("")],
        NOW,
    )
    assert answer == Start(None, f"partition multi is {state} (sinfo)")


def test_slurm_a_refusal_and_a_controller_that_does_not_answer_cannot_start_it() -> None:
    slurm, a_job = SlurmScheduler(), job("slurm", "nosuch")
    refused = out(
        stderr="sbatch: error: invalid partition specified: nosuch\n"
        "allocation failure: Invalid partition name specified\n",
        rc=1,
    )
    assert slurm.parse_start(a_job, [refused], NOW) == Start(
        None,
        "sbatch --test-only refuses it: invalid partition specified: nosuch; Invalid partition name specified",
    )
    down = out(stderr="allocation failure: Unable to contact slurm controller (connect failure)\n", rc=1)
    answer = slurm.parse_start(a_job, [down], NOW)
    assert answer.at is None and answer.reason.startswith("slurmctld does not answer: "), answer
    assert "Unable to contact slurm controller" in answer.reason


# -- SGE: qsub -w v, qstat -g c, qstat -xml -r -u '*' (outputs copied from the test SGE) ---

SUMMARY = """CLUSTER QUEUE                   CQLOAD   USED    RES  AVAIL  TOTAL aoACDS  cdsuE
--------------------------------------------------------------------------------
all.q                             {load}      {used}      0      {avail}      4      {a}      {c}
"""
VERIFIED = out("verification: found suitable queue(s)\n")


def running(n: int, start: str = "2026-11-29T09:59:56", h_rt: str = "300", state: str = "r") -> str:
    limit = (
        f'<hard_request name="h_rt" resource_contribution="0.000000">{h_rt}</hard_request>' if h_rt else ""
    )
    return "".join(
        f"""<job_list state="running"><JB_job_number>{2511 + i}</JB_job_number><JB_name>estblk{i}</JB_name>
      <JB_owner>root</JB_owner><state>{state}</state><JAT_start_time>{start}</JAT_start_time>
      <queue_name>all.q@vm</queue_name><slots>1</slots>{limit}</job_list>"""
        for i in range(n)
    )


def pending(state: str = "qw", queue: str = "") -> str:
    wanted = f"<hard_req_queue>{queue}</hard_req_queue>" if queue else ""
    return f"""<job_list state="pending"><JB_job_number>2515</JB_job_number><JB_name>estblk5</JB_name>
      <state>{state}</state><queue_name></queue_name><slots>1</slots>{wanted}</job_list>"""


def jobs(queued: str, waiting: str = "") -> CommandResult:
    return out(
        f"<?xml version='1.0'?><job_info><queue_info>{queued}</queue_info><job_info>{waiting}</job_info></job_info>"
    )


def summary(used: int, avail: int, a: int = 0, c: int = 0) -> CommandResult:
    return out(SUMMARY.format(load="0.58", used=used, avail=avail, a=a, c=c))


def test_sge_asks_qsub_w_v_with_the_segments_directives_then_the_queues_and_the_jobs() -> None:
    a_job = job("sge", "all.q")
    verify, queues, listing = SgeScheduler().start_argvs(a_job)
    assert verify == SgeScheduler().shape_argv(a_job)
    assert queues == ["qstat", "-g", "c"]
    assert listing == ["env", "TZ=UTC", "qstat", "-xml", "-r", "-u", "*"]


def test_sge_free_slots_and_nothing_pending_ahead_starts_now() -> None:
    answer = SgeScheduler().parse_start(job("sge", "all.q"), [VERIFIED, summary(1, 3), jobs(running(1))], NOW)
    assert answer == Start(NOW, "starts now (3 of 4 slots free on queue all.q)")


def test_sge_a_full_queue_starts_when_a_running_job_reaches_its_h_rt() -> None:
    """4 of 4 slots taken by jobs with h_rt=300 started 09:59:56 (UTC), one job pending ahead:
    the slot for this one is the second to free, at 10:04:56 at the latest."""
    answer = SgeScheduler().parse_start(
        job("sge", "all.q"), [VERIFIED, summary(4, 0), jobs(running(4), pending())], NOW
    )
    assert answer.at == NOW + 80 + 300  # 09:58:36 + 80 s = 09:59:56, + h_rt
    assert (
        "when running jobs reach their h_rt; 0 of 4 slots free on queue all.q, 1 job pending" in answer.reason
    )


@pytest.mark.parametrize("state", ["t", "s", "S", "dr"])
def test_sge_a_job_being_sent_to_its_host_or_suspended_holds_its_slot_until_its_h_rt(state: str) -> None:
    """A job the scheduler dispatched is in state t until the execd starts it (seconds, more on
    a busy host), with its start time and h_rt; qstat -g c counts its slot as used already. It
    frees the slot at its h_rt like a running one: not "not known when" (CI at 566e417)."""
    answer = SgeScheduler().parse_start(
        job("sge", "all.q"), [VERIFIED, summary(4, 0), jobs(running(4, state=state))], NOW
    )
    assert answer.at == NOW + 80 + 300, answer
    assert "when running jobs reach their h_rt; 0 of 4 slots free on queue all.q" in answer.reason


def test_sge_held_and_error_jobs_and_those_for_other_queues_are_not_ahead() -> None:
    waiting = pending("hqw") + pending("Eqw") + pending("qw", "other.q")
    answer = SgeScheduler().parse_start(
        job("sge", "all.q"), [VERIFIED, summary(1, 3), jobs(running(1), waiting)], NOW
    )
    assert answer.at == NOW, answer


def test_sge_a_full_queue_of_jobs_without_h_rt_starts_later_not_known_when() -> None:
    answer = SgeScheduler().parse_start(
        job("sge", "all.q"), [VERIFIED, summary(4, 0), jobs(running(4, h_rt=""))], NOW
    )
    assert answer == Start(NOW + UNKNOWN_WAIT, "later, not known when (0 of 4 slots free on queue all.q)")


@pytest.mark.parametrize(
    "listing", [out(rc=1, stderr="error: failed receiving gdi request"), out("<job_info")]
)
def test_sge_jobs_it_cannot_read_leave_a_full_queue_not_known_when_and_say_so(listing: CommandResult) -> None:
    answer = SgeScheduler().parse_start(job("sge", "all.q"), [VERIFIED, summary(4, 0), listing], NOW)
    assert answer == Start(
        NOW + UNKNOWN_WAIT,
        "later, not known when (0 of 4 slots free on queue all.q; its jobs not read (qstat -xml -r -u '*' failed))",
    )


def test_sge_a_queue_whose_slots_are_all_disabled_or_suspended_cannot_start_it() -> None:
    answer = SgeScheduler().parse_start(job("sge", "all.q"), [VERIFIED, summary(0, 0, c=4), jobs("")], NOW)
    assert answer == Start(None, "queue all.q is disabled, suspended, in alarm or unknown (qstat -g c)")


def test_sge_queues_it_cannot_read_or_without_slots_cannot_start_it() -> None:
    sge, a_job = SgeScheduler(), job("sge", "all.q")
    failed = sge.parse_start(a_job, [VERIFIED, out(rc=1), jobs("")], NOW)
    assert failed == Start(None, "qstat -g c: x exited 1")
    other = out(SUMMARY.format(load="0.58", used=0, avail=4, a=0, c=0).replace("all.q", "gpu.q"))
    assert sge.parse_start(a_job, [VERIFIED, other, jobs("")], NOW) == Start(
        None, "queue all.q has no slots (qstat -g c)"
    )
    assert sge.parse_start(job("sge"), [VERIFIED, other, jobs("")], NOW).reason == (
        "starts now (4 of 4 slots free on queue gpu.q)"  # no queue asked: any queue
    )


def test_sge_a_refusal_and_a_qmaster_that_does_not_answer_cannot_start_it() -> None:
    sge, a_job = SgeScheduler(), job("sge", "nosuch.q")
    refused = out(
        stderr='Unable to run job: Job was rejected because job requests unknown queue "nosuch.q"\nExiting.\n',
        rc=1,
    )
    assert sge.parse_start(a_job, [refused], NOW) == Start(
        None, 'qsub -w v refuses it: Job was rejected because job requests unknown queue "nosuch.q"'
    )
    down = out(
        stderr="error: commlib error: got select error (Connection refused)\nUnable to run job: unable to send "
        'message to qmaster using port 6444 on host "vm": got send error\nExiting.\n',
        rc=1,
    )
    answer = sge.parse_start(a_job, [down], NOW)
    assert answer.at is None and answer.reason.startswith("qmaster does not answer: "), answer


# -- the local runner: its slots ------------------------------------------------------------


def poll_line(state: str, slot: Optional[int] = None, started: float = NOW - 100, reason: str = "") -> str:
    if state == "running":
        return f'{{"id": 1, "name": "x", "state": "running", "started_at": {started}, "slot": {slot}, "walltime": 600}}\n'
    return f'{{"id": 2, "name": "y", "state": "pending", "reason": "{reason}"}}\n'


def test_local_without_slots_every_job_starts_now() -> None:
    answer = LocalScheduler().parse_start(job("local"), [out(poll_line("running", 0))], NOW)
    assert answer == Start(NOW, "starts now (no slot limit on this machine)")


def test_local_a_free_slot_starts_now_and_a_full_machine_when_a_walltime_ends() -> None:
    local = LocalScheduler()
    two = job("local", slots=2)
    assert local.parse_start(two, [out(poll_line("running", 0))], NOW) == Start(
        NOW, "starts now (1 of 2 slots free)"
    )
    full = out(poll_line("running", 0, NOW - 100) + poll_line("running", 1, NOW - 300))
    answer = local.parse_start(two, [full], NOW)
    assert answer.at == NOW + 300 and "0 of 2 slots free" in answer.reason  # the older one ends first
    waiting = out(
        full.stdout + poll_line("pending", reason="Resources") + poll_line("pending", reason="Dependency")
    )
    answer = local.parse_start(two, [waiting], NOW)
    assert answer.at == NOW + 500 and "1 job waiting for one" in answer.reason  # the first slot is taken


# -- the same question through Cluster.expected_start ---------------------------------------


def test_a_place_that_does_not_answer_is_asked_once_and_cannot_start_it() -> None:
    """Through the fake cluster: the answer and the controller that is down; when the question
    fails, nothing more is asked (a down controller would make each command wait its timeout)."""
    world = FakeCluster(FakeClock(NOW))
    cluster = Cluster(world.scheduler(), world.transport())
    assert cluster.expected_start(job("fake"), now=NOW) == Start(NOW, "starts now (fake)")
    world.start_in = 7200
    assert cluster.expected_start(job("fake"), now=NOW).at == NOW + 7200
    world.start_in = None
    assert cluster.expected_start(job("fake"), now=NOW) == Start(None, "the fake cluster refuses it")
    world.down, world.commands = True, []
    answer = cluster.expected_start(job("fake"), now=NOW)
    assert answer.at is None and "does not answer" in answer.reason
    assert world.commands == [["fake-start"]]


def test_slurms_question_fails_once_and_the_rest_is_not_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed first command ends the asking (no sinfo or squeue after a refusal)."""
    ran: list[list[str]] = []

    class Recording:
        host = None

        def run(self, argv: list[str], timeout: float) -> CommandResult:
            ran.append(list(argv))
            return out(
                stderr="allocation failure: Unable to contact slurm controller (connect failure)\n", rc=1
            )

    answer = Cluster(SlurmScheduler(), Recording()).expected_start(job("slurm"))  # type: ignore[arg-type]
    assert answer.at is None and answer.reason.startswith("slurmctld does not answer")
    assert len(ran) == 1 and "--test-only" in ran[0]


# -- on the real schedulers -------------------------------------------------------------------


def local_cluster(kind: str) -> Cluster:
    return Cluster(scheduler_for(kind, None), transport_for(None))


def squeue(job_id: str, fmt: str) -> str:
    env = dict(os.environ, SLURM_TIME_FORMAT="%s")
    return subprocess.run(
        ["squeue", "--noheader", f"--jobs={job_id}", f"--format={fmt}"],
        capture_output=True,
        text=True,
        env=env,
    ).stdout.strip()


@pytest.fixture
def node3() -> Iterator[None]:
    """node3 of the multi-node test Slurm (partition multi), shared with the tests beside this one."""
    with holding_scheduler("slurm"), holding_scheduler("slurm-nodes"):
        need("a running Slurm", slurm_answers(), "sudo scripts/start-slurm")
        nodes = subprocess.run(
            ["sinfo", "--noheader", "--Node", "--partition=multi", "--format=%N %t"],
            capture_output=True,
            text=True,
        ).stdout
        need(
            "the multi-node Slurm (node3 in partition multi)",
            "node3" in nodes,
            "sudo scripts/start-slurm --nodes 3",
        )
        yield


@pytest.mark.slurm
def test_slurm_node_free_starts_now_and_behind_a_blocker_about_when_it_ends(node3: None) -> None:
    """On node3 (2 CPUs): free, the segment starts now; with a blocker holding the whole node
    for 5 minutes, it starts about when the blocker ends (its EndTime), as Slurm reckons; the
    blocker (this test's own job) is cancelled at once after."""
    cluster = local_cluster("slurm")
    a_job = job("slurm", "multi", ("--nodelist=node3",))

    def now_there() -> bool:
        return cluster.expected_start(a_job).reason.startswith("starts now (on node3 in partition multi")

    wait_for(now_there, 300, "node3 to be free")  # other tests' jobs may be on it for a while
    blocker = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--partition=multi",
            "--nodelist=node3",
            "--exclusive",
            "--time=5",
            "--output=/dev/null",
            "--job-name=est-blocker",
            "--wrap=sleep 300",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    try:
        wait_for(lambda: squeue(blocker, "%T") == "RUNNING", 300, "the blocker to run")
        end = float(squeue(blocker, "%e"))
        answer = cluster.expected_start(a_job)
        # The blocker's EndTime; a minute more when another test's job pends for node3 (measured).
        assert answer.at is not None and end - 5 <= answer.at <= end + 120, (answer, end)
        assert answer.at > time.time() + NOW_SLACK and answer.reason.startswith("about "), answer
        assert "on node3 in partition multi, sbatch --test-only" in answer.reason
    finally:
        subprocess.run(["scancel", blocker], check=True)


@pytest.mark.slurm
def test_slurm_a_partition_it_does_not_have_cannot_start_it(shared_slurm: None) -> None:
    answer = local_cluster("slurm").expected_start(job("slurm", "no-such-partition"))
    assert answer.at is None
    assert answer.reason == (
        "sbatch --test-only refuses it: invalid partition specified: no-such-partition; "
        "Invalid partition name specified"
    )


@pytest.mark.slurm
def test_slurm_a_controller_that_does_not_answer_cannot_start_it(
    shared_slurm: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shared slurmctld keeps running: the commands are pointed at a controller port nothing
    listens on (SLURM_CONF, a copy of the real one), through the same code path."""
    conf = Path(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")).read_text()
    conf = re.sub(r"(?m)^SlurmctldPort=.*$", "SlurmctldPort=1", conf)
    conf = re.sub(r"(?m)^MessageTimeout=.*$", "MessageTimeout=2", conf)  # gives up after 1 s
    (tmp_path / "slurm.conf").write_text(conf)
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))
    answer = local_cluster("slurm").expected_start(job("slurm", "debug"))
    assert answer.at is None
    assert answer.reason.startswith("slurmctld does not answer: sbatch --test-only: ") and (
        "Unable to contact slurm controller" in answer.reason
    ), answer


@pytest.fixture
def sge(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with holding_scheduler("sge"):
        need("a running SGE", have("qsub") and answers("qstat"), "sudo scripts/start-sge")
        yield


def qsub(*args: str) -> str:
    return subprocess.run(
        ["qsub", "-terse", *args], capture_output=True, text=True, check=True
    ).stdout.strip()


@pytest.mark.sge
def test_sge_free_starts_now_and_a_full_queue_not_now(sge: None) -> None:
    """all.q's slots filled by blockers with h_rt=300 (this test's own jobs, deleted after): the
    segment does not start now, but about when the first of them reaches its h_rt."""
    cluster = local_cluster("sge")
    a_job = job("sge", "all.q")
    wait_for(lambda: cluster.expected_start(a_job).at is not None, 60, "qmaster to answer")
    wait_for(
        lambda: cluster.expected_start(a_job).reason.startswith("starts now"), 300, "a free slot on all.q"
    )
    total = int(re.search(r"of (\d+) slots? free", cluster.expected_start(a_job).reason).group(1))  # type: ignore[union-attr]
    blockers = []
    try:
        for _ in range(total):
            blockers.append(
                qsub(
                    "-N",
                    "est-blocker",
                    "-q",
                    "all.q",
                    "-o",
                    "/dev/null",
                    "-j",
                    "y",
                    "-l",
                    "h_rt=300",
                    "-b",
                    "y",
                    "sleep",
                    "290",
                )
            )
        first = time.time()
        wait_for(
            lambda: not cluster.expected_start(a_job).reason.startswith("starts now"), 300, "all.q to be full"
        )
        answer = cluster.expected_start(a_job)
        assert answer.at is not None and answer.at > time.time() + NOW_SLACK, answer
        assert answer.at <= first + 300 + 60 or "pending" in answer.reason, (
            answer
        )  # others' jobs may be ahead
        assert f"0 of {total} slots free on queue all.q" in answer.reason, answer
    finally:
        if blockers:
            subprocess.run(["qdel", *blockers], capture_output=True)


@pytest.mark.sge
def test_sge_a_queue_it_does_not_have_and_a_qmaster_that_does_not_answer(
    sge: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = local_cluster("sge")
    answer = cluster.expected_start(job("sge", "no-such.q"))
    assert answer == Start(
        None, 'qsub -w v refuses it: Job was rejected because job requests unknown queue "no-such.q"'
    )
    monkeypatch.setenv("SGE_QMASTER_PORT", "1")  # nothing listens there: the real qmaster keeps running
    answer = cluster.expected_start(job("sge", "all.q"))
    assert answer.at is None and answer.reason.startswith("qmaster does not answer: "), answer
    assert "unable to send message to qmaster using port 1" in answer.reason


def test_local_runner_a_full_machine_starts_when_its_job_reaches_its_walltime(
    home: Path, tmp_path: Path
) -> None:
    """The real local runner with one slot: free, now; one job in it (walltime 300 s), about
    when that job's walltime ends."""
    cluster = local_cluster("local")
    a_job = job("local", slots=1)
    assert cluster.expected_start(a_job).reason == "starts now (1 of 1 slot free)"
    script = tmp_path / "sleep.sh"
    script.write_text("#!/bin/bash\nsleep 300\n")
    runner = [sys.executable, "-m", "chainrun.localrunner"]
    job_id = subprocess.run(
        [
            *runner,
            "submit",
            "--name",
            "est-block",
            "--output",
            str(tmp_path / "log"),
            "--walltime",
            "300",
            "--signal",
            "TERM",
            "--grace",
            "5",
            "--slots",
            "1",
            str(script),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    try:
        wait_for(
            lambda: not cluster.expected_start(a_job).reason.startswith("starts now"), 60, "the job to run"
        )
        answer = cluster.expected_start(a_job)
        assert answer.at is not None and time.time() + 200 < answer.at <= time.time() + 300, answer
        assert "when running jobs reach their walltime; 0 of 1 slot free" in answer.reason
    finally:
        subprocess.run([*runner, "cancel", job_id], check=True)


@pytest.mark.slurm
@pytest.mark.ssh
def test_slurm_over_ssh_is_asked_through_the_clusters_transport(
    shared_slurm: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    need("the test sshd", Path(SSH_CONFIG).exists(), "sudo scripts/start-sshd")
    monkeypatch.setenv("CHAINRUN_SSH_CONFIG", SSH_CONFIG)
    cluster = Cluster(scheduler_for("slurm", "root-local"), transport_for("root-local"))
    answer = cluster.expected_start(job("slurm", "no-such-partition"))
    assert answer.at is None and "invalid partition specified: no-such-partition" in answer.reason
    answer = cluster.expected_start(job("slurm", "debug"))
    assert answer.at is not None and "in partition debug, sbatch --test-only" in answer.reason, answer


@pytest.mark.ssh
def test_a_pool_host_over_ssh_is_asked_through_its_runners_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool host (the local runner over SSH) asked before anything else ran there: the
    runner's copy is placed first, then its poll answers with the slots free."""
    need("the test sshd", Path(SSH_CONFIG).exists(), "sudo scripts/start-sshd")
    monkeypatch.setenv("CHAINRUN_SSH_CONFIG", SSH_CONFIG)
    cluster = Cluster(scheduler_for("local", "root-local"), transport_for("root-local"))
    answer = cluster.expected_start(job("local", slots=50))
    assert answer.at is not None and re.fullmatch(r"starts now \(\d+ of 50 slots free.*\)", answer.reason), (
        answer
    )
    assert cluster.placed  # the runner's copy, found or written
