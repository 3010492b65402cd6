"""Segments that span nodes, on the multi-node test Slurm: ``scripts/start-slurm --nodes 3``
adds node1..node3 (partition ``multi``), each a slurmd in network, UTS, PID and mount
namespaces of its own on a private bridge, sharing this machine's file system.

Every process of every node is also a process of this machine, so "nothing left running on
any node" is read from this machine's /proc: the processes that carry the chain's id in their
environment (srun passes it on to every node).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import test_contract
from conftest import REPO, holding_scheduler, need, wait_for
from test_contract import CLI, Cluster, chain_processes, outline, ran, same_state, status, write_job
from test_distributed import ARGS, DDP_TRAINER, free_port, reference

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

cluster = test_contract.cluster  # the contract's fixtures: the scheduler, shared, and the workdir
work = test_contract.work

SLURM_NODES = REPO / "scripts" / "slurm-nodes"
PARTITION = "multi"
OPTIONS = '["--nodes=2", "--ntasks-per-node=1"]'
# Rank 0's address, as the batch node (the allocation's first) resolves it.
WALLTIME = 120  # long enough for torch's import, a rendezvous and some steps on a loaded machine
HEAD = 'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1); '


def sinfo_nodes() -> dict[str, str]:
    """The multi partition's nodes and their states (a trailing * : not responding)."""
    out = subprocess.run(
        ["sinfo", "--noheader", "--Node", f"--partition={PARTITION}", "--format=%N %t"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return dict(line.split() for line in out.splitlines() if line.strip())


def usable(state: str) -> bool:
    return state in ("idle", "mix", "alloc")


@pytest.fixture
def multinode(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[None]:
    """The multi-node Slurm's nodes, shared with the tests beside this one, or all to itself
    for a test marked ``takes_down_a_node`` (a job of another test on that node would fail)."""
    exclusive = request.node.get_closest_marker("takes_down_a_node") is not None
    with holding_scheduler("slurm-nodes", exclusive=exclusive):
        nodes = sinfo_nodes()
        need(
            "the multi-node Slurm (3 nodes in partition multi)",
            len(nodes) >= 3 and sum(usable(s) for s in nodes.values()) >= 2,
            "sudo scripts/start-slurm --nodes 3",
        )
        yield


def hostnames(nodelist: str) -> list[str]:
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60
    )
    return out.stdout.split()


def job_nodes(job_ids: list[str]) -> dict[str, list[str]]:
    """Each job's nodes, from sacct."""
    out = subprocess.run(
        [
            "sacct",
            "--noheader",
            "--allocations",
            "--parsable2",
            "--format=JobID,NodeList",
            f"--jobs={','.join(job_ids)}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return {
        job: hostnames(nodes)
        for job, nodes in (line.split("|", 1) for line in out.splitlines() if line.strip())
    }


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[1])


def cmdline_of(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def wrapper_own(pid: int, cmdline: str) -> bool:
    """The wrapper's own processes, not the command's, which may outlive the end marker: its
    one-second timer (a `sleep 1` of a subshell of the batch script), and the run directory's
    ``carry`` launcher it asks once more after writing the marker, with what that starts (the
    interpreter it execs, ``python -c ... chainrun.carry ...``, or a grep)."""
    try:
        if cmdline.strip() == "sleep 1" and "slurm_script" in cmdline_of(parent_of(pid)):
            return True
        for _ in range(4):
            if "chainrun.carry" in cmdline or re.search(r"/\.chainrun/[^/ ]+/carry ", cmdline):
                return True
            pid = parent_of(pid)
            cmdline = cmdline_of(pid)
    except (OSError, ValueError):
        return False
    return False


def segment_processes(chain: str, n: str) -> list[str]:
    """The processes of segment ``n`` of the chain still running, on any node (by their environment)."""
    found = []
    for pid in chain_processes(chain):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = cmdline_of(pid)
        except OSError:
            continue  # it ended as we looked
        if f"CHAINRUN_SEGMENT={n}".encode() in environ and not wrapper_own(pid, cmdline):
            found.append(f"pid {pid} ({cmdline})")
    return found


class EndWatch:
    """As soon as each segment's end marker appears: the chain's processes still running,
    anywhere, that belong to that segment (none may: every rank on every node has ended)."""

    def __init__(self, directory: Path) -> None:
        self.work = directory
        self.seen: set[str] = set()
        self.alive: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.check()

    def check(self) -> None:
        for end in self.work.glob(".chainrun/*/seg-*.end"):
            segment = str(int(end.name[4:8]))
            if segment in self.seen:
                continue
            self.seen.add(segment)
            left = segment_processes(end.parent.name, segment)  # .chainrun/CHAIN/seg-N.end
            self.alive.extend(f"segment {segment}: {p} still running at its end marker" for p in left)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.check()


@pytest.mark.torch
@pytest.mark.parametrize("cluster", ["slurm"], indirect=True)
@pytest.mark.parametrize(
    "launcher",
    [
        pytest.param("srun python3 ddp_train.py", id="srun"),
        # torchrun dies of SIGUSR1, and the step's end would then kill its ranks unsaved: it
        # ignores the signal (inherited through exec), its ranks handle it (srun passes it to
        # every process of the step on each node).
        pytest.param(
            'srun bash -c \'trap "" USR1; exec torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d'
            ' --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" ddp_train.py "$@"\' torchrun',
            id="torchrun",
        ),
    ],
)
def test_two_node_ddp_chain_stops_as_one_and_ends_bit_equal_to_one_run(
    cluster: Cluster, multinode: None, launcher: str, work: Path, tmp_path: Path, chainrun: CLI
) -> None:
    """Two nodes, a rank on each: at each walltime signal both ranks stop at the same step and
    rank 0 commits; no process of the segment is left on either node at its end; after two
    or more segments the weights are bit-equal to one uninterrupted two-rank run."""
    import torch

    # Two-minute jobs: the signal comes 90-120 s in (grace 30 s; Slurm checks limits every
    # 30 s), after torch's import and the rendezvous (10-40 s here, by the load): 16 steps
    # of 7 s (112 s) take two segments or more.
    epochs, sleep = 2, 7.0
    expected = torch.load(reference(tmp_path, epochs))
    (work / "ddp_train.py").write_text(DDP_TRAINER.read_text())
    command = f"{HEAD}{launcher} {ARGS} --epochs {epochs} --step-sleep {sleep}"
    path = write_job(
        work,
        cluster,
        command,
        target_epoch=epochs,
        walltime=WALLTIME,
        grace=30,
        queue=PARTITION,
        env={"OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())},
    )
    path.write_text(path.read_text().replace("[scheduler]", f"[scheduler]\noptions = {OPTIONS}", 1))
    watch = EndWatch(work)
    try:
        result = chainrun("run", str(path), "--interval", "1", timeout=1200)
    finally:
        watch.stop()
    assert result.returncode == 0, result.stdout + result.stderr
    st = status(chainrun, "t")
    segs = ran(st)
    assert st["state"] == "completed" and st["failures"] == 0, (st["reason"], outline(segs))
    assert len(segs) >= 2 and all(s["outcome"] == "timeout" for s in segs[:-1]), outline(segs)
    assert all(s["outcome"] in ("timeout", "completed") and not s["charged"] for s in segs), outline(segs)
    assert not watch.alive, watch.alive
    nodes = job_nodes([s["job_id"] for s in segs])
    assert all(len(nodes.get(s["job_id"], [])) == 2 for s in segs), nodes
    logs = chainrun("logs", "t", check=True).stdout
    stops = [line.split("stopped at ")[1] for line in logs.splitlines() if "stopped at epoch" in line]
    timeouts = sum(s["outcome"] == "timeout" for s in segs)  # each segment but the last
    assert logs.count("rank 0: stopped at epoch") >= timeouts, logs
    assert logs.count("rank 1: stopped at epoch") >= timeouts, logs
    # Every stop is both ranks', at the same step.
    assert all(stops.count(where) % 2 == 0 for where in stops), stops
    same_state(expected, torch.load(work / "final.pt"))


def node_of(job_id: str, which: int) -> str:
    """The allocation's node number ``which`` (0: the batch node)."""
    out = subprocess.run(
        ["squeue", "--noheader", f"--jobs={job_id}", "--format=%N"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return hostnames(out.stdout.strip())[which]


def running(st: dict[str, Any]) -> bool:
    """Whether the chain's first segment runs."""
    return bool(st["segments"]) and st["segments"][0]["phase"] == "running"


def submit_without_requeue(path: Path, chainrun: CLI, service: Any) -> str:
    """Submit the job file with the partition's options and --no-requeue (else Slurm itself
    runs the job again, as the same job, after a node failure), and start the service."""
    options = OPTIONS.replace("]", ', "--no-requeue"]')
    path.write_text(path.read_text().replace("[scheduler]", f"[scheduler]\noptions = {options}", 1))
    chain = chainrun("submit", str(path), check=True).stdout.strip()
    service(interval=1)
    return chain


def power(action: str, node: str) -> None:
    subprocess.run([str(SLURM_NODES), action, node], check=True, timeout=120, capture_output=True)


@pytest.mark.torch
@pytest.mark.takes_down_a_node
@pytest.mark.parametrize("cluster", ["slurm"], indirect=True)
def test_a_node_lost_under_a_segment_is_a_free_node_failure_and_the_chain_goes_on(
    cluster: Cluster, multinode: None, work: Path, tmp_path: Path, chainrun: CLI, service: Any
) -> None:
    """Power lost on one node of a running two-node segment (its namespace killed): Slurm
    marks the node down and the job NODE_FAIL; the segment is a node failure at no cost (its
    checkpoint is intact; max_failures = 0 would end the chain on a charge), no rank of it
    survives on any node; while too few nodes are up the next segment waits, saying so; then
    it runs on the nodes that are up and the chain ends bit-equal to one uninterrupted run."""
    import torch

    wait_for(lambda: all(usable(s) for s in sinfo_nodes().values()), 300, "all three nodes up")
    epochs = 3
    expected = torch.load(reference(tmp_path, epochs))
    (work / "ddp_train.py").write_text(DDP_TRAINER.read_text())
    command = f"{HEAD}srun python3 ddp_train.py {ARGS} --epochs {epochs} --step-sleep 1.5"
    path = write_job(
        work,
        cluster,
        command,
        target_epoch=epochs,
        walltime=WALLTIME,
        grace=30,
        max_failures=0,
        queue=PARTITION,
        env={"OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())},
    )
    chain = submit_without_requeue(path, chainrun, service)
    killed: list[str] = []
    try:
        wait_for(lambda: running(status(chainrun, chain)), 400, "segment 1 to run")
        first = status(chainrun, chain)["segments"][0]
        lost = node_of(first["job_id"], 1)
        # Another node down too, first, and seen down by Slurm before `lost` dies: one node left,
        # the next segment (two nodes) must wait. (Killed at once, Slurm may see `lost` dead
        # first, and start the next segment on `other` before it has seen that one dead.)
        other = next(n for n in sinfo_nodes() if n not in (lost, node_of(first["job_id"], 0)))
        power("kill", other)
        killed.append(other)
        wait_for(lambda: not usable(sinfo_nodes()[other]), 120, f"Slurm to see {other} not responding")
        # Segment 1 still running, with a checkpoint saved (an epoch's end) in it.
        wait_for(
            lambda: (status(chainrun, chain)["progress"]["epoch"] or 0) >= 1, 400, "a checkpoint in segment 1"
        )
        assert status(chainrun, chain)["segments"][0]["phase"] == "running", status(chainrun, chain)
        power("kill", lost)
        killed.append(lost)
        wait_for(
            lambda: status(chainrun, chain)["segments"][0]["outcome"] is not None, 300, "segment 1 to end"
        )
        st = status(chainrun, chain)
        seg = st["segments"][0]
        assert (seg["outcome"], seg["charged"]) == ("node_fail", False), seg
        assert "checkpoint is intact" in seg["reason"], seg
        assert not segment_processes(chain, "1"), "a rank of segment 1 survived"

        def waiting() -> str:
            nxt = status(chainrun, chain)["next"]
            return (
                nxt["reason"] if nxt and nxt["phase"] == "pending" and "node" in nxt["reason"].lower() else ""
            )

        wait_for(lambda: bool(waiting()), 120, "segment 2 to wait for nodes")
        power("start", other)
        killed.remove(other)
        wait_for(lambda: status(chainrun, chain)["state"] == "completed", 900, "the chain to complete")
    finally:
        for node in killed:
            power("start", node)
    st = status(chainrun, chain)
    assert st["failures"] == 0, st
    later = [s["job_id"] for s in ran(st)[1:]]
    assert later and all(lost not in nodes for nodes in job_nodes(later).values()), (lost, job_nodes(later))
    same_state(expected, torch.load(work / "final.pt"))


# Segment 1 starts on two nodes and waits for the test's word before its srun (the test kills
# the allocation's second node meanwhile); every segment's srun starts a task on each node;
# a segment whose srun succeeded reached epoch 2.
UNNOTICED = """set -e
if [ "$CHAINRUN_SEGMENT" = 1 ]; then
    touch started
    while [ ! -e go ]; do sleep 0.2; done
fi
srun hostname
echo '{"epoch": 2}' > progress.json
"""


@pytest.mark.takes_down_a_node
@pytest.mark.parametrize("cluster", ["slurm"], indirect=True)
def test_a_step_that_cannot_start_on_a_node_dead_before_slurm_noticed_is_a_free_node_failure(
    cluster: Cluster, multinode: None, work: Path, chainrun: CLI, service: Any
) -> None:
    """A node of a running segment's allocation dies silently before the segment's srun starts
    its tasks (a power loss the controller has not noticed yet): srun cannot launch there, the
    batch script fails and Slurm records the job FAILED, not NODE_FAIL, since it ended before
    the node was declared down. The node is down by the time the job has ended, and the
    segment is a node failure, free as its checkpoint is intact (max_failures = 0 would end
    the chain on a charge); the chain goes on on the nodes that are up."""
    wait_for(lambda: all(usable(s) for s in sinfo_nodes().values()), 300, "all three nodes up")
    (work / "seg.sh").write_text(UNNOTICED)
    (work / "progress.json").write_text('{"epoch": 1}')  # the checkpoint segment 1 starts from
    path = write_job(
        work,
        cluster,
        "bash seg.sh",
        target_epoch=2,
        walltime=WALLTIME,
        grace=30,
        max_failures=0,
        queue=PARTITION,
        progress="progress.json:epoch",
    )
    chain = submit_without_requeue(path, chainrun, service)
    killed: list[str] = []
    try:
        wait_for((work / "started").exists, 300, "segment 1 to start")
        first = status(chainrun, chain)["segments"][0]
        dead = node_of(first["job_id"], 1)
        power("kill", dead)
        killed.append(dead)
        (work / "go").touch()
        wait_for(lambda: status(chainrun, chain)["state"] != "active", 600, "the chain to end")
    finally:
        for node in killed:
            power("start", node)
    st = status(chainrun, chain)
    seg = st["segments"][0]
    assert (seg["outcome"], seg["charged"]) == ("node_fail", False), outline(st["segments"])
    assert dead in seg["reason"] and "checkpoint is intact" in seg["reason"], seg
    assert st["state"] == "completed" and st["failures"] == 0, (st["reason"], outline(st["segments"]))
    # (A segment that started and ended between two ticks has no start recorded: not ``ran``.)
    later = [s["job_id"] for s in st["segments"][1:] if s["outcome"] == "completed"]
    assert later, outline(st["segments"])
    assert all(dead not in nodes for nodes in job_nodes(later).values()), (dead, job_nodes(later))


RAY_EXAMPLE = REPO / "examples" / "ray-tune"


@pytest.mark.ray
@pytest.mark.parametrize("cluster", ["slurm"], indirect=True)
def test_a_ray_tune_experiment_across_the_allocation_resumes_without_restarting_a_trial(
    cluster: Cluster, multinode: None, work: Path, chainrun: CLI
) -> None:
    """examples/ray-tune on two nodes: each segment starts a Ray head on the batch node and a
    worker on the other (srun), then the driver; the walltime signal stops the experiment,
    the next segment resumes it (Tuner.restore), so every trial starts once and later goes on
    from its checkpoint; no process of a segment (Ray's included) is left on any node at its
    end. Ray is an extra: without it this fails, as every test here fails without what it needs."""
    import ray  # noqa: F401  # not importorskip: the extra is part of the test setup

    for name in ("segment.sh", "train.py"):
        shutil.copy(RAY_EXAMPLE / name, work / name)
    # Of 2 s: more than one segment's window (WALLTIME - grace) of trials' work, however fast
    # Ray starts (40 steps once fitted in the first segment on a quiet machine).
    steps = (WALLTIME - 30) // 2 + 10
    path = write_job(
        work,
        cluster,
        f"bash segment.sh --steps {steps} --step-seconds 2",
        target_epoch=steps,
        walltime=WALLTIME,
        grace=30,
        queue=PARTITION,
        checkpoint_dir="ray_results",
        progress="progress.json:epoch",
    )
    options = OPTIONS.replace("]", ', "--no-requeue"]')
    path.write_text(path.read_text().replace("[scheduler]", f"[scheduler]\noptions = {options}", 1))
    watch = EndWatch(work)
    try:
        result = chainrun("run", str(path), "--interval", "1", timeout=1500)
    finally:
        watch.stop()
    assert result.returncode == 0, result.stdout + result.stderr
    st = status(chainrun, "t")
    segs = ran(st)
    assert st["state"] == "completed" and st["failures"] == 0, (st["reason"], segs)
    assert len(segs) >= 2 and segs[0]["outcome"] == "timeout", outline(segs)
    assert not watch.alive, watch.alive
    assert all(len(nodes) == 2 for nodes in job_nodes([s["job_id"] for s in segs]).values())
    logs = chainrun("logs", "t", check=True).stdout
    trials = [line.split("trial ", 1)[1] for line in logs.splitlines() if "trial lr=" in line]
    fresh = [t for t in trials if "fresh start" in t]
    resumed = [t for t in trials if "resumed at step" in t]
    # Two trials, each started once; later segments resume them from a checkpoint past step 0.
    assert len(fresh) == 2 and len({t.split(":")[0] for t in fresh}) == 2, trials
    assert resumed and all(int(t.split("resumed at step ")[1].split()[0]) > 0 for t in resumed), trials
    assert len({t.rsplit(" on ", 1)[1] for t in trials}) == 2, trials  # on both nodes
