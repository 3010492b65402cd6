"""The rules a segment applies to itself while it runs (``decide.segment``), without a clock,
a process or a signal: the runner passes the facts in. The wrapper's tests (test_wrapper.py)
show the same rules acting on real signals, with real sleeps."""

from __future__ import annotations

from typing import Optional

import pytest

from chainrun.decide import segment as rules
from chainrun.decide.segment import Found

NOW = 1_700_000_000


@pytest.mark.parametrize(
    ("started", "expected"),
    [
        (NOW - 15, NOW - 15),  # a prolog ran 15 s: the walltime began then
        (NOW, NOW),
        (None, NOW),  # the scheduler does not tell
        (NOW + 5, NOW),  # in the future: nonsense
        (NOW - 3600, NOW),  # a whole walltime ago: nonsense (it would already be over)
        (NOW - 3599, NOW - 3599),
    ],
)
def test_the_walltime_counts_from_the_schedulers_start_unless_it_is_impossible(
    started: Optional[int], expected: int
) -> None:
    assert rules.walltime_start(started, NOW, 3600) == expected


@pytest.mark.parametrize(
    ("adaptive", "learned", "expected"),
    [
        (True, "grace=4\n", 4),
        (True, "grace=50\n", 12),  # at most the default
        (False, "grace=4\n", 12),  # the job file's own grace is kept
        (True, "grace=x\n", 12),
        (True, "grace=0\n", 12),
        (True, None, 12),
        (True, "version=1\ngrace=7\n", 7),
        (True, "grace=7 \n", 12),  # the whole line, or nothing
    ],
)
def test_the_grace_is_the_one_the_service_learned_at_most_the_default(
    adaptive: bool, learned: Optional[str], expected: int
) -> None:
    assert rules.grace(12, adaptive, learned) == expected


@pytest.mark.parametrize(
    ("now", "already", "preempted", "held", "ready", "expected"),
    [
        (100, False, False, False, False, ""),  # at its time: passed on
        (97, False, False, False, False, "early"),  # Slurm's coarse --signal
        (98, False, False, False, False, ""),  # two seconds early is clock granularity
        (40, False, True, False, False, ""),  # a preemption is never held
        (40, False, True, True, False, ""),
        (100, True, False, False, False, "sent"),  # ours came first: never twice
        (100, True, True, False, False, "sent"),
        (100, False, False, True, False, "not ready"),  # the command still imports
        (100, False, False, True, True, ""),
    ],
)
def test_a_schedulers_walltime_signal_is_passed_on_held_or_dropped(
    now: float, already: bool, preempted: bool, held: bool, ready: bool, expected: str
) -> None:
    assert rules.pass_on(now, 100, already=already, preempted=preempted, held=held, ready=ready) == expected


@pytest.mark.parametrize(
    ("now", "held", "ready", "expected"),
    [
        (99, False, False, "wait"),
        (100, False, False, "send"),
        (100, True, True, "send"),
        (100, True, False, "hold"),
        (128, True, False, "hold"),
        (129, True, False, "never"),  # a second before the deadline: the walltime's kill ends it
        (129, True, True, "send"),
    ],
)
def test_the_runners_own_signal_comes_at_walltime_minus_grace_once_the_command_is_ready(
    now: float, held: bool, ready: bool, expected: str
) -> None:
    assert rules.timer(now, 100, 130, held=held, ready=ready) == expected


def test_the_runner_kills_the_command_a_second_before_the_deadline_only_where_the_scheduler_cannot() -> None:
    assert not rules.kill_due(128.9, 130, True)
    assert rules.kill_due(129, 130, True)
    assert not rules.kill_due(200, 130, False)
    # A cancelled chain's command: killed at the end of the grace it had to save, not before.
    assert not rules.kill_due(99.9, 130, False, stop_by=100) and rules.kill_due(100, 130, False, stop_by=100)


@pytest.mark.parametrize(
    ("code", "expected"), [(0, 0), (1, 1), (98, 98), (99, 1), (100, 1), (101, 101), (137, 137)]
)
def test_no_exit_status_the_scheduler_acts_on_is_passed_on(code: int, expected: int) -> None:
    assert rules.exit_status(code) == expected


def test_leftovers_of_a_command_that_ended_on_its_own_get_term_then_kill_but_none_after_the_signal() -> None:
    assert rules.leftover_signal(False, 0) == "TERM"
    assert rules.leftover_signal(False, rules.LEFTOVER_KILL_AFTER - 0.1) == "TERM"
    assert rules.leftover_signal(False, rules.LEFTOVER_KILL_AFTER) == "KILL"
    assert rules.leftover_signal(True, 0) == ""
    assert rules.leftover_signal(True, 999) == ""


def test_a_preempted_segment_waits_for_the_scheduler_unless_it_already_had_its_term() -> None:
    assert rules.wait_for_preemption(True, "USR1")
    assert not rules.wait_for_preemption(True, "TERM")
    assert not rules.wait_for_preemption(False, "USR1")


def marker(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines())


@pytest.mark.parametrize(
    ("final", "before", "found", "target", "why"),
    [
        (False, None, Found(), None, ""),
        (True, None, Found(), None, "the chain has already ended"),
        (False, None, Found(epoch=30), 30, "epoch 30 already reached target_epoch 30"),
        (False, None, Found(epoch=29), 30, ""),
        (False, None, Found(epoch=99), None, ""),  # no target: the epoch says nothing
        (False, None, Found(epoch=3, done=True), 30, "the checkpoint says training is done"),
        (False, "exit=0\noriginal=0\nsignal=\nskipped=1", Found(), 30, "segment 1 found the goal already reached"),
        # the segment before exited 0 on its own: done, where there is no target or no epoch
        (False, "original=0\nsignal=\nskipped=0", Found(), None, "segment 1 finished on its own (exit 0 before its walltime)"),
        (False, "original=0\nsignal=\nskipped=0\nckpt_epoch=", Found(), 30, "segment 1 finished on its own (exit 0 before its walltime)"),
        (False, "original=0\nsignal=\nskipped=0\nckpt_epoch=12", Found(), 30, ""),
        (False, "original=0\nsignal=\nskipped=0", Found(), 30, ""),
        (False, "original=0\nsignal=USR1\nskipped=0", Found(), None, ""),  # stopped by the signal
        (False, "original=1\nsignal=\nskipped=0", Found(), None, ""),  # crashed: run again
        (False, "original=0\nskipped=0", Found(), None, ""),  # no word on the signal: run
    ],
)  # fmt: skip
def test_a_successor_skips_exactly_when_the_goal_was_met_before_it_started(
    final: bool, before: Optional[str], found: Found, target: Optional[int], why: str
) -> None:
    assert rules.skip_reason(2, final, None if before is None else marker(before), found, target) == why


@pytest.mark.parametrize(
    ("granted", "asked", "expected"),
    [
        (120, 1800, 120),
        (1, 1800, 1),
        (1799, 1800, 1799),
        (1800, 1800, None),
        (3600, 1800, None),
        (0, 1800, None),
        (None, 1800, None),
    ],
)
def test_a_limit_granted_counts_only_where_it_is_one_and_shorter_than_asked(
    granted: Optional[int], asked: int, expected: Optional[int]
) -> None:
    assert rules.shorter_limit(granted, asked) == expected


@pytest.mark.parametrize(
    ("said", "expected", "ready"),
    [(0, 0, False), (1, 0, True), (1, 1, True), (1, 2, False), (2, 2, True), (3, 2, True)],
)
def test_a_command_is_ready_once_as_many_processes_said_so_as_last_time_and_one_at_least(
    said: int, expected: int, ready: bool
) -> None:
    assert rules.all_ready(said, expected) is ready
