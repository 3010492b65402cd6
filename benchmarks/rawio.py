"""The baseline the checkpoint benchmarks measure against: the same bytes written raw and
fsynced, in one place for ``checkpoint.py`` and ``save.py``."""

from __future__ import annotations

import os
from typing import Union


def write_fsync(data: memoryview, path: Union[str, os.PathLike[str]]) -> None:
    """``data`` written to ``path`` in 64 MiB writes, then fsynced: no format, no atomicity."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < len(data):
            done += os.write(fd, data[done : done + (64 << 20)])
        os.fsync(fd)
    finally:
        os.close(fd)
