"""``chainrun cancel`` (and the web page's and the Python API's): chains asked to stop.

A cancel works on the store directly, so it needs no service running: with a service, the
request is carried out at its next tick; without one, here, by one engine tick of the
cancelled chains alone.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from chainrun.engine import Engine, TickSummary
from chainrun.errors import ChainrunError
from chainrun.lock import lock_for
from chainrun.model import Chain
from chainrun.notify import Hooks, Notifier
from chainrun.service import NOTIFY_WAIT
from chainrun.store import Store


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
        print(f"chainrun: {exc}; its on_end and webhook are not used", file=sys.stderr, flush=True)
        return Hooks()
    return Hooks(on_end=config.on_end, webhook=config.webhook)
