"""The heartbeat file (``service.status`` in the state directory): the running service's pid,
the time of its last tick and its one-line status, written after every tick and read by
``chainrun status`` (which need not import the service for it).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Optional

STATUS_FILE = "service.status"


def write(home: Path, status: str) -> None:
    """Say, atomically, that this process ticked now, and how it went; OSError if it cannot."""
    path = Path(home) / STATUS_FILE
    tmp = path.with_name(f".{STATUS_FILE}.tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "at": time.time(), "status": status}))
    os.replace(tmp, path)


def clear(home: Path) -> None:
    """The service stopped: no heartbeat."""
    (Path(home) / STATUS_FILE).unlink(missing_ok=True)


def read(home: Path) -> Optional[dict[str, Any]]:
    """What the running service last said about itself (pid, time, summary), if anything."""
    try:
        data = json.loads((Path(home) / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
