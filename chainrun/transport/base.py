"""What every transport shares: the ``Transport`` protocol, ``FileInfo`` and ``FileRefused``,
the checks of arguments and of files read, and the wording of their errors. ``local.py``
and ``ssh.py`` build on this; ``chainrun.transport`` exports it with the factory.
"""

from __future__ import annotations

import posixpath
import re
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Callable, Protocol

from chainrun.errors import TransportError
from chainrun.model import CommandResult

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class FileRefused(TransportError):
    """A file is there but is not read: it is not a regular file, or it is over the size limit.

    The message names the path, the host and why; ``reason`` says why in a
    few words that do not change while the file grows ("a FIFO", "larger than
    1 MiB"), for callers that report each problem once.
    """

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class FileInfo:
    """One directory entry. ``listdir`` follows symlinks, as ``stat`` does; ``Transport.stat``
    does not, as ``lstat`` does: there a symlink, FIFO or directory has ``is_file`` False."""

    name: str
    size: int
    mtime: float
    is_file: bool
    mode: int = 0  # st_mode: the type and permission bits
    uid: int = -1  # the owner

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)


class ReadStream(Protocol):
    """A file being read in pieces (``Transport.open_read``); a lost link is a TransportError."""

    def read(self, size: int) -> bytes:
        """Up to ``size`` bytes; b"" at the end of the file."""
        ...

    def close(self) -> None: ...


class WriteStream(Protocol):
    """A new file being written in pieces (``Transport.open_new``); a lost link is a
    TransportError. Nothing is durable until ``commit``; ``close`` alone abandons it as it is
    (the caller removes it)."""

    def write(self, data: bytes) -> None: ...

    def commit(self, mtime: float | None = None) -> None:
        """Flush, set the modification time (when given), fsync and close."""
        ...

    def close(self) -> None: ...


class Transport(Protocol):
    """Where commands run and files live: this machine or one SSH host."""

    host: str | None  # None: this machine

    def run(
        self,
        argv: Sequence[str],
        *,
        input: str | None = None,
        timeout: float = 60.0,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult: ...

    def read_file(self, path: str, limit: int | None = None) -> bytes | None:
        """A regular file's bytes, None when missing; FileRefused for anything else, or over ``limit``."""
        ...

    def write_file(self, path: str, data: bytes, mode: int = 0o600) -> None: ...

    def create_file(self, path: str, data: bytes, mode: int = 0o600) -> bool:
        """Create ``path`` with ``data`` only if nothing is there (exclusively: of two at
        once, one alone succeeds), whole or not at all; False when something was."""
        ...

    def listdir(self, path: str) -> list[FileInfo] | None: ...

    def stat(self, path: str) -> FileInfo | None:
        """What is at ``path`` itself (a symlink is not followed); None when nothing is."""
        ...

    def makedirs(self, path: str, mode: int = 0o700) -> None: ...

    def remove(self, path: str) -> None: ...

    def rename(self, path: str, new_path: str, *, replace: bool = False) -> None:
        """Move a file or directory to ``new_path``, which must not exist (never replaced);
        with ``replace``, a file at ``new_path`` is replaced atomically (POSIX rename)."""
        ...

    def open_read(self, path: str) -> ReadStream:
        """A regular file opened to be read in pieces (FileRefused for anything else);
        TransportError when it is missing or cannot be read."""
        ...

    def open_new(self, path: str, mode: int = 0o600) -> WriteStream:
        """A new file created exclusively at ``path`` (TransportError when something is
        there), to be written in pieces and made durable by ``WriteStream.commit``."""
        ...

    def user_id(self) -> int:
        """The numeric user id commands and files are handled as, there."""
        ...

    def close(self) -> None: ...


# -- what every transport checks and says ------------------------------------


def check_argv(argv: Sequence[str], env: Mapping[str, str] | None) -> tuple[str, ...]:
    """``argv`` as a tuple, refusing one string, an empty list, NUL bytes and bad env names."""
    if isinstance(argv, str):
        raise TypeError("argv must be a sequence of arguments, not one string")
    args = tuple(argv)
    if not args:
        raise ValueError("argv is empty: name the command to run")
    for value in (*args, *(env or {}).values()):
        if "\0" in value:
            raise ValueError(f"argument {value!r} contains a NUL byte, which no command can receive")
    for name in env or {}:
        if not _ENV_NAME.match(name):
            raise ValueError(f"environment variable name {name!r} is not valid: use letters, digits and _")
    return args


def command_name(args: Sequence[str]) -> str:
    return posixpath.basename(args[0])


def text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def oneline(e: BaseException) -> str:
    """An exception's message on one line; an OSError's without its errno."""
    message = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return " ".join(message.split())


def file_error(what: str, path: str, where: str, e: OSError) -> TransportError:
    return TransportError(f"cannot {what} {path} on {where}: {oneline(e)}")


_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class StatLike(Protocol):
    """What ``check_file`` needs of an ``os.stat_result`` or a paramiko ``SFTPAttributes``."""

    @property
    def st_mode(self) -> int | None: ...

    @property
    def st_size(self) -> int | None: ...


def check_file(path: str, where: str, st: StatLike, limit: int | None) -> None:
    """Raise FileRefused unless ``st`` is a regular file of at most ``limit`` bytes."""
    mode = st.st_mode or 0
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), f"of unknown type {mode:o}")
        raise FileRefused(f"cannot read {path} on {where}: it is {kind}, not a regular file", reason=kind)
    size = st.st_size or 0
    if limit is not None and size > limit:
        raise FileRefused(
            f"cannot read {path} on {where}: it is {_bytes(size)}, more than the {_bytes(limit)} allowed",
            reason=f"larger than {_bytes(limit)}",
        )


def check_read(path: str, where: str, length: int, limit: int | None) -> None:
    """Raise FileRefused when more than ``limit`` bytes came back: the file grew while read."""
    if limit is not None and length > limit:
        raise FileRefused(
            f"cannot read {path} on {where}: it grew past the {_bytes(limit)} allowed while it was read",
            reason=f"larger than {_bytes(limit)}",
        )


def _bytes(n: int) -> str:
    """``512 bytes``, ``1 MiB``, ``3.5 GiB``."""
    if n < 1024:
        return f"{n} bytes"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    text = f"{value:.1f}"
    return (text[:-2] if text.endswith(".0") else text) + f" {unit}"  # not removesuffix: Python 3.8


def makedirs_with(
    path: str,
    mode: int,
    isdir: Callable[[str], bool | None],
    mkdir: Callable[[str, int], object],
    chmod: Callable[[str, int], object],
    dirname: Callable[[str], str],
) -> None:
    """Create ``path`` and missing parents, each with exactly ``mode``; existing ones stay as they are.

    The file operations are passed in, so that ``os`` and SFTP share the walk.
    """
    missing: list[str] = []
    current = path.rstrip("/") or "/"
    while current not in ("", ".", "/"):
        found = isdir(current)
        if found is None:
            missing.append(current)
            current = dirname(current)
            continue
        if not found:
            raise NotADirectoryError(20, f"{current} exists and is not a directory")
        break
    for directory in reversed(missing):
        try:
            mkdir(directory, mode)
        except OSError:
            if not isdir(directory):  # lost a race to another creator: fine
                raise
            continue
        chmod(directory, mode)  # mkdir's mode is cut by the umask
