"""One chain, several places, on the real schedulers of this machine: the test Slurm and the
test SGE as two places (issue 39). Each place has its own checkpoint directory, so that a
move is a real copy, verified at both ends; the training is the stand-in trainer's lineage
mode, whose final checkpoint holds the epochs it is made of, each once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import answers, have, holding_scheduler, need, slurm_answers, wait_for

DATA = Path(__file__).parent / "data"
CLI = Callable[..., "subprocess.CompletedProcess[str]"]
Service = Callable[..., "subprocess.Popen[bytes]"]
NODE = "node2"  # the one node of the multi partition that test (a) fills with a blocker

pytestmark = [pytest.mark.slurm, pytest.mark.sge]


@pytest.fixture
def both() -> Iterator[None]:
    """The real Slurm and SGE, shared with the tests beside this one; the multi partition's
    nodes all to this test (test (a) fills one with a blocker, and a test that takes a node
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


def uninterrupted(tmp_path: Path, epochs: int) -> list[int]:
    """The epochs of the same training run in one go, here."""
    ckpt = tmp_path / "straight"
    env = dict(os.environ, CHAINRUN_CHECKPOINT_DIR=str(ckpt), CHAINRUN_SEGMENT="1")
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
    argv = [
        sys.executable,
        str(DATA / "trainer.py"),
        "--lineage",
        "--epochs",
        str(epochs),
        "--epoch-time",
        "0.01",
    ]
    subprocess.run(argv, check=True, env=env, capture_output=True, timeout=120)
    return [e[0] for e in lineage(ckpt)]


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
    assert st["state"] == "completed", (st["reason"], timeline(st))
    assert st["failures"] == 0 and not any(s["charged"] for s in st["segments"])
    assert {s["place"] for s in st["segments"]} == {"sge"}, timeline(st)
    moved = [e["message"] for e in history(chainrun, chain_id)["events"] if e["kind"] == "move"]
    assert moved and "slurm cannot start it (" in moved[0] and "chainrun-absent" in moved[0], moved
    assert [e[0] for e in lineage(work / "ckpt-sge")] == list(range(1, 7))
    assert not (work / "ckpt-slurm").exists()  # nothing ever ran there


def test_segments_go_where_they_start_soonest_and_the_checkpoint_follows(
    both: None, work: Path, tmp_path: Path, chainrun: CLI, service: Service
) -> None:
    """(a) Slurm's node is full (a blocker job): the segments go to SGE; once the blocker is
    gone they come back to Slurm, the preferred place. The checkpoint is copied at each move,
    verified, and the training is the same as one run without interruption."""
    # Enough training for four or five segments at SGE (about 30 epochs each) while the
    # service still goes by the forecast it asked for before the blocker went (it asks once
    # a minute), and then one or two at Slurm.
    epochs = 200
    blocker = sbatch(
        "--partition=multi",
        f"--nodelist={NODE}",
        "--exclusive",
        "--time=10",
        "--job-name=places-blocker",
        "--wrap=sleep 600",
    )
    try:
        wait_for(lambda: state_of(blocker) == "RUNNING", 120, "the blocker to run")
        slurm = f'queue = "multi"\noptions = ["--nodelist={NODE}"]'
        path = write_job(work, slurm, epochs=epochs, epoch_time=0.5)
        chain_id = chainrun("submit", str(path), check=True).stdout.strip().splitlines()[-1]
        service(interval=1)

        def at_sge_started() -> bool:
            segs = status(chainrun, chain_id)["segments"]
            return any(s["place"] == "sge" and s["started_at"] for s in segs)

        wait_for(at_sge_started, 180, "a segment to start at SGE")
        subprocess.run(["scancel", blocker], check=True, timeout=60)
        wait_for(lambda: status(chainrun, chain_id)["state"] != "active", 600, "the chain to end")
    finally:
        subprocess.run(["scancel", blocker], timeout=60)
    st = status(chainrun, chain_id)
    print(timeline(st))
    assert st["state"] == "completed", (st["reason"], timeline(st))
    assert st["failures"] == 0, timeline(st)
    places = [s["place"] for s in st["segments"] if s["started_at"]]
    assert places[0] == "sge" and places[-1] == "slurm", timeline(st)
    # Each segment after a move found the checkpoint copied there first, recorded and verified.
    copies = [e["message"] for e in history(chainrun, chain_id)["events"] if e["kind"] == "copy"]
    assert any("from sge" in c and "verified" in c and "sha256" in c for c in copies), copies
    back = next(s for s in st["segments"] if s["place"] == "slurm" and s["started_at"])
    assert back["copy"] is not None and back["copy"]["bytes"] > 0 and back["copy"]["sha256"]
    # The final checkpoint (at Slurm) is made of every epoch once, in order: the same as an
    # uninterrupted run's; its first epochs were trained at SGE by the segments there.
    made = lineage(work / "ckpt-slurm")
    assert [e[0] for e in made] == uninterrupted(tmp_path, epochs)
    at = {place: {s["n"] for s in st["segments"] if s["place"] == place} for place in ("sge", "slurm")}
    assert made[0][1] in at["sge"] and made[-1][1] in at["slurm"], (made[0], made[-1], timeline(st))
    shown = chainrun("history", chain_id, check=True).stdout
    assert "PLACE" in shown and "COPY" in shown
    assert "; now at slurm (of slurm, sge)" in chainrun("status", chain_id, "-v", check=True).stdout


def test_a_copy_that_fails_is_retried_and_the_segment_waits_for_it(
    both: None, work: Path, tmp_path: Path, chainrun: CLI, service: Service
) -> None:
    """(c) The chain's checkpoint is at its first place, SGE, whose queue refuses it; the next
    place, the local runner, has something in the way of its checkpoint directory. The copy
    fails, is retried after the submission's backoff, charged nothing, and the segment is
    submitted only once the copy is whole: it resumes from the copied checkpoint."""
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
    service(interval=1)

    def retried() -> bool:
        return any(e["kind"] == "retry" for e in history(chainrun, chain_id)["events"])

    wait_for(retried, 120, "the failed copy to be retried")
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
