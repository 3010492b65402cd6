"""The heartbeat file (``service.status`` in the state directory): the running service's pid,
the time of its last tick, its tick interval and its one-line status, written after every
tick and read by ``chainrun status`` (which need not import the service for it). A service
that stops leaves the time of its last tick (and no pid): what ``status`` shows is as of then.
The state directory is on this machine, which a cluster's nodes need not see: a segment that
would carry the chain reads the service's beat in its run root instead (``carry.beat_path``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Optional

STATUS_FILE = "service.status"


def write(home: Path, status: str, interval: float, hosts: Optional[dict[str, Any]] = None) -> None:
    """Say, atomically, that this process ticked now (and ticks every ``interval`` seconds),
    and how it went (and, for pools, how each host answered: ``hosts``, read by ``status
    --hosts``); OSError if it cannot."""
    path = Path(home) / STATUS_FILE
    tmp = path.with_name(f".{STATUS_FILE}.tmp")
    beat = {
        "pid": os.getpid(),
        "at": time.time(),
        "status": status,
        "interval": interval,
        "hosts": hosts or {},
    }
    tmp.write_text(json.dumps(beat))
    os.replace(tmp, path)


def stopped(home: Path) -> None:
    """The service stopped: no pid any more, only its last tick's time and status; OSError if
    that cannot be written."""
    last = read(home) or {}
    path = Path(home) / STATUS_FILE
    tmp = path.with_name(f".{STATUS_FILE}.tmp")
    kept = {"at": last.get("at"), "status": last.get("status"), "hosts": last.get("hosts") or {}}
    tmp.write_text(json.dumps({**kept, "stopped": time.time()}))
    os.replace(tmp, path)


def read(home: Path) -> Optional[dict[str, Any]]:
    """What the running service last said about itself (pid, time, summary), if anything."""
    try:
        data = json.loads((Path(home) / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
