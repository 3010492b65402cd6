"""`chainrun tensorboard`: the printed URL serves TensorBoard's page, for a local chain and one on
an SSH host (through a forwarded port that survives an sshd restart), and Ctrl-C leaves no
TensorBoard behind. The SSH case uses a private real sshd (tests/private_sshd.py), so that
stopping it drops no other test's connections."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Callable, Optional

import pytest
from conftest import cli_env, wait_for
from private_sshd import ALIAS, PrivateSSHD

pytest.importorskip("tensorboard", reason="needs the tensorboard extra: pip install 'chainrun[tensorboard]'")

CLI = Callable[..., "subprocess.CompletedProcess[str]"]
TENSORBOARD = str(Path(sys.executable).parent / "tensorboard")
URL = re.compile(r"(http://127\.0\.0\.1:\d+/)")


def job_file(work: Path, host: str = "") -> Path:
    """A chain that is never run: `tensorboard` needs only its spec."""
    lines = [
        'name = "tb"',
        'command = "true"',
        f'workdir = "{work}"',
        'total_time = "1h"',
        'walltime = "10m"',
    ]
    if host:
        lines += ["[scheduler]", 'kind = "slurm"', f'host = "{host}"']
    path = work / "tb.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """A workdir with a log directory whose name no other test's TensorBoard has."""
    path = tmp_path / "work"
    (path / "runs").mkdir(parents=True)
    return path


def page(url: str) -> Optional[bytes]:
    """TensorBoard's page at ``url``, or None when nothing serves it now."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            body: bytes = response.read()
    except (urllib.error.URLError, OSError):
        return None
    return body if b"tensorboard" in body.lower() else None


def tensorboards(logdir: Path) -> list[str]:
    """The processes (TensorBoard and its data server) serving ``logdir``."""
    found = subprocess.run(["pgrep", "-af", "--", f"--logdir[= ]{logdir}"], capture_output=True, text=True)
    return found.stdout.splitlines()


class Board:
    """`chainrun tensorboard` running as a user starts it; its output in a file."""

    def __init__(self, home: Path, out: Path, *args: str, env: Optional[dict[str, str]] = None) -> None:
        self.out = out
        with open(out, "w") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "chainrun", "tensorboard", *args],
                stdout=f,
                stderr=subprocess.STDOUT,
                env={**cli_env(home), **(env or {})},
            )

    def text(self) -> str:
        return self.out.read_text()

    def url(self) -> str:
        def printed() -> bool:
            assert self.proc.poll() is None, f"chainrun tensorboard exited:\n{self.text()}"
            return URL.search(self.text()) is not None

        wait_for(printed, 240, "the URL")
        found = URL.search(self.text())
        assert found is not None
        return found.group(1)

    def interrupt(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout=120)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def boards() -> Iterator[list[Board]]:
    started: list[Board] = []
    yield started
    for board in started:
        board.kill()


def test_local_chain_serves_tensorboard_at_the_printed_url_and_ctrl_c_stops_it(
    work: Path, home: Path, tmp_path: Path, chainrun: CLI, boards: list[Board]
) -> None:
    """A local chain: TensorBoard's page at the printed URL; Ctrl-C leaves no TensorBoard process."""
    chain_id = chainrun("submit", str(job_file(work)), check=True).stdout.strip()
    board = Board(home, tmp_path / "out.txt", chain_id)
    boards.append(board)
    url = board.url()
    wait_for(lambda: page(url) is not None, 120, f"TensorBoard's page at {url}")
    assert tensorboards(work / "runs"), "TensorBoard is not running on the chain's runs directory"
    assert board.interrupt() == 0, board.text()
    wait_for(lambda: not tensorboards(work / "runs"), 30, "TensorBoard to be gone")
    assert "TensorBoard stopped" in board.text()


@pytest.mark.ssh
@pytest.mark.slow
def test_chain_over_ssh_serves_through_a_forward_that_outlives_an_sshd_restart(
    work: Path, home: Path, tmp_path: Path, chainrun: CLI, boards: list[Board]
) -> None:
    """A chain on an SSH host: TensorBoard runs there, the local URL serves its page, serves
    again within 30 s of sshd coming back after a restart, and Ctrl-C stops it there."""
    sshd = PrivateSSHD(tmp_path)
    sshd.start()
    try:
        env = {"CHAINRUN_SSH_CONFIG": str(sshd.config)}
        submitted = subprocess.run(
            [sys.executable, "-m", "chainrun", "submit", str(job_file(work, ALIAS))],
            capture_output=True,
            text=True,
            env={**cli_env(home), **env},
            timeout=120,
        )
        assert submitted.returncode == 0, submitted.stderr
        chain_id = submitted.stdout.strip()
        board = Board(home, tmp_path / "out.txt", chain_id, "--program", TENSORBOARD, env=env)
        boards.append(board)
        url = board.url()
        wait_for(lambda: page(url) is not None, 120, f"TensorBoard's page at {url}")
        assert tensorboards(work / "runs"), "TensorBoard is not running on the chain's runs directory"

        sshd.stop()
        wait_for(lambda: page(url) is None, 30, "the URL to stop serving while sshd is down")
        sshd.start()
        wait_for(lambda: page(url) is not None, 30, "the same URL to serve again after sshd restarted")
        assert "connection lost" in board.text()

        assert board.interrupt() == 0, board.text()
        wait_for(lambda: not tensorboards(work / "runs"), 30, "TensorBoard on the host to be gone")
        assert page(url) is None, "the forward still serves after Ctrl-C"
    finally:
        sshd.stop()
        for line in tensorboards(work / "runs"):  # left by a failure above: never by the command
            subprocess.run(["kill", line.split()[0]], check=False)


@pytest.mark.ssh
def test_missing_tensorboard_on_the_host_is_one_line_and_exit_2(
    work: Path, home: Path, tmp_path: Path
) -> None:
    """A TensorBoard command the host does not have: one line naming what to do, exit 2."""
    sshd = PrivateSSHD(tmp_path)
    sshd.start()
    try:
        env = {**cli_env(home), "CHAINRUN_SSH_CONFIG": str(sshd.config)}

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "chainrun", *args],
                capture_output=True,
                text=True,
                env=env,
                timeout=120,
            )

        chain_id = cli("submit", str(job_file(work, ALIAS))).stdout.strip()
        result = cli("tensorboard", chain_id, "--program", "/no/such/tensorboard")
        assert result.returncode == 2, result.stderr
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
        assert "not found on root-private" in result.stderr and "pip install tensorboard" in result.stderr
    finally:
        sshd.stop()


def test_the_log_directory_is_the_option_else_the_job_files_tensorboard_dir_else_runs(tmp_path: Path) -> None:
    from chainrun import jobfile
    from chainrun import tensorboard as board
    from chainrun.model import Chain, ChainState

    path = tmp_path / "job.toml"
    base = 'name = "t"\ncommand = "true"\ntotal_time = "1h"\nwalltime = "10m"\n'
    for extra, given, expected in (
        ('tensorboard_dir = "logs/tb"\n', None, tmp_path / "logs" / "tb"),
        ('tensorboard_dir = "logs/tb"\n', "other", tmp_path / "other"),
        ("", None, tmp_path / "runs"),
    ):
        path.write_text(base + extra)
        chain = Chain(id="t-000000", spec=jobfile.load(path), state=ChainState.ACTIVE, created_at=0.0)
        assert board.logdir_for(chain, given) == str(expected)
