"""``chainrun status --hosts``: the machines of the pools, as the service's last tick found
them (like ``sinfo`` for a Slurm cluster): each host reachable or not and since when, its
slots used and free, the chains whose segments are there, and the GPUs its runs were given.

What the service saw is in its heartbeat file (``TickSummary.hosts``): whether each pool
host answered its poll, since when, and its jobs with their slots; the chains come from
the store.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

from chainrun import heartbeat
from chainrun.model import Chain, Phase
from chainrun.schedulers.segment import parse_tag
from chainrun.status import columns, when


def hosts(home: Path, chains: Sequence[Chain]) -> list[dict[str, Any]]:
    """Every host of the active chains' pools, in the order the job files list them, then
    those the service polled before (their slots unknown: no active chain names them)."""
    seen: dict[str, Any] = (heartbeat.read(home) or {}).get("hosts") or {}
    pools = [c for c in chains if c.spec.scheduler.hosts]
    by_id = {c.id: c for c in pools}
    names = list(dict.fromkeys([*(h for c in pools for h in c.spec.scheduler.hosts), *seen]))
    shown = []
    for host in names:
        state = seen.get(host) or {}
        listed: Optional[list[dict[str, Any]]] = state.get("jobs")
        slots = max(
            (c.spec.scheduler.slots or 1 for c in pools if host in c.spec.scheduler.hosts), default=None
        )
        gpus: list[int] = []
        used = 0
        for job in listed or []:
            busy = job["phase"] == Phase.RUNNING.value or job.get("reason") not in (None, "Dependency")
            used += busy
            tag = parse_tag(job["name"])
            chain = by_id.get(tag[0]) if tag is not None else None
            per = chain.spec.scheduler.gpus_per_slot if chain is not None else None
            if job["phase"] == Phase.RUNNING.value and per and job.get("slot") is not None:
                gpus += range(job["slot"] * per, job["slot"] * per + per)
        there = [
            {"chain": c.id, "name": c.spec.name, "segment": s.n, "phase": s.phase.value}
            for c in pools
            for s in c.live
            if s.host == host
        ]
        shown.append(
            {
                "host": host,
                "reachable": state.get("answers"),  # None: the service has not polled it yet
                "since": state.get("since"),
                "slots": slots,
                "used": used if listed is not None else None,
                "gpus": sorted(gpus) if listed is not None else None,
                "chains": there,
            }
        )
    return shown


def table(shown: Sequence[dict[str, Any]], now: float, width: int) -> list[str]:
    """The hosts one line each: HOST, STATE (since when), SLOTS used/all, GPUS given, CHAINS."""
    rows = [("HOST", "STATE", "SLOTS", "GPUS", "CHAINS")]
    for h in shown:
        since = h["since"]
        stamp = f" since {datetime.fromtimestamp(since):%H:%M:%S} ({when(since, now)})" if since else ""
        if h["reachable"] is None:
            state = "not polled yet"
        else:
            state = ("up" if h["reachable"] else "UNREACHABLE") + stamp
        slots = "?" if h["used"] is None or h["slots"] is None else f"{h['used']}/{h['slots']} used"
        gpus = "?" if h["gpus"] is None else (",".join(map(str, h["gpus"])) or "-")
        there = ", ".join(f"{c['name']} (segment {c['segment']}, {c['phase']})" for c in h["chains"]) or "-"
        rows.append((h["host"], state, slots, gpus, there))
    if len(rows) == 1:
        return ["no pool: no active chain has scheduler.hosts"]
    return columns(rows, width, [0, 1, 2, 4, 3])
