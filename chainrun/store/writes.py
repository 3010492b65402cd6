"""The tick's writes, and the commands': each function runs inside one transaction the
``Store`` opens, so that everything a tick learned and did for one chain is written at
once, or not at all.

Submission is journaled: a segment row in phase ``submitting`` is written before the
scheduler is asked (``journal_submit``), so a crash between the two is found again and
resolved by adoption rather than a second submission. Every decision is written with its
reason to the append-only events log.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from typing import Optional

from chainrun.model import (
    Action,
    Adopt,
    Cancel,
    ChainState,
    EndSegment,
    Finish,
    JobSpec,
    MarkStuck,
    Move,
    Outcome,
    Phase,
    Progress,
    Reject,
    Remove,
    RetryLater,
    SetGrace,
    Submit,
    Track,
    Unstick,
    Wait,
    new_chain_id,
)
from chainrun.store.views import LIVE_STATES
from chainrun.text import duration


def add_chains(db: sqlite3.Connection, new: Sequence[tuple[JobSpec, Progress]], now: float) -> list[str]:
    """Store new chains, each with the progress it starts from, all in one transaction
    (none stored if one cannot be); their ids, in order."""
    ids: list[str] = []
    for spec, progress in new:
        start = json.dumps(progress.to_json())
        chain_id = new_chain_id(spec.name)
        # Six random hex digits: among thousands of chains of one name, two meet.
        while db.execute("SELECT 1 FROM chains WHERE id = ?", (chain_id,)).fetchone():
            chain_id = new_chain_id(spec.name)
        db.execute(
            "INSERT INTO chains (id, name, spec, state, created_at, progress, baseline)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                chain_id,
                spec.name,
                json.dumps(spec.to_json()),
                ChainState.ACTIVE.value,
                now,
                start,
                start,
            ),
        )
        submitted = f"chain submitted from {spec.source}"
        if spec.snapshot_commit:
            submitted += f"; code snapshot {spec.snapshot_commit} (refs/chainrun/{chain_id})"
        event(db, chain_id, None, now, "submitted", submitted)
        ids.append(chain_id)
    return ids


def request_cancel(db: sqlite3.Connection, chain_id: str, now: float) -> None:
    db.execute(
        "UPDATE chains SET cancel_requested = 1, cancel_requested_at = COALESCE(cancel_requested_at, ?) "
        "WHERE id = ?",
        (now, chain_id),
    )
    event(db, chain_id, None, now, "cancel", "cancel requested by user")


def journal_submit(
    db: sqlite3.Connection,
    chain_id: str,
    sub: Submit,
    now: float,
    host: Optional[str] = None,
    task: Optional[tuple[str, int]] = None,
    place: Optional[str] = None,
) -> int:
    """Write 'submitting segment n' (on ``host``, for a pool; at ``place``, for a chain
    with several) before the scheduler is asked;
    returns the attempt's number. A crash after this is resolved by adoption (decide),
    never a second job. ``task``: the array job (name) and task the segment goes out as;
    kept from the first attempt on, as every later one submits that task again."""
    array, index = task or (None, None)
    row = db.execute(
        "SELECT attempts FROM segments WHERE chain_id = ? AND n = ?", (chain_id, sub.n)
    ).fetchone()
    if row is None:
        db.execute(
            "INSERT INTO segments (chain_id, n, walltime, phase, after, attempts, "
            "submitted_at, host, array, task, place) VALUES (?, ?, ?, ?, ?, 1, ?, ?, ?, ?, ?)",
            (
                chain_id,
                sub.n,
                sub.walltime,
                Phase.SUBMITTING.value,
                sub.after,
                now,
                host,
                array,
                index,
                place,
            ),
        )
        return 1
    db.execute(
        "UPDATE segments SET attempts = attempts + 1, submitted_at = ?, array = COALESCE(array, ?), "
        "task = COALESCE(task, ?) WHERE chain_id = ? AND n = ?",
        (now, array, index, chain_id, sub.n),
    )
    return int(row["attempts"]) + 1


def record_copy(
    db: sqlite3.Connection,
    chain_id: str,
    n: int,
    seconds: float,
    size: int,
    digest: Optional[str],
    message: str,
    now: float,
) -> None:
    """Record the checkpoint copied to segment ``n``'s place before it is submitted there."""
    db.execute(
        "UPDATE segments SET copy_seconds = ?, copy_bytes = ?, copy_digest = ? WHERE chain_id = ? AND n = ?",
        (seconds, size, digest, chain_id, n),
    )
    event(db, chain_id, n, now, "copy", message)


def record(
    db: sqlite3.Connection,
    chain_id: str,
    actions: list[Action],
    latest: Optional[Progress],
    warnings: list[str],
    now: float,
) -> None:
    """Record one tick of a chain in one transaction: the actions carried out (each
    with its reason), the newest progress seen, and what went wrong on the way."""
    if latest is not None:
        text = json.dumps(latest.to_json())
        db.execute("UPDATE chains SET latest = ? WHERE id = ?", (text, chain_id))
        db.execute(
            "INSERT INTO progress_log (chain_id, at, progress) VALUES (?, ?, ?)", (chain_id, now, text)
        )
    for action in actions:
        _apply(db, chain_id, action, now)
    for text in warnings:
        event(db, chain_id, None, now, "warning", text)


def _apply(db: sqlite3.Connection, chain_id: str, action: Action, now: float) -> None:
    seg = (chain_id, getattr(action, "n", None))
    if isinstance(action, Track):
        row = db.execute("SELECT phase FROM segments WHERE chain_id = ? AND n = ?", seg).fetchone()
        # Submitted before it started, whatever the service learned first (a carried one).
        db.execute(
            "UPDATE segments SET phase = ?, reason = ?, started_at = COALESCE(started_at, ?), "
            "submitted_at = MIN(submitted_at, COALESCE(?, submitted_at)), missing_since = ? "
            "WHERE chain_id = ? AND n = ?",
            (
                action.phase.value,
                action.reason,
                action.started_at,
                action.started_at,
                action.missing_since,
                *seg,
            ),
        )
        if row is not None and row["phase"] != action.phase.value:
            text = f"segment {action.n} is {action.phase.value}"
            kind = Outcome.PREEMPTED.value if action.preempted else action.phase.value
            at = _then(action.started_at if action.phase is Phase.RUNNING else None, now)
            event(db, chain_id, action.n, at, kind, text + _paren(action.reason))
        elif action.missing_since is not None:
            event(db, chain_id, action.n, now, "missing", f"segment {action.n} {action.reason}")
        if action.walltime is not None:
            _granted(db, chain_id, action.n, action.walltime, now)
    elif isinstance(action, Adopt):
        if action.walltime is not None:  # queued by the segment before it, at its place: not journaled here
            db.execute(
                "INSERT OR IGNORE INTO segments (chain_id, n, walltime, phase, after, submitted_at, place) "
                "VALUES (?, ?, ?, ?, ?, ?, (SELECT place FROM segments WHERE chain_id = ? AND n = ?))",
                (
                    *seg,
                    action.walltime,
                    Phase.PENDING.value,
                    action.after,
                    _then(action.submitted_at, now),
                    chain_id,
                    action.n - 1,
                ),
            )
        db.execute(
            "UPDATE segments SET job_id = ?, phase = CASE WHEN phase = ? THEN ? ELSE phase END, "
            "retry_at = NULL, missing_since = NULL WHERE chain_id = ? AND n = ?",
            (action.job_id, Phase.SUBMITTING.value, Phase.PENDING.value, *seg),
        )
        at = _then(action.submitted_at, now)
        event(db, chain_id, action.n, at, "job", f"segment {action.n} {action.how} as job {action.job_id}")
    elif isinstance(action, Move):
        event(
            db,
            chain_id,
            action.n,
            now,
            "move",
            f"segment {action.n} goes to {action.place}"
            + (f" (host {action.host})" if action.host else "")
            + f": {action.reason}",
        )
    elif isinstance(action, RetryLater):
        db.execute(
            "UPDATE segments SET retry_at = ?, reason = ? WHERE chain_id = ? AND n = ?",
            (action.at, action.reason, *seg),
        )
        event(
            db,
            chain_id,
            action.n,
            now,
            "retry",
            f"submitting segment {action.n} failed, retrying in {action.at - now:.0f}s: {action.reason}",
        )
    elif isinstance(action, Reject):
        db.execute(
            "UPDATE segments SET phase = ?, outcome = ?, reason = ?, ended_at = ? "
            "WHERE chain_id = ? AND n = ?",
            (Phase.ENDED.value, Outcome.REJECTED.value, action.reason, now, *seg),
        )
        event(db, chain_id, action.n, now, "rejected", f"segment {action.n} rejected: {action.reason}")
    elif isinstance(action, Remove):
        event(db, chain_id, action.n, now, "removed", f"job {action.job_id} removed: {action.reason}")
    elif isinstance(action, EndSegment):
        db.execute(
            "UPDATE segments SET phase = ?, outcome = ?, exit_code = ?, charged = ?, "
            "ended_at = ?, reason = ?, tail = ?, stop = ?, started_at = COALESCE(started_at, ?), "
            "signalled_at = ?, ready_at = ? WHERE chain_id = ? AND n = ?",
            (
                Phase.ENDED.value,
                action.outcome.value,
                action.exit_code,
                int(action.charged),
                action.ended_at,
                action.reason,
                json.dumps(list(action.tail)) if action.tail else None,
                action.stop,
                _started(action.ended_at, action.elapsed),
                action.signalled_at,
                action.ready_at,
                *seg,
            ),
        )
        _credit(db, chain_id, action.charged, action.elapsed, action.progress)
        cost = "costs one failure" if action.charged else "no cost"
        event(
            db,
            chain_id,
            action.n,
            _then(action.ended_at, now),
            "ended",
            f"segment {action.n} ended: {action.reason}; {cost}; progress: {action.progress.describe()}",
        )
    elif isinstance(action, Cancel):
        # The job may be one found under the segment's tag, whose submission an
        # interrupted service never recorded: the segment keeps it.
        ended = db.execute(
            "UPDATE segments SET phase = ?, outcome = ?, ended_at = ?, reason = ?, "
            "job_id = COALESCE(job_id, ?), started_at = COALESCE(started_at, ?) "
            "WHERE chain_id = ? AND n = ? AND phase != ?",
            (
                Phase.ENDED.value,
                Outcome.CANCELLED.value,
                now,
                action.reason,
                action.job_id,
                _started(now, action.elapsed),
                *seg,
                Phase.ENDED.value,
            ),
        ).rowcount
        if ended and (action.elapsed or action.progress is not None):
            _credit(db, chain_id, False, action.elapsed, action.progress)
        job = f"job {action.job_id}" if action.job_id else "not yet submitted"
        event(
            db,
            chain_id,
            action.n,
            now,
            "cancelled",
            f"segment {action.n} ({job}) cancelled: {action.reason}",
        )
    elif isinstance(action, Finish):
        db.execute(
            "UPDATE chains SET state = ?, reason = ?, ended_at = ? WHERE id = ?",
            (action.state.value, action.reason, now, chain_id),
        )
        event(db, chain_id, None, now, action.state.value, f"chain {action.state.value}: {action.reason}")
    elif isinstance(action, Wait):
        # Said once while it lasts; nothing to say once the chain goes on.
        changed = db.execute(
            "UPDATE chains SET reason = ? WHERE id = ? AND reason != ? AND state IN (?, ?)",
            (action.reason, chain_id, action.reason, *LIVE_STATES),
        ).rowcount
        if changed and action.reason:
            event(db, chain_id, None, now, "waiting", action.reason)
    elif isinstance(action, SetGrace):
        event(db, chain_id, None, now, "grace", f"grace {action.seconds}s from now on: {action.reason}")
    elif isinstance(action, (MarkStuck, Unstick)):
        state = ChainState.STUCK if isinstance(action, MarkStuck) else ChainState.ACTIVE
        db.execute(
            "UPDATE chains SET state = ?, reason = ? WHERE id = ? AND state IN (?, ?)",
            (state.value, action.reason, chain_id, *LIVE_STATES),
        )
        event(db, chain_id, None, now, state.value, f"chain {state.value}: {action.reason}")
    else:
        raise TypeError(f"not a recorded action: {action!r}")


def _credit(
    db: sqlite3.Connection, chain_id: str, charged: bool, elapsed: float, progress: Optional[Progress]
) -> None:
    """A segment's end on the chain: a failure if ``charged``, the time it ran, and the
    checkpoint it left as the chain's mark (None: the mark stays)."""
    db.execute(
        "UPDATE chains SET failures = failures + ?, used = used + ?, progress = COALESCE(?, progress) "
        "WHERE id = ?",
        (int(charged), elapsed, None if progress is None else json.dumps(progress.to_json()), chain_id),
    )


def _started(ended_at: float, elapsed: float) -> Optional[float]:
    """When a segment that ran ``elapsed`` seconds until ``ended_at`` started, for one whose
    start no tick saw (it started and ended between two): its running time stays known."""
    return ended_at - elapsed if elapsed > 0 else None


def event(
    db: sqlite3.Connection, chain_id: str, segment: Optional[int], at: float, kind: str, message: str
) -> None:
    db.execute(
        "INSERT INTO events (chain_id, segment, at, kind, message) VALUES (?, ?, ?, ?, ?)",
        (chain_id, segment, at, kind, message),
    )


def _granted(db: sqlite3.Connection, chain_id: str, n: int, walltime: int, now: float) -> None:
    """Segment ``n`` started with a shorter limit than it asked for: its walltime from now on."""
    row = db.execute("SELECT walltime FROM segments WHERE chain_id = ? AND n = ?", (chain_id, n)).fetchone()
    if row is None or row["walltime"] <= walltime:
        return
    db.execute("UPDATE segments SET walltime = ? WHERE chain_id = ? AND n = ?", (walltime, chain_id, n))
    granted, asked = duration(walltime), duration(row["walltime"])
    event(
        db,
        chain_id,
        n,
        now,
        "granted",
        f"segment {n} granted {granted} of the {asked} it asked for: the scheduler started it "
        "sooner with a shorter limit (walltime's range, Slurm's --time-min)",
    )


def _paren(text: str) -> str:
    return f" ({text})" if text else ""


def _then(at: Optional[float], now: float) -> float:
    """When something happened, as the scheduler or the markers say (``now``, when the service
    found out, where they say nothing, or where a node's clock runs ahead)."""
    return now if at is None else min(at, now)
