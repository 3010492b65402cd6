"""Segments sized to start now: ``walltime = "MIN..MAX"``. On Slurm a segment asks for
``--time=MAX --time-min=MIN`` and the backfill scheduler may start it at once with its limit
cut down; the segment's runner reads the limit granted and counts its clock from it, and the
service counts the chain's time from it (``history`` says so). SGE and the local runner grant
no shorter limit: a range there runs for its longest, and ``check`` says so.

The rules and parsers here; the real backfill on the real Slurm in test_slurm_backfill."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from chainrun import check, jobfile
from chainrun.decide import Facts, JobFacts, decide
from chainrun.errors import JobFileError
from chainrun.model import (
    NO_PROGRESS,
    Adopt,
    Chain,
    ChainState,
    ListedJob,
    Phase,
    Progress,
    Segment,
    StartMarker,
    Submit,
    Track,
)
from chainrun.node.granted import granted, limit_seconds
from chainrun.schedulers import scheduler_for
from chainrun.schedulers.script import render_script
from chainrun.schedulers.segment import SegmentJob, parse_start_marker
from chainrun.schedulers.slurm import SlurmScheduler
from chainrun.store import Store

BASE = 'name = "r"\ncommand = "true"\ntotal_time = "72h"\n'


def load(tmp_path: Path, text: str) -> jobfile.JobSpec:
    path = tmp_path / "r.toml"
    path.write_text(BASE + text)
    return jobfile.load(path)


def test_a_range_is_read_as_its_longest_walltime_and_its_shortest(tmp_path: Path) -> None:
    """The longest is what every scheduler asks for; the shortest what backfill may grant. The
    default grace comes of the shortest, which must leave room to start and save."""
    spec = load(tmp_path, 'walltime = "4h..24h"\n[scheduler]\nkind = "slurm"\n')
    assert (spec.walltime, spec.walltime_min, spec.grace) == (24 * 3600, 4 * 3600, 300)
    short = load(tmp_path, 'walltime = "2m..30m"\n[scheduler]\nkind = "slurm"\n')
    assert (short.walltime, short.walltime_min, short.grace) == (1800, 120, 30)
    fixed = load(tmp_path, 'walltime = "4h"\n')
    assert (fixed.walltime, fixed.walltime_min) == (4 * 3600, 0)


@pytest.mark.parametrize(
    ("walltime", "problem"),
    [
        (
            '"24h..4h"',
            "walltime = '24h..4h': a range's first duration must be the shorter, as in \"4h..24h\"",
        ),
        ('"4h..4h"', "walltime = '4h..4h': a range's first duration must be the shorter"),
        ('"4h..x"', "walltime = '4h..x': not a duration; use a duration such as 90s"),
        ('"..4h"', "walltime = '..4h': not a duration"),
        (
            '"4h..100h"',
            "walltime = '4h..100h': longer than total_time (3d); make walltime at most total_time",
        ),
        ('"30s..1h"\n[scheduler]\nkind = "slurm"', "walltime = '30s..1h': too short for slurm"),
    ],
)
def test_a_bad_range_is_one_clear_line(tmp_path: Path, walltime: str, problem: str) -> None:
    with pytest.raises(JobFileError) as err:
        load(tmp_path, f"walltime = {walltime}\n")
    assert problem in str(err.value)
    assert "\n" not in str(err.value)


def test_slurm_asks_for_the_longest_with_time_min_the_shortest(tmp_path: Path) -> None:
    """``--time-min`` goes with a segment that may be cut; not with one already clamped to the
    budget's rest below the shortest, nor with a fixed walltime."""
    spec = load(tmp_path, 'walltime = "4h..24h"\n[scheduler]\nkind = "slurm"\n')
    slurm = SlurmScheduler()
    lines = slurm.directives(SegmentJob("c", 1, spec, spec.walltime))
    assert "#SBATCH --time=1-00:00:00" in lines and "#SBATCH --time-min=0-04:00:00" in lines
    assert "--time-min=0-04:00:00" in slurm.shape_argv(SegmentJob("c", 1, spec, spec.walltime))
    rest = slurm.directives(SegmentJob("c", 4, spec, 10 * 3600))  # the budget's rest: 10h
    assert "#SBATCH --time=0-10:00:00" in rest and "#SBATCH --time-min=0-04:00:00" in rest
    clamped = slurm.directives(SegmentJob("c", 4, spec, 3 * 3600))
    assert not [line for line in clamped if "--time-min" in line]
    fixed = load(tmp_path, 'walltime = "4h"\n[scheduler]\nkind = "slurm"\n')
    assert not [
        line for line in slurm.directives(SegmentJob("c", 1, fixed, 4 * 3600)) if "--time-min" in line
    ]


def test_check_says_what_a_range_does_on_each_scheduler(tmp_path: Path) -> None:
    slurm = "\n".join(
        check.summary(
            "r.toml", s := load(tmp_path, 'walltime = "4h..24h"\n[scheduler]\nkind = "slurm"\n'), [s]
        )
    )
    assert "walltime 4h..1d per segment: the scheduler's backfill may start a segment sooner" in slurm
    assert (
        "to 4h at least (Slurm's --time-min); its signal and the budget count from the limit granted" in slurm
    )
    assert "at most 3 x 1d, more where backfill grants shorter limits" in slurm
    sge = "\n".join(
        check.summary("r.toml", s := load(tmp_path, 'walltime = "4h..24h"\n[scheduler]\nkind = "sge"\n'), [s])
    )
    assert "walltime 1d per segment (sge grants no shorter limits: 4h..1d runs its longest)" in sge
    assert "at most 3 x 1d\n" in sge + "\n"
    local = "\n".join(check.summary("r.toml", s := load(tmp_path, 'walltime = "4h..24h"\n'), [s]))
    assert "walltime 1d per segment (local grants no shorter limits: 4h..1d runs its longest)" in local


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        # squeue --format=%l as the test Slurm printed it (tests/cluster/slurm_facts.md), and its other forms
        ("2:00\n", 120),
        ("10:00", 600),
        ("1:30:00", 5400),
        ("1-00:00:00", 86400),
        ("365-00:00:00", 365 * 86400),
        ("UNLIMITED", None),
        ("NOT_SET", None),
        ("", None),
        ("2:00 3:00", None),
    ],
)
def test_the_node_reads_slurms_time_limit(text: str, seconds: object) -> None:
    assert limit_seconds(text) == seconds


def answer(out: bytes, rc: int = 0) -> subprocess.CompletedProcess[bytes]:
    return subprocess.CompletedProcess(["bash"], rc, out, b"")


def test_the_runner_counts_from_a_shorter_limit_granted_else_from_the_one_asked() -> None:
    """Slurm rounds a limit up to a whole minute: one not shorter than asked is the asked one."""
    assert granted(answer(b"2:00\n"), 1800) == 120
    assert granted(answer(b"30:00\n"), 1799) == 1799
    assert granted(answer(b"UNLIMITED\n"), 1800) == 1800
    assert granted(answer(b"2:00\n", rc=1), 1800) == 1800
    assert granted(None, 1800) == 1800


def test_the_start_marker_carries_the_walltime_counted_from() -> None:
    marker = parse_start_marker(b"job=7\nhost=node3\nat=1000\nwalltime=120\n")
    assert (marker.job_id, marker.at, marker.walltime) == ("7", 1000.0, 120)
    assert parse_start_marker(b"job=7\nhost=node3\nat=1000\n").walltime is None  # an older runner's


def test_decide_records_a_shorter_limit_granted_once(tmp_path: Path) -> None:
    """The service learns the granted limit from the start marker and records it as the
    segment's walltime (the store keeps it and says so in history); once recorded, nothing more."""
    spec = load(tmp_path, 'walltime = "2m..30m"\n[scheduler]\nkind = "slurm"\n')
    now = 10_000.0

    def chain(walltime: int) -> Chain:
        seg = Segment("c", 1, walltime, Phase.RUNNING, job_id="7", started_at=now - 5)
        return Chain("c", spec, ChainState.ACTIVE, 0.0, (seg,), progress=Progress(epoch=1))

    listed = ListedJob("7", "cr.c.1", Phase.RUNNING, started_at=now - 5)
    facts = {"7": JobFacts(listed=listed, start=StartMarker("7", now - 5, None, 120))}
    actions = decide(chain(1800), Facts(jobs=facts, progress=Progress(epoch=1)), now)
    assert Track(1, Phase.RUNNING, "", None, None, walltime=120) in actions
    again = decide(chain(120), Facts(jobs=facts, progress=Progress(epoch=1)), now)
    assert not [a for a in again if isinstance(a, Track)]


def test_only_a_slurm_segment_that_may_be_cut_asks_for_its_limit_in_the_job(tmp_path: Path) -> None:
    """The runner asks the scheduler for the limit granted only where it may be shorter than
    asked: a Slurm segment with a range. SGE and the local runner count from the longest."""

    def asks(kind: str, walltime: str) -> str:
        spec = load(tmp_path, f'walltime = "{walltime}"\n[scheduler]\nkind = "{kind}"\n')
        script = render_script(scheduler_for(kind, None), SegmentJob("c", 1, spec, spec.walltime))
        (line,) = [line for line in script.splitlines() if line.startswith(' "granted": ')]
        return line

    assert "squeue --noheader" in asks("slurm", "4h..24h") and "--format=%l" in asks("slurm", "4h..24h")
    assert asks("slurm", "24h") == ' "granted": "",'
    assert asks("sge", "4h..24h") == ' "granted": "",'
    assert asks("local", "4h..24h") == ' "granted": "",'


def test_the_store_records_a_granted_walltime_once_and_never_a_longer_one(tmp_path: Path) -> None:
    spec = load(tmp_path, 'walltime = "2m..30m"\n[scheduler]\nkind = "slurm"\n')
    store = Store(tmp_path / "home")
    chain_id = store.add_chain(spec, NO_PROGRESS, now=1.0).id
    store.journal_submit(chain_id, Submit(1, spec.walltime), 2.0)
    store.record(chain_id, [Adopt(1, "7", "submitted")], None, [], 2.0)
    for walltime in (120, 120, 600):
        store.record(chain_id, [Track(1, Phase.RUNNING, "", 5.0, None, walltime=walltime)], None, [], 6.0)
    assert store.chain(chain_id).segments[0].walltime == 120
    granted = [ev.message for ev in store.events(chain_id) if ev.kind == "granted"]
    assert granted == [
        "segment 1 granted 2m of the 30m it asked for: the scheduler started it sooner with a "
        "shorter limit (walltime's range, Slurm's --time-min)"
    ]
