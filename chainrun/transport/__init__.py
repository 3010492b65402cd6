"""Run commands and touch files, on this machine or on a cluster over SSH.

The code lives in ``ssh.py`` for now; this package re-exports its names.
"""

from chainrun.transport.ssh import (
    CommandResult,
    FileInfo,
    FileRefused,
    LocalTransport,
    SSHTransport,
    Transport,
    transport_for,
)

__all__ = [
    "CommandResult",
    "FileInfo",
    "FileRefused",
    "LocalTransport",
    "SSHTransport",
    "Transport",
    "transport_for",
]
