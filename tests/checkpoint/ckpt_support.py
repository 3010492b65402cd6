"""Shared by the checkpoint helper's tests: a clean CHAINRUN_* environment, signal handlers put
back, and a runner for the training scripts beside these tests.

Not a conftest.py: tests/conftest.py is imported by name (``from conftest import``)
elsewhere, and a second conftest.py would shadow it. Test modules import the
autouse fixtures from here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CHAINRUN_VARS = (
    "CHAINRUN_CHAIN",
    "CHAINRUN_SEGMENT",
    "CHAINRUN_DEADLINE",
    "CHAINRUN_CHECKPOINT_DIR",
    "CHAINRUN_SIGNAL",
    "CHAINRUN_RUN_DIR",
    "CHAINRUN_SEED",
    "CHAINRUN_GRACE",
)
WATCHED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)


@pytest.fixture(autouse=True)
def no_chainrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts as a script run without chainrun."""
    for name in CHAINRUN_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def restore_signal_handlers() -> Iterator[None]:
    """A SegmentClock a test installs never outlives the test."""
    before = {sig: signal.getsignal(sig) for sig in WATCHED_SIGNALS}
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def script_env(**extra: str) -> dict[str, str]:
    """The environment for a helper script: this repo importable, no CHAINRUN_* unless given."""
    env = {k: v for k, v in os.environ.items() if k not in CHAINRUN_VARS}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    env.update(extra)
    return env


def run_script(
    name: str, *args: Any, env: Optional[dict[str, str]] = None, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """Run ``tests/checkpoint/<name>`` with this interpreter; the output is kept for assertion messages."""
    return subprocess.run(
        [sys.executable, str(HERE / name), *map(str, args)],
        capture_output=True,
        text=True,
        env=env if env is not None else script_env(),
        timeout=timeout,
    )


def describe(result: subprocess.CompletedProcess[str]) -> str:
    """Exit code and output of a finished script, for assertion messages."""
    return f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr[-4000:]}"
