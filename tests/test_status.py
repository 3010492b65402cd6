"""`chainrun status` for people and scripts: bar, ETA, next segment, budget, --json, --watch."""

from __future__ import annotations

import json
import os
import pty
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

from conftest import cli_env
from test_store import chains, one_line_error, raw

from chainrun import status as view
from chainrun.model import Chain, ChainState, JobSpec, Outcome, Phase, Progress, Segment

NOW = 1_000_000.0
CLI = Callable[..., "subprocess.CompletedProcess[str]"]


def chain(
    epoch: Optional[int] = 10,
    target: Optional[int] = 40,
    used: float = 3600.0,
    total: int = 72000,
    segments: tuple[Segment, ...] = (),
    state: ChainState = ChainState.ACTIVE,
    failures: int = 1,
) -> Chain:
    spec = JobSpec(
        name="cifar",
        command="python train.py",
        workdir="/w",
        total_time=total,
        walltime=3600,
        target_epoch=target,
        max_failures=3,
        checkpoint_dir="/w/checkpoints",
        signal="USR1",
        grace=300,
    )
    return Chain(
        id="cifar-a1b2c3",
        spec=spec,
        state=state,
        created_at=0.0,
        segments=segments,
        failures=failures,
        used=used,
        latest=Progress(epoch=epoch),
        reason="" if state is ChainState.ACTIVE else "failure budget spent",
        ended_at=None if state is ChainState.ACTIVE else NOW,
    )


def seg(n: int, phase: Phase, **kw: object) -> Segment:
    return Segment(chain_id="cifar-a1b2c3", n=n, walltime=3600, phase=phase, **kw)  # type: ignore[arg-type]


def test_bar_shows_fraction_percent_and_epochs() -> None:
    """The bar fills in proportion, caps at 100%, and degrades without a target or an epoch."""
    assert view.bar(3, 12) == "[###.........]  25% 3/12"
    assert view.bar(0, 12) == "[............]   0% 0/12"
    assert view.bar(15, 12) == "[############] 100% 15/12"
    assert view.bar(5, None) == "epoch 5"
    assert view.bar(None, 12) == "-"


def test_eta_is_epochs_left_over_the_epoch_rate_of_training_time() -> None:
    """10 epochs in 1 h of ended segments, 30 to go: 3 h."""
    c = chain(epoch=10, target=40, used=3600.0)
    assert view.epoch_rate(c, NOW) == 10 / 3600
    assert view.eta(c, NOW) == 3 * 3600
    assert view.row(c, NOW)[3] == "3h"


def test_eta_counts_only_the_epochs_trained_by_this_chain() -> None:
    """Submitted on a checkpoint at epoch 50, at 60 after 1 h: 10/h, so 40 to go is 4 h, not 40 min."""
    c = replace(chain(epoch=60, target=100, used=3600.0), baseline=Progress(epoch=50))
    assert view.epoch_rate(c, NOW) == 10 / 3600
    assert view.eta(c, NOW) == 4 * 3600
    assert view.eta(replace(c, latest=Progress(epoch=50)), NOW) is None  # nothing gained yet


def test_eta_counts_the_running_segment_time_so_far() -> None:
    """1 h ended plus 30 min running, 15 epochs: 25 left at 10/h is 2h30m."""
    running = seg(2, Phase.RUNNING, job_id="1234", started_at=NOW - 1800)
    c = chain(epoch=15, used=3600.0, segments=(running,))
    assert view.trained(c, NOW) == 5400
    assert view.eta(c, NOW) == 9000
    assert view.row(c, NOW)[3] == "2h30m"


def test_eta_beyond_what_is_left_of_the_budget_is_flagged() -> None:
    """At this rate the target comes after total_time runs out: say so."""
    c = chain(epoch=10, target=40, used=3600.0, total=7200)
    assert view.row(c, NOW)[3] == "3h > budget"


def test_eta_unknown_is_a_dash_and_completed_is_done() -> None:
    """No epoch yet, no target, or no time trained: "-"; a completed chain: "done"."""
    assert view.row(chain(epoch=None), NOW)[3] == "-"
    assert view.row(chain(target=None), NOW)[3] == "-"
    assert view.row(chain(used=0.0), NOW)[3] == "-"
    assert view.row(chain(state=ChainState.COMPLETED), NOW)[3] == "done"


def test_next_segment_shows_its_pending_reason_retry_or_submission() -> None:
    """The successor's scheduler reason (Dependency, Priority), a submission retry, or in flight."""
    running = seg(2, Phase.RUNNING, job_id="1234", started_at=NOW - 600)
    queued = seg(3, Phase.PENDING, job_id="1235", reason="Dependency")
    c = chain(segments=(running, queued))
    row = dict(zip(view.HEADER, view.row(c, NOW)))
    assert row["JOB"] == "1234 running 10m"
    assert row["NEXT"] == "#3 1235 queued (Dependency)"
    assert row["SEGMENT"] == "2/20"
    waiting = chain(segments=(seg(1, Phase.PENDING, job_id="99", reason="Priority"),))
    assert view.next_cell(waiting, NOW) == "#1 99 queued (Priority)"
    retry = chain(segments=(seg(4, Phase.SUBMITTING, retry_at=NOW + 40, reason="sbatch timed out"),))
    assert view.next_cell(retry, NOW) == "#4 retry in 40s"
    assert view.next_cell(chain(segments=(seg(4, Phase.SUBMITTING),)), NOW) == "#4 submitting"
    assert view.next_cell(chain(), NOW) == "-"


def test_row_shows_failures_of_budget_and_time_of_budget() -> None:
    """FAILURES is used/allowed, TIME is trained/total_time."""
    row = dict(zip(view.HEADER, view.row(chain(failures=2, used=5400.0), NOW)))
    assert row["FAILURES"] == "2/3"
    assert row["TIME"] == "1h30m/20h"


def test_table_aligns_columns_and_puts_ended_reasons_below() -> None:
    """One header, one aligned row per chain, then each ended chain's reason."""
    ended = replace(
        chain(state=ChainState.FAILED),
        id="other-ffffff",
        segments=(seg(1, Phase.ENDED, job_id="7", outcome=Outcome.FAILED),),
    )
    lines = view.table([chain(), ended], NOW).splitlines()
    assert lines[0].split() == list(view.HEADER)
    starts = [lines[0].index(h) for h in view.HEADER]
    for line in lines[1:3]:
        for start in starts[1:]:
            assert line[start - 2 : start] == "  "  # every column starts at the same place
    assert lines[3] == "other-ffffff: failure budget spent"


def test_json_carries_eta_rate_and_next_segment() -> None:
    """--json gives scripts the same facts unrounded."""
    queued = seg(3, Phase.PENDING, job_id="1235", reason="Dependency")
    data = view.to_json(chain(segments=(queued,)), NOW)
    assert data["eta_seconds"] == 3 * 3600
    assert data["epochs_per_hour"] == 10.0
    assert data["next"] == {
        "n": 3,
        "job_id": "1235",
        "phase": "pending",
        "reason": "Dependency",
        "retry_at": None,
    }
    assert data["failures"] == 1 and data["max_failures"] == 3


def test_a_damaged_chain_is_a_row_of_dashes_and_a_line_saying_what_is_wrong() -> None:
    """It cannot be shown as a chain; it is shown all the same, with the way out."""
    from chainrun.store import DamagedChain

    damaged = DamagedChain(
        id="bad-000000",
        name="bad",
        problem="state is 'paused', not one of ...",
        jobs=(),
        removal="sqlite3 X '...'",
    )
    lines = view.table([chain()], NOW, [damaged]).splitlines()
    assert lines[2].split() == ["bad-000000", "damaged", *(["-"] * (len(view.HEADER) - 2))]
    assert lines[3] == f"bad-000000: {damaged.reason}"
    assert (
        lines[3].startswith("bad-000000: damaged: state is 'paused'")
        and "remove it with: sqlite3 X" in lines[3]
    )
    frame = view.frame(Path("/nonexistent"), [], NOW, [damaged])
    assert not frame.startswith("no chains") and "bad-000000" in frame


def test_service_line_tells_running_from_stale(tmp_path: Path) -> None:
    """A status file from a live pid means running; one left by a dead pid does not."""
    assert view.service_line(tmp_path, NOW).startswith("service: not running")
    (tmp_path / "service.status").write_text(
        json.dumps({"pid": os.getpid(), "at": NOW - 4, "status": "1 running, 0 queued, 0 failed"})
    )
    assert view.service_line(tmp_path, NOW) == (
        f"service: running (pid {os.getpid()}); last tick 4s ago: 1 running, 0 queued, 0 failed"
    )
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / "service.status").write_text(json.dumps({"pid": dead.pid, "at": NOW, "status": "x"}))
    assert view.service_line(tmp_path, NOW).startswith("service: not running")


# -- through the CLI --------------------------------------------------------------


def cancelled_chain(tmp_path: Path, chainrun: CLI) -> str:
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(Path(__file__).parent / "data" / "trainer.py", work)
    (work / "job.toml").write_text(
        'name = "w"\ncommand = "python3 trainer.py"\ntotal_time = "1h"\nwalltime = "10m"\ntarget_epoch = 5\n'
    )
    chain_id: str = chainrun("submit", str(work / "job.toml"), check=True).stdout.strip()
    chainrun("cancel", chain_id, check=True)
    return chain_id


def test_status_table_through_the_cli_names_the_chain_and_the_service(tmp_path: Path, chainrun: CLI) -> None:
    """`chainrun status` prints the header, the chain, and whether a service runs."""
    chain_id = cancelled_chain(tmp_path, chainrun)
    out = chainrun("status", check=True).stdout.splitlines()
    assert out[0].split() == list(view.HEADER)
    assert out[1].startswith(chain_id) and " cancelled " in out[1]
    assert out[-1].startswith("service: not running")


def test_watch_and_json_together_are_refused(chainrun: CLI) -> None:
    """--watch is for people; combined with --json it is a one-line usage error."""
    result = chainrun("status", "--watch", "--json")
    assert result.returncode == 2 and "--watch draws a table" in result.stderr


def test_watch_redraws_in_place_on_a_terminal_and_stops_when_the_chain_ends(
    tmp_path: Path, chainrun: CLI, home: Path
) -> None:
    """On a TTY each frame homes the cursor and clears the rest; watching an ended chain returns."""
    chain_id = cancelled_chain(tmp_path, chainrun)
    leader, follower = pty.openpty()
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "chainrun", "status", chain_id, "--watch", "0.2"],
        stdout=follower,
        stderr=subprocess.PIPE,
        env=cli_env(home),
    )
    os.close(follower)
    assert proc.wait(30) == 0, proc.stderr.read() if proc.stderr else ""
    output = b""
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:
            break
        if not data:
            break
        output += data
    os.close(leader)
    text = output.decode()
    assert text.startswith("\x1b[H") and text.endswith("\x1b[J")
    assert "\x1b[K" in text and chain_id in text
    assert time.monotonic() - started < 20


def test_status_shows_a_damaged_chain_beside_the_others_and_cancel_refuses_it_in_one_line(
    home: Path, chainrun: CLI
) -> None:
    """A row with bad JSON made `status` a traceback; now: the good chain's row, the damaged
    chain's row and its line, exit 0; `cancel` says it cannot, `history` still reads it."""
    bad, good = chains(home, "bad", "good")
    db = raw(home)
    db.execute("UPDATE chains SET spec = '{oops' WHERE id = ?", (bad,))
    db.close()
    out = chainrun("status", check=True).stdout.splitlines()
    assert out[1].startswith(good) and " active " in out[1]
    assert out[2].split()[:2] == [bad, "damaged"]
    assert out[3].startswith(f"{bad}: damaged: spec is not valid JSON")
    assert "`chainrun cancel` cannot act on it; remove it with: sqlite3 " in out[3]
    assert out[-1].startswith("service: ")
    data = json.loads(chainrun("status", "--json", check=True).stdout)
    assert [(c["id"], c["state"]) for c in data] == [(good, "active"), (bad, "damaged")]
    line = one_line_error(chainrun("cancel", bad), 1)
    assert f"chain {bad} is damaged: spec is not valid JSON" in line
    assert "chain submitted" in chainrun("history", bad, check=True).stdout
    line = one_line_error(chainrun("status", bad), 1)
    assert "is damaged" in line


def test_status_of_an_empty_reference_is_a_usage_error(home: Path, chainrun: CLI) -> None:
    """`status ""` listed every chain, as if no chain had been named."""
    chains(home, "abc")
    assert "no chain given" in one_line_error(chainrun("status", ""), 2)
