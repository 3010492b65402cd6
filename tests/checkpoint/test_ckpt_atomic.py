"""atomic_write: all-or-nothing, durable, hashed on the way, and no temp file left behind."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

import pytest
from ckpt_support import no_chainrun_env, restore_signal_handlers  # noqa: F401
from hypothesis import given, settings
from hypothesis import strategies as st

from chainrun.checkpoint import _atomic, _digest, atomic_write, cleanup_temp_files, is_temp_file, sha256_file
from chainrun.checkpoint._digest import file_digest, root_of


def temp_files(directory: Path) -> list[str]:
    return [n for n in os.listdir(directory) if is_temp_file(n)]


def test_atomic_write_replaces_content_and_reports_size_and_sha256(tmp_path: Path) -> None:
    """The file holds exactly the new bytes and the result describes them."""
    target = tmp_path / "state.bin"
    target.write_bytes(b"old")
    written = atomic_write(target, b"new content")
    assert target.read_bytes() == b"new content"
    assert written.path == str(target)
    assert written.size == 11
    assert written.sha256 == hashlib.sha256(b"new content").hexdigest()
    assert temp_files(tmp_path) == []


def test_atomic_write_hashes_large_writes_from_a_writer_callable(tmp_path: Path) -> None:
    """Writes large enough to be cut in pieces and hashed in a thread still give the file's digest."""
    big = os.urandom(40 << 20)

    def writer(f: IO[bytes]) -> None:
        f.write(b"header")
        for _ in range(4):
            f.write(big)
        f.write(memoryview(b"tail"))

    written = atomic_write(tmp_path / "big.bin", writer)
    assert written.size == 6 + 4 * len(big) + 4
    assert written.sha256 == sha256_file(tmp_path / "big.bin")
    assert written.sha256 == hashlib.sha256(b"header" + big * 4 + b"tail").hexdigest()


@settings(max_examples=60, deadline=None)
@given(chunks=st.lists(st.binary(min_size=0, max_size=300), max_size=25))
def test_atomic_write_digest_matches_the_file_for_any_write_pattern(
    chunks: list[bytes], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Small gathered writes, large ones cut in pieces and hashed in a thread add up to the file."""
    directory = tmp_path_factory.mktemp("pattern")
    saved = (_atomic._SMALL, _atomic._PARALLEL, _atomic._PIECE, _digest._MAP)
    # tiny limits: every path runs, and the hash thread maps the file in odd-sized pieces
    _atomic._SMALL, _atomic._PARALLEL, _atomic._PIECE, _digest._MAP = 64, 100, 97, 31
    try:
        written = atomic_write(directory / "f", lambda f: [f.write(c) for c in chunks])
    finally:
        _atomic._SMALL, _atomic._PARALLEL, _atomic._PIECE, _digest._MAP = saved
    whole = b"".join(chunks)
    assert (directory / "f").read_bytes() == whole
    assert written.sha256 == hashlib.sha256(whole).hexdigest()
    assert written.size == len(whole)


def test_atomic_write_hashes_the_bytes_written_even_when_the_writer_reuses_its_buffer(tmp_path: Path) -> None:
    """A serializer that refills one buffer after each write call still gets the file's digest."""
    buffer = bytearray(3 << 20)
    whole = bytearray()

    def writer(f: IO[bytes]) -> None:
        for i in range(6):
            buffer[:] = bytes([i]) * len(buffer)
            f.write(buffer)
            whole.extend(buffer)

    written = atomic_write(tmp_path / "f", writer)
    assert written.sha256 == hashlib.sha256(whole).hexdigest() == sha256_file(tmp_path / "f")


def test_hashing_reads_the_file_where_it_cannot_be_mapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a file system without mmap (ENODEV) the read-back hash and sha256_file read with pread instead."""
    calls = []

    def no_mmap(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        raise OSError(errno.ENODEV, "No such device")

    monkeypatch.setattr(_digest.mmap, "mmap", no_mmap)
    monkeypatch.setattr(_digest, "_READ", 1000)  # several pread pieces, the last one short
    whole = os.urandom(3 << 20) + b"tail"
    written = atomic_write(
        tmp_path / "f", lambda f: [f.write(whole[i : i + (1 << 20)]) for i in range(0, len(whole), 1 << 20)]
    )
    assert calls, "the hash thread never tried to map the file"
    assert written.sha256 == hashlib.sha256(whole).hexdigest() == sha256_file(tmp_path / "f")


def tree(data: bytes, chunk: int) -> str:
    """The root of a tree digest, spelled out: sha256 of each chunk, then of their digests."""
    pieces = [data[i : i + chunk] for i in range(0, len(data), chunk)]
    return hashlib.sha256(b"".join(hashlib.sha256(p).digest() for p in pieces)).hexdigest()


@settings(max_examples=60, deadline=None)
@given(
    chunks=st.lists(st.binary(min_size=0, max_size=300), max_size=25),
    chunk=st.integers(1, 400),
    inline=st.sampled_from([0, 1 << 20]),
)
def test_atomic_write_tree_digest_matches_the_file_for_any_write_pattern(
    chunks: list[bytes], chunk: int, inline: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """With ``chunk``, each piece's sha256 (hashed by the pool, or inline when small) and the
    root over them are those of the bytes on disk, whatever the writes and the chunk size."""
    directory = tmp_path_factory.mktemp("tree")
    saved = (_atomic._SMALL, _atomic._PIECE, _digest._MAP, _digest._INLINE)
    _atomic._SMALL, _atomic._PIECE, _digest._MAP, _digest._INLINE = 64, 97, 31, inline
    try:
        written = atomic_write(directory / "f", lambda f: [f.write(c) for c in chunks], chunk=chunk)
    finally:
        _atomic._SMALL, _atomic._PIECE, _digest._MAP, _digest._INLINE = saved
    whole = b"".join(chunks)
    expected = [hashlib.sha256(whole[i : i + chunk]).hexdigest() for i in range(0, len(whole), chunk)]
    assert (written.size, written.chunk, list(written.chunks)) == (len(whole), chunk, expected)
    assert written.sha256 == tree(whole, chunk) == root_of(expected)
    assert file_digest(directory / "f", chunk) == (written.sha256, chunk, written.chunks)


def test_a_large_tree_digest_is_hashed_by_a_pool_beside_the_write(tmp_path: Path) -> None:
    """Chunks of a large file are hashed by several threads of a pool while it is written; the
    digest is the same as when the file is hashed again on its own, and no thread is left over."""
    data = os.urandom(24 << 20) + b"tail"
    seen: set[str] = set()
    real = _digest.ChunkHasher._hash

    def hash_and_note(self: Any, start: int, end: int) -> str:
        seen.add(threading.current_thread().name)
        return real(self, start, end)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_digest.ChunkHasher, "_hash", hash_and_note)
        written = atomic_write(
            tmp_path / "f",
            lambda f: [f.write(data[i : i + (3 << 20)]) for i in range(0, len(data), 3 << 20)],
            chunk=4 << 20,
        )
    assert written.sha256 == tree(data, 4 << 20) and len(written.chunks) == 7
    assert seen and all(name.startswith("chainrun-hash") for name in seen), seen
    assert file_digest(tmp_path / "f", 4 << 20).sha256 == written.sha256
    assert file_digest(tmp_path / "f", 0).sha256 == hashlib.sha256(data).hexdigest()
    assert [t for t in threading.enumerate() if t.name.startswith("chainrun-hash")] == []


def test_sha256_file_of_an_empty_file(tmp_path: Path) -> None:
    (tmp_path / "empty").write_bytes(b"")
    assert sha256_file(tmp_path / "empty") == hashlib.sha256(b"").hexdigest()


@pytest.mark.parametrize("chunk", [0, 2 << 20])
def test_atomic_write_stops_its_hash_thread_when_the_writer_fails(tmp_path: Path, chunk: int) -> None:
    """A writer that fails after a large write leaves no hash thread (nor pool) running behind it."""

    def writer(f: IO[bytes]) -> None:
        f.write(os.urandom(8 << 20))
        raise RuntimeError("serializer broke")

    with pytest.raises(RuntimeError, match="serializer broke"):
        atomic_write(tmp_path / "f", writer, chunk=chunk)
    assert [t for t in threading.enumerate() if t.name.startswith("chainrun-hash")] == []
    assert temp_files(tmp_path) == []


@pytest.mark.parametrize("error", [RuntimeError("disk on fire"), KeyboardInterrupt()])
def test_atomic_write_keeps_old_file_and_removes_temp_when_writer_fails(
    tmp_path: Path, error: BaseException
) -> None:
    """A failing writer (even Ctrl-C) leaves the old content and no temp file."""
    target = tmp_path / "state.bin"
    target.write_bytes(b"old")

    def writer(f: IO[bytes]) -> None:
        f.write(os.urandom(10 << 20))
        raise error

    with pytest.raises(type(error)):
        atomic_write(target, writer)
    assert target.read_bytes() == b"old"
    assert temp_files(tmp_path) == []


def test_atomic_write_fsyncs_the_file_before_the_rename_and_the_directory_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The order that makes the new content durable before it becomes visible, and the rename durable."""
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("fsync-dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync-file")
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        events.append("rename")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    atomic_write(tmp_path / "x", b"data")
    assert events == ["fsync-file", "rename", "fsync-dir"]


def test_atomic_write_gives_new_files_the_umask_permissions(tmp_path: Path) -> None:
    """Like open(): 0666 minus the umask, not mkstemp's private 0600."""
    old = os.umask(0o022)
    try:
        atomic_write(tmp_path / "x", b"data")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "x").st_mode) == 0o644


def test_atomic_write_rejects_text_with_a_hint(tmp_path: Path) -> None:
    """A str is refused rather than guessed at."""
    with pytest.raises(TypeError, match=r"encode\(\)"):
        atomic_write(tmp_path / "x", "text")  # type: ignore[arg-type]


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_cleanup_removes_temp_files_of_dead_writers_and_keeps_live_ones(tmp_path: Path) -> None:
    """Stale temps of dead local writers and old remote ones go; live and recent remote ones stay."""
    host = _atomic._HOST
    dead = f".ckpt.pt~{host}~{dead_pid()}~ab12{_atomic.TEMP_SUFFIX}"
    mine = f".ckpt.pt~{host}~{os.getpid()}~cd34{_atomic.TEMP_SUFFIX}"
    remote_old = f".ckpt.pt~other-node~123~ef56{_atomic.TEMP_SUFFIX}"
    remote_new = f".ckpt.pt~other-node~124~ef57{_atomic.TEMP_SUFFIX}"
    unrelated = ".ckpt.pt.tmp"
    for name in (dead, mine, remote_old, remote_new, unrelated):
        (tmp_path / name).write_bytes(b"x")
    os.utime(tmp_path / remote_old, (1, 1))
    removed = cleanup_temp_files(tmp_path)
    assert sorted(removed) == sorted([dead, remote_old])
    assert sorted(os.listdir(tmp_path)) == sorted([mine, remote_new, unrelated])


def test_temp_file_names_are_hidden_and_recognised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Temps start with a dot (the service's mtime watch skips them) and is_temp_file knows them."""
    seen: list[str] = []
    real_replace = os.replace

    def replace(src: Any, dst: Any) -> None:
        seen.append(os.path.basename(src))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    atomic_write(tmp_path / "model.pt", b"x")
    assert len(seen) == 1 and seen[0].startswith(".model.pt~") and is_temp_file(seen[0])
    assert not is_temp_file("model.pt")
