"""The SQLite store: schema versions and what a chain remembers (real SQLite, no service)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from chainrun.errors import StoreError
from chainrun.model import NO_PROGRESS, ChainState, JobSpec, Progress
from chainrun.store import MIGRATIONS, SCHEMA_VERSION, Store

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
