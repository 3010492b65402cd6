"""Shared fixtures: a private CHAINRUN_HOME, the chainrun CLI as a subprocess,
and the rule that a test needing a real scheduler fails (not skips) in CI."""

from __future__ import annotations

import fcntl
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

REPO = Path(__file__).resolve().parent.parent
# Set by scripts/test: a missing scheduler is then a failure, never a skip.
REQUIRE_CLUSTERS = os.environ.get("CHAINRUN_REQUIRE_CLUSTERS") == "1"


def need(what: str, available: bool, how: str) -> None:
    """Skip, or fail under CHAINRUN_REQUIRE_CLUSTERS=1, when ``what`` is missing."""
    if available:
        return
    message = f"{what} is not available here; start it with {how}"
    if REQUIRE_CLUSTERS:
        pytest.fail(message + " (CHAINRUN_REQUIRE_CLUSTERS=1: missing schedulers are failures)")
    pytest.skip(message)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that take a controller down go first: each waits until no test beside it
    holds that scheduler (``holding_scheduler``), which at the start is a moment's wait, and
    mid-run, with every worker going from one scheduler test to the next, took minutes (223 s
    in one full run) while its worker did nothing. pytest-xdist hands each worker a
    contiguous share of this order, so they start at once, one after another on worker 0:
    Slurm's back to back, then SGE's."""
    items.sort(
        key=lambda item: (item.get_closest_marker("takes_down_the_controller") is None, "[sge" in item.nodeid)
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under CHAINRUN_REQUIRE_CLUSTERS=1 (scripts/test, so CI) nothing may skip: a missing
    extra (torch, tensorboard) skips its whole module, and a green run that skipped it
    would report as tested what never ran."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if REQUIRE_CLUSTERS and skipped and exitstatus == pytest.ExitCode.OK:
        reasons = sorted(
            {str(r.longrepr[2]) if isinstance(r.longrepr, tuple) else str(r.longrepr) for r in skipped}
        )
        reporter.write_line(
            f"\n{len(skipped)} skipped under CHAINRUN_REQUIRE_CLUSTERS=1, where nothing may skip:"
        )
        for reason in reasons:
            reporter.write_line(f"  {reason}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private CHAINRUN_HOME for this test."""
    path = tmp_path / "home"
    monkeypatch.setenv("CHAINRUN_HOME", str(path))
    return path


# A suite started in the background by a non-interactive shell (`scripts/test &`, `nohup`)
# inherits SIGINT ignored, and so would every chainrun a test starts: the Ctrl-C tests would
# wait for nothing. Caught here, it is the default again in each process started from now on.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def cli_env(home: Path) -> dict[str, str]:
    env = dict(os.environ, CHAINRUN_HOME=str(home), PYTHONUNBUFFERED="1")
    # The training commands run `python3`: make it this interpreter.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture
def chainrun(home: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run the chainrun CLI in a subprocess, as a user would."""

    def run(*args: str, timeout: float = 300, check: bool = False) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [sys.executable, "-m", "chainrun", *args],
            capture_output=True,
            text=True,
            env=cli_env(home),
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"chainrun {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
            )
        return result

    return run


@pytest.fixture
def service(home: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start `chainrun daemon` processes; all are killed at the end of the test."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(interval: Optional[float] = 0.5, **env: str) -> subprocess.Popen[bytes]:
        """One service with ``env`` added (interval None: the config's); its output in daemon-N.log."""
        full = cli_env(home)
        for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "JOURNAL_STREAM"):
            full.pop(name, None)  # never this shell's systemd context
        full.update(env)
        with open(home.parent / f"daemon-{len(procs)}.log", "wb") as log:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "chainrun",
                    "daemon",
                    *(["--interval", str(interval)] if interval else []),
                ],
                env=full,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, every: float = 0.3) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def have(cmd: str) -> bool:
    return shutil.which(cmd) is not None


def answers(*argv: str) -> bool:
    """Whether the command runs and exits 0 within 30 s."""
    try:
        return subprocess.run(argv, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def slurm_answers() -> bool:
    return have("sbatch") and answers("scontrol", "ping")


@contextmanager
def holding_scheduler(kind: str, *, exclusive: bool = False) -> Iterator[None]:
    """The test scheduler ``kind`` (slurm, sge, or slurm-nodes: the multi-node Slurm's nodes), shared with the tests running beside this one
    (pytest -n), or all to itself for a test that takes its controller (or a node) down: such a test
    waits until the others let go, and they wait while it has the controller down. Every
    test that uses a scheduler holds it, before it first asks whether the scheduler runs."""
    with open(f"/tmp/chainrun-tests-{kind}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield


@pytest.fixture
def shared_slurm() -> Iterator[None]:
    """The real Slurm, shared with the tests beside this one (``holding_scheduler``)."""
    with holding_scheduler("slurm"):
        need("a running Slurm", slurm_answers(), "sudo scripts/start-slurm")
        yield


def without_runner_hash(script: str) -> str:
    """A batch script as its golden file has it: the runner's name (its content's hash, new with
    each change of the runner) as ``runner-HASH.pyz``."""
    return re.sub(r"runner-[0-9a-f]{16}\.pyz", "runner-HASH.pyz", script)


def settings_of(script: str) -> dict[str, Any]:
    """The settings a batch script hands the segment runner (the JSON of its here-document)."""
    start = script.index("<<'CHAINRUN_SETTINGS'\n") + len("<<'CHAINRUN_SETTINGS'\n")
    return json.loads(script[start : script.index("\nCHAINRUN_SETTINGS\n", start)])


def write_segment(job: Any, scheduler: Any, edit: Optional[Callable[[str, str], str]] = None) -> None:
    """A segment's batch script and the runner archive it runs, as ``Cluster.write_script``
    leaves them; ``edit(name, source)`` may change a module the archive ships (a mutant)."""
    from chainrun.schedulers.script import render_script, runner_path
    from chainrun.schedulers.ship import SEGMENT_RUNNER

    os.makedirs(job.run_dir, exist_ok=True)
    Path(job.script_path).write_text(render_script(scheduler, job))
    data = SEGMENT_RUNNER.data()
    if edit is not None:
        out = io.BytesIO()
        with zipfile.ZipFile(io.BytesIO(data)) as old, zipfile.ZipFile(out, "w") as new:
            for info in old.infolist():
                new.writestr(info, edit(info.filename, old.read(info).decode()))
        data = out.getvalue()
    Path(runner_path(job.spec)).write_bytes(data)
