"""Segments sized to start now, on the real multi-node test Slurm (``scripts/start-slurm --nodes
3``, sched/backfill with bf_interval=5): a blocker holds one of node3's two CPUs for ten minutes
while a job that wants the whole node waits for it, so only a job that ends before the blocker
does may backfill. A chain with ``walltime = "2m..30m"`` starts at once with its limit cut to
one that fits (2m, its ``--time-min``, each time measured here), while a chain with a fixed 30m
waits. The range chain's runner counts from the limit granted: its command gets the signal at
that limit - grace, and saves, where a runner counting from 30m would hold Slurm's own early
signal and be killed unsaved at the limit. ``status`` shows the granted walltime and
``history`` says why.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import have, holding_scheduler, need, wait_for
from test_slurm_accounting import cancel_jobs
from test_slurm_preempt import write_job as slurm_job

from chainrun.node.granted import limit_seconds
from chainrun.schedulers.slurm import SlurmScheduler
from chainrun.text import duration

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

CLI = Callable[..., "subprocess.CompletedProcess[str]"]
NODE = "node3"  # two CPUs
GRACE = 30


def _out(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout


@pytest.fixture
def empty_node() -> Iterator[None]:
    """node3 of the multi-node Slurm, with no other test's job on it (the multi nodes held
    exclusively: a job there would change what may backfill)."""
    with holding_scheduler("slurm"), holding_scheduler("slurm-nodes", exclusive=True):
        states = (
            _out("sinfo", "--noheader", "--Node", "--partition=multi", "--format=%N %t")
            if have("sinfo")
            else ""
        )
        need(
            "the multi-node Slurm (node3 in partition multi)",
            any(line.split()[:1] == [NODE] for line in states.splitlines()),
            "sudo scripts/start-slurm --nodes 3",
        )
        wait_for(
            lambda: not _out("squeue", "--noheader", f"--nodelist={NODE}", "--format=%i").strip(),
            300,
            f"{NODE} to run no job",
            every=1,
        )
        yield


def sbatch(*options: str) -> str:
    job = _out(
        "sbatch", "--parsable", "--partition=multi", f"--nodelist={NODE}", "--output=/dev/null", *options
    )
    assert job.strip(), f"sbatch {options} failed"
    return job.strip()


def write_job(work: Path, walltime: str) -> Path:
    return slurm_job(
        work,
        "multi",
        name=f"bf-{work.name}",
        walltime=walltime,
        grace=f"{GRACE}s",
        options=(f"--nodelist={NODE}", "--cpus-per-task=1"),
    )


def test_a_range_starts_at_once_through_backfill_and_its_runner_counts_from_the_limit_granted(
    empty_node: None, tmp_path: Path, chainrun: CLI, service: Callable[..., Any]
) -> None:
    jobs: list[str] = []
    chains: list[str] = []

    def status(chain_id: str) -> dict[str, Any]:
        return json.loads(chainrun("status", chain_id, "--json", check=True).stdout)[0]  # type: ignore[no-any-return]

    def segment(chain_id: str, n: int) -> dict[str, Any]:
        segs = status(chain_id)["segments"]
        return segs[n - 1] if len(segs) >= n else {}

    try:
        jobs.append(sbatch("--cpus-per-task=1", "--time=10", "--job-name=bf-blocker", "--wrap=sleep 600"))
        wait_for(
            lambda: _out("squeue", "-h", "-j", jobs[0], "-o", "%T").strip() == "RUNNING", 60, "the blocker"
        )
        jobs.append(sbatch("--cpus-per-task=2", "--time=5", "--job-name=bf-whole-node", "--wrap=sleep 300"))
        wait_for(
            lambda: (
                _out("squeue", "-h", "-j", jobs[1], "-o", "%T|%r").strip()
                in ("PENDING|Resources", "PENDING|Priority")
            ),
            60,
            "the whole-node job to wait for the blocker",
        )
        ranged = chainrun("submit", str(write_job(tmp_path / "ranged", "2m..30m")), check=True).stdout.strip()
        chains.append(ranged)
        fixed = chainrun("submit", str(write_job(tmp_path / "fixed", "30m")), check=True).stdout.strip()
        chains.append(fixed)
        service(interval=1)

        wait_for(
            lambda: segment(ranged, 1).get("phase") == "running", 120, "the range chain to start", every=1
        )
        # Backfill cut its limit to what ends before the blocker (measured here: 2m, --time-min).
        limit = limit_seconds(_out("squeue", "-h", "-j", segment(ranged, 1)["job_id"], "-o", "%l"))
        assert limit is not None and 120 <= limit <= 540, limit
        wait_for(lambda: segment(fixed, 1).get("job_id"), 60, "the fixed chain's job", every=1)
        assert segment(fixed, 1)["phase"] == "pending", segment(fixed, 1)
        wait_for(
            lambda: segment(ranged, 1).get("walltime") == limit, 60, "the granted walltime recorded", every=1
        )
        history = chainrun("history", ranged, check=True).stdout
        assert f"segment 1 granted {duration(limit)} of the 30m it asked for" in history, history

        # The runner's own timer: the signal at the limit granted - grace; the command saves and exits.
        wait_for(
            lambda: segment(ranged, 1).get("outcome") is not None, limit + 120, "segment 1 to end", every=1
        )
        first = segment(ranged, 1)
        log = chainrun("logs", ranged, "-n", "1").stdout
        assert first["signalled_at"] is not None, (first, log)
        signalled = first["signalled_at"] - first["started_at"]
        assert limit - GRACE - 10 <= signalled <= limit - GRACE + 10, (signalled, first, log)
        assert not first["charged"], first
        assert "exited 0 after SIGUSR1" in first["reason"], (first, log)
        assert segment(fixed, 1)["phase"] == "pending", segment(fixed, 1)
        assert status(ranged)["failures"] == 0
    finally:
        for chain_id in chains:
            chainrun("cancel", chain_id)
            cancel_jobs(chain_id)
        if jobs:
            subprocess.run(["scancel", *jobs], capture_output=True, timeout=60)


def test_each_array_task_reads_its_own_limit_and_start(shared_slurm: None, tmp_path: Path) -> None:
    """A sweep's first segments may be one array: each task asks for its own limit by the id the
    listing lists it under. The last task's own SLURM_JOB_ID is the array's base id, under which
    squeue lists every task: asked by that, it would read no limit."""
    script = tmp_path / "task.sh"
    script.write_text(
        "#!/bin/bash\n"
        f'export CHAINRUN_JOB_ID="{SlurmScheduler.task_id_shell}"\n'
        f'{{ {SlurmScheduler.granted_shell}; }} > "{tmp_path}/limit-$SLURM_ARRAY_TASK_ID.tmp"\n'
        f'{{ {SlurmScheduler.started_shell}; }} > "{tmp_path}/start-$SLURM_ARRAY_TASK_ID"\n'
        f'mv "{tmp_path}/limit-$SLURM_ARRAY_TASK_ID.tmp" "{tmp_path}/limit-$SLURM_ARRAY_TASK_ID"\n'
    )
    base = _out(
        "sbatch", "--parsable", "--array=0-1", "--time=5", "--time-min=2", "--output=/dev/null", str(script)
    ).strip()
    assert base, "sbatch of the array failed"
    try:
        files = [tmp_path / f"limit-{i}" for i in (0, 1)]
        wait_for(lambda: all(f.exists() for f in files), 120, "both tasks to read their limit")
        # One line each: 5:00, or less down to 2:00 where backfill started the task (other
        # tests' jobs wait on this Slurm too).
        limits = [limit_seconds(f.read_text()) for f in files]
        assert all(limit is not None and 120 <= limit <= 300 for limit in limits), [
            f.read_text() for f in files
        ]
        # And its start, one time each (the runner counts its walltime from it).
        starts = [(tmp_path / f"start-{i}").read_text() for i in (0, 1)]
        assert all(start.strip().isdigit() for start in starts), starts
    finally:
        subprocess.run(["scancel", base], capture_output=True, timeout=60)
