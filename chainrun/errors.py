"""The few error types chainrun raises.

Every error carries a message a user can act on: it names the thing, the
value and what to do. The CLI turns any ``ChainrunError`` into one line on
stderr and the error's ``exit_code``; anything else is a bug.
"""

from __future__ import annotations


class ChainrunError(Exception):
    """Base of every expected error; ``str(err)`` is the user-facing message."""

    exit_code = 1


class JobFileError(ChainrunError):
    """The job file is missing, unparseable or invalid."""

    exit_code = 2


class UsageError(ChainrunError):
    """A command was called with arguments that cannot work (unknown chain, ...)."""

    exit_code = 2


class TransportError(ChainrunError):
    """A command could not be run or a file not reached (SSH drop, timeout).

    Always transient from the chain's point of view: retried, never charged.
    """


class ClaimedError(ChainrunError):
    """Another claimant holds the segment's claim (``Cluster.submit``): it queues, or has
    queued, that segment, which must not be queued twice. ``held``: its claim, as read."""

    def __init__(self, n: int, held: object) -> None:
        super().__init__(f"segment {n} is claimed already ({held})")
        self.n = n
        self.held = held


class SchedulerError(ChainrunError):
    """The scheduler refused or failed a request.

    ``transient`` errors (slurmctld not responding, socket timed out) are
    retried with backoff; permanent ones (unknown partition) end the chain with
    the scheduler's own message.
    """

    def __init__(self, message: str, *, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient


class UnsafePathError(ChainrunError):
    """A file or directory chainrun would trust (the run directory and the scripts in
    it) can be changed by someone else: owned by another user, writable by others, or
    a symlink; or the workdir a chain ran in is gone. Nothing is submitted from it."""

    exit_code = 2


class StoreError(ChainrunError):
    """The state database cannot be opened or is from a newer chainrun."""


class StoreUnavailable(StoreError):
    """The database is fine but cannot be used now: its disk is full, it is
    read-only, or another process holds its lock. An outage: the service logs
    it and retries; no chain is charged for it."""


class AlreadyRunning(ChainrunError):
    """Another chainrun service holds the lock on this CHAINRUN_HOME."""
