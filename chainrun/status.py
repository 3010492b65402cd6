"""``chainrun status``: what a person reads at a glance, and the same as JSON.

One line per chain in a table that fits the width it is given (80 columns
unless the caller knows its terminal is wider): the chain, what it is doing
(running for how long, queued and why, retrying, or how it ended), a bar
towards the target epoch, the ETA from the epoch rate so far (epochs gained
per second of budget used), failures used of the budget, segments run of
the most the time budget allows, the budget used of ``total_time``, and the
job ids of its segments not ended. Columns that do not fit are dropped, least important first
(job ids, time, segments, ETA, failures, progress); the chain and its state
always stay, shortened with "…" if need be, and no line is ever longer than
the width. Below the table, by default, only the chains that need a person
get a line: failed, stuck, damaged, a submission being retried, or a job the
scheduler holds. ``verbose`` adds every chain's reason and details. Times
are relative ("5m ago", "in 40s"), never epoch seconds; durations are rounded, never cut
(``text.duration``). With no service
running, the store is only as new as the last tick of the one that stopped
(``last_tick``): an active chain is shown as it was then (``running as of 32s
ago``), its times up to then, never as if it had gone on. Everything here is
computed from ``Chain`` values and ``now``: no I/O but the service's
heartbeat file and lock.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional, Union

from chainrun import heartbeat, systemd
from chainrun.accounting import account, describe
from chainrun.lock import lock_for
from chainrun.model import WAITING_FOR_A_SLOT, Chain, ChainState, Outcome, Phase, Segment, chain_seed
from chainrun.schedulers.pending import will_not_start
from chainrun.store import DamagedChain, Glance, SegmentGlance, ran
from chainrun.store.database import DB_FILE
from chainrun.text import clip, duration, escaped

WIDTH = 80  # the table's width when the terminal's is not known (a pipe, a file)
BAR_WIDTH = 10
CHAIN_MAX = 24  # the chain column's widest at 80 columns; a wider terminal allows more
STATE_MAX = 26
TAIL_LINES = 5  # of a failed segment's output, under its chain's reason

# The columns in the order shown, each with its rank: when the table is too wide,
# the column of the highest rank goes first. CHAIN and STATE always stay.
COLUMNS: tuple[tuple[str, int], ...] = (
    ("CHAIN", 0),
    ("STATE", 0),
    ("PROGRESS", 1),
    ("ETA", 3),
    ("FAILURES", 2),
    ("SEGMENTS", 4),
    ("TIME", 5),
    ("JOBS", 6),
)
HEADER = tuple(name for name, _ in COLUMNS)

# The table is drawn from what it shows of each chain (``Glance``: what ``Store.glance``
# reads without decoding chains); a chain read in full is shown through its glance.
Shown = Union[Chain, Glance]


def _glance(chain: Shown) -> Glance:
    return chain if isinstance(chain, Glance) else Glance.of(chain)


def when(at: float, now: float) -> str:
    """A moment relative to ``now``: ``5m ago``, ``in 40s``, ``just now``."""
    if abs(at - now) < 1:
        return "just now"
    return f"{duration(now - at)} ago" if at < now else f"in {duration(at - now)}"


def budget_used(chain: Shown, now: float) -> float:
    """The budget used so far, the wall time counted against ``total_time``: ended segments
    from start to end, plus the running one up to now (with no service running: up to the
    last tick, ``seen``, passed as ``now``). Not the time trained: that leaves out the
    saving after each signal (``accounting``)."""
    total = chain.used
    for seg in _glance(chain).live:
        if seg.phase is Phase.RUNNING and seg.started_at is not None:
            total += max(0.0, min(now - seg.started_at, float(seg.walltime)))
    return total


def last_tick(home: Path) -> Optional[float]:
    """Until when the stored state is known when no service runs for ``home``: the last tick
    of the one that stopped. None while one runs (the state is current), and when no
    service ever ticked here."""
    beat = heartbeat.read(home)
    at = beat.get("at") if beat else None
    if not isinstance(at, (int, float)) or _service_runs(home):
        return None
    return float(at)


def _service_runs(home: Path) -> bool:
    """Whether a service holds ``home``'s lock (looked at only where there is a database:
    the look would create the state directory)."""
    return (Path(home) / DB_FILE).exists() and lock_for(home).held_elsewhere()


def epoch_rate(chain: Shown, now: float) -> Optional[float]:
    """Epochs per second of budget used over the chain so far; None when unknown.

    Counts from the epoch the chain started at (a run resumed from an existing
    checkpoint did not train its first epochs in this chain's time).
    """
    g = _glance(chain)
    return _rate(g, budget_used(g, now))


def _rate(g: Glance, elapsed: float) -> Optional[float]:
    if g.epoch is None or elapsed <= 0:
        return None
    gained = g.epoch - (g.baseline_epoch or 0)
    return gained / elapsed if gained > 0 else None


def eta(chain: Shown, now: float) -> Optional[float]:
    """Seconds of budget until the target epoch at the current rate; None when unknown."""
    g = _glance(chain)
    return _eta(g, budget_used(g, now))


def _eta(g: Glance, elapsed: float) -> Optional[float]:
    target, epoch = g.target_epoch, g.epoch
    if g.state.final or target is None or epoch is None:
        return None
    if epoch >= target:
        return 0.0
    rate = _rate(g, elapsed)
    return (target - epoch) / rate if rate else None


def bar(done: Optional[int], total: Optional[int], width: int = BAR_WIDTH) -> str:
    """``[###.......] 10/40``; ``epoch 12`` without a target; ``-`` without epochs."""
    if done is None:
        return "-"
    if not total:
        return f"epoch {done}"
    filled = max(0, min(width, width * done // total))
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total}"


def segments_run(chain: Shown) -> int:
    return _glance(chain).ran


def failures_cell(chain: Shown) -> str:
    """``1 of 3``: failures used of the budget. The chain fails at the failure after the
    budget, which reads ``4 (budget 3)``: never as if 4 of 3 could be allowed."""
    used, budget = chain.failures, _glance(chain).max_failures
    return f"{used} of {budget}" if used <= budget else f"{used} (budget {budget})"


def _eta_cell(chain: Glance, elapsed: float) -> str:
    if chain.state is ChainState.COMPLETED:
        return "done"
    left = _eta(chain, elapsed)
    if left is None:
        return "-"
    return duration(left) + (" > budget" if left > chain.total_time - elapsed else "")


def _running(chain: Glance) -> Optional[SegmentGlance]:
    return next((s for s in chain.live if s.phase is Phase.RUNNING), None)


def _upcoming(chain: Glance) -> Optional[SegmentGlance]:
    waiting = [s for s in chain.live if s.phase is not Phase.RUNNING]
    return min(waiting, key=lambda s: s.n) if waiting else None


def _not_running(seg: SegmentGlance, now: float) -> str:
    """A segment not yet running: queued with its pending reason, being submitted, or retrying."""
    if seg.phase is Phase.SUBMITTING:
        if seg.retry_at is None:
            return "submitting"
        return f"retry in {duration(seg.retry_at - now)}" if seg.retry_at > now else "retrying"
    return "queued" + (f" ({seg.reason})" if seg.reason else "")


_DOING = {Phase.RUNNING: "running", Phase.PENDING: "queued"}


def state_cell(chain: Shown, now: float, seen: Optional[float] = None) -> str:
    """What the chain is doing: ``running 10m``, ``queued (Priority)``, ``retry in 40s``;
    once it ended (or is stuck), its state. With no service running, what it was doing at
    the last tick ``seen``: ``running as of 32s ago``."""
    chain = _glance(chain)
    if chain.state is not ChainState.ACTIVE:
        return str(chain.state.value)
    seg = _running(chain) or _upcoming(chain)
    if seen is not None and seg is not None:  # its word alone: its reason may have changed since
        return f"{_DOING.get(seg.phase, 'submitting')} as of {when(seen, now)}"
    seg = _running(chain)
    if seg is not None:
        return "running" + (f" {duration(now - seg.started_at)}" if seg.started_at is not None else "")
    seg = _upcoming(chain)
    if seg is None and chain.reason.startswith(WAITING_FOR_A_SLOT):
        return "waiting for a slot"
    if seg is None and not chain.segments and chain.max_concurrent:
        return f"waiting (max_concurrent {chain.max_concurrent})"  # for a chain of its sweep to end
    return _not_running(seg, now) if seg is not None else str(chain.state.value)


def row(chain: Shown, now: float, seen: Optional[float] = None) -> tuple[str, ...]:
    """Every column's cell for ``chain``, in ``HEADER`` order, before any is dropped (as of
    the last tick ``seen`` when no service runs)."""
    chain = _glance(chain)
    elapsed = budget_used(chain, now if seen is None else min(now, seen))
    return (
        chain.id,
        state_cell(chain, now, seen),
        bar(chain.epoch, chain.target_epoch),
        _eta_cell(chain, elapsed),
        failures_cell(chain),
        f"{chain.ran} of ≤{chain.max_segments}",
        f"{duration(elapsed)} of {duration(chain.total_time)}",
        ",".join(s.job_id for s in chain.live if s.job_id) or "-",
    )


def damaged_row(chain: DamagedChain) -> tuple[str, ...]:
    """A damaged chain's row: its id, "damaged", and nothing else known."""
    return (chain.id, "damaged", *("-" for _ in HEADER[2:]))


def _held_by_scheduler(chain: Glance, seg: SegmentGlance) -> bool:
    """A job the scheduler holds for a reason other than the dependency chainrun gave it:
    a user or admin hold (Slurm's JobHeldUser, JobHeldAdmin), or SGE's hold with no
    predecessor left to wait for. It will not start by itself."""
    if seg.phase is not Phase.PENDING or "held" not in seg.reason.lower():
        return False
    predecessor = any(s.job_id == seg.after for s in chain.live if s is not seg and s.job_id)
    return seg.reason.startswith("JobHeld") or not predecessor


def never_clears(seg: Union[Segment, SegmentGlance]) -> str:
    """``, will not start by itself: WHAT TO CHANGE`` for a segment whose job the scheduler
    keeps pending for a reason that will not clear by itself (Slurm's PartitionNodeLimit,
    ...); "" for any other."""
    advice = will_not_start(seg.reason) if seg.phase is Phase.PENDING else ""
    return f", will not start by itself: {advice}" if advice else ""


def attention(chain: Shown, now: float) -> str:
    """Why a person should look at the chain, or "" when it needs nobody: failed, stuck,
    retrying a submission, held by the scheduler, pending for a reason that will not clear
    by itself (with what to change), or starting up for most of each segment."""
    chain = _glance(chain)
    if chain.state in (ChainState.FAILED, ChainState.STUCK):
        return chain.reason or chain.state.value
    for seg in chain.live:
        if seg.phase is Phase.SUBMITTING and seg.retry_at is not None:
            return f"segment {seg.n}: submission failed ({_not_running(seg, now)}): {seg.reason}"
        blocked = never_clears(seg)
        if blocked:
            again = "; then cancel the chain and submit it again"
            return f"segment {seg.n}: job {seg.job_id} queued ({seg.reason}){blocked}{again}"
        if _held_by_scheduler(chain, seg):
            return (
                f"segment {seg.n}: job {seg.job_id} is held by the scheduler ({seg.reason}); "
                "it will not start until released"
            )
    return "" if chain.state.final else chain.slow_start


def owed_line(owed: Sequence[tuple[str, float]], now: float) -> str:
    """The jobs of a chain whose cancel did not reach the scheduler (``owed``: each with
    since when), in a line: what they are and what becomes of them."""
    jobs = ", ".join(job for job, _ in owed)
    return (
        f"cancel owed: job{'s' * (len(owed) > 1)} {jobs}, since {when(min(t for _, t in owed), now)}: "
        "the scheduler did not take the cancel; the service sends it again once it answers"
    )


def details(
    chain: Chain, now: float, seen: Optional[float] = None, owed: Sequence[tuple[str, float]] = ()
) -> list[str]:
    """``verbose``: everything a person may ask about the chain, a fact a line (its state as
    of the last tick ``seen`` when no service runs; ``owed``: its jobs whose cancel did not
    reach the scheduler, each with since when)."""
    lines = []
    if chain.reason:
        lines.append(f"reason: {chain.reason}")
    if owed:
        lines.append(owed_line(owed, now))
    glance = Glance.of(chain)
    if glance.slow_start:
        lines.append(f"warning: {glance.slow_start}")
    upto = now if seen is None or chain.state.final else min(now, seen)
    if upto != now:
        lines.append(f"as of the last tick, {when(upto, now)}: no service has run since")
    seg = _running(glance)
    if seg is not None:
        since = f" for {duration(upto - seg.started_at)}" if seg.started_at is not None else ""
        on = f" on {seg.host}" if seg.host else ""
        lines.append(f"segment {seg.n}: job {seg.job_id or '?'}{on} running{since}")
    last = next((s for s in reversed(chain.segments) if s.outcome is not None), None)
    if last is not None and last.outcome is Outcome.PREEMPTED and not chain.state.final:
        lines.append(f"segment {last.n}: job {last.job_id} preempted, not charged; the chain goes on")
    nxt = None if chain.state.final else _upcoming(glance)
    if nxt is not None:
        job = (f"job {nxt.job_id} " if nxt.job_id else "") + (f"on {nxt.host} " if nxt.host else "")
        lines.append(f"next: segment {nxt.n}: {job}{_not_running(nxt, now)}{never_clears(nxt)}")
    latest = chain.latest
    if latest.epoch is not None or latest.saved_at is not None:
        target = f" of {chain.spec.target_epoch}" if chain.spec.target_epoch else ""
        text = f"epoch {latest.epoch}{target}" if latest.epoch is not None else "a checkpoint"
        if latest.saved_at is not None:
            text += f", saved {when(latest.saved_at, now)}"
        lines.append(f"progress: {text}" + (f" ({latest.file})" if latest.file else ""))
    else:
        lines.append("progress: no checkpoint yet")
    used, total = duration(budget_used(glance, upto)), duration(chain.spec.total_time)
    lines.append(
        f"budget: used {used} of {total}; "
        f"{glance.ran} of at most {chain.max_segments} segments run; "
        f"failures {failures_cell(glance)}"
    )
    lines.append(f"allocation: {describe(account(chain, upto))}")
    from chainrun.decide.grace import grace_in_force  # here: a plain `status` imports no rules

    lines.append(f"grace: {grace_in_force(chain.spec, chain.segments).describe()}")
    from chainrun.decide.carry import carry_line

    if carry_line(chain.spec) and not chain.state.final:
        lines.append(carry_line(chain.spec))
    placed = _placed(chain, lambda s: s.host)
    if placed:
        lines.append(f"hosts: {placed}")
    places = chain.spec.places
    if places:  # several places: where each segment ran, and where the chain is now
        ran = _placed(chain, lambda s: (s.place or places[0].name) if s.job_id is not None else None)
        names = ", ".join(p.name for p in places)
        lines.append(f"places: {ran or 'none ran yet'}; now at {chain.spec.place_name} (of {names})")
    queue = f", queue {chain.spec.scheduler.queue}" if chain.spec.scheduler.queue else ""
    lines.append(f"scheduler: {chain.spec.scheduler.kind} on {chain.spec.scheduler.where}{queue}")
    started = f"submitted {when(chain.created_at, now)}"
    if chain.ended_at is not None:
        started += f", ended {when(chain.ended_at, now)}"
    lines.append(started)
    return lines


def _placed(chain: Chain, where: Callable[[Segment], Optional[str]]) -> str:
    """Where the chain's segments ran (``where``: a pool's host, or a chain's place), a run of
    segments at one at a time: ``segments 1-2 on gpu1, 3 on gpu2``; "" when none says."""
    runs: list[tuple[int, int, str]] = []
    for seg in chain.segments:
        at = where(seg)
        if at is None:
            continue
        if runs and runs[-1][2] == at and runs[-1][1] == seg.n - 1:
            runs[-1] = (runs[-1][0], seg.n, at)
        else:
            runs.append((seg.n, seg.n, at))
    parts = [f"{a} on {h}" if a == b else f"{a}-{b} on {h}" for a, b, h in runs]
    return (
        ("segment " if len(runs) == 1 and runs[0][0] == runs[0][1] else "segments ") + ", ".join(parts)
        if parts
        else ""
    )


def _clip_id(chain_id: str, width: int) -> str:
    """An id shortened in its name, keeping the random suffix that tells chains apart."""
    if len(chain_id) <= width:
        return chain_id
    head, sep, suffix = chain_id.rpartition("-")
    keep = len(sep + suffix)
    if not head or width < keep + 2:
        return clip(chain_id, width)
    return chain_id[: width - keep - 1] + "…" + chain_id[-keep:]


def _wrap(text: str, width: int, indent: str = "", more: str = "    ") -> list[str]:
    """``text`` as lines of at most ``width`` columns, its first after ``indent``."""
    return textwrap.wrap(
        escaped(text),
        width,
        initial_indent=indent,
        subsequent_indent=indent + more,
        break_on_hyphens=False,
    ) or [indent.rstrip()]


def columns(rows: Sequence[tuple[str, ...]], width: int, ranks: Sequence[int]) -> list[str]:
    """The rows aligned, dropping the columns of highest rank (``ranks``, one a column; 0:
    never dropped) until they fit ``width``."""
    keep = list(range(len(ranks)))
    widths = [max(map(len, column)) for column in zip(*rows)]
    for _, i in sorted(((rank, i) for i, rank in enumerate(ranks) if rank), reverse=True):
        if sum(widths[k] for k in keep) + 2 * (len(keep) - 1) <= width:
            break
        keep.remove(i)
    lines = ["  ".join(r[i].ljust(widths[i]) for i in keep).rstrip() for r in rows]
    return [clip(line, width) for line in lines]  # a terminal narrower than the columns kept


# What names each chain in the table's first columns: their headings, and a chain's cells
# (a sweep's chains are named by their parameters: ``sweepstatus.label``). None: its id.
Label = tuple[tuple[str, ...], Callable[[Shown], tuple[str, ...]]]


def table(
    chains: Sequence[Shown],
    now: float,
    damaged: Sequence[DamagedChain] = (),
    *,
    width: int = WIDTH,
    verbose: bool = False,
    tails: bool = False,
    seen: Optional[float] = None,
    label: Optional[Label] = None,
    owed: Optional[Mapping[str, Sequence[tuple[str, float]]]] = None,
) -> str:
    """The chains as a table of one line each, at most ``width`` columns, then the lines
    about them: those needing attention (every chain's details when ``verbose``, with the
    cancels it is ``owed``, by chain id: ``Store.owed_cancels``), and
    what is wrong with each damaged chain. ``tails``: a failed chain's last output
    lines and the command that shows the rest. ``verbose`` and ``tails`` need the
    chains read in full; the table alone, their glances. ``seen``: the last tick, when
    no service runs (``last_tick``). ``label``: what names each chain in the first
    columns, instead of its id."""
    glances = [_glance(c) for c in chains]
    chain_max = max(CHAIN_MAX, width * 3 // 10)
    heads, cells = label or (HEADER[:1], lambda c: (_clip_id(c.id, chain_max),))
    rows = [(*heads, *HEADER[1:])]
    for c, g in zip(chains, glances):
        cell = row(g, now, seen)
        rows.append((*cells(c), clip(cell[1], STATE_MAX), *cell[2:]))
    for d in damaged:
        rows.append((_clip_id(d.id, chain_max), *("-" for _ in heads[1:]), *damaged_row(d)[1:]))
    lines = columns(rows, width, (*(0 for _ in heads), *(rank for _, rank in COLUMNS[1:])))
    for c, g in zip(chains, glances):
        full = c if isinstance(c, Chain) else None
        if (verbose or tails) and full is None:
            raise TypeError(f"verbose or tails: chain {c.id} must be read in full (Store.shown)")
        if verbose and full is not None:
            lines.append(f"{_clip_id(c.id, width - 1)}:")
            for fact in details(full, now, seen, (owed or {}).get(c.id, ())):
                lines += _wrap(fact, width, "  ")
        else:
            why = attention(g, now)
            if why:
                lines += _wrap(f"{c.id}: {why}", width)
        if tails and full is not None and full.state is ChainState.FAILED:
            lines += _tail(full, width)
    for d in damaged:
        lines += _wrap(f"{d.id}: damaged: {d.problem}; the service skips it", width)
        if d.jobs:
            lines += _wrap(
                f"  its jobs {', '.join(d.jobs)} may still be queued or running: cancel them with "
                "the scheduler's own command",
                width,
            )
        # A command to copy whole: never broken over lines, however long.
        lines.append(f"  `chainrun cancel` cannot act on it; remove it with: {d.removal}")
    return "\n".join(lines)


def _tail(chain: Chain, width: int) -> list[str]:
    """The failing segment's last output lines, and how to read all of it."""
    seg = chain.failing
    if seg is None:
        return []
    lines = []
    if seg.tail:
        lines += _wrap(f"  the last lines of segment {seg.n}'s output:", width)
        lines += [clip(f"    {escaped(line)}", width) for line in seg.tail[-TAIL_LINES:]]
    lines += _wrap(f"  all of it: chainrun logs {chain.id} -n {seg.n}", width)
    return lines


def frame(
    home: Path,
    chains: Sequence[Shown],
    now: float,
    damaged: Sequence[DamagedChain] = (),
    *,
    width: int = WIDTH,
    verbose: bool = False,
    tails: bool = False,
    label: Optional[Label] = None,
    owed: Optional[Mapping[str, Sequence[tuple[str, float]]]] = None,
) -> str:
    """What `chainrun status` prints: the table (or that there are no chains), then the service."""
    # A command to paste (indented four) is left whole: broken in two, it would not run.
    active = any(not c.state.final for c in chains)
    service = "\n".join(
        wrapped
        for line in service_line(home, now, advise=active).splitlines()
        for wrapped in ([escaped(line)] if line.startswith("    ") else _wrap(line, width))
    )
    if not chains and not damaged:
        return f"no chains; submit one with `chainrun submit JOBFILE`\n{service}"
    text = table(
        chains,
        now,
        damaged,
        width=width,
        verbose=verbose,
        tails=tails,
        seen=last_tick(home),
        label=label,
        owed=owed,
    )
    return f"{text}\n{service}"


def service_line(home: Path, now: float, advise: bool = True) -> str:
    """Whether a service is ticking these chains (it holds the lock), with its status file's
    news; when not, since when the state shown is known, and (``advise``: some chain has not
    ended) a second line on how to start one."""
    st = heartbeat.read(home) or {}
    at = st.get("at")
    last = f"last tick {when(at, now)}" if isinstance(at, (int, float)) else ""
    if _service_runs(home):
        pid = st.get("pid") if isinstance(st.get("pid"), int) else lock_for(home).holder()
        return f"service: running (pid {pid or '?'}){'; ' if last else ''}{last}: {st.get('status') or '?'}"
    stopped = f"service: not running{f' ({last})' if last else ''}"
    if not advise:
        return stopped
    return f"{stopped}; chains advance only while one runs:\n  {systemd.start_advice(home)}"


def to_json(c: Chain, now: float, owed: Sequence[tuple[str, float]] = ()) -> dict[str, Any]:
    """One chain for scripts: everything in the table and the details, unrounded, plus the
    segments (``owed``: its jobs whose cancel did not reach the scheduler, with since when)."""
    from chainrun.decide.carry import off_because

    g = Glance.of(c)
    upcoming = None if c.state.final else _upcoming(g)
    rate = epoch_rate(g, now)
    return {
        "id": c.id,
        "name": c.spec.name,
        "sweep": c.spec.sweep_name or None,
        "params": {k: json.loads(v) for k, v in c.spec.params} if c.spec.sweep_name else None,
        "rep": c.spec.rep if c.spec.sweep_name else None,
        "seed": chain_seed(c.spec, c.id),
        "state": c.state.value,
        "reason": c.reason,
        "attention": attention(g, now) or None,
        "epoch": c.latest.epoch,
        "target_epoch": c.spec.target_epoch,
        "progress": c.latest.to_json(),
        "epochs_per_hour": None if rate is None else rate * 3600,
        "eta_seconds": eta(g, now),
        "failures": c.failures,
        "max_failures": c.spec.max_failures,
        "used_seconds": c.used,
        "budget_used_seconds": budget_used(g, now),
        "total_seconds": c.spec.total_time,
        "segments_run": g.ran,
        "max_segments": c.max_segments,
        "accounting": account(c, now).to_json(),
        "scheduler": c.spec.scheduler.kind,
        "self_queue_off": off_because(c.spec) or None,  # why segments never queue their successors
        "host": c.host,
        "place": c.spec.place_name or None,  # where a chain with several places is now
        "created_at": c.created_at,
        "ended_at": c.ended_at,
        # Jobs still queued or running whose cancel the service sends once the scheduler answers.
        "cancel_owed": [{"job_id": job_id, "since": since} for job_id, since in owed],
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
                "ran": ran(s),
                "reason": s.reason,
                "submitted_at": s.submitted_at,
                "started_at": s.started_at,
                "signalled_at": s.signalled_at,
                "ready_at": s.ready_at,
                "ended_at": s.ended_at,
                "tail": list(s.tail),
                "host": s.host,
                # A chain with several places: where it ran, and the checkpoint copied there first.
                "place": (s.place or c.spec.places[0].name) if c.spec.places else None,
                "copy": None
                if s.copy_seconds is None
                else {"seconds": s.copy_seconds, "bytes": s.copy_bytes, "sha256": s.copy_digest},
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
