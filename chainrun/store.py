"""The chain database: the only user of sqlite3.

One SQLite file in WAL mode under ``$CHAINRUN_HOME`` holds the chains, their
segments, and an append-only events log of every decision with its reason.
Submission is journaled: a segment row in phase ``submitting`` is written
before the scheduler is asked, so a crash between the two is found again and
resolved by adoption rather than a second submission. Everything else a tick
learns and does for one chain is recorded in one transaction (``record``).

A database that cannot be used for now (its disk full, read-only, locked by
another process) raises ``StoreUnavailable`` with what is wrong: an outage
that the service waits out, never a reason to charge a chain. A damaged file
raises ``StoreError`` naming ``sqlite3 FILE .recover`` as the way out.

A chain whose row cannot be read back (bad JSON, an unknown state, a value of
the wrong type) is *damaged*: ``chains()`` leaves it out, so the ticks never
see it and the other chains go on, and ``damaged()`` lists it, with how to
remove it, for ``chainrun status``.

The tick's load (``chains(active_only=True)``) reads the active chains only,
and of those decodes again only the ones whose ``version`` moved: triggers
count every change to a chain's row or its segments, made by chainrun or by
hand. ``status`` selects in SQL what it shows (``shown``); the indexes on
state and name keep ended chains out of both. Its table reads only the few
columns it shows (``glance``), and decodes in full only a row that is not as
chainrun writes it, to say what is wrong with it.

``Store(home, readonly=True)`` is for the commands that only look (status,
history, logs): it never writes, never waits on a writer for more than
``READ_TIMEOUT``, and a missing database reads as one without chains.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import json
import operator
import os
import re
import shlex
import sqlite3
import time
import typing
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Optional, Union

from chainrun import localrunner
from chainrun.errors import StoreError, StoreUnavailable, UsageError
from chainrun.localrunner import default_home as default_home  # where chainrun keeps its state
from chainrun.logs import get_logger
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

log = get_logger(__name__)

SCHEMA_VERSION = 6
BUSY_TIMEOUT = 10.0  # seconds a statement waits for another process's write lock
READ_TIMEOUT = 1.0  # seconds a read-only command waits for a writer before saying it is busy
MAX_REF = 200  # the longest chain reference (id, id prefix or name) a command accepts
LIVE_STATES = (ChainState.ACTIVE.value, ChainState.STUCK.value)  # the chains a tick moves
_PLAIN_ID = re.compile(r"[A-Za-z0-9._-]+")  # what chainrun's own ids are made of

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
    # 3: the last lines of a failed segment's output (JSON list), from its end marker.
    "ALTER TABLE segments ADD COLUMN tail TEXT",
    # 4: the tick reads only the active chains, and of those only the ones whose row or
    # segments changed since its last load (``version``, counted by triggers, so that a
    # change made by hand is seen too); `status` reads only the chains it shows.
    """
    CREATE INDEX chains_by_state ON chains (state, ended_at);
    CREATE INDEX chains_by_name ON chains (name, created_at);
    ALTER TABLE chains ADD COLUMN version INTEGER NOT NULL DEFAULT 0;
    CREATE TRIGGER chain_changed AFTER UPDATE ON chains WHEN NEW.version IS OLD.version BEGIN
        UPDATE chains SET version = version + 1 WHERE rowid = NEW.rowid;
    END;
    CREATE TRIGGER segment_added AFTER INSERT ON segments BEGIN
        UPDATE chains SET version = version + 1 WHERE id = NEW.chain_id;
    END;
    CREATE TRIGGER segment_changed AFTER UPDATE ON segments BEGIN
        UPDATE chains SET version = version + 1 WHERE id IN (OLD.chain_id, NEW.chain_id);
    END;
    CREATE TRIGGER segment_removed AFTER DELETE ON segments BEGIN
        UPDATE chains SET version = version + 1 WHERE id = OLD.chain_id;
    END
    """,
    # 5: the host a pool placed each segment on (NULL: the chain's scheduler.host).
    "ALTER TABLE segments ADD COLUMN host TEXT",
    # 6: the array job (its name) and task a first segment was journaled as, so that a
    # crash between journal and submission finds the task, or submits that task again.
    """
    ALTER TABLE segments ADD COLUMN array TEXT;
    ALTER TABLE segments ADD COLUMN task INTEGER
    """,
]


def _statements(script: str) -> Iterator[str]:
    """The SQL statements of ``script``, split where each one is complete (a trigger's
    body holds semicolons of its own)."""
    statement = ""
    for part in script.split(";"):
        statement += part + ";"
        if sqlite3.complete_statement(statement):
            if statement.strip(" \n;"):
                yield statement
            statement = ""


def new_chain_id(name: str) -> str:
    """A fresh chain id: the chain's name and six random hex digits."""
    import secrets  # here: the commands that only read (`status`) need not import it (6 ms)

    return f"{name}-{secrets.token_hex(3)}"


def private_dir(path: Path) -> Path:
    """Create ``path`` (mode 0700) if needed; refuse one others may enter or that is not ours
    (the local runner's rule, which keeps its own state with it)."""
    try:
        return localrunner.private_dir(path)
    except localrunner.RunnerError as exc:
        raise UsageError(str(exc)) from None


@dataclass(frozen=True)
class Event:
    id: int
    chain_id: str
    segment: Optional[int]
    at: float
    kind: str
    message: str


@dataclass(frozen=True)
class DamagedChain:
    """A chain whose row cannot be read back. The ticks never see it (its jobs, if any,
    are left alone); ``chainrun status`` shows it with how to remove it."""

    id: str  # as stored, escaped where it is not printable
    name: str
    problem: str  # what could not be read, e.g. "state 'bogus' is not one of active, ..."
    jobs: tuple[str, ...]  # job ids of segments not recorded as ended: may still be queued or running
    removal: str  # the shell command that removes it from the database

    @property
    def reason(self) -> str:
        """One line: what is wrong, what chainrun does about it, and the way out."""
        jobs = ""
        if self.jobs:
            jobs = (
                f"; its jobs {', '.join(self.jobs)} may still be queued or running: "
                "cancel them with the scheduler's own command"
            )
        return (
            f"damaged: {self.problem}; the service skips it and `chainrun cancel` cannot act on it"
            f"{jobs}; remove it with: {self.removal}"
        )


# A segment ended so, and never started: it did not run (a queued successor cancelled).
_NOT_RUN = frozenset({Outcome.CANCELLED, Outcome.REJECTED, Outcome.LOST})


def ran(seg: Segment) -> bool:
    """Whether the segment's job ran: a successor cancelled while queued did not."""
    if seg.started_at is not None or seg.phase is Phase.RUNNING:
        return True
    return seg.phase is Phase.ENDED and seg.outcome not in _NOT_RUN


class Live(NamedTuple):
    """What ``chainrun status`` reads of a segment that has not ended."""

    n: int
    phase: Phase
    job_id: Optional[str]
    after: Optional[str]
    walltime: int
    started_at: Optional[float]
    retry_at: Optional[float]
    reason: str
    host: Optional[str]


class Glance(NamedTuple):
    """What the status table shows of a chain: a few columns of its row, four fields of
    its spec, its progress's epochs, counts of its segments, and its live segments."""

    id: str
    state: ChainState
    reason: str
    failures: int
    used: float
    epoch: Optional[int]  # the latest progress's
    baseline_epoch: Optional[int]  # the epoch checkpoint_dir held at submission
    target_epoch: Optional[int]
    max_failures: int
    total_time: int
    walltime: int
    max_concurrent: Optional[int]
    pool: bool  # the spec names a pool of hosts
    segments: int  # how many it has
    ran: int  # how many of them ran (``ran``)
    live: tuple[Live, ...]

    @property
    def max_segments(self) -> int:
        """Segments the time budget allows if every one uses its whole walltime."""
        return -(-self.total_time // self.walltime)

    @classmethod
    def of(cls, chain: Chain) -> Glance:
        """The same, from a chain read in full."""
        spec = chain.spec
        live = tuple(
            Live(s.n, s.phase, s.job_id, s.after, s.walltime, s.started_at, s.retry_at, s.reason, s.host)
            for s in chain.live
        )
        return cls(
            chain.id,
            chain.state,
            chain.reason,
            chain.failures,
            chain.used,
            chain.latest.epoch,
            chain.baseline.epoch,
            spec.target_epoch,
            spec.max_failures,
            spec.total_time,
            spec.walltime,
            spec.max_concurrent,
            bool(spec.scheduler.hosts),
            len(chain.segments),
            sum(1 for s in chain.segments if ran(s)),
            live,
        )


class Store:
    """Chains, segments and events in one SQLite file.

    ``readonly``: for commands that only look. Nothing is written (no schema
    upgrade, no lock taken), a writer is waited on for ``READ_TIMEOUT`` at most,
    and a missing database has no chains.
    """

    def __init__(self, home: Path, readonly: bool = False) -> None:
        self.home = Path(home)
        self.path = self.home / "chainrun.db"
        self.readonly = readonly
        self._reported: set[str] = set()  # damaged chains already logged by this store
        # The tick's load, kept for the next: each active chain by rowid, as read at
        # (its rowid, id, version).
        self._kept: dict[int, tuple[tuple[Any, ...], Union[Chain, DamagedChain]]] = {}
        self.db = self._open_reader() if readonly else self._open_writer()

    def _open_writer(self) -> sqlite3.Connection:
        private_dir(self.home)
        # A new database is created private (0600; its -wal and -shm copy its mode);
        # an existing one keeps the mode it has.
        old_umask = os.umask(0o077)
        try:
            with self._sql():
                # The service ticks in a worker thread, one tick at a time.
                self.db = _connect(str(self.path), uri=False, timeout=BUSY_TIMEOUT)
        finally:
            os.umask(old_umask)
        try:
            with self._sql():
                self.db.execute("PRAGMA journal_mode=WAL")
                self.db.execute("PRAGMA synchronous=NORMAL")
                self.db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
        except BaseException:
            self.db.close()
            raise
        return self.db

    def _open_reader(self) -> sqlite3.Connection:
        try:
            exists = self.home.exists()  # a file there is refused below, as for writing
        except OSError as exc:  # a name too long, say
            raise UsageError(
                f"cannot use the state directory {localrunner.short_path(self.home)}: {exc.strerror}"
            ) from None
        if exists:
            private_dir(self.home)  # refused when open to others, as for writing (never created)
        try:
            os.stat(self.path)
        except (FileNotFoundError, NotADirectoryError):
            return self._in_memory(None)  # no database yet: no chains
        except OSError as exc:
            raise StoreUnavailable(f"cannot read {self.path}: {exc.strerror or exc}") from None
        uri = f"{self.path.absolute().as_uri()}?mode=ro"
        with self._sql():
            self.db = _connect(uri, uri=True, timeout=READ_TIMEOUT)
        try:
            with self._sql():
                try:
                    version = _version(self.db)
                except sqlite3.OperationalError as exc:
                    # A reader needs the -shm file beside a WAL database: on a read-only or full
                    # disk it cannot be made. With no -wal to merge, the file alone is the whole
                    # database, and nothing can be writing it without those two files.
                    text = f"{getattr(exc, 'sqlite_errorname', '')} {exc}".lower()
                    unopenable = any(w in text for w in ("cantopen", "unable to open", "ioerr", "i/o error"))
                    if not (unopenable and self._without_wal()):
                        raise
                    self.db.close()
                    self.db = _connect(uri + "&immutable=1", uri=True, timeout=READ_TIMEOUT)
                    version = _version(self.db)
            self._check_version(version)
        except BaseException:
            self.db.close()
            raise
        if version < SCHEMA_VERSION:
            # An older (or empty) database is read through an upgraded copy in memory:
            # the upgrade itself is left to the next chainrun that writes.
            old = self.db
            try:
                return self._in_memory(old)
            finally:
                old.close()
        return self.db

    def _in_memory(self, source: Optional[sqlite3.Connection]) -> sqlite3.Connection:
        self.db = _connect(":memory:", uri=False, timeout=READ_TIMEOUT)
        if source is not None:
            with self._sql():
                source.backup(self.db)
        self._migrate()
        return self.db

    def _without_wal(self) -> bool:
        try:
            return os.stat(f"{self.path}-wal").st_size == 0
        except FileNotFoundError:
            return True
        except OSError:
            return False

    @contextmanager
    def _sql(self) -> Iterator[None]:
        """Turn what SQLite says of the database into a StoreError naming it; a misuse
        of SQLite (a bug) stays what it is."""
        try:
            yield
        except sqlite3.DatabaseError as exc:
            if isinstance(exc, sqlite3.OperationalError) or type(exc) is sqlite3.DatabaseError:
                raise self._fault(exc) from None
            raise

    def _fault(self, exc: sqlite3.DatabaseError) -> StoreError:
        """What an SQLite error means for the user, named for what it is."""
        code = str(getattr(exc, "sqlite_errorname", ""))  # Python 3.11+
        text = f"{code} {exc}".lower()
        where = self.path
        if "corrupt" in text or "malformed" in text or "notadb" in text or "not a database" in text:
            quoted = shlex.quote(str(where))
            return StoreError(
                f"{where} is damaged ({exc}); chainrun cannot use it. Stop the service, then recover"
                f" what it holds: `sqlite3 {quoted} .recover > {quoted}.sql`, move {quoted} aside,"
                f" and `sqlite3 {quoted} < {quoted}.sql`"
            )
        cantopen = "cantopen" in text or "unable to open" in text
        ioerr = "ioerr" in text or "i/o error" in text
        if "full" in text or (ioerr and self._disk_full()):
            return StoreUnavailable(f"the disk holding {where} is full; free some space")
        if self._readonly_fs() and ("readonly" in text or "read-only" in text or cantopen or ioerr):
            return StoreUnavailable(f"{where} is on a read-only filesystem; chainrun needs to write it")
        if "readonly" in text or "read-only" in text:
            return StoreUnavailable(
                f"{where} is read-only; chainrun needs to write it (check its permissions and {self.home}'s)"
            )
        if "locked" in text or "busy" in text:
            if self.readonly:
                return StoreUnavailable(f"{where} is busy: another process is writing it; try again")
            return StoreUnavailable(f"{where} is locked by another process (waited {BUSY_TIMEOUT:g} s)")
        if cantopen:
            return StoreUnavailable(f"cannot open {where}: {exc}")
        if ioerr:
            return StoreUnavailable(f"cannot read or write {where}: {exc}")
        return StoreError(
            f"{where}: not a usable chainrun database ({exc}); "
            "move it aside and resubmit, or point CHAINRUN_HOME elsewhere"
        )

    def _disk_full(self) -> bool:
        try:
            return os.statvfs(self.home).f_bavail == 0
        except OSError:
            return False

    def _readonly_fs(self) -> bool:
        try:
            return bool(os.statvfs(self.home).f_flag & os.ST_RDONLY)
        except OSError:
            return False

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._sql():
            self.db.execute("BEGIN IMMEDIATE")
            try:
                yield self.db
                self.db.execute("COMMIT")
            except BaseException:
                if self.db.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        self.db.execute("ROLLBACK")
                raise

    @contextmanager
    def _snapshot(self) -> Iterator[None]:
        """Reads inside see the database as it was at the first one (WAL: no lock taken
        from writers), so a load's queries agree with each other."""
        with self._sql():
            self.db.execute("BEGIN")
        try:
            yield
        finally:
            with self._sql(), contextlib.suppress(sqlite3.Error):
                self.db.execute("COMMIT")

    def _rows(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._sql():
            return self.db.execute(sql, args).fetchall()

    def _check_version(self, version: int) -> None:
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"{self.path}: written by a newer chainrun (schema {version}, "
                f"this one knows {SCHEMA_VERSION}); upgrade chainrun"
            )

    def _migrate(self) -> None:
        with self._sql():
            version = _version(self.db)
        self._check_version(version)
        if version == SCHEMA_VERSION:
            return  # nothing to write: opening takes no write lock
        with self._tx() as db:
            version = _version(db)  # again under the lock: another process may have done it
            self._check_version(version)
            for step in MIGRATIONS[version:]:
                for statement in _statements(step):
                    db.execute(statement)
            db.execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES ('schema_version', ?)",
                (str(SCHEMA_VERSION),),
            )

    # -- chains ---------------------------------------------------------------

    def add_chain(self, spec: JobSpec, progress: Progress, now: float) -> Chain:
        return self.chain(self.add_chains([(spec, progress)], now)[0])

    def add_chains(self, new: Sequence[tuple[JobSpec, Progress]], now: float) -> list[str]:
        """Store new chains, each with the progress it starts from, all in one transaction
        (none stored if one cannot be); their ids, in order."""
        ids: list[str] = []
        with self._tx() as db:
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
                self._event(db, chain_id, None, now, "submitted", submitted)
                ids.append(chain_id)
        return ids

    def unended(self, names: Sequence[str]) -> dict[str, str]:
        """Of these chain names, those an active (or stuck) chain has: name -> its id."""
        final = [s.value for s in ChainState if s.final]
        found: dict[str, str] = {}
        with self._sql():
            for i in range(0, len(names), 500):  # SQLite's limit on bound parameters
                part = list(names[i : i + 500])
                rows = self.db.execute(
                    f"SELECT name, id FROM chains WHERE name IN ({','.join('?' * len(part))})"
                    f" AND state NOT IN ({','.join('?' * len(final))})",
                    (*part, *final),
                )
                found.update((name, chain_id) for name, chain_id in rows)
        return found

    def chain(self, chain_id: str) -> Chain:
        """The chain with this exact id; StoreError when it is damaged."""
        found = self._load("chains.id = ?", (chain_id,))
        if not found:
            raise UsageError(f"no chain {chain_id!r}; `chainrun status` lists them")
        chain = found[0]
        if isinstance(chain, DamagedChain):
            raise StoreError(f"chain {chain.id} is {chain.reason}")
        return chain

    def chains(self, active_only: bool = False) -> list[Chain]:
        """Every chain, or only those a tick moves (active and stuck), oldest first.

        A damaged chain is left out (``damaged()`` lists those): a row that cannot be
        read stops neither the ticks nor the other chains. The tick's load (``active_only``)
        reads only the active chains and their segments that have not ended; ended
        segments, which never change, are kept from earlier loads, and so is each chain
        whose rows have not changed since."""
        chains: list[Chain] = []
        for item in self._load_live() if active_only else self._load("1"):
            if isinstance(item, Chain):
                chains.append(item)
            elif active_only and item.id not in self._reported:  # the tick's read: log it once
                self._reported.add(item.id)
                log.warning(
                    "chain skipped: its row in the database cannot be read", chain=item.id, why=item.problem
                )
        return chains

    def sweep(self, name: str) -> list[Chain]:
        """The chains of the sweep ``name`` (its chains are named NAME-HASH-rN), oldest first;
        none for a name no sweep can have (``resolve`` then says what is wrong with it)."""
        if not name or len(name) > MAX_REF or not name.isprintable() or not name.isascii():
            return []
        items = self._load("substr(chains.name, 1, ?) = ?", (len(name) + 1, name + "-"))
        return [c for c in items if isinstance(c, Chain) and c.spec.sweep_name == name]

    def shown(self, ended_since: Optional[float]) -> tuple[list[Chain], list[DamagedChain]]:
        """What ``chainrun status`` lists, oldest first: the chains that have not ended and
        those that ended after ``ended_since`` (every chain when None), and apart, the
        damaged ones among them. Selected in SQL: older ended chains are never read."""
        items = self._load(*_shown_where(ended_since))
        return (
            [c for c in items if isinstance(c, Chain)],
            [c for c in items if isinstance(c, DamagedChain)],
        )

    def damaged(self) -> list[DamagedChain]:
        """The chains whose rows cannot be read back, oldest first, whatever their state."""
        return self.shown(None)[1]

    def glance(self, ended_since: Optional[float]) -> tuple[list[Glance], list[DamagedChain]]:
        """What the status table shows of the chains ``shown`` selects, in its order, read
        from the few columns it uses (no chain is decoded whole: at a thousand chains that
        was most of `status`'s time). A row whose columns, or whose segments' columns, are
        not as chainrun writes them is read in full instead, so a damaged chain is listed
        as ``shown`` lists it; the checks here cover what the table reads, every column of
        the segments, and whether each JSON column parses, not every field of the spec."""
        where, args = _shown_where(ended_since)
        picked = f"c.rowid IN (SELECT rowid FROM chains WHERE {where})"  # the index on state alone
        glances: dict[int, Glance] = {}
        unread: list[int] = []
        with self._snapshot():
            live: dict[int, list[Optional[Live]]] = {}
            for r in self._rows(_LIVE_SQL.format(picked=picked), args):
                live.setdefault(r[0], []).append(_live(r))
            order = []
            for r in self._rows(_GLANCE_SQL.format(picked=picked), args):
                order.append(r[0])
                glanced = _glance(r, live.get(r[0], []))
                if glanced is None:
                    unread.append(r[0])
                else:
                    glances[r[0]] = glanced
            full: dict[int, Union[Chain, DamagedChain]] = {}
            for i in range(0, len(unread), 500):  # SQLite binds at most 999 values by default
                part = tuple(unread[i : i + 500])
                cond = f"chains.rowid IN ({', '.join('?' * len(part))})"
                segs = self._segments(cond, part)
                sql = f"SELECT rowid AS rowid_, * FROM chains WHERE {cond}"
                full.update(
                    (r["rowid_"], self._read(r, segs.get(r["rowid_"], []))) for r in self._rows(sql, part)
                )
        shown: list[Glance] = []
        damaged: list[DamagedChain] = []
        for rowid in order:
            item: Union[Glance, Chain, DamagedChain] = glances.get(rowid) or full[rowid]
            if isinstance(item, DamagedChain):
                damaged.append(item)
            else:
                shown.append(item if isinstance(item, Glance) else Glance.of(item))
        return shown, damaged

    def _load(self, where: str, args: tuple[Any, ...] = ()) -> list[Union[Chain, DamagedChain]]:
        """The chains ``where`` (an SQL condition on ``chains``) selects, oldest first, each
        with all its segments: two queries, whatever the number of chains."""
        with self._snapshot():
            rows = self._rows(
                f"SELECT rowid AS rowid_, * FROM chains WHERE {where} ORDER BY created_at, rowid", args
            )
            segs = self._segments(where, args)
        return [self._read(row, segs.get(row["rowid_"], [])) for row in rows]

    def _load_live(self) -> list[Union[Chain, DamagedChain]]:
        """The tick's load: the active chains, each read again only when its ``version``
        says that it or one of its segments changed since the last load."""
        live = f"chains.state IN ({', '.join('?' * len(LIVE_STATES))})"
        with self._snapshot():
            versions = self._rows(
                f"SELECT rowid, id, version FROM chains WHERE {live} ORDER BY created_at, rowid",
                LIVE_STATES,
            )
            changed = [r["rowid"] for r in versions if self._kept.get(r["rowid"], (None,))[0] != tuple(r)]
            read: dict[int, Union[Chain, DamagedChain]] = {}
            for i in range(0, len(changed), 500):  # SQLite binds at most 999 values by default
                part = tuple(changed[i : i + 500])
                where = f"chains.rowid IN ({', '.join('?' * len(part))})"
                sql = f"SELECT rowid AS rowid_, * FROM chains WHERE {where}"
                segs = self._segments(where, part)
                # Decoded part by part: the raw rows (JSON text) of every chain at once
                # would add to the memory peak of a service's first tick.
                read.update(
                    (r["rowid_"], self._read(r, segs.get(r["rowid_"], []))) for r in self._rows(sql, part)
                )
        kept: dict[int, tuple[tuple[Any, ...], Union[Chain, DamagedChain]]] = {}
        for r in versions:
            rowid = r["rowid"]
            kept[rowid] = (tuple(r), read[rowid]) if rowid in read else self._kept[rowid]
        self._kept = kept  # only the chains active now are kept
        return [item for _, item in kept.values()]

    def _segments(self, where: str, args: tuple[Any, ...]) -> dict[int, list[sqlite3.Row]]:
        """The segment rows of the chains ``where`` selects, by their chain's rowid, in order."""
        by_chain: dict[int, list[sqlite3.Row]] = {}
        for seg in self._rows(
            "SELECT chains.rowid AS rowid_, segments.* FROM chains JOIN segments"
            f" ON segments.chain_id = chains.id WHERE {where} ORDER BY chains.rowid, segments.n",
            args,
        ):
            by_chain.setdefault(seg["rowid_"], []).append(seg)
        return by_chain

    def summary(self) -> dict[str, int]:
        """Counts for the service's status line, from one query: chains with a running
        job, with a queued one, active (stuck included), stuck, failed. The index on
        state keeps ended chains and their segments out of it."""
        row = self._rows(
            """SELECT
                (SELECT COUNT(*) FROM chains c WHERE c.state IN (?, ?) AND EXISTS
                 (SELECT 1 FROM segments s WHERE s.chain_id = c.id AND s.phase = 'running')) AS running,
                (SELECT COUNT(*) FROM chains c WHERE c.state IN (?, ?) AND EXISTS
                 (SELECT 1 FROM segments s WHERE s.chain_id = c.id AND s.phase = 'pending')) AS queued,
                (SELECT COUNT(*) FROM chains WHERE state IN (?, ?)) AS active,
                (SELECT COUNT(*) FROM chains WHERE state = 'stuck') AS stuck,
                (SELECT COUNT(*) FROM chains WHERE state = 'failed') AS failed""",
            LIVE_STATES * 3,
        )[0]
        return {key: int(value) for key, value in zip(row.keys(), row)}

    def resolve(self, ref: str) -> str:
        """The id of the chain ``ref`` names: its exact id, else the newest chain of that
        exact name, else the one chain whose id starts with ``ref``. Literal and
        case-sensitive: no pattern, no case folding. The chain itself is not read (it
        may be damaged: its events can still be shown)."""
        if not ref:
            raise UsageError("no chain given: name one by its id, a unique prefix of it, or its name")
        if len(ref) > MAX_REF:
            raise UsageError(
                f"a chain reference is at most {MAX_REF} characters; this one has {len(ref)} "
                f"({ref[:20]!r}...); `chainrun status` lists the chains"
            )
        try:
            ref.encode()
        except UnicodeEncodeError:  # bytes from argv that are not UTF-8: no id or name is
            raise UsageError(f"no chain {ref!r}; `chainrun status` lists them") from None
        for sql in (
            "SELECT id FROM chains WHERE id = ?",
            "SELECT id FROM chains WHERE name = ? ORDER BY created_at DESC, rowid DESC LIMIT 1",
        ):
            rows = self._rows(sql, (ref,))
            if rows:
                return str(rows[0]["id"])
        rows = self._rows(
            "SELECT id FROM chains WHERE substr(id, 1, ?) = ? ORDER BY created_at DESC, rowid DESC",
            (len(ref), ref),
        )
        if len(rows) == 1:
            return str(rows[0]["id"])
        if rows:
            ids = ", ".join(_shown(r["id"]) for r in rows[:5])
            more = f" and {len(rows) - 5} more" if len(rows) > 5 else ""
            raise UsageError(f"{ref!r} starts the ids of several chains ({ids}{more}); give more of the id")
        raise UsageError(f"no chain {ref!r}; `chainrun status` lists them")

    def find(self, ref: str) -> Chain:
        """A chain by id, unique id prefix, or name (see ``resolve``); StoreError when it is damaged."""
        return self.chain(self.resolve(ref))

    def _read(self, row: sqlite3.Row, segs: list[sqlite3.Row]) -> Union[Chain, DamagedChain]:
        """The chain in ``row`` with its segments (their rows ``segs``, in order), or what
        makes it unreadable."""
        try:
            return _chain(row, tuple(_segment(s) for s in segs))
        except _Unreadable as exc:
            return self._damaged(row, segs, str(exc))

    def _damaged(self, row: sqlite3.Row, segs: list[sqlite3.Row], problem: str) -> DamagedChain:
        raw = row["id"]
        if isinstance(raw, str) and _PLAIN_ID.fullmatch(raw):
            sql = f"DELETE FROM segments WHERE chain_id = '{raw}'; DELETE FROM chains WHERE id = '{raw}';"
            quoted = f'"{sql}"'  # nothing in it a shell expands inside double quotes
        else:  # an id that is awkward to type: its row's number
            rowid = int(row["rowid_"])
            sql = (
                f"DELETE FROM segments WHERE chain_id = (SELECT id FROM chains WHERE rowid = {rowid});"
                f" DELETE FROM chains WHERE rowid = {rowid};"
            )
            quoted = shlex.quote(sql)
        return DamagedChain(
            id=_shown(raw),
            name=_shown(row["name"]),
            problem=problem,
            jobs=tuple(
                _shown(s["job_id"])
                for s in segs
                if s["job_id"] is not None and s["phase"] != Phase.ENDED.value
            ),
            removal=f"sqlite3 {shlex.quote(str(self.path))} {quoted}",
        )

    def request_cancel(self, chain_id: str, now: float) -> None:
        with self._tx() as db:
            db.execute("UPDATE chains SET cancel_requested = 1 WHERE id = ?", (chain_id,))
            self._event(db, chain_id, None, now, "cancel", "cancel requested by user")

    # -- segments -------------------------------------------------------------

    def journal_submit(
        self,
        chain_id: str,
        sub: Submit,
        now: float,
        host: Optional[str] = None,
        task: Optional[tuple[str, int]] = None,
    ) -> int:
        """Write 'submitting segment n' (on ``host``, for a pool) before the scheduler is asked;
        returns the attempt's number. A crash after this is resolved by adoption (decide),
        never a second job. ``task``: the array job (name) and task the segment goes out as;
        kept from the first attempt on, as every later one submits that task again."""
        array, index = task or (None, None)
        with self._tx() as db:
            row = db.execute(
                "SELECT attempts FROM segments WHERE chain_id = ? AND n = ?", (chain_id, sub.n)
            ).fetchone()
            if row is None:
                db.execute(
                    "INSERT INTO segments (chain_id, n, walltime, phase, after, attempts, "
                    "submitted_at, host, array, task) VALUES (?, ?, ?, ?, ?, 1, ?, ?, ?, ?)",
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
                    ),
                )
                return 1
            db.execute(
                "UPDATE segments SET attempts = attempts + 1, submitted_at = ?, array = COALESCE(array, ?), "
                "task = COALESCE(task, ?) WHERE chain_id = ? AND n = ?",
                (now, array, index, chain_id, sub.n),
            )
            return int(row["attempts"]) + 1

    def set_waiting(self, chain_id: str, reason: str, now: float) -> None:
        """Why an active chain waits unsubmitted (a pool with no free slot), as its reason and
        an event; "" clears it once the chain goes on."""
        with self._tx() as db:
            changed = db.execute(
                "UPDATE chains SET reason = ? WHERE id = ? AND reason != ? AND state IN (?, ?)",
                (reason, chain_id, reason, *LIVE_STATES),
            ).rowcount
            if changed and reason:
                self._event(db, chain_id, None, now, "waiting", reason)

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
                "ended_at = ?, reason = ?, tail = ? WHERE chain_id = ? AND n = ?",
                (
                    Phase.ENDED.value,
                    action.outcome.value,
                    action.exit_code,
                    int(action.charged),
                    action.ended_at,
                    action.reason,
                    json.dumps(list(action.tail)) if action.tail else None,
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
            # The job may be one found under the segment's tag, whose submission an
            # interrupted service never recorded: the segment keeps it.
            db.execute(
                "UPDATE segments SET phase = ?, outcome = ?, ended_at = ?, reason = ?, "
                "job_id = COALESCE(job_id, ?) WHERE chain_id = ? AND n = ? AND phase != ?",
                (
                    Phase.ENDED.value,
                    Outcome.CANCELLED.value,
                    now,
                    action.reason,
                    action.job_id,
                    *seg,
                    Phase.ENDED.value,
                ),
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
        return [_event(r) for r in rows]

    @staticmethod
    def _event(
        db: sqlite3.Connection, chain_id: str, segment: Optional[int], at: float, kind: str, message: str
    ) -> None:
        db.execute(
            "INSERT INTO events (chain_id, segment, at, kind, message) VALUES (?, ?, ?, ?, ?)",
            (chain_id, segment, at, kind, message),
        )


def _shown_where(ended_since: Optional[float]) -> tuple[str, tuple[Any, ...]]:
    """The SQL condition on ``chains`` of what `status` shows: the chains that have not
    ended and those that ended after ``ended_since`` (every chain when None)."""
    if ended_since is None:
        return "1", ()
    finals = tuple(s.value for s in ChainState if s.final)
    marks = ", ".join("?" * len(finals))
    return f"(chains.state NOT IN ({marks}) OR chains.ended_at > ?)", (*finals, ended_since)


def _sql_words(kind: type[enum.Enum]) -> str:
    return ", ".join(f"'{m.value}'" for m in kind)


# A JSON column of progress: NULL, or an object whose epoch is a whole number or null.
_PROGRESS_OK = """CASE WHEN c.{0} IS NULL THEN 1
    WHEN typeof(c.{0}) = 'text' AND json_valid(c.{0}) THEN json_type(c.{0}) = 'object'
        AND coalesce(json_type(c.{0}, '$.epoch'), 'null') IN ('integer', 'null')
    ELSE 0 END"""
# The spec's fields the table reads, and a check that the spec is a JSON object in which
# they are of their types.
_SPEC_FIELDS = ("target_epoch", "max_failures", "total_time", "walltime", "max_concurrent")
_SPEC_OK = """CASE WHEN typeof(c.spec) = 'text' AND json_valid(c.spec) THEN json_type(c.spec) = 'object'
        AND json_type(c.spec, '$.target_epoch') IN ('integer', 'null')
        AND json_type(c.spec, '$.max_failures') = 'integer'
        AND json_type(c.spec, '$.total_time') = 'integer' AND json_extract(c.spec, '$.total_time') > 0
        AND json_type(c.spec, '$.walltime') = 'integer' AND json_extract(c.spec, '$.walltime') > 0
        AND coalesce(json_type(c.spec, '$.max_concurrent'), 'null') IN ('integer', 'null')
        AND json_type(c.spec, '$.scheduler') = 'object'
        AND coalesce(json_type(c.spec, '$.scheduler.hosts'), 'array') = 'array'
    ELSE 0 END"""
# Every column of a segment as ``_segment`` reads it back.
_SEGMENT_OK = f"""typeof(s.n) = 'integer' AND typeof(s.walltime) = 'integer'
    AND s.phase IN ({_sql_words(Phase)}) AND (s.outcome IS NULL OR s.outcome IN ({_sql_words(Outcome)}))
    AND typeof(s.attempts) = 'integer' AND typeof(s.reason) = 'text'
    AND typeof(s.exit_code) IN ('null', 'integer') AND typeof(s.task) IN ('null', 'integer')
    AND typeof(s.job_id) IN ('null', 'text') AND typeof(s.after) IN ('null', 'text')
    AND typeof(s.host) IN ('null', 'text') AND typeof(s.array) IN ('null', 'text')
    AND typeof(s.retry_at) IN ('null', 'integer', 'real')
    AND typeof(s.submitted_at) IN ('null', 'integer', 'real')
    AND typeof(s.started_at) IN ('null', 'integer', 'real')
    AND typeof(s.ended_at) IN ('null', 'integer', 'real')
    AND typeof(s.missing_since) IN ('null', 'integer', 'real')"""
_RAN = (
    f"s.started_at IS NOT NULL OR s.phase = '{Phase.RUNNING.value}' OR (s.phase = '{Phase.ENDED.value}'"
    f" AND (s.outcome IS NULL OR s.outcome NOT IN ({', '.join(repr(o.value) for o in _NOT_RUN)})))"
)
_OK = " AND ".join(
    f"({check})"
    for check in (_SPEC_OK, *(_PROGRESS_OK.format(c) for c in ("progress", "latest", "baseline")))
)


def _field(column: str, path: str) -> str:
    """A field of a JSON column; NULL where the column does not parse (the chain is then
    read in full: ``_OK`` is false)."""
    return f"CASE WHEN json_valid({column}) THEN json_extract({column}, '{path}') END"


_GLANCE_SQL = f"""SELECT c.rowid, c.id, c.state, c.reason, c.failures, c.used, c.created_at, c.ended_at,
    CASE WHEN {_OK} THEN 1 ELSE 0 END AS ok,
    {_field("coalesce(c.latest, c.progress)", "$.epoch")}, {_field("c.baseline", "$.epoch")},
    {", ".join(_field("c.spec", f"$.{name}") for name in _SPEC_FIELDS)},
    CASE WHEN json_valid(c.spec) THEN coalesce(json_array_length(c.spec, '$.scheduler.hosts'), 0) END,
    count(s.rowid), sum(CASE WHEN s.rowid IS NOT NULL AND ({_RAN}) THEN 1 ELSE 0 END),
    sum(CASE WHEN s.rowid IS NULL OR ({_SEGMENT_OK}) THEN 0 ELSE 1 END)
FROM chains c LEFT JOIN segments s ON s.chain_id = c.id
WHERE {{picked}} GROUP BY c.rowid ORDER BY c.created_at, c.rowid"""
_LIVE_SQL = f"""SELECT c.rowid,
    s.n, s.phase, s.job_id, s.after, s.walltime, s.started_at, s.retry_at, s.reason, s.host
FROM chains c JOIN segments s ON s.chain_id = c.id
WHERE {{picked}} AND s.phase != '{Phase.ENDED.value}' ORDER BY c.rowid, s.n"""

_STATES = {m.value: m for m in ChainState}
_PHASES = {m.value: m for m in Phase}
_NUMBER = frozenset({int, float})
_MAYBE_NUMBER = frozenset({int, float, type(None)})
_MAYBE_TEXT = frozenset({str, type(None)})


def _glance(r: sqlite3.Row, live: list[Optional[Live]]) -> Optional[Glance]:
    """A row of ``_GLANCE_SQL`` with its live segments as the table shows them; None when
    any of it is not as chainrun writes it (the chain is then read in full)."""
    (_, id_, state, reason, failures, used, created, ended, ok) = r[:9]
    segments_ok = not r[19] and None not in live
    row_ok = type(id_) is str and id_.isprintable() and id_ != "" and type(reason) is str
    numbers_ok = type(failures) is int and type(used) in _NUMBER and type(created) in _NUMBER
    if not (ok and segments_ok and row_ok and numbers_ok and type(ended) in _MAYBE_NUMBER):
        return None
    if state not in _STATES:
        return None
    epoch, base, target, max_failures, total, walltime, concurrent, hosts, count, ran = r[9:19]
    segs = tuple(s for s in live if s is not None)
    return Glance(
        id_,
        _STATES[state],
        reason,
        failures,
        used,
        epoch,
        base,
        target,
        max_failures,
        total,
        walltime,
        concurrent,
        hosts > 0,
        count,
        ran,
        segs,
    )


def _live(r: sqlite3.Row) -> Optional[Live]:
    """A row of ``_LIVE_SQL``; None when it is not as chainrun writes it."""
    (_, n, phase, job_id, after, walltime, started, retry, reason, host) = r
    if type(n) is not int or type(walltime) is not int or phase not in _PHASES or type(reason) is not str:
        return None
    if type(job_id) not in _MAYBE_TEXT or type(after) not in _MAYBE_TEXT or type(host) not in _MAYBE_TEXT:
        return None
    if type(started) not in _MAYBE_NUMBER or type(retry) not in _MAYBE_NUMBER:
        return None
    return Live(n, _PHASES[phase], job_id, after, walltime, started, retry, reason, host)


def _paren(text: str) -> str:
    return f" ({text})" if text else ""


def _connect(target: str, uri: bool, timeout: float) -> sqlite3.Connection:
    db = sqlite3.connect(target, uri=uri, timeout=timeout, isolation_level=None, check_same_thread=False)
    db.row_factory = sqlite3.Row
    db.text_factory = _text
    return db


def _version(db: sqlite3.Connection) -> int:
    """The schema version of the database; 0 for one without chainrun's tables."""
    if not db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone():
        return 0
    row = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    if row is None:
        return 0
    try:
        return int(row["value"])
    except (TypeError, ValueError):
        raise sqlite3.DatabaseError(f"its schema version {_brief(row['value'])} is not a number") from None


# -- reading rows back: anything that does not decode makes the chain damaged --------


class _Garbled(bytes):
    """A TEXT value that is not UTF-8: what a damaged row may hold."""


def _text(data: bytes) -> Union[str, _Garbled]:
    """SQLite TEXT to str; bytes that are not UTF-8 stay bytes, so that one bad value
    damages its chain instead of failing the query that read it."""
    try:
        return data.decode()
    except UnicodeDecodeError:
        return _Garbled(data)


class _Unreadable(Exception):
    """What of a chain's row cannot be read back."""


def _brief(value: Any) -> str:
    if isinstance(value, _Garbled):
        return "text that is not UTF-8"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _shown(value: Any) -> str:
    """A stored id, name or job id as one printable word."""
    if isinstance(value, str) and value.isprintable() and value:
        return value
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _json(value: Any, column: str) -> Any:
    if value is None:
        return None
    if isinstance(value, _Garbled):
        raise _Unreadable(f"{column} is not valid UTF-8")
    if not isinstance(value, str):
        raise _Unreadable(f"{column} is {_brief(value)}, not JSON text")
    try:
        return json.loads(value)
    except (ValueError, RecursionError) as exc:
        raise _Unreadable(f"{column} is not valid JSON ({exc})") from None


_EnumT = typing.TypeVar("_EnumT", ChainState, Phase, Outcome)


def _enum(kind: type[_EnumT], value: Any, column: str) -> _EnumT:
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(str(m.value) for m in kind)
        raise _Unreadable(f"{column} is {_brief(value)}, not one of {allowed}") from None


def _progress(value: Any, column: str) -> Progress:
    data = _json(value, column)
    if data is not None and not isinstance(data, dict):
        raise _Unreadable(f"{column} is {_brief(data)}, not a JSON object")
    try:
        return Progress.from_json(data)
    except TypeError as exc:
        raise _Unreadable(f"{column} is not progress ({exc})") from None


def _spec(value: Any) -> JobSpec:
    data = _json(value, "spec")
    try:
        return JobSpec.from_json(data)
    except KeyError as exc:
        raise _Unreadable(f"spec is not a job spec (no {exc})") from None
    except (TypeError, ValueError, AttributeError) as exc:
        raise _Unreadable(f"spec is not a job spec ({exc})") from None


def _chain(row: sqlite3.Row, segments: tuple[Segment, ...]) -> Chain:
    chain = Chain(
        id=row["id"],
        spec=_spec(row["spec"]),
        state=_enum(ChainState, row["state"], "state"),
        created_at=row["created_at"],
        segments=segments,
        failures=row["failures"],
        used=row["used"],
        progress=_progress(row["progress"], "progress"),
        latest=_progress(row["latest"] or row["progress"], "latest"),
        baseline=_progress(row["baseline"], "baseline"),
        cancel_requested=bool(row["cancel_requested"]),
        reason=row["reason"],
        ended_at=row["ended_at"],
    )
    _check(chain)
    if not (isinstance(chain.id, str) and chain.id.isprintable() and chain.id):
        raise _Unreadable(f"its id {_brief(chain.id)} is not a printable word")
    for field in ("total_time", "walltime"):
        if getattr(chain.spec, field) <= 0:
            raise _Unreadable(
                f"spec.{field} is {getattr(chain.spec, field)}, not a positive number of seconds"
            )
    return chain


def _segment(row: sqlite3.Row) -> Segment:
    data: dict[str, Any] = dict(row)
    label = f"segment {data['n']}" if isinstance(data["n"], int) else "a segment"
    try:
        segment = Segment(
            chain_id=data["chain_id"],
            n=data["n"],
            walltime=data["walltime"],
            phase=_enum(Phase, data["phase"], "phase"),
            job_id=data["job_id"],
            after=data["after"],
            attempts=data["attempts"],
            retry_at=data["retry_at"],
            submitted_at=data["submitted_at"],
            started_at=data["started_at"],
            ended_at=data["ended_at"],
            missing_since=data["missing_since"],
            outcome=_enum(Outcome, data["outcome"], "outcome") if data["outcome"] is not None else None,
            exit_code=data["exit_code"],
            charged=bool(data["charged"]),
            reason=data["reason"],
            tail=_tail(data["tail"]),
            host=data["host"],
            array=data["array"],
            task=data["task"],
        )
        _check(segment)
    except _Unreadable as exc:
        raise _Unreadable(f"{label}: {exc}") from None
    return segment


def _tail(raw: Optional[str]) -> tuple[str, ...]:
    """A segment's stored output tail; one that cannot be read is shown as none."""
    try:
        lines = json.loads(raw) if raw else []
    except ValueError:
        return ()
    return tuple(line for line in lines if isinstance(line, str)) if isinstance(lines, list) else ()


def _event(row: sqlite3.Row) -> Event:
    """An event as stored; a damaged one still shows, saying what is wrong with it."""
    at, segment, message = row["at"], row["segment"], row["message"]
    problems = [
        f"{name} is {_brief(value)}"
        for name, value, hint in (("at", at, float), ("message", message, str))
        if not _fitter(hint)(value)
    ]
    return Event(
        id=row["id"],
        chain_id=_shown(row["chain_id"]),
        segment=segment if _fitter(Optional[int])(segment) else None,
        at=float(at) if _fitter(float)(at) else 0.0,
        kind=_shown(row["kind"]),
        message=f"(event {row['id']} is damaged: {'; '.join(problems)})" if problems else message,
    )


# By dataclass: a getter of all its fields' values at once, for each field the types
# that fit it at a glance (see _plain), and its name, type hint, fit test, and whether
# it may hold a dataclass.
_FIELDS: dict[
    type,
    tuple[
        Callable[[Any], Any],
        tuple[frozenset[type], ...],
        list[tuple[str, Any, Callable[[Any], bool], bool]],
    ],
] = {}


def _check(obj: Any, prefix: str = "") -> None:
    """Raise _Unreadable naming the first field of dataclass ``obj`` (nested ones too)
    whose value is not of its declared type: SQLite and JSON keep whatever they are given."""
    known = _FIELDS.get(type(obj))
    if known is None:
        hints = typing.get_type_hints(type(obj))
        names = [f.name for f in dataclasses.fields(obj)]
        known = _FIELDS[type(obj)] = (
            operator.attrgetter(*names),  # every dataclass read here has several fields
            tuple(_plain(hints[n]) for n in names),
            [(n, hints[n], _fitter(hints[n]), _holds_dataclass(hints[n])) for n in names],
        )
    values, plain, fields = known
    for value, types, (name, hint, fits, nested) in zip(values(obj), plain, fields):
        if type(value) in types:  # most fields: a str, a number, None, an Enum
            continue
        if not fits(value):
            what = "not valid UTF-8" if isinstance(value, _Garbled) else f"{_brief(value)}, not {_kind(hint)}"
            raise _Unreadable(f"{prefix}{name} is {what}")
        if nested and dataclasses.is_dataclass(value):
            _check(value, f"{prefix}{name}.")


# The exact types a value of these hints may have: JSON and SQLite give no subclasses.
_PLAIN: dict[Any, frozenset[type]] = {
    str: frozenset({str}),
    int: frozenset({int}),
    float: frozenset({int, float}),
    bool: frozenset({bool}),
    type(None): frozenset({type(None)}),
}


def _plain(hint: Any) -> frozenset[type]:
    """The types whose values fit ``hint`` with no closer look (a str for ``str``, a Phase
    for ``Phase``); none for hints that need one (tuples, dataclasses): ``_fitter`` then."""
    if typing.get_origin(hint) is Union:
        parts = [_plain(arg) for arg in typing.get_args(hint)]
        return frozenset().union(*parts) if all(parts) else frozenset()
    if isinstance(hint, type) and issubclass(hint, (ChainState, Phase, Outcome)):
        return frozenset({hint})
    return _PLAIN.get(hint, frozenset())


def _holds_dataclass(hint: Any) -> bool:
    args = typing.get_args(hint) if typing.get_origin(hint) is Union else (hint,)
    return any(isinstance(a, type) and dataclasses.is_dataclass(a) for a in args)


@functools.cache
def _fitter(hint: Any) -> Callable[[Any], bool]:
    """A test of whether a value is of type ``hint``, made once per hint: a row is read
    field by field on every load of a chain."""
    origin = typing.get_origin(hint)
    if origin is Union:
        args = typing.get_args(hint)
        if len(args) == 2 and type(None) in args:  # Optional[X]
            inner = _fitter(next(a for a in args if a is not type(None)))
            return lambda v: v is None or inner(v)
        parts = tuple(_fitter(arg) for arg in args)
        return lambda v: any(p(v) for p in parts)
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            each = _fitter(args[0])
            return lambda v: isinstance(v, tuple) and all(each(x) for x in v)
        items = tuple(_fitter(a) for a in args)
        return lambda v: isinstance(v, tuple) and len(v) == len(items) and all(f(x) for f, x in zip(items, v))
    if hint is type(None):
        return lambda v: v is None
    if hint is bool:
        return lambda v: isinstance(v, bool)
    if hint is int:
        return lambda v: isinstance(v, int) and not isinstance(v, bool)
    if hint is float:
        return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    if hint is str:
        return lambda v: isinstance(v, str)
    return lambda v: isinstance(v, hint)  # an Enum or a dataclass


def _kind(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Union:
        return " or ".join(_kind(arg) for arg in typing.get_args(hint))
    if origin is tuple:
        args = typing.get_args(hint)
        inner = args[0] if len(args) == 2 and args[1] is Ellipsis else None
        if inner is None:
            return f"a list of {len(args)}"
        return "a list of pairs" if typing.get_origin(inner) is tuple else f"a list of {_kind(inner)}"
    names = {int: "a whole number", float: "a number", str: "text", bool: "true or false", type(None): "null"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))
