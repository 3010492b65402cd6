"""PyTorch Lightning in a chain: ``ChainrunCallback`` saves on the walltime signal and resumes.

::

    cb = chainrun.checkpoint.lightning.ChainrunCallback()
    trainer = L.Trainer(callbacks=[cb], deterministic=True, ...)
    trainer.fit(model, loader, ckpt_path=cb.ckpt_path)  # None on the first segment

On the walltime signal (or the deadline; ``SegmentClock``) the handler only sets a flag; at
the end of the batch in progress the callback saves through Lightning's own
``trainer.save_checkpoint``, makes the file durable and commits it the helper's way (the
progress sidecar, written last and behind the fence, names it with its sha256), then sets
``trainer.should_stop`` so that ``fit`` returns and the script exits 0. When ``fit`` ends on
its own, a last checkpoint is committed with ``done=True``. ``ckpt_path`` is the newest
committed checkpoint whose sha256 checks out (an older one, with a warning, when the newest
is damaged), or None.

Resumed mid-epoch, Lightning restores the model, optimizers, LR schedulers, precision
state, its loops' counters and the callbacks' states; this callback adds the Python, NumPy,
torch and CUDA random states (put back right before the first resumed batch) and, where the
loader draws from a ``chainrun.checkpoint.torch.ResumableSampler``, the place in the
interrupted epoch's order, so that the resumed run trains on exactly the batches the
uninterrupted one would. With another sampler Lightning restarts the epoch's data from its
beginning (it warns so) unless the loader has ``state_dict``/``load_state_dict`` itself.

Lightning's own SLURM auto-requeue is turned off (chainrun queues the next segment): its
handler saves inside the signal handler and calls ``scontrol requeue``. Under DDP every rank
agrees on the stop (any rank that saw the signal stops all), every rank takes part in
``save_checkpoint`` (rank 0 writes) and rank 0 commits.

With ``[tracking] mlflow = true`` in the job, an ``MLFlowLogger`` given no ``run_id`` logs
every segment into the chain's one MLflow run (the callback points it there; Lightning has
made a new run by then, which is deleted). A ``WandbLogger`` given no ``id`` continues the
chain's one run with ``[tracking] wandb = true`` (``wandb.init`` reads ``WANDB_RUN_ID``).
TensorBoard and CSV loggers are numbered by the trainer before any callback runs: pass them
``version=run_id()``.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments.slurm import SLURMEnvironment
from lightning.pytorch.loggers import MLFlowLogger
from torch.utils.data import DataLoader

from chainrun.checkpoint._atomic import fsync_dir, fsync_file
from chainrun.checkpoint._clock import SegmentClock
from chainrun.checkpoint._digest import CHUNK, file_digest
from chainrun.checkpoint._store import CheckpointDir, CheckpointWarning, Resume, Saved
from chainrun.checkpoint._tracking import MLFLOW_TAG, RUN_ID_VAR, run_id
from chainrun.checkpoint.torch import ResumableSampler, capture_rng, restore_rng

_RESERVED = ("epoch", "step", "done", "save_seconds")  # the sidecar's own fields

__all__ = ["RUN_ID_VAR", "ChainrunCallback", "run_id"]


class ChainrunCallback(pl.Callback):
    """Saves at the next batch boundary after the walltime signal, commits atomically, stops.

    ``directory`` defaults to ``CHAINRUN_CHECKPOINT_DIR`` (else ``checkpoints``), ``clock``
    to a new ``SegmentClock`` (made here, so make the callback early: until then the
    signal's default action applies). ``keep`` is how many checkpoints retention leaves.
    """

    def __init__(
        self,
        directory: Optional[Union[str, os.PathLike[str]]] = None,
        *,
        clock: Optional[SegmentClock] = None,
        keep: int = 3,
        prefix: str = "ckpt",
    ) -> None:
        self.clock = clock if clock is not None else SegmentClock()
        self.store = CheckpointDir(directory, prefix=prefix, suffix=".ckpt", keep=keep)
        self.resume: Resume = self.store.restore(lambda path: None)[0]
        self.last_saved: Optional[Saved] = None
        self._stopped = False
        self._stop_at_epoch_end = False
        self._saving: Optional[tuple[int, int]] = None
        self._loaded: Optional[dict[str, Any]] = None
        self._rng: Optional[dict[str, Any]] = None
        self._redraw = False

    @property
    def ckpt_path(self) -> Optional[str]:
        """The newest committed checkpoint, verified, for ``trainer.fit(..., ckpt_path=)``; or None."""
        return None if self.resume.fresh else self.resume.path

    @property
    def directory(self) -> str:
        """The absolute checkpoint directory."""
        return self.store.path

    # -- set-up ---------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            _no_auto_requeue(trainer)
            _continue_the_chains_runs(trainer)

    # -- what the checkpoint holds besides Lightning's own state ------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self._saving is None:
            return {}
        epoch, step = self._saving
        return {"epoch": epoch, "step": step, "rng": capture_rng()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = dict(state_dict) or None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loaded, self._loaded = self._loaded, None
        if loaded is None:
            return
        epoch, step = loaded["epoch"], loaded["step"]
        self._rng = loaded["rng"]  # put back right before the first resumed batch
        if step == 0:  # saved at an epoch's end
            self._redraw = True
            return
        for loader in _loaders(trainer):
            sampler, batch_size = _resumable(loader)
            if sampler is not None:
                sampler.resume_at(epoch, min(step * batch_size, sampler.num_samples))

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        rng, self._rng = self._rng, None
        if rng is None:
            return
        restore_rng(rng)
        if self._redraw:
            # Uninterrupted, the new epoch's DataLoader iterator drew its base seed from the
            # global generator after the epoch-end save; resumed, Lightning made it before the
            # states were put back. Draw it again, as the uninterrupted run did.
            self._redraw = False
            for loader in _loaders(trainer):
                if isinstance(loader, DataLoader) and loader.generator is None:
                    torch.empty((), dtype=torch.int64).random_()

    # -- saving ---------------------------------------------------------------------------------
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stop = self.clock.should_stop()
        if trainer.world_size > 1:
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if not stop or self._stopped:
            return
        if batch_idx + 1 >= trainer.num_training_batches:
            self._stop_at_epoch_end = True  # Lightning resumes an epoch's end only from there
            return
        self.save(trainer, trainer.current_epoch, batch_idx + 1)
        self._stopped = True
        trainer.should_stop = True

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._stop_at_epoch_end or self._stopped:
            return
        epoch = trainer.current_epoch + 1
        self.save(trainer, epoch, 0, done=epoch >= (trainer.max_epochs or 0) >= 0)
        self._stopped = True
        trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._stopped:  # fit ended on its own: max_epochs, max_steps, early stopping
            self.save(trainer, trainer.current_epoch, 0, done=True)

    def save(self, trainer: pl.Trainer, epoch: int, step: int, *, done: bool = False) -> Optional[Saved]:
        """Save through ``trainer.save_checkpoint`` and commit (collective: every rank calls it).

        ``epoch`` counts completed epochs and ``step`` the batches done in the next. Returns the
        committed ``Saved`` on rank 0, None on the others.
        """
        began = time.monotonic()
        name: Optional[str] = None
        if trainer.is_global_zero:
            self.store.prepare()
            name = self.store.new_name(epoch, step)
        name = trainer.strategy.broadcast(name)
        assert name is not None
        path = os.path.join(self.store.path, name)
        self._saving = (epoch, step)
        try:
            trainer.save_checkpoint(path)
        finally:
            self._saving = None
        saved = None
        if trainer.is_global_zero:
            fsync_file(path)
            fsync_dir(self.store.path)
            digest = file_digest(path, CHUNK)  # chunks hashed side by side, as the helper's own saves
            saved = self.store.commit(
                name,
                epoch=epoch,
                step=step,
                size=os.path.getsize(path),
                sha256=digest.sha256,
                chunk=digest.chunk,
                chunks=digest.chunks,
                done=done,
                metrics=_metrics(trainer),
                began=began,
            )
            self.last_saved = saved
        trainer.strategy.barrier("chainrun-commit")
        return saved


def _no_auto_requeue(trainer: pl.Trainer) -> None:
    """Turn Lightning's SLURM auto-requeue off (before the trainer sets its signal handlers)."""
    environment = trainer._accelerator_connector.cluster_environment
    if not isinstance(environment, SLURMEnvironment) or not environment.auto_requeue:
        return
    flag = getattr(trainer._accelerator_connector, "_cluster_environment_flag", None)
    if flag is environment:  # the user passed SLURMEnvironment(auto_requeue=True)
        warnings.warn(
            "chainrun: SLURMEnvironment(auto_requeue=True) turned off: chainrun queues the next "
            "segment itself; pass SLURMEnvironment(auto_requeue=False) to silence this",
            CheckpointWarning,
            stacklevel=2,
        )
    environment.auto_requeue = False


def _continue_the_chains_runs(trainer: pl.Trainer) -> None:
    """Point the loggers at the chain's run where they cannot find it themselves.

    Lightning makes every logger's run (``logger.experiment``) before any callback's ``setup``,
    so a logger that reads its run from the environment is left to it: ``WandbLogger``'s
    ``wandb.init`` reads ``WANDB_RUN_ID`` and ``WANDB_RESUME`` (``[tracking] wandb = true``).
    ``MLFlowLogger`` does not read ``MLFLOW_RUN_ID``, and is pointed at the run here."""
    if run_id() is None:
        return
    for logger in trainer.loggers:
        if isinstance(logger, MLFlowLogger):
            _continue_mlflow_run(logger)


def _continue_mlflow_run(logger: MLFlowLogger) -> None:
    """An ``MLFlowLogger`` given no ``run_id`` continues the chain's run where ``[tracking]
    mlflow = true`` found one (``MLFLOW_RUN_ID``, which the logger does not read itself).

    Lightning makes the loggers' runs before any callback's ``setup``, so on rank 0 the logger
    has made a new run by now; where that run carries the chain's tag (``MLFLOW_RUN_CONTEXT``
    gave it, through MLflow's ``resolve_tags``) and is not the chain's run, the logger is
    pointed at the chain's run and the new, still empty one is deleted. A run the user named
    (``run_id=``) is kept. On the first segment there is no ``MLFLOW_RUN_ID``: the logger's
    run, tagged, is the one the next segment finds."""
    found = os.environ.get("MLFLOW_RUN_ID", "").strip()
    if not found:
        return
    try:
        made, initialized = logger._run_id, logger._initialized
        if not initialized:  # not made yet: the other ranks (which make none), or a later Lightning
            if made is None:
                logger._run_id = found
            return
        if made == found:
            return
        client = logger.experiment
        if client.get_run(made).data.tags.get(MLFLOW_TAG) != run_id():
            return  # the user's own run
        logger._experiment_id = client.get_run(found).info.experiment_id
        logger._run_id = found
        client.update_run(found, status="RUNNING")  # as start_run() does (finalize ends it again)
        client.delete_run(made)
    except AttributeError as exc:  # Lightning changed what chainrun sets
        _mlflow_warning(
            found,
            f"this Lightning's MLFlowLogger has no {exc.name or 'attribute'} as chainrun knows it: "
            "pass MLFlowLogger(run_id=os.environ.get('MLFLOW_RUN_ID'))",
        )
    except Exception as exc:  # the tracking server
        _mlflow_warning(found, f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}")


def _mlflow_warning(found: str, why: str) -> None:
    warnings.warn(
        f"chainrun: cannot continue the chain's MLflow run {found} ({why}); this segment logs "
        "into a run of its own",
        CheckpointWarning,
        stacklevel=2,
    )


def _loaders(trainer: pl.Trainer) -> list[Any]:
    loaders = trainer.train_dataloader
    if loaders is None:
        return []
    if isinstance(loaders, dict):
        return list(loaders.values())
    return list(loaders) if isinstance(loaders, (list, tuple)) else [loaders]


def _resumable(loader: Any) -> tuple[Optional[ResumableSampler], int]:
    batch_sampler = getattr(loader, "batch_sampler", None)
    sampler = getattr(batch_sampler, "sampler", None)
    if isinstance(sampler, ResumableSampler):
        return sampler, int(getattr(batch_sampler, "batch_size", 1) or 1)
    return None, 1


def _metrics(trainer: pl.Trainer) -> dict[str, Any]:
    """The logged metrics that are scalars (what ``self.log`` reported last)."""
    found: dict[str, Any] = {}
    for key, value in trainer.callback_metrics.items():
        if key in _RESERVED:
            continue
        if hasattr(value, "numel") and value.numel() == 1:
            found[key] = value.item()
        elif isinstance(value, (int, float, bool)):
            found[key] = value
    return found
