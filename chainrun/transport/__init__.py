"""Run commands and touch files, on this machine or on a cluster over SSH.

The transport is one of the two places in chainrun that start processes (the
other is the local runner, ``chainrun/localrunner.py``, which supervises the
jobs of the local backend) and the only one that opens SSH connections;
everything else builds argv lists and hands them to a ``Transport``. A
non-zero exit is a ``CommandResult``, never an exception; ``TransportError``
means the command or file could not be reached at all (connection refused or
dropped, authentication or host key problem, timeout) and is transient from a
chain's point of view. ``run`` never retries a command that may have started,
so a submission cannot happen twice by accident; file operations are
idempotent and reconnect once after a drop.

``read_file`` reads regular files only. Whatever else sits at the path (a
FIFO, whose open would block forever; a directory; a device; a symlink, which
could point at ``/dev/zero``) is refused with ``FileRefused`` before it is
opened, and so is a file larger than the caller's ``limit``; a file that
grows past the limit while it is read is refused too, after at most
``limit + 1`` bytes. A missing file reads as None.

This package exports the ``Transport`` protocol (``base.py``, with what its
implementations share: argument checks, the regular-file checks, error wording)
and the factory ``transport_for``, and ``canonical_host``: the machine an alias reaches.
``local.py`` is this machine (``subprocess`` and ``os``); ``ssh.py`` is one host over
paramiko, with ``sshconfig.py`` reading the OpenSSH config and ``sshstream.py`` the SFTP
files written aside or in pieces. paramiko is imported only when a chain has a host:
``SSHTransport`` is loaded on first use, by ``transport_for(host)`` or by importing the name.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from chainrun.model import CommandResult
from chainrun.transport.base import FileInfo, FileRefused, Transport

if TYPE_CHECKING:
    from chainrun.transport.local import LocalTransport
    from chainrun.transport.ssh import SSHTransport

__all__ = [
    "CommandResult",
    "FileInfo",
    "FileRefused",
    "LocalTransport",
    "SSHTransport",
    "Transport",
    "canonical_host",
    "transport_for",
]

_ssh_transports: dict[str, SSHTransport] = {}
_cache_lock = threading.Lock()


def transport_for(host: str | None) -> Transport:
    """The transport for ``host``: this machine for None or "", else one SSHTransport per host.

    The SSH side (and paramiko with it) is imported only here, when a host is named.
    """
    if not host:
        from chainrun.transport.local import LOCAL

        return LOCAL
    from chainrun.transport.ssh import SSHTransport

    with _cache_lock:
        transport = _ssh_transports.get(host)
        if transport is None:
            transport = _ssh_transports[host] = SSHTransport(host)
        return transport


def canonical_host(host: str) -> str:
    """``host`` as ``ssh -G`` names the machine it reaches, ``hostname:port`` (``sshconfig.py``)."""
    from chainrun.transport.sshconfig import canonical_host

    return canonical_host(host)


def __getattr__(name: str) -> object:
    """``LocalTransport`` and ``SSHTransport`` from their modules, loaded on first use (PEP 562)."""
    if name == "LocalTransport":
        from chainrun.transport.local import LocalTransport

        return LocalTransport
    if name == "SSHTransport":
        from chainrun.transport.ssh import SSHTransport

        return SSHTransport
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
