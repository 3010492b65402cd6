"""Crash-proof file writes: temp file in the same directory, fsync, rename, fsync the directory.

A reader sees either the old file or the complete new one, never a torn
write, whatever moment the writer is killed at. The digest of what is written
is computed on the way (``_digest``): hashing threads read the bytes right
behind the writer, straight from the page cache through a read-only mapping of
the file (no copy), so hashing overlaps the writing and the final fsync, and
callers never read a large file twice. With ``chunk`` the digest is a tree of
pieces hashed side by side; without, one sha256 of the whole file. Temp files
carry the writer's host and pid in their name, so a later run can tell a dead
writer's leftovers from a live writer's work in progress.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
from typing import IO, Any, Callable, NamedTuple, Optional, Union, cast

from chainrun.checkpoint._digest import ChunkHasher, FileDigest, WholeHasher

TEMP_SUFFIX = ".chainrun-tmp"
_TEMP_RE = re.compile(
    r"^\.(?P<base>.*)~(?P<host>[A-Za-z0-9.-]*)~(?P<pid>\d+)~[0-9a-f]+" + re.escape(TEMP_SUFFIX) + "$"
)
_HOST = re.sub(r"[^A-Za-z0-9.-]", "-", os.uname().nodename)[:64]
_SMALL = 256 << 10  # writes below this are gathered before reaching the kernel
_PARALLEL = 1 << 20  # a file that grows past this is hashed by a helper thread reading it back
_PIECE = 4 << 20  # large writes go to the kernel in pieces this size, so hashing can follow closely

Writer = Callable[[IO[bytes]], Any]


class Written(NamedTuple):
    """What ``atomic_write`` put on disk: final path, size in bytes, sha256 hex digest (of the
    whole file, or with ``chunk`` the root of its tree, whose chunk digests are ``chunks``)."""

    path: str
    size: int
    sha256: str
    chunk: int = 0
    chunks: tuple[str, ...] = ()


def atomic_write(
    path: Union[str, os.PathLike[str]],
    data_or_writer: Union[bytes, bytearray, memoryview, Writer],
    *,
    fsync: bool = True,
    before_replace: Optional[Callable[[], None]] = None,
    chunk: int = 0,
) -> Written:
    """Write ``path`` so that it is either untouched or complete, and durable once this returns.

    ``data_or_writer`` is bytes, or a callable that receives a binary file
    object (``write``, ``flush``, ``tell``) and writes into it, e.g.
    ``lambda f: torch.save(state, f)``. The temp file is removed on any error,
    including KeyboardInterrupt; only SIGKILL can leave one, and
    :func:`cleanup_temp_files` removes those of dead writers later.
    ``before_replace``, when given, is called once the temp file is durable, right before
    the rename: when it raises, the rename is not made (the fence of a commit).
    ``chunk`` > 0 makes the digest a tree of ``chunk``-byte pieces hashed side by side
    (``_digest``); 0, one sha256 of the whole file.
    """
    if isinstance(data_or_writer, str):
        raise TypeError("atomic_write needs bytes or a writer callable, got str: pass text.encode()")
    target = os.path.abspath(os.fspath(path))
    directory, base = os.path.split(target)
    if not base:
        raise ValueError(f"atomic_write needs a file path, got directory {target!r}")
    fd, temp = _create_temp(directory, base)
    try:
        sink = _Sink(fd, chunk)
        try:
            if callable(data_or_writer):
                data_or_writer(cast(IO[bytes], sink))
            else:
                sink.write(data_or_writer)
            sink.seal()  # the last bytes to the kernel and their hash under way, beside the fsync
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
    return Written(target, sink.size, *digest)


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

    Bytes go to the kernel as they come (a large write in pieces), and hashing
    threads hash the file behind them, reading back what the page cache
    already holds, so neither waits for the other: the hash runs on other
    cores while this thread writes and then while ``fsync`` waits for the
    disk. A whole-file sha256 is one thread (small files never start it); a
    tree (``chunk``) a pool, each of its threads on a piece of its own. A
    buffer is only used during the ``write`` call that passed it, as for any
    file object.
    """

    def __init__(self, fd: int, chunk: int = 0) -> None:
        self._fd = fd
        self._pending = bytearray()
        self._hash = hashlib.sha256()
        self._whole: Optional[WholeHasher] = None
        self._tree = ChunkHasher(fd, chunk) if chunk > 0 else None
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
        if self._tree is not None:
            self._tree.advance(self._written)
        elif self._whole is not None:
            self._whole.advance(self._written)
        elif self._written < _PARALLEL:
            self._hash.update(view)
        else:  # from here on the file is hashed by reading it back
            self._whole = WholeHasher(self._fd, self._hash, self._written - n, self._written)

    def seal(self) -> None:
        """Everything is written: the last bytes go to the kernel and a tree's last piece to its hashers."""
        self.flush()
        if self._tree is not None:
            self._tree.seal(self._written)

    def digest(self) -> FileDigest:
        """The digest of everything written; waits for the hashing threads to catch up."""
        if self._tree is not None:
            return self._tree.digest()
        if self._whole is not None:
            self._whole.finish(self._written)
        return FileDigest(self._hash.hexdigest())

    def close(self) -> None:
        if self._tree is not None:
            self._tree.close()
        if self._whole is not None:
            self._whole.stop()
            self._whole = None
