"""This machine as a transport: commands through ``subprocess``, files through ``os``.

Commands run without a shell, each in a new session so that a timeout kills
whatever the command started too. Files are written atomically (a private
temporary file, fsync, rename, fsync of the directory).
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import signal
import stat
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from typing import BinaryIO

from chainrun.errors import TransportError
from chainrun.model import CommandResult
from chainrun.transport.base import (
    FileInfo,
    FileRefused,
    check_argv,
    check_file,
    check_read,
    command_name,
    file_error,
    makedirs_with,
    text,
)

__all__ = ["LOCAL", "LocalTransport"]

# Nothing is at a path that is missing, or beneath a file (as SFTP answers both: "no such
# file"); a checkpoint directory's name taken by a file is then said by what writes into it.
_NOTHING_THERE = (FileNotFoundError, NotADirectoryError)


class LocalTransport:
    """This machine: ``subprocess`` without a shell, and ``os`` for files."""

    host: str | None = None

    def run(
        self,
        argv: Sequence[str],
        *,
        input: str | None = None,
        timeout: float = 60.0,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        args = check_argv(argv, env)
        merged = {**os.environ, **env} if env else None
        try:
            # A new session makes the command a process group leader, so a
            # timeout can kill whatever it started too.
            proc = subprocess.Popen(
                args,
                stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=merged,
                start_new_session=True,
            )
        except FileNotFoundError:
            return CommandResult(args, 127, "", _not_found(args[0]))
        except PermissionError:
            return CommandResult(args, 126, "", f"{args[0]}: Permission denied\n")
        try:
            out, err = proc.communicate(input.encode() if input is not None else None, timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise TransportError(
                f"{command_name(args)} did not answer within {timeout:g} s on localhost; it was killed"
            ) from None
        code = proc.returncode
        # Report a death by signal as a shell would (128+N), like the remote side.
        return CommandResult(args, 128 - code if code < 0 else code, text(out), text(err))

    def read_file(self, path: str, limit: int | None = None) -> bytes | None:
        full = os.path.expanduser(path)
        try:
            st = os.lstat(full)  # first: opening a device may do something (a tape rewinds)
        except _NOTHING_THERE:
            return None
        except OSError as e:
            raise file_error("read", path, "localhost", e) from None
        check_file(path, "localhost", st, limit)
        try:
            # O_NOFOLLOW and O_NONBLOCK: should a symlink or a FIFO have taken
            # the file's place since, open neither follows it nor waits for a writer.
            fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
                raise FileRefused(
                    f"cannot read {path} on localhost: it is a symbolic link, not a regular file",
                    reason="a symbolic link",
                ) from None
            raise file_error("read", path, "localhost", e) from None
        with open(fd, "rb") as f:
            try:
                check_file(path, "localhost", os.fstat(fd), limit)
                data = f.read() if limit is None else f.read(limit + 1)
            except OSError as e:
                raise file_error("read", path, "localhost", e) from None
        check_read(path, "localhost", len(data), limit)
        return data

    def write_file(self, path: str, data: bytes, mode: int = 0o600) -> None:
        full = os.path.expanduser(path)
        try:
            tmp = _aside(full, data, mode)
        except OSError as e:
            raise file_error("write", path, "localhost", e) from None
        try:
            os.replace(tmp, full)
        except BaseException as e:
            _unlink_quietly(tmp)
            if isinstance(e, OSError):
                raise file_error("write", path, "localhost", e) from None
            raise
        _fsync_dir(os.path.dirname(full) or ".")

    def listdir(self, path: str) -> list[FileInfo] | None:
        full = os.path.expanduser(path)
        try:
            with os.scandir(full) as entries:
                return sorted((_local_info(e) for e in entries), key=lambda i: i.name)
        except _NOTHING_THERE:
            return None
        except OSError as e:
            raise file_error("list", path, "localhost", e) from None

    def stat(self, path: str) -> FileInfo | None:
        try:
            st = os.lstat(os.path.expanduser(path))
        except _NOTHING_THERE:
            return None
        except OSError as e:
            raise file_error("stat", path, "localhost", e) from None
        name = posixpath.basename(path.rstrip("/"))
        return FileInfo(name, st.st_size, st.st_mtime, stat.S_ISREG(st.st_mode), st.st_mode, st.st_uid)

    def user_id(self) -> int:
        return os.geteuid()

    def makedirs(self, path: str, mode: int = 0o700) -> None:
        full = os.path.expanduser(path)

        def isdir(p: str) -> bool | None:
            try:
                return stat.S_ISDIR(os.stat(p).st_mode)
            except FileNotFoundError:
                return None

        try:
            makedirs_with(full, mode, isdir, os.mkdir, os.chmod, os.path.dirname)
        except OSError as e:
            raise file_error("create directory", path, "localhost", e) from None

    def create_file(self, path: str, data: bytes, mode: int = 0o600) -> bool:
        full = os.path.expanduser(path)
        try:
            tmp = _aside(full, data, mode)
        except OSError as e:
            raise file_error("create", path, "localhost", e) from None
        try:
            os.link(tmp, full)  # whole or not at all, and only where nothing is: a link never replaces
        except FileExistsError:
            return False
        except OSError as e:
            raise file_error("create", path, "localhost", e) from None
        finally:
            _unlink_quietly(tmp)
        _fsync_dir(os.path.dirname(full) or ".")
        return True

    def remove(self, path: str) -> None:
        try:
            os.unlink(os.path.expanduser(path))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise file_error("remove", path, "localhost", e) from None

    def rename(self, path: str, new_path: str, *, replace: bool = False) -> None:
        target = os.path.expanduser(new_path)
        try:
            # os.rename would replace an empty directory or a file at the target.
            if not replace and os.path.lexists(target):
                raise FileExistsError(errno.EEXIST, f"{new_path} exists")
            os.rename(os.path.expanduser(path), target)
        except OSError as e:
            raise file_error("rename", path, "localhost", e) from None
        if replace:
            _fsync_dir(os.path.dirname(target) or ".")

    def open_read(self, path: str) -> _Reader:
        full = os.path.expanduser(path)
        try:
            check_file(path, "localhost", os.lstat(full), None)
            fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise file_error("read", path, "localhost", e) from None
        return _Reader(os.fdopen(fd, "rb"), path)

    def open_new(self, path: str, mode: int = 0o600) -> _Writer:
        full = os.path.expanduser(path)
        try:
            fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            os.fchmod(fd, mode)
        except OSError as e:
            raise file_error("create", path, "localhost", e) from None
        return _Writer(os.fdopen(fd, "wb"), path)

    def close(self) -> None:
        pass


LOCAL = LocalTransport()


class _Reader:
    """A local file read in pieces (``open_read``)."""

    def __init__(self, f: BinaryIO, path: str) -> None:
        self._file, self._path = f, path

    def read(self, size: int) -> bytes:
        try:
            return self._file.read(size)
        except OSError as e:
            raise file_error("read", self._path, "localhost", e) from None

    def close(self) -> None:
        self._file.close()


class _Writer:
    """A new local file written in pieces (``open_new``)."""

    def __init__(self, f: BinaryIO, path: str) -> None:
        self._file, self._path = f, path

    def write(self, data: bytes) -> None:
        try:
            self._file.write(data)
        except OSError as e:
            raise file_error("write", self._path, "localhost", e) from None

    def commit(self, mtime: float | None = None) -> None:
        try:
            self._file.flush()
            if mtime is not None:
                os.utime(self._file.fileno(), (mtime, mtime))
            os.fsync(self._file.fileno())
            self._file.close()
        except OSError as e:
            raise file_error("write", self._path, "localhost", e) from None

    def close(self) -> None:
        with contextlib.suppress(OSError):  # abandoned: the caller removes what is there
            self._file.close()


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # A grandchild that left the group may hold the pipes open: do not read them.
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def _not_found(command: str) -> str:
    if "/" in command:
        return f"{command}: No such file or directory\n"
    return f"{command}: command not found\n"


def _local_info(entry: os.DirEntry[str]) -> FileInfo:
    try:
        st = entry.stat()
    except FileNotFoundError:  # dangling symlink
        st = entry.stat(follow_symlinks=False)
    return FileInfo(entry.name, st.st_size, st.st_mtime, stat.S_ISREG(st.st_mode))


def _aside(full: str, data: bytes, mode: int) -> str:
    """``data`` written whole and durable to a private temp file beside ``full`` (``mode``
    set before any data lands), to be put into place by the caller; its path."""
    directory, base = os.path.split(full)
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=".tmp", dir=directory or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return tmp


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories
    finally:
        os.close(fd)
