"""What chainrun runs from a shared workdir is its user's alone: a hostile neighbour's
`.chainrun` is refused, and what chainrun creates is private whatever the umask."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Callable

import pytest
from conftest import wait_for

from chainrun import jobfile
from chainrun.engine import Engine
from chainrun.model import NO_PROGRESS, ChainState, Outcome
from chainrun.store import Store

CLI = Callable[..., "subprocess.CompletedProcess[str]"]
NOBODY = 65534


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    """A scratch directory everyone may write in, sticky, like /tmp or a group's scratch."""
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root (CI runs as root)")
    path = tmp_path / "scratch"
    path.mkdir()
    path.chmod(0o1777)
    return path


def job_file(work: Path, command: str = "touch trained; sleep 30") -> Path:
    path = work / "job.toml"
    path.write_text(f'name = "t"\ncommand = "{command}"\ntotal_time = "5m"\nwalltime = "1m"\ngrace = "2s"\n')
    return path


def chains_stored(home: Path) -> int:
    db = home / "chainrun.db"
    if not db.exists():
        return 0
    return int(sqlite3.connect(db).execute("select count(*) from chains").fetchone()[0])


@pytest.mark.parametrize("planted", ["other user", "writable by all", "symlink"])
def test_a_run_directory_someone_else_can_change_is_refused_at_check_and_submit(
    shared: Path, chainrun: CLI, home: Path, planted: str
) -> None:
    """A neighbour made `.chainrun` in the shared workdir first: check and submit refuse in one
    line naming it and the fix; nothing is stored, and it is left as it is."""
    run_dir = shared / ".chainrun"
    if planted == "symlink":
        (shared / "theirs").mkdir()
        run_dir.symlink_to(shared / "theirs")
    else:
        run_dir.mkdir()
        run_dir.chmod(0o777)
        if planted == "other user":
            os.chown(run_dir, NOBODY, NOBODY)
            run_dir.chmod(0o755)
    path = job_file(shared)
    for command in ("check", "submit"):
        result = chainrun(command, str(path))
        assert result.returncode == 2, result.stdout + result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and str(run_dir) in lines[0] and "will not run scripts from it" in lines[0]
    assert chains_stored(home) == 0
    assert run_dir.exists() or run_dir.is_symlink()


def test_a_script_planted_after_submission_never_runs(shared: Path, home: Path) -> None:
    """The chain is submitted while the workdir is clean; then a neighbour makes the chain's
    directory with their own seg-0001.sh in it. The service refuses to submit from it: the chain
    fails with that reason and the planted script never runs (it did: the service's user ran it)."""
    store = Store(home)
    try:
        chain = store.add_chain(jobfile.load(str(job_file(shared))), NO_PROGRESS, 0.0)
        theirs = shared / ".chainrun" / chain.id
        theirs.mkdir(parents=True)
        planted = theirs / "seg-0001.sh"
        planted.write_text(f"#!/bin/bash\ntouch {shared}/pwned\n")
        for path in (theirs.parent, theirs, planted):
            os.chown(path, NOBODY, NOBODY)
        (shared / ".chainrun").chmod(0o777)
        engine = Engine(store)
        engine.tick()
        engine.tick()
        after = store.chain(chain.id)
        assert after.state is ChainState.FAILED, after
        assert "will not run scripts from it" in after.reason and str(shared / ".chainrun") in after.reason
        assert after.segments[0].outcome is Outcome.REJECTED
        assert not (shared / "pwned").exists() and not (shared / "trained").exists()
        assert planted.read_text() == f"#!/bin/bash\ntouch {shared}/pwned\n"
    finally:
        store.close()


@pytest.fixture
def open_umask() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_what_chainrun_creates_is_private_whatever_the_umask(
    tmp_path: Path, home: Path, open_umask: None
) -> None:
    """Under umask 000 the run directory, the scripts, the markers and the checkpoint directory
    the wrapper makes are still the user's alone (0700 directories, no group or other access)."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(Path(__file__).parent / "data" / "trainer.py", work)
    store = Store(home)
    try:
        spec = jobfile.load(str(job_file(work, "python3 trainer.py --epochs 1 --epoch-time 0.1")))
        chain = store.add_chain(spec, NO_PROGRESS, 0.0)
        engine = Engine(store)
        engine.tick()
        run_dir = work / ".chainrun" / chain.id
        end = run_dir / "seg-0001.end"
        wait_for(end.exists, 120, "segment 1 to end")
        for path in (work / ".chainrun", run_dir, work / "checkpoints"):
            assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
        for path in (run_dir / "seg-0001.sh", run_dir / "seg-0001.start", end):
            assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, (path, oct(path.stat().st_mode))
        assert json.loads((work / "checkpoints" / "chainrun-progress.json").read_text())["epoch"] == 1
        store.request_cancel(chain.id, 1.0)
        engine.tick()
    finally:
        store.close()
