"""Lightning and the Hugging Face Trainer as chains, stopped by the real walltime signal.

examples/lightning/train.py and examples/hf-trainer/train.py run unchanged as a chain's
command, on the local runner (and Lightning on the real Slurm): each segment is stopped by
chainrun's signal, saves at the next batch boundary through the framework's own save and
commits it; the chain ends after three segments or more with the same result as one
uninterrupted run: Lightning's weights and optimizer state bit-equal, the Trainer's loss at
every step and its final weights' sum equal. With [tracking] in the job, their own loggers
(MLflow, W&B) log every segment into the chain's one run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import test_contract
from conftest import REPO, need
from test_contract import CLI, Cluster, outline, ran, same_state, status, write_job
from test_tracking import mlflow_env, mlflow_runs, wandb_offline_runs

from chainrun.schedulers.segment import tracker_run_id

cluster = test_contract.cluster
work = test_contract.work

EXAMPLES = REPO / "examples"


def reference(tmp_path: Path, example: str, *args: str, env: Optional[dict[str, str]] = None) -> Path:
    """One uninterrupted run of the example, as a user would start it."""
    ref = tmp_path / "reference"
    ref.mkdir()
    (ref / "train.py").write_text((EXAMPLES / example / "train.py").read_text())
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        **(env or {}),
    }
    subprocess.run(
        [sys.executable, "train.py", *args], cwd=ref, check=True, timeout=600, capture_output=True, env=env
    )
    return ref


def chain(
    chainrun: CLI,
    cluster: Cluster,
    work: Path,
    example: str,
    args: str,
    epochs: int,
    local_walltime: int = 40,
    env: Optional[dict[str, str]] = None,
    tracking: tuple[str, ...] = (),
) -> list[dict]:
    """Run the example as a chain; returns the segments that trained, checked."""
    (work / "train.py").write_text((EXAMPLES / example / "train.py").read_text())
    # The signal at walltime - grace: 25 s into a 40 s local segment (after the imports,
    # 5-15 s here under load), 30 s into a one-minute Slurm job. The steps (36 of 1.5 s, 54 s
    # in all; of 2.5 s on Slurm) last three segments or more.
    walltime, grace = (local_walltime, 15) if cluster.kind == "local" else (cluster.walltime, 30)
    path = write_job(
        work,
        cluster,
        f"python3 train.py {args}",
        target_epoch=epochs,
        walltime=walltime,
        grace=grace,
        env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})},
        tracking=tracking,
    )
    result = chainrun("run", str(path), "--interval", "1", timeout=1200)
    assert result.returncode == 0, result.stdout + result.stderr
    st = status(chainrun, "t")
    segs = ran(st)
    assert st["state"] == "completed" and st["failures"] == 0, (st["reason"], outline(st["segments"]))
    assert len(segs) >= 3 and sum(s["outcome"] == "timeout" for s in segs) >= 2, outline(segs)
    assert all(not s["charged"] for s in segs), outline(segs)
    assert st["progress"]["epoch"] == epochs, st["progress"]
    return segs


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize(
    ("cluster", "devices"),
    [
        pytest.param("local", "2", id="local-ddp"),
        pytest.param("slurm", "1", id="slurm", marks=pytest.mark.slurm),
    ],
    indirect=["cluster"],
)
def test_lightning_chain_ends_bit_equal_to_one_run(
    cluster: Cluster, devices: str, work: Path, tmp_path: Path, chainrun: CLI
) -> None:
    """Under DDP on two local ranks, and on the real Slurm (one device on the local runner:
    ``test_a_lightning_chain_ends_bit_equal_and_logs_one_mlflow_and_one_wandb_run``)."""
    pytest.importorskip("lightning")
    import torch

    # Under DDP rank 1 starts once rank 0 has imported and called fit: both ready up to 30 s in
    # under load. A later segment's signal waits for both ranks (the `ready` file); the first
    # segment's cannot wait for a rank no one has heard of yet, so it comes 45 s in here (60 s
    # segments), and the steps last 90 s. Slurm's segments train up to 30 s: 90 s of steps.
    ddp = cluster.kind == "local"
    args = f"--epochs 3 --out final.pt --devices {devices} --step-sleep 2.5"
    expected = torch.load(reference(tmp_path, "lightning", *args.split()[:6]) / "final.pt")
    chain(chainrun, cluster, work, "lightning", args, 3, local_walltime=60 if ddp else 40)
    same_state(expected, torch.load(work / "final.pt"))


# Each example: its package and extra, its loggers' arguments, the metric MLflow and W&B hold,
# W&B's x-axis, and the steps it logs in 3 epochs of 12 batches (the first, and how many):
# Lightning counts from 0, the Trainer from 1. Its result (--out) is compared with an
# uninterrupted run's: Lightning's weights and optimizer state bit-equal, the Trainer's loss at
# every step and its final weights' sum equal.
STACKS = {
    "lightning": (
        "lightning",
        "lightning",
        "--out final.pt --mlflow chained --wandb chained",
        ("train_loss", "train_loss", "trainer/global_step"),
        0,
        36,
    ),
    "hf-trainer": (
        "transformers",
        "hf",
        "--out final.json --report-to mlflow,wandb",
        ("loss", "train/loss", "train/global_step"),
        1,
        36,
    ),
}
WANDB_OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize("example", ["lightning", "hf-trainer"])
@pytest.mark.parametrize("cluster", [pytest.param("local")], indirect=True)
def test_a_chain_ends_as_one_run_and_logs_into_one_mlflow_run_and_one_wandb_run(
    cluster: Cluster, example: str, work: Path, tmp_path: Path, chainrun: CLI
) -> None:
    """The example with its own loggers, both at once ([tracking] mlflow = true and wandb = true
    (offline); the script's own logging left as it is), three segments or more against one
    uninterrupted run of the same command:

    - the result is the uninterrupted run's (``STACKS``);
    - MLflow: Lightning's MLFlowLogger given no run_id (the callback points it at the chain's
      run), the Trainer's report_to mlflow (its MLflowCallback reads MLFLOW_RUN_ID itself): one
      run holding every step once, with the uninterrupted run's values;
    - W&B: Lightning's WandbLogger given no id, the Trainer's report_to wandb: their wandb.init
      reads WANDB_RUN_ID, so every segment writes into the chain's one run, and the curves'
      x-axis (the logger's global step) carries each step's loss once."""
    need("mlflow", importlib.util.find_spec("mlflow") is not None, "pip install 'chainrun[mlflow]'")
    need("wandb", importlib.util.find_spec("wandb") is not None, "pip install 'chainrun[wandb]'")
    package, extra, args, (metric, wandb_metric, x), first, steps = STACKS[example]
    need(package, importlib.util.find_spec(package) is not None, f"pip install 'chainrun[{extra}]'")
    args = f"--epochs 3 --step-sleep 1.5 {args}"  # 36 steps, 54 s: over two 25 s segments
    ref_store = tmp_path / "reference-mlruns"
    ref = reference(tmp_path, example, *args.split(), env={**mlflow_env(ref_store), **WANDB_OFFLINE})
    (uninterrupted,) = mlflow_runs(ref_store, metric)
    assert [step for step, _ in uninterrupted["points"]] == list(range(first, first + steps))  # each once
    store = work / "mlruns"
    segs = chain(
        chainrun,
        cluster,
        work,
        example,
        args,
        3,
        env={**mlflow_env(store), **WANDB_OFFLINE},
        tracking=("mlflow", "wandb"),
    )
    if example == "lightning":
        import torch

        same_state(torch.load(ref / "final.pt"), torch.load(work / "final.pt"))
    else:
        assert json.loads((work / "final.json").read_text()) == json.loads((ref / "final.json").read_text())

    rid = tracker_run_id(status(chainrun, "t")["id"])
    runs = mlflow_runs(store, metric)
    one = {"name": rid, "experiment": uninterrupted["experiment"], "tag": rid, "deleted": False}
    assert [run for run in runs if not run["deleted"]] == [{**one, "points": uninterrupted["points"]}]
    # Lightning makes a run of its own in each later segment before the callback runs: deleted, empty.
    deleted = [run for run in runs if run["deleted"]]
    assert len(deleted) == (len(segs) - 1 if example == "lightning" else 0), deleted
    assert all(run["tag"] == rid and run["points"] == [] for run in deleted), deleted

    assert len(list((work / "wandb").glob("offline-run-*"))) == len(segs)  # one directory per segment
    ids, history = wandb_offline_runs(work / "wandb")
    logged = [row[x] for _, row in history if wandb_metric in row]
    assert ids == {rid}
    assert logged == list(range(first, first + steps))
