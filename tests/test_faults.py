"""Faults a real machine has, on the local runner through the real CLI, service and store:
each test here reproduced a fault that failed or duplicated a healthy chain."""

from __future__ import annotations

import json
import os
import random
import shutil
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
from conftest import wait_for

from chainrun import jobfile
from chainrun.decide.retry import STUCK_AFTER
from chainrun.engine import Engine
from chainrun.localrunner import machine_dir
from chainrun.model import NO_PROGRESS, ChainState, Phase
from chainrun.store import Store
from chainrun.transport import FileInfo, LocalTransport

TRAINER = Path(__file__).parent / "data" / "trainer.py"
CLI = Callable[..., "subprocess.CompletedProcess[str]"]
Service = Callable[..., "subprocess.Popen[bytes]"]


def write_job(work: Path, name: str, command: str, walltime: str, extra: str = "") -> Path:
    work.mkdir(parents=True, exist_ok=True)
    shutil.copy(TRAINER, work / "trainer.py")
    path = work / f"{name}.toml"
    path.write_text(
        f'name = "{name}"\ncommand = "{command}"\ntotal_time = "5m"\nwalltime = "{walltime}"\n'
        f'grace = "1s"\n{extra}'
    )
    return path


def status(chainrun: CLI, ref: str) -> dict[str, Any]:
    return json.loads(chainrun("status", ref, "--json", check=True).stdout)[0]  # type: ignore[no-any-return]


def local_jobs(home: Path) -> list[dict[str, Any]]:
    """The local runner's jobs, each with its end record (or None while it runs)."""
    jobs = []
    for d in sorted((machine_dir(home / "local") / "jobs").glob("*")):
        if (d / "job.json").exists():
            job = json.loads((d / "job.json").read_text())
            end = d / "end.json"
            job["end"] = json.loads(end.read_text()) if end.exists() else None
            jobs.append(job)
    return jobs


def test_without_target_a_command_that_finished_on_its_own_never_runs_again(
    tmp_path: Path, chainrun: CLI, service: Service, home: Path
) -> None:
    """No target_epoch: segment 1 exits 0 before its walltime, so the chain is complete. Its
    successor, queued ahead, starts the moment it ends, before a slow service notices: it must
    not run the command again (it did in 12 of 14 chains)."""
    work = tmp_path / "work"
    path = write_job(work, "once", "echo run >> runs.txt; sleep 4", "1m")
    chain_id = chainrun("submit", str(path), check=True).stdout.strip()
    service(3.0)  # a tick every 3 s: the successor starts long before the service sees the end
    wait_for(lambda: len(local_jobs(home)) >= 2, 60, "a successor queued ahead")
    wait_for(lambda: status(chainrun, chain_id)["state"] == "completed", 120, "the chain to complete")
    wait_for(lambda: all(j["end"] for j in local_jobs(home)), 60, "every job to end")
    assert (work / "runs.txt").read_text() == "run\n"
    st = status(chainrun, chain_id)
    assert st["failures"] == 0 and "exited 0 before its walltime" in st["reason"]


def test_a_workdir_moved_away_mid_chain_ends_it_and_is_never_made_again(
    tmp_path: Path, chainrun: CLI, service: Service, home: Path
) -> None:
    """The workdir is moved away (a scratch purge, a user's mv) while a segment runs: the chain
    fails saying so, and chainrun never makes the workdir again. It did, with `mkdir -p`, and
    the next segments ran in that empty directory, each charged, until the budget was spent."""
    work = tmp_path / "work"
    path = write_job(
        work,
        "moved",
        "python3 trainer.py --epochs 100 --epoch-time 1",
        "5s",
        "target_epoch = 100\nmax_failures = 4\n",
    )
    chain_id = chainrun("submit", str(path), check=True).stdout.strip()
    service(0.5)
    wait_for(lambda: (work / "checkpoints" / "chainrun-progress.json").exists(), 120, "a first epoch")
    work.rename(tmp_path / "moved away")
    wait_for(lambda: status(chainrun, chain_id)["state"] != "active", 120, "the chain to end")
    st = status(chainrun, chain_id)
    assert st["state"] == "failed" and f"workdir {work} is gone" in st["reason"], st
    assert not work.exists()
    segs = st["segments"]
    assert segs[-1]["outcome"] == "rejected" and segs[-1]["job_id"] is None, segs
    # Charged at most: the segment running at the move (its checkpoint directory went), and
    # the one queued ahead, which could not start and says so. None ran in an empty directory.
    assert st["failures"] <= 2, segs
    assert not [s for s in segs if "can't open file" in "".join(s["tail"])], segs
    unstarted = [s for s in segs if "could not start" in (s["reason"] or "")]
    assert all("No such file or directory" in s["reason"] for s in unstarted), unstarted
    wait_for(lambda: all(j["end"] for j in local_jobs(home)), 60, "every job to end")


def test_a_fifo_planted_as_one_chains_sidecar_never_freezes_the_others(
    tmp_path: Path, chainrun: CLI, service: Service, home: Path
) -> None:
    """A FIFO as chain A's progress sidecar: reading it blocked the tick, and every chain with it.
    Now it is 'no new progress' for A, and B runs to completion beside it."""
    trap = write_job(tmp_path / "a", "trap", "sleep 60", "2m")
    quick = write_job(
        tmp_path / "b", "quick", "python3 trainer.py --epochs 2 --epoch-time 0.5", "1m", "target_epoch = 2\n"
    )
    a = chainrun("submit", str(trap), check=True).stdout.strip()
    b = chainrun("submit", str(quick), check=True).stdout.strip()
    fifo = tmp_path / "a" / "checkpoints" / "chainrun-progress.json"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    service(0.3)
    wait_for(lambda: status(chainrun, b)["state"] == "completed", 120, "chain B to complete")
    assert status(chainrun, a)["state"] == "active"
    wait_for(lambda: status(chainrun, a)["segments"][0]["phase"] == "running", 60, "A to be ticked too")
    again = chainrun("submit", str(trap), timeout=60)  # reading it at submit never blocks either
    assert again.returncode == 0
    for chain_id in (a, again.stdout.strip()):
        chainrun("cancel", chain_id, check=True)


class _Breaks(LocalTransport):
    """This machine, except that looking at anything under ``broken`` raises (a bug, say)."""

    def __init__(self, broken: Path) -> None:
        self.broken = str(broken)

    def _check(self, path: str) -> None:
        if path.startswith(self.broken):
            raise RuntimeError(f"cannot make sense of {path}")

    def read_file(self, path: str, limit: Optional[int] = None) -> Optional[bytes]:
        self._check(path)
        return super().read_file(path, limit)

    def listdir(self, path: str) -> Optional[list[FileInfo]]:
        self._check(path)
        return super().listdir(path)

    def stat(self, path: str) -> Optional[FileInfo]:
        self._check(path)
        return super().stat(path)


def test_one_chain_whose_tick_raises_never_stops_the_others(tmp_path: Path, home: Path) -> None:
    """A chain whose tick raises is retried, and marked stuck after STUCK_AFTER ticks in a row,
    with the error in its reason; the chain after it moves on every tick (it never moved)."""
    bad = write_job(tmp_path / "bad", "bad", "sleep 60", "1m")
    good = write_job(tmp_path / "good", "good", "sleep 60", "1m")
    store = Store(home)
    try:
        first = store.add_chain(jobfile.load(str(bad)), NO_PROGRESS, 0.0)
        second = store.add_chain(jobfile.load(str(good)), NO_PROGRESS, 1.0)
        engine = Engine(store, transports=lambda host: _Breaks(tmp_path / "bad"))
        for _ in range(STUCK_AFTER):
            summary = engine.tick()
            assert any(first.id in e for e in summary.errors)
        moved = store.chain(second.id)
        assert [(s.n, s.phase is not Phase.SUBMITTING) for s in moved.segments][:1] == [(1, True)]
        stuck = store.chain(first.id)
        assert stuck.state is ChainState.STUCK
        assert "RuntimeError: cannot make sense of" in stuck.reason and str(STUCK_AFTER) in stuck.reason
        store.request_cancel(second.id, 2.0)
        store.request_cancel(first.id, 2.0)
        engine.stuck_until.clear()
        engine.tick()  # the good chain's jobs are cancelled; the bad one stays stuck
        assert store.chain(second.id).state is ChainState.CANCELLED
    finally:
        store.close()


def _fill(directory: Path) -> Path:
    """Fill the filesystem holding ``directory`` to the last byte; returns the filler."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 20, 4096, 1):  # down to the last byte
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


@pytest.fixture
def small_home(home: Path) -> Iterator[Path]:
    """CHAINRUN_HOME on a 64 MiB tmpfs of its own, so a test can fill it (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root (CI runs as root)")
    home.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", str(home)], check=True)
    try:
        yield home
    finally:
        subprocess.run(["umount", "-l", str(home)], check=False)


@pytest.mark.slow
def test_a_storm_of_sigkills_with_a_full_disk_and_a_locked_database_costs_nothing(
    tmp_path: Path, chainrun: CLI, service: Service, small_home: Path
) -> None:
    """The service is SIGKILLed 30 times at random moments while three chains train, and
    restarted each time; once the disk holding its state fills up for a few seconds, once
    another process locks its database. Every chain completes, no failure is charged, no
    segment is lost, and no segment ever runs twice or beside another of its chain."""
    ids, works = [], []
    for i in range(3):
        work = tmp_path / f"w{i}"
        path = write_job(
            work,
            f"storm{i}",
            "python3 trainer.py --exclusive --epochs 50 --epoch-time 0.5",
            "4s",
            "target_epoch = 50\nmax_failures = 3\n",
        )
        ids.append(chainrun("submit", str(path), check=True).stdout.strip())
        works.append(work)
    rng = random.Random(20261126)
    for kill in range(30):
        proc = service(0.3)
        if kill == 8:  # the disk holding CHAINRUN_HOME is full for a while
            filler = _fill(small_home)
            time.sleep(3)
            filler.unlink()
        elif kill == 16:  # another process holds the database's write lock for a while
            db = sqlite3.connect(small_home / "chainrun.db", timeout=30, isolation_level=None)
            db.execute("BEGIN EXCLUSIVE")
            time.sleep(3)
            db.execute("ROLLBACK")
            db.close()
        time.sleep(rng.uniform(0.1, 2.5))  # the moment of the kill is the point: random
        proc.kill()
        proc.wait()
    service(0.3)
    for chain_id in ids:
        wait_for(lambda c=chain_id: status(chainrun, c)["state"] != "active", 300, f"{chain_id} to end")
    for chain_id in ids:
        st = status(chainrun, chain_id)
        told = [(s["n"], s["outcome"], s["charged"], s["reason"]) for s in st["segments"]]
        assert (st["state"], st["failures"]) == ("completed", 0), told
        assert not [s for s in st["segments"] if s["outcome"] == "lost"], told
        assert len(st["segments"]) >= 3, "the storm hit a chain that barely ran"
    for work in works:
        assert not (work / "overlaps.log").exists(), (work / "overlaps.log").read_text()
    started: dict[str, int] = {}
    for job in local_jobs(small_home):
        if (machine_dir(small_home / "local") / "jobs" / str(job["id"]) / "start.json").exists():
            started[job["name"]] = started.get(job["name"], 0) + 1
    assert started and max(started.values()) == 1, started
