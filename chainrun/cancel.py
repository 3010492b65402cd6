"""``chainrun cancel`` (and the web page's and the Python API's): chains asked to stop.

A cancel is exact: what is queued is cancelled at once and never starts work; a running
segment gets its walltime signal at once (its runner watches for the chain's final marker),
has its grace to save and end, and is recorded as it ended (what it saved, its times); a
segment that had ended before the cancel keeps its own outcome (``decide.chain``).

A cancel works on the store directly, so it needs no service running: with a service, the
final marker is written here at once and the service carries the rest out at its next tick;
without one, here, by ticks of the cancelled chains alone until they have ended.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Callable, Optional

from chainrun import rundir
from chainrun.decide.chain import CANCEL_SLACK
from chainrun.decide.grace import grace_in_force
from chainrun.engine import Engine, TickSummary
from chainrun.errors import ChainrunError
from chainrun.lock import lock_for
from chainrun.model import Chain
from chainrun.notify import Hooks, Notifier
from chainrun.service import NOTIFY_WAIT
from chainrun.store import Store
from chainrun.transport import transport_for

WAIT_EVERY = 1.0  # seconds between two ticks while a cancelled chain's segment saves


def cancel(
    home: Path, store: Store, chains: Sequence[Chain], wait: Optional[Callable[[Chain], None]] = None
) -> Optional[TickSummary]:
    """Ask for ``chains`` (none of them ended) to be cancelled. When a service runs for
    ``home``, it carries that out at its next tick: None. Else it is done here, by ticks of
    these chains alone (the others wait for a service, as they would without the cancel),
    which also deliver their end notifications: the last tick's summary (a chain whose
    cluster it could not reach is still active, its cancel requested). With ``wait``, the
    ticks go on while a running segment saves (``wait`` is told of each such chain once);
    without, one tick (the rest is the next service's)."""
    now = time.time()
    for chain in chains:
        store.request_cancel(chain.id, now)
    lock = lock_for(home)
    if lock.held_elsewhere():
        for chain in chains:
            _write_final(chain)
        return None
    lock.acquire()
    try:
        notifier = Notifier(home, _hooks())
        engine = Engine(store, on_end=notifier)
        ids = {c.id for c in chains}
        summary = engine.tick(only=ids)
        longest = max(grace_in_force(c.spec, c.segments).seconds for c in chains)
        until, told = now + longest + CANCEL_SLACK + 10 * WAIT_EVERY, set()
        while wait is not None and time.time() < until:
            going = [c for c in (store.chain(i) for i in ids) if not c.state.final and c.live]
            going = [c for c in going if c.cluster_key not in summary.unreachable]
            if not going:
                break
            for chain in going:
                if chain.id not in told:
                    told.add(chain.id)
                    wait(chain)
            time.sleep(WAIT_EVERY)
            summary = engine.tick(only=ids)
        notifier.close(NOTIFY_WAIT)
    finally:
        lock.release()
    return summary


def _write_final(chain: Chain) -> None:
    """The chain's final marker, at once: a successor that starts finds it and runs nothing,
    and the running segment's runner passes the signal on. Where it cannot be written now,
    the service writes it at its next tick."""
    with contextlib.suppress(ChainrunError, OSError):
        rundir.write_final(transport_for(chain.host), chain.spec, chain.id)


def _hooks() -> Hooks:
    """The config's hooks; a broken config must not stand between a user and a cancel."""
    from chainrun.config import load_config

    try:
        config = load_config()
    except ChainrunError as exc:
        print(f"chainrun: {exc}; its on_end and webhook are not used", file=sys.stderr, flush=True)
        return Hooks()
    return Hooks(on_end=config.on_end, webhook=config.webhook)
