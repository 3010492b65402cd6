"""A sweep's first segments as one job array: the engine on the scripted cluster of
chainrun.testing (batching, the crash between journal and submission, mixed chains,
max_concurrent), the Slurm backend's array commands and its parsing of real ``squeue
--array`` output, and the whole thing on the real Slurm."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import cli_env, wait_for
from test_decide import NOW
from test_decide import SPEC as DECIDE_SPEC
from test_decide import chain as bare_chain
from test_engine import World as EngineWorld

from chainrun import jobfile, sweep
from chainrun.decide import Facts, backoff, decide
from chainrun.engine import Engine
from chainrun.errors import JobFileError
from chainrun.model import (
    NO_PROGRESS,
    ChainState,
    CommandResult,
    JobSpec,
    Outcome,
    Phase,
    SchedulerSpec,
    Submit,
)
from chainrun.schedulers.script import render_array_script
from chainrun.schedulers.segment import SegmentJob, array_tag
from chainrun.schedulers.slurm import SlurmScheduler
from chainrun.status import state_cell
from chainrun.store import Store
from chainrun.transport import LocalTransport

DATA = Path(__file__).parent / "data"
TRAINER = DATA / "trainer.py"
CLI = Callable[..., "subprocess.CompletedProcess[str]"]
SPEC = replace(DECIDE_SPEC, scheduler=SchedulerSpec(kind="fake"))


def sweep_spec(lr: float, rep: int, **changes: object) -> JobSpec:
    """One chain of a sweep "t" as sweep.expand makes it."""
    name = f"t-{str(lr).replace('.', '')}-r{rep}"
    return replace(
        SPEC,
        name=name,
        sweep_name="t",
        params=(("lr", str(lr)),),
        rep=rep,
        checkpoint_dir=f"/w/ckpt/{name}",
        **changes,  # type: ignore[arg-type]
    )


class World(EngineWorld):
    """test_engine's world, its fake cluster with job arrays; chains added as a sweep's."""

    def __init__(self, home: Path) -> None:
        super().__init__(home, arrays=True)

    def add(self, *specs: JobSpec) -> list[str]:  # type: ignore[override]
        return self.store.add_chains([(s, NO_PROGRESS) for s in specs], self.clock())

    def sweep(self, count: int = 6, **changes: object) -> list[str]:
        return sorted(self.add(*[sweep_spec(0.1 * (i // 2 + 1), i % 2, **changes) for i in range(count)]))

    def verbs(self) -> list[str]:
        return [c[0] for c in self.cluster.commands]

    def job(self, chain_id: str, n: int = 1) -> str:
        job_id = self.store.chain(chain_id).segments[n - 1].job_id
        assert job_id is not None
        return job_id


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path / "home")
    yield w
    w.store.close()


def test_a_sweeps_first_segments_go_out_as_one_array_and_successors_per_chain(world: World) -> None:
    """Six chains: one array submission, each chain recorded as its own task; the next tick
    queues each chain's successor on its own, after that chain's task."""
    chains = world.sweep(4)
    world.tick()
    assert world.verbs().count("fake-array") == 1 and "fake-submit" not in world.verbs()
    assert [world.job(c) for c in chains] == ["1_0", "1_1", "1_2", "1_3"]
    script = world.cluster.files[f"/w/.chainrun/array-{chains[0]}.sh"].decode()
    assert f"# fake array {array_tag(chains[0])} walltime 100" in script
    assert (
        f"2) script=/w/.chainrun/{chains[2]}/seg-0001.sh log=/w/.chainrun/{chains[2]}/seg-0001.log" in script
    )
    assert "submitted as task 2 of array 1" in world.history(chains[2])
    world.tick()
    assert world.verbs().count("fake-submit") == 4
    for c in chains:
        successor = world.job(c, 2)
        assert world.cluster.jobs[successor].after == world.job(c)


def test_array_tasks_are_tracked_and_ended_like_any_job(world: World) -> None:
    """A task's markers (written by its chain's own wrapper) end its segment: one poll a tick."""
    chains = world.sweep(2)
    world.tick()
    world.tick()
    world.cluster.start("1_0", epoch=0)
    world.cluster.end("1_0", "timeout", epoch=4, saved=world.clock())
    world.tick()
    first = world.store.chain(chains[0]).segments[0]
    assert (first.phase, first.outcome, first.charged) == (Phase.ENDED, Outcome.TIMEOUT, False)
    assert world.store.chain(chains[0]).progress.epoch == 4
    assert world.store.chain(chains[1]).segments[0].phase is Phase.PENDING
    assert world.verbs().count("fake-poll") == 3


def test_a_big_sweep_is_split_over_arrays_of_the_backends_size(world: World) -> None:
    """The fake backend holds at most 4 tasks an array: ten chains are three arrays."""
    chains = world.sweep(10)
    world.tick()
    assert world.verbs().count("fake-array") == 3
    assert [world.job(c) for c in chains] == [
        *(f"1_{i}" for i in range(4)),
        *(f"2_{i}" for i in range(4)),
        *(f"3_{i}" for i in range(2)),
    ]


def test_only_chains_with_the_same_directives_share_an_array(world: World) -> None:
    """A different walltime is a different header; a chain that is no sweep's goes out on its own."""
    short = world.add(sweep_spec(0.5, 0, walltime=50), sweep_spec(0.5, 1, walltime=50))
    long = world.sweep(2)
    (alone,) = world.add(replace(SPEC, name="single"))
    world.tick()
    assert world.verbs().count("fake-array") == 2 and world.verbs().count("fake-submit") == 1
    assert {world.job(c).split("_")[0] for c in short} != {world.job(c).split("_")[0] for c in long}
    assert "_" not in world.job(alone)


def test_a_crash_after_the_array_was_submitted_adopts_each_task(world: World) -> None:
    """Journaled as tasks, submitted, then the service died before recording: the restarted
    service finds each chain's task under the array's name and adopts it; nothing is resubmitted."""
    chains = world.sweep(3)
    name = array_tag(chains[0])
    for i, c in enumerate(chains):
        world.store.journal_submit(c, Submit(1, 100), world.clock(), task=(name, i))
    stems = [f"/w/.chainrun/{c}/seg-0001" for c in chains]
    base = world.cluster.add_job(name, stems[0], task=0).split("_")[0]
    for i, stem in enumerate(stems[1:], 1):
        world.cluster.add_task(base, i, name, stem)
    world.engine = world.new_engine()
    world.tick()
    assert [world.job(c) for c in chains] == [f"{base}_{i}" for i in range(3)]
    assert "fake-array" not in world.verbs()
    assert f"segment 1 adopted after a restart as job {base}_1" in world.history(chains[1])


def test_a_crash_before_the_array_was_submitted_submits_the_same_tasks_once(world: World) -> None:
    """Journaled as tasks, then the service died before sbatch: the restarted service sends the
    same tasks under the same name, once; a late copy of the first array is then a second job
    of each segment, and is removed."""
    chains = world.sweep(3)
    name = array_tag(chains[0])
    for i, c in enumerate(chains):
        world.store.journal_submit(c, Submit(1, 100), world.clock(), task=(name, i))
    world.engine = world.new_engine()
    world.tick()
    assert world.verbs().count("fake-array") == 1
    assert [world.job(c) for c in chains] == ["1_0", "1_1", "1_2"]
    assert world.cluster.jobs["1_0"].name == name
    late = world.cluster.add_job(name, f"/w/.chainrun/{chains[0]}/seg-0001", task=0)
    world.tick()
    assert world.cluster.jobs[late].live.outcome is Outcome.CANCELLED
    assert world.cluster.jobs["1_0"].live.phase is Phase.PENDING


def test_a_failed_array_submission_retries_each_chain_as_the_same_task(world: World) -> None:
    """RetryLater for every chain of the array; the retry sends the same indices again, under
    the same name; a chain whose script could not be written fails alone."""
    chains = world.sweep(3)
    world.cluster.fail_next_submit()
    world.tick()
    segs = [world.store.chain(c).segments[0] for c in chains]
    assert [(s.phase, s.retry_at, s.task) for s in segs] == [
        (Phase.SUBMITTING, world.clock() + backoff(1), i) for i in range(3)
    ]
    world.tick(backoff(1))
    assert [world.job(c) for c in chains] == ["1_0", "1_1", "1_2"]
    assert world.store.chain(chains[0]).failures == 0


def test_a_refused_array_is_sent_again_as_single_jobs_each_with_its_own_verdict(world: World) -> None:
    """An array refused for good (MaxArraySize, say) does not end the chains: each is submitted
    on its own in the same tick, and keeps its journaled task for a crash."""
    chains = world.sweep(2)
    world.cluster.fail_next_submit("Invalid job array specification", transient=False)
    world.tick()
    assert world.verbs().count("fake-array") == 1 and world.verbs().count("fake-submit") == 2
    assert [world.job(c) for c in chains] == ["1", "2"]
    assert [world.store.chain(c).segments[0].task for c in chains] == [0, 1]
    assert all(world.store.chain(c).state is ChainState.ACTIVE for c in chains)


def test_a_rejected_array_ends_each_chain_in_the_schedulers_words(world: World) -> None:
    """A permanent refusal (an unknown partition), of the array and then of each chain's own
    job, is every chain's Reject, then failed."""
    chains = world.sweep(2)
    for _ in range(3):
        world.cluster.fail_next_submit("invalid partition specified: nosuch", transient=False)
    world.tick()
    world.tick()
    for c in chains:
        chain = world.store.chain(c)
        assert chain.state is ChainState.FAILED and "invalid partition" in chain.reason


def test_max_concurrent_holds_back_the_chains_past_it_until_one_ends(world: World) -> None:
    """max_concurrent = 2 of four chains: two start (one array, with the limit); the others
    wait, through their successors, until a chain of the sweep ends; then the next one starts."""
    chains = world.sweep(4, max_concurrent=2)
    world.tick()
    assert [len(world.store.chain(c).segments) for c in chains] == [1, 1, 0, 0]
    assert ["fake-array", "0,1", "2", f"/w/.chainrun/array-{chains[0]}.sh"] in world.cluster.commands
    world.tick()  # successors queue ahead; still two chains under way
    assert [len(world.store.chain(c).segments) for c in chains] == [2, 2, 0, 0]
    world.cluster.end("1_0", "completed", epoch=10, saved=world.clock())
    world.tick()
    assert world.store.chain(chains[0]).state is ChainState.COMPLETED
    world.tick()
    assert [len(world.store.chain(c).segments) for c in chains][2:] == [1, 0]


def test_the_array_script_runs_each_tasks_own_segment_script_with_its_id(tmp_path: Path) -> None:
    """Rendered for Slurm: the header of the chains' directives under the array's name, a case
    on the task index to the chain's script and log, and the task's id exported for the wrapper."""
    slurm = SlurmScheduler()
    spec = replace(DECIDE_SPEC, scheduler=SchedulerSpec(kind="slurm", queue="gpu"), workdir="/w w")
    jobs = [(i, SegmentJob(f"c{i}", 1, spec, 100)) for i in range(2)]
    text = render_array_script(slurm, "cr@c0", jobs)
    assert text.splitlines()[:3] == ["#!/bin/bash", "#SBATCH --job-name=cr@c0", "#SBATCH --comment=cr@c0"]
    assert "1) script='/w w/.chainrun/c1/seg-0001.sh' log='/w w/.chainrun/c1/seg-0001.log' ;;" in text
    assert 'export CHAINRUN_JOB_ID="${SLURM_ARRAY_JOB_ID:-}_${SLURM_ARRAY_TASK_ID:-}"' in text
    assert text.endswith('exec >>"$log" 2>&1\nexec "$script"\n')
    # Run as task 1 of array 14 would be: it runs chain c1's own script, logging to its log.
    jobs = [(i, replace(job, spec=replace(spec, workdir=str(tmp_path / "w w")))) for i, job in jobs]
    for _, job in jobs:
        os.makedirs(job.run_dir)
        Path(job.script_path).write_text(f'#!/bin/bash\necho "{job.chain_id} ran as $CHAINRUN_JOB_ID"\n')
        os.chmod(job.script_path, 0o700)
    array = tmp_path / "array.sh"
    array.write_text(render_array_script(slurm, "cr@c0", jobs))
    env = {**os.environ, "SLURM_ARRAY_JOB_ID": "14", "SLURM_ARRAY_TASK_ID": "1"}
    assert subprocess.run(["bash", str(array)], env=env, timeout=60).returncode == 0
    assert Path(jobs[1][1].log_path).read_text() == "c1 ran as 14_1\n"
    assert not Path(jobs[0][1].log_path).exists()
    # A sweep of one configuration is an array of one task.
    assert render_array_script(slurm, "cr@c0", jobs[:1]).count("script=") == 1


def test_slurm_array_submission_and_task_ids() -> None:
    """--array as a range when the indices run on, else a list; the % limit; BASE_INDEX ids."""
    slurm = SlurmScheduler()
    argv = slurm.array_submit_argv("/w/a.sh", "/w/a.log", "/w", [0, 1, 2], 2)
    assert argv == ["sbatch", "--parsable", "--array=0-2%2", "--output=/w/a.log", "--chdir=/w", "/w/a.sh"]
    assert slurm.array_submit_argv("/w/a.sh", "/w/a.log", "/w", [1, 3], None)[2] == "--array=1,3"
    assert slurm.array_submit_argv("/w/a.sh", "/w/a.log", "/w", [4], None)[2] == "--array=4"
    assert slurm.task_id("14", 3) == "14_3"
    assert [slurm.task_index(j) for j in ("14_3", "14", "14_[2-3%2]")] == [3, None, None]


def test_slurm_parses_array_tasks_from_real_squeue_output() -> None:
    """squeue --array as the real daemon printed it (tests/data/squeue-array.txt): each task,
    pending (held by the % limit) or running, under its own BASE_INDEX id."""
    text = (DATA / "squeue-array.txt").read_text()
    live = SlurmScheduler().parse_poll(CommandResult(("squeue",), 0, text, ""))
    assert live["14_2"].phase is Phase.PENDING and live["14_2"].reason == "JobArrayTaskLimit"
    assert live["14_0"].phase is Phase.RUNNING and live["14_0"].name == "cr@exp"
    assert live["17"].reason == "Dependency"


@pytest.mark.slow
@pytest.mark.slurm
def test_a_sweep_on_the_real_slurm_goes_out_as_one_array_and_completes(
    tmp_path: Path,
    home: Path,
    chainrun: CLI,
    service: Callable[..., object],
    shared_slurm: None,
) -> None:
    """Two rates x two repetitions on the real Slurm: the first wave is one sbatch (counted
    by a shim in front of the real one on the service's PATH), each chain's first segment a
    task of that array; each chain resumes over two segments or more after its task, sees its
    own values, and completes."""
    real = shutil.which("sbatch")
    assert real is not None
    shims, calls = tmp_path / "shims", tmp_path / "sbatch-calls.txt"
    shims.mkdir()
    (shims / "sbatch").write_text(f'#!/bin/bash\nprintf "%s\\n" "$*" >> {calls}\nexec {real} "$@"\n')
    (shims / "sbatch").chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(TRAINER, work / "trainer.py")
    record = 'echo "{lr} $CHAINRUN_PARAM_LR $CHAINRUN_REP" >> "$CHAINRUN_CHECKPOINT_DIR/seen.txt"'
    # Slurm's limits are whole minutes: the runner's own timer signals 40 s (walltime - the
    # job file's grace, which is kept) after Slurm started the job, so 48 s of training takes
    # two segments; four one-CPU chains fit the node at once.
    (work / "sweep.toml").write_text(
        'name = "arrs"\n'
        f"command = {json.dumps(record + '; exec python3 trainer.py --epochs 12 --epoch-time 4')}\n"
        'total_time = "30m"\nwalltime = "60s"\ngrace = "20s"\ntarget_epoch = 12\n'
        '[scheduler]\nkind = "slurm"\n'
        "[sweep]\nreps = 2\n[sweep.grid]\nlr = [0.1, 0.01]\n"
    )
    ids = chainrun("submit", str(work / "sweep.toml"), check=True).stdout.split()
    assert len(ids) == 4
    service(interval=1, PATH=f"{shims}{os.pathsep}{cli_env(home)['PATH']}")

    def done() -> bool:
        out = json.loads(chainrun("status", "arrs", "--json", check=True).stdout)
        return all(c["state"] in ("completed", "failed", "exhausted") for c in out)

    wait_for(done, 900, "the sweep's four chains on Slurm to end")
    submitted = calls.read_text().splitlines()
    assert "--array=0-3" in submitted[0], submitted[0]
    assert sum("--array" in line for line in submitted) == 1, submitted
    store = Store(home, readonly=True)
    chains = [store.chain(i) for i in ids]
    store.close()
    bases = set()
    for chain in chains:
        assert chain.state is ChainState.COMPLETED, chain.reason
        first, second = chain.segments[0], chain.segments[1]
        assert first.job_id is not None and first.array is not None and first.task is not None
        base, _, index = first.job_id.partition("_")
        bases.add(base)
        assert index == str(first.task)
        assert second.after == first.job_id  # the successor waited on the task itself
        lr, rep = json.loads(dict(chain.spec.params)["lr"]), chain.spec.rep
        lines = (Path(chain.spec.checkpoint_dir) / "seen.txt").read_text().splitlines()
        assert len(lines) >= 2, f"{chain.spec.name} ran {len(lines)} segment(s)"
        assert set(lines) == {f"{lr} {lr} {rep}"}
        log = (work / ".chainrun" / chain.id / "seg-0001.log").read_text()
        assert f"as job {first.job_id}" in log  # the wrapper knows its task's id
    assert len(bases) == 1


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("0", "sweep.max_concurrent = 0: must be at least 1"),
        ('"4"', "max_concurrent = '4': expected a whole"),
    ],
)
def test_a_bad_max_concurrent_is_one_line_naming_it(tmp_path: Path, value: str, needle: str) -> None:
    path = tmp_path / "s.toml"
    path.write_text(
        'name = "s"\ncommand = "echo {x}"\ntotal_time = "1h"\nwalltime = "10m"\n'
        f"[sweep]\nmax_concurrent = {value}\n[sweep.grid]\nx = [1, 2]\n"
    )
    with pytest.raises(JobFileError) as err:
        jobfile.load(path)
    assert needle in str(err.value) and "\n" not in str(err.value)
    path.write_text(path.read_text().replace(f"max_concurrent = {value}", "max_concurrent = 3"))
    assert jobfile.load(path).max_concurrent == 3


def test_decide_holds_a_sweeps_chain_that_may_not_start_yet() -> None:
    """A chain with no segment waits while its sweep's max_concurrent chains are under way."""
    fresh = bare_chain()
    assert decide(fresh, Facts(may_start=False), NOW) == []
    assert decide(fresh, Facts(), NOW) == [Submit(n=1, walltime=DECIDE_SPEC.walltime)]


class Died(BaseException):
    """The service dying at a chosen moment: nothing in it catches that."""


@pytest.mark.slurm
def test_crashes_around_the_array_sbatch_on_the_real_slurm_neither_lose_nor_duplicate_tasks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared_slurm: None
) -> None:
    """The service dies right before its sbatch runs, then (restarted) right after it ran but
    before recording: the third service finds each chain's task in the real squeue under the
    array's name and index and adopts it. One array reached Slurm, one task per chain."""
    work = tmp_path / "work"
    work.mkdir()
    spec = replace(
        DECIDE_SPEC,
        name="crash",
        command="sleep 300",
        workdir=str(work),
        checkpoint_dir=str(work / "ckpt"),
        walltime=600,
        total_time=3600,
        scheduler=SchedulerSpec(kind="slurm"),
        sweep=((("lr", "1"),), (("lr", "2"),), (("lr", "3"),)),
    )
    store = Store(tmp_path / "home")
    ids = sorted(store.add_chains([(s, NO_PROGRESS) for s in sweep.expand(spec)], time.time()))
    sbatch: list[list[str]] = []
    die_before_sbatch = [True]

    class Transport(LocalTransport):
        def run(self, argv: Sequence[str], **kw: Any) -> CommandResult:
            if argv[0] == "sbatch":
                if die_before_sbatch.pop() if die_before_sbatch else False:
                    raise Died("before sbatch")
                sbatch.append(list(argv))
            return super().run(argv, **kw)

    def engine() -> Engine:
        return Engine(store, transports=lambda host: Transport())

    with pytest.raises(Died):
        engine().tick()  # died before its sbatch: the chains are journaled as tasks 0-2
    assert sbatch == [] and [store.chain(c).segments[0].task for c in ids] == [0, 1, 2]
    record = Store.record

    def dying(self: Store, *args: Any, **kw: Any) -> None:
        raise Died("after sbatch")

    monkeypatch.setattr(Store, "record", dying)
    try:
        with pytest.raises(Died):
            engine().tick()  # sends the same tasks, then dies before recording the ids
        assert len(sbatch) == 1 and "--array=0-2" in sbatch[0]
        monkeypatch.setattr(Store, "record", record)
        engine().tick()
        jobs = [store.chain(c).segments[0].job_id for c in ids]
        assert len(sbatch) == 1, sbatch
        base = (jobs[0] or "").split("_")[0]
        assert jobs == [f"{base}_{i}" for i in range(3)]
        assert f"segment 1 adopted after a restart as job {base}_0" in [
            e.message for e in store.events(ids[0])
        ]
        live = SlurmScheduler().parse_poll(LocalTransport().run(SlurmScheduler().poll_argv()))
        assert sorted(j for j, job in live.items() if job.name == array_tag(ids[0])) == [
            f"{base}_{i}" for i in range(3)
        ]
    finally:
        store.close()
        subprocess.run(["scancel", f"--name={array_tag(ids[0])}"], check=False, timeout=60)


def test_status_says_a_chain_waits_for_its_sweeps_max_concurrent() -> None:
    """A sweep's chain not started yet reads "waiting (max_concurrent N)", not "active"."""
    held = bare_chain(spec=sweep_spec(0.1, 0, max_concurrent=2))
    assert state_cell(held, NOW) == "waiting (max_concurrent 2)"
    assert state_cell(bare_chain(), NOW) == "active"
