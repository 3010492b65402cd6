"""The runners chainrun places on the machines where jobs run, which need no chainrun
installed there: each one zip archive Python runs (``python3 -I FILE.pyz``), holding its
entry module and the modules of chainrun it imports (the standard library besides), the
same bytes for the same chainrun, so that its name can be its hash and none is half new."""

from __future__ import annotations

import functools
import hashlib
import io
import pkgutil
import posixpath
import zipfile
from dataclasses import dataclass


@dataclass(frozen=True)
class Shipped:
    """One runner: ``modules``, paths in the package, the first the one it runs."""

    stem: str
    modules: tuple[str, ...]

    @property
    def entry(self) -> str:
        return "chainrun." + self.modules[0][: -len(".py")].replace("/", ".")

    def data(self) -> bytes:
        return _archive(self.entry, self.modules)

    def name(self) -> str:
        """``STEM-HASH.pyz``: named by its content."""
        return f"{self.stem}-{hashlib.sha256(self.data()).hexdigest()[:16]}.pyz"


# The segment runner, which a batch script runs, with the rules it applies.
SEGMENT_RUNNER = Shipped(
    "runner",
    (
        "node/runner.py",
        "node/carrier.py",
        "node/granted.py",
        "node/proc.py",
        "node/share.py",
        "node/tracking.py",
        "decide/segment.py",
        "decide/goal.py",
        "checkpoint/_fence.py",
        "checkpoint/_ready.py",
        "checkpoint/_tracking.py",
    ),
)
# The carrier (``chainrun.carry``), placed in a chain's run root when its segments may queue
# their successors: what it imports (the SSH transport among them, never used there), and the
# segment runner's modules, which it ships again with each successor it queues.
CARRIER = Shipped(
    "carrier",
    (
        "carry.py",
        "checkpoint/__init__.py",
        "checkpoint/_atomic.py",
        "checkpoint/_digest.py",
        "checkpoint/_clock.py",
        "checkpoint/_fence.py",
        "checkpoint/_progress.py",
        "checkpoint/_ready.py",
        "checkpoint/_seed.py",
        "checkpoint/_store.py",
        "checkpoint/_tracking.py",
        "cluster.py",
        "container.py",
        "decide/__init__.py",
        "decide/carry.py",
        "decide/chain.py",
        "decide/charge.py",
        "decide/facts.py",
        "decide/goal.py",
        "decide/grace.py",
        "decide/placement.py",
        "decide/places.py",
        "decide/retry.py",
        "decide/segment.py",
        "errors.py",
        "fields.py",
        "home.py",
        "localrunner.py",
        "logsetup.py",
        "model.py",
        "places.py",
        "node/carrier.py",
        "node/granted.py",
        "node/proc.py",
        "node/runner.py",
        "node/share.py",
        "node/tracking.py",
        "progress.py",
        "result.py",
        "rundir.py",
        "schedulers/__init__.py",
        "schedulers/base.py",
        "schedulers/local.py",
        "schedulers/script.py",
        "schedulers/segment.py",
        "schedulers/sge.py",
        "schedulers/ship.py",
        "schedulers/slurm.py",
        "schema.py",
        "starts.py",
        "sweep.py",
        "text.py",
        "transport/__init__.py",
        "transport/base.py",
        "transport/local.py",
        "transport/ssh.py",
        "transport/sshconfig.py",
        "transport/sshstream.py",
        "values.py",
    ),
)
# The local runner, copied to each remote workstation of a local scheduler or pool.
LOCAL_RUNNER = Shipped("localrunner", ("localrunner.py", "home.py", "node/proc.py"))


@functools.lru_cache(maxsize=None)  # noqa: UP033 (functools.cache is 3.9's; the carrier runs on 3.8)
def _archive(entry: str, modules: tuple[str, ...]) -> bytes:
    # Each package a module is in, as an empty one: a node needs nothing else of chainrun.
    stubs = {"__init__.py"} | {
        posixpath.join(posixpath.dirname(m), "__init__.py") for m in modules if "/" in m
    }
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:

        def add(name: str, data: bytes) -> None:
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            archive.writestr(info, data)

        add("__main__.py", f"import sys\nfrom {entry} import main\n\nsys.exit(main())\n".encode())
        for stub in sorted(stubs - set(modules)):
            add("chainrun/" + stub, b"")
        for name in modules:
            add("chainrun/" + name, _source(name))
    return buffer.getvalue()


def _source(name: str) -> bytes:
    """A module's bytes, from the installed package or from the archive this runs in
    (pkgutil: ``importlib.resources.files`` is Python 3.9's, and the carrier runs on 3.8)."""
    data = pkgutil.get_data("chainrun", name)
    if data is None:
        raise FileNotFoundError(f"chainrun/{name}")
    return data
