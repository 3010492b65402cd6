"""``chainrun history``: a chain's events, every decision with its reason, then its segments'
times (``accounting``): how long each waited in the queue once it could start, how long
it trained, how long its command took to exit after the signal (the save), the gap to its
successor's start, and the time the chain had trained when it ended, so that a gap between
two timestamps never has to be worked out by hand; then the chain's totals: the budget used
of ``total_time`` and where the allocation went. ``to_json`` gives
the same to scripts. The last line counts the chain's preemptions: segments that ended
preempted, and jobs the scheduler preempted and requeued (each an event of kind
"preempted").
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, Optional

from chainrun.accounting import SegmentAccount, account, describe
from chainrun.model import Chain, Outcome
from chainrun.status import budget_used
from chainrun.store import Event
from chainrun.text import duration

HEADER = ("SEGMENT", "JOB", "OUTCOME", "QUEUED", "TRAINING", "SAVING", "GAP", "TRAINED")
PLACES = ("PLACE", "COPY")  # for a chain with several places: where it ran, the checkpoint's copy there


def clock(at: float, date: bool = False) -> str:
    """A moment as local time: ``12:13:11``, with ``date`` ``2026-11-27 12:13:11``."""
    return datetime.fromtimestamp(at).strftime("%Y-%m-%d %H:%M:%S" if date else "%H:%M:%S")


def event_lines(events: Sequence[Event]) -> list[str]:
    return [f"{clock(ev.at, date=True)}  {ev.message}" for ev in events]


def _outcome(acc: SegmentAccount) -> str:
    return acc.outcome + (", charged" if acc.charged else "")


def _cell(seconds: Optional[float]) -> str:
    return "-" if seconds is None else duration(seconds)


def preemptions(chain: Chain, events: Sequence[Event]) -> tuple[int, int]:
    """How often the scheduler preempted the chain's jobs: in all, and of those how often
    it requeued the job instead of ending it."""
    requeued = sum(1 for ev in events if ev.kind == Outcome.PREEMPTED.value)
    ended = sum(1 for s in chain.segments if s.outcome is Outcome.PREEMPTED)
    return ended + requeued, requeued


def segment_lines(chain: Chain, now: float, events: Sequence[Event] = ()) -> list[str]:
    """The table of the chain's segments and their times, then the totals and the
    preemptions."""
    acc = account(chain, now)
    several = bool(chain.spec.places)  # a chain with several places: where each ran, and the copy there
    rows: list[tuple[str, ...]] = [HEADER + (PLACES if several else ())]
    trained = 0.0
    by_n = {s.n: s for s in chain.segments}
    for seg in acc.segments:
        trained += seg.training or 0.0
        row: tuple[str, ...] = (
            str(seg.n),
            seg.job_id or "-",
            _outcome(seg),
            _cell(seg.queued),
            _cell(seg.training),
            _cell(seg.saving),
            _cell(seg.gap),
            duration(trained) if seg.training is not None else "-",
        )
        if several:
            own = by_n[seg.n]
            row += (own.place or chain.spec.places[0].name, _cell(own.copy_seconds))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    count = sum(1 for s in acc.segments if s.training is not None)
    total, requeued = preemptions(chain, events)
    again = f" ({requeued} requeued)" if requeued else ""
    lines.append(
        f"budget used {duration(budget_used(chain, now))} of {duration(chain.spec.total_time)}"
        f" in {count} segment{'' if count == 1 else 's'}; {describe(acc)};"
        f" preempted {total} time{'' if total == 1 else 's'}{again}"
    )
    lines += [place.describe() for place in acc.places]
    return lines


def to_json(chain_id: str, events: Sequence[Event], chain: Optional[Chain], now: float) -> dict[str, Any]:
    """The same for scripts: the events, each segment's account and the chain's totals
    (None for a chain whose segments cannot be read)."""
    acc = account(chain, now) if chain is not None else None
    return {
        "id": chain_id,
        "events": [
            {"at": ev.at, "segment": ev.segment, "kind": ev.kind, "message": ev.message} for ev in events
        ],
        "segments": None if acc is None else [s.to_json() for s in acc.segments],
        "totals": None if acc is None else acc.to_json(),
        "preempted": None if chain is None else dict(zip(("times", "requeued"), preemptions(chain, events))),
    }
