"""A tick reads what changed: a checkpoint directory without a progress sidecar is listed
while its chain's segment just runs only when due (``progress.listing_due``, in windows that
grow with the segment's age: ``progress.listing_every``), and always when
a segment is judged, so a script that saves over its checkpoint in place is credited what it
saved. Through the real engine and store on the scripted cluster, and one real chain on the
local runner."""

from __future__ import annotations

import json
import random
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
from test_engine import SPEC, World

from chainrun.checkpoint import SIDECAR_NAME
from chainrun.cluster import Cluster
from chainrun.engine.observe import Polled, poll
from chainrun.model import Outcome, Phase
from chainrun.progress import PROGRESS_EVERY, PROGRESS_EVERY_MOST, listing_due, listing_every
from chainrun.schedulers.segment import ARRAY_PREFIX
from chainrun.testing import FakeCluster, FakeTransport

CLI = Callable[..., "subprocess.CompletedProcess[str]"]
CKPT = SPEC.checkpoint_dir
SIDECAR_PATH = f"{CKPT}/chainrun-progress.json"


# -- the due-time rule --------------------------------------------------------------


def offset_of(path: str) -> float:
    """Where ``path``'s windows start, found from the rule itself: the first moment after 0
    at which a listing made at 0 is due again."""
    t = 0.0
    while not listing_due(path, 0.0, t + 0.001):
        t += 0.001
    return round(t + 0.001, 3) % PROGRESS_EVERY


@pytest.mark.parametrize(
    ("last", "now", "due"),
    [
        (None, 0.0, True),  # never listed: now
        (0.0, 0.0, False),  # listed this very moment
        (1.0, 59.0, False),  # in the same window
        (0.0, 60.0, True),  # the next window
        (59.0, 61.0, True),  # across the window's edge, however short the wait
        (10.0, 500.0, True),  # long after
        (70.0, 55.0, True),  # the clock went back into the window before: listed again
        (70.0, 65.0, False),  # back, but within the same window
    ],
)
def test_a_listing_is_due_once_in_each_window_of_its_path(
    last: Optional[float], now: float, due: bool
) -> None:
    """The rule in the windows of one path (times given from the start of its window)."""
    path = SIDECAR_PATH
    shift = offset_of(path)
    moved = None if last is None else last + shift
    assert listing_due(path, moved, now + shift) is due


def test_each_directory_is_listed_once_a_window_and_many_are_spread_over_the_ticks() -> None:
    """1,000 chains first listed on one tick, then ticked every 10 s for 10 minutes: each is
    listed again once in every PROGRESS_EVERY (never twice within a tick of it), and the
    listings spread over the ticks rather than all coming due on one."""
    tick = 10.0
    paths = [f"/home/u/run{i}/checkpoints/chainrun-progress.json" for i in range(1000)]
    last = dict.fromkeys(paths, 0.0)
    listings: dict[str, list[float]] = {p: [0.0] for p in paths}
    per_tick = []
    for k in range(1, 61):
        now = k * tick
        due = [p for p in paths if listing_due(p, last[p], now)]
        for p in due:
            last[p] = now
            listings[p].append(now)
        per_tick.append(len(due))
    for times in listings.values():
        gaps = [b - a for a, b in zip(times[1:], times[2:])]  # after the first window
        assert all(PROGRESS_EVERY - tick <= g <= PROGRESS_EVERY + tick for g in gaps), gaps
        assert len(times) == 11  # the first listing, then one in each of 10 windows
    expected = len(paths) * tick / PROGRESS_EVERY
    assert max(per_tick) < 1.5 * expected, per_tick  # not all on one tick
    assert min(per_tick[6:]) > 0.5 * expected, per_tick


def test_listings_thin_out_as_a_segment_runs_and_many_spread_over_the_ticks() -> None:
    """1,000 chains whose segments started together, first listed then, ticked every 10 s
    for two hours, each listing standing in a window of ``listing_every`` for its segment's
    age: a directory is listed at most twice in each size of window (1, 2, 4 ... minutes,
    then PROGRESS_EVERY_MOST), about once in a PROGRESS_EVERY_MOST once the segment is that
    old, and the listings of the many spread over the ticks, not all on one."""
    tick = 10.0
    paths = [f"/home/u/run{i}/checkpoints/chainrun-progress.json" for i in range(1000)]
    last: dict[str, tuple[float, float]] = {}  # when each was listed, and its window's size
    listings: dict[str, list[float]] = {p: [] for p in paths}
    per_tick = []
    for k in range(int(2 * 3600 / tick) + 1):
        now = k * tick
        due = [p for p in paths if p not in last or listing_due(p, last[p][0], now, last[p][1])]
        for p in due:
            last[p] = (now, listing_every(0.0, now))
            listings[p].append(now)
        per_tick.append(len(due))
    sizes = int(PROGRESS_EVERY_MOST // PROGRESS_EVERY).bit_length()  # 60 s doubled up to the most
    for times in listings.values():
        assert len(times) <= 1 + 2 * sizes, times
        late = [t for t in times if t >= PROGRESS_EVERY_MOST]  # windows of the most, to 2 hours
        assert 1 <= len(late) <= 2, times
    late_ticks = per_tick[-int(3600 / tick) :]
    expected = len(paths) * tick / PROGRESS_EVERY_MOST
    assert max(late_ticks) < 8 * expected, late_ticks  # not all on one tick
    assert sum(late_ticks) < 2 * len(paths), late_ticks


# -- the engine on the scripted cluster ---------------------------------------------


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path / "home")
    yield w
    w.store.close()


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Every file-system call the engine makes through the scripted cluster's transport."""
    made: list[tuple[str, str]] = []
    for name in ("read_file", "stat", "listdir", "write_file", "create_file"):
        method = getattr(FakeTransport, name)

        def counting(
            self: FakeTransport, path: str, *args: object, _m: Any = method, _n: str = name, **kw: object
        ) -> object:
            made.append((_n, path))
            return _m(self, path, *args, **kw)

        monkeypatch.setattr(FakeTransport, name, counting)
    return made


def save_in_place(world: World, name: str = "model.pt") -> float:
    """The script saves its checkpoint over the old one, under the same name: the file
    changes, the directory does not. Returns the save's time."""
    world.engine.transports(None).write_file(f"{CKPT}/{name}", b"weights")
    return world.clock()


def running_chain(world: World) -> tuple[str, float, float]:
    """A chain whose segment 1 runs, with segment 2 queued behind it, and a checkpoint saved
    before segment 1 started (which its start marker records); when that was saved, and when
    segment 1 started."""
    chain_id = world.add(replace(SPEC, target_epoch=None))
    saved = save_in_place(world)
    world.tick()
    world.tick()
    started = world.clock()
    world.cluster.start("1", mtime=saved)
    world.tick()  # records that it runs: the chain is loaded anew
    world.tick()  # decided once on that, then quiet
    return chain_id, saved, started


def test_a_running_chain_without_a_sidecar_is_listed_only_when_due_and_not_decided_again(
    world: World, calls: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steady ticks make no file-system call for the chain but the due listings of its
    checkpoint directory, fewer as its segment runs, and one stat of its sidecar's path a tick
    in its segment's first minute only (a sidecar that comes then is read at once), and its
    facts stay equal, so decide() is not asked again; a save in place shows at the next due
    listing."""
    started = running_chain(world)[2]
    decided: list[str] = []
    import chainrun.engine as engine_module

    decide = engine_module.decide

    def counting(chain: object, facts: object, now: float) -> object:
        decided.append("decide")
        return decide(chain, facts, now)  # type: ignore[arg-type]

    monkeypatch.setattr(engine_module, "decide", counting)
    calls.clear()
    first_minute = 0
    while world.clock() + 10 < started + PROGRESS_EVERY:
        world.tick()
        first_minute += 1
    assert ("stat", f"{CKPT}/{SIDECAR_NAME}") in calls, "looked for in the first minute"
    assert calls.count(("stat", f"{CKPT}/{SIDECAR_NAME}")) <= first_minute, calls  # one a tick at most
    calls.clear()
    ticks = 30  # 300 s of 10 s ticks
    for _ in range(ticks):
        world.tick()
    assert set(calls) == {("listdir", CKPT)}, calls  # past the first minute: no stat between listings
    # Windows of 1, 2 and 4 minutes in these 5 minutes (its age 1 to 6 minutes): not one per tick.
    assert 2 <= calls.count(("listdir", CKPT)) <= 5, calls
    assert decided == [], "facts unchanged: decide() is not asked again"
    saved = save_in_place(world)
    by = saved + listing_every(started, saved) + 10
    while world.clock() < by and world.store.chains()[-1].latest.saved_at != saved:
        world.tick()
    assert world.store.chains()[-1].latest.saved_at == saved


def test_a_chain_an_hour_into_its_segment_is_listed_about_once_an_hour(
    world: World, calls: list[tuple[str, str]]
) -> None:
    """A chain whose segment has run for an hour, its script saving on its own: no
    file-system call for it in ten minutes of steady ticks, and at most one listing in its
    window's length (it was one a minute); a save in place shows by that window's end."""
    started = running_chain(world)[2]
    world.tick(3600)  # an hour on: its listing is due, and stands for the window of that age
    every = listing_every(started, world.clock())
    assert every >= 1800
    calls.clear()
    for _ in range(60):
        world.tick()
    assert calls.count(("listdir", CKPT)) <= 1, calls
    assert set(calls) <= {("listdir", CKPT)}, calls
    saved = save_in_place(world)
    while world.store.chains()[-1].latest.saved_at != saved:
        assert world.clock() < saved + every + 10, "shown by its window's end"
        world.tick(60)


@pytest.mark.parametrize("marker", [True, False], ids=["end marker", "no end marker"])
def test_a_segment_that_saved_in_place_after_the_last_listing_is_credited(
    world: World, calls: list[tuple[str, str]], marker: bool
) -> None:
    """The segment saves over its checkpoint in place after the service last listed the
    directory, and ends before the next listing is due: the tick that sees it end lists the
    directory then, so the segment is judged on the checkpoint it left, never charged "no
    progress". Without an end marker (its node lost), that listing is all there is."""
    chain_id, before, _ = running_chain(world)
    # Tick until a tick that listed the directory is followed by one where no listing is due.
    while True:
        calls.clear()
        world.tick()
        now = world.clock()
        if ("listdir", CKPT) in calls and not listing_due(SIDECAR_PATH, now, now + 10):
            break
    world.clock.advance(3)
    saved = save_in_place(world)
    assert saved > before
    mark = {"mtime": saved} if marker else {}
    world.cluster.end("1", "timeout", marker=marker, **mark)
    chain = world.tick(7)
    first = chain.segments[0]
    assert first.outcome is Outcome.TIMEOUT
    assert not first.charged, first.reason
    assert chain.failures == 0
    assert chain.progress.saved_at == saved, chain.progress
    assert "no progress" not in world.history(chain_id)


# -- a real chain on the local runner -----------------------------------------------

IN_PLACE = """
import os, signal, sys, time
path = os.path.join("checkpoints", "model.pt")
os.makedirs("checkpoints", exist_ok=True)
segments = int(open(path, "rb").read().split()[0]) if os.path.exists(path) else 0
if segments >= 3:
    sys.exit(0)  # trained enough: ends the chain
stop = []  # the signal stops it after the save under way: one cut off would leave the file empty
signal.signal(signal.SIGUSR1, lambda *_: stop.append(True))
def save(step):
    data = f"{segments + 1} {step}".encode()
    if HOW == "torch.save":
        import io, torch
        buffer = io.BytesIO()
        torch.save({"step": step}, buffer)
        data = data + b" " + buffer.getvalue()
    with open(path, "wb") as f:  # over the old file: the directory does not change
        f.write(data)
step = 0
while not stop:
    time.sleep(0.5)
    step += 1
    save(step)
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["torch.save", "plain write"])
def test_a_script_that_saves_over_its_checkpoint_in_place_is_never_charged(
    tmp_path: Path, chainrun: CLI, how: str
) -> None:
    """A script that saves to the same file name over and over (no sidecar, no new file: its
    checkpoint directory's mtime never moves after the first save) runs three segments to
    their walltime, each credited the progress it saved, then exits 0 on its own."""
    if how == "torch.save":
        pytest.importorskip("torch")
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text(f"HOW = {how!r}\n" + IN_PLACE)
    command = f"{shlex.quote(sys.executable)} train.py"
    (work / "job.toml").write_text(
        f'name = "inplace"\ncommand = {json.dumps(command)}\n'
        # 12 s: the first save comes after torch's import, which took over 4 s on a loaded machine.
        'total_time = "3m"\nwalltime = "12s"\ngrace = "2s"\nmax_failures = 0\n'
    )
    result = chainrun("run", str(work / "job.toml"), "--interval", "0.3")
    out = chainrun("status", "inplace", "--json", check=True).stdout
    st = json.loads(out)[0]
    assert result.returncode == 0, (result.stderr[-2000:], st["reason"])
    assert st["state"] == "completed", st["reason"]
    segments = st["segments"]
    assert [s["outcome"] for s in segments[:3]] == ["timeout"] * 3, segments
    assert not any(s["charged"] for s in segments), segments
    assert st["failures"] == 0


def test_a_sidecar_that_comes_after_the_segment_s_first_minute_is_read_at_the_next_listing(
    world: World, calls: list[tuple[str, str]]
) -> None:
    """Past its segment's first minute a chain whose directory had no sidecar is not looked
    at between listings; a sidecar that comes then (a script that uses the helper saving
    first after a long start) is read, and its epoch recorded, at the directory's next
    listing, at most a window of ``listing_every`` later, and from then on at every tick."""
    started = running_chain(world)[2]
    while world.clock() < started + PROGRESS_EVERY:
        world.tick()
    world.cluster.checkpoint(CKPT, epoch=3)
    came = world.clock()
    calls.clear()
    while world.store.chains()[-1].latest.epoch != 3:
        assert world.clock() < came + listing_every(started, came) + 10, "found by the next listing"
        world.tick()
    assert ("listdir", CKPT) in calls
    calls.clear()
    world.cluster.checkpoint(CKPT, epoch=4)
    assert world.tick().latest.epoch == 4, "a sidecar once found is read at every tick"


def test_a_sidecar_that_comes_in_the_segment_s_first_minute_is_read_at_the_next_tick(world: World) -> None:
    """In its segment's first minute the chain looks for a sidecar at every tick: a script
    that uses the helper is followed from its first save (the web page's curves keep every
    epoch), not from the directory's next listing."""
    started = running_chain(world)[2]
    assert world.clock() + 10 < started + PROGRESS_EVERY
    world.cluster.checkpoint(CKPT, epoch=1)
    assert world.tick().latest.epoch == 1


# -- the poll: what changed since the poll before ----------------------------------


def test_a_poll_indexes_anew_only_what_changed_and_says_what_did() -> None:
    """Chains' jobs and array tasks start, end, leave the listing, come twice under one tag
    (an interrupted submission), first in a few set steps, then at random, on the fake
    cluster (whose backend keeps its last listing's lines, as Slurm's does): each poll made
    with the poll before it indexes them as a whole index of its listing does (the jobs of
    one place in the listing's order), and its ``moved`` and ``touched`` name every job
    that changed and the chains and tasks they are of; a chain none of whose jobs changed
    keeps its very entry."""
    fake = FakeCluster(arrays=True)
    cluster = Cluster(fake.scheduler(), fake.transport())
    key = ("fake", "")
    first = [fake.add_job(f"cr.c{i}.1", f"/w/c{i}/seg-1") for i in range(12)]
    base = fake.add_job(f"{ARRAY_PREFIX}sweep", "/w/a/seg-1", task=0).split("_")[0]
    for index in range(1, 4):
        fake.add_task(base, index, f"{ARRAY_PREFIX}sweep", f"/w/a{index}/seg-1")
    polls = [poll(key, cluster)]

    def check() -> Polled:
        before = polls[-1]
        polled = poll(key, cluster, before)
        whole = poll(key, cluster)  # the same listing, indexed whole
        assert (polled.jobs, polled.tagged, polled.tasks) == (whole.jobs, whole.tagged, whole.tasks)
        if polled.since is not None:
            assert polled.since == before.serial
            changed = {
                i for i in {*before.jobs, *polled.jobs} if before.jobs.get(i) is not polled.jobs.get(i)
            }
            assert polled.moved == changed
            for chain_id, entry in polled.tagged.items():
                if chain_id not in polled.touched:
                    assert entry is before.tagged[chain_id], "untouched: its very entry"
            for job_id in changed:
                job = polled.jobs.get(job_id) or before.jobs[job_id]
                if job.name.startswith("cr."):
                    assert job.name.split(".")[1] in polled.touched
        polls.append(polled)
        return polled

    fake.vanish(first[0])  # c0's one job leaves the listing
    assert "c0" not in check().tagged
    second = fake.add_job("cr.c1.1", "/w/twice")  # c1's segment 1 twice
    assert [j.job_id for j in check().tagged["c1"][1]] == [first[1], second]
    fake.start(first[1])  # the first of the two changes: still first
    assert [j.job_id for j in check().tagged["c1"][1]] == [first[1], second]
    fake.end(f"{base}_2", "timeout")  # an array task
    assert check().tasks[(f"{ARRAY_PREFIX}sweep", 2)][0].phase is Phase.ENDED
    rng = random.Random(38)
    for _ in range(150):
        for _ in range(rng.choice([0, 0, 1, 1, 2, 5])):
            job_id = rng.choice(sorted(fake.jobs))
            change = rng.choice(["start", "end", "vanish", "next", "twice"])
            name = fake.jobs[job_id].live.name
            if change == "start" and fake.jobs[job_id].live.phase is Phase.PENDING:
                fake.start(job_id)
            elif change == "end":
                fake.end(job_id, "timeout")
            elif change == "vanish":
                fake.vanish(job_id)
            elif change == "next" and not name.startswith(ARRAY_PREFIX):
                chain, n = name.split(".")[1:]
                fake.add_job(f"cr.{chain}.{int(n) + 1}", f"/w/{chain}/seg-{int(n) + 1}", after=job_id)
            elif change == "twice":
                fake.add_job(name, "/w/twice")
        check()
    assert sum(p.since is not None for p in polls) > 60  # many polls were counted from the one before
