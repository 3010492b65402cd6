"""One chain, several places, on the real schedulers of this machine (issue 39): the test
Slurm and the test SGE as two places, and the same Slurm over SSH (the test sshd) as a third.
Each place has its own checkpoint directory, so that a move is a real copy, verified at both
ends; the training is the stand-in trainer's lineage mode (its final checkpoint holds the
epochs it is made of, each once), or a PyTorch training compared bit for bit with one run
without a break."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import REPO, answers, have, holding_scheduler, need, slurm_answers, wait_for
from test_contract import SSH_CONFIG, TORCH_TRAINER, same_state
from test_transport import sshd_problem

from chainrun.checkpoint._digest import file_digest
from chainrun.model import Adopt, JobSpec, PlaceSpec, Progress, SchedulerSpec, Submit
from chainrun.schedulers.segment import SegmentJob
from chainrun.store import Store

DATA = Path(__file__).parent / "data"
CLI = Callable[..., "subprocess.CompletedProcess[str]"]
Service = Callable[..., "subprocess.Popen[bytes]"]

pytestmark = [pytest.mark.slurm, pytest.mark.sge]


@pytest.fixture
def both() -> Iterator[None]:
    """The real Slurm and SGE, shared with the tests beside this one; the multi partition's
    nodes all to this test (test (a) fills two with blockers, and a test that takes a node
    down would change Slurm's forecast under it)."""
    with ExitStack() as stack:
        for kind in ("slurm", "sge"):
            stack.enter_context(holding_scheduler(kind))
        stack.enter_context(holding_scheduler("slurm-nodes", exclusive=True))
        need("a running Slurm", slurm_answers(), "sudo scripts/start-slurm")
        need("a running SGE", have("qsub") and answers("qstat"), "sudo scripts/start-sge")
        yield


@pytest.fixture
def work(tmp_path: Path) -> Path:
    path = tmp_path / "work dir 'q'"
    path.mkdir()
    shutil.copy(DATA / "trainer.py", path / "trainer.py")
    return path


def write_job(work: Path, slurm: str, epochs: int, epoch_time: float = 1) -> Path:
    """Two places: Slurm first (``slurm``: its queue and options lines), SGE second, each with
    its own checkpoint directory; one segment at SGE trains about 15 epochs of a second."""
    path = work / "job.toml"
    path.write_text(
        f"""
name = "places"
command = "python3 trainer.py --lineage --epochs {epochs} --epoch-time {epoch_time}"
workdir = {json.dumps(str(work))}
total_time = "30m"
walltime = "60s"
grace = "5s"
target_epoch = {epochs}
max_failures = 1

[[cluster]]
name = "slurm"
kind = "slurm"
{slurm}
checkpoint_dir = "ckpt-slurm"

[[cluster]]
name = "sge"
kind = "sge"
walltime = "20s"
checkpoint_dir = "ckpt-sge"
"""
    )
    return path


def status(chainrun: CLI, chain_id: str) -> dict[str, Any]:
    return json.loads(chainrun("status", chain_id, "--json", check=True).stdout)[0]  # type: ignore[no-any-return]


def history(chainrun: CLI, chain_id: str) -> dict[str, Any]:
    return json.loads(chainrun("history", chain_id, "--json", check=True).stdout)  # type: ignore[no-any-return]


def lineage(ckpt: Path) -> list[list[Any]]:
    """The epochs the checkpoint in ``ckpt`` is made of: [epoch, segment, host] each."""
    sidecar = json.loads((ckpt / "chainrun-progress.json").read_text())
    return json.loads((ckpt / sidecar["file"]).read_text())["history"]  # type: ignore[no-any-return]


def timeline(st: dict[str, Any]) -> str:
    """Which segment ran where, its queue wait and the copy before it: the test's record."""
    lines = ["segment  place  job  queued  ran  copy"]
    for s in st["segments"]:
        wait = s["started_at"] - s["submitted_at"] if s["started_at"] and s["submitted_at"] else None
        took = s["ended_at"] - s["started_at"] if s["ended_at"] and s["started_at"] else None
        copy = f"{s['copy']['seconds']:.2f}s {s['copy']['bytes']}B" if s["copy"] else "-"
        lines.append(
            f"{s['n']}  {s['place']}  {s['job_id']}  {'-' if wait is None else f'{wait:.0f}s'}  "
            f"{'-' if took is None else f'{took:.0f}s'}  {copy}  {s['outcome']}"
        )
    return "\n".join(lines)


def completed_free(st: dict[str, Any]) -> None:
    """The chain completed, with no failure and no segment charged."""
    assert st["state"] == "completed", (st["reason"], timeline(st))
    assert st["failures"] == 0 and not any(s["charged"] for s in st["segments"]), timeline(st)


def sbatch(*options: str) -> str:
    out = subprocess.run(
        ["sbatch", "--parsable", "--output=/dev/null", *options], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip(), out.stderr
    return out.stdout.strip().split(";")[0]


def state_of(job: str) -> str:
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=60)
    return out.stdout.strip()


def test_a_place_that_cannot_start_a_segment_is_skipped_and_costs_nothing(
    both: None, work: Path, chainrun: CLI, service: Service
) -> None:
    """The first place's partition is not there (a place in maintenance, its partition
    gone): refused at submit and by `sbatch --test-only`; the segments go to SGE, the reason
    is shown, and nothing is charged. (Test (b) proper, slurmctld stopped mid-chain, is
    tests/test_places_down.py.)"""
    path = write_job(work, 'queue = "chainrun-absent"', epochs=6)
    submitted = chainrun("submit", str(path), check=True)
    chain_id = submitted.stdout.strip().splitlines()[-1]
    assert "its first place, slurm, refuses it now" in submitted.stderr
    service(interval=1)
    wait_for(lambda: status(chainrun, chain_id)["state"] != "active", 300, "the chain to end")
    st = status(chainrun, chain_id)
    completed_free(st)
    assert {s["place"] for s in st["segments"]} == {"sge"}, timeline(st)
    moved = [e["message"] for e in history(chainrun, chain_id)["events"] if e["kind"] == "move"]
    assert moved and "slurm cannot start it (" in moved[0] and "chainrun-absent" in moved[0], moved
    assert [e[0] for e in lineage(work / "ckpt-sge")] == list(range(1, 7))
    assert not (work / "ckpt-slurm").exists()  # nothing ever ran there


def blocker(node: str) -> str:
    """A job that fills ``node`` for half an hour: once it runs, a place on that node would
    start a segment only then (not "soon")."""
    return sbatch(
        "--partition=multi",
        f"--nodelist={node}",
        "--exclusive",
        "--time=30",
        f"--job-name=places-blocker-{node}",
        "--wrap=sleep 1800",
    )


def started_at(chainrun: CLI, chain_id: str, place: str) -> bool:
    return any(s["place"] == place and s["started_at"] for s in status(chainrun, chain_id)["segments"])


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.ssh
def test_three_places_one_over_ssh_and_the_training_ends_bit_equal(
    both: None, work: Path, tmp_path: Path, chainrun: CLI, service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(a) Three places, in order of preference, each with its own workdir and checkpoint
    directory: the test Slurm on node2, the same Slurm on node3 over SSH (the test sshd, its
    host key checked), and the test SGE. Both Slurm nodes are full (a blocker job each): the
    segments go to SGE. Node3 frees up: they go to the SSH place, the checkpoint copied there
    over SFTP. Node2 frees up: they come back to the first place, the checkpoint copied back
    from the SSH place. Each copy is the checkpoint the place it left committed, verified, and
    the first segment after it resumes from it; the PyTorch training (dropout, AdamW,
    OneCycleLR, GradScaler, its sampler's order) ends bit-equal to one run without a break.

    The training steps slowly at SGE and at the SSH place (``step-sleep`` in each workdir: a
    slower machine) and fast at the first: however loaded this machine is (torch's import
    takes 3-25 s of each segment), the chain is not done before it is back, and is then
    soon."""
    torch = pytest.importorskip("torch")
    problem = sshd_problem()
    need(f"the test sshd ({problem})", problem is None, "scripts/start-sshd (as root)")
    monkeypatch.setenv("CHAINRUN_SSH_CONFIG", SSH_CONFIG)  # for the CLI and the service
    # The SSH place's workdir (this machine as root over the sshd: a login node that sees it) and SGE's.
    remote, at_sge = tmp_path / "over ssh", tmp_path / "at sge"
    pace = {work: "0.05", remote: "1", at_sge: "1"}  # seconds a training step sleeps there
    for where, sleep in pace.items():
        where.mkdir(exist_ok=True)
        shutil.copy(TORCH_TRAINER, where / "torch_train.py")
        (where / "step-sleep").write_text(sleep)
    # 12 steps an epoch: some 130 of its 240 steps are done before the chain is back at its
    # first place on an idle machine (about 7 a segment at SGE, 27 at the SSH place), fewer
    # on a loaded one; the rest takes seconds there.
    epochs = 20
    args = f"--out final.pt --epochs {epochs}"
    reference = tmp_path / "reference"
    reference.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHAINRUN_")}
    argv = [sys.executable, str(TORCH_TRAINER), "--dir", "ckpt", *args.split()]
    subprocess.run(argv, cwd=reference, env=env, check=True, capture_output=True, timeout=300)
    command = (
        f'python3 torch_train.py --dir "$CHAINRUN_CHECKPOINT_DIR" {args} --step-sleep "$(cat step-sleep)"'
    )
    path = work / "job.toml"
    path.write_text(
        f"""
name = "places"
command = {json.dumps(command)}
workdir = {json.dumps(str(work))}
total_time = "30m"
walltime = "60s"
grace = "30s"  # the signal: at 10 s at SGE (after the first steps, on a loaded machine), 30 s at Slurm
target_epoch = {epochs}
max_failures = 1

[env]  # the same at every place: this interpreter (torch) and this checkout (the helper)
PATH = {json.dumps(os.path.dirname(sys.executable) + ":/usr/local/bin:/usr/bin:/bin")}
PYTHONPATH = {json.dumps(str(REPO))}

[[cluster]]
name = "slurm"
kind = "slurm"
queue = "multi"
options = ["--nodelist=node2"]
checkpoint_dir = "ckpt"

[[cluster]]
name = "ssh"
kind = "slurm"
host = "root-local"
queue = "multi"
options = ["--nodelist=node3"]
workdir = {json.dumps(str(remote))}
checkpoint_dir = "ckpt"

[[cluster]]
name = "sge"
kind = "sge"
walltime = "40s"
workdir = {json.dumps(str(at_sge))}
checkpoint_dir = "ckpt"
"""
    )
    blockers: list[str] = []
    try:
        for node in ("node2", "node3"):
            blockers.append(blocker(node))
        wait_for(lambda: all(state_of(job) == "RUNNING" for job in blockers), 120, "the blockers to run")
        chain_id = chainrun("submit", str(path), check=True).stdout.strip().splitlines()[-1]
        service(interval=1)
        wait_for(lambda: started_at(chainrun, chain_id, "sge"), 180, "a segment to start at SGE")
        subprocess.run(["scancel", blockers[1]], check=True, timeout=60)
        wait_for(lambda: started_at(chainrun, chain_id, "ssh"), 300, "a segment to start at the SSH place")
        subprocess.run(["scancel", blockers[0]], check=True, timeout=60)
        wait_for(lambda: status(chainrun, chain_id)["state"] != "active", 600, "the chain to end")
    finally:
        if blockers:
            subprocess.run(["scancel", *blockers], timeout=60)
    st = status(chainrun, chain_id)
    print(timeline(st))
    completed_free(st)
    ran = [s for s in st["segments"] if s["started_at"]]
    stays = [s["place"] for i, s in enumerate(ran) if i == 0 or ran[i - 1]["place"] != s["place"]]
    assert stays == ["sge", "ssh", "slurm"], timeline(st)
    events = history(chainrun, chain_id)["events"]
    moves = [e["message"] for e in events if e["kind"] == "move"]
    assert any("goes to ssh: ssh starts now (on node3 in partition multi" in m for m in moves), moves
    # Each move copied the newest checkpoint of the place it left (whose checkpoint directory
    # nothing wrote after it): the copy's sha256 is the one committed there, it is that file's,
    # and the first segment at the new place resumed from it. The SSH place trained on.
    reached = []
    for source, dest in (("sge", "ssh"), ("ssh", "slurm")):
        left = {"sge": at_sge, "ssh": remote}[source] / "ckpt"
        sidecar = json.loads((left / "chainrun-progress.json").read_text())
        reached.append((sidecar["epoch"], sidecar["step"]))
        first = next(s for s in ran if s["place"] == dest)
        copy = first["copy"]
        assert copy is not None and copy["bytes"] > sidecar["size"], timeline(st)
        found = file_digest(left / sidecar["file"], sidecar["sha256_chunk"]).sha256
        assert copy["sha256"] == sidecar["sha256"] == found, (copy, sidecar, found)
        said = [e["message"] for e in events if e["kind"] == "copy" and f"from {source} " in e["message"]]
        assert len(said) == 1 and f" to {dest} " in said[0] and "verified" in said[0], said
        log = chainrun("logs", chain_id, "--segment", str(first["n"]), check=True).stdout
        assert f"resumed from {sidecar['file']} " in log, log
    assert reached[0] < reached[1] < (epochs, 0), reached
    # Bit-equal: every tensor of the final model, optimizer, scheduler, scaler and RNG.
    same_state(torch.load(reference / "final.pt"), torch.load(work / "final.pt"))
    assert not (remote / "final.pt").exists() and not (at_sge / "final.pt").exists()
    # The accounting per place: its segments, the time allocated there and the copies to it.
    totals = history(chainrun, chain_id)["totals"]
    per = {p["place"]: p for p in totals["places"]}
    assert {p: per[p]["segments"] for p in per} == dict(Counter(s["place"] for s in ran)), totals
    assert sum(p["allocated_seconds"] for p in per.values()) == pytest.approx(totals["allocated_seconds"])
    copied = {s["place"]: s["copy"]["seconds"] for s in ran if s["copy"]}
    assert {p: per[p]["copy_seconds"] for p in ("ssh", "slurm")} == copied, (totals, copied)
    shown = chainrun("history", chain_id, check=True).stdout
    assert "PLACE" in shown and "COPY" in shown
    assert all(f"at {place}: {per[place]['segments']} segment" in shown for place in per), shown
    shown = " ".join(chainrun("status", chain_id, "-v", check=True).stdout.split())  # unwrapped
    places = r"places: segments 1(-\d+)? on sge, \d+(-\d+)? on ssh, \d+(-\d+)? on slurm; now at slurm \(of slurm, ssh, sge\)"
    assert re.search(places, shown), shown


def test_a_copy_that_fails_is_retried_and_the_segment_waits_for_it(
    both: None, work: Path, tmp_path: Path, chainrun: CLI, service: Service
) -> None:
    """(c) The chain's checkpoint is at its first place, SGE, whose queue refuses it; the next
    place, the local runner, has something in the way of its checkpoint directory. The copy
    fails, is retried after the submission's backoff, charged nothing, and the segment is
    submitted only once the copy is whole: it resumes from the copied checkpoint. Before
    that, the source directory is away (an unmounted file system, a rename): a chain that
    has saved never starts from nothing at the new place; the copy waits for it too."""
    first = work / "ckpt-sge"
    env = dict(os.environ, CHAINRUN_CHECKPOINT_DIR=str(first), CHAINRUN_SEGMENT="0")
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
    argv = [sys.executable, str(work / "trainer.py"), "--lineage", "--epochs", "3", "--epoch-time", "0.01"]
    subprocess.run(argv, check=True, env=env, capture_output=True, timeout=120)
    blocked = work / "ckpt-local"
    blocked.write_text("not a directory")
    path = work / "job.toml"
    path.write_text(
        f"""
name = "copy"
command = "python3 trainer.py --lineage --epochs 6 --epoch-time 1"
workdir = {json.dumps(str(work))}
total_time = "10m"
walltime = "12s"
grace = "3s"
target_epoch = 6

[[cluster]]
name = "sge"
kind = "sge"
queue = "chainrun-absent.q"
checkpoint_dir = "ckpt-sge"

[[cluster]]
name = "here"
kind = "local"
checkpoint_dir = "ckpt-local"
"""
    )
    chain_id = chainrun("submit", str(path), check=True).stdout.strip().splitlines()[-1]
    away = work / "ckpt-sge.away"
    first.rename(away)
    service(interval=1)

    def retries() -> int:
        return sum(e["kind"] == "retry" for e in history(chainrun, chain_id)["events"])

    wait_for(lambda: retries() >= 1, 120, "the copy from a missing source to be retried")
    seg = status(chainrun, chain_id)["segments"][0]
    assert (seg["job_id"], seg["phase"], seg["copy"]) == (None, "submitting", None), seg
    assert str(first) in seg["reason"] and "epoch 3" in seg["reason"], seg["reason"]
    assert not blocked.is_dir()
    away.rename(first)
    wait_for(lambda: retries() >= 2, 120, "the failed copy to be retried")
    st = status(chainrun, chain_id)
    seg = st["segments"][0]
    assert (seg["place"], seg["job_id"], seg["phase"], seg["copy"]) == ("here", None, "submitting", None)
    assert "checkpoint" in seg["reason"] and str(blocked) in seg["reason"], seg["reason"]
    blocked.unlink()
    wait_for(lambda: status(chainrun, chain_id)["state"] != "active", 300, "the chain to end")
    st = status(chainrun, chain_id)
    assert st["state"] == "completed" and st["failures"] == 0, (st["reason"], timeline(st))
    assert st["segments"][0]["copy"] is not None and st["segments"][0]["job_id"] is not None
    made = lineage(blocked)
    assert [e[0] for e in made] == [1, 2, 3, 4, 5, 6]
    assert [e[1] for e in made[:3]] == [0, 0, 0]  # trained before the chain, at its first place


@pytest.mark.ssh
def test_logs_reads_each_segment_at_the_place_it_ran(
    tmp_path: Path, home: Path, chainrun: CLI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`chainrun logs` of a chain with several places reads each segment's output where that
    segment ran (its place's workdir, over SSH for a place with a host), not at the place the
    chain is at now: it printed nothing for the segments that ran elsewhere."""
    problem = sshd_problem()
    need(f"the test sshd ({problem})", problem is None, "scripts/start-sshd (as root)")
    monkeypatch.setenv("CHAINRUN_SSH_CONFIG", SSH_CONFIG)
    here, there = tmp_path / "here", tmp_path / "over ssh"
    places = (
        PlaceSpec("here", SchedulerSpec("local"), str(here), str(here / "ckpt"), 60),
        PlaceSpec("ssh", SchedulerSpec("local", host="root-local"), str(there), str(there / "ckpt"), 60),
    )
    spec = JobSpec(
        name="logs",
        command="true",
        workdir=str(here),
        total_time=600,
        walltime=60,
        target_epoch=None,
        max_failures=0,
        checkpoint_dir=str(here / "ckpt"),
        signal="USR1",
        grace=10,
        scheduler=places[0].scheduler,
        places=places,
    )
    store = Store(home)
    chain_id = store.add_chain(spec, Progress(), 0.0).id
    for n, place in ((1, "ssh"), (2, "here")):  # the chain went over SSH, and is back here now
        store.journal_submit(chain_id, Submit(n, 60), float(n), place=place)
        store.record(chain_id, [Adopt(n, f"j{n}", "submitted")], None, [], float(n))
        log = Path(SegmentJob(chain_id, n, spec.at(place), 0).log_path)
        log.parent.mkdir(parents=True)
        log.write_text(f"segment {n} trained at {place}\n")
    assert store.chain(chain_id).spec.place_name == "here"
    shown = chainrun("logs", chain_id, check=True).stdout
    assert "segment 1 trained at ssh\n" in shown and "segment 2 trained at here\n" in shown, shown
    assert chainrun("logs", chain_id, "-n", "1", check=True).stdout == "segment 1 trained at ssh\n"
