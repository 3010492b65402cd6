"""Garbage of code snapshots (``chainrun gc``, and the service once a day): the refs
``refs/chainrun/<chain-id>``, each chain's working copy (``.chainrun/<chain-id>/code``) and
the unpacked ``.chainrun/code/<commit>/`` directories of chains that ended more than
``gc_after`` ago (the service config; 7 days by default).

A chain that has not ended, or ended more recently, keeps its ref, and keeps the unpacked
commit it copies from also for every other chain of the same commit (a sweep's chains share
one): nothing an active chain may still start a segment from is ever removed. Before a copy
is removed, what its command left there is brought home to the workdir (``node.share``, run
on the host); a copy that still holds something that could not be is named and kept, and so
is the commit it was copied from. A host that cannot be reached, or a repository that has
gone, is left for the next time.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from chainrun import logsetup, snapshot
from chainrun.errors import ChainrunError, TransportError
from chainrun.model import Chain
from chainrun.node import share
from chainrun.schedulers.segment import code_root, share_settings
from chainrun.store import Store
from chainrun.transport import Transport, transport_for

log = logsetup.get_logger(__name__)

SHARE_SOURCE = Path(share.__file__).read_text()  # run where the code is, by the host's python3
BRING_HOME_TIMEOUT = 600
DEFAULT_AFTER = 7 * 86400
EVERY = 86400  # seconds between the service's collections


@dataclass
class Collected:
    """What one collection removed, and what it could not."""

    refs: list[str] = field(default_factory=list)  # chain ids whose ref was removed
    moved: list[str] = field(default_factory=list)  # what a code directory held, brought home first
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
    old, kept = expired(store.chains(), now, keep)
    done = Collected()
    commits: dict[tuple[str, str], dict[str, str]] = {}
    for chain in old:
        try:
            if snapshot.unpin(chain.spec, chain.id):
                done.refs.append(chain.id)
        except ChainrunError as exc:
            done.problems.append(f"{chain.id}: {exc}")
        settings = share_settings(chain.spec, chain.id)
        assert settings is not None
        where = _where(chain)
        # A chain of an earlier chainrun ran in the unpacked commit itself: its files too.
        commits[where] = {**settings, "copy": where[1]}
        if not _remove(where[0], settings, done):
            kept.add(where)  # the copy stays, and the commit it was copied from
    for where, settings in commits.items():
        if where not in kept:
            _remove(where[0], settings, done)
    if done.refs or done.code or done.problems:
        log.info("snapshots collected", refs=len(done.refs), code=done.code, problems=done.problems)
    return done


def _remove(host: str, settings: dict[str, str], done: Collected) -> bool:
    """Bring home what a code directory (``settings["copy"]``) on ``host`` holds, then remove
    it; False when it stays (something there could not be brought home, or the host could
    not be reached; said in ``done.problems``)."""
    where = settings["copy"]
    try:
        transport = transport_for(host or None)
        if transport.stat(where) is None:
            return True
        if not _brought_home(transport, settings, done):
            return False
        snapshot.remove(transport, where)
    except ChainrunError as exc:
        done.problems.append(f"{settings['chain']}: {exc}")
        return False
    done.code.append(f"{host}:{where}" if host else where)
    return True


def _brought_home(transport: Transport, settings: dict[str, str], done: Collected) -> bool:
    """Bring home what a code directory still holds (``node.share`` on its host); False when
    something stays there (said in ``done.problems``). TransportError when the host cannot
    run it."""
    result = transport.run(
        ["python3", "-I", "-c", SHARE_SOURCE, json.dumps(settings)], timeout=BRING_HOME_TIMEOUT
    )
    try:
        answer = json.loads(result.stdout) if result.ok else None
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise TransportError(f"bringing home what {settings['copy']} holds failed: {result.describe()}")
    done.moved += [str(p) for p in answer.get("moved", [])]
    done.moved += [f"{p} (beside the workdir's own)" for p in answer.get("beside", [])]
    left = [str(p) for p in answer.get("left", [])]
    if left:
        done.problems.append(
            f"kept {settings['copy']}: {len(left)} of its files could not be brought home to "
            f"{settings['workdir']} ({'; '.join(left[:3])}); move them, then run gc again"
        )
    return not left


def _where(chain: Chain) -> tuple[str, str]:
    return chain.spec.scheduler.first_host or "", code_root(chain.spec)
