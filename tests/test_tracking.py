"""One run in the tracker, whatever the segments (issue 37): every segment's command gets the
chain's id and a tracker-safe run id, the same in each of its segments."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_wrapper import run_wrapper, work  # noqa: F401 (work: the fixture)

from chainrun.model import new_chain_id
from chainrun.schedulers.segment import RUN_ID_MAX, tracker_run_id

SAFE = re.compile(r"[a-z0-9-]+")


@pytest.mark.parametrize(
    ("chain_id", "run_id"),
    [
        ("cifar-resnet-1a2b3c", "cifar-resnet-1a2b3c"),
        ("My_Run.v2-abcdef", "my-run-v2-abcdef"),
        ("A" * 64 + "-0f0f0f", "a" * 57 + "-0f0f0f"),
    ],
)
def test_the_run_id_is_the_chain_id_lowercase_letters_digits_and_hyphens_with_its_random_end_kept(
    chain_id: str, run_id: str
) -> None:
    assert tracker_run_id(chain_id) == run_id
    assert SAFE.fullmatch(run_id) and len(run_id) <= RUN_ID_MAX


def test_every_chain_name_gives_a_safe_run_id_that_keeps_its_chains_apart() -> None:
    """The longest names (64 characters, a sweep's -HASH-rN within them) keep the random end,
    so two chains of one name still get two runs."""
    for name in ("x", "Name.With_Dots-and-CAPS", "n" * 64, "s" * 50 + "-0123abcd-r12"):
        ids = {tracker_run_id(new_chain_id(name)) for _ in range(20)}
        assert all(SAFE.fullmatch(i) and len(i) <= RUN_ID_MAX for i in ids)
        assert len(ids) == 20


def test_each_segment_of_a_chain_sees_its_chain_id_and_the_same_run_id(work: Path) -> None:  # noqa: F811
    """The segment runner exports CHAINRUN_CHAIN_ID and CHAINRUN_RUN_ID to the command."""
    seen = []
    for n in (1, 2, 3):
        proc, job = run_wrapper(work, 'echo "$CHAINRUN_CHAIN_ID $CHAINRUN_RUN_ID" > seen', n=n)
        assert proc.returncode == 0, proc.stderr
        seen.append((work / "seen").read_text().split())
    assert seen == [[job.chain_id, tracker_run_id(job.chain_id)]] * 3
