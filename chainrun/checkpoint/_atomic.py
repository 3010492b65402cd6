"""Crash-proof file writes: temp file in the same directory, fsync, rename, fsync the directory.

A reader sees either the old file or the complete new one, never a torn
write, whatever moment the writer is killed at. The sha256 of what is written
is computed on the way: a helper thread hashes the bytes right behind the
writer, straight from the page cache through a read-only mapping of the file
(no copy), so hashing overlaps the writing and the final fsync, and callers
never read a large file twice. Temp files carry the
writer's host and pid in their name, so a later run can tell a dead writer's
leftovers from a live writer's work in progress.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import re
import threading
from typing import IO, Any, Callable, NamedTuple, Optional, Union, cast

TEMP_SUFFIX = ".chainrun-tmp"
_TEMP_RE = re.compile(
    r"^\.(?P<base>.*)~(?P<host>[A-Za-z0-9.-]*)~(?P<pid>\d+)~[0-9a-f]+" + re.escape(TEMP_SUFFIX) + "$"
)
_HOST = re.sub(r"[^A-Za-z0-9.-]", "-", os.uname().nodename)[:64]
_CHUNK = 1 << 20  # where mmap fails, files are read back in pieces this size (they stay in the CPU cache)
_MAP = 16 << 20  # files are mapped for hashing at most this much at a time
_SMALL = 256 << 10  # writes below this are gathered before reaching the kernel
_PARALLEL = 1 << 20  # a file that grows past this is hashed by a helper thread reading it back
_PIECE = 4 << 20  # large writes go to the kernel in pieces this size, so hashing can follow closely
_HAVE_PREADV = hasattr(os, "preadv")  # missing on some platforms; os.pread is the fallback

Writer = Callable[[IO[bytes]], Any]


class Written(NamedTuple):
    """What ``atomic_write`` put on disk: final path, size in bytes, sha256 hex digest."""

    path: str
    size: int
    sha256: str


def atomic_write(
    path: Union[str, os.PathLike[str]],
    data_or_writer: Union[bytes, bytearray, memoryview, Writer],
    *,
    fsync: bool = True,
    before_replace: Optional[Callable[[], None]] = None,
) -> Written:
    """Write ``path`` so that it is either untouched or complete, and durable once this returns.

    ``data_or_writer`` is bytes, or a callable that receives a binary file
    object (``write``, ``flush``, ``tell``) and writes into it, e.g.
    ``lambda f: torch.save(state, f)``. The temp file is removed on any error,
    including KeyboardInterrupt; only SIGKILL can leave one, and
    :func:`cleanup_temp_files` removes those of dead writers later.
    ``before_replace``, when given, is called once the temp file is durable, right before
    the rename: when it raises, the rename is not made (the fence of a commit).
    """
    if isinstance(data_or_writer, str):
        raise TypeError("atomic_write needs bytes or a writer callable, got str: pass text.encode()")
    target = os.path.abspath(os.fspath(path))
    directory, base = os.path.split(target)
    if not base:
        raise ValueError(f"atomic_write needs a file path, got directory {target!r}")
    fd, temp = _create_temp(directory, base)
    try:
        sink = _Sink(fd)
        try:
            if callable(data_or_writer):
                data_or_writer(cast(IO[bytes], sink))
            else:
                sink.write(data_or_writer)
            sink.flush()
            if fsync:
                os.fsync(fd)
            digest = sink.digest()
        finally:
            sink.close()
            os.close(fd)
        if before_replace is not None:
            before_replace()
        os.replace(temp, target)
        if fsync:
            fsync_dir(directory)
    except BaseException:
        _unlink_quietly(temp)
        raise
    return Written(target, sink.size, digest)


def fsync_dir(directory: Union[str, os.PathLike[str]]) -> None:
    """Make the directory's entries (a rename, a new file) durable; a no-op where unsupported."""
    fd = os.open(os.fspath(directory), os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some network file systems refuse fsync on a directory; their
        # renames are synchronous with the server anyway.
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def fsync_file(path: Union[str, os.PathLike[str]]) -> None:
    """Flush a file someone else wrote (TensorFlow, the user) to stable storage."""
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Union[str, os.PathLike[str]]) -> str:
    """The sha256 hex digest of a file's content, hashed from the page cache without a copy."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        _hash_range(f.fileno(), h, 0, os.fstat(f.fileno()).st_size)
    return h.hexdigest()


def _hash_range(fd: int, h: Any, offset: int, end: int) -> None:
    """Add bytes ``offset`` to ``end`` of a file (which holds at least ``end`` bytes) to ``h``.

    Mapped read-only, the page cache's pages are hashed where they are:
    reading them into a buffer first (pread) costs a copy of every byte, which
    made read-back hashing about 1.6x as costly on the benchmark machine
    (benchmarks/README.md). A file system that cannot map files is read with
    pread instead. hashlib releases the GIL on large buffers.
    """
    while offset < end:
        stop = min(end, offset + _MAP)
        base = offset - offset % mmap.ALLOCATIONGRANULARITY
        try:
            mapped = mmap.mmap(fd, stop - base, access=mmap.ACCESS_READ, offset=base)
        except OSError:
            _hash_read(fd, h, offset, end)
            return
        with mapped, memoryview(mapped) as view, view[offset - base :] as piece:
            h.update(piece)
        offset = stop


def _hash_read(fd: int, h: Any, offset: int, end: int) -> None:
    buf = bytearray(min(_CHUNK, end - offset))
    view = memoryview(buf)
    while offset < end:
        n = _pread_into(fd, view[: min(len(buf), end - offset)], offset)
        if n == 0:
            raise OSError(errno.EIO, f"file ended at {offset} bytes while {end} were written")
        h.update(view[:n])
        offset += n


def is_temp_file(name: str) -> bool:
    """True for the name of an ``atomic_write`` temp file (finished or not)."""
    return _TEMP_RE.match(name) is not None


def cleanup_temp_files(directory: Union[str, os.PathLike[str]], *, max_age: float = 3600.0) -> list[str]:
    """Remove temp files that no live writer owns; returns the names removed.

    A temp file is stale when its writer ran on this host and is gone, or when
    it was written on another host and is older than ``max_age`` seconds
    (a shared file system cannot see other hosts' processes).
    """
    import time

    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    now = time.time()
    for name in names:
        m = _TEMP_RE.match(name)
        if m is None:
            continue
        path = os.path.join(directory, name)
        pid = int(m.group("pid"))
        if m.group("host") == _HOST:
            if pid == os.getpid() or _alive(pid):
                continue
        else:
            try:
                if now - os.stat(path).st_mtime < max_age:
                    continue
            except FileNotFoundError:
                continue
        if _unlink_quietly(path):
            removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, owned by someone else
    return True


def _create_temp(directory: str, base: str) -> tuple[int, str]:
    prefix = f".{base[:100]}~{_HOST}~{os.getpid()}~"
    for _ in range(100):
        temp = os.path.join(directory, prefix + os.urandom(6).hex() + TEMP_SUFFIX)
        try:
            # 0o666 and no fchmod: the file gets the user's umask, like open().
            return os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666), temp
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a unique temp file for {base!r} in {directory!r}")


def _unlink_quietly(path: str) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


class _Sink:
    """The binary file object handed to writer callables: gathers small writes, hashes everything.

    Bytes go to the kernel as they come (a large write in pieces), and a
    helper thread hashes the file behind them, reading back what the page
    cache already holds, so neither waits for the other: the hash runs on
    another core while this thread writes and then while ``fsync`` waits for
    the disk. Small files never start the thread. A buffer is only used
    during the ``write`` call that passed it, as for any file object.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._pending = bytearray()
        self._hash = hashlib.sha256()
        self._hasher: Optional[_Hasher] = None
        self.size = 0  # bytes accepted from the writer
        self._written = 0  # bytes handed to the kernel

    # The small file-object surface torch.save, pickle and numpy use.
    def write(self, data: Union[bytes, bytearray, memoryview]) -> int:
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        n = view.nbytes
        self.size += n
        if n < _SMALL:
            self._pending += view
            if len(self._pending) >= _SMALL:
                self.flush()
        else:
            self.flush()
            for start in range(0, n, _PIECE):
                self._to_kernel(view[start : start + _PIECE])
        return n

    def flush(self) -> None:
        if self._pending:
            with memoryview(self._pending) as view:
                self._to_kernel(view)
            self._pending.clear()

    def tell(self) -> int:
        return self.size

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    @property
    def closed(self) -> bool:
        return False

    def _to_kernel(self, view: memoryview) -> None:
        n = view.nbytes
        done = 0
        while done < n:
            done += os.write(self._fd, view[done:])
        self._written += n
        if self._hasher is not None:
            self._hasher.advance(self._written)
        elif self._written < _PARALLEL:
            self._hash.update(view)
        else:  # from here on the file is hashed by reading it back
            self._hasher = _Hasher(self._fd, self._hash, self._written - n, self._written)

    def digest(self) -> str:
        """The sha256 of everything written; waits for the helper thread to catch up."""
        if self._hasher is not None:
            self._hasher.finish(self._written)
        return self._hash.hexdigest()

    def close(self) -> None:
        if self._hasher is not None:
            self._hasher.stop()
            self._hasher = None


class _Hasher:
    """A thread that hashes a file from ``start`` up to the offset the writer has reached.

    It hashes what the writer already handed to the kernel, from the page
    cache (``_hash_range``), so it never touches the writer's buffers and
    never holds the writer up.
    """

    def __init__(self, fd: int, h: Any, start: int, end: int) -> None:
        self._fd = fd
        self._hash = h
        self._hashed = start
        self._end = end
        self._error: Optional[BaseException] = None
        self._stopping = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="chainrun-hash", daemon=True)
        self._thread.start()

    def advance(self, end: int) -> None:
        """The file now holds ``end`` bytes: hash up to there."""
        with self._cond:
            self._end = end
            self._cond.notify_all()

    def finish(self, end: int) -> None:
        """Wait until the first ``end`` bytes are hashed; re-raises the thread's error."""
        with self._cond:
            while self._hashed < end and self._error is None:
                self._cond.wait()
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while self._hashed >= self._end and not self._stopping:
                        self._cond.wait()
                    if self._stopping:
                        return
                    offset, end = self._hashed, self._end
                _hash_range(self._fd, self._hash, offset, end)
                with self._cond:
                    self._hashed = end
                    self._cond.notify_all()
        except BaseException as exc:  # re-raised in the writing thread by finish()
            with self._cond:
                self._error = exc
                self._cond.notify_all()


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    if _HAVE_PREADV:
        return os.preadv(fd, [view], offset)
    data = os.pread(fd, view.nbytes, offset)
    view[: len(data)] = data
    return len(data)
