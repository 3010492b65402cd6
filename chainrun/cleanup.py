"""Garbage of code snapshots (``chainrun gc``, and the service once a day): the refs
``refs/chainrun/<chain-id>`` and the unpacked ``.chainrun/code/<commit>/`` directories of
chains that ended more than ``gc_after`` ago (the service config; 7 days by default).

A chain that has not ended, or ended more recently, keeps its ref, and keeps the code
directory it runs in also for every other chain of the same commit (a sweep's chains share
one): nothing an active chain may still start a segment from is ever removed. A host that
cannot be reached, or a repository that has gone, is left for the next time.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from chainrun import logs, snapshot
from chainrun.errors import ChainrunError
from chainrun.model import Chain
from chainrun.schedulers.segment import code_root
from chainrun.store import Store
from chainrun.transport import transport_for

log = logs.get_logger(__name__)

DEFAULT_GC_AFTER = 7 * 86400
GC_EVERY = 86400  # seconds between the service's collections


@dataclass
class Collected:
    """What one collection removed, and what it could not."""

    refs: list[str] = field(default_factory=list)  # chain ids whose ref was removed
    code: list[str] = field(default_factory=list)  # "[host:]path" of each code directory removed
    problems: list[str] = field(default_factory=list)


def expired(chains: Iterable[Chain], now: float, keep: float) -> tuple[list[Chain], set[tuple[str, str]]]:
    """The snapshot chains that ended more than ``keep`` seconds before ``now``, and the code
    directories (host, path) still in use by any other snapshot chain."""
    old, used = [], set()
    for chain in chains:
        if not chain.spec.snapshot_commit:
            continue
        if chain.state.final and chain.ended_at is not None and chain.ended_at < now - keep:
            old.append(chain)
        else:
            used.add(_where(chain))
    return old, used


def collect(store: Store, now: float, keep: float) -> Collected:
    """Remove the refs and code directories of the snapshot chains that ended long enough ago."""
    old, used = expired(store.chains(), now, keep)
    done = Collected()
    seen: set[tuple[str, str]] = set(used)
    for chain in old:
        try:
            if snapshot.unpin(chain.spec, chain.id):
                done.refs.append(chain.id)
        except ChainrunError as exc:
            done.problems.append(f"{chain.id}: {exc}")
        where = _where(chain)
        if where in seen:
            continue
        seen.add(where)
        host, path = where
        try:
            if snapshot.remove(transport_for(host or None), chain.spec):
                done.code.append(f"{host}:{path}" if host else path)
        except ChainrunError as exc:
            done.problems.append(f"{chain.id}: {exc}")
    if done.refs or done.code or done.problems:
        log.info("snapshots collected", refs=len(done.refs), code=done.code, problems=done.problems)
    return done


def _where(chain: Chain) -> tuple[str, str]:
    return chain.spec.scheduler.first_host or "", code_root(chain.spec)
