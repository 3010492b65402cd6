"""The service's doorbell: a Unix datagram socket in the state directory (``service.wake``),
which the running service listens on and a command rings once it has given the service
something to do (``chainrun submit``): the service ticks at once instead of at the end of
its interval, so a chain's first segment is queued when it is submitted, not up to an
interval later.

A ring carries nothing and can ask for nothing but a tick sooner: a lost one (no service
listening, a full buffer, a state directory path too long for a socket) costs only the wait
for the next tick, as before. The socket is a file in the state directory, which is this
user's alone; no process id is looked up, so no other process can be signalled by mistake.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import Optional

WAKE_FILE = "service.wake"


def ring(home: Path) -> bool:
    """Ask the service of ``home`` to tick now; whether one was listening."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as bell:
        bell.setblocking(False)
        try:
            bell.sendto(b"\0", str(Path(home) / WAKE_FILE))
        except OSError:  # no service, an old one that does not listen, a full buffer, a long path
            return False
    return True


class Doorbell:
    """The service's end: bound while the service holds its home's lock (the stale file an
    earlier service left is its own to replace), read by the service's main thread."""

    def __init__(self, home: Path) -> None:
        self.path = str(Path(home) / WAKE_FILE)
        self.sock: Optional[socket.socket] = None

    def open(self) -> Optional[str]:
        """Listen; why it cannot (the service then ticks at its interval alone), None once it does."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.bind(self.path)
        except OSError as exc:  # a path over the 107 bytes of a socket's name, say
            sock.close()
            return str(exc.strerror or exc)
        sock.setblocking(False)
        self.sock = sock
        return None

    def answer(self) -> None:
        """Take every ring waiting: one tick answers them all."""
        assert self.sock is not None
        with contextlib.suppress(BlockingIOError):
            while self.sock.recv(64):
                pass

    def close(self, mine: bool = True) -> None:
        """Stop listening; the socket's file goes too while the home is still ``mine`` (a
        service that lost its lock leaves it to the service that may hold the home now)."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            if mine:
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
