"""Run commands and touch files, on this machine or on a cluster over SSH.

This module is the only place in chainrun that starts processes or opens SSH
connections; everything else builds argv lists and hands them to a
``Transport``. A non-zero exit is a ``CommandResult``, never an exception;
``TransportError`` means the command or file could not be reached at all
(connection refused or dropped, authentication or host key problem, timeout)
and is transient from a chain's point of view. ``run`` never retries a
command that may have started, so a submission cannot happen twice by
accident; file operations are idempotent and reconnect once after a drop.

``read_file`` reads regular files only. Whatever else sits at the path (a
FIFO, whose open would block forever; a directory; a device; a symlink, which
could point at ``/dev/zero``) is refused with ``FileRefused`` before it is
opened, and so is a file larger than the caller's ``limit``; a file that
grows past the limit while it is read is refused too, after at most
``limit + 1`` bytes. A missing file reads as None.

Remote commands go through the user's login shell as ``ssh host cmd`` does,
which hands the string to ``bash -l -c`` so that ``/etc/profile``,
``/etc/profile.d/*`` and ``~/.bash_profile`` (or ``~/.profile``) set PATH the
way an interactive login does: that is where clusters put Slurm and SGE. Every
argument is quoted with ``shlex``; ``env`` becomes ``K=V`` assignments in
front of the command.
"""

from __future__ import annotations

import contextlib
import errno
import getpass
import glob
import os
import posixpath
import re
import secrets
import select
import shlex
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Callable, Protocol, TypeVar

import paramiko
from paramiko.common import cMSG_CHANNEL_REQUEST
from paramiko.message import Message
from paramiko.sftp import CMD_EXTENDED

from chainrun.errors import TransportError

__all__ = [
    "CommandResult",
    "FileInfo",
    "FileRefused",
    "LocalTransport",
    "SSHTransport",
    "Transport",
    "transport_for",
]

T = TypeVar("T")

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_CONNECT_TIMEOUT = 15.0
_KEEPALIVE_S = 30
_SFTP_TIMEOUT = 60.0  # per reply from the server, not per file
_CHUNK = 65536


@dataclass(frozen=True)
class CommandResult:
    """What a finished command returned; a non-zero exit is a result, not an error."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def describe(self) -> str:
        """One line for messages: ``sbatch exited 1: <first line of stderr>``."""
        name = posixpath.basename(self.argv[0]) if self.argv else "command"
        detail = _first_line(self.stderr) or _first_line(self.stdout)
        summary = f"{name} exited {self.returncode}"
        return f"{summary}: {detail}" if detail else summary


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

    def listdir(self, path: str) -> list[FileInfo] | None: ...

    def stat(self, path: str) -> FileInfo | None:
        """What is at ``path`` itself (a symlink is not followed); None when nothing is."""
        ...

    def makedirs(self, path: str, mode: int = 0o700) -> None: ...

    def remove(self, path: str) -> None: ...

    def rename(self, path: str, new_path: str) -> None:
        """Move a file or directory to ``new_path``, which must not exist (never replaced)."""
        ...

    def user_id(self) -> int:
        """The numeric user id commands and files are handled as, there."""
        ...

    def close(self) -> None: ...


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
        args = _check_argv(argv, env)
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
                f"{_name(args)} did not answer within {timeout:g} s on localhost; it was killed"
            ) from None
        code = proc.returncode
        # Report a death by signal as a shell would (128+N), like the remote side.
        return CommandResult(args, 128 - code if code < 0 else code, _text(out), _text(err))

    def read_file(self, path: str, limit: int | None = None) -> bytes | None:
        full = os.path.expanduser(path)
        try:
            st = os.lstat(full)  # first: opening a device may do something (a tape rewinds)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise _file_error("read", path, "localhost", e) from None
        _check_file(path, "localhost", st, limit)
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
            raise _file_error("read", path, "localhost", e) from None
        with open(fd, "rb") as f:
            try:
                _check_file(path, "localhost", os.fstat(fd), limit)
                data = f.read() if limit is None else f.read(limit + 1)
            except OSError as e:
                raise _file_error("read", path, "localhost", e) from None
        _check_read(path, "localhost", len(data), limit)
        return data

    def write_file(self, path: str, data: bytes, mode: int = 0o600) -> None:
        full = os.path.expanduser(path)
        directory, base = os.path.split(full)
        directory = directory or "."
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=".tmp", dir=directory)
        except OSError as e:
            raise _file_error("write", path, "localhost", e) from None
        try:
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), mode)
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, full)
        except BaseException as e:
            _unlink_quietly(tmp)
            if isinstance(e, OSError):
                raise _file_error("write", path, "localhost", e) from None
            raise
        _fsync_dir(directory)

    def listdir(self, path: str) -> list[FileInfo] | None:
        full = os.path.expanduser(path)
        try:
            with os.scandir(full) as entries:
                return sorted((_local_info(e) for e in entries), key=lambda i: i.name)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise _file_error("list", path, "localhost", e) from None

    def stat(self, path: str) -> FileInfo | None:
        try:
            st = os.lstat(os.path.expanduser(path))
        except FileNotFoundError:
            return None
        except OSError as e:
            raise _file_error("stat", path, "localhost", e) from None
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
            _makedirs(full, mode, isdir, os.mkdir, os.chmod, os.path.dirname)
        except OSError as e:
            raise _file_error("create directory", path, "localhost", e) from None

    def remove(self, path: str) -> None:
        try:
            os.unlink(os.path.expanduser(path))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise _file_error("remove", path, "localhost", e) from None

    def rename(self, path: str, new_path: str) -> None:
        target = os.path.expanduser(new_path)
        try:
            # os.rename would replace an empty directory or a file at the target.
            if os.path.lexists(target):
                raise FileExistsError(errno.EEXIST, f"{new_path} exists")
            os.rename(os.path.expanduser(path), target)
        except OSError as e:
            raise _file_error("rename", path, "localhost", e) from None

    def close(self) -> None:
        pass


@dataclass
class _Endpoint:
    """One SSH hop, resolved from the ssh config."""

    alias: str
    hostname: str
    port: int
    user: str
    key_files: list[str]
    identities_only: bool
    known_hosts: list[str]  # global files, then the user's
    user_known_hosts: str  # where ssh would record a newly accepted key
    strict_host_keys: bool
    proxy_command: str | None
    proxy_jump: list[str]
    keepalive: int
    connect_timeout: float

    @property
    def where(self) -> str:
        return f"{self.hostname} port {self.port}"

    @property
    def known_hosts_name(self) -> str:
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"


@dataclass
class _Connection:
    client: paramiko.SSHClient
    jumps: list[paramiko.SSHClient] = field(default_factory=list)
    sftp: paramiko.SFTPClient | None = None

    def alive(self) -> bool:
        t = self.client.get_transport()
        return t is not None and t.is_active()

    def close(self) -> None:
        for closable in (self.sftp, self.client, *reversed(self.jumps)):
            if closable is not None:
                with contextlib.suppress(Exception):  # a dead link may fail to close in any way
                    closable.close()


class _ConnectionLost(Exception):
    """The SSH connection died under an operation (internal: turned into TransportError)."""


class SSHTransport:
    """One host from ``~/.ssh/config`` (or ``$CHAINRUN_SSH_CONFIG``), over paramiko.

    The connection opens on first use and again on the first use after a
    drop. Host keys are checked against the system and user known_hosts files
    (and ``UserKnownHostsFile``); an unknown key is refused unless the config
    says ``StrictHostKeyChecking no``. Keys come from ssh-agent and the
    ``IdentityFile`` entries, as ssh does. ``ProxyJump`` and ``ProxyCommand``
    are honoured. One lock serializes all calls on a transport.
    """

    def __init__(self, host: str) -> None:
        self.host: str | None = host
        self._alias = host
        self._lock = threading.Lock()
        self._conn: _Connection | None = None
        self._uid: int | None = None

    def __repr__(self) -> str:
        return f"SSHTransport({self._alias!r})"

    # -- commands ---------------------------------------------------------

    def run(
        self,
        argv: Sequence[str],
        *,
        input: str | None = None,
        timeout: float = 60.0,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        args = _check_argv(argv, env)
        command = _remote_command(args, env)
        with self._lock:
            chan = self._open_session()
            try:
                chan.exec_command(command)
                code, out, err = self._collect(chan, args, input, timeout)
            except TransportError:
                # A command that does not answer may sit on a connection that
                # died silently: start the next call on a fresh one.
                self._drop()
                raise
            except (paramiko.SSHException, EOFError, OSError, _ConnectionLost) as e:
                self._drop()
                raise TransportError(
                    f"ssh {self._alias}: connection lost while running {_name(args)}"
                    f" ({_oneline(e) or 'closed'}); it may or may not have run"
                ) from None
            finally:
                chan.close()
        return CommandResult(args, code, _text(out), _text(err))

    def _open_session(self) -> paramiko.Channel:
        # Opening a channel sends nothing of the command yet, so a stale
        # connection may be replaced here without any risk of running twice.
        for attempt in (1, 2):
            conn = self._connection()
            transport = conn.client.get_transport()
            try:
                if transport is None:
                    raise _ConnectionLost("no transport")
                return transport.open_session(timeout=_CONNECT_TIMEOUT)
            except (paramiko.SSHException, EOFError, OSError, _ConnectionLost) as e:
                self._drop()
                if attempt == 2:
                    raise TransportError(
                        f"ssh {self._alias}: cannot open a session ({_oneline(e)}); "
                        f"check that `ssh {self._alias} true` works"
                    ) from None
        raise AssertionError("unreachable")

    def _collect(
        self, chan: paramiko.Channel, args: tuple[str, ...], input: str | None, timeout: float
    ) -> tuple[int, bytes, bytes]:
        deadline = time.monotonic() + timeout
        pending = memoryview(input.encode()) if input else None
        if pending is None:
            chan.shutdown_write()
        out: list[bytes] = []
        err: list[bytes] = []
        while True:
            while pending is not None and chan.send_ready():
                pending = pending[chan.send(pending[:_CHUNK]) :]
                if not pending:
                    chan.shutdown_write()
                    pending = None
            while chan.recv_ready():
                out.append(chan.recv(_CHUNK))
            while chan.recv_stderr_ready():
                err.append(chan.recv_stderr(_CHUNK))
            if chan.exit_status_ready() and chan.eof_received:
                if not (chan.recv_ready() or chan.recv_stderr_ready()):
                    return chan.recv_exit_status(), b"".join(out), b"".join(err)
            elif chan.closed:
                raise _ConnectionLost("channel closed without an exit status")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                _kill_remote(chan)
                raise TransportError(
                    f"{_name(args)} did not answer within {timeout:g} s on {self._alias}; it was killed"
                )
            # The channel's fd wakes us for output and close; the short cap
            # covers the exit status and stdin window, which do not signal it.
            select.select([chan], [], [], min(remaining, 0.02 if pending else 0.2))

    # -- files ------------------------------------------------------------

    def read_file(self, path: str, limit: int | None = None) -> bytes | None:
        def read(sftp: paramiko.SFTPClient, p: str) -> bytes | None:
            try:
                # The server's open would block on a FIFO (and the link with
                # it), so only what lstat calls a regular file is opened.
                _check_file(path, self._alias, sftp.lstat(p), limit)
                with sftp.open(p, "rb") as f:
                    attrs = f.stat()  # what was opened, should it have been swapped since
                    _check_file(path, self._alias, attrs, limit)
                    f.prefetch(attrs.st_size or 0)
                    data = bytes(f.read() if limit is None else f.read(limit + 1))
            except FileNotFoundError:
                return None
            _check_read(path, self._alias, len(data), limit)
            return data

        return self._sftp_call("read", path, read)

    def write_file(self, path: str, data: bytes, mode: int = 0o600) -> None:
        def write(sftp: paramiko.SFTPClient, p: str) -> None:
            directory, base = posixpath.split(p)
            tmp = posixpath.join(directory, f".{base}.{secrets.token_hex(6)}.tmp")
            try:
                # 'x' creates it exclusively; the mode is set before any data lands.
                with sftp.open(tmp, "wxb") as f:
                    f.chmod(mode)
                    f.set_pipelined(True)
                    f.write(data)
                    f.flush()
                    _sftp_fsync(sftp, f)
                sftp.posix_rename(tmp, p)
            except BaseException:
                with contextlib.suppress(Exception):  # best effort: the original error matters
                    sftp.remove(tmp)
                raise

        self._sftp_call("write", path, write)

    def listdir(self, path: str) -> list[FileInfo] | None:
        def listdir(sftp: paramiko.SFTPClient, p: str) -> list[FileInfo] | None:
            try:
                attrs = sftp.listdir_attr(p)
            except FileNotFoundError:
                return None
            infos = []
            for a in attrs:
                if stat.S_ISLNK(a.st_mode or 0):
                    with contextlib.suppress(FileNotFoundError):  # dangling: describe the link
                        a = _with_name(sftp.stat(posixpath.join(p, a.filename)), a.filename)
                infos.append(
                    FileInfo(
                        name=a.filename,
                        size=a.st_size or 0,
                        mtime=float(a.st_mtime or 0),
                        is_file=stat.S_ISREG(a.st_mode or 0),
                    )
                )
            return sorted(infos, key=lambda i: i.name)

        return self._sftp_call("list", path, listdir)

    def stat(self, path: str) -> FileInfo | None:
        def lstat(sftp: paramiko.SFTPClient, p: str) -> FileInfo | None:
            try:
                a = sftp.lstat(p)
            except FileNotFoundError:
                return None
            return FileInfo(
                name=posixpath.basename(path.rstrip("/")),
                size=a.st_size or 0,
                mtime=float(a.st_mtime or 0),
                is_file=stat.S_ISREG(a.st_mode or 0),
                mode=a.st_mode or 0,
                uid=-1 if a.st_uid is None else a.st_uid,
            )

        return self._sftp_call("stat", path, lstat)

    def user_id(self) -> int:
        """The remote user's id: the owner of the login directory SFTP starts in."""
        if self._uid is None:

            def home_owner(sftp: paramiko.SFTPClient, p: str) -> int:
                return sftp.stat(p).st_uid or 0

            self._uid = self._sftp_call("stat", "~", home_owner)
        return self._uid

    def makedirs(self, path: str, mode: int = 0o700) -> None:
        def makedirs(sftp: paramiko.SFTPClient, p: str) -> None:
            def isdir(d: str) -> bool | None:
                try:
                    return stat.S_ISDIR(sftp.stat(d).st_mode or 0)
                except FileNotFoundError:
                    return None

            _makedirs(p, mode, isdir, sftp.mkdir, sftp.chmod, posixpath.dirname)

        self._sftp_call("create directory", path, makedirs)

    def remove(self, path: str) -> None:
        def remove(sftp: paramiko.SFTPClient, p: str) -> None:
            with contextlib.suppress(FileNotFoundError):
                sftp.remove(p)

        self._sftp_call("remove", path, remove)

    def rename(self, path: str, new_path: str) -> None:
        remote_new = new_path[2:] if new_path.startswith("~/") else new_path

        def rename(sftp: paramiko.SFTPClient, p: str) -> None:
            # SFTP's own rename (not posix-rename) refuses a target that exists.
            sftp.rename(p, remote_new)

        self._sftp_call("rename", path, rename)

    def _sftp_call(self, what: str, path: str, op: Callable[[paramiko.SFTPClient, str], T]) -> T:
        # SFTP resolves relative paths against the login directory, so "~/x" is "x".
        remote = "." if path == "~" else path[2:] if path.startswith("~/") else path
        with self._lock:
            for attempt in (1, 2):
                conn = self._connection()
                try:
                    if conn.sftp is None:
                        conn.sftp = conn.client.open_sftp()
                        # Without a timeout a request on a silently dead link waits forever.
                        conn.sftp.get_channel().settimeout(_SFTP_TIMEOUT)
                    return op(conn.sftp, remote)
                except (paramiko.SSHException, EOFError, OSError) as e:
                    sftp_chan = conn.sftp.get_channel() if conn.sftp is not None else None
                    dead = (
                        not conn.alive()
                        or sftp_chan is None
                        or sftp_chan.closed
                        or isinstance(e, (socket.timeout, TimeoutError))
                    )
                    if not dead and isinstance(e, OSError):
                        raise _file_error(what, path, self._alias, e) from None
                    self._drop()
                    if attempt == 2:
                        raise TransportError(
                            f"ssh {self._alias}: connection lost twice during {what} {path}"
                            f" ({_oneline(e) or 'closed'}); check that `ssh {self._alias} true` works"
                        ) from None
        raise AssertionError("unreachable")

    # -- connection -------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _connection(self) -> _Connection:
        if self._conn is not None and self._conn.alive():
            return self._conn
        self._drop()
        config, config_path = _load_ssh_config()
        target = _resolve(config, self._alias, config_path)
        # Each ProxyJump hop is resolved through the config too; a hop's own
        # ProxyJump is not followed.
        hops = [_resolve(config, spec, config_path) for spec in target.proxy_jump]
        jumps: list[paramiko.SSHClient] = []
        try:
            sock: object = None
            for hop, nxt in zip(hops, [*hops[1:], target]):
                jumps.append(_connect(hop, sock, config_path))
                sock = _forward(jumps[-1], hop, nxt)
            client = _connect(target, sock, config_path)
        except BaseException:
            for j in reversed(jumps):
                j.close()
            raise
        self._conn = _Connection(client, jumps)
        return self._conn


_LOCAL = LocalTransport()
_ssh_transports: dict[str, SSHTransport] = {}
_cache_lock = threading.Lock()


def transport_for(host: str | None) -> Transport:
    """The transport for ``host``: this machine for None or "", else one SSHTransport per host."""
    if not host:
        return _LOCAL
    with _cache_lock:
        transport = _ssh_transports.get(host)
        if transport is None:
            transport = _ssh_transports[host] = SSHTransport(host)
        return transport


# -- command helpers ---------------------------------------------------------


def _check_argv(argv: Sequence[str], env: Mapping[str, str] | None) -> tuple[str, ...]:
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


def _remote_command(args: tuple[str, ...], env: Mapping[str, str] | None) -> str:
    """The string sshd hands to the login shell: ``exec bash -l -c '<command>'``.

    Assignments in front of the command (not ``env K=V``) leave a missing
    command to bash, which answers 127 "command not found" as it would
    interactively. ``; exit $?`` keeps bash as the parent, so a command killed
    by a signal reads 128+N as in a shell (paramiko reports no exit-signal).
    """
    assignments = [f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()]
    inner = " ".join([*assignments, shlex.join(args)]) + "; exit $?"
    return f"exec bash -l -c {shlex.quote(inner)}"


def _kill_remote(chan: paramiko.Channel) -> None:
    """Send SIGKILL through the channel (RFC 4254 "signal"; paramiko has no call for it).

    OpenSSH's sshd delivers it to the session's process group; closing the
    channel alone would leave the command running. Best effort: a server that
    ignores the request leaves it running.
    """
    m = Message()
    m.add_byte(cMSG_CHANNEL_REQUEST)
    m.add_int(chan.remote_chanid)
    m.add_string("signal")
    m.add_boolean(False)
    m.add_string("KILL")
    with contextlib.suppress(paramiko.SSHException, EOFError, OSError):
        chan.transport._send_user_message(m)


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


def _name(args: Sequence[str]) -> str:
    return posixpath.basename(args[0])


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


def _oneline(e: BaseException) -> str:
    text = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return " ".join(text.split())


# -- file helpers ------------------------------------------------------------


def _file_error(what: str, path: str, where: str, e: OSError) -> TransportError:
    return TransportError(f"cannot {what} {path} on {where}: {_oneline(e)}")


_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class _Stat(Protocol):
    """What ``_check_file`` needs of an ``os.stat_result`` or a paramiko ``SFTPAttributes``."""

    @property
    def st_mode(self) -> int | None: ...

    @property
    def st_size(self) -> int | None: ...


def _check_file(path: str, where: str, st: _Stat, limit: int | None) -> None:
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


def _check_read(path: str, where: str, length: int, limit: int | None) -> None:
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
    return f"{value:.1f}".removesuffix(".0") + f" {unit}"


def _makedirs(
    path: str,
    mode: int,
    isdir: Callable[[str], bool | None],
    mkdir: Callable[[str, int], object],
    chmod: Callable[[str, int], object],
    dirname: Callable[[str], str],
) -> None:
    """Create ``path`` and missing parents, each with exactly ``mode``; existing ones stay as they are."""
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


def _local_info(entry: os.DirEntry[str]) -> FileInfo:
    try:
        st = entry.stat()
    except FileNotFoundError:  # dangling symlink
        st = entry.stat(follow_symlinks=False)
    return FileInfo(entry.name, st.st_size, st.st_mtime, stat.S_ISREG(st.st_mode))


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


def _with_name(attrs: paramiko.SFTPAttributes, name: str) -> paramiko.SFTPAttributes:
    attrs.filename = name
    return attrs


def _sftp_fsync(sftp: paramiko.SFTPClient, f: paramiko.SFTPFile) -> None:
    """Ask the server to fsync (OpenSSH's fsync@openssh.com); skip where unsupported."""
    with contextlib.suppress(OSError):  # no extension: the rename is still atomic
        sftp._request(CMD_EXTENDED, "fsync@openssh.com", f.handle)


# -- SSH connection helpers --------------------------------------------------


def _load_ssh_config() -> tuple[paramiko.SSHConfig, str]:
    """The user's ssh config (or ``$CHAINRUN_SSH_CONFIG``, like ``ssh -F``) and its path.

    As ssh does, the system's /etc/ssh/ssh_config follows the user's file
    (first value wins) unless a file is named explicitly.
    """
    override = os.environ.get("CHAINRUN_SSH_CONFIG")
    path = override or os.path.expanduser("~/.ssh/config")
    if override and not os.path.isfile(override):
        raise TransportError(
            f"CHAINRUN_SSH_CONFIG={override}: no such file; point it at an ssh config or unset it"
        )
    files = [path] if override else [path, "/etc/ssh/ssh_config"]
    try:
        # "Host *" first: a file's leading global lines must not join the
        # previous file's last Host block.
        text = "".join(
            "Host *\n" + _config_text(f, "/etc/ssh" if f.startswith("/etc/ssh/") else "~/.ssh")
            for f in files
            if os.path.isfile(f)
        )
        return paramiko.SSHConfig.from_text(text), path
    except (OSError, paramiko.ssh_exception.ConfigParseError) as e:
        raise TransportError(
            f"cannot read ssh config {path}: {_oneline(e)}; fix it so `ssh` accepts it"
        ) from None


_INCLUDE = re.compile(r"\s*include(?:\s*=\s*|\s+)(.+)", re.IGNORECASE)


def _config_text(path: str, base: str, depth: int = 0) -> str:
    """The file with its ``Include`` lines replaced by the files they name (paramiko lacks Include).

    Relative names are looked up in ``base`` (~/.ssh, or /etc/ssh for the
    system file). An Include inside a Host block is inlined there too, which
    matches ssh as long as the included files start with their own Host lines.
    """
    lines = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            match = _INCLUDE.match(line)
            if match is None or depth >= 16:
                lines.append(line if line.endswith("\n") else line + "\n")
                continue
            for pattern in shlex.split(match.group(1)):
                pattern = os.path.join(os.path.expanduser(base), os.path.expanduser(pattern))
                for included in sorted(glob.glob(pattern)):
                    if os.path.isfile(included):
                        lines.append(_config_text(included, base, depth + 1))
    return "".join(lines)


def _hops(proxy_jump: str | None) -> list[str]:
    if not proxy_jump or proxy_jump.lower() == "none":
        return []
    return [hop.strip() for hop in proxy_jump.split(",") if hop.strip()]


def _resolve(config: paramiko.SSHConfig, spec: str, config_path: str) -> _Endpoint:
    """An alias or ProxyJump hop (``[user@]host[:port]``) resolved through the config."""
    user = port = None
    alias = spec
    if "@" in alias:
        user, alias = alias.rsplit("@", 1)
    if alias.startswith("[") and "]:" in alias:
        alias, port = alias[1:].split("]:", 1)
    elif alias.count(":") == 1:
        alias, port = alias.split(":", 1)
    try:
        opts = config.lookup(alias)
        port_number = int(port or opts.get("port", 22))
        keepalive = int(opts.get("serveraliveinterval") or _KEEPALIVE_S)
        connect_timeout = float(opts.get("connecttimeout") or _CONNECT_TIMEOUT)
    except (ValueError, paramiko.SSHException) as e:
        raise TransportError(f"ssh {spec}: bad setting in {config_path}: {_oneline(e)}") from None
    user_known = opts.get("userknownhostsfile") or "~/.ssh/known_hosts ~/.ssh/known_hosts2"
    global_known = opts.get("globalknownhostsfile") or "/etc/ssh/ssh_known_hosts /etc/ssh/ssh_known_hosts2"
    proxy_command = opts.get("proxycommand")  # paramiko turns "none" into None
    return _Endpoint(
        alias=spec,
        hostname=opts["hostname"],
        port=port_number,
        user=user or opts.get("user") or getpass.getuser(),
        key_files=[os.path.expanduser(k) for k in opts.get("identityfile", [])],
        identities_only=(opts.get("identitiesonly") or "no").lower() == "yes",
        known_hosts=[os.path.expanduser(p) for p in f"{global_known} {user_known}".split()],
        user_known_hosts=user_known.split()[0],
        strict_host_keys=(opts.get("stricthostkeychecking") or "yes").lower() != "no",
        proxy_command=proxy_command if proxy_command and proxy_command.lower() != "none" else None,
        proxy_jump=_hops(opts.get("proxyjump")),
        keepalive=keepalive,
        connect_timeout=connect_timeout,
    )


class _UnknownHostKey(Exception):
    def __init__(self, key: paramiko.PKey) -> None:
        super().__init__("host key not known")
        self.key = key


class _RejectUnknown:
    """paramiko's MissingHostKeyPolicy, by duck typing: refuse, keeping the key for the message."""

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        raise _UnknownHostKey(key)


def _host_key_types(ep: _Endpoint) -> set[str]:
    """Key types known for the host: only those are offered, as OpenSSH prefers.

    Without this paramiko may pick ed25519 when known_hosts holds only the
    host's ECDSA key, and refuse a host that ssh accepts.
    """
    keys = paramiko.HostKeys()
    for path in ep.known_hosts:
        if os.path.isfile(path):
            try:
                keys.load(path)
            except OSError:
                continue
    found = keys.lookup(ep.known_hosts_name) or {}
    types: set[str] = set()
    for name in found:
        types.update(("rsa-sha2-512", "rsa-sha2-256") if name == "ssh-rsa" else (name,))
    return types


def _connect(ep: _Endpoint, via: object, config_path: str) -> paramiko.SSHClient:
    client = paramiko.SSHClient()
    for path in ep.known_hosts:
        if os.path.isfile(path):
            try:
                client.load_system_host_keys(path)  # "system": paramiko never writes them back
            except OSError:
                continue
    client.set_missing_host_key_policy(_RejectUnknown() if ep.strict_host_keys else paramiko.WarningPolicy())
    supported = paramiko.Transport._preferred_keys
    known = _host_key_types(ep) & set(supported)
    disabled = {"keys": [k for k in supported if k not in known]} if known else None
    key_files = [k for k in ep.key_files if os.path.isfile(k)]
    try:
        sock = via if via is not None else _open_socket(ep)
        client.connect(
            ep.hostname,
            port=ep.port,
            username=ep.user,
            key_filename=key_files or None,
            allow_agent=not ep.identities_only,
            look_for_keys=not ep.identities_only and not key_files,
            timeout=ep.connect_timeout,
            banner_timeout=ep.connect_timeout,
            auth_timeout=ep.connect_timeout,
            sock=sock,
            disabled_algorithms=disabled,
        )
    except BaseException as e:
        # paramiko re-raises the last of its attempts, often a key-format
        # complaint; what matters is whether the handshake got as far as auth.
        t = client.get_transport()
        at_auth = (
            t is not None
            and t.is_active()
            and t.host_key is not None  # key exchange done, host key accepted
            and not t.is_authenticated()
        )
        client.close()
        if isinstance(e, TransportError):
            raise
        if isinstance(e, Exception):
            raise TransportError(_connect_message(ep, e, config_path, at_auth)) from None
        raise
    transport = client.get_transport()
    if transport is not None:
        transport.set_keepalive(ep.keepalive)
    return client


def _open_socket(ep: _Endpoint) -> object:
    if ep.proxy_command:
        return paramiko.ProxyCommand(ep.proxy_command)
    try:
        return socket.create_connection((ep.hostname, ep.port), timeout=ep.connect_timeout)
    except socket.gaierror:
        raise TransportError(
            f"ssh {ep.alias}: cannot resolve host name {ep.hostname!r}; "
            "check the name, or its HostName in your ssh config"
        ) from None
    except ConnectionRefusedError:
        raise TransportError(
            f"ssh {ep.alias}: connection refused by {ep.where}; "
            "check that sshd runs there and that HostName/Port in your ssh config are right"
        ) from None
    except (socket.timeout, TimeoutError):
        raise TransportError(
            f"ssh {ep.alias}: no answer from {ep.where} within {ep.connect_timeout:g} s; "
            "check the network or VPN, or raise ConnectTimeout in your ssh config"
        ) from None
    except OSError as e:
        raise TransportError(f"ssh {ep.alias}: cannot connect to {ep.where}: {_oneline(e)}") from None


def _forward(jump: paramiko.SSHClient, hop: _Endpoint, target: _Endpoint) -> paramiko.Channel:
    transport = jump.get_transport()
    try:
        if transport is None:
            raise paramiko.SSHException("jump host connection closed")
        return transport.open_channel(
            "direct-tcpip",
            (target.hostname, target.port),
            ("127.0.0.1", 0),
            timeout=target.connect_timeout,
        )
    except (paramiko.SSHException, EOFError, OSError) as e:
        raise TransportError(
            f"ssh {target.alias}: jump host {hop.alias} cannot reach {target.where} ({_oneline(e)}); "
            f"check `ssh -J {hop.alias} {target.alias} true`"
        ) from None


def _connect_message(ep: _Endpoint, e: Exception, config_path: str, at_auth: bool) -> str:
    default_config = config_path == os.path.expanduser("~/.ssh/config")
    ssh = f"ssh {ep.alias}" if default_config else f"ssh -F {config_path} {ep.alias}"
    if isinstance(e, _UnknownHostKey):
        return (
            f"ssh {ep.alias}: host key of {ep.known_hosts_name} is not known "
            f"({e.key.get_name()} {e.key.fingerprint}); run `{ssh}` once to accept it, "
            f"or add it to {ep.user_known_hosts}"
        )
    if isinstance(e, paramiko.BadHostKeyException):
        return (
            f"ssh {ep.alias}: host key of {ep.known_hosts_name} has CHANGED "
            f"(now {e.key.get_name()} {e.key.fingerprint}); this may be an attack. If the change "
            f"is expected, run `ssh-keygen -R '{ep.known_hosts_name}'` and then `{ssh}` once"
        )
    if isinstance(e, paramiko.PasswordRequiredException):
        return (
            f"ssh {ep.alias}: the key file needs a passphrase; load it into ssh-agent "
            "(`ssh-add`) so chainrun can use it"
        )
    if isinstance(e, paramiko.AuthenticationException) or at_auth:
        return (
            f"ssh {ep.alias}: authentication failed for user {ep.user} at {ep.where}; "
            f"make `{ssh} true` work without a password (ssh-agent or an IdentityFile)"
        )
    if isinstance(e, (socket.timeout, TimeoutError)):
        return (
            f"ssh {ep.alias}: {ep.where} did not complete the SSH handshake "
            f"within {ep.connect_timeout:g} s; check that it is an SSH server"
        )
    return f"ssh {ep.alias}: cannot connect to {ep.where}: {_oneline(e) or type(e).__name__}"
