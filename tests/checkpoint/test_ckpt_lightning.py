"""chainrun.checkpoint.lightning with the real ``lightning`` package: examples/lightning/train.py
stopped mid-epoch by its callback's clock several times ends bit-equal to one uninterrupted run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from ckpt_support import REPO, describe, no_chainrun_env, restore_signal_handlers, script_env  # noqa: F401

pytest.importorskip("lightning")
pytestmark = pytest.mark.torch

EXAMPLE = REPO / "examples" / "lightning" / "train.py"


def run(where: Path, *args: str, **env: str) -> str:
    """The example's three epochs in ``where``; its output, warnings included."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, str(where / "train.py"), "--epochs", "3", *args],
        cwd=where,
        capture_output=True,
        text=True,
        env=script_env(OMP_NUM_THREADS="1", **env),
        timeout=240,
    )
    assert result.returncode == 0, describe(result)
    return result.stdout + result.stderr


@pytest.mark.parametrize(
    ("every", "segments", "devices"),
    [
        pytest.param(7, 6, "1", id="mid-epoch"),  # 12 batches an epoch, 36 in all
        pytest.param(12, 3, "1", id="epoch-ends"),  # saved at the epoch's end; the last one is done
        pytest.param(7, 6, "2", id="ddp-mid-epoch"),  # two CPU ranks; rank 0 commits
    ],
)
def test_stopped_segments_end_bitwise_equal_to_an_uninterrupted_run(
    tmp_path: Path, every: int, segments: int, devices: str
) -> None:
    import torch

    ref, chain = tmp_path / "ref", tmp_path / "chain"
    for d in (ref, chain):
        d.mkdir()
        shutil.copy(EXAMPLE, d / "train.py")
    run(ref, "--out", "final.pt", "--devices", devices)
    ran = 0
    while not (chain / "final.pt").exists():
        out = run(chain, "--out", "final.pt", "--stop-after", str(every), "--devices", devices)
        ran += 1
        assert ran <= 8, out
    assert ran == segments
    progress = json.loads((chain / "checkpoints" / "chainrun-progress.json").read_text())
    assert progress["done"] is True and progress["epoch"] == 3
    assert "train_loss" in progress["metrics"]
    expected, got = torch.load(ref / "final.pt"), torch.load(chain / "final.pt")
    for part in ("model", "optimizer"):
        flat_a, flat_b = (
            torch.utils._pytree.tree_leaves(expected[part]),
            torch.utils._pytree.tree_leaves(got[part]),
        )
        assert len(flat_a) == len(flat_b)
        for a, b in zip(flat_a, flat_b):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), part
            else:
                assert a == b, part


def test_ckpt_path_is_none_first_then_the_committed_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from chainrun.checkpoint.lightning import ChainrunCallback

    monkeypatch.chdir(tmp_path)
    assert ChainrunCallback(tmp_path / "ck", clock=None).ckpt_path is None
    shutil.copy(EXAMPLE, tmp_path / "train.py")
    run(tmp_path, "--stop-after", "5")
    cb = ChainrunCallback(tmp_path / "checkpoints")
    progress = json.loads((tmp_path / "checkpoints" / "chainrun-progress.json").read_text())
    assert cb.ckpt_path == str(tmp_path / "checkpoints" / progress["file"])
    assert (progress["epoch"], progress["step"], progress["done"]) == (0, 5, False)
    # recorded with the helper's chunked digest, which the file matches
    from chainrun.checkpoint._digest import CHUNK, file_digest

    assert progress["sha256_chunk"] == CHUNK
    assert file_digest(cb.ckpt_path, CHUNK).sha256 == progress["sha256"]
    # a save that never committed (a newer, partly written file) is never chosen
    (tmp_path / "checkpoints" / "ckpt-000099-e0001-s000000.ckpt").write_bytes(b"partial")
    assert ChainrunCallback(tmp_path / "checkpoints").ckpt_path == cb.ckpt_path


def test_lightning_slurm_auto_requeue_is_turned_off_and_said_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning's requeue handler saves inside the signal handler and calls scontrol: off."""
    import signal

    import lightning as L
    import torch
    from lightning.fabric.plugins.environments.slurm import SLURMEnvironment
    from torch.utils.data import DataLoader, TensorDataset

    from chainrun.checkpoint import CheckpointWarning
    from chainrun.checkpoint.lightning import ChainrunCallback

    for name, value in {
        "SLURM_NTASKS": "1",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_JOB_NAME": "t",
        "SLURM_JOB_ID": "1",
        "SLURM_NTASKS_PER_NODE": "1",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            seen.append(signal.getsignal(signal.SIGUSR1))
            return self.net(batch[0]).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    seen: list[object] = []
    cb = ChainrunCallback(tmp_path / "ck")
    environment = SLURMEnvironment(auto_requeue=True)
    trainer = L.Trainer(
        callbacks=[cb],
        plugins=[environment],
        max_steps=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    loader = DataLoader(TensorDataset(torch.ones(4, 2)), batch_size=2)
    with pytest.warns(CheckpointWarning, match="auto_requeue=True"):
        trainer.fit(Tiny(), loader, ckpt_path=cb.ckpt_path)
    assert environment.auto_requeue is False
    assert seen and all(handler == cb.clock._handle for handler in seen)  # the walltime signal is ours
    assert cb.last_saved is not None and cb.last_saved.done


def test_run_id_names_a_loggers_version_in_a_chain_and_nothing_outside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    from chainrun.checkpoint.lightning import ChainrunCallback, run_id

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = self.net(batch[0]).sum()
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    loader = DataLoader(TensorDataset(torch.ones(4, 2)), batch_size=2)
    versions = []
    for chain_run in ("chain-7f3a", ""):
        monkeypatch.setenv("CHAINRUN_RUN_ID", chain_run)
        cb = ChainrunCallback(tmp_path / f"ck{chain_run}")
        logger = CSVLogger(tmp_path / "logs", version=run_id())
        trainer = L.Trainer(
            callbacks=[cb],
            logger=logger,
            max_steps=2,
            accelerator="cpu",
            devices=1,
            enable_checkpointing=False,
            enable_progress_bar=False,
        )
        trainer.fit(Tiny(), loader, ckpt_path=cb.ckpt_path)
        versions.append(logger.version)
    assert versions == ["chain-7f3a", 0]  # unset: Lightning's own numbering
    assert (tmp_path / "logs" / "lightning_logs" / "chain-7f3a").is_dir()


def test_an_mlflow_run_id_that_names_no_run_leaves_the_segment_its_own_run_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chain's run deleted under it (MLFLOW_RUN_ID names none): the MLFlowLogger keeps the
    run it made, tagged as the chain's, trains to the end and one warning says why."""
    pytest.importorskip("mlflow")
    import mlflow

    store = {"MLFLOW_TRACKING_URI": f"file://{tmp_path / 'mlruns'}", "MLFLOW_ALLOW_FILE_STORE": "true"}
    shutil.copy(EXAMPLE, tmp_path / "train.py")
    gone = "0" * 32
    out = run(
        tmp_path,
        "--mlflow",
        "e",
        CHAINRUN_RUN_ID="chain-1a2b3c",
        MLFLOW_RUN_CONTEXT=json.dumps({"chainrun.run_id": "chain-1a2b3c"}),
        MLFLOW_RUN_ID=gone,
        **store,
    )
    said = [line for line in out.splitlines() if "chainrun: cannot continue" in line]
    assert len(said) == 1, out
    assert f"chainrun: cannot continue the chain's MLflow run {gone} (MlflowException: " in said[0]
    for name, value in store.items():
        monkeypatch.setenv(name, value)
    (own,) = mlflow.search_runs(search_all_experiments=True, output_format="list")
    assert own.data.tags["chainrun.run_id"] == "chain-1a2b3c" and own.info.run_id != gone
    assert len(mlflow.MlflowClient().get_metric_history(own.info.run_id, "train_loss")) == 36
