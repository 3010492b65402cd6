"""The service side of systemd's sd_notify protocol: one datagram per message to
``$NOTIFY_SOCKET`` (the abstract namespace included): READY=1, STATUS=, WATCHDOG=1,
RELOADING=1, STOPPING=1.
"""

from __future__ import annotations

import os
import socket
from typing import Optional

from chainrun.logsetup import get_logger

log = get_logger(__name__)


class SdNotify:
    """The service side of sd_notify; every call is a no-op outside systemd."""

    def __init__(self, address: Optional[str] = None, watchdog_usec: Optional[int] = None) -> None:
        self.address = address or None
        self.watchdog_usec = watchdog_usec if watchdog_usec and watchdog_usec > 0 else None
        self._sock: Optional[socket.socket] = None
        self._warned = False

    @classmethod
    def from_environ(cls, unset: bool = True) -> SdNotify:
        """Read ``$NOTIFY_SOCKET`` and the watchdog; ``unset`` hides them from children.

        Jobs and hooks started later must not inherit them: a training script
        that speaks sd_notify would otherwise talk on the service's behalf.
        """
        address = os.environ.get("NOTIFY_SOCKET")
        usec: Optional[int] = None
        pid = os.environ.get("WATCHDOG_PID")
        if pid is None or pid == str(os.getpid()):
            try:
                usec = int(os.environ.get("WATCHDOG_USEC", ""))
            except ValueError:
                usec = None
        if unset:
            for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
                os.environ.pop(name, None)
        return cls(address, usec)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def watchdog_period(self) -> Optional[float]:
        """Seconds between WATCHDOG=1 pings: half the watchdog timeout, as systemd advises."""
        return self.watchdog_usec / 2e6 if self.watchdog_usec else None

    def send(self, *fields: str) -> bool:
        """Send ``fields`` (``READY=1``, ``STATUS=...``) as one datagram; True if sent."""
        if self.address is None or not fields:
            return False
        target = self.address
        if target.startswith("@"):
            target = "\0" + target[1:]  # the abstract namespace
        elif not target.startswith("/"):
            self._warn(f"NOTIFY_SOCKET={self.address!r} is not a unix socket path; not notifying")
            return False
        data = "\n".join(f.replace("\n", " ") for f in fields).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.sendto(data, target)
        except OSError as exc:
            self._warn(f"cannot notify systemd at {self.address}: {exc.strerror or exc}")
            return False
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _warn(self, message: str) -> None:
        if not self._warned:  # once: the service keeps working without it
            self._warned = True
            log.warning(message)
