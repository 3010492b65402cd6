"""Where a chain's allocation went (``chainrun.accounting``): each segment's queue wait,
training, save after the signal, gap to its successor, and the chain's totals with GPU-hours;
computed from the stored times, checked on the real local runner against the wrapper's
markers, and on the real Slurm against sacct's own Submit/Start/End."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
from conftest import have, need, wait_for

from chainrun.accounting import account, describe, gpus
from chainrun.history import segment_lines
from chainrun.model import Chain, ChainState, JobSpec, Outcome, Phase, PlaceSpec, SchedulerSpec, Segment
from chainrun.store import Store

DATA = Path(__file__).parent / "data"
CLI = Callable[..., "subprocess.CompletedProcess[str]"]
Service = Callable[..., "subprocess.Popen[bytes]"]


@pytest.mark.parametrize(
    ("kind", "options", "expected"),
    [
        ("slurm", (), 0),
        ("slurm", ("--gres=gpu:2", "--mem=16G"), 2),
        ("slurm", ("--gres=gpu:a100:4,nic:1",), 4),
        ("slurm", ("--gres=gpu",), 1),
        ("slurm", ("--gres=gpu:2", "--nodes=3"), 6),
        ("slurm", ("--gpus=a100:3",), 3),
        ("slurm", ("--gpus 2",), 2),
        ("slurm", ("-G", "5"), 5),
        ("slurm", ("--gpus-per-node=2", "-N", "2"), 4),
        ("slurm", ("--gres=shard:2",), 0),
        ("sge", ("-l gpu=2",), 2),
        ("sge", ("-l", "h_vmem=4G,gpu=1"), 1),
        ("slurm", ("-l gpu=2",), 0),  # not an option of Slurm's
    ],
)
def test_the_gpus_a_job_asks_for_are_read_from_its_options(
    kind: str, options: tuple[str, ...], expected: int
) -> None:
    """Slurm's --gres, --gpus/-G and --gpus-per-node (times the nodes), SGE's -l gpu=N."""
    assert gpus(SchedulerSpec(kind=kind, options=options)) == expected


def test_a_pool_counts_its_gpus_per_slot() -> None:
    spec = SchedulerSpec(kind="local", hosts=("a", "b"), slots=2, gpus_per_slot=3)
    assert gpus(spec) == 3


def _chain(*segments: Segment, options: tuple[str, ...] = ()) -> Chain:
    spec = JobSpec(
        name="acc",
        command="true",
        workdir="/w",
        total_time=36000,
        walltime=3600,
        target_epoch=10,
        max_failures=3,
        checkpoint_dir="/w/ck",
        signal="USR1",
        grace=300,
        scheduler=SchedulerSpec(kind="slurm", options=options),
    )
    return Chain(id="acc-1", spec=spec, state=ChainState.ACTIVE, created_at=0.0, segments=segments)


def test_a_segment_splits_into_queue_training_save_and_gap() -> None:
    """Segment 1 waits 100 s, trains until the signal at 3400 s, saves 60 s; segment 2, queued
    ahead, waits only from segment 1's end (20 s), then runs: it counts up to now. A cancelled
    successor that never ran is no successor; the totals add up, with GPU-hours."""
    s1 = Segment(
        "acc-1",
        1,
        3600,
        Phase.ENDED,
        job_id="11",
        submitted_at=0.0,
        started_at=100.0,
        signalled_at=3400.0,
        ended_at=3460.0,
        outcome=Outcome.TIMEOUT,
    )
    s2 = Segment(
        "acc-1", 2, 3600, Phase.RUNNING, job_id="12", after="11", submitted_at=200.0, started_at=3480.0
    )
    acc = account(_chain(s1, s2, options=("--gres=gpu:2",)), now=4480.0)
    one, two = acc.segments
    assert (one.queued, one.training, one.saving, one.gap) == (100.0, 3300.0, 60.0, 20.0)
    assert (two.queued, two.training, two.saving, two.gap) == (20.0, 1000.0, 0.0, None)
    assert (acc.allocated, acc.trained, acc.queued, acc.gaps) == (4360.0, 4300.0, 120.0, 20.0)
    assert acc.share == pytest.approx(4300 / 4360)
    assert acc.gpu_hours == pytest.approx(4360 * 2 / 3600)
    assert account(_chain(), now=0.0).share is None
    assert account(_chain(s1), now=0.0).gpu_hours is None


def test_a_chain_with_several_places_is_accounted_per_place_with_each_places_gpus() -> None:
    """Segment 1 ran at the first place (2 GPUs a job, no place recorded: the first), segment
    2 at the second (1 GPU a job) after a 30 s copy there: each place is charged its own
    allocation and GPU-hours, the copy counted where it went, and the chain's GPU-hours are
    their sum; a place where nothing ran is left out, and history says each place's line."""
    uni = PlaceSpec("uni", SchedulerSpec(kind="slurm", options=("--gres=gpu:2",)), "/w", "/w/ck", 3600)
    national = PlaceSpec("national", SchedulerSpec(kind="sge", options=("-l gpu=1",)), "/n", "/n/ck", 3600)
    idle = PlaceSpec("idle", SchedulerSpec(kind="local"), "/i", "/i/ck", 3600)
    s1 = Segment(
        "acc-1", 1, 3600, Phase.ENDED, job_id="11", submitted_at=0.0, started_at=0.0,
        signalled_at=3500.0, ended_at=3600.0, outcome=Outcome.TIMEOUT,
    )  # fmt: skip
    s2 = Segment(
        "acc-1", 2, 3600, Phase.ENDED, job_id="7", submitted_at=3700.0, started_at=3700.0,
        signalled_at=5500.0, ended_at=5500.0, outcome=Outcome.COMPLETED, place="national", copy_seconds=30.0,
    )  # fmt: skip
    chain = _chain(s1, s2, options=("--gres=gpu:2",))
    chain = replace(chain, spec=replace(chain.spec, places=(uni, national, idle)))
    acc = account(chain, now=6000.0)
    assert [p.to_json() for p in acc.places] == [
        {"place": "uni", "segments": 1, "allocated_seconds": 3600.0, "trained_seconds": 3500.0,
         "copy_seconds": 0.0, "gpus": 2, "gpu_hours": 2.0},
        {"place": "national", "segments": 1, "allocated_seconds": 1800.0, "trained_seconds": 1800.0,
         "copy_seconds": 30.0, "gpus": 1, "gpu_hours": 0.5},
    ]  # fmt: skip
    assert acc.gpu_hours == 2.5
    assert acc.to_json()["places"][1]["place"] == "national"
    assert account(_chain(s1), now=0.0).to_json()["places"] is None  # one place: no list
    lines = segment_lines(chain, 6000.0)
    assert lines[-2:] == [
        "at uni: 1 segment, allocated 1h, trained 58m; 2.0 GPU-hours",
        "at national: 1 segment, allocated 30m, trained 30m; copies 30s; 0.5 GPU-hours",
    ]
    assert lines[-3].endswith("; 2.5 GPU-hours; preempted 0 times"), lines[-3]


def test_the_totals_round_every_duration_never_cut_it() -> None:
    """150 s allocated, 120 s of it trained: ``2m30s`` and ``2m``, not ``2m`` and ``1m`` as a
    cut would write them (issue 36, finding 4)."""
    s1 = Segment(
        "acc-1", 1, 3600, Phase.ENDED, job_id="11", submitted_at=0.0, started_at=10.0,
        signalled_at=130.0, ended_at=160.0, outcome=Outcome.TIMEOUT,
    )  # fmt: skip
    line = describe(account(_chain(s1), now=200.0))
    assert line.startswith("allocated 2m30s, trained 2m (80%); queued 10s, saving 30s, gaps 0s"), line


def test_history_counts_the_running_segment_in_the_budget_used_as_in_the_allocation() -> None:
    """While segment 2 runs, the history's last line says the budget used with it (as
    ``status`` does), beside the allocation, which counts it too; "trained" is only the time
    the command trained (issue 36, finding 4: ``trained 22s of 10m ...; allocated 46s``)."""
    s1 = Segment(
        "acc-1", 1, 3600, Phase.ENDED, job_id="11", submitted_at=0.0, started_at=100.0,
        signalled_at=3400.0, ended_at=3460.0, outcome=Outcome.TIMEOUT,
    )  # fmt: skip
    s2 = Segment(
        "acc-1", 2, 3600, Phase.RUNNING, job_id="12", after="11", submitted_at=200.0, started_at=3480.0
    )
    chain = replace(_chain(s1, s2), used=3360.0)
    last = segment_lines(chain, now=4480.0)[-1]
    assert last.startswith("budget used 1h13m of 10h in 2 segments; allocated 1h13m, trained 1h12m (99%);"), (
        last
    )


# -- the real local runner ---------------------------------------------------------------


def _history(chainrun: CLI, chain_id: str) -> dict[str, Any]:
    return json.loads(chainrun("history", chain_id, "--json", check=True).stdout)  # type: ignore[no-any-return]


def test_a_timed_out_segment_on_the_local_runner_accounts_its_save_after_the_signal(
    tmp_path: Path, home: Path, chainrun: CLI, service: Service
) -> None:
    """Walltime 10 s, grace 4 s: segment 1 gets the signal about 6 s in (its end marker says
        when), saves and exits; history --json splits its time at the signal, counts the gap to
        segment 2's start, and `status CHAIN` shows the totals in one line; the overview's
    query of every chain's totals agrees."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(DATA / "trainer.py", work)
    (work / "job.toml").write_text(
        'name = "acct"\ncommand = "python3 trainer.py --epochs 1000 --epoch-time 0.5"\n'
        'total_time = "1h"\nwalltime = "10s"\ngrace = "4s"\ntarget_epoch = 1000\n'
    )
    chain_id = chainrun("submit", str(work / "job.toml"), check=True).stdout.strip()
    service(0.3)
    wait_for(
        lambda: any(s["n"] == 2 and s["started_at"] for s in _history(chainrun, chain_id)["segments"] or []),
        120,
        "segment 2 started",
    )
    chainrun("cancel", chain_id, check=True)
    # The running service carries the cancel out at its next tick: until then segment 2
    # runs, and its allocation grows with the clock between one read and the next.
    wait_for(
        lambda: all(s["ended_at"] for s in _history(chainrun, chain_id)["segments"] if s["started_at"]),
        60,
        "the cancel to end segment 2",
    )
    data = _history(chainrun, chain_id)
    one = data["segments"][0]
    assert one["outcome"] == "timeout" and one["signalled_at"] is not None
    assert one["started_at"] < one["signalled_at"] < one["ended_at"]
    assert one["training_seconds"] == pytest.approx(one["signalled_at"] - one["started_at"])
    assert one["saving_seconds"] == pytest.approx(one["ended_at"] - one["signalled_at"])
    assert 3 <= one["training_seconds"] <= 10  # the signal at walltime - grace, whole seconds
    two = data["segments"][1]
    assert one["gap_seconds"] == pytest.approx(two["started_at"] - one["ended_at"])
    totals = data["totals"]
    allocated = sum(s["allocated_seconds"] for s in data["segments"])
    assert totals["allocated_seconds"] == pytest.approx(allocated)
    assert totals["trained_share"] == pytest.approx(totals["trained_seconds"] / allocated)
    assert totals["gpu_hours"] is None
    # The web page's overview reads the same totals in one query for every chain.
    store = Store(home, readonly=True)
    try:
        allocated_sql, trained_sql = store.allocations(time.time())[chain_id]
    finally:
        store.close()
    assert allocated_sql == pytest.approx(totals["allocated_seconds"])
    assert trained_sql == pytest.approx(totals["trained_seconds"])
    status = chainrun("status", chain_id, check=True).stdout
    assert "allocation: allocated " in status and "trained " in status, status


# -- the real Slurm ----------------------------------------------------------------------


def _sacct(job_id: str) -> tuple[Optional[float], ...]:
    """sacct's Submit, Start and End of the job, as epoch seconds (None: not yet)."""
    out = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "Submit,Start,End"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.split()[0]
    return tuple(None if t == "Unknown" else datetime.fromisoformat(t).timestamp() for t in out.split("|"))


@pytest.mark.slurm
def test_the_accounting_of_a_chain_on_slurm_matches_sacct(
    tmp_path: Path, chainrun: CLI, service: Service, shared_slurm: None
) -> None:
    """Segment 1 of a chain on the real Slurm times out; its queue wait, time allocated and
    the gap to segment 2 agree with sacct's Submit/Start/End within two seconds."""
    need("Slurm's accounting (sacct)", have("sacct"), "sudo scripts/start-slurm")
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(DATA / "trainer.py", work)
    (work / "job.toml").write_text(
        'name = "acct-slurm"\ncommand = "python3 trainer.py --epochs 1000 --epoch-time 1"\n'
        'total_time = "1h"\nwalltime = "1m"\ngrace = "50s"\ntarget_epoch = 1000\n'
        '[scheduler]\nkind = "slurm"\n'
    )
    chain_id = chainrun("submit", str(work / "job.toml"), check=True).stdout.strip()
    service(0.5)
    try:
        wait_for(
            lambda: any(
                s["n"] == 2 and s["started_at"] for s in _history(chainrun, chain_id)["segments"] or []
            ),
            300,
            "segment 2 started",
        )
        one, two = _history(chainrun, chain_id)["segments"][:2]
        wait_for(lambda: _sacct(one["job_id"])[2] is not None, 60, "sacct's end of segment 1")
        submit, start, end = _sacct(one["job_id"])
        submit2, start2, _ = _sacct(two["job_id"])
        assert one["outcome"] == "timeout"
        assert one["queued_seconds"] == pytest.approx(start - submit, abs=2)
        assert one["allocated_seconds"] == pytest.approx(end - start, abs=2)
        assert one["gap_seconds"] == pytest.approx(start2 - end, abs=2)
        assert two["submitted_at"] == pytest.approx(submit2, abs=2)
    finally:
        chainrun("cancel", chain_id)
