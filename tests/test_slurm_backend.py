"""The Slurm backend's builders and parsers, on outputs copied from the real Slurm 22.05
(tests/cluster/slurm_facts.md). The chains themselves run against the real Slurm in test_contract."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import without_runner_hash

from chainrun.errors import SchedulerError
from chainrun.model import JobSpec, Outcome, Phase, SchedulerSpec
from chainrun.schedulers.script import render_script
from chainrun.schedulers.segment import SegmentJob
from chainrun.schedulers.slurm import STATES, SlurmScheduler, slurm_time
from chainrun.transport import CommandResult

GOLDEN = Path(__file__).parent / "data" / "golden" / "slurm-hostile.sh"
HOSTILE_COMMAND = (
    "python3 train.py --note \"it's $(rm -rf ~) `id` ${HOME}\" \\\n  --lr 1e-3; echo 'done' # end"
)
HOSTILE_ENV = (("NOTE", "a'b\"c $(id) `id` ${X}\nline two"), ("EMPTY", ""))


def hostile_spec(workdir: str = "/scratch/my run's dir $x") -> JobSpec:
    return JobSpec(
        name="hostile",
        command=HOSTILE_COMMAND,
        workdir=workdir,
        total_time=86400,
        walltime=3 * 3600 + 1,
        target_epoch=30,
        max_failures=2,
        checkpoint_dir=workdir + "/ckpt 'x'",
        signal="USR1",
        grace=300,
        scheduler=SchedulerSpec(kind="slurm", queue="gpu", options=("--gres=gpu:1", "--mem=16G")),
        env=HOSTILE_ENV,
    )


def result(rc: int, out: str = "", err: str = "") -> CommandResult:
    return CommandResult(("sbatch",), rc, out, err)


def test_batch_script_matches_the_golden_file() -> None:
    """Every value from the job file lands quoted; the directives carry tag, limits and signal."""
    job = SegmentJob("hostile-1a2b3c", 3, hostile_spec(), 3 * 3600 + 1)
    script = without_runner_hash(render_script(SlurmScheduler(), job))
    if os.environ.get("CHAINRUN_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(script)
    assert script == GOLDEN.read_text()


def test_submit_argv_chains_with_afterany_and_keeps_paths_as_single_arguments() -> None:
    job = SegmentJob("c-1", 2, hostile_spec(), 600, after="41")
    argv = SlurmScheduler().submit_argv(job)
    assert argv[:2] == ["sbatch", "--parsable"]
    assert "--dependency=afterany:41" in argv
    assert f"--output={job.log_path}" in argv and f"--chdir={job.spec.workdir}" in argv
    assert argv[-1] == job.script_path
    assert "--dependency=afterany:41" not in SlurmScheduler().submit_argv(replace(job, after=None))


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (1, "0-00:01:00"),
        (60, "0-00:01:00"),
        (61, "0-00:02:00"),
        (4 * 3600, "0-04:00:00"),
        (86400 * 2 + 5, "2-00:01:00"),
    ],
)
def test_time_limit_rounds_up_to_whole_minutes(seconds: int, text: str) -> None:
    assert slurm_time(seconds) == text


def test_parse_submit_reads_the_parsable_id() -> None:
    assert SlurmScheduler().parse_submit(result(0, "1234\n")) == "1234"
    assert SlurmScheduler().parse_submit(result(0, "1234;cluster2\n")) == "1234"


@pytest.mark.parametrize(
    ("rc", "err", "transient"),
    [
        (
            1,
            "sbatch: error: invalid partition specified: nosuch\n"
            "sbatch: error: Batch job submission failed: Invalid partition name specified\n",
            False,
        ),
        (
            255,
            "sbatch: unrecognized option '--nosuchopt'\nTry \"sbatch --help\" for more information\n",
            False,
        ),
        (255, "sbatch: error: Invalid --time specification\n", False),
        (
            1,
            "sbatch: error: Batch job submission failed: Invalid account or account/partition combination\n",
            False,
        ),
        (
            1,
            "sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)\n",
            True,
        ),
        (1, "sbatch: error: Batch job submission failed: Socket timed out on send/recv operation\n", True),
        (127, "bash: sbatch: command not found\n", False),
    ],
)
def test_submit_errors_are_split_into_transient_and_permanent(rc: int, err: str, transient: bool) -> None:
    with pytest.raises(SchedulerError) as caught:
        SlurmScheduler().parse_submit(result(rc, "", err))
    assert caught.value.transient is transient
    assert err.splitlines()[-1].split(": ")[-1] in str(caught.value)


# Lines copied from `SLURM_TIME_FORMAT=%s squeue --me -t all -h -o '%i|%j|%T|%r|%S|%e|%N'` on the test
# cluster (jobs 13-15 in the same form: this cluster cannot OOM, fail a node or preempt; 16 ran on
# two nodes of the multi-node partition). A job never started has no nodes.
POLL = """\
2|cr.a-1.2|PENDING|Dependency|N/A|N/A|
8|ignterm|PENDING|Resources|N/A|N/A|
12|afterok-on-failed|PENDING|DependencyNeverSatisfied|N/A|N/A|
4|tmo|RUNNING|None|1795644629|1795644689|vm
7|runcancel|RUNNING|None|1795644638|NONE|vm
9|ignterm|COMPLETING|None|1795644651|1795644652|vm
1|envjob.sh|COMPLETED|None|1795644629|1795644644|vm
5|tmo|TIMEOUT|TimeLimit|1795644629|1795644716|vm
6|pendcancel|CANCELLED|Dependency|1795644637|1795644637|
3|name|with|bars|FAILED|NonZeroExitCode|1795644629|1795644629|vm
13|oom|OUT_OF_MEMORY|OutOfMemory|1795644629|1795644631|vm
14|nf|NODE_FAIL|NodeDown|1795644629|1795644631|vm
15|pre|PREEMPTED|None|1795644629|1795644631|vm
16|cr.t-026ddb.1|FAILED|NonZeroExitCode|1795947321|1795947328|node[1-2]
"""


def test_a_line_the_same_as_at_the_last_poll_gives_the_very_same_job() -> None:
    """A line unchanged since the last listing is not parsed again: its job is the very
    object of that listing (by which the engine sees at a glance what did not change); a
    changed line gives a new job, as a fresh parse of it does, and a line that left the
    listing is forgotten."""
    first = SlurmScheduler().parse_poll(CommandResult(("squeue",), 0, POLL, ""))
    changed = POLL.replace(
        "4|tmo|RUNNING|None|1795644629|1795644689|vm", "4|tmo|COMPLETED|None|1795644629|1795644689|vm"
    )
    changed = changed.replace("8|ignterm|PENDING|Resources|N/A|N/A|\n", "")
    again = SlurmScheduler().parse_poll(CommandResult(("squeue",), 0, changed, ""))
    assert again["2"] is first["2"] and again["12"] is first["12"]
    assert again["4"] is not first["4"] and again["4"].outcome is Outcome.COMPLETED
    assert "8" not in again
    back = SlurmScheduler().parse_poll(CommandResult(("squeue",), 0, POLL, ""))
    assert back == first
    assert back["2"] is first["2"] and back["8"] is not first["8"], "forgotten when it left the listing"


def test_poll_maps_every_line_through_the_state_table() -> None:
    jobs = SlurmScheduler().parse_poll(CommandResult(("squeue",), 0, POLL, ""))
    view = {i: (j.phase, j.outcome) for i, j in jobs.items()}
    assert view == {
        "2": (Phase.PENDING, None),
        "8": (Phase.PENDING, None),
        "12": (Phase.ENDED, Outcome.FAILED),
        "4": (Phase.RUNNING, None),
        "7": (Phase.RUNNING, None),
        "9": (Phase.RUNNING, None),
        "1": (Phase.ENDED, Outcome.COMPLETED),
        "5": (Phase.ENDED, Outcome.TIMEOUT),
        "6": (Phase.ENDED, Outcome.CANCELLED),
        "3": (Phase.ENDED, Outcome.FAILED),
        "13": (Phase.ENDED, Outcome.OOM),
        "14": (Phase.ENDED, Outcome.NODE_FAIL),
        "15": (Phase.ENDED, Outcome.PREEMPTED),
        "16": (Phase.ENDED, Outcome.FAILED),
    }
    assert (jobs["16"].nodes, jobs["1"].nodes) == ("node[1-2]", "vm")
    assert jobs["4"].nodes == "" and jobs["6"].nodes == ""  # running: asked only of an ended job
    assert jobs["2"].name == "cr.a-1.2" and jobs["2"].reason == "Dependency"
    assert jobs["3"].name == "name|with|bars"
    assert jobs["12"].stuck and "DependencyNeverSatisfied" in jobs["12"].reason
    assert jobs["4"].started_at is not None and jobs["4"].ended_at is None
    assert (jobs["1"].started_at, jobs["1"].ended_at) == (1795644629.0, 1795644644.0)
    assert jobs["7"].started_at is not None


# In the form of `sinfo --noheader --Node --nodes=... --format='%N|%t'`: node2 killed a moment before
# (not responding: "*"), node3 in two partitions (a line for each), node4 down since, node5 drained
# (a drain ends no job), node6 failed.
SINFO = """\
node1|idle
node2|idle*
node3|mix
node3|mix
node4|down*
node5|drain
node6|fail
"""


def test_the_nodes_down_are_those_not_responding_down_or_failed() -> None:
    slurm = SlurmScheduler()
    argv = slurm.down_argv("node[1-6]")
    assert argv[0] == "sinfo" and "--nodes=node[1-6]" in argv
    assert slurm.parse_down(CommandResult(("sinfo",), 0, SINFO, "")) == ["node2", "node4", "node6"]
    assert slurm.parse_down(CommandResult(("sinfo",), 1, "", "sinfo: error: Invalid node name\n")) == []


def test_every_job_state_slurm_documents_is_in_the_table() -> None:
    documented = [
        *[
            "BOOT_FAIL",
            "CANCELLED",
            "COMPLETED",
            "CONFIGURING",
            "COMPLETING",
            "DEADLINE",
            "FAILED",
            "NODE_FAIL",
            "OUT_OF_MEMORY",
        ],
        *[
            "PENDING",
            "PREEMPTED",
            "RUNNING",
            "RESV_DEL_HOLD",
            "REQUEUE_FED",
            "REQUEUE_HOLD",
            "REQUEUED",
            "RESIZING",
            "REVOKED",
        ],
        *["SIGNALING", "SPECIAL_EXIT", "STAGE_OUT", "STOPPED", "SUSPENDED", "TIMEOUT"],
    ]
    assert sorted(STATES) == sorted(documented)


def test_poll_failure_while_slurmctld_is_down_is_transient() -> None:
    down = CommandResult(
        ("squeue",), 1, "", "slurm_load_jobs error: Unable to contact slurm controller (connect failure)\n"
    )
    with pytest.raises(SchedulerError) as caught:
        SlurmScheduler().parse_poll(down)
    assert caught.value.transient


# `sacct` with accounting off, copied from the test cluster before scripts/start-slurm turned it on.
ACCOUNTING_OFF = CommandResult(("sacct",), 1, "", "Slurm accounting storage is disabled\n")


def test_accounting_disabled_is_no_answer_not_an_error() -> None:
    assert SlurmScheduler().parse_accounting(ACCOUNTING_OFF) == {}


# Lines copied from `SLURM_TIME_FORMAT=%s sacct --noheader --parsable2 --allocations --jobs=...
# --format=JobID,JobName,State,ExitCode,Start,End` on the test cluster with accounting on (slurmdbd
# 22.05.8 on MariaDB): 261 went over --mem=50M under task/cgroup, 262 the same under
# JobAcctGatherParams=OverMemoryKill without cgroups, 270 and 260 were scancelled (260 without a
# TERM trap), 271 ignored SIGTERM past --time=1, 273 was held past its --deadline, 274 was cancelled
# while pending, 275's node was set down (--no-requeue), 263 was requeued by a node failure, 290 ran.
# 296-297 are in the same form: this cluster cannot preempt or fail to boot a node.
SACCT = """\
268|ok|COMPLETED|0:0|1795692275|1795692276
269|fail3|FAILED|3:0|1795692275|1795692275
261|oom.sh|OUT_OF_MEMORY|0:125|1795692132|1795692132
262|oom.sh|FAILED|0:9|1795692148|1795692150
270|cancelme|CANCELLED by 0|0:0|1795692275|1795692279
260|oom.sh|CANCELLED|0:15|1795692089|1795692110
271|tmo|TIMEOUT|0:0|1795692423|1795692483
273|dl|DEADLINE|1:0|None|1795692321
274|pend|CANCELLED by 0|0:0|None|1795692320
275|nf|NODE_FAIL|0:0|1795692282|1795692284
263|nf.sh|PENDING|0:0|Unknown|Unknown
290|cr.t-b3337a.1|RUNNING|0:0|1795692669|Unknown
296|name|with|bars|PREEMPTED|0:15|1795692669|1795692700
297|bf|BOOT_FAIL|0:0|None|1795692700
"""


def test_accounting_maps_every_state_and_the_exit_code_a_shell_would_report() -> None:
    """Slurm's own marks are no exit codes: OOM's 0:125, and the 0:0 of jobs Slurm ended itself."""
    jobs = SlurmScheduler().parse_accounting(CommandResult(("sacct",), 0, SACCT, ""))
    view = {i: (j.phase, j.outcome, j.exit_code) for i, j in jobs.items()}
    assert view == {
        "268": (Phase.ENDED, Outcome.COMPLETED, 0),
        "269": (Phase.ENDED, Outcome.FAILED, 3),
        "261": (Phase.ENDED, Outcome.OOM, None),
        "262": (Phase.ENDED, Outcome.FAILED, 137),
        "270": (Phase.ENDED, Outcome.CANCELLED, None),
        "260": (Phase.ENDED, Outcome.CANCELLED, 143),
        "271": (Phase.ENDED, Outcome.TIMEOUT, None),
        "273": (Phase.ENDED, Outcome.TIMEOUT, 1),
        "274": (Phase.ENDED, Outcome.CANCELLED, None),
        "275": (Phase.ENDED, Outcome.NODE_FAIL, None),
        "263": (Phase.PENDING, None, None),
        "290": (Phase.RUNNING, None, None),
        "296": (Phase.ENDED, Outcome.PREEMPTED, 143),
        "297": (Phase.ENDED, Outcome.NODE_FAIL, None),
    }
    assert (jobs["275"].started_at, jobs["275"].ended_at) == (1795692282.0, 1795692284.0)
    assert jobs["274"].started_at is None and jobs["274"].ended_at == 1795692320.0
    assert jobs["263"].started_at is None and jobs["263"].ended_at is None
    assert jobs["290"].started_at == 1795692669.0 and jobs["290"].ended_at is None
    assert jobs["270"].reason == "CANCELLED by 0 (sacct)"
    assert jobs["296"].name == "name|with|bars"


def test_accounting_asks_once_for_all_jobs_with_the_fields_it_parses() -> None:
    argv = SlurmScheduler().accounting_argv(["41", "42"])
    assert argv is not None and argv.count("sacct") == 1
    assert "--jobs=41,42" in argv and "--allocations" in argv and "--parsable2" in argv
    assert "--format=JobID,JobName,State,ExitCode,Start,End" in argv


def test_cancel_is_one_scancel_for_all_ids() -> None:
    assert SlurmScheduler().cancel_argv(["7", "8"]) == ["scancel", "7", "8"]
