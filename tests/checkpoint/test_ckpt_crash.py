"""Crash consistency: SIGKILL at any moment of a save never leaves a sidecar naming a bad checkpoint.

A child saves in a loop and is killed, 200 times at random moments and more
times on purpose before and after each write, fsync, rename and unlink of the
save. After every kill the sidecar must parse, name a file whose size and
sha256 match and that loads with the right epoch and step; progress never
goes backwards; at most the dead child's one temp file is left (the next child
cleans it up); and retention keeps the directory bounded.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from ckpt_support import HERE, no_chainrun_env, restore_signal_handlers, script_env  # noqa: F401

from chainrun.checkpoint import (
    SIDECAR_NAME,
    CheckpointDir,
    SegmentClock,
    cleanup_temp_files,
    file_digest,
    is_temp_file,
    read_progress,
)
from chainrun.checkpoint._store import read_companion
from chainrun.checkpoint.torch import Checkpointer

TIMED_TRIALS = 200
KEEP = 2  # as in _crash_child.py
PLANNED = [
    f"{func}:{n}:{when}"
    for func in ("write", "fsync", "replace", "unlink")
    for n in (1, 2, 3, 5, 8)
    for when in ("before", "after")
]


class Zygote:
    """The forking parent in _crash_child.py, driven line by line."""

    def __init__(self, mode: str, directory: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "_crash_child.py"), mode, str(directory)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=script_env(),
        )
        assert self.read() == "ready"

    def read(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line:
            raise AssertionError(f"the crash child's parent died (exit {self.proc.poll()})")
        return line

    def trial(self, seed: int, plan: str, kill_after: Optional[float]) -> tuple[int, str]:
        """Run one child; kill it after ``kill_after`` s (or let it kill itself); its status and phase."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"run {seed} {plan}\n")
        self.proc.stdin.flush()
        pid = int(self.read().split()[1])
        time.sleep(kill_after if kill_after is not None else 0)
        if kill_after is not None:
            os.kill(pid, signal.SIGKILL)
        watchdog = time.monotonic() + 20
        while True:  # a planned self-kill happens within a few saves; never hang the suite
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            if time.monotonic() > watchdog:
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.002)
        _, status, phase = self.read().split()
        return int(status), phase

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(30)


def load_core(path: str) -> tuple[int, int]:
    """Read a core payload (see _crash_child.py) the way a loader would, checking its own digest."""
    data = Path(path).read_bytes()
    content, digest = data[:-32], data[-32:]
    if hashlib.sha256(content).digest() != digest:
        raise ValueError("payload digest mismatch")
    trailer = json.loads(content[-65:-1])
    return trailer["epoch"], trailer["step"]


def check_core(directory: Path, progress: dict[str, Any]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would be a failure here
        resume, position = CheckpointDir(directory, prefix="ckpt", suffix=".bin").restore(load_core)
    assert resume.file == progress["file"]
    assert position == (progress["epoch"], progress["step"])


def make_torch_check() -> Callable[[Path, dict[str, Any]], None]:
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 256))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def check(directory: Path, progress: dict[str, Any]) -> None:
        ckpt = Checkpointer(directory, model=model, optimizer=optimizer, clock=SegmentClock(install=False))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            resume = ckpt.restore()
        assert (resume.file, resume.epoch, resume.step) == (
            progress["file"],
            progress["epoch"],
            progress["step"],
        )
        expected = float(progress["epoch"] * 10 + progress["step"])
        assert bool((model[0].weight == expected).all()), "the weights are not the ones saved under this name"

    return check


def check_after_kill(
    directory: Path, check: Callable[[Path, dict[str, Any]], None], last: tuple[int, int]
) -> tuple[int, int]:
    """The invariants after one kill; returns the committed position."""
    names = os.listdir(directory)
    temps = [n for n in names if is_temp_file(n)]
    assert len(temps) <= 1, f"temp files pile up: {temps}"
    if SIDECAR_NAME not in names:
        assert last == (-1, -1), "the sidecar disappeared"
        return last
    progress = read_progress((directory / SIDECAR_NAME).read_bytes())
    path = directory / progress["file"]
    assert path.exists(), f"the sidecar names {progress['file']}, which does not exist"
    assert path.stat().st_size == progress["size"]
    assert file_digest(path, progress["sha256_chunk"]).sha256 == progress["sha256"]
    for name in names:  # a companion only ever vouches for a complete file
        main = name[: -len(".sha256")]
        if name.endswith(".sha256") and (directory / main).exists():
            vouched = read_companion(str(directory / name), main)
            assert vouched is not None, f"{name} is malformed"
            assert file_digest(directory / main, vouched.chunk)[:2] == vouched[:2], (
                f"{name} does not match its file"
            )
    check(directory, progress)
    position = (progress["epoch"], progress["step"])
    assert position >= last, f"progress went backwards from {last} to {position}"
    # Each child starts from at most KEEP (its first save drops uncommitted leftovers and prunes),
    # then adds one: in flight, or committed with the kill before or during retention.
    checkpoints = [n for n in names if n.startswith("ckpt-") and n.endswith((".bin", ".pt"))]
    assert len(checkpoints) <= KEEP + 1, f"retention let checkpoints pile up: {sorted(checkpoints)}"
    return position


@pytest.mark.parametrize(
    ("mode", "timed_trials", "max_delay"),
    [("core", TIMED_TRIALS, 0.06), pytest.param("torch", 60, 0.08, marks=pytest.mark.torch)],
)
def test_sigkill_at_any_moment_leaves_a_loadable_committed_checkpoint(
    tmp_path: Path, mode: str, timed_trials: int, max_delay: float
) -> None:
    """Hundreds of SIGKILLs across write, fsync, rename and unlink: the sidecar always names a good checkpoint."""
    check = check_core if mode == "core" else make_torch_check()
    rng = random.Random(1234)
    plans = [("timed", rng.uniform(0.0, max_delay)) for _ in range(timed_trials)] + [
        (p, None) for p in PLANNED
    ]
    rng.shuffle(plans)
    zygote = Zygote(mode, tmp_path)
    phases: Counter[str] = Counter()
    last = (-1, -1)
    try:
        for i, (plan, delay) in enumerate(plans):
            status, phase = zygote.trial(i, plan, delay)
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
                f"trial {i} ({plan}): the saving child ended with status {status}, not by SIGKILL"
            )
            phases[phase if plan == "timed" else plan.split(":")[0]] += 1
            last = check_after_kill(tmp_path, check, last)
    finally:
        zygote.close()
    assert last > (0, 0), "no save ever committed"
    assert {"write", "fsync", "replace", "unlink"} <= set(phases), phases
    cleanup_temp_files(tmp_path)
    assert [n for n in os.listdir(tmp_path) if is_temp_file(n)] == []
