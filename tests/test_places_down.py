"""One chain, two places, and the controller of the one it runs at stops mid-chain (issue 39,
test (b)): slurmctld is really stopped while a segment runs at Slurm with its successor queued
one ahead there. The chain must not wait on Slurm while SGE can start it: the segment that
ends while slurmctld is away is judged by its runner's markers, the successor that cannot be
cancelled there is left (free), and the next segment starts at SGE once the checkpoint is
copied there. When slurmctld is back, the successor left behind is cancelled, and, had it
started first, it could not have trained: the checkpoint directory the chain left is fenced."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import test_contract
import test_places
from conftest import holding_scheduler, wait_for
from test_places import CLI, Service, completed_free, history, lineage, status, timeline, write_job

from chainrun.checkpoint import _fence as fence

pytestmark = [pytest.mark.slurm, pytest.mark.sge, pytest.mark.slow, pytest.mark.takes_down_the_controller]

SLURM = test_contract.CLUSTERS["slurm"]
SGE = test_contract.CLUSTERS["sge"]
work = test_places.work  # its fixture: the workdir, whose name needs quoting
REMOVED = "its cancel did not reach the scheduler, which did not answer; sent again now that it answers"


@pytest.fixture
def slurm_to_stop() -> Iterator[test_contract.Cluster]:
    """Slurm all to this test (no other test's job runs while its controller is away), SGE
    shared with the tests beside it."""
    with holding_scheduler("slurm", exclusive=True), holding_scheduler("sge"):
        test_contract.need("a running Slurm", SLURM.available(), "sudo scripts/start-slurm")
        test_contract.need("a running SGE", SGE.available(), "sudo scripts/start-sge")
        yield SLURM


def test_the_next_segment_starts_at_sge_while_slurmctld_is_away_and_nothing_is_charged(
    slurm_to_stop: test_contract.Cluster, work: Path, chainrun: CLI, service: Service
) -> None:
    """(b) slurmctld stops while segment 1 runs at Slurm and segment 2 waits there behind it.
    Segment 1 ends on its runner's walltime signal while slurmctld is away: judged by its end
    marker (a timeout with progress: free); Slurm does not answer, SGE starts now, so the
    next segment goes to SGE with the checkpoint, and segment 2, which Slurm cannot cancel
    now, is left, free. Back, Slurm holds no job of the chain, and the checkpoint left at
    Slurm is never trained on again. The final checkpoint is every epoch once, in order."""
    # Segment 1 trains 50 to 62 epochs at Slurm (its walltime 60 s), one or two at SGE (20 s)
    # the rest, before the chain could come back to Slurm, which answers again by then.
    epochs = 68
    path = write_job(work, "", epochs=epochs)
    chain_id = chainrun("submit", str(path), check=True).stdout.strip().splitlines()[-1]
    service(interval=1)

    def queued_behind_a_running_one() -> bool:
        segs = status(chainrun, chain_id)["segments"]
        phases = [(s["place"], s["phase"], s["job_id"] is not None) for s in segs]
        return phases == [("slurm", "running", True), ("slurm", "pending", True)]

    wait_for(queued_behind_a_running_one, 180, "segment 1 to run at Slurm with segment 2 queued behind it")
    stale = status(chainrun, chain_id)["segments"][1]["job_id"]

    def at_sge_started() -> bool:
        segs = status(chainrun, chain_id)["segments"]
        return any(s["place"] == "sge" and s["started_at"] for s in segs)

    try:
        try:
            slurm_to_stop.stop_controller()
            wait_for(at_sge_started, 150, "a segment to start at SGE while slurmctld is away")
            assert not test_contract.answers("scontrol", "ping"), "slurmctld came back before its time"
            left_at_slurm = lineage(work / "ckpt-slurm")  # what segment 1 committed there
        finally:
            slurm_to_stop.start_controller()
        wait_for(lambda: not slurm_to_stop.live_jobs(chain_id), 120, "no job of the chain left at Slurm")
        wait_for(lambda: status(chainrun, chain_id)["state"] != "active", 240, "the chain to end")
    finally:  # Slurm as the test found it, whatever failed: none of the chain's jobs left there
        left = [j.job_id for j in slurm_to_stop.live_jobs(chain_id)]
        if left:
            subprocess.run(["scancel", *left], timeout=60)

    st = status(chainrun, chain_id)
    print(timeline(st))
    completed_free(st)
    first, left, *rest = st["segments"]
    assert (first["place"], first["outcome"]) == ("slurm", "timeout"), timeline(st)
    assert (left["place"], left["outcome"], left["started_at"]) == ("slurm", "cancelled", None), timeline(st)
    assert "left for sge" in left["reason"], left["reason"]
    assert rest and {s["place"] for s in rest} == {"sge"}, timeline(st)
    events = history(chainrun, chain_id)["events"]
    moved = [e["message"] for e in events if e["kind"] == "move"]
    assert moved and "goes to sge: sge starts now" in moved[0], moved
    assert "slurm cannot start it (its scheduler did not answer: " in moved[0], moved
    copies = [e["message"] for e in events if e["kind"] == "copy"]
    assert copies and "from slurm" in copies[0] and "verified" in copies[0], copies
    # Segment 2 was cancelled once slurmctld answered, before it started; or, had it started
    # first, it found the checkpoint directory the chain left fenced for segment 3, and ran
    # nothing (test_fence: a segment that starts after a newer one never runs its command).
    run_dir = work / ".chainrun" / chain_id
    removed = [e["message"] for e in events if e["kind"] == "removed"]
    if (run_dir / "seg-0002.start").exists():
        print("segment 2 started before its cancel reached Slurm: " + (run_dir / "seg-0002.end").read_text())
        assert "\nfenced=segment 3 " in (run_dir / "seg-0002.end").read_text()
    else:
        assert removed == [f"job {stale} removed: {REMOVED}"], removed
    owner = fence.read(str(work / "ckpt-slurm"))
    assert owner is not None and owner.newer_than(fence.Token(chain_id, 2, 0, stale)), owner
    # The checkpoint left at Slurm is as segment 1 left it.
    assert lineage(work / "ckpt-slurm") == left_at_slurm
    made = lineage(work / "ckpt-sge")
    assert [e[0] for e in made] == list(range(1, epochs + 1)), made
    # The last epochs at SGE, by a segment that ran there: not always the last one that
    # started (a successor queued ahead may start as the goal is met, and is cancelled).
    ran = {s["n"] for s in rest if s["started_at"]}
    assert made[0][1] == first["n"] and made[-1][1] in ran, (made[0], made[-1], timeline(st))
    assert json.loads((work / "ckpt-sge" / "chainrun-progress.json").read_text())["epoch"] == epochs
