"""One cluster host as a transport, over paramiko: commands on a session channel, files over SFTP.

Remote commands go through the user's login shell as ``ssh host cmd`` does,
which hands the string to ``bash -l -c`` so that ``/etc/profile``,
``/etc/profile.d/*`` and ``~/.bash_profile`` (or ``~/.profile``) set PATH the
way an interactive login does: that is where clusters put Slurm and SGE. Every
argument is quoted with ``shlex``; ``env`` becomes ``K=V`` assignments in
front of the command. Where to connect and how comes from the OpenSSH config
(``sshconfig.py``). ``forward`` carries a local port to an address on the
host (``direct-tcpip``, as ``ssh -L``), across reconnects. This module,
``sshconfig.py`` and ``sshstream.py`` (files written aside, or in pieces) are the only
ones that import paramiko; ``chainrun.transport`` loads them when a chain has a host.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import select
import shlex
import socket
import stat
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import paramiko
from paramiko.common import cMSG_CHANNEL_REQUEST
from paramiko.message import Message

from chainrun.errors import TransportError
from chainrun.model import CommandResult
from chainrun.transport.base import (
    FileInfo,
    check_argv,
    check_file,
    check_read,
    command_name,
    file_error,
    makedirs_with,
    oneline,
    text,
)
from chainrun.transport.sshconfig import (
    CONNECT_TIMEOUT,
    Endpoint,
    UnknownHostKey,
    connect_message,
    host_key_types,
    load_config,
    resolve,
)
from chainrun.transport.sshstream import SFTPReader, SFTPWriter, sftp_aside

__all__ = ["PortForward", "SSHTransport"]

T = TypeVar("T")

_SFTP_TIMEOUT = 60.0  # per reply from the server, not per file
_CHUNK = 65536
_FORWARD_STEP = 0.5  # seconds between looks at whether a forward was closed


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
        args = check_argv(argv, env)
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
                    f"ssh {self._alias}: connection lost while running {command_name(args)}"
                    f" ({oneline(e) or 'closed'}); it may or may not have run"
                ) from None
            finally:
                chan.close()
        return CommandResult(args, code, text(out), text(err))

    def _open_session(self) -> paramiko.Channel:
        return self._open_channel("a session", lambda t: t.open_session(timeout=CONNECT_TIMEOUT))

    def _open_channel(
        self, what: str, opener: Callable[[paramiko.Transport], paramiko.Channel]
    ) -> paramiko.Channel:
        """A new channel from ``opener``, on a fresh connection if the current one is dead.

        Called with the lock held. Opening a channel sends nothing through it yet,
        so a stale connection may be replaced here without any risk of running a
        command twice. A channel the server refuses (``ChannelException``) leaves a
        sound connection as it is."""
        for attempt in (1, 2):
            conn = self._connection()
            transport = conn.client.get_transport()
            try:
                if transport is None:
                    raise _ConnectionLost("no transport")
                return opener(transport)
            except paramiko.ChannelException as e:
                reason = e.text or oneline(e)  # the server's own words: "Connect failed", "open failed"
                raise TransportError(f"ssh {self._alias}: the server refused {what} ({reason})") from None
            except (paramiko.SSHException, EOFError, OSError, _ConnectionLost) as e:
                self._drop()
                if attempt == 2:
                    raise TransportError(
                        f"ssh {self._alias}: cannot open {what} ({oneline(e)}); "
                        f"check that `ssh {self._alias} true` works"
                    ) from None
        raise AssertionError("unreachable")

    # -- port forwarding --------------------------------------------------

    def forward(
        self,
        remote: tuple[str, int],
        local_port: int = 0,
        on_change: Callable[[str | None], None] | None = None,
    ) -> PortForward:
        """Listen on 127.0.0.1:``local_port`` (0: a free port) and carry each connection made
        there to ``remote`` (an address as the host sees it) over a ``direct-tcpip`` channel.

        OSError when the local port cannot be bound. See ``PortForward``."""
        return PortForward(self, remote, local_port, on_change)

    def _open_direct(self, remote: tuple[str, int], origin: tuple[str, int]) -> paramiko.Channel:
        host, port = remote
        with self._lock:
            return self._open_channel(
                f"a connection to {host}:{port}",
                lambda t: t.open_channel("direct-tcpip", remote, origin, timeout=CONNECT_TIMEOUT),
            )

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
                    f"{command_name(args)} did not answer within {timeout:g} s on {self._alias};"
                    " it was killed"
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
                check_file(path, self._alias, sftp.lstat(p), limit)
                with sftp.open(p, "rb") as f:
                    attrs = f.stat()  # what was opened, should it have been swapped since
                    check_file(path, self._alias, attrs, limit)
                    f.prefetch(attrs.st_size or 0)
                    data = bytes(f.read() if limit is None else f.read(limit + 1))
            except FileNotFoundError:
                return None
            check_read(path, self._alias, len(data), limit)
            return data

        return self._sftp_call("read", path, read)

    def write_file(self, path: str, data: bytes, mode: int = 0o600) -> None:
        def write(sftp: paramiko.SFTPClient, p: str) -> None:
            tmp = sftp_aside(sftp, p, data, mode)
            try:
                sftp.posix_rename(tmp, p)
            except BaseException:
                with contextlib.suppress(Exception):  # best effort: the original error matters
                    sftp.remove(tmp)
                raise

        self._sftp_call("write", path, write)

    def create_file(self, path: str, data: bytes, mode: int = 0o600) -> bool:
        def create(sftp: paramiko.SFTPClient, p: str) -> bool:
            tmp = sftp_aside(sftp, p, data, mode)
            try:
                # SFTP's own rename (not posix-rename) refuses a target that exists: the file
                # appears whole, and only where nothing was.
                sftp.rename(tmp, p)
            except OSError as exc:
                with contextlib.suppress(Exception):
                    sftp.remove(tmp)
                try:
                    sftp.lstat(p)
                except FileNotFoundError:
                    raise exc from None
                return False
            return True

        return self._sftp_call("create", path, create)

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

            makedirs_with(p, mode, isdir, sftp.mkdir, sftp.chmod, posixpath.dirname)

        self._sftp_call("create directory", path, makedirs)

    def remove(self, path: str) -> None:
        def remove(sftp: paramiko.SFTPClient, p: str) -> None:
            with contextlib.suppress(FileNotFoundError):
                sftp.remove(p)

        self._sftp_call("remove", path, remove)

    def rename(self, path: str, new_path: str, *, replace: bool = False) -> None:
        remote_new = new_path[2:] if new_path.startswith("~/") else new_path

        def rename(sftp: paramiko.SFTPClient, p: str) -> None:
            # SFTP's own rename (not posix-rename) refuses a target that exists.
            (sftp.posix_rename if replace else sftp.rename)(p, remote_new)

        self._sftp_call("rename", path, rename)

    def open_read(self, path: str) -> SFTPReader:
        def open_(sftp: paramiko.SFTPClient, p: str) -> SFTPReader:
            check_file(path, self._alias, sftp.lstat(p), None)  # never open a FIFO: see read_file
            f = sftp.open(p, "rb")
            return SFTPReader(sftp, f, f.stat().st_size or 0, self._alias, path)

        return self._sftp_call("read", path, open_)

    def open_new(self, path: str, mode: int = 0o600) -> SFTPWriter:
        def create(sftp: paramiko.SFTPClient, p: str) -> SFTPWriter:
            f = sftp.open(p, "wxb")
            f.chmod(mode)
            return SFTPWriter(sftp, f, self._alias, path)

        return self._sftp_call("create", path, create)

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
                        raise file_error(what, path, self._alias, e) from None
                    self._drop()
                    if attempt == 2:
                        raise TransportError(
                            f"ssh {self._alias}: connection lost twice during {what} {path}"
                            f" ({oneline(e) or 'closed'}); check that `ssh {self._alias} true` works"
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
        config, config_path = load_config()
        target = resolve(config, self._alias, config_path)
        # Each ProxyJump hop is resolved through the config too; a hop's own
        # ProxyJump is not followed.
        hops = [resolve(config, spec, config_path) for spec in target.proxy_jump]
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


class PortForward:
    """A local listening port whose connections reach an address on the host, as ``ssh -L`` does.

    Each connection accepted on 127.0.0.1:``port`` gets its own ``direct-tcpip``
    channel, opened on the transport's current connection (through its ProxyJump
    hops), and bytes are carried both ways by a thread per connection. After a drop
    the next connection reconnects, so the same local port serves again once the
    host answers; the connections that were open at the drop are closed.
    ``on_change`` hears of the forward's state when it changes: a message when a
    connection could not be carried, None when one is carried again after that.
    ``close`` stops listening and closes every connection.
    """

    def __init__(
        self,
        transport: SSHTransport,
        remote: tuple[str, int],
        local_port: int,
        on_change: Callable[[str | None], None] | None,
    ) -> None:
        self.remote = remote
        self._transport = transport
        self._on_change = on_change
        self._failing = False
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._open: set[tuple[socket.socket, paramiko.Channel]] = set()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind(("127.0.0.1", local_port))
            self._listener.listen(16)
        except OSError:
            self._listener.close()
            raise
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name=f"forward-{self.port}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        self._thread.join()
        self._listener.close()
        with self._lock:
            pairs = list(self._open)
        for sock, chan in pairs:
            _close_pair(sock, chan)

    def _accept(self) -> None:
        while not self._closed.is_set():
            if not select.select([self._listener], [], [], _FORWARD_STEP)[0]:
                continue
            try:
                sock, peer = self._listener.accept()
            except OSError:  # the client gave up before we took it
                continue
            threading.Thread(target=self._carry, args=(sock, peer), daemon=True).start()

    def _carry(self, sock: socket.socket, peer: tuple[str, int]) -> None:
        try:
            chan = self._transport._open_direct(self.remote, peer)
        except TransportError as e:
            sock.close()
            self._state(str(e))
            return
        self._state(None)
        with self._lock:
            if self._closed.is_set():
                _close_pair(sock, chan)
                return
            self._open.add((sock, chan))
        try:
            _splice(sock, chan, self._closed)
        except (paramiko.SSHException, EOFError, OSError):
            pass  # either end went away: this connection is over, the forward goes on
        finally:
            with self._lock:
                self._open.discard((sock, chan))
            _close_pair(sock, chan)

    def _state(self, error: str | None) -> None:
        with self._lock:
            changed = self._failing != (error is not None)
            self._failing = error is not None
        if changed and self._on_change is not None:
            self._on_change(error)


def _splice(sock: socket.socket, chan: paramiko.Channel, closed: threading.Event) -> None:
    """Carry bytes between ``sock`` and ``chan`` until the far end is done (or ``closed``).

    The local client's end of input is passed on as an EOF and its answer still
    carried back; the far end's EOF ends the connection."""
    sending = True
    while not closed.is_set() and not chan.closed:
        waiting: list[Any] = [sock, chan] if sending else [chan]
        readable = select.select(waiting, [], [], _FORWARD_STEP)[0]
        if sock in readable:
            data = sock.recv(_CHUNK)
            if data:
                chan.sendall(data)
            else:
                sending = False
                chan.shutdown_write()
        if chan in readable:
            data = chan.recv(_CHUNK)
            if not data:
                return
            sock.sendall(data)


def _close_pair(sock: socket.socket, chan: paramiko.Channel) -> None:
    for closable in (chan, sock):
        with contextlib.suppress(Exception):  # a dead link may fail to close in any way
            closable.close()


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


def _with_name(attrs: paramiko.SFTPAttributes, name: str) -> paramiko.SFTPAttributes:
    attrs.filename = name
    return attrs


class _RejectUnknown:
    """paramiko's MissingHostKeyPolicy, by duck typing: refuse, keeping the key for the message."""

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        raise UnknownHostKey(key)


def _connect(ep: Endpoint, via: object, config_path: str) -> paramiko.SSHClient:
    client = paramiko.SSHClient()
    for path in ep.known_hosts:
        if os.path.isfile(path):
            try:
                client.load_system_host_keys(path)  # "system": paramiko never writes them back
            except OSError:
                continue
    client.set_missing_host_key_policy(_RejectUnknown() if ep.strict_host_keys else paramiko.WarningPolicy())
    supported = paramiko.Transport._preferred_keys
    known = host_key_types(ep) & set(supported)
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
            raise TransportError(connect_message(ep, e, config_path, at_auth)) from None
        raise
    transport = client.get_transport()
    if transport is not None:
        transport.set_keepalive(ep.keepalive)
    return client


def _open_socket(ep: Endpoint) -> object:
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
        raise TransportError(f"ssh {ep.alias}: cannot connect to {ep.where}: {oneline(e)}") from None


def _forward(jump: paramiko.SSHClient, hop: Endpoint, target: Endpoint) -> paramiko.Channel:
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
            f"ssh {target.alias}: jump host {hop.alias} cannot reach {target.where} ({oneline(e)}); "
            f"check `ssh -J {hop.alias} {target.alias} true`"
        ) from None
