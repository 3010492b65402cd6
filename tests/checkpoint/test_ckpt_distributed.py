"""The Checkpointer under torch.distributed: 2 real processes (gloo, CPU) train one DDP model.

The ranks are started as two processes with torchrun's variables (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so the test decides which rank gets a
signal or dies. They must stop at the same step when one rank alone sees the
walltime signal, resume bit-exactly, and keep the previous checkpoint in force
when a rank dies during a save.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

pytestmark = [pytest.mark.torch, pytest.mark.slow]

TRAINER = Path(__file__).parent / "_ddp_train.py"
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(tmp: Path, *args: str) -> list[subprocess.CompletedProcess[str]]:
    """Both ranks of one run; returns their results, rank 0 first."""
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith("CHAINRUN_")}
        env.update(
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(REPO),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(TRAINER), *args],
                cwd=tmp,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, ""))
    return results


def ok(results: list[subprocess.CompletedProcess[str]]) -> list[str]:
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank} exited {result.returncode}:\n{result.stdout}"
    return [r.stdout for r in results]


def same(a: object, b: object, where: str = "state") -> None:
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where} keys differ"
        for key in a:
            same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where} lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def sidecar(directory: Path) -> dict[str, object]:
    return json.loads((directory / "chainrun-progress.json").read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One uninterrupted 2-process run's final states."""
    import torch

    tmp = tmp_path_factory.mktemp("reference")
    ok(launch(tmp, "--dir", "ckpt", "--out", "final.pt"))
    return torch.load(tmp / "final.pt")  # type: ignore[no-any-return]


def test_the_signal_on_one_rank_stops_both_at_the_same_step(tmp_path: Path) -> None:
    outs = ok(launch(tmp_path, "--dir", "ckpt", "--out", "final.pt", "--signal-at", "0:5:1"))
    assert "rank 0: stopped at epoch 0 step 6" in outs[0], outs[0]
    assert "rank 1: stopped at epoch 0 step 6" in outs[1], outs[1]
    progress = sidecar(tmp_path / "ckpt")
    assert (progress["epoch"], progress["step"]) == (0, 6)
    # One checkpoint, written once: rank 1 wrote nothing of its own.
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("ckpt-*.pt")) == [progress["file"]]


def test_two_interruptions_end_bit_equal_to_one_uninterrupted_run(
    tmp_path: Path, reference: dict[str, object]
) -> None:
    import torch

    args = ["--dir", "ckpt", "--out", "final.pt"]
    first = ok(launch(tmp_path, *args, "--signal-at", "0:3:1"))
    assert all("stopped at epoch 0 step 4" in out for out in first), first
    second = ok(launch(tmp_path, *args, "--signal-at", "1:5:0"))
    assert all("resumed from" in out and "stopped at epoch 1 step 6" in out for out in second), second
    last = ok(launch(tmp_path, *args))
    assert all("at step 6" in out and "finished" in out for out in last), last
    same(reference, torch.load(tmp_path / "final.pt"))


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_in_force(
    tmp_path: Path, reference: dict[str, object]
) -> None:
    import torch

    args = ["--dir", "ckpt", "--out", "final.pt"]
    ok(launch(tmp_path, *args, "--signal-at", "0:3:0"))
    before = sidecar(tmp_path / "ckpt")
    assert (before["epoch"], before["step"]) == (0, 4)

    # Rank 1 dies in the run's first save (the end of epoch 0) once rank 0 has its states.
    died = launch(tmp_path, *args, "--die-in-save", "1:1")
    assert died[1].returncode == -9 and "dying in save" in died[1].stdout, died[1].stdout
    assert died[0].returncode != 0, died[0].stdout  # rank 0 cannot commit without rank 1
    assert sidecar(tmp_path / "ckpt") == before
    assert not list((tmp_path / "ckpt").glob("*e0001-s000000.pt.sha256"))

    # The next run resumes from the checkpoint before the failed save, and still ends exact.
    last = ok(launch(tmp_path, *args))
    assert all("resumed from " + str(before["file"]) in out for out in last), last
    same(reference, torch.load(tmp_path / "final.pt"))
