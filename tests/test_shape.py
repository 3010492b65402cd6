"""A job that cannot start says so at once (issue 36, item 11): ``check`` and ``submit`` ask the
real Slurm (``sbatch --test-only``) and the real SGE (``qsub -w v``) about the segment's shape,
queueing nothing, and refuse one the scheduler would never start with its own reason and what
to change; nothing is stored."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import answers, cli_env, have, holding_scheduler, need, slurm_answers, wait_for
from test_notify import Server, url
from test_notify import server as server  # the fixture: a webhook receiver
from test_slurm_accounting import node_usable
from test_starts import job
from test_ui import _get
from test_ui import ui as ui  # the fixture that starts `chainrun ui`

from chainrun.errors import SchedulerError
from chainrun.model import CommandResult
from chainrun.schedulers.sge import SgeScheduler
from chainrun.schedulers.slurm import SlurmScheduler

CLI = Callable[..., "subprocess.CompletedProcess[str]"]
Service = Callable[..., "subprocess.Popen[bytes]"]


def job_file(where: Path, kind: str, scheduler: str = "", top: str = "", name: str = "shape") -> Path:
    (where / "train.py").write_text("pass\n")
    path = where / "job.toml"
    path.write_text(
        f'name = "{name}"\ncommand = "python3 train.py"\ntotal_time = "2h"\nwalltime = "1h"\n'
        f'{top}[scheduler]\nkind = "{kind}"\n{scheduler}'
    )
    return path


def state(chainrun: CLI, chain_id: str) -> str:
    return str(json.loads(chainrun("status", chain_id, "--json", check=True).stdout)[0]["state"])


def refused(chainrun: CLI, path: Path, reason: str) -> None:
    """``check`` and ``submit`` both exit 2 with the scheduler's ``reason`` and what to change,
    in a few lines and no traceback; no chain is stored."""
    for command in ("check", "submit"):
        result = chainrun(command, str(path))
        assert result.returncode == 2, (command, result.stdout, result.stderr)
        assert reason in result.stderr and "would never start a segment of this shape" in result.stderr
        assert "change [scheduler] queue or options, or walltime" in result.stderr
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) <= 3
    listed = chainrun("status", "--json")
    assert '"id"' not in listed.stdout, listed.stdout


@pytest.mark.slurm
def test_slurm_refuses_a_two_node_segment_on_the_one_node_default_partition(
    tmp_path: Path, chainrun: CLI
) -> None:
    """Issue 36 item 11: --nodes=2 on the default partition (one node) used to be submitted and
    sit pending with PartitionNodeLimit; now check and submit refuse it in Slurm's words."""
    with holding_scheduler("slurm"):
        need("a running Slurm", slurm_answers(), "sudo scripts/start-slurm")
        path = job_file(tmp_path, "slurm", 'options = ["--nodes=2"]\n')
        refused(chainrun, path, "Requested node configuration is not available")


@pytest.mark.slurm
def test_slurm_refuses_a_partition_that_does_not_exist_and_takes_one_that_fits(
    tmp_path: Path, chainrun: CLI
) -> None:
    """A queue Slurm does not have is refused at check; the same job file on its real
    partition passes (the question queues nothing: no job is left behind)."""
    with holding_scheduler("slurm"):
        need("a running Slurm", slurm_answers(), "sudo scripts/start-slurm")
        path = job_file(tmp_path, "slurm", 'queue = "no-such-partition"\n')
        refused(chainrun, path, "invalid partition specified: no-such-partition")
        # A name no other test's chain has: those beside this one queue jobs.
        path = job_file(tmp_path, "slurm", 'queue = "debug"\noptions = ["--cpus-per-task=1"]\n', name="fits")
        result = chainrun("check", str(path))
        assert result.returncode == 0, result.stderr
        queued = subprocess.run(
            ["squeue", "--me", "--noheader", "--format=%j"], capture_output=True, text=True
        )
        assert "cr.fits" not in queued.stdout


@pytest.mark.slurm
def test_a_sweep_is_asked_about_each_shape_its_chains_have(tmp_path: Path, chainrun: CLI) -> None:
    """A sweep over --nodes asks about each node count its chains use (the placeholders filled
    in): the one-node chains alone pass; a two-node one refuses the whole job file."""
    with holding_scheduler("slurm"):
        need("a running Slurm", slurm_answers(), "sudo scripts/start-slurm")
        path = job_file(tmp_path, "slurm", 'options = ["--nodes={nodes}"]\n[sweep.grid]\nnodes = [1]\n')
        result = chainrun("check", str(path))
        assert result.returncode == 0, result.stderr
        path = job_file(tmp_path, "slurm", 'options = ["--nodes={nodes}"]\n[sweep.grid]\nnodes = [1, 2]\n')
        refused(chainrun, path, "Requested node configuration is not available")


@pytest.mark.slurm
@pytest.mark.takes_down_a_node
def test_a_shape_that_fits_once_a_drained_node_is_back_is_not_refused(tmp_path: Path, chainrun: CLI) -> None:
    """sbatch --test-only weighs only the nodes that can take a job now: with one node of
    partition multi drained (as in maintenance, or for the seconds after slurmctld restarts,
    when every node is "unknown" until its slurmd registers) it answers "Requested node
    configuration is not available" for three nodes of three, as for a shape that never fits.
    Refused on that, a valid job file could not be submitted at all while a node was away (the
    CI run at 9b978b9: both `submit`s of test_tensorboard refused). It is not refused: check
    passes it, and submit stores the chain. With every node up, a shape beyond the partition is
    still refused in Slurm's words."""
    with holding_scheduler("slurm"), holding_scheduler("slurm-nodes", exclusive=True):
        need(
            "the multi-node Slurm (partition multi)",
            answers("scontrol", "show", "partition", "multi"),
            "sudo scripts/start-slurm --nodes 3",
        )
        three = job_file(tmp_path, "slurm", 'queue = "multi"\noptions = ["--nodes=3"]\n')
        assert chainrun("check", str(three)).returncode == 0
        subprocess.run(
            ["scontrol", "update", "nodename=node3", "state=drain", "reason=chainrun shape test"],
            check=True,
            timeout=60,
        )
        try:
            checked = chainrun("check", str(three))
            assert checked.returncode == 0, checked.stderr
            unasked = "slurm could not tell whether it would ever start a segment of this shape"
            assert unasked in checked.stderr and "node3 (drain)" in checked.stderr, checked.stderr
            submitted = chainrun("submit", str(three))
            assert submitted.returncode == 0, submitted.stderr
            assert unasked in submitted.stderr, submitted.stderr
            assert state(chainrun, submitted.stdout.strip()) == "active"
            chainrun("cancel", submitted.stdout.strip(), check=True)
        finally:
            subprocess.run(
                ["scontrol", "update", "nodename=node3", "state=resume"], capture_output=True, timeout=60
            )
            wait_for(lambda: node_usable("node3"), 300, "node3 to be usable again")
        four = job_file(tmp_path, "slurm", 'queue = "multi"\noptions = ["--nodes=4"]\n')
        checked = chainrun("check", str(four))
        assert checked.returncode == 2 and "would never start a segment of this shape" in checked.stderr
        assert "Requested node configuration is not available" in checked.stderr


@pytest.mark.slurm
def test_a_job_pending_for_a_reason_that_will_not_clear_is_shown_as_a_problem(
    tmp_path: Path,
    home: Path,
    chainrun: CLI,
    service: Service,
    ui: Callable[..., str],
    server: Server,
) -> None:
    """Issue 36 item 11: a segment's job that Slurm keeps pending with PartitionNodeLimit (its
    request changed after submission: here by scontrol, as an admin's new limit would) was
    shown once as "queued (PartitionNodeLimit)" and nothing more; now status, its JSON, run's
    line, the web page and the webhook say it will not start by itself, and what to change."""
    with holding_scheduler("slurm"):
        need("a running Slurm", slurm_answers(), "sudo scripts/start-slurm")
        # --begin keeps the job pending until the test has changed it.
        hook = f'webhook = "{url(server)}"\n'
        path = job_file(tmp_path, "slurm", 'options = ["--begin=now+600"]\n', top=hook)
        chain_id = chainrun("submit", str(path), check=True).stdout.strip()
        service(interval=0.5)
        try:

            def first_job() -> Any:
                segs = json.loads(chainrun("status", chain_id, "--json", check=True).stdout)[0]["segments"]
                return segs[0]["job_id"] if segs else None

            wait_for(lambda: first_job() is not None, 120, "segment 1 to be queued")
            job_id = first_job()
            subprocess.run(["scontrol", "update", f"jobid={job_id}", "NumNodes=2"], check=True)
            subprocess.run(["scontrol", "update", f"jobid={job_id}", "StartTime=now"], check=True)
            problem = "(PartitionNodeLimit), will not start by itself: it asks for more nodes than its partition allows"

            def attention() -> str:
                return str(json.loads(chainrun("status", "--json", check=True).stdout)[0]["attention"])

            wait_for(lambda: problem in attention(), 120, "status to show the PartitionNodeLimit problem")
            assert "change --nodes, or queue" in attention()
            table = " ".join(chainrun("status").stdout.split())  # below the table, wrapped
            assert problem in table and "change --nodes, or queue" in table, table
            watched = " ".join(chainrun("status", chain_id, "-v", check=True).stdout.split())
            assert problem in watched and "change --nodes, or queue" in watched, watched
            # `run` of the same job file follows the chain the service drives: its line says it.
            follow = subprocess.Popen(
                [sys.executable, "-m", "chainrun", "run", str(path)],
                env=cli_env(home),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            seen: list[str] = []
            assert follow.stdout is not None

            def read() -> None:
                for line in follow.stdout or ():
                    seen.append(line)

            threading.Thread(target=read, daemon=True).start()
            try:
                wait_for(lambda: problem in "".join(seen), 60, "run's line to show the problem")
            finally:
                follow.kill()
                follow.wait()
            page_url = ui()
            base, token = page_url.split("/?token=")
            code, page = _get(f"{base}/chain/{chain_id}?token={token}")
            assert code == 200 and 'class="problem"' in page and "PartitionNodeLimit" in page, page[-2000:]

            def told() -> list[dict[str, Any]]:
                return [
                    r["body"] for r in server.received if r["body"].get("event") == "segment_will_not_start"
                ]

            wait_for(lambda: bool(told()), 60, "the webhook to be told")
            (body,) = told()
            assert (body["chain"], body["segment"], body["job"]) == (chain_id, 1, job_id), body
            assert body["reason"] == "PartitionNodeLimit" and "change --nodes, or queue" in body["change"]
        finally:
            chainrun("cancel", chain_id)
            wait_for(lambda: state(chainrun, chain_id) == "cancelled", 120, "the service to cancel the chain")


@pytest.mark.sge
def test_sge_refuses_a_queue_that_does_not_exist(tmp_path: Path, chainrun: CLI) -> None:
    """qsub -w v: SGE's own reason for a queue it does not have, at check and at submit."""
    with holding_scheduler("sge"):
        need("a running SGE", have("qsub") and answers("qstat"), "sudo scripts/start-sge")
        path = job_file(tmp_path, "sge", 'queue = "no-such.q"\n')
        refused(chainrun, path, 'job requests unknown queue "no-such.q"')


@pytest.mark.sge
def test_sge_refuses_a_parallel_environment_beyond_what_it_has(tmp_path: Path, chainrun: CLI) -> None:
    """A slot count through a parallel environment SGE does not offer is refused in its words."""
    with holding_scheduler("sge"):
        need("a running SGE", have("qsub") and answers("qstat"), "sudo scripts/start-sge")
        path = job_file(tmp_path, "sge", 'options = ["-pe smp 64"]\n')
        refused(chainrun, path, 'the requested parallel environment "smp" does not exist')


@pytest.mark.slurm
def test_check_says_when_the_scheduler_could_not_be_asked_about_the_shape(
    tmp_path: Path, chainrun: CLI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sbatch cannot reach slurmctld: the job file passes (a controller away is no reason to
    refuse it), and check says in one line that the shape went unasked, why, and what
    happens to a segment Slurm cannot start. It said nothing, as if the shape had been asked."""
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "sbatch").write_text(
        "#!/bin/sh\necho 'sbatch: error: Batch job submission failed: Unable to contact slurm controller "
        "(connect failure)' >&2\nexit 1\n"
    )
    (shim / "sbatch").chmod(0o755)
    path = job_file(tmp_path, "slurm")
    monkeypatch.setenv("PATH", f"{shim}:{cli_env(tmp_path)['PATH']}")
    with holding_scheduler("slurm"):  # check asks the real Slurm's other tools (its partitions)
        checked = chainrun("check", str(path))
    assert checked.returncode == 0, checked.stderr
    told = [line for line in checked.stderr.splitlines() if "could not tell" in line]
    assert len(told) == 1, checked.stderr
    assert "Unable to contact slurm controller" in told[0] and "`chainrun status` shows why" in told[0]
    assert f"{path}: slurm could not tell whether it would ever start a segment of this shape" in told[0]


@pytest.mark.slurm
def test_a_refusal_for_want_of_nodes_asked_before_a_node_registered_is_asked_again(
    tmp_path: Path, chainrun: CLI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race the load run showed (ed2c2c9): --test-only refused "no node fits" while a node
    had not yet registered after slurmctld restarted; by the time sinfo was asked every node
    was back, so the refusal stood, and a valid job file was refused as one that would never
    start. A stand-in sbatch refuses the first question so (as slurmctld does then) and passes
    the rest to the real one: the question is asked again after sinfo, and its answer stands."""
    need("a running Slurm", slurm_answers(), "sudo scripts/start-slurm")
    real = shutil.which("sbatch")
    assert real is not None
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "sbatch").write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = --test-only ] && mkdir {shlex.quote(str(tmp_path / "refused"))} 2>/dev/null; then\n'
        f"  printf %s {shlex.quote(NO_NODE_FITS)} >&2; exit 1\n"
        "fi\n"
        f'exec {shlex.quote(real)} "$@"\n'
    )
    (shim / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim}:{cli_env(tmp_path)['PATH']}")
    with holding_scheduler("slurm"):
        checked = chainrun("check", str(job_file(tmp_path, "slurm")))
        assert (tmp_path / "refused").is_dir()  # the first question was refused
        assert checked.returncode == 0 and "would never start" not in checked.stderr, checked.stderr
        assert "could not tell" not in checked.stderr, checked.stderr


def test_a_refusal_for_want_of_nodes_is_the_second_questions_once_every_node_is_back() -> None:
    """With every node of the partition back in sinfo, the question asked again after it
    answers: a start (a node registered in between) refuses nothing; a controller gone away
    since tells nothing now."""
    slurm, a_job = SlurmScheduler(), job("slurm", "multi")
    refused = CommandResult(["x"], 1, "", NO_NODE_FITS)
    listing = CommandResult(["sinfo"], 0, NODES.format(state="idle"), "")
    starts = CommandResult(
        ["x"],
        0,
        "",
        "sbatch: Job 7 to start at 1795946616 using 1 processors on nodes node1 in partition multi\n",
    )
    assert slurm.parse_shape(a_job, [refused, listing, starts]) == ""
    gone = CommandResult(
        ["x"], 1, "", "sbatch: error: Unable to contact slurm controller (connect failure)\n"
    )
    with pytest.raises(SchedulerError) as caught:
        slurm.parse_shape(a_job, [refused, listing, gone])
    assert caught.value.transient


@pytest.mark.parametrize(
    ("scheduler", "away"),
    [
        (SlurmScheduler(), "sbatch: error: Unable to contact slurm controller (connect failure)\n"),
        (SgeScheduler(), "error: commlib error: got read error\nUnable to run job: got send error\n"),
    ],
)
def test_a_scheduler_that_does_not_answer_refuses_nothing(scheduler: object, away: str) -> None:
    """A controller away (or the tool missing) is no reason to refuse a job file: the
    question raises a transient error, which check and submit pass over."""
    assert isinstance(scheduler, (SlurmScheduler, SgeScheduler))
    a_job = job(scheduler.kind)
    for result in (CommandResult(["x"], 1, "", away), CommandResult(["x"], 127, "", "x: not found\n")):
        with pytest.raises(SchedulerError) as caught:
            scheduler.parse_shape(a_job, [result])
        assert caught.value.transient
    assert (
        scheduler.parse_shape(a_job, [CommandResult(["x"], 0, "", "verification: found suitable queue(s)\n")])
        == ""
    )


NO_NODE_FITS = "allocation failure: Requested node configuration is not available\n"
NODES = "debug*|idle|vm\nmulti|idle|node[1-2]\nmulti|{state}|node3\ngpu|down*|g1\n"


@pytest.mark.parametrize(
    ("queue", "options", "state", "away"),
    [
        ("multi", (), "drain", "node3 (drain)"),
        ("multi", (), "unk*", "node3 (unk*)"),  # slurmctld restarted, slurmd not yet registered
        ("multi", (), "down", "node3 (down)"),
        ("multi", (), "idle*", "node3 (idle*)"),  # not responding
        ("multi", (), "resv", "node3 (resv)"),  # a maintenance reservation
        (
            "debug",
            ("--partition=gpu,multi",),
            "drng",
            "node3 (drng), g1 (down*)",
        ),  # the options' partitions win
        ("debug", ("-p", "multi"), "maint", "node3 (maint)"),
        (None, ("-pmulti",), "fail", "node3 (fail)"),
        ("multi", (), "idle", ""),
        ("multi", (), "mix", ""),
        ("multi", (), "alloc", ""),
        ("multi", (), "idle~", ""),  # powered down to save power: booted for a job
        (None, (), "drain", ""),  # the default partition (debug) has none away
        ("debug", (), "down", ""),  # another partition's node
    ],
)
def test_a_refusal_for_want_of_nodes_tells_nothing_while_a_node_of_the_partition_is_away(
    queue: str, options: tuple[str, ...], state: str, away: str
) -> None:
    """--test-only weighs only the nodes that can take a job now: its "Requested node
    configuration is not available" is a refusal only when every node of the job's partitions
    can; while one is away it tells nothing now (transient), naming the node. Other refusals
    need no sinfo (and are not asked again)."""
    slurm, a_job = SlurmScheduler(), job("slurm", queue, options)
    refused = CommandResult(["x"], 1, "", NO_NODE_FITS)
    listing = CommandResult(["sinfo"], 0, NODES.format(state=state), "")
    sinfo = ["sinfo", "--noheader", "--format=%P|%t|%N"]
    assert slurm.shape_explain_argvs(a_job, refused) == [sinfo, slurm.shape_argv(a_job)]
    if away:
        with pytest.raises(SchedulerError) as caught:
            slurm.parse_shape(a_job, [refused, listing, refused])
        assert caught.value.transient and f"and {away} cannot" in str(caught.value), caught.value
    else:  # asked again after a listing with every node back, its refusal stands
        assert (
            slurm.parse_shape(a_job, [refused, listing, refused])
            == "Requested node configuration is not available"
        )
    with pytest.raises(SchedulerError) as caught:  # sinfo did not answer: nothing can be told
        slurm.parse_shape(a_job, [refused, CommandResult(["sinfo"], 1, "", "sinfo: error: ...\n"), refused])
    assert caught.value.transient
    other = CommandResult(["x"], 1, "", "sbatch: error: invalid partition specified: nosuch\n")
    assert slurm.parse_shape(a_job, [other]) == "invalid partition specified: nosuch"
    away = CommandResult(
        ["x"], 1, "", "allocation failure: Unable to contact slurm controller (connect failure)\n"
    )
    assert slurm.shape_explain_argvs(a_job, other) == slurm.shape_explain_argvs(a_job, away) == []


@pytest.mark.parametrize(
    ("reason", "advice"),
    [
        ("PartitionNodeLimit", "change --nodes, or queue"),
        ("PartitionTimeLimit", "shorten walltime, or change queue"),
        ("QOSMaxWallDurationPerJobLimit", "shorten walltime, or change --qos"),
        ("Priority", ""),
        ("Resources", ""),
        ("Dependency", ""),
        ("BeginTime", ""),
        ("ReqNodeNotAvail, UnavailableNodes:node1", ""),  # a node down may come back
    ],
)
def test_only_pending_reasons_that_never_clear_are_problems(reason: str, advice: str) -> None:
    """A job waiting its turn is no problem; one waiting for a change to its own request is,
    with what to change."""
    from chainrun.schedulers.pending import will_not_start

    found = will_not_start(reason)
    assert (advice in found) if advice else found == "", found
