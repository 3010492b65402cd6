"""Exact resume for TensorFlow/Keras custom loops, on top of ``tf.train.Checkpoint``.

``tf.train.Checkpoint.write`` (what ``CheckpointManager.save`` calls) writes an
``.index`` and one or more ``.data-*`` files and fsyncs none of them. This
helper makes them durable (fsync each, then the directory), records their
sizes and sha256 in a small manifest (``<stem>.chainrun.json``, written
atomically) and only then writes chainrun's sidecar naming that manifest: the
sidecar is the commit point, so a kill at any moment leaves the previous
checkpoint in force. Restore verifies every file. Besides the objects you pass
(a Keras model and optimizer, say), a checkpoint holds every variable those
Keras objects own (dropout seed states included), the global ``tf.random``
generator (as set when the Checkpointer is made), the Python and NumPy RNG
states, the epoch, the step and extras. TensorFlow's own ``checkpoint`` state
file is updated after each commit, so ``tf.train.latest_checkpoint(directory)``
names the committed checkpoint.

Imported in a chain, it seeds Python's, NumPy's and TensorFlow's random numbers
(``tf.random.set_seed``) from the chain's ``CHAINRUN_SEED`` unless the script has set
TensorFlow's global seed already (see ``_seed``): seeding of the script's own after the
import wins, and ``restore()`` puts back the states a checkpoint holds.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Optional, Union

import tensorflow as tf

from chainrun.checkpoint._atomic import atomic_write, fsync_dir, fsync_file
from chainrun.checkpoint._clock import SegmentClock
from chainrun.checkpoint._digest import sha256_file
from chainrun.checkpoint._seed import chain_seed, seed_python_and_numpy
from chainrun.checkpoint._store import CheckpointDir, CheckpointError, Resume, Saved

FORMAT = "chainrun-tensorflow"
FORMAT_VERSION = 1
MANIFEST_SUFFIX = ".chainrun.json"
TF_STATE_NAME = "checkpoint"

__all__ = ["FORMAT", "MANIFEST_SUFFIX", "Checkpointer"]


class Checkpointer:
    """Saves and restores TensorFlow objects with chainrun's atomic, verified commit.

    Pass the objects as keywords (``model=model, optimizer=optimizer``), as
    for ``tf.train.Checkpoint``, or an existing ``checkpoint=``. Build the model
    (give it an ``Input`` or call it once) before making the Checkpointer: an
    optimizer that has no variables yet is then built for the model's trainable
    variables, so that its slots are saved and restored from the start. ``directory`` defaults to
    ``CHAINRUN_CHECKPOINT_DIR`` (else ``checkpoints``), ``clock`` to a new
    ``SegmentClock``. Extras must be JSON values.
    """

    def __init__(
        self,
        directory: Optional[Union[str, os.PathLike[str]]] = None,
        *,
        checkpoint: Optional[tf.train.Checkpoint] = None,
        clock: Optional[SegmentClock] = None,
        keep: int = 3,
        prefix: str = "ckpt",
        **trackables: Any,
    ) -> None:
        if checkpoint is not None and trackables:
            raise TypeError("pass either checkpoint= or the objects to track as keywords, not both")
        if checkpoint is None and not trackables:
            raise TypeError("nothing to checkpoint: pass model=..., optimizer=... (or checkpoint=)")
        self.checkpoint = checkpoint if checkpoint is not None else tf.train.Checkpoint(**trackables)
        self._trackables = dict(trackables)
        self._build_optimizers()  # so that every checkpoint holds the slots, even one saved before training
        # Keras 3 keeps some state (dropout seed generators) in variables that
        # TensorFlow's object graph does not reach; track them explicitly.
        owned: list[Any] = []
        for obj in self._trackables.values():
            variables = getattr(obj, "variables", None)
            if isinstance(obj, tf.Module) or hasattr(obj, "get_config"):
                owned.extend(v for v in (variables or []) if _is_variable(v))
        self.checkpoint._chainrun_variables = owned
        # With op determinism on and no global generator set, there is none to keep.
        with contextlib.suppress(RuntimeError):
            self.checkpoint._chainrun_rng = tf.random.get_global_generator()
        self.store = CheckpointDir(directory, prefix=prefix, suffix=MANIFEST_SUFFIX, keep=keep)
        self.clock = clock if clock is not None else SegmentClock()
        self.last_saved: Optional[Saved] = None
        self._resume: Optional[Resume] = None

    @property
    def directory(self) -> str:
        """The absolute checkpoint directory."""
        return self.store.path

    # -- restore ------------------------------------------------------------------------------
    def restore(self, *, allow_fresh: bool = False) -> Resume:
        """Load the newest good checkpoint into the objects and RNGs; returns what it resumed.

        Same contract as the PyTorch helper: fallback with a warning past
        corrupt checkpoints, ``CheckpointError`` when none is usable (unless
        ``allow_fresh``), a fresh start for an empty directory.
        """
        resume, manifest = self.store.restore(self._load_manifest, allow_fresh=allow_fresh)
        if manifest is not None:
            try:
                status = self.checkpoint.read(os.path.join(self.store.path, manifest["prefix"]))
                status.expect_partial()  # what the checkpoint has beyond our objects is fine
                status.assert_existing_objects_matched()
            except (AssertionError, ValueError, tf.errors.OpError) as exc:
                raise CheckpointError(
                    f"checkpoint {resume.file} does not match the objects given "
                    f"(was the model changed?): {exc}"
                ) from exc
            _restore_host_rng(manifest["rng"])
            resume = resume.loaded(manifest)
        self._resume = resume
        return resume

    def _load_manifest(self, path: str) -> dict[str, Any]:
        with open(path, "rb") as f:
            manifest = json.loads(f.read().decode("utf-8"))
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise ValueError("not a chainrun TensorFlow manifest")
        if manifest.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"manifest version {manifest.get('version')!r}; this chainrun reads {FORMAT_VERSION}"
            )
        for name, meta in manifest["files"].items():
            file = os.path.join(self.store.path, name)
            try:
                size = os.path.getsize(file)
            except FileNotFoundError:
                raise ValueError(f"its data file {name} is missing") from None
            if size != meta["size"] or sha256_file(file) != meta["sha256"]:
                raise ValueError(
                    f"its data file {name} does not match the recorded size and sha256 (corrupt)"
                )
        return manifest

    def _build_optimizers(self) -> None:
        models = [
            o
            for o in self._trackables.values()
            if hasattr(o, "trainable_variables") and not hasattr(o, "apply_gradients")
        ]
        for opt in self._trackables.values():
            if hasattr(opt, "apply_gradients") and hasattr(opt, "build") and not getattr(opt, "built", True):
                variables = [v for m in models for v in m.trainable_variables]
                if variables:
                    opt.build(variables)

    # -- the loop --------------------------------------------------------------------------------
    def steps(self, batches: Iterable[Any], epoch: int) -> Iterator[tuple[int, Any]]:
        """``enumerate(batches)`` that skips the batches already trained when resuming mid-epoch.

        A ``tf.data.Dataset`` is skipped with ``Dataset.skip``; other iterables
        are advanced. The dataset must repeat its order for a given epoch (shuffle
        with ``seed=base + epoch``), as the resume replays it.
        """
        resume, self._resume = self._resume, None
        skip = resume.skip(epoch) if resume is not None and not resume.fresh else 0
        if isinstance(batches, tf.data.Dataset):
            source: Iterable[Any] = batches.skip(skip) if skip else batches
            it = iter(source)
        else:
            it = iter(batches)
            for done in range(skip):
                try:
                    next(it)
                except StopIteration:
                    raise CheckpointError(
                        f"epoch {epoch} has {done} batches, but the checkpoint was saved after {skip}: "
                        "did the data change?"
                    ) from None
        step = skip
        for batch in it:
            yield step, batch
            step += 1

    def should_stop(self) -> bool:
        """True when the segment should save and exit (the walltime signal or deadline)."""
        return self.clock.should_stop()

    # -- save -------------------------------------------------------------------------------------
    def save(
        self,
        epoch: int,
        step: int = 0,
        *,
        done: bool = False,
        metrics: Optional[Mapping[str, Any]] = None,
        extras: Optional[Mapping[str, Any]] = None,
    ) -> Saved:
        """Checkpoint after ``epoch`` completed epochs and ``step`` batches of the next; commits it."""
        began = time.monotonic()
        store = self.store
        store.prepare()
        name = store.new_name(epoch, step)
        stem = name[: -len(MANIFEST_SUFFIX)]
        self.checkpoint.write(os.path.join(store.path, stem))
        files = {}
        for file in sorted(os.listdir(store.path)):
            if file.startswith(stem + ".") and file != name and not file.endswith(".sha256"):
                path = os.path.join(store.path, file)
                fsync_file(path)
                files[file] = {"size": os.path.getsize(path), "sha256": sha256_file(path)}
        if not any(f.endswith(".index") for f in files):
            raise CheckpointError(f"tf.train.Checkpoint.write left no {stem}.index in {store.path}")
        fsync_dir(store.path)
        plain_metrics = {k: _plain(v) for k, v in (metrics or {}).items()}
        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "prefix": stem,
            "epoch": epoch,
            "step": step,
            "done": done,
            "saved_at": time.time(),
            "files": files,
            "rng": _capture_host_rng(),
            "metrics": plain_metrics,
            "extras": dict(extras or {}),
        }
        try:
            data = json.dumps(manifest, sort_keys=True).encode("utf-8")
        except TypeError as exc:
            raise TypeError(f"TensorFlow checkpoint extras must be JSON values: {exc}") from None
        written = atomic_write(os.path.join(store.path, name), data)
        saved = store.commit(
            name,
            epoch=epoch,
            step=step,
            size=written.size,
            sha256=written.sha256,
            done=done,
            metrics=plain_metrics,
            began=began,
        )
        self.last_saved = saved
        store.wait()  # TensorFlow's state file lists what retention kept
        self._update_tf_state(stem)
        return saved

    def wait(self) -> Optional[Saved]:
        """The last committed save (TensorFlow saves are synchronous)."""
        return self.last_saved

    def _update_tf_state(self, latest: str) -> None:
        # TensorFlow's "checkpoint" state file (a text proto), written after the
        # commit so that TensorFlow's view is never ahead of the sidecar.
        kept = [
            e.name[: -len(MANIFEST_SUFFIX)]
            for e in self.store.entries()
            if e.name[: -len(MANIFEST_SUFFIX)] <= latest
        ]
        lines = [f'model_checkpoint_path: "{latest}"'] + [f'all_model_checkpoint_paths: "{k}"' for k in kept]
        atomic_write(os.path.join(self.store.path, TF_STATE_NAME), ("\n".join(lines) + "\n").encode())


def _is_variable(value: Any) -> bool:
    return isinstance(value, tf.Variable) or hasattr(value, "assign")


def _seed_unless_seeded() -> None:
    """Seed from ``CHAINRUN_SEED`` unless the script set TensorFlow's global seed before
    importing this module (as ``keras.utils.set_random_seed`` would, it seeds all three)."""
    seed = chain_seed()
    if seed is None or tf.compat.v1.get_seed(None)[0] is not None:
        return
    seed_python_and_numpy(seed)
    tf.random.set_seed(seed)


_seed_unless_seeded()


def _capture_host_rng() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss]}
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state["numpy"] = [str(kind), np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)]
    return state


def _restore_host_rng(state: Mapping[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if state.get("numpy") is not None:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def _plain(value: Any) -> Any:
    if hasattr(value, "numpy"):
        value = value.numpy()
    if hasattr(value, "item"):
        value = value.item()
    return value
