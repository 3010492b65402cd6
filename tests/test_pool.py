"""A pool of machines without a scheduler (issue 14, item 4): ``hosts = [...]`` with ``slots``.

The job file's fields; ``place`` (which host a new segment goes to); the engine on two
scripted hosts (placement, waiting for a slot, an unreachable host, one poll per host);
and whole chains on two real sshds on loopback, each with a state directory of its own,
where python3 cannot import chainrun: the runner is copied there, and no host ever runs
two segments at once.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Callable

import pytest

try:
    import tomllib
except ImportError:  # Python before 3.11
    import tomli as tomllib  # type: ignore[no-redef]
from conftest import wait_for
from private_sshd import PrivateSSHD
from test_decide import SPEC as DECIDE_SPEC
from test_snapshot import make_repo
from test_store import SPEC as STORE_SPEC
from test_store import old_database

from chainrun.cluster import Cluster
from chainrun.decide import place
from chainrun.engine import Engine
from chainrun.errors import JobFileError
from chainrun.jobfile import parse
from chainrun.localrunner import machine_dir
from chainrun.model import NO_PROGRESS, Chain, ChainState, JobSpec, Outcome, Phase, SchedulerSpec
from chainrun.run import Follower
from chainrun.schedulers.local import LocalScheduler, runner_path
from chainrun.schedulers.segment import CODE_NAMES, SegmentJob
from chainrun.schedulers.ship import LOCAL_RUNNER
from chainrun.snapshot import capture
from chainrun.status import state_cell
from chainrun.store import Store
from chainrun.testing import FakeClock, FakeCluster
from chainrun.transport import LocalTransport

TRAINER = Path(__file__).parent / "data" / "trainer.py"
CLI = Callable[..., "subprocess.CompletedProcess[str]"]

# -- the job file ---------------------------------------------------------------------------

BASE = 'name = "p"\ncommand = "true"\nworkdir = "/tmp"\ntotal_time = "1h"\nwalltime = "10m"\n'


def read(text: str) -> JobSpec:
    return parse(tomllib.loads(text), "/tmp/job.toml", Path("/tmp"))


def scheduler(text: str) -> SchedulerSpec:
    return read(BASE + "[scheduler]\n" + text).scheduler


def test_a_pool_is_read_with_one_slot_per_host_unless_told() -> None:
    """hosts, slots (1 by default with hosts) and gpus_per_slot; `check` words it."""
    sched = scheduler('hosts = ["hoff", "norman"]\n')
    assert (sched.hosts, sched.slots, sched.gpus_per_slot, sched.host) == (("hoff", "norman"), 1, None, None)
    assert sched.where == "a pool of hoff, norman; 1 run at a time on each"
    sched = scheduler('hosts = ["hoff"]\nslots = 4\ngpus_per_slot = 2\n')
    assert (sched.slots, sched.gpus_per_slot) == (4, 2)
    assert sched.where == "a pool of hoff; 4 runs at a time on each, 2 GPUs per run"
    assert scheduler("slots = 2\n").slots == 2  # this machine, two runs at a time


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('hosts = ["a"]\nhost = "b"\n', "scheduler.hosts = ['a']: give either host"),
        ('kind = "slurm"\nhosts = ["a"]\n', "scheduler.hosts = ['a']: only applies to kind = \"local\""),
        ('kind = "sge"\nslots = 2\n', 'scheduler.slots = 2: only applies to kind = "local"'),
        ("hosts = []\n", "scheduler.hosts = []: give 1 to"),
        ('hosts = ["a", "-oProxyCommand=x"]\n', "'-oProxyCommand=x' is not a host name"),
        ('hosts = ["a", "a"]\n', "names a host twice"),
        ('hosts = "a"\n', "scheduler.hosts = 'a': expected a list of ssh hosts"),
        ("slots = 0\n", "scheduler.slots = 0: must be 1 to"),
        ("gpus_per_slot = 1\n", "scheduler.gpus_per_slot = 1: needs slots"),
    ],
)
def test_a_bad_pool_is_one_line_naming_the_field(text: str, message: str) -> None:
    """Every mistake in the pool's fields is an error that names the field and the value."""
    with pytest.raises(JobFileError) as err:
        scheduler(text)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_pools_workdir_must_be_absolute_as_on_any_remote_host() -> None:
    with pytest.raises(
        JobFileError, match=r"workdir = .w.: with scheduler.host \(or hosts\) set, give an absolute path"
    ):
        read(BASE.replace('"/tmp"', '"w"') + '[scheduler]\nhosts = ["a"]\n')


# -- placement --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("previous", "free", "expected"),
    [
        (None, {"a": 1, "b": 2}, "b"),  # the most free slots
        (None, {"a": 1, "b": 1}, "a"),  # a tie: the first listed
        ("b", {"a": 2, "b": 1}, "b"),  # where it ran before, while that one has a slot
        ("b", {"a": 1, "b": 0}, "a"),  # ... else elsewhere
        ("b", {"a": 1}, "a"),  # b did not answer
        (None, {"a": 0, "b": 0}, None),  # nothing free: wait
        (None, {}, None),  # nobody answered: wait
    ],
)
def test_place_prefers_the_previous_host_then_the_most_free_slots(
    previous: str | None, free: dict[str, int], expected: str | None
) -> None:
    assert place(("a", "b"), previous, free) == expected


# -- the engine, on two scripted hosts ----------------------------------------------------------

POOL = replace(DECIDE_SPEC, scheduler=SchedulerSpec(kind="fake", hosts=("a", "b"), slots=1))


class Pool:
    """A store, two fake hosts on one clock, and an engine over them."""

    def __init__(self, home: Path) -> None:
        self.clock = FakeClock()
        self.hosts = {"a": FakeCluster(self.clock), "b": FakeCluster(self.clock)}
        self.hosts["b"].next_id = 100  # each host numbers its own jobs; kept apart for reading
        self.store = Store(home)
        self.engine = Engine(
            self.store,
            clock=self.clock,
            transports=lambda host: self.hosts[host or ""].transport(host),
            schedulers=lambda kind, host: self.hosts[host or ""].scheduler(kind, host),
        )

    def add(self, spec: JobSpec = POOL) -> str:
        return self.store.add_chain(spec, NO_PROGRESS, self.clock()).id

    def tick(self) -> None:
        self.clock.advance(10)
        self.engine.tick()

    def chain(self, chain_id: str) -> Chain:
        return self.store.chain(chain_id)

    def placed(self, chain_id: str) -> list[tuple[int, str | None, str | None]]:
        return [(s.n, s.host, s.job_id) for s in self.chain(chain_id).segments]

    def polls(self) -> dict[str, int]:
        return {h: sum(c[0] == "fake-poll" for c in cluster.commands) for h, cluster in self.hosts.items()}


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[Pool]:
    p = Pool(tmp_path / "home")
    yield p
    p.store.close()


def test_first_segments_go_to_free_hosts_and_a_chain_waits_for_a_slot_with_a_reason(pool: Pool) -> None:
    """Two hosts of one slot, three chains: one each, the third waits (unsubmitted, uncharged,
    saying why) until a slot frees; successors queue on their chain's host."""
    one, two, three = pool.add(), pool.add(), pool.add()
    pool.tick()
    assert pool.placed(one) == [(1, "a", "1")]
    assert pool.placed(two) == [(1, "b", "100")]
    assert pool.placed(three) == []
    waiting = pool.chain(three)
    assert waiting.reason == "waiting for a free slot on hosts a, b"
    assert state_cell(waiting, pool.clock()) == "waiting for a slot"
    assert (waiting.state, waiting.failures) == (ChainState.ACTIVE, 0)
    assert pool.polls() == {"a": 1, "b": 1}  # one poll per host per tick, for all three chains

    pool.tick()  # successors are queued behind each running chain, on its host
    assert pool.placed(one) == [(1, "a", "1"), (2, "a", "2")]
    assert pool.hosts["a"].jobs["2"].after == "1"
    assert pool.placed(two) == [(1, "b", "100"), (2, "b", "101")]
    assert pool.placed(three) == []  # a queued successor does not free the slot it will take
    assert pool.polls() == {"a": 2, "b": 2}

    pool.hosts["a"].start("1")
    pool.hosts["a"].end("1", "completed", epoch=10, done=True)  # in its end marker: not the others'

    pool.tick()  # chain one completes and its successor is cancelled: a's slot is free
    assert pool.chain(one).state is ChainState.COMPLETED
    pool.tick()
    assert pool.placed(three)[0] == (1, "a", "3")
    assert pool.chain(three).reason == ""
    assert "waiting for a free slot on hosts a, b" in [e.message for e in pool.store.events(three)]


def test_chainrun_run_follows_a_pool_chain_on_the_host_its_segment_was_placed_on(pool: Pool) -> None:
    """Watching began before the chain had a host (its pool's first, a, was busy): the output
    line comes from the segment's log on b, where it was placed, not from a."""
    chain_id = pool.add()
    follower = Follower(pool.store, chain_id, lambda host: pool.hosts[host or ""].transport(host))
    pool.hosts["a"].add_job("someone else's", "/x/job")
    pool.tick()
    assert pool.placed(chain_id) == [(1, "b", "100")]
    log = SegmentJob(chain_id, 1, POOL, 0).log_path
    pool.hosts["b"].files[log] = b"epoch 1 on b\n"
    pool.hosts["b"].start("100")
    pool.tick()
    assert follower.poll()[2] == "epoch 1 on b"


def test_a_chain_goes_back_to_the_host_it_ran_on_when_that_one_is_free(pool: Pool) -> None:
    """Between segments (no successor queued ahead), the next one goes where the last ran."""
    chain_id = pool.add(replace(POOL, max_failures=0))  # at the budget's edge: nothing queued ahead
    pool.hosts["a"].add_job("someone else's", "/x/job")  # a is busy: the first segment goes to b
    pool.tick()
    assert pool.placed(chain_id) == [(1, "b", "100")]
    pool.hosts["a"].end("1", "completed")  # a is free again
    pool.hosts["b"].start("100")
    pool.hosts["b"].checkpoint("/w/ckpt", epoch=3)
    pool.hosts["b"].end("100", "timeout", epoch=3)
    pool.tick()
    pool.tick()
    assert pool.placed(chain_id) == [(1, "b", "100"), (2, "b", "101")]


def test_an_unreachable_host_makes_its_chains_wait_and_new_chains_go_elsewhere(pool: Pool) -> None:
    """A host that cannot be polled: its chain waits uncharged; a new chain goes to the other."""
    first = pool.add()
    pool.tick()
    assert pool.placed(first) == [(1, "a", "1")]
    pool.hosts["a"].down = True
    second = pool.add()
    pool.tick()
    pool.tick()
    assert pool.placed(first) == [(1, "a", "1")]
    assert pool.placed(second)[0][:2] == (1, "b")
    assert pool.chain(first).failures == 0
    third = pool.add()
    pool.tick()
    assert pool.placed(third) == []
    assert pool.chain(third).reason == "waiting for a free slot on hosts b (a not reached)"


@pytest.mark.parametrize("shared", [True, False])
def test_a_host_silent_for_host_timeout_loses_its_segments_at_no_cost(pool: Pool, shared: bool) -> None:
    """Host a stops answering with a chain's segment running and its successor queued: for
    host_timeout nothing happens; then both end as lost, uncharged. With a shared workdir
    (one file system: b sees a's files) the chain resumes on b from the checkpoint; without,
    it waits for a, saying why, and goes on there once a answers again. A job a still runs
    of a segment ended as lost is then cancelled: no segment runs twice."""
    sched = replace(POOL.scheduler, host_timeout=120, workdir_shared=shared)
    chain_id = pool.add(replace(POOL, scheduler=sched))
    if shared:
        pool.hosts["b"].files = pool.hosts["a"].files
    pool.tick()
    pool.tick()
    assert pool.placed(chain_id) == [(1, "a", "1"), (2, "a", "2")]
    pool.hosts["a"].start("1")
    pool.hosts["a"].checkpoint(POOL.checkpoint_dir, epoch=2)
    pool.tick()
    pool.hosts["a"].down = True
    for _ in range(11):  # 110 s: not yet gone
        pool.tick()
    assert [s.phase for s in pool.chain(chain_id).segments] == [Phase.RUNNING, Phase.PENDING]
    pool.tick()
    pool.tick()
    chain = pool.chain(chain_id)
    ended = [(s.n, s.outcome, s.charged) for s in chain.segments[:2]]
    assert ended == [(1, Outcome.LOST, False), (2, Outcome.LOST, False)]
    assert "host a has not answered for 2m (host_timeout)" in chain.segments[0].reason
    assert chain.failures == 0 and chain.state is ChainState.ACTIVE
    if shared:
        assert pool.placed(chain_id)[2][:2] == (3, "b")
        assert chain.progress.epoch == 2  # read through b: the same checkpoint
    else:
        assert len(chain.segments) == 2
        assert chain.reason == (
            "waiting for host a to answer: the checkpoint is on its disk (the workdir is not shared by the pool)"
        )
    pool.hosts["a"].down = False  # it was cut off, not dead: job 1 still runs there
    pool.tick()
    assert ["fake-cancel", "1", "2"] in pool.hosts["a"].commands
    removed = [e.message for e in pool.store.events(chain_id) if e.kind == "removed"]
    assert removed == [
        f"job {job} removed: segment {n} was ended as lost while host a was away; the chain went on"
        for n, job in ((1, "1"), (2, "2"))
    ]  # in the chain's history, as every cancel is
    if not shared:
        pool.tick()  # its slot free again
        assert pool.placed(chain_id)[2][:2] == (3, "a")
        assert pool.chain(chain_id).reason == ""


def test_a_snapshot_chain_placed_on_another_host_finds_its_code_unpacked_there(
    pool: Pool, tmp_path: Path
) -> None:
    """Code snapshots are unpacked through the pool's first host at submit; a segment placed on
    another host (a is busy) gets the code unpacked there first, from the commit kept in the
    repository on this machine, before its job is submitted."""
    repo = make_repo(tmp_path / "repo")
    spec = replace(POOL, source=str(repo / "job.toml"), snapshot="git")
    spec = replace(spec, snapshot_commit=capture(spec).commit)
    chain_id = pool.add(spec)
    pool.hosts["a"].add_job("someone else's", "/x/job")
    pool.tick()
    assert pool.placed(chain_id) == [(1, "b", "100")]
    code = f"{POOL.workdir}/.chainrun/code/{spec.snapshot_commit}"
    assert pool.hosts["b"].files[f"{code}/version.txt"] == b"v2\n"  # the uncommitted edit, as submitted
    assert f"{code}/{CODE_NAMES}" in pool.hosts["b"].files
    assert f"{code}/{CODE_NAMES}" not in pool.hosts["a"].files


# -- whole chains on two real hosts over SSH ------------------------------------------------


def _intervals(state: Path, prefix: str) -> list[tuple[float, float]]:
    """The (start, end) of every job named ``prefix...`` a host's runner ran, from its own records."""
    spans = []
    for jobdir in machine_dir(state / "local").glob("jobs/*"):
        end = json.loads((jobdir / "end.json").read_text())
        if json.loads((jobdir / "job.json").read_text())["name"].startswith(prefix) and end.get("started_at"):
            spans.append((end["started_at"], end["ended_at"]))
    return sorted(spans)


@pytest.mark.slow
@pytest.mark.ssh
def test_a_pool_of_two_ssh_hosts_runs_four_chains_never_two_at_once_on_a_host(
    tmp_path: Path,
    chainrun: CLI,
    service: Callable[..., subprocess.Popen[bytes]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two sshds on loopback (separate runner state each), slots = 1, four chains each resumed
    over two or more segments: all complete; the runners' records and a lock in the command
    show no host ran two segments at once; python3 there cannot import chainrun. A fifth
    chain, on one of them as its ``host`` (no pool, no slots), runs beside them."""
    hosts = {}
    for name in ("pool-a", "pool-b"):
        state = tmp_path / f"state-{name}"
        server = f"SetEnv CHAINRUN_HOME={state} POOL_HOST={name}\n"
        (tmp_path / name).mkdir()
        hosts[name] = (PrivateSSHD(tmp_path / name, alias=name, server=server), state)
    for sshd, _ in hosts.values():
        sshd.start()
    config = tmp_path / "ssh_config"
    config.write_text("".join(sshd.config.read_text() for sshd, _ in hosts.values()))
    config.chmod(0o600)
    monkeypatch.setenv("CHAINRUN_SSH_CONFIG", str(config))  # for the CLI and the service
    try:
        for name in hosts:
            bare = subprocess.run(
                ["ssh", "-F", str(config), name, "python3 -c 'import chainrun'"], capture_output=True
            )
            assert bare.returncode != 0 and b"No module named 'chainrun'" in bare.stderr, bare

        work = tmp_path / "work"
        work.mkdir()
        shutil.copy(TRAINER, work / "trainer.py")
        # The lock is the host's: a second segment on one host at once would find it held.
        command = (
            'flock -n -E 42 \\"$POOL_HOST.lock\\" python3 trainer.py --epochs 6 --epoch-time 1; rc=$?; '
            '[ $rc != 42 ] || echo \\"$POOL_HOST\\" >>overlaps.log; exit $rc'
        )
        # 6 s: 5 s before the signal, time for a first epoch on a busy machine (a segment
        # without one is charged) and too short for all 6, so each chain resumes at least once.
        for i in range(4):
            job = work / f"job{i}.toml"
            job.write_text(
                f'name = "pool{i}"\ncommand = "{command}"\nworkdir = "{work}"\n'
                f'checkpoint_dir = "ckpt{i}"\ntotal_time = "5m"\nwalltime = "6s"\ngrace = "1s"\n'
                'target_epoch = 6\nmax_failures = 2\n[scheduler]\nhosts = ["pool-a", "pool-b"]\n'
            )
            chainrun("submit", str(job), check=True)
        single = work / "single.toml"
        single.write_text(
            'name = "single"\ncommand = "python3 trainer.py --epochs 4 --epoch-time 1"\n'
            f'workdir = "{work}"\ncheckpoint_dir = "ckpt-single"\ntotal_time = "5m"\nwalltime = "4s"\n'
            'grace = "1s"\ntarget_epoch = 4\n[scheduler]\nhost = "pool-b"\n'
        )
        chainrun("submit", str(single), check=True)
        service()

        def chains() -> list[dict]:  # type: ignore[type-arg]
            out = chainrun("status", "--all", "--json", check=True).stdout
            return [c for c in json.loads(out) if c["name"] != "single"]

        def states() -> list[str]:
            return [c["state"] for c in json.loads(chainrun("status", "--all", "--json", check=True).stdout)]

        wait_for(lambda: states() == ["completed"] * 5, 400, "five completed chains")
        shown = chains()
        assert len(shown) == 4
        assert not (work / "overlaps.log").exists(), (work / "overlaps.log").read_text()
        for c in shown:
            ran = [s for s in c["segments"] if s["ran"]]
            assert len(ran) >= 2, c
            assert {s["host"] for s in c["segments"]} <= set(hosts), c
            charged = [
                (s["n"], s["host"], s["outcome"], s["exit_code"], s["reason"], s["tail"])
                for s in c["segments"]
                if s["charged"]
            ]
            assert c["failures"] == 0, charged
        used = set()
        for name, (_, state) in hosts.items():
            spans = _intervals(state, "cr.pool")
            if spans:
                used.add(name)
            for (_, end), (start, _) in zip(spans, spans[1:]):
                assert start >= end, f"{name} ran two segments at once: {spans}"
        assert used == set(hosts), "both hosts should have run segments"
        # The runner was copied, not installed: one private file per version, in the login home.
        listed = subprocess.run(
            ["ssh", "-F", str(config), "pool-a", f"stat -c %a {runner_path()}"],
            capture_output=True,
            text=True,
        )
        assert listed.stdout.strip() == "600", listed
        detail = chainrun("status", shown[0]["id"], check=True).stdout
        assert "hosts: segment" in detail and "pool-" in detail, detail
        assert _intervals(hosts["pool-b"][1], "cr.single"), "the single-host chain ran on pool-b"
    finally:
        for sshd, _ in hosts.values():
            sshd.stop()
        # The runners' supervisors and jobs outlive their sshd: cancel what a failure left.
        for _, state in hosts.values():
            for jobdir in machine_dir(state / "local").glob("jobs/*"):
                (jobdir / "cancel").touch()


def test_a_version_4_database_gains_segment_hosts_and_its_chains_still_load(tmp_path: Path) -> None:
    """Schema 5 adds each segment's host: an older database's segments read as placed nowhere,
    and its specs, written before pools, read as no pool."""
    db = old_database(tmp_path / "home", 4)
    spec = STORE_SPEC.to_json()
    for key in ("hosts", "slots", "gpus_per_slot"):
        del spec["scheduler"][key]
    db.execute("UPDATE chains SET spec = ?", (json.dumps(spec),))
    db.execute(
        "INSERT INTO segments (chain_id, n, walltime, phase, job_id) VALUES ('cifar-a1b2c3', 1, 60, 'pending', '7')"
    )
    db.close()
    store = Store(tmp_path / "home")
    chain = store.chain("cifar-a1b2c3")
    store.close()
    assert [(s.n, s.job_id, s.host) for s in chain.segments] == [(1, "7", None)]
    assert (chain.spec.scheduler.hosts, chain.spec.scheduler.slots, chain.host) == ((), None, None)
    assert chain.cluster_key == ("local", "")


def test_the_runner_is_copied_once_private_and_again_when_someone_else_could_change_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Preparing a remote host (here: this machine's transport, HOME in a temporary
    directory) writes the runner by its content's hash, 0600, leaves a good copy alone, and
    writes it again when it is open to others or not whole. Each tick makes its own cluster,
    which looks once; a later tick looks again."""
    monkeypatch.setenv("HOME", str(tmp_path))
    backend = LocalScheduler(host="gpu1")

    def tick() -> None:
        Cluster(backend, LocalTransport()).prepare()

    assert backend.poll_argv() == ["python3", runner_path(), "poll"]
    copy = tmp_path / runner_path()
    tick()
    assert copy.read_bytes() == LOCAL_RUNNER.data() and copy.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / ".chainrun").stat().st_mode & 0o777 == 0o700
    before = copy.stat().st_ino
    tick()
    assert copy.stat().st_ino == before  # there already: not written again
    copy.chmod(0o666)
    tick()
    assert copy.stat().st_mode & 0o777 == 0o600
    copy.write_bytes(LOCAL_RUNNER.data()[:100])
    tick()
    assert copy.read_bytes() == LOCAL_RUNNER.data()
    cluster = Cluster(backend, LocalTransport())
    cluster.prepare()
    copy.chmod(0o666)
    cluster.prepare()  # the same tick: looked at once
    assert copy.stat().st_mode & 0o777 == 0o666
    assert LocalScheduler().helper_files() == []  # this machine runs the installed module: nothing to copy
    assert LocalScheduler().poll_argv()[1:] == ["-m", "chainrun.localrunner", "poll"]


def test_the_copied_runner_runs_where_chainrun_cannot_be_imported(tmp_path: Path) -> None:
    """The runner imports the standard library alone: as its archive, under an isolated
    python3 that cannot import chainrun, it queues, runs and reports a job."""
    copy = tmp_path / "localrunner-copy.pyz"
    copy.write_bytes(LOCAL_RUNNER.data())
    script = tmp_path / "job.sh"
    script.write_text("echo slot=$CHAINRUN_SLOT\n")
    env = {"PATH": "/usr/bin:/bin", "CHAINRUN_HOME": str(tmp_path / "state"), "HOME": str(tmp_path)}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["python3", "-I", str(copy), *args], capture_output=True, text=True, env=env)

    assert subprocess.run(["python3", "-I", "-c", "import chainrun"], capture_output=True, env=env).returncode
    out = tmp_path / "out.log"
    submitted = run(
        "submit", "--name", "cr.x.1", "--output", str(out), "--walltime", "60", "--slots", "1", str(script)
    )
    assert submitted.returncode == 0, submitted.stderr

    def ended() -> bool:
        return '"state": "ended"' in run("poll").stdout

    wait_for(ended, 60, "the job to end")
    assert '"outcome": "completed"' in run("poll").stdout
    assert out.read_text() == "slot=0\n"


def test_check_shows_the_pool(tmp_path: Path, chainrun: CLI) -> None:
    """`chainrun check` names the pool's hosts and slots; a bad pool is one line, exit 2."""
    job = tmp_path / "job.toml"
    job.write_text(BASE + '[scheduler]\nhosts = ["hoff", "norman"]\nslots = 2\ngpus_per_slot = 1\n')
    shown = chainrun("check", str(job), check=True).stdout
    assert "local on a pool of hoff, norman; 2 runs at a time on each, 1 GPU per run" in shown
    job.write_text(BASE + '[scheduler]\nkind = "slurm"\nhosts = ["hoff"]\n')
    refused = chainrun("check", str(job))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.count("\n") == 1 and "scheduler.hosts" in refused.stderr, refused.stderr
