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
every tick, until the sidecar reads well again. A checkpoint directory
without a sidecar is listed every tick only while something happens to the
chain; while its segment just runs, that listing feeds only what ``status``
shows, and it is listed again only when due (``listing_due``: once in a window
of ``listing_every`` seconds, each directory in its own slot of it; the window
grows with the segment's age, from ``PROGRESS_EVERY`` to ``PROGRESS_EVERY_MOST``).
Its directory's mtime cannot stand in for it: a script that saves over its
checkpoint in place (``torch.save`` to the same name) changes the file, not
the directory. While none is there, the sidecar's path is still stat'ed at
each tick of a segment's first ``PROGRESS_EVERY`` seconds (``sidecar_watched``), so a
sidecar that comes then (the first save of a script that uses the helper) is read at once;
one that comes later is found by the directory's next listing. A running chain whose script
saves on its own costs a listing at about 1, 2, 4, 8 ... minutes of its segment, then one an
hour, and nothing between. The module-level
``read`` is a fresh reader for one-off reads, such as at submission.
"""

from __future__ import annotations

import json
import math
import posixpath
import time
import zlib
from dataclasses import dataclass
from typing import Optional, Union

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

# The windows in which a listing of a checkpoint directory without a sidecar stands while its
# chain's segment just runs (``listing_every``): from PROGRESS_EVERY, doubled as the segment
# runs, up to PROGRESS_EVERY_MOST (64 minutes). What ``status`` shows of such a checkpoint may
# be this old.
PROGRESS_EVERY = 60.0
PROGRESS_EVERY_MOST = PROGRESS_EVERY * 64


def listing_window(path: str, at: float, every: float = PROGRESS_EVERY) -> tuple[float, float]:
    """The window of ``every`` seconds that holds ``at``, for the checkpoint directory whose
    progress is read at ``path``: a listing made at ``at`` stands while the clock is in it.
    Each path's windows are shifted by an offset drawn from it, so that directories first
    listed on one tick come due on different ticks after."""
    offset = zlib.crc32(path.encode()) / 2**32 * every
    start = offset + math.floor((at - offset) / every) * every
    return start, start + every


def listing_every(started: Optional[float], now: float) -> float:
    """How long a listing made at ``now`` stands (the ``every`` of its window), for a chain
    whose newest running segment started at ``started`` (None: not known; -inf: none runs,
    so its segments wait in the queue and have no age to go by): ``PROGRESS_EVERY``
    doubled while that is at most the segment's age, up to ``PROGRESS_EVERY_MOST``. Each size
    of window is used for as long as it is long, so a directory is listed at most twice at
    each size: the listings thin out as the segment runs (in windows of 1, 2, 4, 8 ... minutes,
    then of ``PROGRESS_EVERY_MOST``), and those of many chains spread over the ticks. No
    rule reads what they find while the segment runs (a segment is judged on the listing made
    when it ends, and on its end marker), only what ``status`` shows of the checkpoint, and
    whether a sidecar came (a script that uses the helper, saving first after its first
    minute, is followed from up to about its age at that save later)."""
    every = PROGRESS_EVERY
    while (
        started is not None and started > -math.inf and every * 2 <= min(now - started, PROGRESS_EVERY_MOST)
    ):
        every *= 2
    return every


def listing_due(path: str, last: Optional[float], now: float, every: float = PROGRESS_EVERY) -> bool:
    """Whether that directory, last listed at ``last`` (None: never), is due to be listed
    again at ``now``: once the clock has left the window of that listing (``listing_window``)."""
    if last is None:
        return True
    start, until = listing_window(path, last, every)
    return not start <= now < until


def sidecar_watched(started_at: Optional[float], now: float, every: float = PROGRESS_EVERY) -> bool:
    """Whether a chain whose checkpoint directory held no sidecar at its last listing looks
    for one (a ``stat`` of its path) at ``now``, between listings: only in the first ``every``
    seconds of the segment that runs, which started at ``started_at`` (None: not known, so
    yes). A script that uses the helper most often saves first then; a sidecar that comes
    later is found by the directory's next listing, at most a window of ``listing_every``
    after it came, and a script that saves on its own is not looked at between its listings
    at all."""
    return started_at is None or now < started_at + every


@dataclass(frozen=True)
class _Seen:
    """The sidecar as last read: its stat and what it said."""

    size: int
    mtime: float
    settled: bool  # read well after its mtime: the same size and mtime mean the same content
    result: Optional[Progress]


class _Listed:
    """No sidecar: what the checkpoint directory's newest file said when it was last listed,
    and the window in which that listing stands (``listing_window``; None: not known).
    Updated in place (a service lists thousands a minute, and keeps each): memory it holds
    for long is not made anew every minute."""

    __slots__ = ("result", "window")

    def __init__(self, window: Optional[tuple[float, float]], result: Progress) -> None:
        self.window = window
        self.result = result


class ProgressReader:
    """Reads progress tick after tick, re-reading a sidecar only when it changed.

    Keep one per service (it remembers each sidecar by host and path); it is
    not thread-safe.
    """

    def __init__(self) -> None:
        self._seen: dict[tuple[Optional[str], str], Union[_Seen, _Listed]] = {}
        self._reported: dict[tuple[Optional[str], str], set[str]] = {}

    def progress(
        self,
        transport: Transport,
        spec: JobSpec,
        now: Optional[float] = None,
        running: bool = False,
        watched: bool = True,
        every: float = PROGRESS_EVERY,
    ) -> Optional[Progress]:
        """The chain's progress at ``now`` (None: not known); None when the sidecar exists but
        is unreadable. ``running``: the chain's segment just runs (nothing of it ended, nothing
        asked of it), so a checkpoint directory without a sidecar is listed again only when
        due (``listing_due``); until then its last listing stands (one made now, for
        ``every`` seconds: ``listing_every``), and a sidecar is looked for between listings
        only when ``watched`` (``sidecar_watched``)."""
        path = _path(spec)
        key = (transport.host, path)
        seen = self._seen.get(key)
        if isinstance(seen, _Listed):
            if running and now is not None and seen.window and seen.window[0] <= now < seen.window[1]:
                if not watched or not self.present(transport, spec):  # a sidecar that comes: read now
                    return seen.result
            elif not spec.progress_file:  # the listing shows whether a sidecar has come
                files = transport.listdir(spec.checkpoint_dir)
                if not any(f.name == SIDECAR_NAME for f in files or ()):
                    return self._listed(key, files, now, every)
        info = transport.stat(path)
        if info is None:
            return self._listed(key, transport.listdir(spec.checkpoint_dir), now, every)
        if isinstance(seen, _Seen) and seen.settled and (seen.size, seen.mtime) == (info.size, info.mtime):
            return seen.result
        try:
            data = transport.read_file(path, limit=MAX_SIDECAR_BYTES)
        except FileRefused as exc:
            self._remember(key, info, None)
            self._report(key, exc.reason, "progress sidecar refused, counting no new progress", str(exc))
            return None
        if data is None:  # removed since the stat
            return self._listed(key, transport.listdir(spec.checkpoint_dir), now, every)
        try:
            result = _own(data, spec, info) if spec.progress_file else _parse(data)
        except ValueError as exc:
            self._remember(key, info, None)
            self._report(key, str(exc), "progress sidecar unreadable, counting no new progress", str(exc))
            return None
        self._remember(key, info, result)
        self._reported.pop(key, None)
        return result

    def present(self, transport: Transport, spec: JobSpec) -> bool:
        """Whether the chain's sidecar (or its own progress file) is there now: one ``stat``.
        A chain whose directory had none looks for it at every tick while ``sidecar_watched``,
        so that the first segment of a script that uses the helper is followed from its first
        save, not from its directory's next listing up to ``PROGRESS_EVERY`` later."""
        return transport.stat(_path(spec)) is not None

    def standing(self, transport: Transport, spec: JobSpec) -> Optional[tuple[float, float]]:
        """While the clock is in the window returned, ``progress(transport, spec, now,
        running=True)`` gives what it gave last, reading nothing: no sidecar was there at
        the directory's last listing. None: it reads."""
        seen = self._seen.get((transport.host, _path(spec)))
        return seen.window if isinstance(seen, _Listed) else None

    def _listed(
        self,
        key: tuple[Optional[str], str],
        files: Optional[list[FileInfo]],
        now: Optional[float],
        every: float = PROGRESS_EVERY,
    ) -> Progress:
        """The newest checkpoint in ``files`` (the directory's listing, None: no directory),
        kept as listed at ``now``, standing for ``every`` seconds."""
        result = _newest_checkpoint(files or [])
        window = None if now is None else listing_window(key[1], now, every)
        seen = self._seen.get(key)
        if not isinstance(seen, _Listed):
            self._seen[key] = _Listed(window, result)
            return result
        if seen.result != result:
            seen.result = result
        seen.window = window
        return seen.result

    def _remember(self, key: tuple[Optional[str], str], info: FileInfo, result: Optional[Progress]) -> None:
        settled = time.time() - info.mtime >= _SETTLE_S
        self._seen[key] = _Seen(info.size, info.mtime, settled, result)

    def _report(self, key: tuple[Optional[str], str], reason: str, event: str, error: str) -> None:
        reported = self._reported.setdefault(key, set())
        if reason not in reported:
            reported.add(reason)
            host, path = key
            log.warning(event, host=host or "localhost", path=path, error=error)


def _path(spec: JobSpec) -> str:
    """Where the chain's progress is read: the sidecar, or its own file (``progress``)."""
    return spec.progress_file or posixpath.join(spec.checkpoint_dir, SIDECAR_NAME)


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


def _newest_checkpoint(files: list[FileInfo]) -> Progress:
    """Progress by the newest regular file's mtime in a checkpoint directory's listing, for
    scripts that write no sidecar."""
    candidates = [f for f in files if is_checkpoint_file(f)]
    if not candidates:
        return NO_PROGRESS
    newest = max(candidates, key=lambda f: f.mtime)
    return Progress(file=newest.name, saved_at=newest.mtime)
