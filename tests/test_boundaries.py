"""Boundaries the rules turn on, each pinned at the value where they turn, and each shown to
catch the bug that moves it: a chain one epoch short of its target goes on; the default grace
is a quarter of a short walltime; the wrapper signals at walltime minus grace, to the second.
Each check runs on the real code, and (``tests_the_tests``) on a copy with that one bug in it
(``mutants``), where it must fail: a test that cannot fail is a defect."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import pytest

try:
    import tomllib
except ImportError:  # Python before 3.11
    import tomli as tomllib  # type: ignore[no-redef]
from conftest import wait_for, write_segment
from mutants import mutant, rules_mutant
from test_decide import SPEC, chain, seg
from test_slurm_backend import hostile_spec
from test_wrapper import wrapper_env

from chainrun import schema
from chainrun.decide import Facts, JobFacts
from chainrun.decide import chain as chain_rules
from chainrun.errors import JobFileError
from chainrun.model import (
    ChainState,
    EndMarker,
    EndSegment,
    Finish,
    ListedJob,
    Outcome,
    Phase,
    Progress,
    Submit,
)
from chainrun.schedulers.base import Scheduler
from chainrun.schedulers.segment import SegmentJob, parse_end_marker
from chainrun.schedulers.sge import SgeScheduler
from chainrun.schedulers.slurm import SlurmScheduler

NOW = 10_000.0


def fails_on_the_bug(check: Callable[[Any], None], bug: Any) -> None:
    with pytest.raises(AssertionError):
        check(bug)


# -- a chain one epoch short of its target goes on ------------------------------------


def one_epoch_short_goes_on(decide: Callable[..., list[object]]) -> None:
    """Segment 1 ended on its walltime at epoch 9 of 10: it is credited, and segment 2 (queued)
    goes on; the chain is not completed. At epoch 10 it is."""
    assert SPEC.target_epoch == 10
    for epoch, completes in ((SPEC.target_epoch - 1, False), (SPEC.target_epoch, True)):
        left = Progress(epoch=epoch, saved_at=NOW - 2)
        marker = EndMarker(0, 0, "USR1", False, NOW - 1, progress=left)
        job = JobFacts(
            listed=ListedJob("j1", "j1", Phase.ENDED, Outcome.TIMEOUT, 0, NOW - 90, NOW - 1), end=marker
        )
        actions = decide(chain(seg(1), seg(2, Phase.PENDING)), Facts(jobs={"j1": job}, progress=left), NOW)
        ended = next(a for a in actions if isinstance(a, EndSegment))
        assert (ended.outcome, ended.charged, ended.progress.epoch) == (Outcome.TIMEOUT, False, epoch)
        finished = [a for a in actions if isinstance(a, Finish)]
        if completes:
            assert [f.state for f in finished] == [ChainState.COMPLETED], actions
        else:
            assert finished == [], f"completed at epoch {epoch} of {SPEC.target_epoch}: {actions}"
        # The checkpoint alone (segment 2 running) says the same.
        running = JobFacts(listed=ListedJob("j2", "j2", Phase.RUNNING))
        now = decide(chain(seg(2), progress=left), Facts(jobs={"j2": running}, progress=left), NOW)
        assert any(isinstance(a, Submit) for a in now) is not completes, now


def test_a_chain_one_epoch_short_of_its_target_goes_on() -> None:
    one_epoch_short_goes_on(chain_rules.decide)


@pytest.mark.tests_the_tests
def test_that_check_fails_on_a_chain_that_completes_one_epoch_early() -> None:
    bug = rules_mutant("progress.epoch >= target_epoch", "progress.epoch >= target_epoch - 1")
    fails_on_the_bug(one_epoch_short_goes_on, bug.decide)


# -- the default grace is a quarter of a short walltime, at most 5 minutes -----------------


def default_grace_fits_the_walltime(parse: Callable[..., Any]) -> None:
    """Without ``grace``, the signal comes a quarter of the walltime before it, at most 5 min and
    at least 1 s (never with the kill)."""
    for walltime, grace in (("3s", 1), ("40s", 10), ("2m", 30), ("19m", 285), ("20m", 300), ("4h", 300)):
        text = f'name="a"\ncommand="true"\ntotal_time="8h"\nwalltime="{walltime}"\n'
        spec = parse(tomllib.loads(text), "/tmp/job.toml", Path("/tmp"))
        assert spec.grace == grace, (walltime, spec.grace)


def test_the_default_grace_is_a_quarter_of_a_short_walltime() -> None:
    default_grace_fits_the_walltime(schema.parse)


@pytest.mark.tests_the_tests
def test_that_check_fails_on_a_default_grace_of_half_the_walltime() -> None:
    bug = mutant(schema, "min(300, walltime // 4)", "min(300, walltime // 2)")
    fails_on_the_bug(default_grace_fits_the_walltime, bug.parse)


# -- the wrapper signals at walltime minus grace, to the second -------------------------

WALLTIME = 12
GRACE = 8


def signal_seconds_before_the_deadline(
    work: Path, scheduler: Scheduler, edit: Optional[Callable[[str, str], str]] = None
) -> int:
    """How many seconds before its deadline the command got the walltime signal: under
    ``scheduler``'s script (SGE: the wrapper's own timer; Slurm: a --signal that came at once,
    which the wrapper holds), run by bash as the scheduler would."""
    work.mkdir(parents=True, exist_ok=True)
    spec = replace(
        hostile_spec(str(work)),
        grace=GRACE,
        command="echo $CHAINRUN_DEADLINE > deadline; trap 'date +%s > got; exit 0' USR1; "
        "while :; do sleep 0.1; done",
    )
    job = SegmentJob("hostile-1a2b3c", 1, spec, WALLTIME)
    write_segment(job, scheduler, edit)
    proc = subprocess.Popen(["bash", job.script_path], env=wrapper_env(), stdout=subprocess.PIPE, text=True)
    try:
        wait_for((work / "deadline").exists, 30, "the command to start")
        if not scheduler.wrapper_signals:
            proc.send_signal(signal.SIGUSR1)  # Slurm's --signal, far too early: held
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (work / "got").exists(), "the command never got the walltime signal"
    end = parse_end_marker(Path(job.stem + ".end").read_bytes())
    assert end is not None and end.signal == "USR1", end
    return int((work / "deadline").read_text()) - int((work / "got").read_text())


def signals_at_walltime_minus_grace(
    work: Path, scheduler: Scheduler, edit: Optional[Callable[[str, str], str]] = None
) -> None:
    """The command gets the signal GRACE seconds before its deadline: not later (one second
    for the wrapper's one-second timer, one more for a loaded machine), not earlier."""
    before = signal_seconds_before_the_deadline(work, scheduler, edit)
    assert GRACE - 2 <= before <= GRACE, f"signalled {before}s before the deadline, not {GRACE}"


SCHEDULERS = pytest.mark.parametrize(
    "scheduler", [SgeScheduler(), SlurmScheduler()], ids=["own-timer", "held-signal"]
)


@SCHEDULERS
def test_the_wrapper_signals_at_walltime_minus_grace_to_the_second(
    tmp_path: Path, scheduler: Scheduler
) -> None:
    signals_at_walltime_minus_grace(tmp_path, scheduler)


@pytest.mark.tests_the_tests
@SCHEDULERS
def test_that_check_fails_on_a_wrapper_that_signals_at_the_walltime(
    tmp_path: Path, scheduler: Scheduler
) -> None:
    def at_the_walltime(name: str, source: str) -> str:
        if name != "chainrun/node/runner.py":
            return source
        line = "self.signal_at = self.deadline - self.grace"
        assert source.count(line) == 1
        return source.replace(line, "self.signal_at = self.deadline - 0")

    fails_on_the_bug(lambda edit: signals_at_walltime_minus_grace(tmp_path, scheduler, edit), at_the_walltime)


# -- the same crash twice before any progress ends the chain; any difference keeps the budget --

TAIL = ("Traceback (most recent call last):", "ModuleNotFoundError: No module named 'torch'")


def only_an_identical_crash_before_progress_ends_the_chain(decide: Callable[..., list[object]]) -> None:
    """Segment 1 crashed (exit 1, TAIL) with the checkpoint as submitted; segment 2 ends the chain
    when it crashes exactly so, and not when one line, the exit status or the chain's checkpoint
    (one step past the baseline, saved by a segment between) differs by the least there is."""
    base = Progress(epoch=3, step=7, saved_at=100.0)
    first = replace(seg(1, Phase.ENDED), outcome=Outcome.FAILED, exit_code=1, tail=TAIL, charged=True)
    cases = [
        (1, TAIL, base, True),
        (1, (TAIL[0] + " ", TAIL[1]), base, False),
        (1, (TAIL[0], TAIL[1][:-1] + "x"), base, False),
        (2, TAIL, base, False),
        (1, TAIL, replace(base, step=8), False),
    ]
    for code, tail, mark, ends in cases:
        marker = EndMarker(code, code, "", False, NOW - 1, progress=mark, tail=tail)
        job = JobFacts(
            listed=ListedJob("j2", "j2", Phase.ENDED, Outcome.FAILED, code, NOW - 5, NOW - 1), end=marker
        )
        c = chain(first, seg(2), failures=1, baseline=base, progress=mark)
        actions = decide(c, Facts(jobs={"j2": job}, progress=mark), NOW)
        finished = [a for a in actions if isinstance(a, Finish)]
        if ends:
            assert [f.state for f in finished] == [ChainState.FAILED], actions
            assert finished[0].reason.endswith(" | ".join(TAIL)), finished[0].reason
        else:
            assert finished == [], f"exit {code}, {tail}, {mark}: {actions}"


def test_only_an_identical_crash_before_progress_ends_the_chain() -> None:
    only_an_identical_crash_before_progress_ends_the_chain(chain_rules.decide)


@pytest.mark.tests_the_tests
@pytest.mark.parametrize(
    "bug",
    [
        ("if crashes.get(m) == crash)", "if (crashes.get(m) or (0, ()))[1][-1:] == crash[1][-1:])"),
        ("if crashes.get(m) == crash)", "if (crashes.get(m) or (0, ()))[1] == crash[1])"),
        ("or mark.advanced_from(chain.baseline)", "or mark.epoch != chain.baseline.epoch"),
    ],
    ids=["compares-the-last-line-only", "ignores-the-exit-status", "progress-by-epoch-only"],
)
def test_that_check_fails_on_a_repeat_rule_that_looks_at_less(bug: tuple[str, str]) -> None:
    fails_on_the_bug(only_an_identical_crash_before_progress_ends_the_chain, rules_mutant(*bug).decide)


# -- the least walltime and grace that start and save are accepted, a second less is not ------


def least_walltime_and_grace_are_accepted(parse: Callable[..., Any]) -> None:
    """On each scheduler kind, the least walltime and grace that work parse; one second less of
    either is refused, naming the field."""
    for kind, walltime, grace in (("local", 3, 1), ("sge", 5, 3), ("slurm", 60, 1)):
        for w, g, refused in (
            (walltime, grace, ""),
            (walltime - 1, grace, "walltime"),
            (walltime, grace - 1, ""),
        ):
            if g < 1:
                continue  # a duration of 0 is refused as such, not as too short
            refused = refused or ("grace" if g < grace else "")
            text = f'name="a"\ncommand="true"\ntotal_time="8h"\nwalltime="{w}s"\ngrace="{g}s"\n'
            text += f'[scheduler]\nkind="{kind}"\n'
            try:
                parse(tomllib.loads(text), "/tmp/job.toml", Path("/tmp"))
            except JobFileError as err:
                assert refused and f": {refused} = '" in str(err), (kind, w, g, str(err))
            else:
                assert not refused, f"{kind}: walltime {w}s, grace {g}s accepted"


def test_the_least_walltime_and_grace_that_work_are_accepted_a_second_less_is_not() -> None:
    least_walltime_and_grace_are_accepted(schema.parse)


@pytest.mark.tests_the_tests
@pytest.mark.parametrize(
    "bug",
    [
        ("if walltime - grace < MIN_START:", "if walltime - grace < MIN_START - 1:"),
        ('MIN_GRACE = {"local": 1, "slurm": 1, "sge": 3}', 'MIN_GRACE = {"local": 1, "slurm": 1, "sge": 2}'),
        (
            'MIN_WALLTIME = {"local": 0, "slurm": 60, "sge": 0}',
            'MIN_WALLTIME = {"local": 0, "slurm": 59, "sge": 0}',
        ),
    ],
    ids=["one-second-to-start", "sge-grace-2s", "slurm-59s"],
)
def test_that_check_fails_on_a_bound_one_second_off(bug: tuple[str, str]) -> None:
    fails_on_the_bug(least_walltime_and_grace_are_accepted, mutant(schema, *bug).parse)
