"""Submitting and cancelling chains: what ``chainrun submit``/``cancel`` and the Python API share.

Both work on the store directly, so neither needs a service running: a
submitted chain waits in the store until a service picks it up, and a cancel
that no service is there to carry out is carried out here, by one engine tick
of the cancelled chains alone. Notes a user should see (a chain left as it
was, a checkpoint directory moved aside) go to stderr; refusals are raised as
``ChainrunError`` with the one line the CLI prints.
"""

from __future__ import annotations

import posixpath
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from chainrun import progress, snapshot, sweep
from chainrun.engine import Engine, TickSummary
from chainrun.errors import ChainrunError, TransportError, UsageError
from chainrun.lock import lock_for
from chainrun.model import NO_PROGRESS, Chain, JobSpec, Progress
from chainrun.notify import Hooks, Notifier
from chainrun.plan import preflight
from chainrun.service import NOTIFY_WAIT
from chainrun.store import Store
from chainrun.transport import Transport, transport_for


def _note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def submit_all(store: Store, specs: Sequence[JobSpec], fresh: bool = False) -> list[tuple[str, JobSpec]]:
    """Store a chain for each spec, and for each chain of a sweep, all in one transaction:
    none is stored when one cannot be. What checkpoint_dir holds is each one's starting point.

    A checkpoint that already says the run is complete is refused (exit 1, nothing stored):
    submitting it again would only complete at once. With ``fresh`` each checkpoint
    directory is first moved aside (never deleted), so the chain starts from nothing. A
    sweep's chain that is already active is left as it is, and said so: submitting the
    same sweep again never duplicates a run. Returns the new chains' ids and specs.
    """
    new: list[tuple[JobSpec, Progress]] = []
    pins: list[Optional[snapshot.Snapshot]] = []
    for spec in specs:
        preflight(spec)
        transport = transport_for(spec.scheduler.first_host)
        try:
            # The code is captured once per job file: a sweep's chains all run the same commit.
            spec, snap = snapshot.prepare(transport, spec)
            chains = sweep.expand(spec)
            taken = store.unended([c.name for c in chains]) if spec.sweep else {}
            for one in chains:
                if one.name in taken:
                    _note(f"{one.name}: already submitted as chain {taken[one.name]}; left as it is")
                    continue
                if fresh:
                    _move_aside(transport, one)
                baseline = progress.read(transport, one) or NO_PROGRESS
                why = _complete(one, baseline)
                if why:
                    again = "; to start over, add --fresh (it moves the directory aside, deleting nothing)"
                    where = f"the checkpoint in {one.checkpoint_dir}"
                    raise ChainrunError(f"{where} is already complete ({why}){'' if fresh else again}")
                new.append((one, baseline))
                pins.append(snap)
        except TransportError as exc:
            if spec.scheduler.first_host is None:
                raise
            raise TransportError(f"cannot reach {spec.scheduler.first_host}: {exc}") from None
    ids = store.add_chains(new, time.time())
    for chain_id, snap in zip(ids, pins):
        if snap is not None:
            snapshot.pin(snap, chain_id)
    return [(chain_id, spec) for chain_id, (spec, _) in zip(ids, new)]


def _complete(spec: JobSpec, baseline: Progress) -> str:
    """Why the checkpoint already says the run is complete; "" when it does not."""
    if spec.target_epoch is not None and (baseline.epoch or 0) >= spec.target_epoch:
        return f"epoch {baseline.epoch}, target_epoch {spec.target_epoch}"
    if baseline.done:
        return "the training script marked it done"
    return ""


def _move_aside(transport: Transport, spec: JobSpec) -> None:
    """``--fresh``: rename checkpoint_dir to ``<dir>.old-<UTC time>`` (``-2``, ``-3``, ... on a
    clash), saying so on stderr; nothing to do when it does not exist. Refused, with nothing
    moved, when that would move the workdir or would not start over (the progress file
    lies outside checkpoint_dir)."""
    ckpt = spec.checkpoint_dir
    if posixpath.commonpath([ckpt, spec.workdir]) == ckpt:
        raise UsageError(
            f"--fresh: checkpoint_dir {ckpt} holds the workdir {spec.workdir}, so moving it aside "
            "would move the job's own files; move the old checkpoints yourself, or give the job "
            "a checkpoint_dir of its own"
        )
    if spec.progress_file and posixpath.commonpath([ckpt, spec.progress_file]) != ckpt:
        raise UsageError(
            f"--fresh: the progress file {spec.progress_file} is outside checkpoint_dir {ckpt}, so "
            "moving that aside would not start over; set checkpoint_dir to the directory the "
            "script saves in"
        )
    if transport.stat(ckpt) is None:
        return
    stem = f"{ckpt}.old-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    target, n = stem, 1
    while transport.stat(target) is not None:
        n += 1
        target = f"{stem}-{n}"
    transport.rename(ckpt, target)
    _note(f"moved the old checkpoint directory aside: {ckpt} -> {target}")


def cancel(home: Path, store: Store, chains: Sequence[Chain]) -> Optional[TickSummary]:
    """Ask for ``chains`` (none of them ended) to be cancelled. When a service runs for
    ``home``, it carries that out at its next tick: None. Else it is done here, by one
    tick of these chains alone (the others wait for a service, as they would without
    the cancel), which also delivers their end notifications: that tick's summary (a
    chain whose cluster it could not reach is still active, its cancel requested)."""
    now = time.time()
    for chain in chains:
        store.request_cancel(chain.id, now)
    lock = lock_for(home)
    if lock.held_elsewhere():
        return None
    lock.acquire()
    try:
        notifier = Notifier(home, _hooks())
        summary = Engine(store, on_end=notifier).tick(only={c.id for c in chains})
        notifier.close(NOTIFY_WAIT)
    finally:
        lock.release()
    return summary


def _hooks() -> Hooks:
    """The config's hooks; a broken config must not stand between a user and a cancel."""
    from chainrun.config import load_config

    try:
        config = load_config()
    except ChainrunError as exc:
        _note(f"chainrun: {exc}; its on_end and webhook are not used")
        return Hooks()
    return Hooks(on_end=config.on_end, webhook=config.webhook)
