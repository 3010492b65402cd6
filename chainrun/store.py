"""The chain database: the only user of sqlite3.

One SQLite file in WAL mode under ``$CHAINRUN_HOME`` holds the chains, their
segments, and an append-only events log of every decision with its reason.
Submission is journaled: a segment row in phase ``submitting`` is written
before the scheduler is asked, so a crash between the two is found again and
resolved by adoption rather than a second submission. Everything else a tick
learns and does for one chain is recorded in one transaction (``record``).

A database that cannot be used for now (its disk full, read-only, locked by
another process) raises ``StoreUnavailable`` with what is wrong: an outage
that the service waits out, never a reason to charge a chain.
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from chainrun.errors import StoreError, StoreUnavailable, UsageError
from chainrun.model import (
    Action,
    Adopt,
    Cancel,
    Chain,
    ChainState,
    EndSegment,
    Finish,
    JobSpec,
    Outcome,
    Phase,
    Progress,
    Reject,
    Remove,
    RetryLater,
    Segment,
    Submit,
    Track,
)

SCHEMA_VERSION = 2
BUSY_TIMEOUT = 10.0  # seconds a statement waits for another process's write lock
LIVE_STATES = (ChainState.ACTIVE.value, ChainState.STUCK.value)  # the chains a tick moves

# Migrations from version i to i+1 are MIGRATIONS[i]; index 0 creates the schema.
MIGRATIONS: list[str] = [
    """
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE chains (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL,
        spec TEXT NOT NULL,
        state TEXT NOT NULL,
        created_at REAL NOT NULL,
        failures INTEGER NOT NULL DEFAULT 0,
        used REAL NOT NULL DEFAULT 0,
        progress TEXT,
        latest TEXT,
        cancel_requested INTEGER NOT NULL DEFAULT 0,
        reason TEXT NOT NULL DEFAULT '',
        ended_at REAL
    );
    CREATE TABLE segments (
        chain_id TEXT NOT NULL REFERENCES chains(id),
        n INTEGER NOT NULL,
        walltime INTEGER NOT NULL,
        phase TEXT NOT NULL,
        job_id TEXT,
        after TEXT,
        attempts INTEGER NOT NULL DEFAULT 0,
        retry_at REAL,
        submitted_at REAL,
        started_at REAL,
        ended_at REAL,
        missing_since REAL,
        outcome TEXT,
        exit_code INTEGER,
        charged INTEGER NOT NULL DEFAULT 0,
        reason TEXT NOT NULL DEFAULT '',
        PRIMARY KEY (chain_id, n)
    );
    CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        chain_id TEXT NOT NULL,
        segment INTEGER,
        at REAL NOT NULL,
        kind TEXT NOT NULL,
        message TEXT NOT NULL
    );
    CREATE INDEX events_by_chain ON events (chain_id, id);
    """,
    # 2: the progress already in checkpoint_dir at submission, so the epoch rate
    # counts only what the chain trained (NULL for older chains: from epoch 0).
    "ALTER TABLE chains ADD COLUMN baseline TEXT",
]


def default_home() -> Path:
    """``$CHAINRUN_HOME``, else ``$XDG_STATE_HOME/chainrun``, else ``~/.local/state/chainrun``."""
    home = os.environ.get("CHAINRUN_HOME")
    if home:
        return Path(home).expanduser()
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "chainrun"


def new_chain_id(name: str) -> str:
    """A fresh chain id: the chain's name and six random hex digits."""
    return f"{name}-{secrets.token_hex(3)}"


def private_dir(path: Path) -> Path:
    """Create ``path`` (mode 0700) if needed; state is private to the user.

    An existing directory others can enter is refused, never chmod-ed: it may
    be a shared one (CHAINRUN_HOME=$HOME by mistake) that must stay as it is.
    """
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        if path.is_dir() and path.stat().st_mode & 0o077:
            raise StoreError(
                f"{path} is open to other users; chainrun keeps its state private: "
                f"run `chmod 700 {path}` if it is chainrun's own, or set CHAINRUN_HOME to a new directory"
            ) from None
    return path


@dataclass(frozen=True)
class Event:
    id: int
    chain_id: str
    segment: Optional[int]
    at: float
    kind: str
    message: str


class Store:
    """Chains, segments and events in one SQLite file."""

    def __init__(self, home: Path) -> None:
        self.home = private_dir(Path(home))
        self.path = self.home / "chainrun.db"
        old_umask = os.umask(0o077)
        try:
            # The service ticks in a worker thread, one tick at a time.
            self.db = sqlite3.connect(
                self.path, timeout=BUSY_TIMEOUT, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path}: cannot open the state database: {exc}") from None
        finally:
            os.umask(old_umask)
        self.db.row_factory = sqlite3.Row
        try:
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
            os.chmod(self.path, 0o600)
        except StoreError:
            self.db.close()
            raise
        except sqlite3.OperationalError as exc:
            self.db.close()
            raise self._unavailable(exc) from None
        except sqlite3.DatabaseError as exc:
            self.db.close()
            raise StoreError(
                f"{self.path}: not a usable chainrun database ({exc}); "
                "move it aside and resubmit, or point CHAINRUN_HOME elsewhere"
            ) from None

    def _unavailable(self, exc: sqlite3.Error) -> StoreError:
        """What an SQLite error means for the user: an outage named for what it is."""
        text = str(exc).lower()
        where = self.path
        if "full" in text:
            return StoreUnavailable(f"the disk holding {where} is full; free some space (chainrun retries)")
        if "readonly" in text or "read-only" in text:
            return StoreUnavailable(f"{where} is read-only here; chainrun needs to write it (it retries)")
        if "locked" in text or "busy" in text:
            return StoreUnavailable(
                f"{where} is locked by another process for more than {BUSY_TIMEOUT:g} s (chainrun retries)"
            )
        if "i/o error" in text or "unable to open" in text:
            return StoreUnavailable(f"cannot read or write {where}: {exc} (chainrun retries)")
        return StoreError(
            f"{where}: not a usable chainrun database ({exc}); "
            "move it aside and resubmit, or point CHAINRUN_HOME elsewhere"
        )

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            raise self._unavailable(exc) from None
        try:
            yield self.db
            self.db.execute("COMMIT")
        except BaseException as exc:
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            if isinstance(exc, sqlite3.OperationalError):
                raise self._unavailable(exc) from None
            raise

    def _rows(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        try:
            return self.db.execute(sql, args).fetchall()
        except sqlite3.OperationalError as exc:
            raise self._unavailable(exc) from None

    def _migrate(self) -> None:
        with self._tx() as db:
            has_meta = db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='meta'").fetchone()
            version = 0
            if has_meta:
                row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
                version = int(row["value"]) if row else 0
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.path}: written by a newer chainrun (schema {version}, "
                    f"this one knows {SCHEMA_VERSION}); upgrade chainrun"
                )
            for step in MIGRATIONS[version:]:
                for statement in step.split(";"):
                    if statement.strip():
                        db.execute(statement)
            db.execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES ('schema_version', ?)",
                (str(SCHEMA_VERSION),),
            )

    # -- chains ---------------------------------------------------------------

    def add_chain(self, spec: JobSpec, progress: Progress, now: float) -> Chain:
        chain_id = new_chain_id(spec.name)
        start = json.dumps(progress.to_json())
        with self._tx() as db:
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
            self._event(db, chain_id, None, now, "submitted", f"chain submitted from {spec.source}")
        return self.chain(chain_id)

    def chain(self, chain_id: str) -> Chain:
        rows = self._rows("SELECT * FROM chains WHERE id = ?", (chain_id,))
        if not rows:
            raise UsageError(f"no chain {chain_id!r}; `chainrun status` lists them")
        return self._chain(rows[0])

    def chains(self, active_only: bool = False) -> list[Chain]:
        """Every chain, or only those a tick moves (active and stuck), oldest first."""
        if active_only:
            rows = self._rows("SELECT * FROM chains WHERE state IN (?, ?) ORDER BY created_at", LIVE_STATES)
        else:
            rows = self._rows("SELECT * FROM chains ORDER BY created_at")
        return [self._chain(r) for r in rows]

    def summary(self) -> dict[str, int]:
        """Counts for the service's status line, from one query: chains with a running
        job, with a queued one, active (stuck included), stuck, failed."""
        row = self._rows(
            """SELECT
                (SELECT COUNT(DISTINCT s.chain_id) FROM segments s JOIN chains c ON c.id = s.chain_id
                 WHERE c.state IN (?, ?) AND s.phase = 'running') AS running,
                (SELECT COUNT(DISTINCT s.chain_id) FROM segments s JOIN chains c ON c.id = s.chain_id
                 WHERE c.state IN (?, ?) AND s.phase = 'pending') AS queued,
                (SELECT COUNT(*) FROM chains WHERE state IN (?, ?)) AS active,
                (SELECT COUNT(*) FROM chains WHERE state = 'stuck') AS stuck,
                (SELECT COUNT(*) FROM chains WHERE state = 'failed') AS failed""",
            LIVE_STATES * 3,
        )[0]
        return {key: int(value) for key, value in zip(row.keys(), row)}

    def find(self, ref: str) -> Chain:
        """A chain by id, unique id prefix, or name (the newest chain of that name)."""
        rows = self.db.execute(
            "SELECT * FROM chains WHERE id = ? OR id LIKE ? OR name = ? ORDER BY created_at DESC",
            (ref, ref.replace("%", "") + "%", ref),
        ).fetchall()
        exact = [r for r in rows if r["id"] == ref]
        if exact:
            return self._chain(exact[0])
        named = [r for r in rows if r["name"] == ref]
        if named:
            return self._chain(named[0])
        if len(rows) == 1:
            return self._chain(rows[0])
        if rows:
            ids = ", ".join(r["id"] for r in rows[:5])
            raise UsageError(f"{ref!r} matches several chains ({ids}); give the full id")
        raise UsageError(f"no chain {ref!r}; `chainrun status` lists them")

    def _chain(self, row: sqlite3.Row) -> Chain:
        segs = self._rows("SELECT * FROM segments WHERE chain_id = ? ORDER BY n", (row["id"],))
        return Chain(
            id=row["id"],
            spec=JobSpec.from_json(json.loads(row["spec"])),
            state=ChainState(row["state"]),
            created_at=row["created_at"],
            segments=tuple(_segment(s) for s in segs),
            failures=row["failures"],
            used=row["used"],
            progress=Progress.from_json(json.loads(row["progress"] or "null")),
            latest=Progress.from_json(json.loads(row["latest"] or row["progress"] or "null")),
            baseline=Progress.from_json(json.loads(row["baseline"] or "null")),
            cancel_requested=bool(row["cancel_requested"]),
            reason=row["reason"],
            ended_at=row["ended_at"],
        )

    def request_cancel(self, chain_id: str, now: float) -> None:
        with self._tx() as db:
            db.execute("UPDATE chains SET cancel_requested = 1 WHERE id = ?", (chain_id,))
            self._event(db, chain_id, None, now, "cancel", "cancel requested by user")

    # -- segments -------------------------------------------------------------

    def journal_submit(self, chain_id: str, sub: Submit, now: float) -> int:
        """Write 'submitting segment n' before the scheduler is asked; returns the attempt's
        number. A crash after this is resolved by adoption (decide), never a second job."""
        with self._tx() as db:
            row = db.execute(
                "SELECT attempts FROM segments WHERE chain_id = ? AND n = ?", (chain_id, sub.n)
            ).fetchone()
            if row is None:
                db.execute(
                    "INSERT INTO segments (chain_id, n, walltime, phase, after, attempts, submitted_at) "
                    "VALUES (?, ?, ?, ?, ?, 1, ?)",
                    (chain_id, sub.n, sub.walltime, Phase.SUBMITTING.value, sub.after, now),
                )
                return 1
            db.execute(
                "UPDATE segments SET attempts = attempts + 1, submitted_at = ? WHERE chain_id = ? AND n = ?",
                (now, chain_id, sub.n),
            )
            return int(row["attempts"]) + 1

    def set_stuck(self, chain_id: str, stuck: bool, reason: str, now: float) -> None:
        """Mark a chain whose ticks keep failing as stuck (with why), or active again."""
        state = ChainState.STUCK if stuck else ChainState.ACTIVE
        with self._tx() as db:
            db.execute(
                "UPDATE chains SET state = ?, reason = ? WHERE id = ? AND state IN (?, ?)",
                (state.value, reason, chain_id, *LIVE_STATES),
            )
            self._event(db, chain_id, None, now, state.value, f"chain {state.value}: {reason}")

    # -- one tick's record ------------------------------------------------------

    def record(
        self,
        chain_id: str,
        actions: list[Action],
        latest: Optional[Progress],
        warnings: list[str],
        now: float,
    ) -> None:
        """Record one tick of a chain in one transaction: the actions carried out (each
        with its reason), the newest progress seen, and what went wrong on the way."""
        with self._tx() as db:
            if latest is not None:
                db.execute(
                    "UPDATE chains SET latest = ? WHERE id = ?", (json.dumps(latest.to_json()), chain_id)
                )
            for action in actions:
                self._apply(db, chain_id, action, now)
            for text in warnings:
                self._event(db, chain_id, None, now, "warning", text)

    def _apply(self, db: sqlite3.Connection, chain_id: str, action: Action, now: float) -> None:
        seg = (chain_id, getattr(action, "n", None))
        if isinstance(action, Track):
            row = db.execute("SELECT phase FROM segments WHERE chain_id = ? AND n = ?", seg).fetchone()
            db.execute(
                "UPDATE segments SET phase = ?, reason = ?, started_at = COALESCE(started_at, ?), "
                "missing_since = ? WHERE chain_id = ? AND n = ?",
                (action.phase.value, action.reason, action.started_at, action.missing_since, *seg),
            )
            if row is not None and row["phase"] != action.phase.value:
                text = f"segment {action.n} is {action.phase.value}"
                self._event(db, chain_id, action.n, now, action.phase.value, text + _paren(action.reason))
            elif action.missing_since is not None:
                self._event(db, chain_id, action.n, now, "missing", f"segment {action.n} {action.reason}")
        elif isinstance(action, Adopt):
            db.execute(
                "UPDATE segments SET job_id = ?, phase = CASE WHEN phase = ? THEN ? ELSE phase END, "
                "retry_at = NULL, missing_since = NULL WHERE chain_id = ? AND n = ?",
                (action.job_id, Phase.SUBMITTING.value, Phase.PENDING.value, *seg),
            )
            self._event(
                db, chain_id, action.n, now, "job", f"segment {action.n} {action.how} as job {action.job_id}"
            )
        elif isinstance(action, RetryLater):
            db.execute(
                "UPDATE segments SET retry_at = ?, reason = ? WHERE chain_id = ? AND n = ?",
                (action.at, action.reason, *seg),
            )
            self._event(
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
            self._event(
                db, chain_id, action.n, now, "rejected", f"segment {action.n} rejected: {action.reason}"
            )
        elif isinstance(action, Remove):
            self._event(
                db, chain_id, action.n, now, "removed", f"job {action.job_id} removed: {action.reason}"
            )
        elif isinstance(action, EndSegment):
            db.execute(
                "UPDATE segments SET phase = ?, outcome = ?, exit_code = ?, charged = ?, "
                "ended_at = ?, reason = ? WHERE chain_id = ? AND n = ?",
                (
                    Phase.ENDED.value,
                    action.outcome.value,
                    action.exit_code,
                    int(action.charged),
                    action.ended_at,
                    action.reason,
                    *seg,
                ),
            )
            db.execute(
                "UPDATE chains SET failures = failures + ?, used = used + ?, progress = ? WHERE id = ?",
                (int(action.charged), action.elapsed, json.dumps(action.progress.to_json()), chain_id),
            )
            cost = "costs one failure" if action.charged else "no cost"
            self._event(
                db,
                chain_id,
                action.n,
                now,
                "ended",
                f"segment {action.n} ended: {action.reason}; {cost}; progress: {action.progress.describe()}",
            )
        elif isinstance(action, Cancel):
            db.execute(
                "UPDATE segments SET phase = ?, outcome = ?, ended_at = ?, reason = ? "
                "WHERE chain_id = ? AND n = ? AND phase != ?",
                (Phase.ENDED.value, Outcome.CANCELLED.value, now, action.reason, *seg, Phase.ENDED.value),
            )
            job = f"job {action.job_id}" if action.job_id else "not yet submitted"
            self._event(
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
            self._event(
                db, chain_id, None, now, action.state.value, f"chain {action.state.value}: {action.reason}"
            )
        else:
            raise TypeError(f"not a recorded action: {action!r}")

    # -- events ---------------------------------------------------------------

    def event(self, chain_id: str, segment: Optional[int], kind: str, message: str) -> None:
        with self._tx() as db:
            self._event(db, chain_id, segment, time.time(), kind, message)

    def events(self, chain_id: str, after_id: int = 0) -> list[Event]:
        rows = self._rows(
            "SELECT * FROM events WHERE chain_id = ? AND id > ? ORDER BY id", (chain_id, after_id)
        )
        return [Event(r["id"], r["chain_id"], r["segment"], r["at"], r["kind"], r["message"]) for r in rows]

    @staticmethod
    def _event(
        db: sqlite3.Connection, chain_id: str, segment: Optional[int], at: float, kind: str, message: str
    ) -> None:
        db.execute(
            "INSERT INTO events (chain_id, segment, at, kind, message) VALUES (?, ?, ?, ?, ?)",
            (chain_id, segment, at, kind, message),
        )


def _paren(text: str) -> str:
    return f" ({text})" if text else ""


def _segment(row: sqlite3.Row) -> Segment:
    data: dict[str, Any] = dict(row)
    return Segment(
        chain_id=data["chain_id"],
        n=data["n"],
        walltime=data["walltime"],
        phase=Phase(data["phase"]),
        job_id=data["job_id"],
        after=data["after"],
        attempts=data["attempts"],
        retry_at=data["retry_at"],
        submitted_at=data["submitted_at"],
        started_at=data["started_at"],
        ended_at=data["ended_at"],
        missing_since=data["missing_since"],
        outcome=Outcome(data["outcome"]) if data["outcome"] else None,
        exit_code=data["exit_code"],
        charged=bool(data["charged"]),
        reason=data["reason"],
    )
