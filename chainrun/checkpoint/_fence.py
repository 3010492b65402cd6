"""The fence: which segment of a chain may commit into its checkpoint directory.

A segment's runner writes the segment's token (chain, segment number, restart of a
requeued job, job id) into ``.chainrun-fence`` in the checkpoint directory when it
starts, unless a newer segment of the same chain has written its own there (then this
one is fenced before it starts). From then on only the segment whose token the file
holds may commit: the helper reads the file again just before the rename that commits
a save (``check``), and the runner stops a command whose token is gone. So an older
segment that still runs (a pool host cut off but alive, a second successor, a requeue
racing its successor) can never commit over a newer one, whatever the timing.

What remains is the window between the helper's read and its rename: microseconds on a
local disk, one round trip on a network file system. A newer segment starts from the
checkpoint committed before it started, so a commit inside that window is one the newer
segment never sees: it trains on from its own start and overwrites it at its next save.

Standard library alone: the segment runner ships this module beside itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from typing import NamedTuple, Optional

FENCE_NAME = ".chainrun-fence"
FENCE_VAR = "CHAINRUN_FENCE"  # this segment's token, as the runner wrote it
FENCED_EXIT = 75  # sysexits' EX_TEMPFAIL: a fenced segment's command, stopped at its commit


class Token(NamedTuple):
    """One segment's mark on a checkpoint directory: the fence's content."""

    chain: str
    segment: int
    restart: int  # the scheduler's count of requeues of the job
    job: str

    def text(self) -> str:
        return f"{self.chain} {self.segment} {self.restart} {self.job or '-'}\n"

    def newer_than(self, other: Token) -> bool:
        """A later segment of the same chain, or a later run of the same segment."""
        return self.chain == other.chain and (self.segment, self.restart) > (other.segment, other.restart)

    def describe(self) -> str:
        run = f", run {self.restart + 1}" if self.restart else ""
        return f"segment {self.segment}{run} (job {self.job or '?'})"


def parse(text: str) -> Optional[Token]:
    parts = text.split()
    if len(parts) != 4 or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return Token(parts[0], int(parts[1]), int(parts[2]), "" if parts[3] == "-" else parts[3])


def read(directory: str) -> Optional[Token]:
    """The token the directory's fence holds; None when it has none (or none that reads)."""
    try:
        with open(os.path.join(directory, FENCE_NAME), encoding="utf-8", errors="replace") as f:
            return parse(f.read(512))
    except OSError:
        return None


def take(directory: str, token: Token) -> Optional[Token]:
    """Write ``token`` into ``directory``'s fence, unless a newer segment of the same chain
    holds it: then that segment's token (this one is fenced), else None. The fence is taken
    one at a time (a lock beside the fence), and the fence is replaced whole."""
    fd = os.open(os.path.join(directory, FENCE_NAME + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        owner = read(directory)
        if owner is not None and owner.newer_than(token):
            return owner
        temp = os.path.join(directory, f"{FENCE_NAME}.{os.getpid()}.tmp")
        try:
            with open(temp, "w", encoding="utf-8") as f:
                f.write(token.text())
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, os.path.join(directory, FENCE_NAME))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
        return None
    finally:
        os.close(fd)


class Fenced(SystemExit):
    """A newer segment of the chain owns the checkpoint directory: this save was not
    committed, and the command exits (``FENCED_EXIT``; the runner records it as fenced,
    which costs nothing)."""

    def __init__(self, directory: str, own: Token, owner: Optional[Token]) -> None:
        super().__init__(FENCED_EXIT)
        newer = owner.describe() if owner is not None else "another run"
        self.message = (
            f"chainrun: {own.describe()} is fenced: {newer} of the chain now owns {directory}; "
            "this save was not committed, and the command stops"
        )

    def __str__(self) -> str:
        return self.message


def holds(directory: str, own: Token) -> bool:
    """Whether segment ``own`` may commit into ``directory``: its fence holds ``own``'s token,
    or there is no fence there (a directory set up anew). One that does not read holds no one's."""
    if read(directory) == own:
        return True
    return not os.path.lexists(os.path.join(directory, FENCE_NAME))


def check(directory: str) -> None:
    """Raise ``Fenced`` when this process runs as a segment of a chain (``CHAINRUN_FENCE``)
    and the directory's fence holds another segment's token: just before a commit."""
    own = parse(os.environ.get(FENCE_VAR, ""))
    if own is not None and not holds(directory, own):
        fenced = Fenced(directory, own, read(directory))
        print(fenced.message, file=sys.stderr)  # stderr is line-buffered: out before the exit
        raise fenced
