"""Read a chain's progress through its cluster's transport.

The helper's sidecar (``chainrun-progress.json``) is the preferred source.
Without one, the newest file in the checkpoint directory stands in: a script
that saves with its own ``os.replace`` shows progress by that file's mtime.
A sidecar that cannot be parsed is reported as unreadable (None), which the
decision logic treats as "no new progress": never a crash of the service.
"""

from __future__ import annotations

import posixpath
from typing import Optional

import structlog

from chainrun.checkpoint import SIDECAR_NAME, read_progress
from chainrun.model import NO_PROGRESS, JobSpec, Progress
from chainrun.transport import Transport

log = structlog.get_logger(__name__)

# Files a saving script leaves only for a moment, or that are not checkpoints.
_IGNORED_SUFFIXES = (".tmp", ".partial", ".lock", "~")


def progress(transport: Transport, spec: JobSpec) -> Optional[Progress]:
    """The chain's progress now; None when the sidecar exists but is unreadable."""
    path = posixpath.join(spec.checkpoint_dir, SIDECAR_NAME)
    data = transport.read_file(path)
    if data is not None:
        try:
            fields = read_progress(data)
        except ValueError as exc:
            log.warning("progress sidecar unreadable, counting no new progress", path=path, error=str(exc))
            return None
        return Progress(
            epoch=fields.get("epoch"),
            step=fields.get("step"),
            file=fields.get("file"),
            sha256=fields.get("sha256"),
            saved_at=fields.get("saved_at"),
            done=bool(fields.get("done")),
            segment=fields.get("segment"),
        )
    files = transport.listdir(spec.checkpoint_dir) or []
    candidates = [
        f
        for f in files
        if f.is_file and not f.name.startswith(".") and not f.name.endswith(_IGNORED_SUFFIXES)
    ]
    if not candidates:
        return NO_PROGRESS
    newest = max(candidates, key=lambda f: f.mtime)
    return Progress(file=newest.name, saved_at=newest.mtime)
