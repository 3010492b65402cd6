"""The TensorFlow helper: bitwise-exact resume, the sidecar as commit point, verified fallback."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import keras
import numpy as np
import pytest
import tensorflow as tf
from ckpt_support import describe, no_chainrun_env, restore_signal_handlers, run_script, script_env  # noqa: F401

import chainrun.checkpoint._progress as progress_module
import chainrun.checkpoint.tensorflow as tf_module
from chainrun.checkpoint import SIDECAR_NAME, CheckpointError, CheckpointWarning, SegmentClock, load_progress
from chainrun.checkpoint.tensorflow import MANIFEST_SUFFIX, Checkpointer

pytestmark = pytest.mark.tensorflow


@pytest.fixture(autouse=True)
def collect_what_tensorflow_left() -> Iterator[None]:
    """TensorFlow logs a warning when a restore's status object is collected with values
    unrestored (a mismatched model's): collect it here, while this test's output is
    captured, not in whichever test of this worker next triggers a collection (a full run
    saw it land in an in-process `chainrun submit`'s stderr)."""
    yield
    gc.collect()


def test_keras_run_interrupted_mid_epoch_ends_bitwise_equal_to_an_uninterrupted_run(tmp_path: Path) -> None:
    """Stop at epoch 1 batch 5 by SIGUSR1, resume in a new process: every model and optimizer variable is equal."""
    base = run_script("_tf_train.py", "--dir", tmp_path / "base", "--out", tmp_path / "base.npz")
    assert base.returncode == 0 and "finished" in base.stdout, describe(base)
    env = script_env(CHAINRUN_SIGNAL="USR1", CHAINRUN_SEGMENT="1")
    common = ["--dir", tmp_path / "ckpt", "--out", tmp_path / "resumed.npz"]
    first = run_script("_tf_train.py", *common, "--signal-at", "1:4", env=env)
    assert first.returncode == 0 and "stopped at epoch 1 step 5" in first.stdout, describe(first)
    progress = load_progress(tmp_path / "ckpt")
    assert progress is not None and (progress["epoch"], progress["step"], progress["segment"]) == (1, 5, 1)
    second = run_script("_tf_train.py", *common, env=env)
    assert second.returncode == 0 and "finished" in second.stdout, describe(second)
    assert f"resumed from {progress['file']} (epoch 1) at step 5" in second.stdout
    expected, resumed = np.load(tmp_path / "base.npz"), np.load(tmp_path / "resumed.npz")
    assert sorted(expected.files) == sorted(resumed.files) and len(expected.files) > 10
    differing = [k for k in expected.files if not np.array_equal(expected[k], resumed[k])]
    assert differing == []


def make_model() -> tuple[keras.Model, keras.optimizers.Optimizer]:
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dropout(0.5), keras.layers.Dense(2)]
    )
    return model, keras.optimizers.Adam(0.01)


def train_a_step(model: keras.Model, optimizer: keras.optimizers.Optimizer) -> None:
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(model(tf.ones((2, 4)), training=True)))
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))


def checkpointer(
    directory: Path, **kwargs: Any
) -> tuple[keras.Model, keras.optimizers.Optimizer, Checkpointer]:
    model, optimizer = make_model()
    return (
        model,
        optimizer,
        Checkpointer(
            directory, model=model, optimizer=optimizer, clock=SegmentClock(install=False), **kwargs
        ),
    )


def values(variables: list[Any]) -> list[np.ndarray]:
    return [v.numpy() for v in variables]


def recording(events: list[str], label: str, real: Callable[..., Any]) -> Callable[..., Any]:
    """``real``, noting ``label <file name>`` in ``events`` before each call."""

    def wrapper(path: str, *args: Any, **kwargs: Any) -> Any:
        events.append(f"{label} {os.path.basename(path)}")
        return real(path, *args, **kwargs)

    return wrapper


def test_save_makes_every_file_durable_before_the_manifest_and_the_sidecar_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fsync of each TensorFlow file and of the directory, then the manifest, then the sidecar (the commit point)."""
    _, _, ckpt = checkpointer(tmp_path / "ckpt")
    events: list[str] = []
    monkeypatch.setattr(tf_module, "fsync_file", recording(events, "fsync", tf_module.fsync_file))
    monkeypatch.setattr(tf_module, "fsync_dir", recording(events, "fsync", tf_module.fsync_dir))
    monkeypatch.setattr(tf_module, "atomic_write", recording(events, "write", tf_module.atomic_write))
    monkeypatch.setattr(
        progress_module, "atomic_write", recording(events, "write", progress_module.atomic_write)
    )
    saved = ckpt.save(1, 0)
    stem = saved.file[: -len(MANIFEST_SUFFIX)]
    files = sorted(e for e in events if e.startswith(f"fsync {stem}"))
    assert files == [f"fsync {stem}.data-00000-of-00001", f"fsync {stem}.index"]
    order = [events.index(e) for e in (*files, "fsync ckpt", f"write {saved.file}", f"write {SIDECAR_NAME}")]
    assert max(order[:2]) < order[2] < order[3] < order[4], events
    assert events[-1] == "write checkpoint", "TensorFlow's own state file comes after the commit"


def test_crash_before_the_sidecar_leaves_the_previous_checkpoint_in_force(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save that dies after writing its files but before the sidecar is not resumed from, and is cleaned up later."""
    model, optimizer, ckpt = checkpointer(tmp_path)
    train_a_step(model, optimizer)
    first = ckpt.save(1, 0)
    committed_values = values(model.variables)
    train_a_step(model, optimizer)

    def die(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt  # stands in for the kill

    monkeypatch.setattr(progress_module, "atomic_write", die)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(2, 0)
    monkeypatch.undo()
    assert load_progress(tmp_path)["file"] == first.file  # type: ignore[index]
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith("ckpt-000002-e0002-")]
    assert len(leftovers) >= 3, "the uncommitted save's index, data and manifest are there"

    model2, _, ckpt2 = checkpointer(tmp_path)
    resume = ckpt2.restore()
    assert resume.file == first.file and not resume.fell_back
    assert all(np.array_equal(a, b) for a, b in zip(committed_values, values(model2.variables)))
    ckpt2.save(3, 0)
    assert set(leftovers).isdisjoint(os.listdir(tmp_path)), "leftovers are removed by the next save"


def test_corrupt_data_file_of_the_newest_checkpoint_falls_back_with_a_warning(tmp_path: Path) -> None:
    """A flipped byte in a .data file is caught by the manifest's sha256; the previous checkpoint is used."""
    model, optimizer, ckpt = checkpointer(tmp_path)
    train_a_step(model, optimizer)
    first = ckpt.save(1, 0)
    first_values = values(model.variables)
    train_a_step(model, optimizer)
    newest = ckpt.save(2, 0)
    data_file = tmp_path / (newest.file[: -len(MANIFEST_SUFFIX)] + ".data-00000-of-00001")
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data_file.write_bytes(bytes(raw))

    model2, _, ckpt2 = checkpointer(tmp_path)
    with pytest.warns(
        CheckpointWarning, match=rf"resumed from {first.file}.*data-00000-of-00001 does not match"
    ):
        resume = ckpt2.restore()
    assert resume.fell_back and resume.epoch == 1
    assert all(np.array_equal(a, b) for a, b in zip(first_values, values(model2.variables)))


def test_no_usable_checkpoint_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    """With every checkpoint's files gone, restore raises."""
    _, _, ckpt = checkpointer(tmp_path)
    saved = ckpt.save(1, 0)
    os.unlink(tmp_path / (saved.file[: -len(MANIFEST_SUFFIX)] + ".index"))
    _, _, ckpt2 = checkpointer(tmp_path)
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        ckpt2.restore()


def test_optimizer_state_and_iterations_resume_exactly(tmp_path: Path) -> None:
    """Adam's slots and iteration count come back bitwise, although the new optimizer had never run."""
    model, optimizer, ckpt = checkpointer(tmp_path)
    for _ in range(3):
        train_a_step(model, optimizer)
    ckpt.save(0, 3)
    _, optimizer2, ckpt2 = checkpointer(tmp_path)
    assert ckpt2.restore().step == 3
    assert int(optimizer2.iterations.numpy()) == 3
    assert all(
        np.array_equal(a, b) for a, b in zip(values(optimizer.variables), values(optimizer2.variables))
    )


def test_dropout_seed_state_is_part_of_the_checkpoint(tmp_path: Path) -> None:
    """Keras keeps dropout randomness in a seed-generator variable TensorFlow's graph misses; it is restored too."""
    model, optimizer, ckpt = checkpointer(tmp_path)
    train_a_step(model, optimizer)
    ckpt.save(0, 1)
    after_save = model(tf.ones((8, 4)), training=True).numpy()
    model2, _, ckpt2 = checkpointer(tmp_path)
    ckpt2.restore()
    assert np.array_equal(model2(tf.ones((8, 4)), training=True).numpy(), after_save)


def test_model_that_does_not_match_the_checkpoint_is_an_error(tmp_path: Path) -> None:
    """A changed architecture is reported, never half-restored."""
    _, _, ckpt = checkpointer(tmp_path)
    ckpt.save(1, 0)
    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(7), keras.layers.Dense(2)])
    with pytest.raises(CheckpointError, match="does not match the objects given"):
        Checkpointer(tmp_path, model=other, clock=SegmentClock(install=False)).restore()


def test_retention_deletes_every_file_of_old_checkpoints(tmp_path: Path) -> None:
    """keep=2: the index, data, manifest and companion files of older saves are all removed."""
    _, _, ckpt = checkpointer(tmp_path, keep=2)
    names = [ckpt.save(i, 0).file for i in range(1, 5)]
    left = {n.split(".")[0] for n in os.listdir(tmp_path) if n.startswith("ckpt-")}
    assert left == {names[2].split(".")[0], names[3].split(".")[0]}


def test_tensorflow_latest_checkpoint_names_the_committed_one(tmp_path: Path) -> None:
    """TensorFlow's own tools (tf.train.latest_checkpoint) see what the sidecar names."""
    _, _, ckpt = checkpointer(tmp_path)
    ckpt.save(1, 0)
    saved = ckpt.save(2, 0)
    assert tf.train.latest_checkpoint(str(tmp_path)) == str(tmp_path / saved.file[: -len(MANIFEST_SUFFIX)])


def test_steps_skip_the_batches_already_trained_in_the_resumed_epoch(tmp_path: Path) -> None:
    """A tf.data pipeline resumes at the next batch, numbered on."""
    _, _, ckpt = checkpointer(tmp_path)
    ckpt.save(2, 3)
    _, _, ckpt2 = checkpointer(tmp_path)
    ckpt2.restore()
    batches = tf.data.Dataset.range(10).batch(2)
    assert [(s, b.numpy().tolist()) for s, b in ckpt2.steps(batches, 2)] == [(3, [6, 7]), (4, [8, 9])]
    assert [s for s, _ in ckpt2.steps(batches, 3)] == [0, 1, 2, 3, 4]


def test_extras_and_metrics_come_back(tmp_path: Path) -> None:
    """JSON extras round-trip; tensor metrics are stored as numbers."""
    _, _, ckpt = checkpointer(tmp_path)
    ckpt.save(1, 0, metrics={"loss": tf.constant(0.5)}, extras={"best": [1, 2]})
    _, _, ckpt2 = checkpointer(tmp_path)
    resume = ckpt2.restore()
    assert dict(resume.extras) == {"best": [1, 2]} and dict(resume.metrics) == {"loss": 0.5}
