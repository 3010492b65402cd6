"""Local-runner chains through the real CLI, service and store, beyond the shared contract
(tests/test_contract.py runs the contract on the local runner as on Slurm and SGE)."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from chainrun.localrunner import machine_dir

TRAINER = Path(__file__).parent / "data" / "trainer.py"
CLI = Callable[..., "subprocess.CompletedProcess[str]"]


def job(
    tmp_path: Path,
    mode: str = "ok",
    epochs: int = 6,
    walltime: str = "4s",
    grace: str = "1s",
    max_failures: int = 2,
    total: str = "2m",
    name: str = "t",
    extra: str = "",
) -> Path:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    shutil.copy(TRAINER, work / "trainer.py")
    path = work / "job.toml"
    path.write_text(
        f'name = "{name}"\n'
        f'command = "python3 trainer.py --mode {mode} --epochs {epochs} --epoch-time 1"\n'
        f'total_time = "{total}"\nwalltime = "{walltime}"\ngrace = "{grace}"\n'
        f"target_epoch = {epochs}\nmax_failures = {max_failures}\n{extra}"
    )
    return path


def command_job(tmp_path: Path, command: str, fields: str) -> Path:
    """A job file named "t" in ``tmp_path/work`` that runs ``command``, with ``fields`` (TOML) added."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    path = work / "job.toml"
    path.write_text(f'name = "t"\ncommand = {json.dumps(command)}\n{fields}')
    return path


def status(chainrun: CLI, ref: str) -> dict:  # type: ignore[type-arg]
    out = chainrun("status", ref, "--json", check=True).stdout
    return json.loads(out)[0]  # type: ignore[no-any-return]


def local_jobs(home: Path) -> list[dict]:  # type: ignore[type-arg]
    jobs = machine_dir(home / "local") / "jobs"
    return [json.loads((d / "job.json").read_text()) for d in jobs.iterdir()] if jobs.exists() else []


def started_segments(work: Path) -> list[Path]:
    return sorted(work.glob(".chainrun/*/seg-*.start"))


@pytest.mark.slow
def test_script_that_never_advances_stops_with_no_progress(tmp_path: Path, chainrun: CLI) -> None:
    """Running but never saving spends the budget with reason 'no progress'."""
    path = job(tmp_path, mode="stall", walltime="3s", max_failures=1)
    result = chainrun("run", str(path), "--interval", "0.3")
    assert result.returncode == 1
    st = status(chainrun, "t")
    assert st["state"] == "failed"
    assert "no progress" in st["reason"] and "failure budget spent" in st["reason"]
    assert [s["outcome"] for s in st["segments"]] == ["timeout", "timeout"]


@pytest.mark.slow
def test_corrupt_sidecar_is_no_progress_and_never_crashes_the_service(tmp_path: Path, chainrun: CLI) -> None:
    """A half-written sidecar counts as no new progress; the service keeps going."""
    # Long enough that the half-written sidecar is written (a second in) and read by the service
    # (every 0.3 s) before the signal, on a machine as busy as CI's.
    path = job(tmp_path, mode="corrupt", walltime="8s", max_failures=1)
    result = chainrun("run", str(path), "--interval", "0.3")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "progress sidecar unreadable" in result.stderr
    st = status(chainrun, "t")
    assert "no progress" in st["reason"]


def test_cancel_without_a_service_cancels_jobs_at_once(tmp_path: Path, chainrun: CLI, home: Path) -> None:
    """`chainrun cancel` with no service running carries the cancel out itself."""
    path = job(tmp_path, epochs=50, walltime="30s", total="5m")
    chain_id = chainrun("submit", str(path), check=True).stdout.strip()
    db = sqlite3.connect(home / "chainrun.db")
    assert db.execute("select count(*) from segments").fetchone()[0] == 0
    result = chainrun("cancel", chain_id, check=True)
    assert "cancelled" in result.stdout
    st = status(chainrun, chain_id)
    assert st["state"] == "cancelled"


def test_status_with_no_chains_says_how_to_start(chainrun: CLI) -> None:
    """An empty status tells the user what to do."""
    assert "submit one" in chainrun("status", check=True).stdout


@pytest.mark.parametrize("args", [["status", "nosuch"], ["history", "nosuch"], ["cancel", "nosuch"]])
def test_unknown_chain_is_one_line_exit_2(chainrun: CLI, args: list[str]) -> None:
    """Naming a chain that does not exist is a one-line error, exit 2."""
    result = chainrun(*args)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "no chain 'nosuch'" in result.stderr


def test_bad_job_file_is_one_line_exit_2_and_stores_nothing(
    tmp_path: Path, chainrun: CLI, home: Path
) -> None:
    """A malformed job file is refused by check, submit and run alike, without a traceback."""
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\ncommand = "true"\ntotal_time = "1h"\nwalltime = "2h"\n')
    for cmd in ("check", "submit", "run"):
        result = chainrun(cmd, str(bad))
        assert result.returncode == 2, cmd
        assert "walltime = '2h': longer than total_time" in result.stderr
        assert "Traceback" not in result.stderr
    assert (
        not (home / "chainrun.db").exists()
        or sqlite3.connect(home / "chainrun.db").execute("select count(*) from chains").fetchone()[0] == 0
    )


def test_what_the_backend_refuses_is_caught_by_check_and_submit_before_any_state(
    tmp_path: Path, chainrun: CLI, home: Path
) -> None:
    """An SGE workdir holding ',' (SGE would split its -o path): check and submit refuse it in one
    line, with no scheduler reached and no chain stored."""
    work = tmp_path / "runs,v2"
    work.mkdir()
    path = work / "job.toml"
    path.write_text(
        'name = "x"\ncommand = "true"\ntotal_time = "2h"\nwalltime = "1h"\n[scheduler]\nkind = "sge"\n'
    )
    for cmd in ("check", "submit"):
        result = chainrun(cmd, str(path))
        assert result.returncode == 2, cmd
        assert "SGE splits -o paths at ','" in result.stderr and "Traceback" not in result.stderr
        assert result.stderr.strip().count("\n") == 0
    assert (
        not (home / "chainrun.db").exists()
        or sqlite3.connect(home / "chainrun.db").execute("select count(*) from chains").fetchone()[0] == 0
    )


def test_state_directory_open_to_others_is_refused_never_chmodded(tmp_path: Path) -> None:
    """CHAINRUN_HOME set to a shared directory by mistake: a one-line refusal, the directory untouched."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    env = dict(os.environ, CHAINRUN_HOME=str(shared))
    result = subprocess.run(
        [sys.executable, "-m", "chainrun", "status"], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode != 0
    assert "is open to other users" in result.stderr and "Traceback" not in result.stderr
    assert shared.stat().st_mode & 0o777 == 0o755 and list(shared.iterdir()) == []


@pytest.mark.slow
def test_a_failed_chain_keeps_the_last_lines_of_the_failing_segments_output(
    tmp_path: Path, chainrun: CLI, home: Path
) -> None:
    """Wrapper, end marker, engine, store: the chain's failing segment carries its output's
    tail, so the failure explains itself without a second command."""
    from chainrun.store import Store

    path = command_job(
        tmp_path,
        "for i in 1 2 3 4 5 6; do echo step $i; done; echo bad input >&2; exit 3",
        'total_time = "1m"\nwalltime = "10s"\ngrace = "1s"\nmax_failures = 0\n',
    )
    assert chainrun("run", str(path), "--interval", "0.3").returncode == 1
    store = Store(home, readonly=True)
    try:
        (chain,) = store.chains()
    finally:
        store.close()
    assert chain.failing is not None and chain.failing.exit_code == 3
    assert chain.failing.tail == ("step 3", "step 4", "step 5", "step 6", "bad input")


@pytest.mark.slow
def test_a_missing_file_fails_the_chain_after_two_segments_not_the_whole_budget(
    tmp_path: Path, chainrun: CLI
) -> None:
    """A script that cannot open its input fails twice alike before any progress: the chain
    ends FAILED after two segments (max_failures = 3 would allow four runs), and says why with
    Python's own line."""
    path = command_job(
        tmp_path, "python reads.py", 'total_time = "5m"\nwalltime = "10s"\ngrace = "2s"\nmax_failures = 3\n'
    )
    work = path.parent
    (work / "reads.py").write_text("open('missing.py')\n")
    result = chainrun("run", str(path), "--interval", "0.3")
    assert result.returncode == 1, result.stdout + result.stderr
    st = status(chainrun, "t")
    assert st["state"] == "failed"
    assert st["reason"].startswith("segment 2 failed (exit 1) as segment 1 did"), st["reason"]
    assert "FileNotFoundError: [Errno 2] No such file or directory: 'missing.py'" in st["reason"]
    assert [(s["n"], s["outcome"], s["exit_code"]) for s in st["segments"]] == [
        (1, "failed", 1),
        (2, "failed", 1),
    ]
    assert len(started_segments(work)) == 2
    shown = " ".join(chainrun("status", st["id"], check=True).stdout.split())  # as wrapped to the terminal
    assert "reason: segment 2 failed (exit 1) as segment 1 did" in shown
    assert "No such file or directory" in shown


@pytest.mark.slow
def test_a_segment_the_walltime_signal_killed_while_starting_names_the_docs_paragraph(
    tmp_path: Path, chainrun: CLI
) -> None:
    """A script still "importing" (sleeping, no handler set) when SIGUSR1 comes dies of it: the
    chain's reason names that likely cause and the docs paragraph on making the clock first."""
    path = command_job(
        tmp_path,
        "python3 -c 'import time; time.sleep(60)'",
        'total_time = "1m"\nwalltime = "4s"\ngrace = "2s"\nmax_failures = 0\n',
    )
    assert chainrun("run", str(path), "--interval", "0.3").returncode == 1
    st = status(chainrun, "t")
    assert st["state"] == "failed"
    assert [(s["outcome"], s["exit_code"]) for s in st["segments"]] == [("timeout", 138)]
    assert "SIGUSR1 killed the command before it saved anything" in st["reason"], st["reason"]
    assert st["reason"].endswith('see docs/resuming.md "Make the clock first when the start is slow"')
