"""Where a chain's allocation went: each segment's queue wait, time training, time from the
signal to the command's exit (the save and grace), the gap to its successor's start and its
outcome; and per chain, the time allocated (every segment from its start to its end), the
part of it that trained, the share that trained, and GPU-hours where the job asks for GPUs.

Everything is computed from the times stored with each segment (the scheduler's submit,
start and end, and the signal time from the wrapper's end marker) and ``now`` for the
segment still running: the figures agree with the scheduler's own accounting (sacct's
Submit/Start/End) to the second. A segment queued ahead waits in the queue only once it
could start: from its submission or its predecessor's end, whichever is later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from chainrun.model import Chain, Phase, SchedulerSpec, Segment
from chainrun.text import duration


def gpus(scheduler: SchedulerSpec) -> int:
    """GPUs each segment's job holds: a pool's ``gpus_per_slot``, or what the job's options
    ask for in its scheduler's syntax (``SchedulerSpec.options``); 0 when none."""
    if scheduler.gpus_per_slot:
        return scheduler.gpus_per_slot
    # Here, not at the top: `chainrun status` with no chain to account loads no backend.
    from chainrun.schedulers import scheduler_for

    return scheduler_for(scheduler.kind, scheduler.host).gpus_asked(scheduler.options)


@dataclass(frozen=True)
class SegmentAccount:
    """One segment's times, in seconds; None where not known (yet)."""

    n: int
    job_id: Optional[str]
    outcome: str  # how it ended, or its phase while it has not
    charged: bool
    submitted_at: Optional[float]
    started_at: Optional[float]
    signalled_at: Optional[float]
    ended_at: Optional[float]
    queued: Optional[float]  # from when it could start to its start (or its cancel)
    training: Optional[float]  # from its start to the signal (or its end, or now)
    saving: Optional[float]  # from the signal to the command's exit: the save and grace
    gap: Optional[float]  # from its end to its successor's start

    @property
    def allocated(self) -> float:
        """The time its job held the allocation."""
        return (self.training or 0.0) + (self.saving or 0.0)

    def to_json(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "job_id": self.job_id,
            "outcome": self.outcome,
            "charged": self.charged,
            "submitted_at": self.submitted_at,
            "started_at": self.started_at,
            "signalled_at": self.signalled_at,
            "ended_at": self.ended_at,
            "queued_seconds": self.queued,
            "training_seconds": self.training,
            "saving_seconds": self.saving,
            "gap_seconds": self.gap,
            "allocated_seconds": self.allocated,
        }


@dataclass(frozen=True)
class PlaceAccount:
    """What a chain with several places spent at one of them: its allocation there is
    charged to that place's account (its own GPUs per job)."""

    place: str
    segments: int  # that ran there
    allocated: float
    trained: float
    copying: float  # seconds of the checkpoint's copies to there
    gpus: int  # per job there; 0: none asked for

    @property
    def gpu_hours(self) -> Optional[float]:
        return self.allocated * self.gpus / 3600 if self.gpus else None

    def describe(self) -> str:
        """``at uni: 3 segments, allocated 11h58m, trained 11h40m; copies 2m; 12.0 GPU-hours``."""
        runs = f"{self.segments} segment{'' if self.segments == 1 else 's'}"
        text = f"at {self.place}: {runs}, allocated {duration(self.allocated)}"
        text += f", trained {duration(self.trained)}"
        text += f"; copies {duration(self.copying)}" if self.copying else ""
        return text + (f"; {self.gpu_hours:.1f} GPU-hours" if self.gpu_hours is not None else "")

    def to_json(self) -> dict[str, Any]:
        return {
            "place": self.place,
            "segments": self.segments,
            "allocated_seconds": self.allocated,
            "trained_seconds": self.trained,
            "copy_seconds": self.copying,
            "gpus": self.gpus,
            "gpu_hours": self.gpu_hours,
        }


@dataclass(frozen=True)
class ChainAccount:
    """A chain's segments' accounts and their totals (and, with several places, each place's)."""

    segments: tuple[SegmentAccount, ...]
    gpus: int  # per segment's job (at the place the chain is now); 0: none asked for
    places: tuple[PlaceAccount, ...] = ()

    @property
    def allocated(self) -> float:
        return sum(s.allocated for s in self.segments)

    @property
    def trained(self) -> float:
        return sum(s.training or 0.0 for s in self.segments)

    @property
    def queued(self) -> float:
        return sum(s.queued or 0.0 for s in self.segments)

    @property
    def saving(self) -> float:
        return sum(s.saving or 0.0 for s in self.segments)

    @property
    def gaps(self) -> float:
        return sum(s.gap or 0.0 for s in self.segments)

    @property
    def share(self) -> Optional[float]:
        """The share of the allocated time that trained; None before any segment ran."""
        return self.trained / self.allocated if self.allocated > 0 else None

    @property
    def gpu_hours(self) -> Optional[float]:
        """GPU-hours allocated (with several places: the sum of theirs); None when no job asks for GPUs."""
        if self.places:
            hours = [p.gpu_hours for p in self.places if p.gpu_hours is not None]
            return sum(hours) if hours else None
        return self.allocated * self.gpus / 3600 if self.gpus else None

    def to_json(self) -> dict[str, Any]:
        return {
            "places": [p.to_json() for p in self.places] or None,
            "allocated_seconds": self.allocated,
            "trained_seconds": self.trained,
            "trained_share": self.share,
            "queued_seconds": self.queued,
            "saving_seconds": self.saving,
            "gap_seconds": self.gaps,
            "gpus": self.gpus,
            "gpu_hours": self.gpu_hours,
        }


def _queued(seg: Segment, before: Optional[Segment]) -> Optional[float]:
    if seg.submitted_at is None:
        return None
    ready = seg.submitted_at
    if seg.after is not None and before is not None:
        if before.ended_at is None:
            return None  # its predecessor still runs: it is not waiting for the queue yet
        ready = max(ready, before.ended_at)
    until = seg.started_at if seg.started_at is not None else seg.ended_at
    return None if until is None else max(0.0, until - ready)


def _segment(seg: Segment, before: Optional[Segment], after: Optional[Segment], now: float) -> SegmentAccount:
    start = seg.started_at
    end = seg.ended_at
    if end is None and seg.phase is Phase.RUNNING and start is not None:
        end = max(start, min(now, start + seg.walltime))  # running: so far
    signal = seg.signalled_at
    if signal is not None and (start is None or end is None or not start <= signal <= end):
        signal = None  # a clock that disagrees: the whole run counts as training
    training = saving = None
    if start is not None and end is not None:
        training = max(0.0, (signal if signal is not None else end) - start)
        saving = end - signal if signal is not None else 0.0
    gap = None
    if seg.ended_at is not None and after is not None and after.started_at is not None:
        gap = max(0.0, after.started_at - seg.ended_at)
    return SegmentAccount(
        n=seg.n,
        job_id=seg.job_id,
        outcome=seg.outcome.value if seg.outcome is not None else seg.phase.value,
        charged=seg.charged,
        submitted_at=seg.submitted_at,
        started_at=seg.started_at,
        signalled_at=seg.signalled_at,
        ended_at=seg.ended_at,
        queued=_queued(seg, before),
        training=training,
        saving=saving,
        gap=gap,
    )


def account(chain: Chain, now: float) -> ChainAccount:
    """The chain's accounts; a running segment counts up to ``now``. A segment's successor
    is the next one that started (a successor cancelled while queued never ran)."""
    segs = chain.segments
    accounts = []
    for i, seg in enumerate(segs):
        after = next((s for s in segs[i + 1 :] if s.started_at is not None), None)
        accounts.append(_segment(seg, segs[i - 1] if i else None, after, now))
    return ChainAccount(tuple(accounts), gpus(chain.spec.scheduler), _places(chain, accounts))


def _places(chain: Chain, accounts: list[SegmentAccount]) -> tuple[PlaceAccount, ...]:
    """Each place's part, in the job file's order, for a chain with several (a segment with no
    place recorded ran at the first); a place where nothing ran is left out."""
    if not chain.spec.places:
        return ()
    first = chain.spec.places[0].name
    at = {seg.n: (seg.place or first, seg.copy_seconds or 0.0) for seg in chain.segments}
    parts = []
    for place in chain.spec.places:
        mine = [a for a in accounts if at[a.n][0] == place.name and a.started_at is not None]
        copying = sum(copy for place_name, copy in at.values() if place_name == place.name)
        if mine or copying:
            parts.append(
                PlaceAccount(
                    place=place.name,
                    segments=len(mine),
                    allocated=sum(a.allocated for a in mine),
                    trained=sum(a.training or 0.0 for a in mine),
                    copying=copying,
                    gpus=gpus(chain.spec.at(place.name).scheduler),
                )
            )
    return tuple(parts)


def describe(acc: ChainAccount) -> str:
    """The totals in one line: ``allocated 3h10m, trained 2h55m (92%); queued 12m, saving
    3m, gaps 40s; 1.6 GPU-hours``."""
    share = f" ({acc.share:.0%})" if acc.share is not None else ""
    text = (
        f"allocated {duration(acc.allocated)}, trained {duration(acc.trained)}{share}; "
        f"queued {duration(acc.queued)}, saving {duration(acc.saving)}, gaps {duration(acc.gaps)}"
    )
    if acc.gpu_hours is not None and acc.places:
        text += f"; {acc.gpu_hours:.1f} GPU-hours"
    elif acc.gpu_hours is not None:
        text += f"; {acc.gpu_hours:.1f} GPU-hours ({acc.gpus} GPU{'s' if acc.gpus > 1 else ''} a job)"
    return text
