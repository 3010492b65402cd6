"""Processes as Linux's ``/proc`` shows them: the one reading of ``/proc/PID/stat`` that the
local runner and the segment runner share (each ships it beside itself, so it imports the
standard library alone and keeps to Python 3.8)."""

from __future__ import annotations

import os
from typing import NamedTuple, Optional


class Process(NamedTuple):
    """One process, as its ``stat`` line says."""

    parent: int
    group: int  # its process group
    session: int
    state: str  # "Z" for a zombie
    start: int  # clock ticks after boot: with the PID, what names this process for good


def read(pid: int) -> Optional[Process]:
    """Process ``pid``; None once it is gone (or it went as we looked)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(") ", 1)[1].split()
        return Process(int(rest[1]), int(rest[2]), int(rest[3]), rest[0], int(rest[19]))
    except (OSError, IndexError, ValueError):
        return None


def started_at(pid: int) -> Optional[int]:
    """When process ``pid`` started (clock ticks after boot); None once it is gone. The kernel
    gives a PID again once its process is gone: a PID names one of ours only with this start."""
    found = read(pid)
    return found.start if found is not None else None


def table() -> dict[int, Process]:
    """Every process, zombies included."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            process = read(int(entry))
            if process is not None:
                found[int(entry)] = process
    return found


def below(root: int, processes: dict[int, Process]) -> set[int]:
    """The processes under ``root`` in ``processes``, zombies too."""
    children: dict[int, list[int]] = {}
    for pid, process in processes.items():
        children.setdefault(process.parent, []).append(pid)
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: Optional[int]) -> bool:
    """Whether process ``pid`` runs (a zombie does not: its parent has not reaped it yet)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    found = read(pid)
    return found is None or found.state != "Z"  # None: it went as we looked; alive a moment ago
