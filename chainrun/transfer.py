"""The checkpoint follows: a chain's newest committed checkpoint copied, verified, to another place.

``move_checkpoint(src, src_dir, dst, dst_dir)`` copies what a segment at the
destination needs to resume, and nothing else:

- **With the helper's progress sidecar** (``chainrun-progress.json``): the file it
  names; when that file is a helper's manifest (``*.chainrun.json``: the TensorFlow
  and Hugging Face helpers save several files, or a ``checkpoint-N`` directory, and
  list them there with their size and sha256), every file the manifest lists first,
  then the manifest; then the sidecar, then the fence (``.chainrun-fence``) when the
  source has one. Each file is checked against the digest recorded for it (the
  sidecar's, whole or a tree of chunks as ``sha256_chunk`` says, ``_digest``'s
  scheme), computed as its bytes pass through here. Older retained checkpoints,
  their ``.sha256`` companions (the destination's helper writes the newest one's
  from the sidecar) and temp files stay behind.
- **Without a sidecar** (a script that saves its own files, whose progress chainrun
  reads from the newest file's mtime: ``progress.is_checkpoint_file``): every such
  regular file of the directory (no hidden or temp files, no subdirectories), each
  hashed on the source host before the copy and checked against that as it passes.
  Their mtimes are kept, so progress by mtime neither goes back nor jumps (SFTP
  carries whole seconds: a remote side's mtime may lose its fraction); they are put
  in place oldest first, so the newest, the one progress reads, lands last. Such a
  directory has no commit point: a move cut short among its renames (after every
  file was copied and verified) leaves some files new and some old, each whole, until
  the retry completes it.

No file is used half-written: each is written to a temporary name in ``dst_dir``
(``.<name>.<random>.chainrun-move``, hidden, so progress never counts it), made
durable, and hashed again where it was written (on the destination host, by
``python3`` running ``_digest`` there: the bytes are not pulled back), and only then
renamed into place, replacing a file of that name. The destination's sidecar is
replaced only after every file it names is in place and verified, so until then its
previous checkpoint and sidecar stay valid. A move that fails raises
``TransferError`` (what, where, why) and removes the temp files it can; a move
begins by removing the temp files an interrupted one left, so a retry starts clean.
One move at a time per destination directory, from a source no segment writes to
any more (the service moves a chain's checkpoint between two segments): the sidecar
is read once, at the start, and a file retention deletes under the copy fails it.

The bytes flow through this machine (source -> here -> destination), in pieces of
``piece`` bytes over each transport's streams (``Transport.open_read``,
``open_new``), never a whole file in memory; a copy between two SSH hosts crosses
the network twice. rsync over the same SSH connection, or a copy straight between
the hosts, is a later improvement.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from chainrun.checkpoint import SIDECAR_NAME, _digest, read_progress
from chainrun.checkpoint._digest import FileDigest, StreamDigest
from chainrun.checkpoint._fence import FENCE_NAME, Token
from chainrun.errors import ChainrunError, TransportError
from chainrun.progress import MAX_SIDECAR_BYTES, is_checkpoint_file
from chainrun.transport import Transport

__all__ = ["Moved", "MovedFile", "TransferError", "move_checkpoint"]

PIECE = 1 << 20  # bytes read from the source and written to the destination at a time
MOVE_SUFFIX = ".chainrun-move"  # the temp files of a move: ``.<name>.<random>.chainrun-move``
MANIFEST_SUFFIX = ".chainrun.json"  # the TensorFlow and Hugging Face helpers' manifests
MAX_MANIFEST_BYTES = 16 << 20
_HASH_RATE = 50 << 20  # bytes/s assumed at the least when waiting for a host to hash files


class TransferError(ChainrunError):
    """A checkpoint could not be moved; the destination's previous checkpoint stays in force."""


@dataclass(frozen=True)
class MovedFile:
    """One file moved: its path relative to the checkpoint directory, size and digest."""

    name: str
    size: int
    sha256: str
    chunk: int = 0  # > 0: ``sha256`` is the root of a tree of pieces this size


@dataclass(frozen=True)
class Moved:
    """What a move copied: the files (data first, the sidecar and fence last), their bytes,
    how long it took, and the checkpoint's digest (the sidecar's ``sha256``; None without one)."""

    files: tuple[MovedFile, ...]
    bytes: int
    seconds: float
    digest: Optional[str]


@dataclass(frozen=True)
class _Item:
    name: str  # relative to the checkpoint directory
    size: int
    digest: FileDigest
    mtime: Optional[float] = None  # kept at the destination when set


def move_checkpoint(
    src: Transport,
    src_dir: str,
    dst: Transport,
    dst_dir: str,
    *,
    piece: int = PIECE,
    on_piece: Optional[Callable[[int], None]] = None,
) -> Moved:
    """Copy the newest committed checkpoint of ``src_dir`` (on ``src``) to ``dst_dir`` (on
    ``dst``), verified, as the module says; ``on_piece`` hears the bytes copied so far after
    each piece. Raises TransferError."""
    began = time.monotonic()
    where = f"{_place(src, src_dir)} to {_place(dst, dst_dir)}"
    temps: list[str] = []
    try:
        dst.makedirs(dst_dir)
        _remove_leftovers(dst, dst_dir)
        sidecar = src.read_file(posixpath.join(src_dir, SIDECAR_NAME), limit=MAX_SIDECAR_BYTES)
        items, digest = _plan(src, src_dir, sidecar)
        copied = 0
        placed: list[tuple[str, _Item]] = []
        for item in items:
            temp = _temp_name(dst_dir, item.name)
            temps.append(temp)
            copied = _copy(src, posixpath.join(src_dir, item.name), dst, temp, item, piece, copied, on_piece)
            placed.append((temp, item))
        _verify(dst, placed)
        for temp, item in placed:
            target = posixpath.join(dst_dir, item.name)
            if "/" in item.name:
                dst.makedirs(posixpath.dirname(target))
            dst.rename(temp, target, replace=True)
            temps.remove(temp)
        moved = [MovedFile(i.name, i.size, i.digest.sha256, i.digest.chunk) for i in items]
        if sidecar is not None:  # the commit at the destination: after every file it names
            dst.write_file(posixpath.join(dst_dir, SIDECAR_NAME), sidecar)
            moved.append(_small(SIDECAR_NAME, sidecar))
        fence = src.read_file(posixpath.join(src_dir, FENCE_NAME), limit=MAX_SIDECAR_BYTES)
        if fence is not None:
            dst.write_file(posixpath.join(dst_dir, FENCE_NAME), fence)
            moved.append(_small(FENCE_NAME, fence))
    except (TransportError, _Refused) as e:
        _remove_quietly(dst, temps)
        raise TransferError(f"cannot move the checkpoint from {where}: {e}") from None
    except BaseException:
        _remove_quietly(dst, temps)
        raise
    total = sum(f.size for f in moved)
    return Moved(tuple(moved), total, time.monotonic() - began, digest)


class _Refused(Exception):
    """What is at the source cannot be moved, or did not arrive as it should (internal)."""


def fence_left(transport: Transport, directory: str, chain_id: str, segment: int) -> None:
    """Fence the checkpoint directory a chain moved away from for its ``segment`` at the new
    place: a job of the chain still queued there (its cancel did not reach a scheduler that
    did not answer) is fenced as it starts and trains nothing. Written without the fence's
    lock, which only a segment of the chain starting there right now could race: every one
    there has ended. Raises TransportError."""
    token = Token(chain_id, segment, 0, "").text().encode()
    transport.write_file(posixpath.join(directory, FENCE_NAME), token, mode=0o644)


def _place(transport: Transport, directory: str) -> str:
    return f"{transport.host or 'localhost'}:{directory}"


def _plan(src: Transport, src_dir: str, sidecar: Optional[bytes]) -> tuple[list[_Item], Optional[str]]:
    """The files to move, in the order they are put in place, and the checkpoint's digest."""
    if sidecar is None:
        return _own_files(src, src_dir), None
    try:
        progress = read_progress(sidecar)
    except ValueError as e:
        raise _Refused(str(e)) from None
    name = progress["file"]
    main = _Item(name, progress["size"], FileDigest(progress["sha256"], progress["sha256_chunk"]))
    items = _manifest_files(src, src_dir, name) if name.endswith(MANIFEST_SUFFIX) else []
    return [*items, main], progress["sha256"]


def _manifest_files(src: Transport, src_dir: str, name: str) -> list[_Item]:
    """The files a helper's manifest lists (``files``: name -> size and sha256), under its
    ``directory`` when it names one (Hugging Face's ``checkpoint-N``)."""
    data = src.read_file(posixpath.join(src_dir, name), limit=MAX_MANIFEST_BYTES)
    if data is None:
        raise _Refused(f"the sidecar names {name}, which is missing")
    try:
        manifest = json.loads(data)
        base = manifest.get("directory", "")
        files = [
            _Item(_relative(posixpath.join(base, f)), int(m["size"]), FileDigest(str(m["sha256"])))
            for f, m in manifest["files"].items()
        ]
    except (ValueError, TypeError, KeyError, AttributeError):
        raise _Refused(f"{name} is not a manifest of files with their size and sha256") from None
    return files


def _relative(name: str) -> str:
    if name.startswith("/") or ".." in name.split("/"):
        raise ValueError(name)
    return posixpath.normpath(name)


def _own_files(src: Transport, src_dir: str) -> list[_Item]:
    """A script's own checkpoint files, oldest first, hashed where they are."""
    listed = src.listdir(src_dir)
    if listed is None:
        raise _Refused("the directory is missing")
    files = sorted((f for f in listed if is_checkpoint_file(f)), key=lambda f: (f.mtime, f.name))
    if not files:
        raise _Refused("it holds no checkpoint: no progress sidecar and no regular file")
    paths = [(posixpath.join(src_dir, f.name), 0) for f in files]
    hashed = _hash_there(src, paths, sum(f.size for f in files))
    return [_Item(f.name, size, FileDigest(sha), f.mtime) for f, (sha, size) in zip(files, hashed)]


def _copy(
    src: Transport,
    path: str,
    dst: Transport,
    temp: str,
    item: _Item,
    piece: int,
    copied: int,
    on_piece: Optional[Callable[[int], None]],
) -> int:
    """Stream ``path`` into the new file ``temp``, hashing on the way; the bytes copied in all."""
    digest = StreamDigest(item.digest.chunk)
    size = 0
    reader = src.open_read(path)
    try:
        writer = dst.open_new(temp)
        try:
            while data := reader.read(piece):
                digest.update(data)
                writer.write(data)
                size += len(data)
                copied += len(data)
                if on_piece is not None:
                    on_piece(copied)
            writer.commit(item.mtime)
        finally:
            writer.close()
    finally:
        reader.close()
    if size != item.size:
        raise _Refused(f"{item.name} at the source has {size} bytes where {item.size} were recorded")
    if digest.digest().sha256 != item.digest.sha256:
        raise _Refused(
            f"{item.name} at the source does not match its recorded sha256:"
            " it is corrupt, or changed while it was copied"
        )
    return copied


def _verify(dst: Transport, placed: Sequence[tuple[str, _Item]]) -> None:
    """Hash the files as written, where they were written; each must match its digest."""
    if not placed:
        return
    paths = [(temp, item.digest.chunk) for temp, item in placed]
    found = _hash_there(dst, paths, sum(item.size for _, item in placed))
    for (_, item), (sha, size) in zip(placed, found):
        if size != item.size or sha != item.digest.sha256:
            raise _Refused(f"{item.name} as written at the destination does not match its sha256")


_HASH_MAIN = """
import json as _json, sys as _sys
_found = []
for _path, _chunk in zip(_sys.argv[1::2], _sys.argv[2::2]):
    _path = os.path.expanduser(_path)
    _found.append([file_digest(_path, int(_chunk)).sha256, os.stat(_path).st_size])
print(_json.dumps(_found))
"""


def _hash_there(transport: Transport, files: Sequence[tuple[str, int]], total: int) -> list[tuple[str, int]]:
    """Each file's digest (chunk 0: whole; else a tree) and size, computed on the transport's
    host by ``python3`` running the helper's ``_digest`` module (sent on stdin); ``total``,
    their bytes, sets how long it may take."""
    source = Path(_digest.__file__).read_text() + _HASH_MAIN
    args = [arg for path, chunk in files for arg in (path, str(chunk))]
    timeout = 60.0 + total / _HASH_RATE
    result = transport.run(["python3", "-", *args], input=source, timeout=timeout)
    if not result.ok:
        last = (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1]
        raise _Refused(f"python3 could not hash the files on {transport.host or 'localhost'}: {last}")
    try:
        return [(str(sha), int(size)) for sha, size in json.loads(result.stdout)]
    except (ValueError, TypeError):
        answer = result.stdout[:200]
        raise _Refused(f"python3 on {transport.host or 'localhost'} answered {answer!r}") from None


def _temp_name(dst_dir: str, name: str) -> str:
    return posixpath.join(dst_dir, f".{posixpath.basename(name)}.{secrets.token_hex(6)}{MOVE_SUFFIX}")


def _remove_leftovers(dst: Transport, dst_dir: str) -> None:
    """Remove the temp files an interrupted move left in ``dst_dir``."""
    for info in dst.listdir(dst_dir) or []:
        if info.name.startswith(".") and info.name.endswith(MOVE_SUFFIX):
            dst.remove(posixpath.join(dst_dir, info.name))


def _remove_quietly(dst: Transport, temps: Sequence[str]) -> None:
    """Best effort: on a dead link the next move's ``_remove_leftovers`` does it."""
    for temp in temps:
        try:
            dst.remove(temp)
        except TransportError:
            return


def _small(name: str, data: bytes) -> MovedFile:
    return MovedFile(name, len(data), hashlib.sha256(data).hexdigest())
