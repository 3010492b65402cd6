"""The sha256 of a checkpoint file: of the whole file, or a tree of chunks hashed side by side.

A whole-file sha256 runs in one thread, and with the CPU's SHA instructions it
still hashes about 1.1 to 1.5 GB/s: slower than the disk of a GPU machine
(issue 38). A *tree* digest cuts the file into ``chunk``-byte pieces (the last
one shorter), takes the sha256 of each, and its root is the sha256 of those
32-byte digests one after the other. The pieces are hashed by a pool of
threads (hashlib releases the GIL), each straight from the page cache through
a read-only mapping of the file (no copy), while the writer goes on writing:
:class:`ChunkHasher`. Restore verifies a tree the same way, and the chunk
digests, kept in the checkpoint's companion, say which piece is corrupt.
A file is hashed with a tree when its record says ``chunk`` > 0; files
recorded with a plain sha256 (chunk 0, every checkpoint written before the
tree) are hashed whole, as before.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Union

if TYPE_CHECKING:
    from concurrent.futures import Future, ThreadPoolExecutor

# The piece a tree digest hashes by itself; recorded beside each digest. A piece is hashed once
# it is written, so the hash trails the writer by up to one piece, and the last one is hashed
# after the last write: 16 MiB keeps that tail near 12 ms (64 MiB: about 50 ms, 12% of a fast
# disk's 500 MB save), and a 4 GiB checkpoint still makes 256 pieces, a 17 kB companion.
CHUNK = 16 << 20
_READ = 1 << 20  # where mmap fails, files are read back in pieces this size (they stay in the CPU cache)
_MAP = 16 << 20  # files are mapped for hashing at most this much at a time
_INLINE = 1 << 20  # a tree's chunk below this is hashed by the caller: no pool for small files
_MAX_WORKERS = 8  # hash threads per file; 8 x ~1.2 GB/s is past any local disk
_HAVE_PREADV = hasattr(os, "preadv")  # missing on some platforms; os.pread is the fallback


class FileDigest(NamedTuple):
    """A file's digest: ``sha256`` of the whole file when ``chunk`` is 0, else the root of its
    tree of ``chunk``-byte pieces, whose own sha256 hex digests are ``chunks`` (when known)."""

    sha256: str
    chunk: int = 0
    chunks: tuple[str, ...] = ()


def root_of(chunks: Sequence[str]) -> str:
    """The root of a tree: the sha256 of its chunk digests (32 bytes each), in order."""
    return hashlib.sha256(b"".join(bytes.fromhex(c) for c in chunks)).hexdigest()


def sha256_file(path: Union[str, os.PathLike[str]]) -> str:
    """The sha256 hex digest of a file's content, hashed from the page cache without a copy."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        hash_range(f.fileno(), h, 0, os.fstat(f.fileno()).st_size)
    return h.hexdigest()


def file_digest(path: Union[str, os.PathLike[str]], chunk: int) -> FileDigest:
    """The digest of a file as it was recorded: whole (``chunk`` 0) or a tree, its chunks
    hashed side by side."""
    if chunk <= 0:
        return FileDigest(sha256_file(path))
    with open(path, "rb", buffering=0) as f:
        hasher = ChunkHasher(f.fileno(), chunk)
        try:
            hasher.seal(os.fstat(f.fileno()).st_size)
            return hasher.digest()
        finally:
            hasher.close()


class StreamDigest:
    """The digest of bytes seen once, in order (``update``), as ``file_digest`` hashes a file:
    whole when ``chunk`` is 0, else a tree of ``chunk``-byte pieces. For bytes passing through
    (a copy between hosts), where no file is there to map."""

    def __init__(self, chunk: int) -> None:
        self._chunk = chunk
        self._hash = hashlib.sha256()  # the whole file, or the piece being filled
        self._filled = 0
        self._chunks: list[str] = []

    def update(self, data: bytes) -> None:
        view = memoryview(data)
        while self._chunk and len(view) >= self._chunk - self._filled:
            take = self._chunk - self._filled
            self._hash.update(view[:take])
            self._chunks.append(self._hash.hexdigest())
            self._hash, self._filled, view = hashlib.sha256(), 0, view[take:]
        self._hash.update(view)
        self._filled += len(view)

    def digest(self) -> FileDigest:
        if not self._chunk:
            return FileDigest(self._hash.hexdigest())
        chunks = (*self._chunks, self._hash.hexdigest()) if self._filled else tuple(self._chunks)
        return FileDigest(root_of(chunks), self._chunk, chunks)


def hash_range(fd: int, h: Any, offset: int, end: int) -> None:
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
    buf = bytearray(min(_READ, end - offset))
    view = memoryview(buf)
    while offset < end:
        n = _pread_into(fd, view[: min(len(buf), end - offset)], offset)
        if n == 0:
            raise OSError(errno.EIO, f"file ended at {offset} bytes while {end} were written")
        h.update(view[:n])
        offset += n


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    if _HAVE_PREADV:
        return os.preadv(fd, [view], offset)
    data = os.pread(fd, view.nbytes, offset)
    view[: len(data)] = data
    return len(data)


def _workers() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))  # what Slurm or taskset left this process
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(_MAX_WORKERS, cpus))


class ChunkHasher:
    """Hashes a file's ``chunk``-byte pieces in a pool of threads as the file grows.

    ``advance(end)`` hands over every piece the first ``end`` bytes complete;
    ``seal(size)`` the last, shorter one (hashed by the caller when small);
    ``digest()`` waits for them all. The pool starts with the first full piece,
    so small files never start a thread. ``close()`` waits for the threads.
    """

    def __init__(self, fd: int, chunk: int) -> None:
        if chunk <= 0:
            raise ValueError(f"chunk={chunk}: a tree digest needs pieces of at least one byte")
        self._fd = fd
        self._chunk = chunk
        self._handed = 0  # bytes handed to the pool or hashed
        self._parts: list[Union[Future[str], str]] = []
        self._pool: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()  # advance() and seal() may come from different threads

    def advance(self, end: int) -> None:
        """The file holds ``end`` bytes now: hash every whole piece among them."""
        with self._lock:
            while self._handed + self._chunk <= end:
                self._hand(self._handed + self._chunk)

    def seal(self, size: int) -> None:
        """The file is complete at ``size`` bytes: hash what is left."""
        self.advance(size)
        with self._lock:
            if self._handed < size:
                self._hand(size)

    def digest(self) -> FileDigest:
        """The tree's root and chunk digests; re-raises a hash thread's error."""
        chunks = tuple(part if isinstance(part, str) else part.result() for part in self._parts)
        return FileDigest(root_of(chunks), self._chunk, chunks)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _hand(self, end: int) -> None:
        start, self._handed = self._handed, end
        if end - start < _INLINE and self._pool is None:
            self._parts.append(self._hash(start, end))
            return
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor  # only files of a chunk or more pay its import

            self._pool = ThreadPoolExecutor(max_workers=_workers(), thread_name_prefix="chainrun-hash")
        self._parts.append(self._pool.submit(self._hash, start, end))

    def _hash(self, start: int, end: int) -> str:
        h = hashlib.sha256()
        hash_range(self._fd, h, start, end)
        return h.hexdigest()


class WholeHasher:
    """A thread that hashes a file whole, from ``start`` up to the offset the writer has reached.

    It hashes what the writer already handed to the kernel, from the page
    cache (``hash_range``), so it never touches the writer's buffers and
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
                hash_range(self._fd, self._hash, offset, end)
                with self._cond:
                    self._hashed = end
                    self._cond.notify_all()
        except BaseException as exc:  # re-raised in the writing thread by finish()
            with self._cond:
                self._error = exc
                self._cond.notify_all()
