"""A segment's walltime counts from when Slurm started the job, not from when the batch
script began: on the test Slurm, partition ``slow-start`` has a prolog that takes 15 s
(scripts/start-slurm), longer than the 10 s grace floor. Before, the wrapper counted from its
own start, so the walltime signal came 15 s late: after Slurm's kill when the grace was
shorter than the prolog, and always 15 s closer to it than the grace the script asked for."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Callable

import pytest
from conftest import REPO, have, holding_scheduler, need, wait_for

from chainrun.schedulers.segment import parse_end_marker, parse_start_marker

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

CLI = Callable[..., "subprocess.CompletedProcess[str]"]
PROLOG = 15  # seconds: scripts/start-slurm's prolog for partition slow-start
WALLTIME, GRACE = 120, 30


@pytest.fixture
def slow_start_slurm() -> Iterator[None]:
    with holding_scheduler("slurm"):
        found = (
            have("sbatch")
            and subprocess.run(
                ["scontrol", "show", "partition", "slow-start"], capture_output=True, timeout=60
            ).returncode
            == 0
        )
        need("a running Slurm with partition slow-start", found, "sudo scripts/start-slurm")
        yield


def slurm_start(job_id: str) -> int:
    """When Slurm started the job (its StartTime), in epoch seconds."""
    out = subprocess.run(
        ["scontrol", "show", "job", job_id],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SLURM_TIME_FORMAT": "%s"},
    ).stdout
    return int(out.split("StartTime=", 1)[1].split()[0])


def test_the_signal_comes_grace_before_slurms_end_though_a_prolog_delayed_the_script(
    slow_start_slurm: None, tmp_path: Path, chainrun: CLI, service: Callable[..., subprocess.Popen[bytes]]
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "trainer.py").write_bytes((REPO / "tests" / "data" / "trainer.py").read_bytes())
    job = work / "slow.toml"
    job.write_text(
        'name = "slow-start"\n'
        'command = "python3 trainer.py --epochs 1000 --epoch-time 1"\n'
        f"workdir = {json.dumps(str(work))}\n"
        f'total_time = "1h"\nwalltime = "{WALLTIME}s"\ngrace = "{GRACE}s"\n'
        "target_epoch = 1000\nmax_failures = 0\n"
        '[scheduler]\nkind = "slurm"\nqueue = "slow-start"\n'
    )
    chain = chainrun("submit", str(job), check=True).stdout.split()[-1]
    service()

    def first_judged() -> bool:
        segments = json.loads(chainrun("history", chain, "--json", check=True).stdout)["segments"] or []
        return bool(segments) and segments[0]["ended_at"] is not None

    wait_for(first_judged, 600, "the first segment to end and be judged")
    chainrun("cancel", chain, check=True)  # its successor need not run
    run_dir = work / ".chainrun" / chain
    began = parse_start_marker((run_dir / "seg-0001.start").read_bytes())
    ended = parse_end_marker((run_dir / "seg-0001.end").read_bytes())
    assert ended is not None and began.at is not None
    start = slurm_start(began.job_id)
    assert began.at >= start + PROLOG - 1, (began.at, start)  # the prolog delayed the script
    # Slurm ends the job at StartTime + walltime: the signal comes grace before that (give or
    # take its clock's second), not grace before the script's own start + walltime.
    assert ended.signal == "USR1" and ended.signalled_at is not None, ended
    assert abs(ended.signalled_at - (start + WALLTIME - GRACE)) <= 3, (ended.signalled_at - start, ended)
    # The script saved on it and exited before Slurm's kill: a timeout with progress, no cost.
    assert ended.original == 0 and ended.progress is not None and (ended.progress.epoch or 0) >= 1, ended
    segment = json.loads(chainrun("history", chain, "--json", check=True).stdout)["segments"][0]
    assert segment["outcome"] == "timeout" and not segment["charged"], segment
