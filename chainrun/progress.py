"""Read a chain's progress through its cluster's transport.

The helper's sidecar (``chainrun-progress.json``) is the preferred source,
or, when the job file says ``progress = "FILE:KEY"``, the epoch at KEY in the
script's own JSON file (saved at that file's mtime). Without either, the
newest regular file in the checkpoint directory stands in: a script that
saves with its own ``os.replace`` shows progress by that file's mtime. A
sidecar that cannot be used is reported as unreadable (None), which the
decision logic treats as "no new progress": never a crash or a stall of the
service. That covers one that does not parse, and one that the transport
refuses: anything but a regular file (a FIFO, whose open would block the tick
forever; a symlink, say to ``/dev/zero``; a directory; a device), or a file
over ``MAX_SIDECAR_BYTES``.

The service keeps one ``ProgressReader`` across ticks. It stats the sidecar
(without following a symlink) every tick and reads it again only when its
size or mtime changed, and it logs a problem with a sidecar once, not on
every tick, until the sidecar reads well again. The module-level
``read`` is a fresh reader for one-off reads, such as at submission.
"""

from __future__ import annotations

import json
import math
import posixpath
import time
from dataclasses import dataclass
from typing import Optional

from chainrun.checkpoint import SIDECAR_NAME, read_progress
from chainrun.logsetup import get_logger
from chainrun.model import NO_PROGRESS, JobSpec, Progress
from chainrun.transport import FileInfo, FileRefused, Transport

log = get_logger(__name__)

MAX_SIDECAR_BYTES = 1024 * 1024  # one line of JSON: a real sidecar is a few hundred bytes

# Files a saving script leaves only for a moment, or that are not checkpoints.
_IGNORED_SUFFIXES = (".tmp", ".partial", ".lock", "~")

# A sidecar read less than this long after its mtime is read again at the next
# tick even if its size and mtime are the same: SFTP gives mtimes in whole
# seconds, so a rewrite in the same second may not change them. The margin
# also absorbs some clock skew between this machine and the cluster.
_SETTLE_S = 5.0


@dataclass(frozen=True)
class _Seen:
    """The sidecar as last read: its stat and what it said."""

    size: int
    mtime: float
    settled: bool  # read well after its mtime: the same size and mtime mean the same content
    result: Optional[Progress]


class ProgressReader:
    """Reads progress tick after tick, re-reading a sidecar only when it changed.

    Keep one per service (it remembers each sidecar by host and path); it is
    not thread-safe.
    """

    def __init__(self) -> None:
        self._seen: dict[tuple[Optional[str], str], _Seen] = {}
        self._reported: dict[tuple[Optional[str], str], set[str]] = {}

    def progress(self, transport: Transport, spec: JobSpec) -> Optional[Progress]:
        """The chain's progress now; None when the sidecar exists but is unreadable."""
        path = spec.progress_file or posixpath.join(spec.checkpoint_dir, SIDECAR_NAME)
        key = (transport.host, path)
        info = transport.stat(path)
        if info is None:
            self._seen.pop(key, None)
            return _newest_checkpoint(transport, spec.checkpoint_dir)
        seen = self._seen.get(key)
        if seen is not None and seen.settled and (seen.size, seen.mtime) == (info.size, info.mtime):
            return seen.result
        try:
            data = transport.read_file(path, limit=MAX_SIDECAR_BYTES)
        except FileRefused as exc:
            self._remember(key, info, None)
            self._report(key, exc.reason, "progress sidecar refused, counting no new progress", str(exc))
            return None
        if data is None:  # removed since the stat
            self._seen.pop(key, None)
            return _newest_checkpoint(transport, spec.checkpoint_dir)
        try:
            result = _own(data, spec, info) if spec.progress_file else _parse(data)
        except ValueError as exc:
            self._remember(key, info, None)
            self._report(key, str(exc), "progress sidecar unreadable, counting no new progress", str(exc))
            return None
        self._remember(key, info, result)
        self._reported.pop(key, None)
        return result

    def _remember(self, key: tuple[Optional[str], str], info: FileInfo, result: Optional[Progress]) -> None:
        settled = time.time() - info.mtime >= _SETTLE_S
        self._seen[key] = _Seen(info.size, info.mtime, settled, result)

    def _report(self, key: tuple[Optional[str], str], reason: str, event: str, error: str) -> None:
        reported = self._reported.setdefault(key, set())
        if reason not in reported:
            reported.add(reason)
            host, path = key
            log.warning(event, host=host or "localhost", path=path, error=error)


def read(transport: Transport, spec: JobSpec) -> Optional[Progress]:
    """The chain's progress now, read once; None when the sidecar exists but is unreadable."""
    return ProgressReader().progress(transport, spec)


def _parse(data: bytes) -> Progress:
    fields = read_progress(data)
    return Progress(
        epoch=fields.get("epoch"),
        step=fields.get("step"),
        file=fields.get("file"),
        sha256=fields.get("sha256"),
        saved_at=fields.get("saved_at"),
        done=bool(fields.get("done")),
        segment=fields.get("segment"),
        metrics=tuple(
            (str(k), float(v))
            for k, v in (fields.get("metrics") or {}).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        ),
    )


def _own(data: bytes, spec: JobSpec, info: FileInfo) -> Progress:
    """The epoch at ``progress_key`` in the script's own JSON file, saved when it was written."""
    try:
        value: object = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    for part in spec.progress_key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ValueError(f"no key {spec.progress_key!r} in it (progress = FILE:KEY)")
        value = value[part]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{spec.progress_key} is {value!r}, not a whole number of epochs")
    return Progress(epoch=value, file=posixpath.basename(spec.progress_file or ""), saved_at=info.mtime)


def is_checkpoint_file(info: FileInfo) -> bool:
    """Whether a directory entry counts as a script's own checkpoint: a regular file, neither
    hidden nor a file a saving script leaves only for a moment."""
    return info.is_file and not info.name.startswith(".") and not info.name.endswith(_IGNORED_SUFFIXES)


def _newest_checkpoint(transport: Transport, directory: str) -> Progress:
    """Progress by the newest regular file's mtime, for scripts that write no sidecar."""
    candidates = [f for f in transport.listdir(directory) or [] if is_checkpoint_file(f)]
    if not candidates:
        return NO_PROGRESS
    newest = max(candidates, key=lambda f: f.mtime)
    return Progress(file=newest.name, saved_at=newest.mtime)
