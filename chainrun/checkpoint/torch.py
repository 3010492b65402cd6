"""Exact resume for PyTorch training loops: ``Checkpointer`` and ``ResumableSampler``.

A checkpoint holds the model, optimizer, LR scheduler, GradScaler, any other
object with ``state_dict``/``load_state_dict``, the RNG states (Python, NumPy,
torch CPU and every CUDA device), the epoch, the step within it and user
extras. ``Checkpointer.steps`` replays the data order of an interrupted epoch
and skips the batches already trained, so an interrupted and resumed run ends
with the same weights as an uninterrupted one. Saves are atomic and verified
on restore (see ``chainrun.checkpoint.CheckpointDir``); with ``async_save`` the
loop blocks only while the state is copied to host memory.

When ``torch.distributed`` has a default process group of several ranks, the
ranks act as one: ``should_stop()`` and ``save()`` are collective (every rank
calls them at the same step), rank 0 alone writes the checkpoint and the
progress sidecar, and ``restore()`` loads it on every rank.

Imported in a chain, it seeds Python's, NumPy's and torch's random numbers from the chain's
``CHAINRUN_SEED`` unless the script has seeded torch already (see ``_seed``): seeding of the
script's own after the import wins, and ``restore()`` puts back the states a checkpoint holds.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import ctypes
import functools
import os
import pickle
import queue
import random
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sized
from typing import Any, Callable, Optional, Union

import torch
from torch.utils.data import BatchSampler, Sampler

from chainrun.checkpoint._clock import SegmentClock
from chainrun.checkpoint._seed import SEED_LIMIT, chain_seed, seed_python_and_numpy
from chainrun.checkpoint._store import CheckpointDir, CheckpointError, CheckpointWarning, Resume, Saved

FORMAT = "chainrun-torch"
FORMAT_VERSION = 1

__all__ = ["FORMAT", "Checkpointer", "ResumableSampler", "capture_rng", "restore_rng"]


class ResumableSampler(Sampler[int]):
    """Shuffles with its own seed per epoch and can start part-way through an epoch.

    The order of epoch ``e`` is a permutation drawn from ``seed + e`` alone, so
    it does not depend on the global RNG and is the same in every process.
    ``set_epoch(epoch, start)`` skips the first ``start`` samples of that order.
    Without a ``seed``: the chain's ``CHAINRUN_SEED``, else 0.
    """

    def __init__(
        self, data_source: Union[Sized, int], *, shuffle: bool = True, seed: Optional[int] = None
    ) -> None:
        super().__init__()
        n = data_source if isinstance(data_source, int) else len(data_source)
        if n < 0:
            raise ValueError(f"ResumableSampler needs a dataset size >= 0, got {n}")
        self.num_samples = n
        self.shuffle = shuffle
        if seed is None:
            seed = chain_seed()
        self.seed = 0 if seed is None else seed
        self.epoch = 0
        self.start = 0
        self._resume_at: Optional[tuple[int, int]] = None

    def set_epoch(self, epoch: int, start: Optional[int] = None) -> None:
        """Use epoch ``epoch``'s order from sample ``start`` on (0: the whole epoch). Without a
        ``start``: where ``resume_at`` said for that epoch, else 0."""
        pending, self._resume_at = self._resume_at, None
        if start is None:
            start = pending[1] if pending is not None and pending[0] == epoch else 0
        if not 0 <= start <= self.num_samples:
            raise ValueError(f"start={start} is outside the epoch of {self.num_samples} samples")
        self.epoch = epoch
        self.start = start

    def resume_at(self, epoch: int, start: int) -> None:
        """Start epoch ``epoch`` at sample ``start``, also when a trainer that knows nothing of
        resuming (Lightning) then calls ``set_epoch(epoch)`` at the epoch's start."""
        self.set_epoch(epoch, start)
        self._resume_at = (epoch, start)

    def order(self, epoch: int) -> list[int]:
        """All sample indices of ``epoch`` in the order they are drawn."""
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.order(self.epoch)[self.start :])

    def __len__(self) -> int:
        return self.num_samples - self.start


class Checkpointer:
    """Saves and restores everything a PyTorch loop needs to continue exactly.

    ``directory`` defaults to ``CHAINRUN_CHECKPOINT_DIR`` (else ``checkpoints``);
    ``clock`` to a new ``SegmentClock``. ``stateful`` names further objects with
    ``state_dict``/``load_state_dict`` (an EMA, a second model). ``keep`` is how
    many checkpoints retention leaves. ``map_location`` is passed to
    ``torch.load`` ("cpu" by default, so a GPU checkpoint resumes anywhere; the
    load_state_dict calls then copy to where the model lives). Extras are loaded
    with ``weights_only`` unless you pass ``weights_only=False``.

    Typical loop::

        ckpt = Checkpointer(model=model, optimizer=opt, scheduler=sched)
        start = ckpt.restore()
        for epoch in range(start.epoch, epochs):
            for step, (x, y) in ckpt.steps(loader, epoch):
                ...train on one batch...
                if ckpt.should_stop():
                    ckpt.save(epoch, step + 1)
                    sys.exit(0)
            ckpt.save(epoch + 1, 0, done=epoch + 1 == epochs)

    Under ``torch.distributed`` (a default process group of more than one rank)
    every rank runs the same loop: ``should_stop()`` all-reduces its answer, so
    the walltime signal or deadline seen by any rank stops all of them at the
    same step; ``save()`` gathers each rank's RNG states, rank 0 writes the one
    checkpoint (the model as rank 0 holds it, which DDP keeps equal on all
    ranks), and commits it only once every rank has confirmed it is still in the
    save, so a rank that dies mid-save leaves the previous checkpoint in force;
    ``restore()`` loads the checkpoint on every rank, each with its own RNG
    states. Distributed saves are synchronous (``async_save`` is not used).
    """

    def __init__(
        self,
        directory: Optional[Union[str, os.PathLike[str]]] = None,
        *,
        model: Optional[torch.nn.Module] = None,
        optimizer: Optional[torch.optim.Optimizer] = None,
        scheduler: Any = None,
        scaler: Any = None,
        stateful: Optional[Mapping[str, Any]] = None,
        clock: Optional[SegmentClock] = None,
        keep: int = 3,
        prefix: str = "ckpt",
        async_save: bool = False,
        map_location: Any = "cpu",
        weights_only: bool = True,
    ) -> None:
        self._objects: dict[str, Any] = {}
        for name, obj in (
            ("model", model),
            ("optimizer", optimizer),
            ("scheduler", scheduler),
            ("scaler", scaler),
        ):
            if obj is not None:
                self._objects[name] = obj
        for name, obj in (stateful or {}).items():
            if name in self._objects:
                raise ValueError(
                    f"stateful name {name!r} clashes with the {name} argument: choose another name"
                )
            self._objects[name] = obj
        for name, obj in self._objects.items():
            if not (
                callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
            ):
                raise TypeError(
                    f"{name} ({type(obj).__name__}) has no state_dict/load_state_dict: "
                    "it cannot be checkpointed"
                )
        self.store = CheckpointDir(directory, prefix=prefix, suffix=".pt", keep=keep)
        group = _distributed()
        if group is not None:
            _flag_device(group)  # a rank on another's GPU is told now, not by a hung collective
        self.clock = clock if clock is not None else SegmentClock()
        self.async_save = async_save
        self.map_location = map_location
        self.weights_only = weights_only
        self.last_saved: Optional[Saved] = None
        self._resume: Optional[Resume] = None
        self._resume_rng: Optional[dict[str, Any]] = None
        self._resume_epoch_rng: Optional[dict[str, Any]] = None
        self._epoch_rng: Optional[tuple[int, dict[str, Any]]] = None
        self._background = _Background()
        weakref.finalize(self, self._background.stop)
        self._error: Optional[BaseException] = None
        self._staging: dict[tuple[Any, ...], torch.Tensor] = {}
        self._reserving: Optional[threading.Thread] = None
        atexit.register(_finish_at_exit, weakref.ref(self))
        if async_save:
            self._reserve()
            if (
                optimizer is not None
                and not optimizer.state
                and hasattr(optimizer, "register_step_post_hook")
            ):
                # Adam's and most optimizers' state appears with their first step: reserve it then.
                ref = weakref.ref(self)

                def first_step(*_: Any) -> None:
                    handle.remove()
                    ckpt = ref()
                    if ckpt is not None:
                        ckpt._reserve()

                handle = optimizer.register_step_post_hook(first_step)

    @property
    def directory(self) -> str:
        """The absolute checkpoint directory."""
        return self.store.path

    # -- restore --------------------------------------------------------------------------
    def restore(self, *, allow_fresh: bool = False) -> Resume:
        """Load the newest good checkpoint into the objects and RNGs; returns what it resumed.

        Falls back to an older checkpoint, with a ``CheckpointWarning``, when
        the newest is missing, corrupt or does not load. An empty directory is a
        fresh start; checkpoints that are all unusable raise ``CheckpointError``
        unless ``allow_fresh``.
        """
        self.wait()
        resume, payload = self.store.restore(self._load, allow_fresh=allow_fresh)
        if payload is not None:
            _own_rank_rng(payload)
            for name, obj in self._objects.items():
                if name not in payload["objects"]:
                    raise CheckpointError(
                        f"checkpoint {resume.file} has no state for {name!r} (it holds "
                        f"{sorted(payload['objects'])}): was it saved by a different script?"
                    )
                obj.load_state_dict(payload["objects"][name])
            restore_rng(payload["rng"])
            self._resume_rng = payload["rng"]
            self._resume_epoch_rng = payload.get("epoch_rng")
            resume = resume.loaded(payload)
            if self.async_save:
                self._reserve()  # the optimizer's state is all there now
        self._resume = resume
        return resume

    def _load(self, path: str) -> dict[str, Any]:
        location = self.map_location
        if location is None and not torch.cuda.is_available():
            location = "cpu"
        try:
            payload = torch.load(path, map_location=location, weights_only=self.weights_only)
        except pickle.UnpicklingError as exc:
            if self.weights_only:
                raise CheckpointError(
                    f"{path} holds objects torch.load(weights_only=True) refuses (probably in extras): "
                    f"pass Checkpointer(weights_only=False) if you trust the file. {exc}"
                ) from exc
            raise
        if not isinstance(payload, dict) or payload.get("format") != FORMAT:
            raise ValueError("not a chainrun PyTorch checkpoint")
        if payload.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"checkpoint format version {payload.get('version')!r}; this chainrun reads {FORMAT_VERSION}"
            )
        return payload

    # -- the loop ---------------------------------------------------------------------------
    def steps(self, loader: Iterable[Any], epoch: int) -> Iterator[tuple[int, Any]]:
        """``enumerate(loader)`` for ``epoch`` that continues an interrupted epoch exactly.

        On the epoch restore() stopped in, the RNGs are rewound to that epoch's
        start so the loader draws the same order, the batches already trained
        are skipped (by index with a ``ResumableSampler``, else by loading and
        dropping them), and the RNGs are then set to where the checkpoint left
        them. Step numbers continue from the checkpoint's. Samplers with
        ``set_epoch`` (``DistributedSampler``) get it called.
        """
        resume, self._resume = self._resume, None
        skip = resume.skip(epoch) if resume is not None and not resume.fresh else 0
        if skip and self._resume_epoch_rng is not None:
            restore_rng(self._resume_epoch_rng)
        self._epoch_rng = (epoch, capture_rng())
        fast = _resumable(loader)
        if fast is not None:
            sampler, batch_size = fast
            sampler.set_epoch(epoch, min(skip * batch_size, sampler.num_samples))
        else:
            sampler_ = getattr(loader, "sampler", None)
            if callable(getattr(sampler_, "set_epoch", None)):
                sampler_.set_epoch(epoch)  # type: ignore[union-attr]
        if skip and fast is None and self._resume_epoch_rng is None:
            warnings.warn(
                f"resuming epoch {epoch} at step {skip} without the RNG state of the epoch's start "
                "(the checkpoint was not saved inside steps()): a shuffling loader may not repeat "
                "its order; use a ResumableSampler",
                CheckpointWarning,
                stacklevel=2,
            )
        it = iter(loader)
        if skip and fast is None:
            for done in range(skip):
                try:
                    next(it)
                except StopIteration:
                    raise CheckpointError(
                        f"epoch {epoch} of the loader has {done} batches, but the checkpoint was "
                        f"saved after {skip}: did the dataset or batch size change?"
                    ) from None
        if skip and self._resume_rng is not None:
            restore_rng(self._resume_rng)
        self._resume_rng = self._resume_epoch_rng = None
        step = skip
        for batch in it:
            yield step, batch
            step += 1

    def should_stop(self) -> bool:
        """True when the segment should save and exit; a background save is finished first."""
        self._raise_background_error()
        stop = self.clock.should_stop()
        group = _distributed()
        if group is not None and _all_reduce_flag(group, stop, group.ReduceOp.MAX) and not stop:
            self.clock.request_stop("another rank is stopping")
            stop = True
        if stop:
            self.wait()
        return stop

    # -- save -------------------------------------------------------------------------------
    def save(
        self,
        epoch: int,
        step: int = 0,
        *,
        done: bool = False,
        metrics: Optional[Mapping[str, Any]] = None,
        extras: Optional[Mapping[str, Any]] = None,
    ) -> Optional[Saved]:
        """Checkpoint after ``epoch`` completed epochs and ``step`` batches of the next.

        Returns the committed ``Saved``; with ``async_save`` it returns None and
        the write goes on in a background thread (``wait()`` returns it). A save
        with ``done=True``, after the clock stopped, or under ``torch.distributed``
        is always synchronous.
        """
        self._raise_background_error()
        group = _distributed()
        if group is not None:
            return self._save_distributed(group, epoch, step, done, metrics, extras)
        state = self._state(epoch, step, done, metrics, extras)
        self._join_save()
        if not self.async_save or done or self.clock.should_stop():
            return self._write(state)
        if self._reserving is not None:
            self._reserving.join()
        snapshot = _Stager(self._staging).stage(state)
        self._background.submit(functools.partial(self._write_in_background, snapshot))
        return None

    def wait(self) -> Optional[Saved]:
        """Finish a background save and retention, if any; returns the last committed save."""
        self._join_save()
        self.store.wait()
        return self.last_saved

    def _join_save(self) -> None:
        self._background.join()
        self._raise_background_error()

    def close(self) -> None:
        """Finish pending work (the same as ``wait()``, for ``with`` blocks)."""
        self.wait()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.wait()

    def _state(
        self,
        epoch: int,
        step: int,
        done: bool,
        metrics: Optional[Mapping[str, Any]],
        extras: Optional[Mapping[str, Any]],
        objects: bool = True,
    ) -> dict[str, Any]:
        for key, value in (("epoch", epoch), ("step", step)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"save({key}={value!r}): {key} must be a non-negative integer")
        epoch_rng = None
        if step and self._epoch_rng is not None and self._epoch_rng[0] == epoch:
            epoch_rng = self._epoch_rng[1]
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "epoch": epoch,
            "step": step,
            "done": done,
            "saved_at": time.time(),
            "objects": {name: obj.state_dict() for name, obj in self._objects.items()} if objects else {},
            "rng": capture_rng(),
            "epoch_rng": epoch_rng,
            "metrics": dict(metrics or {}),
            "extras": dict(extras or {}),
        }

    def _write(self, state: dict[str, Any], ready: Optional[Callable[[], None]] = None) -> Saved:
        saved = self.store.save(
            lambda f: _save_without_crc32(state, f),
            epoch=state["epoch"],
            step=state["step"],
            done=state["done"],
            metrics=state["metrics"],
            ready=ready,
        )
        self.last_saved = saved
        return saved

    def _save_distributed(
        self,
        group: Any,
        epoch: int,
        step: int,
        done: bool,
        metrics: Optional[Mapping[str, Any]],
        extras: Optional[Mapping[str, Any]],
    ) -> Saved:
        """The collective save: every rank's RNG states to rank 0, which writes the file; the
        commit waits until every rank has confirmed (a rank gone by then makes the collective
        fail, and the file stays uncommitted); rank 0 then tells every rank what it committed."""
        self._join_save()
        state = self._state(epoch, step, done, metrics, extras, objects=group.get_rank() == 0)
        ranks: list[Any] = [None] * group.get_world_size()
        group.all_gather_object(ranks, {"rng": state["rng"], "epoch_rng": state["epoch_rng"]})
        outcome: list[Any] = [None]
        if group.get_rank() == 0:
            state["ranks"] = ranks
            confirmed = False

            def ready() -> None:
                nonlocal confirmed
                confirmed = True
                _all_reduce_flag(group, True, group.ReduceOp.MIN)

            try:
                outcome[0] = self._write(state, ready)
            except Exception as exc:
                outcome[0] = f"{type(exc).__name__}: {exc}"
                with contextlib.suppress(Exception):  # these fail too where a rank is gone
                    if not confirmed:
                        _all_reduce_flag(group, False, group.ReduceOp.MIN)
                    group.broadcast_object_list(outcome, src=0)
                raise
            group.broadcast_object_list(outcome, src=0)
            return outcome[0]  # type: ignore[no-any-return]
        _all_reduce_flag(group, True, group.ReduceOp.MIN)  # pairs with rank 0's ready()
        group.broadcast_object_list(outcome, src=0)  # waits for rank 0's commit
        if not isinstance(outcome[0], Saved):
            raise CheckpointError(f"rank 0 could not save the checkpoint in {self.store.path}: {outcome[0]}")
        self.last_saved = outcome[0]
        return outcome[0]

    def _reserve(self) -> None:
        """Allocate, in a thread of its own, the host buffers an async save copies the state into,
        before the first save needs them: pinned ones for CUDA tensors take about 0.5 s per GiB,
        which the first save's blocking part would otherwise pay (issue 38). Restore does not
        wait for it; a save does. Under torch.distributed saves are synchronous: nothing to do."""
        if _distributed() is not None:
            return
        objects = {name: obj.state_dict() for name, obj in self._objects.items()}
        before = self._reserving

        def reserve() -> None:
            if before is not None:
                before.join()
            try:
                _Stager(self._staging).reserve({"objects": objects})
            except Exception as exc:  # the save allocates what is missing itself
                warnings.warn(
                    f"chainrun: could not allocate host buffers ahead: {exc}", CheckpointWarning, stacklevel=1
                )

        self._reserving = threading.Thread(target=reserve, name="chainrun-reserve", daemon=True)
        self._reserving.start()

    def _write_in_background(self, state: dict[str, Any]) -> None:
        try:
            self._write(state)
        except BaseException as exc:  # handed to the training thread by wait()
            self._error = exc

    def _raise_background_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise CheckpointError(
                f"a background save in {self.store.path} failed: {type(error).__name__}: {error}"
            ) from error


class _Background:
    """One long-lived thread that runs a Checkpointer's background saves, one at a time.

    Handing a save over is a queue put: the training loop never waits for a
    thread to start, which on a busy node can take longer than the copy.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Optional[Callable[[], None]]] = queue.SimpleQueue()
        self._pending = 0
        self._done = threading.Condition()
        self._thread: Optional[threading.Thread] = None

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` (which handles its own errors) after the ones before it."""
        with self._done:
            self._pending += 1
        if self._thread is None:
            # A daemon: at exit an idle one must not hold the interpreter; pending
            # work is finished by the Checkpointer's atexit wait().
            self._thread = threading.Thread(target=self._run, name="chainrun-save", daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def join(self) -> None:
        """Wait until the submitted jobs are done."""
        with self._done:
            self._done.wait_for(lambda: self._pending == 0)

    def stop(self) -> None:
        """Let the thread end once its jobs are done (the Checkpointer is gone)."""
        self._jobs.put(None)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()
            del job  # hold no reference to the Checkpointer while idle
            with self._done:
                self._pending -= 1
                self._done.notify_all()


_CRC32_LOCK = threading.Lock()


def _save_without_crc32(state: Any, f: Any) -> None:
    """torch.save, minus the per-record CRC32 of its zip container.

    chainrun's sha256 covers the whole file, and the CRC32 costs about a third
    of the save time. torch.load does not check it; ``unzip -t`` would. The
    option is process-wide in torch, so it is off only for this call.
    """
    get = getattr(torch.serialization, "get_crc32_options", None)
    set_ = getattr(torch.serialization, "set_crc32_options", None)
    if get is None or set_ is None:  # torch before 2.5 always computes it
        torch.save(state, f)
        return
    with _CRC32_LOCK:
        before = get()
        set_(False)
        try:
            torch.save(state, f)
        finally:
            set_(before)


def _distributed() -> Any:
    """``torch.distributed`` when its default process group has more than one rank, else None."""
    group = torch.distributed
    if group.is_available() and group.is_initialized() and group.get_world_size() > 1:
        return group
    return None


def _all_reduce_flag(group: Any, value: bool, op: Any) -> bool:
    """``value`` combined over all ranks with ``op`` (MAX: any rank; MIN: every rank)."""
    flag = torch.tensor([int(value)], dtype=torch.int32, device=_flag_device(group))
    group.all_reduce(flag, op=op)
    return bool(flag.item())


def _flag_device(group: Any) -> str:
    """Where this rank's collective flags live: the CPU, or under NCCL its current GPU. That is
    the rank's own GPU only when it called ``torch.cuda.set_device(local_rank)``; without it
    every rank of a node is on cuda:0 and the collective fails or hangs, so it is checked
    against ``LOCAL_RANK`` (torchrun) or ``SLURM_LOCALID`` (srun) where the rank sees that GPU."""
    if group.get_backend() != "nccl":
        return "cpu"
    current = torch.cuda.current_device()
    local = (os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID") or "").strip()
    if local.isdigit() and int(local) < torch.cuda.device_count() and int(local) != current:
        raise CheckpointError(
            f"rank {group.get_rank()} (local rank {local}) has cuda:{current} as its current device, "
            f"not its own GPU: call torch.cuda.set_device({local}) on each rank, before "
            "init_process_group (torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) under torchrun)"
        )
    return f"cuda:{current}"


def _own_rank_rng(payload: dict[str, Any]) -> None:
    """Under torch.distributed, put this rank's RNG states where restore() reads them: a
    checkpoint of as many ranks holds each rank's own; otherwise every rank gets rank 0's."""
    ranks = payload.get("ranks")
    group = _distributed()
    if group is None or not ranks:
        return
    if len(ranks) != group.get_world_size():
        warnings.warn(
            f"the checkpoint was saved by {len(ranks)} ranks and is resumed by {group.get_world_size()}: "
            "every rank gets rank 0's random number states, so the run will not repeat exactly",
            CheckpointWarning,
            stacklevel=3,
        )
        return
    own = ranks[group.get_rank()]
    payload["rng"], payload["epoch_rng"] = own["rng"], own["epoch_rng"]


def capture_rng() -> dict[str, Any]:
    """The states of Python's, NumPy's (if installed), torch's CPU and every initialized CUDA RNG."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = _numpy()
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = (str(kind), np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached))
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Set the RNGs from ``capture_rng()``'s result (CUDA states only where CUDA is here)."""
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    torch.set_rng_state(state["torch"].cpu())
    np = _numpy()
    if np is not None and state.get("numpy") is not None:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        for index, rng in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(rng.cpu(), index)


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def _resumable(loader: Any) -> Optional[tuple[ResumableSampler, int]]:
    batch_sampler = getattr(loader, "batch_sampler", None)
    if isinstance(batch_sampler, BatchSampler) and isinstance(batch_sampler.sampler, ResumableSampler):
        return batch_sampler.sampler, batch_sampler.batch_size
    return None


class _Stager:
    """Copies a state tree to host memory, into the buffers of the previous save (or of
    ``reserve()``): pinned memory for CUDA tensors, so the copies run as DMA on each device's stream."""

    def __init__(self, cache: dict[tuple[Any, ...], torch.Tensor]) -> None:
        self._cache = cache
        self._seen: dict[int, torch.Tensor] = {}  # tied weights stay tied
        self._devices: set[torch.device] = set()
        self._copying = True

    def stage(self, state: Any) -> Any:
        staged = self._copy(state, ())
        for device in self._devices:  # every device copied from, not only the current one
            torch.cuda.synchronize(device)
        return staged

    def reserve(self, state: Any) -> None:
        """Allocate the buffers ``stage`` will copy ``state``'s tensors into, copying nothing."""
        self._copying = False
        self._copy(state, ())

    def _copy(self, obj: Any, key: tuple[Any, ...]) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, key)
        if isinstance(obj, dict):
            out = obj.__class__((k, self._copy(v, (*key, k))) for k, v in obj.items())
            metadata = getattr(obj, "_metadata", None)
            if metadata is not None:
                # load_state_dict reads module versions from it
                out._metadata = copy.deepcopy(metadata)  # type: ignore[attr-defined]
            return out
        if isinstance(obj, list):
            return [self._copy(v, (*key, i)) for i, v in enumerate(obj)]
        if type(obj) is tuple:
            return tuple(self._copy(v, (*key, i)) for i, v in enumerate(obj))
        return copy.deepcopy(obj) if self._copying else None

    def _tensor(self, t: torch.Tensor, key: tuple[Any, ...]) -> Optional[torch.Tensor]:
        ident = id(t)
        seen = self._seen.get(ident)
        if seen is not None:
            return seen
        t = t.detach()
        if t.layout != torch.strided or t.is_quantized or t.is_nested:
            if not self._copying:
                return None
            self._seen[ident] = t.to("cpu", copy=True)
            return self._seen[ident]
        cached = self._cache.get(key)
        if cached is None or cached.shape != t.shape or cached.dtype != t.dtype:
            # Pinned (page-locked) only where CUDA is: the copy from the device is then a DMA.
            cached = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda and torch.cuda.is_available())
            self._cache[key] = cached
        self._seen[ident] = out = cached
        if not self._copying:
            return out
        if t.is_cuda:
            out.copy_(t, non_blocking=True)  # DMA on t's device's stream; stage() waits for each device
            self._devices.add(t.device)
        elif t.device.type == "cpu" and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
            # One plain memcpy: copy_ would split it over torch's intra-op
            # threads, which on a busy node wait on each other far longer
            # than the copy takes.
            ctypes.memmove(out.data_ptr(), t.data_ptr(), t.nbytes)
        else:
            out.copy_(t)
        return out


def _seed_unless_seeded() -> None:
    """Seed from ``CHAINRUN_SEED`` unless the script seeded torch before importing this module.
    Torch seeds itself with 64 random bits at start; a seed set with ``manual_seed`` is below
    ``SEED_LIMIT`` (as NumPy requires), so a smaller one says the script seeded already (the
    64 random bits fall below it once in 2**32 starts)."""
    seed = chain_seed()
    if seed is None or torch.initial_seed() < SEED_LIMIT:
        return
    seed_python_and_numpy(seed)
    torch.manual_seed(seed)  # the CPU generator and every CUDA device's


_seed_unless_seeded()


def _finish_at_exit(ref: weakref.ref[Checkpointer]) -> None:
    ckpt = ref()
    if ckpt is None:
        return
    try:
        ckpt.wait()
    except CheckpointError as exc:
        print(f"chainrun: {exc}", file=sys.stderr)
