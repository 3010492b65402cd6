"""Faults a real machine has, on the local runner through the real CLI, service and store:
each test here reproduced a fault that failed or duplicated a healthy chain."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any, Callable, Optional

from conftest import wait_for

from chainrun import jobfile
from chainrun.engine import STUCK_AFTER, Engine
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
    for d in sorted((home / "local" / "jobs").glob("*")):
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


def test_segments_that_ended_while_the_service_was_away_are_each_credited_their_progress(
    tmp_path: Path, chainrun: CLI, service: Service, home: Path
) -> None:
    """The service stops for longer than a walltime: segment 1 and its queued successor both
    train and end while it is away. Back, it charges neither (it charged the second 'no
    progress', since the progress since the last tick was credited to the first)."""
    work = tmp_path / "work"
    path = write_job(
        work,
        "away",
        "python3 trainer.py --epochs 40 --epoch-time 1",
        "5s",
        "target_epoch = 40\nmax_failures = 1\n",
    )
    chain_id = chainrun("submit", str(path), check=True).stdout.strip()
    proc = service(0.3)
    wait_for(
        lambda: sum(1 for s in status(chainrun, chain_id)["segments"] if s["job_id"]) >= 2,
        60,
        "segment 2 queued ahead",
    )
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    wait_for(
        lambda: [bool(j["end"]) for j in local_jobs(home)][:2] == [True, True],
        90,
        "both segments to end while the service is away",
    )
    service(0.3)
    wait_for(
        lambda: [s["phase"] for s in status(chainrun, chain_id)["segments"][:2]] == ["ended", "ended"],
        60,
        "the service to judge both segments",
    )
    st = status(chainrun, chain_id)
    assert [s["charged"] for s in st["segments"][:2]] == [False, False], st["segments"]
    assert st["failures"] == 0
    chainrun("cancel", chain_id, check=True)


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
