"""`chainrun run` over SSH rides out a network drop: with the login node's sshd stopped for 20 s
while a segment runs on the real Slurm, it says the connection was lost, goes on when it is back,
and the chain completes with no failure charged. The sshd is a private one (tests/private_sshd.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import cli_env, holding_scheduler, wait_for
from private_sshd import ALIAS, PrivateSSHD
from test_contract import CLUSTERS, write_job

OUTAGE = 20.0


def status(home: Path, env: dict[str, str], chain: str) -> dict[str, object]:
    result = subprocess.run(
        [sys.executable, "-m", "chainrun", "status", chain, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)[0]  # type: ignore[no-any-return]


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.ssh
def test_run_over_ssh_survives_sshd_stopped_for_20s_and_charges_nothing(
    work_dir: Path, home: Path, tmp_path: Path
) -> None:
    """sshd down 20 s mid-segment: `run` shows the loss and the return, the chain completes, failures 0."""
    with holding_scheduler("slurm"):  # as the contract suite: no controller taken down meanwhile
        sshd = PrivateSSHD(tmp_path)
        sshd.start()
        try:
            cluster = replace(CLUSTERS["slurm-ssh"], host=ALIAS)
            path = write_job(
                work_dir,
                cluster,
                "python3 trainer.py --epochs 40 --epoch-time 1",
                walltime=600,
                grace=30,
                target_epoch=40,
            )
            env = {**cli_env(home), "CHAINRUN_SSH_CONFIG": str(sshd.config)}
            out = tmp_path / "run.txt"
            with open(out, "w") as f:
                run = subprocess.Popen(
                    [sys.executable, "-m", "chainrun", "run", str(path), "--interval", "1"],
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
            try:
                # A tick may skip an epoch in the output: wait for any epoch from 3 on.
                wait_for(lambda: _epoch(out.read_text()) >= 3, 240, f"epoch 3 in the output:\n{out}")
                sshd.stop()
                time.sleep(OUTAGE)
                sshd.start()
                code = run.wait(timeout=400)
            finally:
                if run.poll() is None:
                    run.kill()
                    run.wait()
            text = out.read_text()
            assert code == 0, text
            lost = text.index("connection lost, retrying in")
            assert text.index("connection back after", lost) > lost, text
            assert "completed" in text.splitlines()[-1], text
            chain = text.split("chain ", 1)[1].split()[0]
            st = status(home, env, chain)
            assert st["state"] == "completed" and st["failures"] == 0, st
        finally:
            sshd.stop()


@pytest.fixture
def work_dir(tmp_path: Path) -> Path:
    """The training's working directory, with the contract suite's trainer."""
    path = tmp_path / "work dir"
    path.mkdir()
    data = Path(__file__).parent / "data" / "trainer.py"
    (path / "trainer.py").write_text(data.read_text())
    return path


def _epoch(text: str) -> int:
    """The highest epoch `run`'s progress lines have shown so far (-1: none yet)."""
    return max((int(m) for m in re.findall(r"epoch (\d+)/40", text)), default=-1)
