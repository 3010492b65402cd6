"""A chain runs in the environment of the shell that submitted it, not the service's: the service
is started as systemd starts it, with a bare environment, and the job still finds `python`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import wait_for

CLI = Callable[..., "subprocess.CompletedProcess[str]"]
VENV_BIN = os.path.dirname(sys.executable)
DAEMON = ["-m", "chainrun", "daemon", "--interval", "0.3"]


@pytest.fixture
def bare_service(home: Path, tmp_path: Path) -> Iterator[Callable[[], subprocess.Popen[bytes]]]:
    """`chainrun daemon` as a systemd user unit starts it: `env -i PATH=/usr/bin:/bin HOME=...`."""
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "CHAINRUN_HOME": str(home)}
        with open(tmp_path / f"bare-daemon-{len(procs)}.log", "wb") as log:
            proc = subprocess.Popen(
                ["env", "-i", *(f"{k}={v}" for k, v in env.items()), sys.executable, *DAEMON],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def write_job(work: Path, extra: str = "") -> Path:
    work.mkdir(exist_ok=True)
    path = work / "job.toml"
    path.write_text(
        'name = "venv"\ncommand = "python -c \'import sys; print(sys.prefix)\' > prefix.txt"\n'
        f'total_time = "5m"\nwalltime = "1m"\ngrace = "2s"\n{extra}'
    )
    return path


def status(chainrun: CLI, ref: str) -> dict[str, Any]:
    return json.loads(chainrun("status", ref, "--json", check=True).stdout)[0]  # type: ignore[no-any-return]


def test_the_submitting_shells_virtualenv_travels_with_the_chain(
    tmp_path: Path, chainrun: CLI, bare_service: Callable[[], subprocess.Popen[bytes]]
) -> None:
    """`python` exists only in the virtualenv that submitted: the job finds it (it got exit 127
    and burned the whole failure budget); `check` says which variables it takes along."""
    assert not os.path.exists("/usr/bin/python") and os.path.exists(os.path.join(VENV_BIN, "python"))
    path = write_job(tmp_path / "work")
    check = chainrun("check", str(path), check=True).stdout
    assert "PATH" in check and "from this shell" in check
    chain_id = chainrun("submit", str(path), check=True).stdout.strip()
    bare_service()
    wait_for(lambda: status(chainrun, chain_id)["state"] != "active", 120, "the chain to end")
    st = status(chainrun, chain_id)
    assert (st["state"], st["failures"]) == ("completed", 0), st["reason"]
    assert (tmp_path / "work" / "prefix.txt").read_text().strip() == sys.prefix


def test_without_inheriting_a_missing_command_ends_the_chain_at_once_saying_why(
    tmp_path: Path, chainrun: CLI, bare_service: Callable[[], subprocess.Popen[bytes]]
) -> None:
    """inherit_env = []: the job gets the service's bare PATH, `python` is not found (127), and the
    chain fails at once with one failure charged and the PATH it was looked up in."""
    path = write_job(tmp_path / "work", "inherit_env = []\nmax_failures = 3\n")
    chain_id = chainrun("submit", str(path), check=True).stdout.strip()
    bare_service()
    wait_for(lambda: status(chainrun, chain_id)["state"] != "active", 120, "the chain to end")
    st = status(chainrun, chain_id)
    assert (st["state"], st["failures"]) == ("failed", 1), st
    assert st["reason"].startswith("command not found or not executable (exit 127)"), st["reason"]
    assert "PATH was /usr/bin:/bin" in st["reason"]
    # The successor queued behind it may have started and failed alike before the service looked:
    # it is recorded, not charged.
    ran = [(s["outcome"], s["charged"]) for s in st["segments"] if s["outcome"] != "cancelled"]
    assert ran[0] == ("failed", True) and all(r == ("failed", False) for r in ran[1:]), ran
