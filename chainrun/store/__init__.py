"""The chain database: the only user of sqlite3.

One SQLite file in WAL mode under ``$CHAINRUN_HOME`` holds the chains, their
segments, and an append-only events log of every decision with its reason.
``Store`` is the one door to it; behind it, ``database`` opens the file and
says what an SQLite error means, ``migrations`` holds the schema, ``rows``
decodes rows back (``checked`` type-checks them), ``views`` is the read model
of ``chainrun status``, and ``writes`` the transactions that change it.

A chain whose row cannot be read back (bad JSON, an unknown state, a value of
the wrong type) is *damaged*: ``chains()`` leaves it out, so the ticks never
see it and the other chains go on, and ``damaged()`` lists it, with how to
remove it, for ``chainrun status``.

The tick's load (``chains(active_only=True)``) reads the active chains only,
and of those decodes again only the ones whose ``version`` moved: triggers
count every change to a chain's row or its segments, made by chainrun or by
hand. When nothing was written since the last load (``Database.stamp``: no
other connection committed, this one began no write and its connection was not
handed out), it reads nothing and gives the chains of that load again.
``status`` selects in SQL what it shows (``shown``); the indexes on state and
name keep ended chains out of both. Its table reads only the few
columns it uses (``glance``), and decodes in full only a row that is not as
chainrun writes it, to say what is wrong with it.

``Store(home, readonly=True)`` is for the commands that only look (status,
history, logs): it never writes, never waits on a writer for more than
``READ_TIMEOUT``, and a missing database reads as one without chains.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any, NamedTuple, Optional, Union

from chainrun.errors import StoreError, UsageError
from chainrun.home import default_home as default_home  # where chainrun keeps its state
from chainrun.logsetup import get_logger
from chainrun.model import Action, Chain, ChainState, Finish, JobSpec, Progress, Submit
from chainrun.store import views, writes
from chainrun.store.database import READ_TIMEOUT as READ_TIMEOUT
from chainrun.store.database import Database, local_dir, private_dir
from chainrun.store.migrations import MIGRATIONS as MIGRATIONS
from chainrun.store.migrations import SCHEMA_VERSION as SCHEMA_VERSION
from chainrun.store.rows import (
    Event,
    Unreadable,
    decode_chain,
    decode_event,
    decode_progress,
    decode_segment,
    decode_spec,
    word,
)
from chainrun.store.views import LIVE_STATES, DamagedChain, Glance, SegmentGlance, ran

__all__ = [
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "DamagedChain",
    "Event",
    "Glance",
    "OwedCancel",
    "SegmentGlance",
    "Store",
    "default_home",
    "local_dir",
    "private_dir",
    "ran",
]

log = get_logger(__name__)

MAX_REF = 200  # the longest chain reference (id, id prefix or name) a command accepts


class OwedCancel(NamedTuple):
    """A job whose cancel did not reach its scheduler: its chain, its segment, since when,
    and the name it was listed with (the cancel is for the job listed with it alone)."""

    chain_id: str
    n: int
    since: float
    name: str


class Store:
    """Chains, segments and events in one SQLite file.

    ``readonly``: for commands that only look. Nothing is written (no schema
    upgrade, no lock taken), a writer is waited on for ``READ_TIMEOUT`` at most,
    and a missing database has no chains.
    """

    def __init__(self, home: Path, readonly: bool = False) -> None:
        self._database = Database(home, readonly)
        self.home = self._database.home
        self.path = self._database.path
        self.readonly = readonly
        self._reported: set[str] = set()  # damaged chains already logged by this store
        # The tick's load, kept for the next: each active chain by rowid, as read at
        # (its rowid, id, version).
        self._kept: dict[int, tuple[tuple[Any, ...], Union[Chain, DamagedChain]]] = {}
        # The database's stamp when that load began, and its chains (None: load anew).
        self._loaded: Optional[tuple[tuple[int, int], list[Chain]]] = None

    @property
    def db(self) -> sqlite3.Connection:
        """The connection itself, for a look behind the store (tests). What is done with
        it is not seen by ``Database.stamp``: the next tick's load reads anew."""
        self._loaded = None
        return self._database.db

    def close(self) -> None:
        self._database.close()

    # -- chains ---------------------------------------------------------------

    def add_chain(self, spec: JobSpec, progress: Progress, now: float) -> Chain:
        return self.chain(self.add_chains([(spec, progress)], now)[0])

    def add_chains(
        self,
        new: Sequence[tuple[JobSpec, Progress]],
        now: float,
        vet: Optional[Callable[[list[tuple[str, str, JobSpec]]], None]] = None,
    ) -> list[str]:
        """Store new chains, each with the progress it starts from, all in one transaction
        (none stored if one cannot be); their ids, in order. ``vet`` is shown the chains that
        have not ended (``unended``) as this transaction reads them, before anything is
        written, and refuses by raising: two processes storing at once cannot both pass it."""
        with self._database.tx():
            if vet is not None:
                vet(self.unended())
            return writes.add_chains(self.db, new, now)

    def unended(self) -> list[tuple[str, str, JobSpec]]:
        """The chains that have not ended (active or stuck), oldest first: (id, name, spec).
        A row whose spec cannot be read is left out, as from ``chains()``."""
        rows = self._by_end(False, "created_at, rowid")
        return [(chain_id, name, spec) for chain_id, name, _, spec in rows]

    def ended(self) -> list[tuple[str, str, ChainState, JobSpec]]:
        """The chains that have ended, the last to end first: (id, name, state, spec). A row
        whose spec cannot be read is left out, as from ``chains()``."""
        rows = self._by_end(True, "ended_at DESC, rowid DESC")
        return [(chain_id, name, ChainState(state), spec) for chain_id, name, state, spec in rows]

    def _by_end(self, ended: bool, order: str) -> list[tuple[str, str, str, JobSpec]]:
        final = [s.value for s in ChainState if s.final]
        rows = self._database.rows(
            f"SELECT id, name, state, spec FROM chains WHERE state {'' if ended else 'NOT '}IN "
            f"({','.join('?' * len(final))}) ORDER BY {order}",
            tuple(final),
        )
        found = []
        for row in rows:
            try:
                found.append((row["id"], row["name"], row["state"], decode_spec(row["spec"])))
            except Unreadable:
                continue
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
        whose rows have not changed since; when nothing was written to the database since
        the last such load, nothing is read, and the very list of that load is given again
        (the caller does not change it), by which the caller sees that nothing changed."""
        stamp = self._database.stamp() if active_only else None
        if stamp is not None and self._loaded is not None and self._loaded[0] == stamp:
            return self._loaded[1]
        chains: list[Chain] = []
        for item in self._load_live() if active_only else self._load("1"):
            if isinstance(item, Chain):
                chains.append(item)
            elif active_only and item.id not in self._reported:  # the tick's read: log it once
                self._reported.add(item.id)
                log.warning(
                    "chain skipped: its row in the database cannot be read", chain=item.id, why=item.problem
                )
        if stamp is not None:
            self._loaded = (stamp, chains)
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
        items = self._load(*views.shown_where(ended_since))
        return (
            [c for c in items if isinstance(c, Chain)],
            [c for c in items if isinstance(c, DamagedChain)],
        )

    def damaged(self) -> list[DamagedChain]:
        """The chains whose rows cannot be read back, oldest first, whatever their state."""
        return self.shown(None)[1]

    def _load(self, where: str, args: tuple[Any, ...] = ()) -> list[Union[Chain, DamagedChain]]:
        """The chains ``where`` (an SQL condition on ``chains``) selects, oldest first, each
        with all its segments: two queries, whatever the number of chains."""
        with self._database.read_transaction():
            rows = self._database.rows(
                f"SELECT rowid AS rowid_, * FROM chains WHERE {where} ORDER BY created_at, rowid", args
            )
            segs = self._segments(where, args)
        return [self._read(row, segs.get(row["rowid_"], [])) for row in rows]

    def _load_live(self) -> list[Union[Chain, DamagedChain]]:
        """The tick's load: the active chains, each read again only when its ``version``
        says that it or one of its segments changed since the last load."""
        live = f"chains.state IN ({', '.join('?' * len(LIVE_STATES))})"
        with self._database.read_transaction():
            versions = self._database.rows(
                f"SELECT rowid, id, version FROM chains WHERE {live} ORDER BY created_at, rowid",
                LIVE_STATES,
            )
            changed = [r["rowid"] for r in versions if self._kept.get(r["rowid"], (None,))[0] != tuple(r)]
            read = self._by_rowid(changed)
        kept: dict[int, tuple[tuple[Any, ...], Union[Chain, DamagedChain]]] = {}
        for r in versions:
            rowid = r["rowid"]
            kept[rowid] = (tuple(r), read[rowid]) if rowid in read else self._kept[rowid]
        self._kept = kept  # only the chains active now are kept
        return [item for _, item in kept.values()]

    def _by_rowid(self, rowids: Sequence[int]) -> dict[int, Union[Chain, DamagedChain]]:
        """The chains with these rowids, each with all its segments, decoded part by part:
        SQLite binds at most 999 values by default, and the raw rows (JSON text) of every
        chain at once would add to the memory peak of a service's first tick."""
        read: dict[int, Union[Chain, DamagedChain]] = {}
        for i in range(0, len(rowids), 500):
            part = tuple(rowids[i : i + 500])
            where = f"chains.rowid IN ({', '.join('?' * len(part))})"
            segs = self._segments(where, part)
            sql = f"SELECT rowid AS rowid_, * FROM chains WHERE {where}"
            read.update(
                (r["rowid_"], self._read(r, segs.get(r["rowid_"], [])))
                for r in self._database.rows(sql, part)
            )
        return read

    def _segments(self, where: str, args: tuple[Any, ...]) -> dict[int, list[sqlite3.Row]]:
        """The segment rows of the chains ``where`` selects, by their chain's rowid, in order."""
        by_chain: dict[int, list[sqlite3.Row]] = {}
        for seg in self._database.rows(
            "SELECT chains.rowid AS rowid_, segments.* FROM chains JOIN segments"
            f" ON segments.chain_id = chains.id WHERE {where} ORDER BY chains.rowid, segments.n",
            args,
        ):
            by_chain.setdefault(seg["rowid_"], []).append(seg)
        return by_chain

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
            rows = self._database.rows(sql, (ref,))
            if rows:
                return str(rows[0]["id"])
        rows = self._database.rows(
            "SELECT id FROM chains WHERE substr(id, 1, ?) = ? ORDER BY created_at DESC, rowid DESC",
            (len(ref), ref),
        )
        if len(rows) == 1:
            return str(rows[0]["id"])
        if rows:
            ids = ", ".join(word(r["id"]) for r in rows[:5])
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
            return decode_chain(row, tuple(decode_segment(s) for s in segs))
        except Unreadable as exc:
            return views.damaged(row, segs, str(exc), str(self.path))

    def events(self, chain_id: str, after_id: int = 0) -> list[Event]:
        rows = self._database.rows(
            "SELECT * FROM events WHERE chain_id = ? AND id > ? ORDER BY id", (chain_id, after_id)
        )
        return [decode_event(r) for r in rows]

    def progress_log(self, chain_id: str) -> list[tuple[float, Progress]]:
        """Each new progress the ticks saw of the chain, with when, oldest first; none in a
        database older than that record (a reader does not upgrade it), and a row that
        cannot be read is left out."""
        if not self._database.rows("SELECT 1 FROM sqlite_master WHERE name = 'progress_log'"):
            return []
        rows = self._database.rows(
            "SELECT at, progress FROM progress_log WHERE chain_id = ? ORDER BY at, rowid", (chain_id,)
        )
        log = []
        for r in rows:
            with suppress(Unreadable):
                log.append((float(r["at"]), decode_progress(r["progress"])))
        return log

    def metric_ranges(self, chain_ids: Sequence[str]) -> dict[str, dict[str, tuple[float, float]]]:
        """Each metric's lowest and highest value over the chains' progress records, by chain
        id and metric name, in one query (none in a database older than those records)."""
        if not self._database.rows("SELECT 1 FROM sqlite_master WHERE name = 'progress_log'"):
            return {}
        ranges: dict[str, dict[str, tuple[float, float]]] = {}
        for r in self._database.rows(views.METRIC_RANGE_SQL, (json.dumps(list(chain_ids)),)):
            if isinstance(r[1], str):
                ranges.setdefault(r[0], {})[r[1]] = (float(r[2]), float(r[3]))
        return ranges

    def allocations(self, now: float) -> dict[str, tuple[float, float]]:
        """Every chain's time allocated and time trained (``chainrun.accounting``'s totals),
        by chain id, in one query; a chain none of whose segments started is not there."""
        if not self._database.rows("SELECT 1 FROM sqlite_master WHERE name = 'progress_log'"):
            return {}  # a database from before the signal time was kept
        return {r[0]: (float(r[1]), float(r[2])) for r in self._database.rows(views.ALLOCATION_SQL, (now,))}

    def data_version(self) -> int:
        """A number that changes whenever another connection has written to the database
        (SQLite's ``data_version``): what a live view watches."""
        return int(self._database.rows("PRAGMA data_version")[0][0])

    def glance(self, ended_since: Optional[float]) -> tuple[list[Glance], list[DamagedChain]]:
        """What the status table shows of the chains ``shown`` selects, in its order, read
        from the few columns it uses (no chain is decoded whole: at a thousand chains that
        was most of `status`'s time). A row whose columns, or whose segments' columns, are
        not as chainrun writes them is read in full instead, so a damaged chain is listed
        as ``shown`` lists it; the checks here cover what the table reads, every column of
        the segments, and whether each JSON column parses, not every field of the spec."""
        where, args = views.shown_where(ended_since)
        picked = f"c.rowid IN (SELECT rowid FROM chains WHERE {where})"  # the index on state alone
        glances: dict[int, Glance] = {}
        unread: list[int] = []
        with self._database.read_transaction():
            live: dict[int, list[Optional[SegmentGlance]]] = {}
            for r in self._database.rows(views.SEGMENT_GLANCE_SQL.format(picked=picked), args):
                live.setdefault(r[0], []).append(views.read_segment_glance(r))
            order = []
            for r in self._database.rows(views.GLANCE_SQL.format(picked=picked), args):
                order.append(r[0])
                glanced = views.read_glance(r, live.get(r[0], []))
                if glanced is None:
                    unread.append(r[0])
                else:
                    glances[r[0]] = glanced
            full = self._by_rowid(unread)
        shown: list[Glance] = []
        damaged: list[DamagedChain] = []
        for rowid in order:
            item: Union[Glance, Chain, DamagedChain] = glances.get(rowid) or full[rowid]
            if isinstance(item, DamagedChain):
                damaged.append(item)
            else:
                shown.append(item if isinstance(item, Glance) else Glance.of(item))
        return shown, damaged

    def summary(self) -> dict[str, int]:
        """Counts for the service's status line, from one query: chains with a running
        job, with a queued one, active (stuck included), stuck, failed. The index on
        state keeps ended chains and their segments out of it."""
        row = self._database.rows(views.SUMMARY_SQL, LIVE_STATES * 3)[0]
        return {key: int(value) for key, value in zip(row.keys(), row)}

    def request_cancel(self, chain_id: str, now: float) -> None:
        with self._database.tx() as db:
            writes.request_cancel(db, chain_id, now)

    # -- segments -------------------------------------------------------------

    def journal_submit(
        self,
        chain_id: str,
        sub: Submit,
        now: float,
        host: Optional[str] = None,
        task: Optional[tuple[str, int]] = None,
        place: Optional[str] = None,
    ) -> int:
        """Write 'submitting segment n' before the scheduler is asked (``writes.journal_submit``);
        returns the attempt's number."""
        with self._database.tx() as db:
            return writes.journal_submit(db, chain_id, sub, now, host, task, place)

    def record_copy(
        self,
        chain_id: str,
        n: int,
        seconds: float,
        size: int,
        digest: Optional[str],
        message: str,
        now: float,
    ) -> None:
        """Record the checkpoint copied to segment ``n``'s place (``writes.record_copy``)."""
        with self._database.tx() as db:
            writes.record_copy(db, chain_id, n, seconds, size, digest, message, now)

    # -- one tick's record ------------------------------------------------------

    def record(
        self,
        chain_id: str,
        actions: list[Action],
        latest: Optional[Progress],
        warnings: list[str],
        now: float,
    ) -> Optional[Chain]:
        """Record one tick of a chain in one transaction: the actions carried out (each
        with its reason), the newest progress seen, and what went wrong on the way. When
        the chain ends here, returns it as recorded, for those told of chains that end."""
        with self._database.tx() as db:
            writes.record(db, chain_id, actions, latest, warnings, now)
        return self.chain(chain_id) if any(isinstance(a, Finish) for a in actions) else None

    # -- cancels owed -----------------------------------------------------------

    def owed_cancels(self) -> dict[tuple[str, str], dict[str, OwedCancel]]:
        """The jobs owed a cancel, by cluster (scheduler kind, host) and job id (``owe_cancels``)."""
        owed: dict[tuple[str, str], dict[str, OwedCancel]] = {}
        for r in self._owed_rows("kind, host, job_id, chain_id, n, since, name"):
            owed.setdefault((r[0], r[1]), {})[r[2]] = OwedCancel(r[3], int(r[4]), float(r[5]), r[6])
        return owed

    def owed_by_chain(self) -> dict[str, list[tuple[str, float]]]:
        """``owed_cancels`` by chain id: each job owed a cancel, with since when."""
        by_chain: dict[str, list[tuple[str, float]]] = {}
        for jobs in self.owed_cancels().values():
            for job_id, cancel in jobs.items():
                by_chain.setdefault(cancel.chain_id, []).append((job_id, cancel.since))
        return by_chain

    def owed_for(self, chain_id: str) -> list[tuple[str, float]]:
        """One chain's entry of ``owed_by_chain``, read alone."""
        rows = self._owed_rows("job_id, since", "WHERE chain_id = ?", (chain_id,))
        return [(r[0], float(r[1])) for r in rows]

    def _owed_rows(self, columns: str, where: str = "", args: tuple[str, ...] = ()) -> list[sqlite3.Row]:
        """``columns`` of the owed cancels (``where``); none in a store older than their table."""
        if not self._database.rows("SELECT 1 FROM sqlite_master WHERE name = 'owed_cancels'"):
            return []
        return self._database.rows(f"SELECT {columns} FROM owed_cancels {where}", args)

    def owe_cancels(self, key: tuple[str, str], jobs: dict[str, OwedCancel]) -> None:
        """Keep ``jobs`` as owed a cancel on cluster ``key``: their cancel did not reach its
        scheduler, and is sent once it answers, by this service or one started after it. A job
        owed one already keeps the time since when it is."""
        with self._database.tx() as db:
            db.executemany(
                "INSERT OR IGNORE INTO owed_cancels (kind, host, job_id, chain_id, n, since, name)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(*key, job_id, *owed) for job_id, owed in jobs.items()],
            )

    def settle_cancels(self, key: tuple[str, str], job_ids: Iterable[str]) -> None:
        """``job_ids`` on cluster ``key`` are owed a cancel no more."""
        with self._database.tx() as db:
            db.executemany(
                "DELETE FROM owed_cancels WHERE kind = ? AND host = ? AND job_id = ?",
                [(*key, job_id) for job_id in job_ids],
            )

    # -- events ---------------------------------------------------------------

    def event(self, chain_id: str, segment: Optional[int], kind: str, message: str) -> None:
        with self._database.tx() as db:
            writes.event(db, chain_id, segment, time.time(), kind, message)
