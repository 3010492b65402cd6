"""One service per ``CHAINRUN_HOME``: an exclusive lock on the database file itself.

Before every tick the service checks that the file at that path is still the
one it locked (``InstanceLock.check``); a service whose database was deleted
or replaced stops (``LockLost``), so two services never tick the same chains.
Commands ask ``held_elsewhere`` whether a service runs for a home.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path
from typing import Optional

from chainrun import heartbeat
from chainrun.errors import AlreadyRunning, ChainrunError, StoreUnavailable
from chainrun.logsetup import get_logger
from chainrun.store import local_dir, private_dir
from chainrun.store.database import DB_FILE

log = get_logger(__name__)

PID_FILE = "service.pid"
LOCK_TRIES = 5  # a command checking for a service holds the lock for an instant
LOCK_RETRY = 0.1

# One lock object per state directory for the life of the process: its descriptor
# is never closed (see _lock_fds), so a program that looks often (`status --watch`) opens it once.
_locks: dict[Path, InstanceLock] = {}

# Descriptors of the database opened for its lock. They stay open for the life
# of the process: closing *any* descriptor of a file drops every POSIX lock
# the process holds on it, SQLite's own locks on the database included.
_lock_fds: list[int] = []


class LockLost(ChainrunError):
    """The database this service locked was deleted or replaced while it ran."""


class InstanceLock:
    """The single-instance lock of a CHAINRUN_HOME: an exclusive flock on its database.

    Locking the database itself, rather than a file beside it, means that
    deleting some other file cannot let a second service in; deleting or
    replacing the database is caught by ``check()`` before every tick.

    flock(2) locks belong to an open file description; SQLite locks the same
    file with POSIX (fcntl) record locks, which belong to the process. On
    Linux local filesystems the two kinds are separate and never conflict, so
    this lock does not stand in the way of SQLite, in this process or any
    other. (On NFS, Linux emulates flock with a POSIX lock on the whole file,
    which SQLite's locks would then collide with: ``acquire`` refuses a home on a
    network file system, as the store does.)
    """

    def __init__(self, home: Path) -> None:
        self.home = Path(home)
        self.path = self.home / DB_FILE
        self.pidfile = self.home / PID_FILE
        self._fd: Optional[int] = None
        self._held = False

    def acquire(self) -> None:
        """Take the lock, creating the database file (0600) if needed; else AlreadyRunning.
        UsageError on a network file system, where neither it nor the database holds."""
        local_dir(self.home)
        for _ in range(LOCK_TRIES):
            fd = self._open(create=True)
            assert fd is not None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                time.sleep(LOCK_RETRY)
                continue
            except OSError as exc:
                raise ChainrunError(
                    f"{self.path}: cannot lock the state database: {exc.strerror or exc}"
                ) from None
            try:
                mine = self._names(fd)
            except OSError as exc:
                raise ChainrunError(
                    f"{self.path}: cannot look at the state database: {exc.strerror or exc}"
                ) from None
            if mine:
                self._held = True
                self._write_pid()
                return
            fcntl.flock(fd, fcntl.LOCK_UN)  # replaced between open and lock: lock the new file
        raise AlreadyRunning(
            f"another chainrun service is running for {self.home}"
            f" (pid {self.holder() or '?'}); use `chainrun status`, or stop it first"
        )

    def check(self) -> None:
        """Return while the lock is held on the file the path names now; else raise LockLost.

        StoreUnavailable when the path cannot be looked at (an I/O error): an
        outage, not a reason to stop.
        """
        try:
            if self._held and self._fd is not None and self._names(self._fd):
                return
        except OSError as exc:
            raise StoreUnavailable(
                f"{self.path}: cannot check the state database: {exc.strerror or exc}"
            ) from None
        raise LockLost(
            f"{self.path} was deleted or replaced while this service ran; it stops rather than"
            " risk a second service ticking the same chains. Put the database back and start"
            " the service again"
        )

    def held_elsewhere(self) -> bool:
        """True when another process holds the lock (a service is running)."""
        if self._held:
            return False
        try:
            fd = self._open(create=False)
        except ChainrunError:
            return False
        if fd is None:
            return False  # no database yet, so no service either
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return False
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False

    def holder(self) -> Optional[int]:
        """The pid of the service holding the lock, from its pid file or its status file."""
        try:
            return int(self.pidfile.read_text().strip())
        except (OSError, ValueError):
            pass
        pid = (heartbeat.read(self.home) or {}).get("pid")
        return pid if isinstance(pid, int) else None

    def release(self) -> None:
        if self._held and self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._held = False

    def _open(self, create: bool) -> Optional[int]:
        """A descriptor of the file the path names now; None if there is none and not ``create``."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                if self._names(self._fd):
                    return self._fd
        private_dir(self.home)
        flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_CREAT if create else 0)
        try:
            fd = os.open(self.path, flags, 0o600)
        except FileNotFoundError:
            if create:
                raise ChainrunError(f"{self.path}: cannot create the state database") from None
            return None
        except OSError as exc:
            raise ChainrunError(
                f"{self.path}: cannot open the state database: {exc.strerror or exc}"
            ) from None
        _lock_fds.append(fd)  # never closed: see _lock_fds
        self._fd = fd
        return fd

    def _names(self, fd: int) -> bool:
        """Whether the path still names the file open as ``fd`` (not deleted, not replaced)."""
        mine = os.fstat(fd)
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            return False
        return mine.st_nlink > 0 and (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino)

    def _write_pid(self) -> None:
        try:
            self.pidfile.write_text(f"{os.getpid()}\n")
        except OSError as exc:  # the lock is what counts; the pid only names the holder
            log.warning("cannot write the pid file", path=str(self.pidfile), error=str(exc))


def lock_for(home: Path) -> InstanceLock:
    """This process's ``InstanceLock`` of ``home``."""
    key = Path(home).absolute()
    if key not in _locks:
        _locks[key] = InstanceLock(key)
    return _locks[key]
