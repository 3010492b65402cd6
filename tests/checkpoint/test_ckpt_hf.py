"""chainrun.checkpoint.hf with the real ``transformers`` package: examples/hf-trainer/train.py (a
tiny GPT-2 built from a config) stopped by its callback's clock several times logs the same
loss at every step, and ends with the same weights, as one uninterrupted run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ckpt_support import REPO, describe, no_chainrun_env, restore_signal_handlers, script_env  # noqa: F401

pytest.importorskip("transformers")
pytestmark = pytest.mark.torch

EXAMPLE = REPO / "examples" / "hf-trainer" / "train.py"


def run(where: Path, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(where / "train.py"), "--epochs", "2", *args],
        cwd=where,
        capture_output=True,
        text=True,
        env=script_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"),
        timeout=240,
    )
    assert result.returncode == 0, describe(result)
    return result.stdout


def test_stopped_segments_log_the_same_losses_as_an_uninterrupted_run(tmp_path: Path) -> None:
    ref, chain = tmp_path / "ref", tmp_path / "chain"
    for d in (ref, chain):
        d.mkdir()
        shutil.copy(EXAMPLE, d / "train.py")
    run(ref, "--out", "final.json")
    ran = 0
    while not (chain / "final.json").exists():
        out = run(chain, "--out", "final.json", "--stop-after", "5")  # 12 steps an epoch, 24 in all
        ran += 1
        assert ran <= 8, out
    assert ran == 5
    expected, got = (
        json.loads((ref / "final.json").read_text()),
        json.loads((chain / "final.json").read_text()),
    )
    assert len(expected["losses"]) == 24
    assert got == expected  # the loss of every step, and the sum of the final weights, exactly
    progress = json.loads((chain / "checkpoints" / "chainrun-progress.json").read_text())
    assert (progress["epoch"], progress["step"], progress["done"]) == (2, 0, True)
    assert "loss" in progress["metrics"]


def test_newest_checkpoint_is_never_a_partly_written_one(tmp_path: Path) -> None:
    from chainrun.checkpoint import CheckpointError
    from chainrun.checkpoint.hf import newest_checkpoint

    assert newest_checkpoint(tmp_path / "checkpoints") is None
    shutil.copy(EXAMPLE, tmp_path / "train.py")
    run(tmp_path, "--stop-after", "5")
    out = tmp_path / "checkpoints"
    progress = json.loads((out / "chainrun-progress.json").read_text())
    assert (progress["epoch"], progress["step"], progress["done"]) == (0, 5, False)
    assert newest_checkpoint(out) == str(out / "checkpoint-5")
    # the Trainer was killed writing checkpoint-9: a directory with no committed manifest
    partial = out / "checkpoint-9"
    shutil.copytree(out / "checkpoint-5", partial)
    (partial / "model.safetensors").write_bytes(b"cut short")
    assert newest_checkpoint(out) == str(out / "checkpoint-5")
    # a committed checkpoint damaged afterwards, with no older one: an error, not a fresh start
    (out / "checkpoint-5" / "model.safetensors").write_bytes(b"damaged")
    with pytest.raises(CheckpointError, match="does not match its size and sha256"):
        newest_checkpoint(out)
