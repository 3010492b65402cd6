"""Chains run through the real CLI and service, for the benchmarks that time them
(``grace.py``, ``compute.py``): the environment of a private chainrun home, the CLI called,
and the service run until every chain has ended."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def environment(root: Path) -> dict[str, str]:
    """This process's environment with a chainrun home of its own under ``root`` and this
    checkout's chainrun first on the path."""
    env = dict(os.environ, CHAINRUN_HOME=str(root / "home"), PYTHONUNBUFFERED="1")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "chainrun", *args], env=env, capture_output=True, text=True, timeout=300
    )


def submit(env: dict[str, str], job_file: Path) -> None:
    """``chainrun submit``, or the benchmark ends with what it said."""
    done = cli(env, "submit", str(job_file))
    if done.returncode != 0:
        sys.exit(done.stdout + done.stderr)


@contextlib.contextmanager
def service(env: dict[str, str], interval: float = 1.0) -> Iterator[None]:
    """``chainrun daemon`` running, at ``interval`` seconds between its ticks."""
    daemon = subprocess.Popen(
        [sys.executable, "-m", "chainrun", "daemon", "--interval", f"{interval:g}"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield
    finally:
        daemon.terminate()
        daemon.wait()


def until_ended(env: dict[str, str]) -> list[dict[str, Any]]:
    """``status --json`` once no chain is active or stuck."""
    while True:
        chains: list[dict[str, Any]] = json.loads(cli(env, "status", "--json").stdout)
        if all(c["state"] not in ("active", "stuck") for c in chains):
            return chains
        time.sleep(5)


def serve_until_ended(env: dict[str, str], interval: float = 1.0) -> list[dict[str, Any]]:
    """Run the service until no chain is active or stuck; ``status --json`` then."""
    with service(env, interval):
        return until_ended(env)
