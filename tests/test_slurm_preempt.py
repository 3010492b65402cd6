"""Preemption on the real Slurm that scripts/start-slurm configures: PreemptType=
preempt/partition_prio, jobs of partition ``high`` preempt those of ``low-requeue``
(PreemptMode=REQUEUE) and ``low-cancel`` (PreemptMode=CANCEL) on the same node, after a
GraceTime during which the batch shell gets the job's --signal
(SlurmctldParameters=preempt_send_user_signal).

One chain on each low partition, one preemptor (a plain sbatch to ``high`` that takes the
whole node) against both at once: the lean way to see both modes, as requeued jobs wait
out Slurm's two-minute requeue delay before they run again. Everything is real: the CLI,
the service, sbatch, the preemption, the wrapper and the training script (which holds a
lock on its checkpoint directory, so two copies of one chain at once would show).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import REPO, have, holding_scheduler, need, wait_for
from test_slurm_accounting import cancel_jobs

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

CLI = Callable[..., "subprocess.CompletedProcess[str]"]
PARTITIONS = ("low-requeue", "low-cancel", "high")


@pytest.fixture
def preemptible_slurm() -> Iterator[None]:
    """The real Slurm, shared with tests beside this one, with start-slurm's preemption
    partitions."""
    with holding_scheduler("slurm"):
        found = have("sbatch") and all(
            subprocess.run(["scontrol", "show", "partition", p], capture_output=True, timeout=60).returncode
            == 0
            for p in PARTITIONS
        )
        need(
            "a running Slurm with the partitions " + ", ".join(PARTITIONS), found, "sudo scripts/start-slurm"
        )
        yield


def write_job(
    work: Path,
    queue: str,
    *,
    name: str = "",
    walltime: str = "10m",
    grace: str = "30s",
    options: tuple[str, ...] = (),
) -> Path:
    """A Slurm chain of the test trainer, long enough never to end on its own, in ``queue``."""
    work.mkdir()
    (work / "trainer.py").write_bytes((REPO / "tests" / "data" / "trainer.py").read_bytes())
    path = work / "t.toml"
    path.write_text(
        f'name = "{name or queue}"\n'
        'command = "python3 trainer.py --epochs 1000 --epoch-time 1 --exclusive"\n'
        f"workdir = {json.dumps(str(work))}\n"
        f'total_time = "2h"\nwalltime = "{walltime}"\ngrace = "{grace}"\ntarget_epoch = 1000\n'
        # One failure would end the chain at the next: any charge shows.
        "max_failures = 1\n"
        f'[scheduler]\nkind = "slurm"\nqueue = "{queue}"\n'
        + (f"options = {json.dumps(list(options))}\n" if options else "")
    )
    return path


def _out(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout


def preempt(jobs: list[str]) -> str:
    """Submit a preemptor that takes the whole node, once only ``jobs`` (of the low
    partitions) run there, and return its id once Slurm is preempting them all. A pending
    job of ``high`` keeps the other tests' ``debug`` jobs from starting: one that finds a
    ``debug`` job running (started just before it) is withdrawn and tried again."""
    deadline = time.monotonic() + 600
    node = _out("squeue", "--noheader", f"--jobs={jobs[0]}", "--format=%N").strip()
    while True:
        wait_for(
            lambda: (
                set(
                    _out(
                        "squeue", "--noheader", "--states=RUNNING", f"--nodelist={node}", "--format=%i"
                    ).split()
                )
                <= set(jobs)
            ),
            max(1.0, deadline - time.monotonic()),
            "the node to run only the chains' jobs",
            every=1,
        )
        preemptor = _out(
            "sbatch",
            "--parsable",
            "--partition=high",
            "--exclusive",
            "--job-name=chainrun-preemptor",
            "--output=/dev/null",
            "--wrap=sleep 5",
        ).strip()
        assert preemptor, "sbatch of the preemptor failed"
        try:
            wait_for(
                lambda: all(re.search(r"\bPreemptTime=\d", _out("scontrol", "show", "job", j)) for j in jobs),
                20,
                "Slurm to preempt the chains' jobs",
                every=1,
            )
            return preemptor
        except AssertionError:
            subprocess.run(["scancel", preemptor], capture_output=True, timeout=60)
            if time.monotonic() > deadline:
                raise


def saved_when_stopped(log: str) -> int:
    """The epoch the training had saved when the signal stopped it (its first stop)."""
    before, stopped, _ = log.partition("stopping on signal")
    assert stopped, f"the command never got the signal:\n{log}"
    return int(re.findall(r"^epoch (\d+) done$", before, re.MULTILINE)[-1])


def test_preempted_segments_save_cost_nothing_requeue_resumes_and_cancel_goes_on(
    preemptible_slurm: None, tmp_path: Path, chainrun: CLI, service: Callable[..., Any]
) -> None:
    """A preemptor fills the node: both chains' commands get SIGUSR1 at once and save. With
    CANCEL, segment 1 ends "preempted", charged nothing, and segment 2 resumes from its
    checkpoint. With REQUEUE, segment 1's job is requeued ("preempted, requeued" in status),
    its queued successor never starts beside it, and the same job runs segment 1 again
    from the checkpoint. ``history`` counts each chain's preemptions."""
    requeue = chainrun(
        "submit", str(write_job(tmp_path / "requeue", "low-requeue")), check=True
    ).stdout.strip()
    cancel = chainrun("submit", str(write_job(tmp_path / "cancel", "low-cancel")), check=True).stdout.strip()
    preemptor = ""
    service(interval=1)

    def status(chain_id: str) -> dict[str, Any]:
        return json.loads(chainrun("status", chain_id, "--json", check=True).stdout)[0]  # type: ignore[no-any-return]

    def segment(chain_id: str, n: int) -> dict[str, Any]:
        segs = status(chain_id)["segments"]
        return segs[n - 1] if len(segs) >= n else {}

    def log(chain_id: str, n: int) -> str:
        return chainrun("logs", chain_id, "-n", str(n)).stdout

    try:

        def both_training() -> bool:
            return all(
                segment(c, 1).get("phase") == "running"
                and segment(c, 2).get("job_id")
                and (status(c)["epoch"] or 0) >= 2
                for c in (requeue, cancel)
            )

        wait_for(both_training, 240, "both chains to train with a successor queued", every=1)
        preemptor = preempt([segment(c, 1)["job_id"] for c in (requeue, cancel)])

        # CANCEL: the segment ends preempted, saved, charged nothing; the next one resumes.
        wait_for(
            lambda: segment(cancel, 1).get("outcome") is not None, 300, "segment 1 (CANCEL) to end", every=1
        )
        first = segment(cancel, 1)
        assert (first["outcome"], first["charged"]) == ("preempted", False), first
        assert "exited 0 after SIGUSR1 (the job was preempted)" in first["reason"], first
        saved = saved_when_stopped(log(cancel, 1))
        assert "preempted, not charged" in chainrun("status", cancel, check=True).stdout
        wait_for(lambda: "resumed from" in log(cancel, 2), 300, "segment 2 (CANCEL) to resume", every=1)
        assert f"resumed from model.ckpt (epoch {saved})" in log(cancel, 2)

        # REQUEUE: the same job is queued again; status says so; the successor waits.
        wait_for(
            lambda: segment(requeue, 1).get("reason", "").startswith("preempted, requeued"),
            300,
            "segment 1 (REQUEUE) to be requeued",
            every=1,
        )
        job = segment(requeue, 1)["job_id"]
        saved = saved_when_stopped(log(requeue, 1))
        table = chainrun("status", check=True).stdout
        assert any(requeue in line and "queued (preempted" in line for line in table.splitlines()), table
        # Slurm holds a requeued job for two minutes (BeginTime) before it may run again.
        wait_for(
            lambda: segment(requeue, 1).get("phase") == "running", 400, "segment 1 to run again", every=1
        )
        wait_for(lambda: "resumed from" in log(requeue, 1), 120, "segment 1 to resume", every=1)
        assert f"resumed from model.ckpt (epoch {saved})" in log(requeue, 1)
        wait_for(lambda: (status(requeue)["epoch"] or 0) > saved, 120, "training to go on", every=1)
        again, successor = segment(requeue, 1), segment(requeue, 2)
        assert (again["job_id"], again["outcome"], successor["phase"]) == (job, None, "pending"), (
            again,
            successor,
        )

        for chain_id in (requeue, cancel):
            assert status(chain_id)["failures"] == 0
        assert not (tmp_path / "requeue" / "overlaps.log").exists()
        assert not (tmp_path / "cancel" / "overlaps.log").exists()
        assert (
            chainrun("history", requeue, check=True).stdout.rstrip().endswith("preempted 1 time (1 requeued)")
        )
        assert chainrun("history", cancel, check=True).stdout.rstrip().endswith("preempted 1 time")
    finally:
        for chain_id in (requeue, cancel):
            chainrun("cancel", chain_id)
            cancel_jobs(chain_id)
        if preemptor:
            subprocess.run(["scancel", preemptor], capture_output=True, timeout=60)
