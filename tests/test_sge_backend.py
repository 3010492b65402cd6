"""The SGE backend's builders and parsers, against outputs measured on a real SGE 8.1.9.

Pure: no scheduler needed. The outputs under tests/data/sge/ are copied from
real runs (tests/cluster/sge_facts.md and the runs that checked this backend).
"""

from __future__ import annotations

import os
import stat
import subprocess
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from conftest import without_runner_hash

from chainrun.errors import SchedulerError
from chainrun.model import JobSpec, ListedJob, Outcome, Phase, SchedulerSpec
from chainrun.schedulers import scheduler_for
from chainrun.schedulers.script import render_script
from chainrun.schedulers.segment import SegmentJob
from chainrun.schedulers.sge import SgeScheduler
from chainrun.transport import CommandResult

DATA = Path(__file__).parent / "data"
SGE = SgeScheduler()

HOSTILE = JobSpec(
    name="hostile",
    command='python3 "train.py" --tag \'a b\' $(whoami) `id` \\\n  --next\necho "done $HOME"',
    workdir="/scratch/my runs/bob's",
    total_time=259200,
    walltime=14400,
    target_epoch=200,
    max_failures=3,
    checkpoint_dir="/scratch/my runs/bob's/ckpt",
    signal="USR1",
    grace=300,
    scheduler=SchedulerSpec(kind="sge", queue="gpu.q", options=("-l gpu=1", "-pe smp 4")),
    env=(("MSG", 'it\'s "$(rm -rf /)" `x`\nline2 $HOME'), ("SEED", "7")),
)


def result(stdout: str = "", stderr: str = "", rc: int = 0) -> CommandResult:
    return CommandResult(argv=("qsub",), returncode=rc, stdout=stdout, stderr=stderr)


def utc(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp()


def test_registered_as_sge_with_the_wrapper_sending_the_warning() -> None:
    """kind "sge" gives this backend; SGE sends no warning before h_rt, so the wrapper does."""
    scheduler = scheduler_for("sge", None)
    assert isinstance(scheduler, SgeScheduler)
    assert (scheduler.kind, scheduler.wrapper_signals) == ("sge", True)


def test_golden_script_for_hostile_job() -> None:
    """Quotes, $(...), backticks and newlines in command, env and paths stay inert."""
    job = SegmentJob("hostile-a1b2c3", 3, HOSTILE, 14400, after="41")
    golden = DATA / "golden" / "sge-hostile.sh"
    script = without_runner_hash(render_script(SGE, job))
    if os.environ.get("CHAINRUN_UPDATE_GOLDEN") == "1":  # after a deliberate change; review the diff
        golden.write_text(script)
    assert script == golden.read_text()


def test_directives_without_queue_or_options() -> None:
    """The queue line only when a queue is set; the limit in seconds; never s_rt."""
    spec = replace(HOSTILE, scheduler=SchedulerSpec(kind="sge"))
    lines = SGE.directives(SegmentJob("a-000001", 1, spec, 1200))
    assert lines == ["#$ -N cr.a-000001.1", "#$ -S /bin/bash", "#$ -j y", "#$ -l h_rt=1200", "#$ -V"]


def test_submit_argv_keeps_colons_and_spaces_in_paths() -> None:
    """-o gets a leading ":" (its syntax is [host:]path); -hold_jid names the predecessor."""
    spec = replace(HOSTILE, workdir="/data/a:b c'd")
    job = SegmentJob("x-1", 2, spec, 600, after="17")
    assert SGE.submit_argv(job) == [
        "qsub", "-terse",
        "-o", ":/data/a:b c'd/.chainrun/x-1/seg-0002.log",
        "-wd", "/data/a:b c'd",
        "-hold_jid", "17",
        "/data/a:b c'd/.chainrun/x-1/seg-0002.sh",
    ]  # fmt: skip
    assert "-hold_jid" not in SGE.submit_argv(SegmentJob("x-1", 1, spec, 600))


@pytest.mark.parametrize("workdir", ["/data/a,b", "/data/$JOB_ID", "/d/$HOMEx", "/d/$USER/x", "/d/$TASK_ID"])
def test_submit_refuses_paths_sge_would_rewrite(workdir: str) -> None:
    """SGE splits -o at "," and replaces $HOME, $USER, ... in -o and -wd (measured): refused, for good."""
    spec = replace(HOSTILE, workdir=workdir)
    with pytest.raises(SchedulerError) as err:
        SGE.submit_argv(SegmentJob("x-1", 1, spec, 600))
    assert not err.value.transient and workdir in str(err.value)


@pytest.mark.parametrize("workdir", ["/d/$x", "/d/${JOB_ID}", "/d/$SGE_TASK_ID", "/d/a:b"])
def test_submit_keeps_paths_sge_leaves_alone(workdir: str) -> None:
    """Measured: these reach the job as written."""
    assert SGE.submit_argv(SegmentJob("x-1", 1, replace(HOSTILE, workdir=workdir), 600))[5] == workdir


@pytest.mark.parametrize(
    "field",
    [{"command": "true\n#$ -q other.q"}, {"env": (("A", "x\n#$ -l h_rt=99999"),)}, {"workdir": "/w\n#$ -V"}],
)
def test_no_value_from_the_job_file_starts_a_line_qsub_would_read_as_a_directive(
    field: dict[str, Any],
) -> None:
    """qsub reads "#$" at the start of any line of the script, inside quotes too (measured): newlines are $'\\n'."""
    script = render_script(SGE, SegmentJob("x-1", 1, replace(HOSTILE, **field), 600))
    directives = [line for line in script.splitlines() if line.startswith("#$")]
    assert directives == SGE.directives(SegmentJob("x-1", 1, replace(HOSTILE, **field), 600))


def test_directives_refuse_a_tag_sge_would_reject_or_mangle() -> None:
    """Job-file names (even "9lives", 64 characters) give tags SGE keeps; anything else is refused."""
    for chain_id in ("9lives-a1b2c3", "x" * 64 + "-a1b2c3"):
        assert SGE.directives(SegmentJob(chain_id, 12, HOSTILE, 600))[0] == f"#$ -N cr.{chain_id}.12"
    with pytest.raises(SchedulerError, match="job name"):
        SGE.directives(SegmentJob("a b", 1, HOSTILE, 600))


# -- qsub ---------------------------------------------------------------------


def test_parse_submit_reads_the_terse_id() -> None:
    assert SGE.parse_submit(result("57\n")) == "57"
    assert SGE.parse_submit(result("60.1-3:1\n")) == "60"  # an array job


@pytest.mark.parametrize(
    ("stderr", "rc"),
    [
        ('Unable to run job: Job was rejected because job requests unknown queue "nosuch"\nExiting.\n', 1),
        ('Unable to run job: attribute "h_rt" is not a time value\nExiting.\n', 1),
        ('Unable to run job: unknown resource "nosuch"\nExiting.\n', 1),
        ('Unable to run job: job rejected: the requested parallel environment "smp" does not exist\nExiting.\n', 1),
        ('qsub: invalid option argument "-bogus"\n', 2),
        ("Unable to read script file because of error: error opening /nonexistent/script.sh: "
         "No such file or directory\n", 14),
        ('Unable to run job: denied: "1abc" is not a valid object name (cannot start with a digit)\nExiting.\n', 1),
        ("Unable to run job: Error reading answer list from qmaster\nExiting.\n", 1),
    ],
)  # fmt: skip
def test_rejections_are_permanent_with_sges_message(stderr: str, rc: int) -> None:
    with pytest.raises(SchedulerError) as err:
        SGE.parse_submit(result(stderr=stderr, rc=rc))
    assert not err.value.transient
    assert stderr.splitlines()[0] in str(err.value) and "Exiting." not in str(err.value)


def test_qmaster_down_is_transient() -> None:
    """Measured with qmaster killed (at once) and hung (after 122 s): same words."""
    stderr = (
        "error: commlib error: got select error (Connection refused)\n"
        'Unable to run job: unable to send message to qmaster using port 6444 on host "vm": got send error\n'
        "Exiting.\n"
    )
    with pytest.raises(SchedulerError) as err:
        SGE.parse_submit(result(stderr=stderr, rc=1))
    assert err.value.transient and "unable to send message to qmaster" in str(err.value)


def test_qsub_not_found_is_permanent_with_a_hint() -> None:
    with pytest.raises(SchedulerError, match=r"qsub not found.*settings\.sh") as err:
        SGE.parse_submit(result(stderr="bash: line 1: qsub: command not found\n", rc=127))
    assert not err.value.transient


def test_unexpected_submit_output_is_transient() -> None:
    with pytest.raises(SchedulerError) as err:
        SGE.parse_submit(result('Your job 60 ("sample") has been submitted\n'))
    assert err.value.transient


# -- qstat ----------------------------------------------------------------------


def test_poll_argv_lists_only_the_callers_jobs_in_utc() -> None:
    """Plain qstat shows only the caller's jobs (measured); TZ=UTC pins its zone-less times."""
    assert SGE.poll_argv() == ["env", "TZ=UTC", "qstat", "-xml"]


def test_parse_poll_running_pending_and_error_jobs() -> None:
    jobs = SGE.parse_poll(result((DATA / "sge" / "qstat.xml").read_text()))
    assert jobs["44"] == ListedJob("44", "hrt", Phase.RUNNING, started_at=utc("2026-11-25T22:15:05"))
    assert jobs["51"].phase is Phase.RUNNING  # dr: qdel'd, still ending
    assert jobs["50"] == ListedJob("50", "holdunk", Phase.PENDING)
    assert jobs["49"] == ListedJob("49", "held", Phase.PENDING, reason="held (hqw)")
    assert jobs["47"] == ListedJob(
        "47", "x100", Phase.ENDED, Outcome.FAILED, reason="error state, SGE will not run it (Eqw)", stuck=True
    )
    # Listed twice while rescheduled (Rr ending, Rq queued again): the later entry wins.
    assert jobs["46"] == ListedJob("46", "x99", Phase.PENDING)
    assert set(jobs) == {"44", "46", "47", "49", "50", "51"}


@pytest.mark.parametrize(
    ("code", "phase"),
    [
        ("qw", Phase.PENDING),
        ("hqw", Phase.PENDING),
        ("hRwq", Phase.PENDING),
        ("Rq", Phase.PENDING),
        ("t", Phase.RUNNING),
        ("r", Phase.RUNNING),
        ("Rr", Phase.RUNNING),
        ("Rt", Phase.RUNNING),
        ("hr", Phase.RUNNING),
        ("s", Phase.RUNNING),
        ("S", Phase.RUNNING),
        ("T", Phase.RUNNING),
        ("ts", Phase.RUNNING),
        ("dr", Phase.RUNNING),
        ("dt", Phase.RUNNING),
        ("dRr", Phase.RUNNING),
        ("Eqw", Phase.ENDED),
        ("Ehqw", Phase.ENDED),
        ("EhRqw", Phase.ENDED),
    ],
)
def test_every_state_maps_through_the_table(code: str, phase: Phase) -> None:
    """Only error states end a job in the live view, and those are stuck: the engine removes them."""
    xml = (
        "<job_info><job_info><job_list><JB_job_number>7</JB_job_number><JB_name>cr.a.1</JB_name>"
        f"<state>{code}</state></job_list></job_info></job_info>"
    )
    job = SGE.parse_poll(result(xml))["7"]
    assert job.phase is phase
    assert job.stuck is (phase is Phase.ENDED)
    assert (job.outcome is Outcome.FAILED) is job.stuck


def test_parse_poll_nothing_queued() -> None:
    empty = (
        "<?xml version='1.0'?>\n"
        '<job_info  xmlns:xsd="http://arc.liv.ac.uk/repos/darcs/sge/source/dist/util/resources/schemas/qstat/qstat.xsd">\n'
        "  <queue_info>\n  </queue_info>\n  <job_info>\n  </job_info>\n</job_info>\n"
    )
    assert SGE.parse_poll(result(empty)) == {}
    assert SGE.parse_poll(result("")) == {}


def test_failed_poll_raises() -> None:
    down = (
        "error: commlib error: got select error (Connection refused)\n"
        'error: unable to send message to qmaster using port 6444 on host "vm": got send error\n'
    )
    with pytest.raises(SchedulerError) as err:
        SGE.parse_poll(result(stderr=down, rc=1))
    assert err.value.transient
    with pytest.raises(SchedulerError):
        SGE.parse_poll(result("<job_info><queue_info>"))


# -- qdel, qstat -j ---------------------------------------------------------------


def test_cancel_deletes_successors_first() -> None:
    """qdel of a predecessor releases its -hold_jid successor: highest id first, one call."""
    assert SGE.cancel_argv(["9", "10", "100"]) == ["qdel", "100", "10", "9"]


def test_explain_reads_the_error_reason() -> None:
    assert SGE.explain_argv("48") == ["qstat", "-j", "48"]
    text = (DATA / "sge" / "qstat-j-eqw.txt").read_text()
    assert SGE.parse_explain(result(text)) == "error: can't chdir to /nonexistent: No such file or directory"
    two = (
        "error reason          1:      11/25/2026 22:15:10 [104:2470]: exit_status of job start = 100\n"
        "error reason          2:      11/25/2026 22:22:02 [0:21737]: error: can't open output file "
        '"/nonexistent/dir/x.log": No such file or directory\n'
    )
    assert SGE.parse_explain(result(two)) == (
        'exit_status of job start = 100; error: can\'t open output file "/nonexistent/dir/x.log": '
        "No such file or directory"
    )
    assert SGE.parse_explain(result(stderr="Following jobs do not exist: \n99999\n", rc=1)) == ""


# -- qacct ------------------------------------------------------------------------


def test_accounting_argv_asks_for_every_job_in_one_round_trip(tmp_path: Path) -> None:
    """The argv really runs qacct once per id (here a stand-in qacct on PATH)."""
    fake = tmp_path / "qacct"
    fake.write_text('#!/bin/sh\necho "args=$* TZ=$TZ"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    argv = SGE.accounting_argv(["5", "6 7"])
    assert argv is not None
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run(argv, capture_output=True, text=True, env=env, check=True).stdout
    assert out == "args=-j 5 TZ=UTC\nargs=-j 6 7 TZ=UTC\n"


def test_parse_accounting_real_outputs() -> None:
    """Blocks measured on the real SGE, read under TZ=UTC; the unknown id is simply absent."""
    stdout = (DATA / "sge" / "qacct-jobs.txt").read_text()
    jobs = SGE.parse_accounting(result(stdout, "error: job id 99999 not found\n", rc=1))
    got = {k: (j.name, j.phase, j.outcome, j.exit_code) for k, j in jobs.items()}
    assert got == {
        "34": ("sgeb-A", Phase.ENDED, Outcome.CANCELLED, 137),  # qdel of a running job
        "38": ("sgeb-e3", Phase.ENDED, Outcome.FAILED, 3),
        "39": ("sgeb-hrt", Phase.ENDED, Outcome.TIMEOUT, 137),  # h_rt kill
        "40": ("sgeb-e99", Phase.ENDED, Outcome.COMPLETED, 0),  # exit 99, rerun exited 0: last block
        "41": ("sgeb-e100", Phase.ENDED, Outcome.FAILED, 100),
        "42": ("sgeb-wd", Phase.ENDED, Outcome.FAILED, 0),  # -wd /nonexistent
    }
    assert jobs["39"].reason == "qacct: failed 37 : qmaster enforced h_rt, h_cpu, or h_vmem limit"
    assert (jobs["39"].started_at, jobs["39"].ended_at) == (
        utc("2026-11-26T01:39:02"),
        utc("2026-11-26T01:39:08"),
    )
    assert jobs["38"].reason == "qacct: exit_status 3"
    assert (
        jobs["42"].started_at is None
        and jobs["42"].reason == "qacct: failed 28 : changing into working directory"
    )


def block(failed: str, exit_status: str, wallclock: str = "5s", category: str = "-l h_rt=3600") -> str:
    """The lines that matter of one qacct block, with the values under test."""
    return (
        "==============================================================\n"
        "jobname      cr.a.1              \njobnumber    7                   \n"
        "start_time   Wed Nov 25 22:15:05 2026\nend_time     Wed Nov 25 22:15:07 2026\n"
        f"failed       {failed}\nexit_status  {exit_status}\nru_wallclock {wallclock}\ncategory     {category}\n"
    )


@pytest.mark.parametrize(
    ("text", "phase", "outcome"),
    [
        (block("0    ", "0"), Phase.ENDED, Outcome.COMPLETED),
        (block("0    ", "137                  (Killed)", "3601s"), Phase.ENDED, Outcome.TIMEOUT),
        (
            block("100 : assumedly after job", "137                  (Killed)", "3601s"),
            Phase.ENDED,
            Outcome.TIMEOUT,
        ),
        (
            block("100 : assumedly after job", "137                  (Killed)", "20s"),
            Phase.ENDED,
            Outcome.CANCELLED,
        ),
        (block("7   : in prolog", "0"), Phase.ENDED, Outcome.NODE_FAIL),
        (block("19  : before writing exit_status", "0"), Phase.ENDED, Outcome.NODE_FAIL),
        (block("17  : through signal", "137"), Phase.ENDED, Outcome.CANCELLED),
        (block("26  : opening input/output file", "0"), Phase.ENDED, Outcome.FAILED),
        (block("25  : rescheduling", "99"), Phase.PENDING, None),
    ],
)
def test_failed_and_exit_status_map_to_outcomes(text: str, phase: Phase, outcome: Outcome) -> None:
    job = SGE.parse_accounting(result(text))["7"]
    assert (job.phase, job.outcome) == (phase, outcome)


def test_failing_qacct_knows_nothing() -> None:
    assert SGE.parse_accounting(result(stderr="error: job id 12 not found\n", rc=1)) == {}
    assert SGE.parse_accounting(result(stderr="sh: 1: qacct: not found\n", rc=127)) == {}
