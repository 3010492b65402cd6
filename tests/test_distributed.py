"""Distributed training as a chain: 2-process DDP (gloo, CPU) stopped by the walltime signal.

The command is the launcher's own line (``torchrun --standalone --nproc-per-node 2 ...`` on
the local runner, ``srun`` with ``--ntasks=2`` on Slurm). The wrapper signals the command's
whole process group and waits for all of it; the Checkpointer makes the ranks stop and save
as one. The chain must end bit-equal to one uninterrupted 2-process run, and no rank of a
segment may still run once that segment's end marker exists.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import test_contract
from test_contract import CLI, Cluster, outline, ran, same_state, status, write_job

pytest.importorskip("torch")

cluster = test_contract.cluster  # the contract's fixtures: the scheduler, shared, and the workdir
work = test_contract.work

DDP_TRAINER = Path(__file__).parent / "checkpoint" / "_ddp_train.py"
ARGS = "--out final.pt"  # and --epochs: 8 steps an epoch per rank


def ended(pid: int) -> bool:
    """The process is gone, or a zombie its adopter has yet to reap."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(") ", 1)[1].startswith("Z")


class RankWatch:
    """Checks, as soon as each segment's end marker appears, that the ranks it ran have ended."""

    def __init__(self, directory: Path) -> None:
        self.work = directory
        self.seen: dict[str, int] = {}  # segment -> ranks checked
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
            pids = sorted((self.work / "pids" / segment).glob("rank-*.pid"))
            self.seen[segment] = len(pids)
            for path in pids:
                pid = int(path.read_text())
                if not ended(pid):
                    self.alive.append(
                        f"segment {segment}: {path.stem} (pid {pid}) still running at its end marker"
                    )

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.check()


def reference(tmp_path: Path, epochs: int) -> Path:
    """One uninterrupted 2-process run, started by torchrun as a user would."""
    ref = tmp_path / "reference"
    ref.mkdir()
    subprocess.run(
        [
            str(Path(sys.executable).parent / "torchrun"),
            "--standalone",
            "--nproc-per-node",
            "2",
            str(DDP_TRAINER),
            "--dir",
            "checkpoints",
            *ARGS.split(),
            "--epochs",
            str(epochs),
        ],
        cwd=ref,
        check=True,
        timeout=600,
        capture_output=True,
    )
    return ref / "final.pt"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize(
    ("cluster", "launcher"),
    [
        pytest.param("local", "torchrun --standalone --nproc-per-node 2 ddp_train.py", id="local-torchrun"),
        pytest.param("slurm", "srun python3 ddp_train.py", id="slurm-srun", marks=pytest.mark.slurm),
    ],
    indirect=["cluster"],
)
def test_ddp_chain_stops_as_one_and_ends_bit_equal_to_one_run(
    cluster: Cluster,
    launcher: str,
    work: Path,
    tmp_path: Path,
    chainrun: CLI,
) -> None:
    import torch

    # The signal (the wrapper's own timer) at 40 s of each 60 s segment locally, at 30 s of
    # a one-minute Slurm job: well after torch's import and the rendezvous (9 s of a
    # segment beside a 6-worker suite here, 18 s at load average 8; a segment stopped
    # before its first step is charged). Either way the training (84 s of steps locally, 64 s
    # on Slurm) is longer than two segments' time before their signal (80 s, 60 s), so it
    # lasts three segments or more however quick the start (6 epochs, 72 s, took two in a
    # full run whose start-up was under 4 s).
    epochs, sleep, walltime, grace = (
        (7, 1.5, 60, 20) if cluster.kind == "local" else (2, 4.0, cluster.walltime, 30)
    )
    expected = torch.load(reference(tmp_path, epochs))
    (work / "ddp_train.py").write_text(DDP_TRAINER.read_text())
    command = f"{launcher} {ARGS} --epochs {epochs} --step-sleep {sleep} --pids pids/$CHAINRUN_SEGMENT"
    path = write_job(
        work,
        cluster,
        command,
        target_epoch=epochs,
        walltime=walltime,
        grace=grace,
        env={"OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())},
    )
    if cluster.kind == "slurm":
        path.write_text(path.read_text().replace("[scheduler]", '[scheduler]\noptions = ["--ntasks=2"]', 1))
    watch = RankWatch(work)
    try:
        result = chainrun("run", str(path), "--interval", "1", timeout=1200)
    finally:
        watch.stop()
    assert result.returncode == 0, result.stdout + result.stderr
    st = status(chainrun, "t")
    segs = ran(st)
    charged = [
        (s["n"], s["outcome"], s["exit_code"], s["reason"], s["tail"]) for s in st["segments"] if s["charged"]
    ]
    assert st["state"] == "completed" and st["failures"] == 0, (st["reason"], charged)
    assert len(segs) >= 3 and sum(s["outcome"] == "timeout" for s in segs) >= 2, outline(segs)
    assert all(s["outcome"] in ("timeout", "completed") and not s["charged"] for s in segs), outline(segs)
    assert not watch.alive, watch.alive
    assert all(watch.seen.get(str(s["n"])) == 2 for s in segs), (watch.seen, segs)
    logs = chainrun("logs", "t", check=True).stdout
    assert logs.count("rank 0: stopped at epoch") >= 2 and logs.count("rank 1: stopped at epoch") >= 2, logs
    same_state(expected, torch.load(work / "final.pt"))
