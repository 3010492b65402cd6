"""The Hugging Face ``Trainer`` in a chain: ``ChainrunTrainerCallback`` and ``newest_checkpoint``.

::

    cb = ChainrunTrainerCallback()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])
    trainer.train(resume_from_checkpoint=newest_checkpoint(args.output_dir))

On the walltime signal (or the deadline; ``SegmentClock``) the handler only sets a flag; at
the end of the optimizer step in progress the callback sets ``should_save`` and
``should_training_stop``, so the Trainer writes its own ``checkpoint-N`` directory (model,
optimizer, scheduler, RNG states, trainer state) and returns. The Trainer neither fsyncs
those files nor marks a directory complete, so once it has written one the callback makes
every file in it durable, records their sizes and sha256 in a manifest beside it
(``<name>.chainrun.json``, written atomically) and commits that manifest with the progress
sidecar (behind the fence), as the TensorFlow helper does: a directory a kill cut short has no
committed manifest and is never resumed from. The last step of the run is saved too, with
``done=True``.

``newest_checkpoint(output_dir)`` is the newest committed ``checkpoint-N`` whose files all
match their manifest (an older one, with a warning, when the newest is damaged), or None:
pass it to ``trainer.train(resume_from_checkpoint=...)``. The Trainer then restores the
model, optimizer, scheduler, RNG states and its state, and skips the batches of the
interrupted epoch already trained.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Optional, Union

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from chainrun.checkpoint._atomic import atomic_write, fsync_dir, fsync_file
from chainrun.checkpoint._clock import SegmentClock
from chainrun.checkpoint._digest import sha256_file
from chainrun.checkpoint._store import CheckpointDir, Saved

FORMAT = "chainrun-hf"
FORMAT_VERSION = 1
MANIFEST_SUFFIX = ".chainrun.json"
_RESERVED = ("epoch", "step", "done", "save_seconds")  # the sidecar's own fields

__all__ = ["FORMAT", "ChainrunTrainerCallback", "newest_checkpoint"]


class ChainrunTrainerCallback(TrainerCallback):
    """Turns the walltime signal into a save and a stop at the step's end; commits each save.

    ``clock`` defaults to a new ``SegmentClock`` (made here: make the callback early). The
    checkpoints are the Trainer's, in ``args.output_dir``; the manifests and the sidecar go
    there too. ``keep`` manifests are kept (``save_total_limit`` keeps the directories).
    """

    def __init__(self, *, clock: Optional[SegmentClock] = None, keep: int = 3) -> None:
        self.clock = clock if clock is not None else SegmentClock()
        self.keep = keep
        self.last_saved: Optional[Saved] = None

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        if state.max_steps > 0 and state.global_step >= state.max_steps:
            control.should_save = True  # the last step: saved as done
        elif self.clock.should_stop():
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        if state.is_world_process_zero:
            self.last_saved = _commit(args, state, self.keep)
        return control


def newest_checkpoint(output_dir: Union[str, os.PathLike[str]]) -> Optional[str]:
    """The newest committed, complete ``checkpoint-N`` directory in ``output_dir``, or None."""
    store = _store(os.fspath(output_dir), keep=1)
    resume, directory = store.restore(lambda path: _verified(store.path, path))
    return None if resume.fresh else directory


def _store(output_dir: str, keep: int) -> CheckpointDir:
    return CheckpointDir(output_dir, prefix="chainrun", suffix=MANIFEST_SUFFIX, keep=keep)


def _commit(args: TrainingArguments, state: TrainerState, keep: int) -> Saved:
    began = time.monotonic()
    store = _store(args.output_dir or "trainer_output", keep)
    directory = f"checkpoint-{state.global_step}"
    root = os.path.join(store.path, directory)
    files = {}
    for folder, _, names in os.walk(root):
        for name in sorted(names):
            path = os.path.join(folder, name)
            fsync_file(path)
            files[os.path.relpath(path, root)] = {"size": os.path.getsize(path), "sha256": sha256_file(path)}
        fsync_dir(folder)
    if not files:
        raise RuntimeError(f"the Trainer left no files in {root}")
    fsync_dir(store.path)
    epoch, step = _position(state)
    done = state.max_steps > 0 and state.global_step >= state.max_steps
    metrics = _metrics(state)
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "directory": directory,
        "global_step": state.global_step,
        "files": files,
    }
    store.prepare()
    name = store.new_name(epoch, step)
    written = atomic_write(os.path.join(store.path, name), json.dumps(manifest, sort_keys=True).encode())
    return store.commit(
        name,
        epoch=epoch,
        step=step,
        size=written.size,
        sha256=written.sha256,
        done=done,
        metrics=metrics,
        began=began,
    )


def _verified(output_dir: str, manifest_path: str) -> str:
    """The checkpoint directory a manifest names, once every file in it matches; else ValueError."""
    with open(manifest_path, "rb") as f:
        manifest = json.loads(f.read().decode("utf-8"))
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError("not a chainrun Hugging Face manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"manifest version {manifest.get('version')!r}; this chainrun reads {FORMAT_VERSION}"
        )
    root = os.path.join(output_dir, manifest["directory"])
    for name, meta in manifest["files"].items():
        path = os.path.join(root, name)
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise ValueError(f"{manifest['directory']}/{name} is missing") from None
        if size != meta["size"] or sha256_file(path) != meta["sha256"]:
            raise ValueError(f"{manifest['directory']}/{name} does not match its size and sha256 (corrupt)")
    return root


def _position(state: TrainerState) -> tuple[int, int]:
    """Completed epochs, and optimizer steps done in the epoch in progress."""
    progress = float(state.epoch or 0.0)
    epoch = math.floor(progress + 1e-9)
    per_epoch = math.ceil(state.max_steps / state.num_train_epochs) if state.num_train_epochs else 0
    step = max(0, state.global_step - epoch * per_epoch) if per_epoch else 0
    return epoch, step if step < per_epoch else 0


def _metrics(state: TrainerState) -> dict[str, Any]:
    """The latest value of each scalar the Trainer logged."""
    found: dict[str, Any] = {}
    for entry in state.log_history:
        for key, value in entry.items():
            if key not in _RESERVED and isinstance(value, (int, float)) and not isinstance(value, bool):
                found[key] = value
    return found
