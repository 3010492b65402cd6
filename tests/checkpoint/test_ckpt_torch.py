"""The PyTorch helper: exact resume across processes, verified fallback, async saves, signals."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ckpt_support import HERE, describe, no_chainrun_env, restore_signal_handlers, run_script, script_env  # noqa: F401
from torch.utils.data import DataLoader, Dataset, TensorDataset

import chainrun.checkpoint._store as store_module
from chainrun.checkpoint import (
    SIDECAR_NAME,
    CheckpointError,
    CheckpointWarning,
    SegmentClock,
    file_digest,
    load_progress,
)
from chainrun.checkpoint.torch import FORMAT, Checkpointer, ResumableSampler, capture_rng, restore_rng

pytestmark = pytest.mark.torch


# -- exact resume in new processes -------------------------------------------------------------


def assert_same_state(a: Any, b: Any, where: str = "") -> None:
    """Bitwise equality of nested state (tensors with torch.equal)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where} keys differ"
        for k in a:
            assert_same_state(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where} lengths differ"
        for i, (u, v) in enumerate(zip(a, b)):
            assert_same_state(u, v, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


_baselines: dict[str, dict[str, Any]] = {}


def uninterrupted(sampler: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The final state of an uninterrupted run (once per sampler kind)."""
    if sampler not in _baselines:
        root = tmp_path_factory.mktemp(f"baseline-{sampler}")
        result = run_script(
            "_torch_train.py", "--dir", root / "ckpt", "--out", root / "out.pt", "--sampler", sampler
        )
        assert result.returncode == 0 and "finished" in result.stdout, describe(result)
        _baselines[sampler] = torch.load(root / "out.pt", weights_only=True)
    return _baselines[sampler]


@pytest.mark.parametrize(
    ("sampler", "workers", "extra"),
    [
        ("resumable", 0, []),
        ("shuffle", 0, []),
        ("resumable", 2, ["--async-save"]),
    ],
)
def test_run_interrupted_mid_epoch_by_the_signal_ends_equal_to_an_uninterrupted_run(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, sampler: str, workers: int, extra: list[str]
) -> None:
    """Stop at epoch 1 batch 5 by SIGUSR1, resume in a new process: weights, optimizer, schedule, scaler, RNG all equal."""
    expected = uninterrupted(sampler, tmp_path_factory)
    common = [
        "--dir",
        tmp_path / "ckpt",
        "--out",
        tmp_path / "out.pt",
        "--sampler",
        sampler,
        "--workers",
        workers,
        *extra,
    ]
    env = script_env(
        CHAINRUN_SIGNAL="USR1", CHAINRUN_SEGMENT="1", CHAINRUN_CHECKPOINT_DIR=str(tmp_path / "ckpt")
    )
    first = run_script("_torch_train.py", *common, "--signal-at", "1:4", env=env)
    assert first.returncode == 0 and "stopped at epoch 1 step 5" in first.stdout, describe(first)
    progress = load_progress(tmp_path / "ckpt")
    assert progress is not None and (
        progress["epoch"],
        progress["step"],
        progress["done"],
        progress["segment"],
    ) == (1, 5, False, 1)
    assert not (tmp_path / "out.pt").exists()

    env["CHAINRUN_SEGMENT"] = "2"
    second = run_script("_torch_train.py", *common, env=env)
    assert second.returncode == 0 and "finished" in second.stdout, describe(second)
    assert f"resumed from {progress['file']} (epoch 1) at step 5" in second.stdout
    assert_same_state(expected, torch.load(tmp_path / "out.pt", weights_only=True))
    final = load_progress(tmp_path / "ckpt")
    assert final is not None and (final["epoch"], final["done"], final["segment"]) == (3, True, 2)


@pytest.mark.parametrize("sig", ["USR1", "TERM"])
def test_signal_from_outside_at_a_random_moment_still_resumes_exactly(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, sig: str
) -> None:
    """Wherever the signal lands (USR1 from chainrun or TERM at the kill), save, exit 0, resume to the same end."""
    expected = uninterrupted("resumable", tmp_path_factory)
    common = ["--dir", tmp_path / "ckpt", "--out", tmp_path / "out.pt"]
    env = script_env(CHAINRUN_SIGNAL=sig)
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "_torch_train.py"), *map(str, common), "--step-sleep", "0.02"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    while "training" not in proc.stdout.readline():
        assert proc.poll() is None, proc.communicate()
    time.sleep(random.Random(sig).uniform(0.1, 0.5))
    proc.send_signal(signal.Signals["SIG" + sig])
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "stopped at epoch" in out, out
    second = run_script("_torch_train.py", *common, env=env)
    assert second.returncode == 0 and "finished" in second.stdout, describe(second)
    assert_same_state(expected, torch.load(tmp_path / "out.pt", weights_only=True))


# -- restore: verification and fallback -----------------------------------------------------------


def small_setup(
    directory: Path, **kwargs: Any
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Checkpointer]:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = Checkpointer(
        directory, model=model, optimizer=optimizer, clock=SegmentClock(install=False), **kwargs
    )
    return model, optimizer, ckpt


def train_a_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(5, 4)).square().sum().backward()
    optimizer.step()


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_restore_falls_back_to_the_previous_checkpoint_when_the_newest_is_corrupt(tmp_path: Path) -> None:
    """A corrupt newest checkpoint: the weights of the previous one are loaded, and a warning says which and why."""
    model, optimizer, ckpt = small_setup(tmp_path)
    train_a_step(model, optimizer)
    first = ckpt.save(1, 0)
    weights_then = model.weight.detach().clone()
    train_a_step(model, optimizer)
    newest = ckpt.save(2, 0)
    assert first is not None and newest is not None
    flip_a_byte(Path(newest.path))

    model2, _, ckpt2 = small_setup(tmp_path)
    with pytest.warns(CheckpointWarning, match=rf"resumed from {first.file}.*{newest.file}: sha256"):
        resume = ckpt2.restore()
    assert (resume.file, resume.epoch, resume.fell_back) == (first.file, 1, True)
    assert torch.equal(model2.weight, weights_then)


def test_restore_with_no_usable_checkpoint_raises_instead_of_starting_fresh(tmp_path: Path) -> None:
    """All checkpoints corrupt: CheckpointError, and the model is left untouched."""
    _, _, ckpt = small_setup(tmp_path)
    saved = ckpt.save(1, 0)
    assert saved is not None
    flip_a_byte(Path(saved.path))
    model2, _, ckpt2 = small_setup(tmp_path)
    before = model2.weight.detach().clone()
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        ckpt2.restore()
    assert torch.equal(model2.weight, before)


def test_restore_starts_fresh_over_unusable_checkpoints_only_when_asked(tmp_path: Path) -> None:
    """allow_fresh=True: a warned fresh start."""
    _, _, ckpt = small_setup(tmp_path)
    saved = ckpt.save(1, 0)
    assert saved is not None
    os.unlink(saved.path)
    _, _, ckpt2 = small_setup(tmp_path)
    with pytest.warns(CheckpointWarning, match="starting fresh"):
        assert ckpt2.restore(allow_fresh=True).fresh


def test_restore_of_a_checkpoint_without_an_object_is_an_error(tmp_path: Path) -> None:
    """A checkpoint saved without a scheduler cannot silently leave the scheduler at its start."""
    _, _, ckpt = small_setup(tmp_path)
    ckpt.save(1, 0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    other = Checkpointer(
        tmp_path, model=model, optimizer=optimizer, scheduler=scheduler, clock=SegmentClock(install=False)
    )
    with pytest.raises(CheckpointError, match="no state for 'scheduler'"):
        other.restore()


def test_gpu_checkpoint_restores_on_a_cpu_only_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tensors tagged cuda:0 (a GPU run's checkpoint) load on CPU through map_location."""
    model, optimizer, ckpt = small_setup(tmp_path)
    train_a_step(model, optimizer)
    with monkeypatch.context() as patch:
        patch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        saved = ckpt.save(1, 0)
    assert saved is not None
    if not torch.cuda.is_available():  # what the helper protects against
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(saved.path, weights_only=True)
    for location in ("cpu", None):
        model2, _, ckpt2 = small_setup(tmp_path, map_location=location)
        ckpt2.restore()
        assert model2.weight.device.type == "cpu" and torch.equal(model2.weight, model.weight)


def test_checkpoint_holds_rng_states_extras_and_other_stateful_objects(tmp_path: Path) -> None:
    """Extras and stateful objects round-trip; restore rewinds Python, NumPy and torch RNGs."""
    model, optimizer, _ = small_setup(tmp_path)
    ema = torch.optim.swa_utils.AveragedModel(model)
    ckpt = Checkpointer(
        tmp_path, model=model, optimizer=optimizer, stateful={"ema": ema}, clock=SegmentClock(install=False)
    )
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    ckpt.save(2, 3, extras={"best": 0.75, "history": [1, 2]})
    draws = (torch.rand(3), random.random(), np.random.rand())
    model2, optimizer2, _ = small_setup(tmp_path)
    ema2 = torch.optim.swa_utils.AveragedModel(model2)
    resume = Checkpointer(
        tmp_path,
        model=model2,
        optimizer=optimizer2,
        stateful={"ema": ema2},
        clock=SegmentClock(install=False),
    ).restore()
    assert dict(resume.extras) == {"best": 0.75, "history": [1, 2]}
    assert (resume.epoch, resume.step) == (2, 3)
    assert (
        torch.equal(torch.rand(3), draws[0]) and random.random() == draws[1] and np.random.rand() == draws[2]
    )
    assert torch.equal(ema2.n_averaged, ema.n_averaged)


def test_metrics_survive_a_save_mid_epoch_in_the_sidecar_and_the_resume(tmp_path: Path) -> None:
    """The walltime signal's save mid-epoch has no metrics at hand: the last ones are carried
    into the sidecar, and a resume from that save gets them back."""
    _, _, ckpt = small_setup(tmp_path)
    ckpt.save(1, 0, metrics={"loss": 0.5})
    ckpt.save(1, 4)
    ckpt.wait()
    progress = load_progress(tmp_path)
    assert progress is not None and (progress["step"], progress["metrics"]) == (4, {"loss": 0.5})
    _, _, again = small_setup(tmp_path)
    resume = again.restore()
    assert (resume.step, dict(resume.metrics)) == (4, {"loss": 0.5})


def test_capture_and_restore_rng_round_trip() -> None:
    """capture_rng/restore_rng replay the same random numbers in every generator."""
    state = capture_rng()
    first = (torch.randn(4), random.random(), np.random.rand(2))
    restore_rng(state)
    again = (torch.randn(4), random.random(), np.random.rand(2))
    assert torch.equal(first[0], again[0]) and first[1] == again[1] and np.array_equal(first[2], again[2])


def test_saved_file_is_a_plain_torch_checkpoint(tmp_path: Path) -> None:
    """Users can torch.load a chainrun checkpoint without chainrun (weights_only, too)."""
    model, _, ckpt = small_setup(tmp_path)
    saved = ckpt.save(4, 0)
    assert saved is not None
    payload = torch.load(saved.path, weights_only=True)
    assert payload["format"] == FORMAT and payload["epoch"] == 4
    assert torch.equal(payload["objects"]["model"]["weight"], model.weight)


# -- the data order --------------------------------------------------------------------------------


def test_resumable_sampler_order_depends_only_on_seed_and_epoch() -> None:
    """Two samplers with one seed agree per epoch, epochs differ, and the global RNG is not touched."""
    a, b = ResumableSampler(50, seed=3), ResumableSampler(50, seed=3)
    state = torch.get_rng_state()
    a.set_epoch(4)
    b.set_epoch(4)
    assert list(a) == list(b) and sorted(a) == list(range(50))
    b.set_epoch(5)
    assert list(a) != list(b)
    assert torch.equal(torch.get_rng_state(), state)


def test_resumable_sampler_start_skips_the_first_samples_of_the_epoch() -> None:
    """set_epoch(e, start) yields the tail of epoch e's order and reports its length."""
    sampler = ResumableSampler(20, seed=1)
    sampler.set_epoch(2)
    whole = list(sampler)
    sampler.set_epoch(2, start=8)
    assert list(sampler) == whole[8:] and len(sampler) == 12
    with pytest.raises(ValueError):
        sampler.set_epoch(2, start=21)


@pytest.mark.parametrize("shuffle_kind", ["resumable", "random"])
def test_steps_continue_an_epoch_with_the_batches_not_yet_seen(tmp_path: Path, shuffle_kind: str) -> None:
    """After a mid-epoch save, steps() yields the rest of the same epoch order, numbered on."""
    dataset = TensorDataset(torch.arange(40))

    def loader() -> DataLoader[Any]:
        if shuffle_kind == "resumable":
            return DataLoader(dataset, batch_size=4, sampler=ResumableSampler(dataset, seed=9))
        return DataLoader(dataset, batch_size=4, shuffle=True)

    torch.manual_seed(0)
    _, _, ckpt = small_setup(tmp_path)
    ckpt.restore()
    seen = []
    for step, (batch,) in ckpt.steps(loader(), 0):
        seen.append((step, batch.tolist()))
        if step == 3:
            ckpt.save(0, 4)
    _, _, ckpt2 = small_setup(tmp_path)
    assert ckpt2.restore().step == 4
    rest = [(step, batch.tolist()) for step, (batch,) in ckpt2.steps(loader(), 0)]
    assert rest == seen[4:]


# -- async save ----------------------------------------------------------------------------------------


def held_writes(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make the store's writes wait until the returned event is set (30 s at most)."""
    real = store_module.atomic_write
    release = threading.Event()

    def held(*args: Any, **kwargs: Any) -> Any:
        release.wait(timeout=30)
        return real(*args, **kwargs)

    monkeypatch.setattr(store_module, "atomic_write", held)
    return release


def test_async_save_returns_after_the_copy_and_writes_in_the_background(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """save() does not wait for the disk; wait() returns the committed save."""
    _, _, ckpt = small_setup(tmp_path, async_save=True)
    release = held_writes(monkeypatch)
    assert ckpt.save(1, 0) is None
    assert load_progress(tmp_path) is None, "save() returned only after the write"
    release.set()
    saved = ckpt.wait()
    assert saved is not None and load_progress(tmp_path)["file"] == saved.file  # type: ignore[index]


def test_async_save_snapshots_the_state_before_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Weights changed right after save() returns do not leak into the checkpoint being written."""
    model, _, ckpt = small_setup(tmp_path, async_save=True)
    release = held_writes(monkeypatch)
    before = model.weight.detach().clone()
    ckpt.save(1, 0)
    with torch.no_grad():
        model.weight.add_(100.0)
    release.set()
    saved = ckpt.wait()
    assert saved is not None
    assert torch.equal(torch.load(saved.path, weights_only=True)["objects"]["model"]["weight"], before)


class Views:
    """A stateful object whose state holds a transposed and a conjugated view, integers and a plain tensor."""

    def __init__(self) -> None:
        self.grid = torch.arange(12.0).reshape(3, 4)
        self.counts = torch.arange(5)
        self.phases = torch.complex(torch.arange(3.0), torch.ones(3))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            "transposed": self.grid.t(),
            "counts": self.counts,
            "grid": self.grid,
            "conjugated": self.phases.conj(),  # a lazy view: the conjugation is a flag, not data
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.grid.copy_(state["grid"])
        self.counts.copy_(state["counts"])


def test_async_save_snapshots_strided_and_integer_tensors_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Views, integer and complex tensors and contiguous ones are all copied as they were when save() returned."""
    views = Views()
    ckpt = Checkpointer(
        tmp_path, stateful={"views": views}, clock=SegmentClock(install=False), async_save=True
    )
    release = held_writes(monkeypatch)
    expected = {k: v.clone() for k, v in views.state_dict().items()}
    ckpt.save(1, 0)
    views.grid.mul_(-1)
    views.counts.add_(7)
    views.phases.mul_(2)
    release.set()
    saved = ckpt.wait()
    assert saved is not None
    stored = torch.load(saved.path, weights_only=True)["objects"]["views"]
    for key, value in expected.items():
        assert torch.equal(stored[key], value), key


def test_async_saves_are_handed_to_one_long_lived_thread(tmp_path: Path) -> None:
    """Each async save is queued to the same background thread; none starts a thread of its own."""
    _, _, ckpt = small_setup(tmp_path, async_save=True)

    def save_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "chainrun-save"]

    before = set(save_threads())
    ckpt.save(1, 0)
    ckpt.wait()
    started = [t for t in save_threads() if t not in before]
    assert len(started) == 1, "no background thread is waiting for the next save"
    for epoch in (2, 3):
        ckpt.save(epoch, 0)
        ckpt.wait()
        assert [t for t in save_threads() if t not in before] == started


def test_async_save_reuses_its_host_buffers_and_keeps_tied_weights_tied(tmp_path: Path) -> None:
    """A second async save copies into the first one's buffers; a tensor shared twice is staged once."""
    model = torch.nn.Linear(4, 4)
    ckpt = Checkpointer(
        tmp_path, model=model, stateful={"twin": model}, clock=SegmentClock(install=False), async_save=True
    )
    ckpt.save(1, 0)
    ckpt.wait()
    buffers = {k: v.data_ptr() for k, v in ckpt._staging.items()}
    ckpt.save(2, 0)
    saved = ckpt.wait()
    assert saved is not None and {k: v.data_ptr() for k, v in ckpt._staging.items()} == buffers
    objects = torch.load(saved.path, weights_only=True)["objects"]
    assert torch.equal(objects["model"]["weight"], objects["twin"]["weight"])


def test_background_save_failure_is_raised_in_the_training_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed background write is never silent: the next call raises it."""
    _, _, ckpt = small_setup(tmp_path, async_save=True)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OSError("No space left on device")

    monkeypatch.setattr(store_module, "atomic_write", broken)
    ckpt.save(1, 0)
    with pytest.raises(CheckpointError, match="No space left"):
        ckpt.wait()


def test_walltime_signal_finishes_the_pending_async_save_before_should_stop_says_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """should_stop() returns True only once the background save is committed."""
    model = torch.nn.Linear(4, 3)
    ckpt = Checkpointer(tmp_path, model=model, clock=SegmentClock("USR1"), async_save=True)
    release = held_writes(monkeypatch)
    ckpt.save(1, 0)
    os.kill(os.getpid(), signal.SIGUSR1)
    threading.Timer(0.3, release.set).start()  # the write goes on while should_stop() waits
    assert ckpt.should_stop()
    progress = load_progress(tmp_path)
    assert progress is not None and progress["epoch"] == 1
    assert file_digest(tmp_path / progress["file"], progress["sha256_chunk"]).sha256 == progress["sha256"]


def test_pending_async_save_is_finished_before_the_process_exits(tmp_path: Path) -> None:
    """A script that exits right after an async save still leaves it committed."""
    code = f"""
import sys, time, torch
import chainrun.checkpoint._store as store
from chainrun.checkpoint.torch import Checkpointer
real = store.atomic_write
def slow(*a, **k):
    time.sleep(0.5)
    return real(*a, **k)
store.atomic_write = slow
ckpt = Checkpointer({str(tmp_path)!r}, model=torch.nn.Linear(64, 64), async_save=True)
ckpt.save(7, 0)
sys.exit(0)
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=script_env(), timeout=120
    )
    assert result.returncode == 0, result.stderr
    progress = load_progress(tmp_path)
    assert progress is not None and progress["epoch"] == 7
    assert file_digest(tmp_path / progress["file"], progress["sha256_chunk"]).sha256 == progress["sha256"]


# -- signals -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_signal_during_a_save_lets_the_save_finish_and_then_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sig: signal.Signals
) -> None:
    """The signal arrives between write and fsync: the save completes, is committed, and the loop is told to stop."""
    model = torch.nn.Linear(16, 16)
    ckpt = Checkpointer(tmp_path, model=model, clock=SegmentClock(sig))
    real_fsync = os.fsync
    sent: list[bool] = []

    def fsync_with_signal(fd: int) -> None:
        if not sent:
            sent.append(True)
            os.kill(os.getpid(), sig)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_with_signal)
    saved = ckpt.save(0, 3)
    assert sent and saved is not None
    progress = load_progress(tmp_path)
    assert progress is not None and progress["file"] == saved.file
    assert file_digest(saved.path, progress["sha256_chunk"]).sha256 == progress["sha256"]
    assert ckpt.should_stop() and ckpt.clock.received is sig


_WORKER_CLOCK: list[SegmentClock] = []


class SignalsItself(Dataset[tuple[int, bool, int]]):
    """A dataset whose items send the walltime signal to the worker loading them."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple[int, bool, int]:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)
        return index, _WORKER_CLOCK[0].should_stop(), os.getpid()


def test_signal_in_a_dataloader_worker_neither_stops_nor_saves_nor_kills_it(tmp_path: Path) -> None:
    """Workers that receive SIGUSR1 keep loading; their clock copy stays false; nothing is saved."""
    model = torch.nn.Linear(4, 3)
    clock = SegmentClock("USR1")
    _WORKER_CLOCK[:] = [clock]
    ckpt = Checkpointer(tmp_path, model=model, clock=clock)
    loader = DataLoader(SignalsItself(), batch_size=2, num_workers=2, multiprocessing_context="fork")
    items = [item for batch in loader for item in zip(*[t.tolist() for t in batch])]
    assert sorted(i for i, _, _ in items) == list(range(8))
    assert {pid for _, _, pid in items}.isdisjoint({os.getpid()}), "the items must come from worker processes"
    assert not any(stopped for _, stopped, _ in items)
    assert not ckpt.should_stop()
    assert not (tmp_path / SIDECAR_NAME).exists()


def test_checkpointer_without_a_clock_listens_to_the_chainrun_signal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default clock follows CHAINRUN_SIGNAL."""
    monkeypatch.setenv("CHAINRUN_SIGNAL", "USR2")
    ckpt = Checkpointer(tmp_path, model=torch.nn.Linear(2, 2))
    assert not ckpt.should_stop()
    os.kill(os.getpid(), signal.SIGUSR2)
    assert ckpt.should_stop()


def test_objects_without_state_dict_are_refused(tmp_path: Path) -> None:
    """A typo (passing a tensor as the model) is caught at construction."""
    with pytest.raises(TypeError, match="state_dict"):
        Checkpointer(tmp_path, model=torch.zeros(3), clock=SegmentClock(install=False))  # type: ignore[arg-type]


def test_weights_only_refusal_explains_the_fix(tmp_path: Path) -> None:
    """Extras torch.load(weights_only=True) refuses: the error names weights_only=False."""
    _, _, ckpt = small_setup(tmp_path)
    ckpt.save(1, 0, extras={"when": threading.Lock})
    _, _, ckpt2 = small_setup(tmp_path)
    with pytest.raises(CheckpointError, match="weights_only=False"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt2.restore()
    _, _, ckpt3 = small_setup(tmp_path, weights_only=False)
    assert ckpt3.restore().extras["when"] is threading.Lock
