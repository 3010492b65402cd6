"""The fence at the checkpoint (chainrun/checkpoint/_fence.py): once a newer segment of a
chain has started, an older one that still runs (a pool host cut off but alive, a second
successor, a requeue racing its successor) never commits into the checkpoint directory again.
The helper refuses its commit; the runner stops a command that saves without the helper, and
a segment that starts after a newer one never runs its command; decide charges nothing."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from conftest import wait_for
from test_decide import BEFORE, NOW, chain, run, seg
from test_wrapper import marker, start_logged, wrapper_spec

from chainrun.checkpoint import FENCED_EXIT, CheckpointDir, Fenced, load_progress
from chainrun.checkpoint import _fence as fence
from chainrun.decide import JobFacts
from chainrun.model import EndMarker, EndSegment, ListedJob, Outcome, Phase
from chainrun.schedulers.segment import SegmentJob

CHAIN = "hostile-1a2b3c"


def test_the_helper_commits_while_its_segment_holds_the_fence_and_never_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Segment 1 commits while the fence holds its token (or no fence is there). Once segment
    2 has taken the directory, segment 1's next save is refused at the commit: Fenced (a
    SystemExit with FENCED_EXIT, so a loop's ``except Exception`` cannot swallow it), one line
    on stderr, and the sidecar still names the checkpoint committed before."""
    ckpt = CheckpointDir(tmp_path / "ckpt")
    one = fence.Token(CHAIN, 1, 0, "101")
    monkeypatch.setenv(fence.FENCE_VAR, one.text().strip())
    ckpt.save(b"no fence yet", epoch=1, step=0)
    assert fence.take(str(ckpt.path), one) is None
    ckpt.save(b"epoch 2", epoch=2, step=0)
    assert load_progress(ckpt.path)["epoch"] == 2
    two = fence.Token(CHAIN, 2, 0, "102")
    assert fence.take(str(ckpt.path), two) is None
    assert fence.take(str(ckpt.path), one) == two  # the older one cannot take it back
    with pytest.raises(Fenced) as refused:
        ckpt.save(b"a zombie's epoch 3", epoch=3, step=0)
    assert refused.value.code == FENCED_EXIT
    assert capsys.readouterr().err == (
        f"chainrun: segment 1 (job 101) is fenced: segment 2 (job 102) of the chain now owns {ckpt.path}; "
        "this save was not committed, and the command stops\n"
    )
    assert load_progress(ckpt.path)["epoch"] == 2
    assert not [n for n in os.listdir(ckpt.path) if n.startswith(".chainrun-progress")]  # no temp left
    monkeypatch.setenv(fence.FENCE_VAR, two.text().strip())
    ckpt.save(b"epoch 3", epoch=3, step=0)  # the owner commits
    assert load_progress(ckpt.path)["epoch"] == 3


def test_a_requeued_run_of_a_segment_is_newer_and_a_later_job_of_one_segment_wins() -> None:
    first, again = fence.Token(CHAIN, 4, 0, "7"), fence.Token(CHAIN, 4, 1, "7")
    assert again.newer_than(first) and not first.newer_than(again)
    assert not fence.Token(CHAIN, 5, 0, "8").newer_than(fence.Token(CHAIN, 5, 0, "9"))  # equals: last wins
    assert not fence.Token("other", 9, 0, "1").newer_than(first)  # another chain: never newer
    assert fence.parse(again.text()) == again and fence.parse("a b c d") is None


def test_a_fence_reads_only_as_four_fields_with_numbers_where_numbers_go() -> None:
    """Anything else (a torn write, a stray file) is no token, which holds no one's commit."""
    assert [fence.parse(text) for text in ("c 1 0 -\n", "c 12 3 j9", " c  1 0  j ")] == [
        fence.Token("c", 1, 0, ""),
        fence.Token("c", 12, 3, "j9"),
        fence.Token("c", 1, 0, "j"),
    ]
    torn = ("", "c 1 0", "c 1 0 j extra", "c x 0 j", "c 1 -1 j", "c 1 y j", "c -1 0 j")
    assert [fence.parse(text) for text in torn] == [None] * len(torn)
    assert fence.Token("c", 2, 0, "").text() == "c 2 0 -\n"
    assert fence.Token("c", 2, 0, "").describe() == "segment 2 (job ?)"
    assert fence.Token("c", 2, 1, "j7").describe() == "segment 2, run 2 (job j7)"


def test_only_the_fences_token_or_no_fence_at_all_lets_a_segment_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No fence: a directory set up anew, anyone commits. A fence that does not read (torn)
    holds no one's: the segment is fenced, by "another run". A process
    that is no segment of a chain (no CHAINRUN_FENCE) is never fenced."""
    one = fence.Token(CHAIN, 1, 0, "101")
    assert fence.read(str(tmp_path)) is None and fence.holds(str(tmp_path), one)
    path = tmp_path / fence.FENCE_NAME
    path.write_bytes(b"\xff\xfe 1 0 101")  # not UTF-8: still read, as no chain of ours
    assert fence.read(str(tmp_path)) == fence.Token("\ufffd\ufffd", 1, 0, "101")
    path.write_text(f"{CHAIN} 1")
    assert fence.read(str(tmp_path)) is None and not fence.holds(str(tmp_path), one)
    monkeypatch.setenv(fence.FENCE_VAR, one.text().strip())
    with pytest.raises(Fenced) as refused:
        fence.check(str(tmp_path))
    assert str(refused.value) == (
        f"chainrun: segment 1 (job 101) is fenced: another run of the chain now owns {tmp_path}; "
        "this save was not committed, and the command stops"
    )
    assert capsys.readouterr().err == str(refused.value) + "\n"
    path.write_text(one.text())
    fence.check(str(tmp_path))  # its own token: it commits
    path.write_text(fence.Token(CHAIN, 1, 1, "101").text())
    with pytest.raises(Fenced):
        fence.check(str(tmp_path))  # a requeued run of itself took it
    assert "is fenced: segment 1, run 2 (job 101) of the chain now owns" in capsys.readouterr().err
    monkeypatch.delenv(fence.FENCE_VAR)
    fence.check(str(tmp_path))
    assert capsys.readouterr().err == ""


def test_taking_the_fence_replaces_it_whole_and_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same segment, or another chain's, takes the fence; the lock beside it is private.
    A take that fails to write leaves the fence as it was and no temporary file."""
    one, other = fence.Token(CHAIN, 5, 0, "j5"), fence.Token("other", 1, 0, "k1")
    assert fence.take(str(tmp_path), one) is None and fence.take(str(tmp_path), one) is None
    assert fence.take(str(tmp_path), other) is None and fence.read(str(tmp_path)) == other
    lock = tmp_path / (fence.FENCE_NAME + ".lock")
    assert lock.stat().st_mode & 0o777 == 0o600
    assert sorted(os.listdir(tmp_path)) == [fence.FENCE_NAME, fence.FENCE_NAME + ".lock"]

    renamed = []

    def full(src: str, dst: str) -> None:
        renamed.append((src, dst))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fence.os, "replace", full)
    with pytest.raises(OSError):
        fence.take(str(tmp_path), one)
    temp = str(tmp_path / f"{fence.FENCE_NAME}.{os.getpid()}.tmp")  # beside the fence: one file system
    assert renamed == [(temp, str(tmp_path / fence.FENCE_NAME))]
    assert fence.read(str(tmp_path)) == other
    assert sorted(os.listdir(tmp_path)) == [fence.FENCE_NAME, fence.FENCE_NAME + ".lock"]
    monkeypatch.undo()
    os.mkdir(temp)  # the temporary file cannot even be made: that error, the fence as it was
    with pytest.raises(IsADirectoryError):
        fence.take(str(tmp_path), one)
    assert fence.read(str(tmp_path)) == other


def test_only_a_fences_first_512_bytes_are_read(tmp_path: Path) -> None:
    """A token is one short line; what a stray writer appended past 512 bytes is not read."""
    token = fence.Token(CHAIN, 3, 0, "j3")
    (tmp_path / fence.FENCE_NAME).write_text(token.text().ljust(512) + "appended")
    assert fence.read(str(tmp_path)) == token


def test_a_segment_whose_fence_a_newer_one_took_stops_its_command_at_no_cost(work: Path) -> None:
    """A command that saves without the helper (and ignores the walltime signal and TERM)
    runs as segment 1; segment 2 takes the checkpoint directory, as its runner does when
    it starts elsewhere. The runner kills the command within seconds, queues nothing, and
    its end marker says fenced, which decide records as free."""
    spec = replace_command(
        work,
        "trap '' USR1 TERM; printf '%s' \"$CHAINRUN_FENCE\" > fence-seen; "
        'while true; do date +%s%N > "$CHAINRUN_CHECKPOINT_DIR/model.txt"; sleep 0.2; done',
    )
    job = SegmentJob(CHAIN, 1, spec, 60)
    runner = start_logged(job)
    ckpt = spec.checkpoint_dir
    wait_for(lambda: fence.read(ckpt) is not None and (work / "fence-seen").exists(), 30, "segment 1's fence")
    assert fence.read(ckpt) == fence.Token(CHAIN, 1, 0, "")
    assert (work / "fence-seen").read_text() == f"{CHAIN} 1 0 -"  # the helper's CHAINRUN_FENCE
    assert fence.take(ckpt, fence.Token(CHAIN, 2, 0, "j2")) is None
    assert runner.wait(timeout=30) == 0
    stopped = Path(ckpt, "model.txt").read_text()
    time.sleep(0.5)  # what a command that still ran would have written by now
    assert Path(ckpt, "model.txt").read_text() == stopped
    end = marker(job)
    assert end.fenced == "segment 2 (job j2)" and end.outcome() is Outcome.FENCED
    assert "segment 1 fenced: segment 2 (job j2) of the chain owns" in Path(job.log_path).read_text()
    assert not list(Path(job.run_dir).glob("seg-*.queued"))
    decided = run(chain(seg(1, job="j1")), {"j1": ended_with(end)}, BEFORE)[0]
    assert isinstance(decided, EndSegment) and decided.outcome is Outcome.FENCED and not decided.charged
    assert decided.reason.startswith("fenced: ") and decided.reason.endswith(": free")


def test_a_segment_that_starts_after_a_newer_one_never_runs_its_command(work: Path) -> None:
    """Segment 2 starts late (a second successor, say) and finds segment 3's fence: it exits
    at once, skipped and fenced, and leaves the fence to segment 3."""
    spec = replace_command(work, "touch ran")
    os.makedirs(spec.checkpoint_dir)
    three = fence.Token(CHAIN, 3, 0, "j3")
    fence.take(spec.checkpoint_dir, three)
    job = SegmentJob(CHAIN, 2, spec, 60)
    assert start_logged(job).wait(timeout=60) == 0
    assert not (work / "ran").exists()
    end = marker(job)
    assert end.skipped and end.fenced == "segment 3 (job j3)" and end.outcome() is Outcome.FENCED
    assert fence.read(spec.checkpoint_dir) == three


def replace_command(work: Path, command: str):  # type: ignore[no-untyped-def]
    from dataclasses import replace

    return replace(wrapper_spec(work), command=command)


def ended_with(end: EndMarker) -> JobFacts:
    return JobFacts(
        listed=ListedJob("j1", "j1", Phase.ENDED, Outcome.COMPLETED, 0, NOW - 60, NOW - 1), end=end
    )


@pytest.fixture
def work(tmp_path: Path) -> Path:
    path = tmp_path / "my run's dir $x"
    path.mkdir()
    return path
