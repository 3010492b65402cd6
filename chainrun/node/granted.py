"""The walltime a segment was granted: with ``walltime = "MIN..MAX"`` Slurm's backfill may start
the job early with its limit cut down (``--time-min``), and the segment's own clock (the
walltime signal at ``deadline - grace``, CHAINRUN_DEADLINE) must count from that limit, not
the one asked for. The backend's shell question prints the limit as Slurm does (``squeue
--format=%l``: ``M:SS``, ``H:MM:SS`` or ``D-HH:MM:SS``, ``UNLIMITED`` where none); this reads
it. Standard library only: it runs on the node, in the segment runner.
"""

from __future__ import annotations

import re
import subprocess
from typing import Optional

from chainrun.decide import segment as rules

# [D-]H:MM:SS or M:SS as Slurm prints a time limit; the fields from the right are seconds,
# minutes, hours, days.
_LIMIT = re.compile(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)")


def limit_seconds(text: str) -> Optional[int]:
    """Seconds in a time limit as Slurm prints it; None for anything else (``UNLIMITED``,
    ``NOT_SET``, nothing)."""
    found = _LIMIT.fullmatch(text.strip())
    if found is None:
        return None
    days, hours, minutes, seconds = (int(g or 0) for g in found.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def granted(answer: Optional[subprocess.CompletedProcess[bytes]], asked: int) -> int:
    """The walltime to count from: the limit the scheduler's ``answer`` gives, when it is
    shorter than the one ``asked`` (Slurm rounds a limit up to a whole minute); else
    ``asked`` (no answer, no range, a limit it cannot read)."""
    if answer is None or answer.returncode != 0:
        return asked
    shorter = rules.shorter_limit(limit_seconds(answer.stdout.decode("ascii", "replace")), asked)
    return asked if shorter is None else shorter
