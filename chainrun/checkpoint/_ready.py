"""The ``ready`` file in a chain's run directory: how a segment's command tells chainrun's
segment runner that it takes the walltime signal (``SegmentClock`` says so once its handlers
are set), and how the runner reads it.

Every process that sets its handlers appends one line, ``SEGMENT HOST PID``: under DDP each
rank does, and a rank still importing when its rank 0 is ready has none yet, so the signal's
default action (death) would kill it. Once a chain's command has said so, the runner of each
later segment holds the signal until as many processes have said so in its segment as did in
the latest segment before it. A line of a segment number alone (an older helper's) counts
as one process.

Standard library alone: the segment runner ships this module beside itself.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

READY_NAME = "ready"
READ_AT_MOST = 1 << 20


def tell(directory: str, segment: str) -> None:
    """Say that this process takes the signal in ``segment``; raises OSError. One ``write``
    of one short line with ``O_APPEND``: the lines of the processes of one machine never mix."""
    line = f"{segment} {socket.gethostname()} {os.getpid()}\n".encode()
    fd = os.open(os.path.join(directory, READY_NAME), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def said(text: bytes) -> dict[int, set[str]]:
    """Who said they were ready, by segment: ``{segment: {"HOST PID", ...}}``."""
    found: dict[int, set[str]] = {}
    for line in text.decode(errors="replace").splitlines():
        segment, _, who = line.strip().partition(" ")
        if segment.isdigit():
            found.setdefault(int(segment), set()).add(who)
    return found


def before(found: Mapping[int, set[str]], segment: int) -> tuple[int, str]:
    """How many processes said they were ready in the latest segment before ``segment`` (0
    where none did), and their lines alone: what the file keeps once ``segment`` starts."""
    earlier = [n for n in found if n < segment]
    last = max(earlier, default=0)
    return len(found.get(last, ())), "".join(f"{last} {who}\n" for who in sorted(found.get(last, ())))
