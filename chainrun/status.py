"""``chainrun status``: what a person reads at a glance, and the same as JSON.

One row per chain: state, a progress bar towards the target epoch, the ETA
from the epoch rate so far (epochs gained per second of training time),
the running job, the next segment with its pending reason (Dependency,
Priority, ...) or its retry, failures used of the budget, and time used of
the budget. A damaged chain (its row in the database cannot be read) gets a
row of dashes and, below the table, what is wrong and how to remove it.
Everything here is computed from a ``Chain`` and ``now``: no I/O but the
service's own status file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from chainrun.daemon import read_status
from chainrun.jobfile import format_duration
from chainrun.localrunner import alive
from chainrun.model import Chain, ChainState, Phase, Segment
from chainrun.store import DamagedChain

HEADER = ("CHAIN", "STATE", "PROGRESS", "ETA", "SEGMENT", "JOB", "NEXT", "FAILURES", "TIME")
BAR_WIDTH = 12


def short(seconds: float) -> str:
    """A duration to two units at most: ``45s``, ``12m``, ``5h20m``, ``2d3h``."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        h, m = divmod(s // 60, 60)
        return f"{h}h{m:02d}m" if m else f"{h}h"
    d, h = divmod(s // 3600, 24)
    return f"{d}d{h}h" if h else f"{d}d"


def trained(chain: Chain, now: float) -> float:
    """Training time so far: ended segments plus the running one up to now."""
    total = chain.used
    for seg in chain.live:
        if seg.phase is Phase.RUNNING and seg.started_at is not None:
            total += max(0.0, min(now - seg.started_at, float(seg.walltime)))
    return total


def epoch_rate(chain: Chain, now: float) -> Optional[float]:
    """Epochs per second of training time over the chain so far; None when unknown.

    Counts from the epoch the chain started at (a run resumed from an existing
    checkpoint did not train its first epochs in this chain's time).
    """
    epoch = chain.latest.epoch
    elapsed = trained(chain, now)
    if epoch is None or elapsed <= 0:
        return None
    gained = epoch - (chain.baseline.epoch or 0)
    return gained / elapsed if gained > 0 else None


def eta(chain: Chain, now: float) -> Optional[float]:
    """Training seconds until the target epoch at the current rate; None when unknown."""
    target = chain.spec.target_epoch
    epoch = chain.latest.epoch
    if chain.state.final or target is None or epoch is None:
        return None
    if epoch >= target:
        return 0.0
    rate = epoch_rate(chain, now)
    return (target - epoch) / rate if rate else None


def bar(done: Optional[int], total: Optional[int], width: int = BAR_WIDTH) -> str:
    """``[######......]  50% 100/200``; ``epoch 12`` without a target; ``-`` without epochs."""
    if done is None:
        return "-"
    if not total:
        return f"epoch {done}"
    filled = max(0, min(width, width * done // total))
    percent = min(100, 100 * done // total)
    return f"[{'#' * filled}{'.' * (width - filled)}] {percent:3d}% {done}/{total}"


def _eta_cell(chain: Chain, now: float) -> str:
    if chain.state is ChainState.COMPLETED:
        return "done"
    left = eta(chain, now)
    if left is None:
        return "-"
    budget_left = chain.spec.total_time - trained(chain, now)
    return short(left) + (" > budget" if left > budget_left else "")


def _running(chain: Chain) -> Optional[Segment]:
    return next((s for s in chain.live if s.phase is Phase.RUNNING), None)


def _upcoming(chain: Chain) -> Optional[Segment]:
    waiting = [s for s in chain.live if s.phase is not Phase.RUNNING]
    return min(waiting, key=lambda s: s.n) if waiting else None


def job_cell(chain: Chain, now: float) -> str:
    seg = _running(chain)
    if seg is None:
        return "-"
    elapsed = f" {short(now - seg.started_at)}" if seg.started_at else ""
    return f"{seg.job_id or '?'} running{elapsed}"


def next_cell(chain: Chain, now: float) -> str:
    """The next segment: queued with its pending reason, being submitted, or retrying."""
    if chain.state.final:
        return "-"
    seg = _upcoming(chain)
    if seg is None:
        return "-"
    if seg.phase is Phase.SUBMITTING:
        if seg.retry_at is not None:
            return f"#{seg.n} retry in {short(seg.retry_at - now)}"
        return f"#{seg.n} submitting"
    text = f"#{seg.n} {seg.job_id or '?'} queued"
    return text + (f" ({seg.reason})" if seg.reason else "")


def row(chain: Chain, now: float) -> tuple[str, ...]:
    running = _running(chain)
    n = running.n if running else max((s.n for s in chain.segments), default=0)
    return (
        chain.id,
        chain.state.value,
        bar(chain.latest.epoch, chain.spec.target_epoch),
        _eta_cell(chain, now),
        f"{n}/{chain.max_segments}",
        job_cell(chain, now),
        next_cell(chain, now),
        f"{chain.failures}/{chain.spec.max_failures}",
        f"{format_duration(trained(chain, now))}/{format_duration(chain.spec.total_time)}",
    )


def damaged_row(chain: DamagedChain) -> tuple[str, ...]:
    """A damaged chain's row: its id, "damaged", and nothing else known."""
    return (chain.id, "damaged", *("-" for _ in HEADER[2:]))


def table(chains: list[Chain], now: float, damaged: Sequence[DamagedChain] = ()) -> str:
    """The chains as an aligned table, each ended chain's reason below it, then what
    is wrong with each damaged chain."""
    rows = [HEADER, *(row(c, now) for c in chains), *(damaged_row(d) for d in damaged)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines += [
        f"{c.id}: {c.reason}" for c in chains if (c.state.final or c.state is ChainState.STUCK) and c.reason
    ]
    lines += [f"{d.id}: {d.reason}" for d in damaged]
    return "\n".join(lines)


def frame(home: Path, chains: list[Chain], now: float, damaged: Sequence[DamagedChain] = ()) -> str:
    """What `chainrun status` prints: the table (or that there are no chains), then the service."""
    service = service_line(home, now)
    if not chains and not damaged:
        return f"no chains; submit one with `chainrun submit JOBFILE`\n{service}"
    return f"{table(chains, now, damaged)}\n{service}"


def service_line(home: Path, now: float) -> str:
    """Whether a service is ticking these chains, from its status file."""
    st = read_status(home)
    pid = st.get("pid") if st else None
    if isinstance(pid, int) and alive(pid):
        at = st.get("at") if st else None
        ago = f"; last tick {short(now - at)} ago" if isinstance(at, (int, float)) else ""
        return f"service: running (pid {pid}){ago}: {st.get('status', '?') if st else '?'}"
    return (
        "service: not running; chains advance only while one runs "
        "(`chainrun service install --now`, or `chainrun daemon`)"
    )


def to_json(c: Chain, now: float) -> dict[str, Any]:
    """One chain for scripts: everything in the table, unrounded, plus the segments."""
    upcoming = None if c.state.final else _upcoming(c)
    rate = epoch_rate(c, now)
    return {
        "id": c.id,
        "name": c.spec.name,
        "state": c.state.value,
        "reason": c.reason,
        "epoch": c.latest.epoch,
        "target_epoch": c.spec.target_epoch,
        "progress": c.latest.to_json(),
        "epochs_per_hour": None if rate is None else rate * 3600,
        "eta_seconds": eta(c, now),
        "failures": c.failures,
        "max_failures": c.spec.max_failures,
        "used_seconds": c.used,
        "trained_seconds": trained(c, now),
        "total_seconds": c.spec.total_time,
        "max_segments": c.max_segments,
        "scheduler": c.spec.scheduler.kind,
        "host": c.spec.scheduler.host,
        "next": None
        if upcoming is None
        else {
            "n": upcoming.n,
            "job_id": upcoming.job_id,
            "phase": upcoming.phase.value,
            "reason": upcoming.reason,
            "retry_at": upcoming.retry_at,
        },
        "segments": [
            {
                "n": s.n,
                "job_id": s.job_id,
                "phase": s.phase.value,
                "walltime": s.walltime,
                "outcome": s.outcome.value if s.outcome else None,
                "exit_code": s.exit_code,
                "charged": s.charged,
                "reason": s.reason,
                "started_at": s.started_at,
                "ended_at": s.ended_at,
            }
            for s in c.segments
        ],
    }


def damaged_json(d: DamagedChain) -> dict[str, Any]:
    """A damaged chain for scripts: state "damaged", what is wrong, the jobs it may have left."""
    return {
        "id": d.id,
        "name": d.name,
        "state": "damaged",
        "reason": d.reason,
        "problem": d.problem,
        "jobs": list(d.jobs),
    }
