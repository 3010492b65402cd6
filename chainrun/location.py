"""Where each checkpoint directory of a submission really is, for its hold (``decide.holds``).

A path on a host is resolved on that host, symlinks followed there. Each host is asked once
per submission, for all the paths on it, by one small Python program over its transport,
which also reads the host's machine id; a host is named by its canonical name (``ssh -G``'s
hostname and port) and by that identity, so that two aliases of one machine, or a host that
is this machine, are seen as one. A host that cannot be asked (down, no ``python3``) keeps
its paths as written and its canonical name: compared as before, never worse. A pool's
path is the one its first host resolves; each of its hosts gives its identity. What is
found is kept in each chain's spec (``checkpoint_real``, ``checkpoint_machines``), so later
submissions compare with it without asking the host again.
"""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Sequence
from dataclasses import replace
from typing import Optional

from chainrun.decide.holds import HERE, hosts, machines
from chainrun.errors import TransportError
from chainrun.localrunner import machine_id
from chainrun.model import JobSpec
from chainrun.transport import canonical_host, transport_for

# Run on a host with the paths (a JSON list) on stdin: prints its machine id ("" when it has
# none) and each path resolved there.
_PROGRAM = """\
import json, os, sys
ident = ""
for name in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
    try:
        with open(name) as f:
            ident = f.read().strip()
    except OSError:
        continue
    if ident.isalnum():
        break
    ident = ""
paths = json.load(sys.stdin)
print(json.dumps([ident, [os.path.realpath(p) for p in paths]]))
"""
_TIMEOUT = 60.0


def locate(specs: Sequence[JobSpec]) -> list[JobSpec]:
    """``specs``, each with where its checkpoint directory really is: the path resolved on its
    host (a pool's first; this machine's resolved here), seen from the machines its hosts are;
    a chain with several places, each place's (``PlaceSpec``)."""
    views = [spec.at(p.name) for spec in specs for p in spec.places]
    found = iter(_locate([*specs, *views]))
    out = [next(found) for _ in specs]
    return [
        replace(
            spec,
            places=tuple(
                replace(
                    p,
                    checkpoint_real=(there := next(found)).checkpoint_real,
                    checkpoint_machines=there.checkpoint_machines,
                )
                for p in spec.places
            ),
        )
        for spec in out
    ]


def _locate(specs: Sequence[JobSpec]) -> list[JobSpec]:
    here = machine_id()
    asked: dict[str, list[str]] = {}
    for spec in specs:
        for host in hosts(spec) if spec.scheduler.remote else ():
            asked.setdefault(host, []).append(spec.checkpoint_dir)
    found = {host: _ask(host, paths) for host, paths in asked.items()}
    out = []
    for spec in specs:
        if not spec.scheduler.remote:
            names = machines(HERE, here, here)
            path = os.path.realpath(spec.checkpoint_dir)
        else:
            names = frozenset().union(
                *(machines(_canonical(host), found[host][0], here) for host in hosts(spec))
            )
            path = found[hosts(spec)[0]][1].get(spec.checkpoint_dir, spec.checkpoint_dir)
        out.append(
            replace(spec, checkpoint_real=posixpath.normpath(path), checkpoint_machines=tuple(sorted(names)))
        )
    return out


def _ask(host: str, paths: list[str]) -> tuple[str, dict[str, str]]:
    """``host``'s machine id ("" unknown) and ``paths`` resolved there (those it could)."""
    try:
        result = transport_for(host).run(
            ["python3", "-c", _PROGRAM], input=json.dumps(paths), timeout=_TIMEOUT
        )
    except TransportError:
        return "", {}
    answer = _parse(result.stdout) if result.ok else None
    if answer is None:
        return "", {}
    identity, real = answer
    return identity, dict(zip(paths, real)) if len(real) == len(paths) else {}


def _parse(stdout: str) -> Optional[tuple[str, list[str]]]:
    """The program's answer, None when it is not one (a login banner is skipped: the last line)."""
    lines = stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else None
    except ValueError:
        return None
    if not (isinstance(answer, list) and len(answer) == 2 and isinstance(answer[0], str)):
        return None
    identity, real = answer
    if not isinstance(real, list) or not all(isinstance(p, str) for p in real):
        return None
    return identity, real


def _canonical(host: str) -> str:
    """``host``'s canonical name; the alias itself where the ssh config cannot be read (the
    submission then fails where it connects, saying why)."""
    try:
        return canonical_host(host)
    except TransportError:
        return host
