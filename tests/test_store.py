"""The SQLite store: schema versions and what a chain remembers (real SQLite, no service),
and what hostile input does to it: a chain reference that is a pattern, a row or a file
that is damaged, a lock, a read-only or a full disk. One clear line, nothing lost."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

import pytest
from conftest import have
from test_engine import World

from chainrun.errors import StoreError, StoreUnavailable, UsageError
from chainrun.model import (
    NO_PROGRESS,
    Action,
    Adopt,
    Cancel,
    ChainState,
    EndSegment,
    Finish,
    JobSpec,
    MarkStuck,
    Outcome,
    Phase,
    Progress,
    RetryLater,
    Submit,
    Track,
    Wait,
)
from chainrun.schedulers.segment import tag_for
from chainrun.store import MIGRATIONS, SCHEMA_VERSION, Glance, OwedCancel, Store
from chainrun.store import database as database_module
from chainrun.store import writes as writes_module

CLI = Callable[..., "subprocess.CompletedProcess[str]"]

SPEC = JobSpec(
    name="cifar",
    command="python train.py",
    workdir="/w",
    total_time=72000,
    walltime=3600,
    target_epoch=100,
    max_failures=3,
    checkpoint_dir="/w/checkpoints",
    signal="USR1",
    grace=300,
)


def old_database(home: Path, version: int) -> sqlite3.Connection:
    """A state database as chainrun schema ``version`` left it, with one chain at epoch 7."""
    home.mkdir(mode=0o700)
    db = sqlite3.connect(home / "chainrun.db", isolation_level=None)
    for step in MIGRATIONS[:version]:
        db.executescript(step)
    db.execute("INSERT INTO meta (key, value) VALUES ('schema_version', ?)", (str(version),))
    db.execute(
        "INSERT INTO chains (id, name, spec, state, created_at, progress) VALUES (?, ?, ?, ?, ?, ?)",
        ("cifar-a1b2c3", "cifar", json.dumps(SPEC.to_json()), "active", 1.0, json.dumps({"epoch": 7})),
    )
    return db


def test_a_version_1_database_is_migrated_and_keeps_its_chains(tmp_path: Path) -> None:
    """Opening an older database upgrades it in place; its chains load, starting from epoch 0."""
    old_database(tmp_path / "home", 1).close()
    for _ in range(2):  # a second open finds nothing left to do
        store = Store(tmp_path / "home")
        chain = store.chain("cifar-a1b2c3")
        assert (chain.state, chain.progress.epoch, chain.baseline) == (ChainState.ACTIVE, 7, NO_PROGRESS)
        version = store.db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0]
        assert version == str(SCHEMA_VERSION)
        store.close()


def test_the_schema_version_counts_the_migrations() -> None:
    """Version N is the database after the first N migrations: two branches that each added a
    migration must not both leave the version where one of them put it."""
    assert len(MIGRATIONS) == SCHEMA_VERSION


def test_a_cancel_owed_before_version_13_is_kept_for_its_segments_job_by_name(tmp_path: Path) -> None:
    """A cancel a version-12 database owed (which kept no name) is still owed after the
    upgrade, for the job listed with its segment's tag, the name that job was given."""
    db = old_database(tmp_path / "home", 12)
    db.execute(
        "INSERT INTO owed_cancels (kind, host, job_id, chain_id, n, since) VALUES (?, ?, ?, ?, ?, ?)",
        ("slurm", "", "1693", "cifar-a1b2c3", 4, 50.0),
    )
    db.close()
    store = Store(tmp_path / "home")
    try:
        assert store.owed_cancels() == {
            ("slurm", ""): {"1693": OwedCancel("cifar-a1b2c3", 4, 50.0, "cr.cifar-a1b2c3.4")}
        }
        assert tag_for("cifar-a1b2c3", 4) == "cr.cifar-a1b2c3.4"
    finally:
        store.close()


@pytest.mark.parametrize("applied", [7, 8])
def test_a_database_marked_7_is_upgraded_whichever_seventh_migration_it_had(
    tmp_path: Path, applied: int
) -> None:
    """Two migrations were once both numbered 7, and every database chainrun made since was
    marked 7 with both applied (the segments' ``stop`` column among them): such a one, and one
    marked 7 with only the first, both open, upgrade and keep their chains."""
    db = old_database(tmp_path / "home", applied)
    db.execute("UPDATE meta SET value = '7' WHERE key = 'schema_version'")
    db.close()
    store = Store(tmp_path / "home")
    assert store.chain("cifar-a1b2c3").progress.epoch == 7
    columns = {row[1] for row in store.db.execute("PRAGMA table_info(segments)")}
    assert "stop" in columns
    version = store.db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0]
    assert version == str(SCHEMA_VERSION)
    store.close()


def test_a_database_from_a_newer_chainrun_is_refused_and_left_intact(tmp_path: Path) -> None:
    """A downgrade must not guess at a schema it does not know: one line, and the chains stay."""
    old_database(tmp_path / "home", SCHEMA_VERSION).execute(
        "UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),)
    )
    with pytest.raises(StoreError, match=r"written by a newer chainrun .* upgrade chainrun"):
        Store(tmp_path / "home")
    db = sqlite3.connect(tmp_path / "home" / "chainrun.db")
    assert db.execute("SELECT id, progress FROM chains").fetchall() == [("cifar-a1b2c3", '{"epoch": 7}')]


def test_a_chain_remembers_where_it_started_as_progress_moves_on(tmp_path: Path) -> None:
    """The baseline is what checkpoint_dir held at submission; later progress does not move it."""
    store = Store(tmp_path / "home")
    chain = store.add_chain(SPEC, Progress(epoch=50, step=3), now=1.0)
    store.record(chain.id, [], Progress(epoch=60), [], 2.0)
    again = store.chain(chain.id)
    assert (again.baseline, again.latest.epoch) == (Progress(epoch=50, step=3), 60)


@pytest.mark.skipif(sys.version_info < (3, 10), reason="dataclass slots are Python 3.10's")
def test_a_chain_read_back_keeps_its_values_in_slots_and_its_live_segments_derived(tmp_path: Path) -> None:
    """What a service holds of every active chain has no instance dictionary (1.5 KB for a
    spec's 44 fields: 16 MB of a service's RSS at 10,000 chains, measured): the chain, its
    spec and scheduler, its segments and progress. ``live`` is derived from the segments,
    again for a chain made from another (``replace``), and is no field that is stored or
    compared."""
    store = Store(tmp_path / "home")
    added = store.add_chain(SPEC, Progress(epoch=1), now=1.0)
    store.journal_submit(added.id, Submit(1, 3600), 2.0)
    store.record(added.id, [Adopt(1, "7", "submitted")], Progress(epoch=2), [], 3.0)
    chain = store.chain(added.id)
    for value in (chain, chain.spec, chain.spec.scheduler, chain.segments[0], chain.progress, chain.latest):
        assert not hasattr(value, "__dict__"), type(value).__name__
    assert chain.live == chain.segments and chain.live[0].phase is Phase.PENDING
    ended = replace(chain, segments=(replace(chain.segments[0], phase=Phase.ENDED),))
    assert ended.live == ()
    assert replace(ended, segments=chain.segments) == chain


def test_a_chain_id_already_taken_is_drawn_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Six random hex digits meet among thousands of chains of one name: the second chain
    used to fail with sqlite3's IntegrityError; it gets another id."""
    drawn = iter(["cifar-aaaaaa", "cifar-aaaaaa", "cifar-bbbbbb"])
    monkeypatch.setattr(writes_module, "new_chain_id", lambda name: next(drawn))
    store = Store(tmp_path / "home")
    ids = [store.add_chain(SPEC, NO_PROGRESS, now=1.0).id for _ in range(2)]
    assert ids == ["cifar-aaaaaa", "cifar-bbbbbb"]


def test_the_ticks_load_reads_again_a_chain_changed_since_even_by_hand(world: World) -> None:
    """The tick keeps the chains it decoded and reads again only those whose row or segments
    changed (counted by triggers): a change by chainrun, or by another program, is seen."""
    first, second = world.add(), world.add()
    world.tick()
    kept = world.store.chains(active_only=True)
    assert world.store.chains(active_only=True) == kept  # unchanged: the same chains
    with raw(world.store.home) as db:
        db.execute("UPDATE chains SET reason = 'by hand' WHERE id = ?", (first,))
        db.execute("UPDATE segments SET reason = 'by hand too' WHERE chain_id = ?", (second,))
    by_id = {c.id: c for c in world.store.chains(active_only=True)}
    assert by_id[first].reason == "by hand" and by_id[second].segments[0].reason == "by hand too"
    world.store.record(first, [Track(1, Phase.RUNNING, "", 5.0, None)], None, [], 5.0)
    (again,) = [c for c in world.store.chains(active_only=True) if c.id == first]
    assert again.segments[0].phase is Phase.RUNNING
    world.store.request_cancel(second, 6.0)
    assert [c.cancel_requested for c in world.store.chains(active_only=True)] == [False, True]
    world.store.db.execute("UPDATE chains SET reason = 'through its own connection' WHERE id = ?", (second,))
    by_id = {c.id: c for c in world.store.chains(active_only=True)}
    assert by_id[second].reason == "through its own connection"


def test_the_ticks_load_reads_nothing_when_nothing_was_written(world: World) -> None:
    """Nothing written since the last load, by any connection: the load runs one statement
    (SQLite's data_version) and gives the very chains of that load; a write by another
    program is seen at the next load."""
    first = world.add()
    world.tick()
    statements: list[str] = []
    world.store.db.set_trace_callback(statements.append)  # (handing out the connection: load anew)
    try:
        kept = world.store.chains(active_only=True)
        statements.clear()
        again = world.store.chains(active_only=True)
        assert [c is k for c, k in zip(again, kept)] == [True]
        assert statements == ["PRAGMA data_version"], statements
        with raw(world.store.home) as db:
            db.execute("UPDATE chains SET reason = 'by hand' WHERE id = ?", (first,))
        assert world.store.chains(active_only=True)[0].reason == "by hand"
    finally:
        world.store.db.set_trace_callback(None)


def test_status_reads_only_the_chains_it_shows(world: World) -> None:
    """Active chains and those ended after the cut-off, with the damaged ones among them apart;
    an ended chain older than that is never read (its damaged row goes unnoticed until --all)."""
    old, recent, active, broken = (world.add() for _ in range(4))
    for chain_id, at in ((old, 100.0), (recent, 5000.0)):
        world.store.record(chain_id, [Finish(ChainState.COMPLETED, "done")], None, [], at)
    with raw(world.store.home) as db:
        db.execute("UPDATE chains SET spec = 'garbled' WHERE id IN (?, ?)", (old, broken))
    shown, damaged = world.store.shown(1000.0)
    assert [c.id for c in shown] == [recent, active] and [d.id for d in damaged] == [broken]
    shown, damaged = world.store.shown(None)
    assert [c.id for c in shown] == [recent, active] and [d.id for d in damaged] == [old, broken]


def chains(home: Path, *names: str) -> list[str]:
    """Chains added straight to the store (nothing submitted anywhere), oldest first; their ids."""
    store = Store(home)
    try:
        return [
            store.add_chain(replace(SPEC, name=name), NO_PROGRESS, float(i)).id
            for i, name in enumerate(names)
        ]
    finally:
        store.close()


def raw(home: Path) -> sqlite3.Connection:
    """The database as another program sees it."""
    return sqlite3.connect(home / "chainrun.db", isolation_level=None)


def one_line_error(result: subprocess.CompletedProcess[str], code: int) -> str:
    """The command failed with ``code`` and said why in one line, no traceback; that line."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("chainrun: "), result.stderr
    return lines[0]


# -- the wrong chain: references are literal ----------------------------------------


def test_a_reference_is_an_exact_id_a_unique_literal_prefix_or_an_exact_name(tmp_path: Path) -> None:
    """No pattern characters, no case folding: `a_c` is not `abc`, `%`, `_` and "" match nothing."""
    home = tmp_path / "home"
    (abc,) = chains(home, "abc")
    store = Store(home)
    assert store.find(abc).id == abc
    assert store.find(abc[:5]).id == abc  # a unique prefix
    assert store.find("abc").id == abc  # the name
    for ref in ("a_c", "%", "_", "abc%", "a%", "ABC", abc.upper(), "bc", "\udcff"):
        with pytest.raises(UsageError, match="no chain"):
            store.find(ref)
    with pytest.raises(UsageError, match="no chain given"):
        store.find("")


def test_a_name_is_the_newest_chain_of_that_name_and_a_shared_prefix_is_ambiguous(tmp_path: Path) -> None:
    home = tmp_path / "home"
    first, other, second = chains(home, "abc", "abd", "abc")
    store = Store(home)
    assert store.find("abc").id == second
    assert store.find(first).id == first
    with pytest.raises(UsageError, match=r"'ab' starts the ids of several chains .*give more of the id"):
        store.find("ab")
    assert store.find(other[:3]).id == other  # "abd" is a prefix of one id, and no name


def test_an_over_long_reference_is_one_usage_line(tmp_path: Path) -> None:
    """A 100k-character reference was a LIKE pattern too complex for SQLite: a traceback."""
    home = tmp_path / "home"
    chains(home, "abc")
    with pytest.raises(UsageError, match="at most 200 characters; this one has 100000") as info:
        Store(home).find("a" * 100_000)
    assert len(str(info.value)) < 200


def test_cancel_with_a_pattern_or_an_empty_reference_cancels_nothing(home: Path, chainrun: CLI) -> None:
    """`chainrun cancel a_c` cancelled abc-...; `%` and "" matched every chain."""
    ids = chains(home, "abc", "xyz")
    for ref in ("a_c", "%", "_", "", "ABC", "x" * 100_000):
        line = one_line_error(chainrun("cancel", ref), 2)
        assert "chain" in line and len(line) < 300
    store = Store(home)
    assert [c.state for c in store.chains()] == [ChainState.ACTIVE, ChainState.ACTIVE]
    assert [e.kind for e in store.events(ids[0])] == ["submitted"]


# -- a damaged row: that chain is set aside, the others go on ---------------------------

DAMAGE = {
    "bad JSON in spec": ("UPDATE chains SET spec = '{\"name\": ' WHERE id = ?", "spec is not valid JSON"),
    "spec not a job spec": ("UPDATE chains SET spec = '[1, 2]' WHERE id = ?", "spec is not a job spec"),
    "spec field of the wrong type": (
        "UPDATE chains SET spec = json_set(spec, '$.walltime', 'long') WHERE id = ?",
        "spec.walltime is 'long', not a whole number",
    ),
    "spec with a zero walltime": (
        "UPDATE chains SET spec = json_set(spec, '$.walltime', 0) WHERE id = ?",
        "spec.walltime is 0, not a positive number",
    ),
    "bad JSON in progress": (
        "UPDATE chains SET progress = 'epoch 7' WHERE id = ?",
        "progress is not valid JSON",
    ),
    "latest not an object": (
        "UPDATE chains SET latest = '[7]' WHERE id = ?",
        "latest is [7], not a JSON object",
    ),
    "unknown state": (
        "UPDATE chains SET state = 'paused' WHERE id = ?",
        "state is 'paused', not one of active, stuck, completed",
    ),
    "text for a number": ("UPDATE chains SET used = 'lots' WHERE id = ?", "used is 'lots', not a number"),
    "not UTF-8": ("UPDATE chains SET spec = CAST(x'7bff' AS TEXT) WHERE id = ?", "spec is not valid UTF-8"),
    "unknown phase": (
        "UPDATE segments SET phase = 'asleep' WHERE chain_id = ?",
        "segment 1: phase is 'asleep', not one of submitting, pending",
    ),
    "unknown outcome": (
        "UPDATE segments SET phase = 'ended', outcome = 'vanished' WHERE chain_id = ?",
        "segment 1: outcome is 'vanished', not one of completed",
    ),
}


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path / "home")
    yield w
    w.store.close()


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_row_that_cannot_be_read_sets_its_chain_aside_and_the_others_go_on(
    world: World, damage: str
) -> None:
    """It stopped every tick (and `status`): now the tick never sees it, `damaged()` says what
    could not be read, and the other chain runs as if nothing happened."""
    bad, good = world.add(), world.add()
    world.tick()  # both have segment 1 queued
    sql, problem = DAMAGE[damage]
    world.store.db.execute(sql, (bad,))
    assert [c.id for c in world.store.chains(active_only=True)] == [good]
    assert [c.id for c in world.store.chains()] == [good]
    (damaged,) = world.store.damaged()
    assert damaged.id == bad and problem in damaged.problem
    assert damaged.reason.startswith("damaged: " + damaged.problem)
    assert (
        "`chainrun cancel` cannot act on it" in damaged.reason
        and "remove it with: sqlite3 " in damaged.reason
    )
    with pytest.raises(StoreError, match=f"chain {bad} is damaged: "):
        world.store.find(bad)
    before = world.store.db.execute("SELECT * FROM chains WHERE id = ?", (bad,)).fetchall()
    for _ in range(3):
        world.tick()
    assert world.store.chain(good).segments[0].phase is Phase.PENDING
    world.cluster.start(world.store.chain(good).segments[0].job_id or "?")
    assert world.tick().state is ChainState.ACTIVE
    assert world.store.chain(good).segments[0].phase is Phase.RUNNING
    # The damaged chain is left exactly as it was: nothing lost, nothing run for it.
    assert world.store.db.execute("SELECT * FROM chains WHERE id = ?", (bad,)).fetchall() == before


def test_a_damaged_chain_names_the_jobs_it_may_have_left_and_its_removal_works(world: World) -> None:
    """The way out it prints is a command that removes that chain and nothing else."""
    bad, good = world.add(), world.add()
    world.tick()
    job = world.store.chain(bad).segments[0].job_id
    world.store.db.execute("UPDATE chains SET state = 'paused' WHERE id = ?", (bad,))
    (damaged,) = world.store.damaged()
    assert damaged.jobs == (job,) and f"its jobs {job} may still be queued or running" in damaged.reason
    if not have("sqlite3"):
        pytest.skip("the sqlite3 command-line shell is not installed here")
    subprocess.run(["bash", "-c", damaged.removal], check=True, capture_output=True)
    assert world.store.damaged() == []
    assert [c.id for c in world.store.chains()] == [good]


def test_an_id_that_is_not_text_is_shown_escaped_and_removed_by_row(world: World) -> None:
    bad = world.add()
    world.store.db.execute("UPDATE chains SET id = CAST(x'6162ff0a' AS TEXT) WHERE id = ?", (bad,))
    (damaged,) = world.store.damaged()
    assert damaged.id == repr("ab\ufffd\n") and damaged.problem == "id is not valid UTF-8"
    assert "WHERE rowid = 1" in damaged.removal
    if have("sqlite3"):
        subprocess.run(["bash", "-c", damaged.removal], check=True, capture_output=True)
        assert world.store.damaged() == []


# -- a damaged file: one line, and `sqlite3 FILE .recover` ----------------------------------


def garble(path: Path, offset: int, length: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes([0xA5]) * length)


def chains_page(home: Path) -> int:
    """The byte offset of the chains table's root page."""
    db = raw(home)
    size = db.execute("PRAGMA page_size").fetchone()[0]
    root = db.execute("SELECT rootpage FROM sqlite_master WHERE name = 'chains'").fetchone()[0]
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    return int((root - 1) * size)


def test_a_garbled_file_is_one_line_naming_it_and_the_recovery_at_open_or_at_a_later_query(
    home: Path, chainrun: CLI
) -> None:
    """`database disk image is malformed` was a traceback from a query; `file is not a database`
    at open said "move it aside and resubmit", which loses every chain."""
    chains(home, "abc")
    db = str(home / "chainrun.db")
    garble(home / "chainrun.db", chains_page(home), 8)  # its page header: a later query finds it
    store = Store(home)
    with pytest.raises(StoreError, match=r"is damaged \(database disk image is malformed\).*\.recover"):
        store.chains()
    store.close()
    for args in (("status",), ("history", "abc"), ("cancel", "abc")):
        line = one_line_error(chainrun(*args), 1)
        assert db in line and f"sqlite3 {db} .recover" in line and "resubmit" not in line
    garble(home / "chainrun.db", 0, 16)  # the header: found at open
    with pytest.raises(StoreError, match=r"is damaged \(file is not a database\).*\.recover"):
        Store(home)
    for args in (("status",), ("cancel", "abc")):
        line = one_line_error(chainrun(*args), 1)
        assert f"sqlite3 {db} .recover" in line and "resubmit" not in line


# -- read-only commands -------------------------------------------------------------


def test_status_history_and_logs_take_no_write_lock(home: Path, chainrun: CLI) -> None:
    """Opening the store ran the migrations in a write transaction: a writer holding the lock
    made `status` wait 10 s and fail. A reader never needs that lock."""
    (abc,) = chains(home, "abc")
    holder = raw(home)
    holder.execute("BEGIN IMMEDIATE")
    holder.execute("UPDATE chains SET reason = 'being written' WHERE id = ?", (abc,))
    try:
        out = chainrun("status", "--json", check=True).stdout
        assert [c["id"] for c in json.loads(out)] == [abc]
        assert "chain submitted" in chainrun("history", "abc", check=True).stdout
        assert chainrun("logs", abc, check=True).returncode == 0
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_a_reader_waits_on_an_exclusive_writer_about_a_second_then_says_busy(
    home: Path, chainrun: CLI
) -> None:
    """A connection in exclusive locking mode keeps even readers out: say so, soon, in one line."""
    chains(home, "abc")
    holder = raw(home)
    holder.execute("PRAGMA locking_mode = EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")
    holder.execute("UPDATE chains SET reason = 'x'")
    try:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match="is busy: another process is writing it; try again"):
            Store(home, readonly=True)
        assert time.monotonic() - started < 5
        line = one_line_error(chainrun("status"), 1)
        assert "busy" in line and "try again" in line and "not a usable" not in line
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_a_missing_database_is_no_chains_and_reading_creates_nothing(home: Path, chainrun: CLI) -> None:
    assert chainrun("status", check=True).stdout.startswith("no chains")
    assert json.loads(chainrun("status", "--json", check=True).stdout) == []
    assert "no chain 'abc'" in one_line_error(chainrun("history", "abc"), 2)
    assert "no chain 'abc'" in one_line_error(chainrun("logs", "abc"), 2)
    assert not home.exists()


def test_a_reader_leaves_an_older_database_as_it_is(tmp_path: Path) -> None:
    """It reads a version-1 database through an upgraded copy in memory; the upgrade itself
    is left to a chainrun that writes."""
    old_database(tmp_path / "home", 1).close()
    before = (tmp_path / "home" / "chainrun.db").read_bytes()
    store = Store(tmp_path / "home", readonly=True)
    assert store.find("cifar").progress.epoch == 7
    store.close()
    assert (tmp_path / "home" / "chainrun.db").read_bytes() == before


def test_opening_the_database_keeps_its_mode_and_a_new_one_is_private(tmp_path: Path) -> None:
    """Every open chmod-ed the database to 0600; now only a new one is made 0600 (whatever the umask)."""
    home = tmp_path / "home"
    old = os.umask(0)
    try:
        Store(home).close()
    finally:
        os.umask(old)
    assert stat.S_IMODE((home / "chainrun.db").stat().st_mode) == 0o600
    os.chmod(home / "chainrun.db", 0o640)
    Store(home).close()
    Store(home, readonly=True).close()
    assert stat.S_IMODE((home / "chainrun.db").stat().st_mode) == 0o640


# -- true messages: a lock, a read-only disk, a full disk ------------------------------------


def test_a_lock_held_elsewhere_is_named_at_open_migration_and_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(database_module, "BUSY_TIMEOUT", 0.2)
    home = tmp_path / "home"
    (abc,) = chains(home, "abc")
    holder = raw(home)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        store = Store(home)  # an up-to-date database: opening writes nothing
        assert store.find("abc").id == abc
        with pytest.raises(StoreUnavailable, match="is locked by another process") as info:
            store.request_cancel(abc, 1.0)
        assert "not a usable" not in str(info.value)
        store.close()
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    old_database(tmp_path / "old", 1).execute("BEGIN EXCLUSIVE")  # an upgrade needs the lock
    with pytest.raises(StoreUnavailable, match="is locked by another process"):
        Store(tmp_path / "old")


@pytest.fixture
def tmpfs(home: Path) -> Iterator[Callable[[str], None]]:
    """A small tmpfs mounted as CHAINRUN_HOME; the function remounts it with options ("ro")."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs (a read-only or full disk) needs root")
    home.mkdir(mode=0o700)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(home)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")

    def remount(options: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{options}", str(home)], check=True, capture_output=True)

    yield remount
    subprocess.run(["umount", "-l", str(home)], capture_output=True)


def fill(directory: Path) -> None:
    """Write a file until the disk holding ``directory`` is full."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, bytes(65536))
    except OSError:
        pass
    try:
        while True:
            os.write(fd, b"x")
    except OSError:
        pass
    os.close(fd)


def test_a_read_only_disk_is_read_and_a_write_names_it(
    home: Path, tmpfs: Callable[[str], None], chainrun: CLI
) -> None:
    """`status` could not open a WAL database there at all ("unable to open database file");
    now it reads it, and a command that must write says the filesystem is read-only."""
    (abc,) = chains(home, "abc")
    tmpfs("ro")
    out = chainrun("status", check=True).stdout
    assert abc in out and " active " in out
    assert "chain submitted" in chainrun("history", abc, check=True).stdout
    with pytest.raises(StoreUnavailable, match="is on a read-only filesystem; chainrun needs to write it"):
        Store(home)
    line = one_line_error(chainrun("cancel", abc), 1)
    assert "read-only filesystem" in line and "not a usable" not in line


def test_a_full_disk_is_read_and_a_write_names_it(
    home: Path, tmpfs: Callable[[str], None], chainrun: CLI
) -> None:
    """`status` could not open the database on a full disk (no room for its -shm); now it
    reads it. At open and at a write after a good open: "the disk ... is full", never
    "not a usable" nor a bare "disk I/O error"."""
    (abc,) = chains(home, "abc")
    fill(home)
    out = chainrun("status", check=True).stdout
    assert abc in out and " active " in out
    line = one_line_error(chainrun("cancel", abc), 1)
    assert "the disk holding" in line and "is full; free some space" in line and "not a usable" not in line
    (home / "filler").unlink()
    store = Store(home)  # opened while there is room
    fill(home)
    with pytest.raises(StoreUnavailable, match=r"the disk holding .* is full; free some space") as info:
        for i in range(1000):
            store.event(abc, None, "note", "x" * 4096 + str(i))
    assert "not a usable" not in str(info.value)
    store.close()


def test_a_state_directory_of_another_user_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    """CHAINRUN_HOME pointing at a neighbour's directory: one line, nothing read or written there."""
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root (CI runs as root)")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(UsageError, match="belongs to another user"):
        Store(theirs)
    assert list(theirs.iterdir()) == []


# -- what `status` shows of each chain, read without decoding the chains ---------------------


def varied(store: Store, now: float) -> dict[str, str]:
    """Chains as a table meets them: running with a successor queued, a submission being
    retried, a job held, a pool's chain waiting for a slot, a sweep's chain waiting for its
    turn, stuck, completed, exhausted, failed (one segment that ran, one cancelled while
    queued), cancelled, one ended long ago, and a chain resumed from a checkpoint. Their ids
    by what they are."""
    pool = replace(SPEC, scheduler=replace(SPEC.scheduler, hosts=("gpu1", "gpu2"), slots=1))
    sweep = replace(SPEC, name="lr-1a2b3c-r0", sweep_name="lr", params=(("lr", "0.1"),), max_concurrent=2)

    def add(spec: JobSpec = SPEC, progress: Progress = NO_PROGRESS, at: float = now - 7200) -> str:
        return store.add_chain(spec, progress, at).id

    def run(chain_id: str, n: int, job: str, after: Optional[str] = None, host: Optional[str] = None) -> None:
        store.journal_submit(chain_id, Submit(n, SPEC.walltime, after=after), now - 3600, host=host)
        store.record(chain_id, [Adopt(n, job, "submitted")], None, [], now - 3600)

    running = add(progress=Progress(epoch=20))
    run(running, 1, "11")
    store.record(running, [Track(1, Phase.RUNNING, "", now - 1800, None)], Progress(epoch=31), [], now)
    run(running, 2, "12", after="11")
    store.record(running, [Track(2, Phase.PENDING, "Dependency", None, None)], None, [], now)
    retrying = add()
    store.journal_submit(retrying, Submit(1, SPEC.walltime), now - 60)
    store.record(retrying, [RetryLater(1, now + 40, "sbatch: timed out")], None, [], now - 60)
    held = add()
    run(held, 1, "21")
    store.record(held, [Track(1, Phase.PENDING, "JobHeldUser", None, None)], None, [], now)
    waiting = add(pool)
    store.record(waiting, [Wait("waiting for a free slot on gpu1, gpu2")], None, [], now)
    placed = add(pool)
    run(placed, 1, "31", host="gpu2")
    add(sweep)
    stuck = add()
    run(stuck, 1, "41")
    store.record(stuck, [MarkStuck("ticks keep failing: disk full")], None, [], now)
    ends = (
        (ChainState.COMPLETED, Outcome.COMPLETED, False, now - 600),
        (ChainState.EXHAUSTED, Outcome.TIMEOUT, False, now - 500),
        (ChainState.FAILED, Outcome.FAILED, True, now - 400),
        (ChainState.CANCELLED, Outcome.CANCELLED, True, now - 300),
        (ChainState.COMPLETED, Outcome.COMPLETED, False, now - 5 * 86400),
    )
    ids = {"running": running, "retrying": retrying, "held": held, "waiting": waiting, "stuck": stuck}
    for i, (state, outcome, charged, at) in enumerate(ends):
        chain_id = ids[f"{state.value}{i}"] = add(at=at - 7200)
        run(chain_id, 1, str(50 + i))
        store.record(chain_id, [Track(1, Phase.RUNNING, "", at - 3000, None)], None, [], at - 3000)
        ended = EndSegment(
            1, outcome, 1 if charged else 0, charged, 3000, at, outcome.value, Progress(epoch=9)
        )
        actions: list[Action] = [ended]
        if state is ChainState.FAILED:  # its successor, queued behind it, was cancelled: it never ran
            store.journal_submit(chain_id, Submit(2, SPEC.walltime, after=str(50 + i)), at - 3000)
            actions += [Adopt(2, str(60 + i), "submitted"), Cancel(2, str(60 + i), "its predecessor failed")]
        store.record(chain_id, [*actions, Finish(state, f"{state.value} for a reason")], None, [], at)
    return ids


@pytest.mark.parametrize("damage", [None, *DAMAGE])
def test_the_status_table_reads_of_each_chain_what_a_full_read_gives(
    tmp_path: Path, damage: Optional[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`status` reads only the few columns its table shows (``glance``); for every kind of chain,
    and for a row damaged in each way a full read finds, that gives what reading each chain
    whole gives: the same values, the same damaged chains, and the same table. Only the
    damaged chains are read whole."""
    from chainrun import status as view

    now = 1_000_000.0
    store = Store(tmp_path / "home")
    ids = varied(store, now)
    if damage is not None:
        for chain_id in (ids["running"], ids["failed2"]):  # live segments; ended ones only
            store.db.execute(DAMAGE[damage][0], (chain_id,))
    read_whole: list[str] = []
    read = store._read
    for since in (None, now - 86400):
        full, damaged = store.shown(since)
        with monkeypatch.context() as patch:
            patch.setattr(store, "_read", lambda row, segs: read_whole.append(row["id"]) or read(row, segs))
            glances, glanced_damaged = store.glance(since)
        assert glances == [Glance.of(c) for c in full]
        assert glanced_damaged == damaged
        assert len(damaged) == (0 if damage is None else 2)
        for width in (80, 200):
            drawn = view.frame(tmp_path, glances, now, glanced_damaged, width=width)
            assert drawn == view.frame(tmp_path, full, now, damaged, width=width)
    assert len(read_whole) == (0 if damage is None else 4)  # twice each: with and without the cut-off
    assert len(store.glance(None)[0]) == 12 - len(damaged)
    assert len(store.glance(now - 86400)[0]) == 11 - len(damaged)
    store.close()


def test_a_cancel_records_the_job_of_a_segment_whose_submission_was_never_recorded(tmp_path: Path) -> None:
    """A service killed mid-submission leaves the segment 'submitting' with no job id; if the
    chain ends in the next one's first tick, the segment's job (found under its tag) is cancelled,
    and its record keeps that job, not nothing (seen under load in the contract test)."""
    store = Store(tmp_path / "home")
    chain = store.add_chain(SPEC, NO_PROGRESS, 1.0)
    store.journal_submit(chain.id, Submit(1, SPEC.walltime), 2.0)
    store.record(chain.id, [Cancel(n=1, job_id="3", reason="chain completed")], None, [], 3.0)
    (seg,) = store.chain(chain.id).segments
    assert (seg.job_id, seg.phase, seg.outcome) == ("3", Phase.ENDED, Outcome.CANCELLED)
    store.close()
