"""A pool as one of several places, on real machines (issue 39): a pool of one host (a real
sshd on loopback with a runner state of its own, as tests/test_pool.py makes pool hosts) is
the preferred place, the local runner on this machine the other. With the pool's one slot
taken (another chain's job on its host), the chain starts here; once the slot is free, the
pool starts the next segment as soon as here does and, listed first, wins: the chain moves
to the pool host, its checkpoint copied there from here and verified first, and completes
there. Nothing is charged; the final checkpoint holds every epoch once, the first ones
trained here, the last ones on the pool host."""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import REPO, wait_for
from private_sshd import PrivateSSHD
from test_decide import SPEC as DECIDE_SPEC
from test_places import completed_free

from chainrun.engine import Engine
from chainrun.localrunner import machine_dir
from chainrun.model import NO_PROGRESS, PlaceSpec, SchedulerSpec
from chainrun.store import Store
from chainrun.testing import FakeClock, FakeCluster, FakeTransport
from chainrun.transfer import Moved
from chainrun.transport import Transport

DATA = Path(__file__).parent / "data"
CLI = Callable[..., "subprocess.CompletedProcess[str]"]
Service = Callable[..., "subprocess.Popen[bytes]"]
EPOCHS = 60


def status(chainrun: CLI, chain_id: str) -> dict[str, Any]:
    return json.loads(chainrun("status", chain_id, "--json", check=True).stdout)[0]  # type: ignore[no-any-return]


def submit(chainrun: CLI, path: Path) -> str:
    return chainrun("submit", str(path), check=True).stdout.strip().splitlines()[-1]


def timeline(st: dict[str, Any]) -> str:
    """Which segment ran where, on which host, and the copy before it: the test's record."""
    lines = []
    for s in st["segments"]:
        copy = f"copy {s['copy']['bytes']}B" if s["copy"] else "-"
        lines.append(f"{s['n']} {s['place']} {s['host']} {s['job_id']} {s['outcome']} {copy} {s['reason']}")
    return "\n".join(lines)


def test_the_engine_copies_to_the_pool_host_a_move_is_placed_on_and_from_the_one_it_ran_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On scripted hosts (the copy itself recorded, as tests/test_transfer.py tests it): a
    cluster ``x`` that refuses the segment and a pool of ``a`` (busy) and ``b``. The first
    segment moves to the pool, placed on ``b``; once it has ended and ``x`` starts one now
    (listed first, it wins the tie), the next moves to ``x``, its checkpoint read on ``b``,
    where the chain ran, and written at ``x``."""
    clock = FakeClock()
    clusters = {name: FakeCluster(clock) for name in ("a", "b", "x")}
    clusters["b"].next_id, clusters["x"].next_id = 100, 200
    names = {id(c): name for name, c in clusters.items()}
    copies: list[tuple[str, str, str, str]] = []

    def copy(src: Transport, src_dir: str, dst: Transport, dst_dir: str) -> Moved:
        assert isinstance(src, FakeTransport) and isinstance(dst, FakeTransport)
        copies.append((names[id(src.cluster)], src_dir, names[id(dst.cluster)], dst_dir))
        return Moved((), 10, 0.5, "ab" * 32)

    monkeypatch.setattr("chainrun.engine.act.move_checkpoint", copy)
    other = PlaceSpec("x", SchedulerSpec(kind="fake", host="x"), "/w", "/w/ckpt", 100)
    pool = SchedulerSpec(kind="fake", hosts=("a", "b"), slots=1, workdir_shared=False)
    lab = PlaceSpec("lab", pool, "/p", "/p/ckpt", 100)
    # At the failure budget's edge, nothing is queued ahead: each segment is chosen anew.
    spec = replace(DECIDE_SPEC, scheduler=other.scheduler, places=(other, lab), max_failures=0)
    store = Store(tmp_path / "home")
    engine = Engine(
        store,
        clock=clock,
        transports=lambda host: clusters[host or ""].transport(host),
        schedulers=lambda kind, host: clusters[host or ""].scheduler(kind, host),
    )
    try:
        chain_id = store.add_chain(spec, NO_PROGRESS, clock()).id
        clusters["x"].start_in = None  # x refuses it
        clusters["a"].add_job("someone else's", "/elsewhere/job")  # a's one slot is taken,
        clusters["a"].start_in = None  # and a says it cannot start one
        clock.advance(10)
        engine.tick()
        (first,) = store.chain(chain_id).segments
        assert (first.n, first.place, first.host, first.job_id) == (1, "lab", "b", "100")
        assert copies == []  # nothing at x to copy yet
        moves = [e.message for e in store.events(chain_id) if e.kind == "move"]
        assert moves and moves[0].startswith("segment 1 goes to lab (host b): lab on b: starts now"), moves

        clusters["b"].start("100")
        clusters["b"].transport().makedirs("/p/ckpt")  # on b's own disk alone
        clusters["b"].checkpoint("/p/ckpt", epoch=3)
        clusters["b"].end("100", "timeout", epoch=3)
        clusters["x"].start_in = 0.0  # x starts one now: listed first, it wins the tie
        clock.advance(61)  # the places are asked again
        engine.tick()
        chain = store.chain(chain_id)
        second = chain.segments[-1]
        assert (second.n, second.place, second.host, second.job_id) == (2, "x", None, "200")
        assert copies == [("b", "/p/ckpt", "x", "/w/ckpt")]
        assert (second.copy_bytes, second.copy_digest) == (10, "ab" * 32)
        assert (chain.spec.place_name, chain.host, chain.cluster_key) == ("x", "x", ("fake", "x"))
    finally:
        store.close()


@pytest.mark.slow
@pytest.mark.ssh
def test_a_chain_moves_from_here_to_a_pool_host_when_its_slot_frees_and_completes_there(
    tmp_path: Path, chainrun: CLI, service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state-pool-a"
    (tmp_path / "pool-a").mkdir()
    sshd = PrivateSSHD(
        tmp_path / "pool-a", alias="pool-a", server=f"SetEnv CHAINRUN_HOME={state} POOL_HOST=1\n"
    )
    sshd.start()
    monkeypatch.setenv("CHAINRUN_SSH_CONFIG", str(sshd.config))  # for the CLI and the service
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(DATA / "trainer.py", work / "trainer.py")
    try:
        service(interval=1)
        # Another chain of the pool takes its host's one slot for ten minutes.
        blocker = work / "blocker.toml"
        blocker.write_text(
            f'name = "blocker"\ncommand = "sleep 600"\nworkdir = "{work}"\ncheckpoint_dir = "ckpt-blocker"\n'
            'total_time = "1h"\nwalltime = "10m"\n[scheduler]\nhosts = ["pool-a"]\nslots = 1\n'
        )
        blocker_id = submit(chainrun, blocker)
        wait_for(
            lambda: any(s["started_at"] for s in status(chainrun, blocker_id)["segments"]), 120, "the blocker"
        )
        # Here an epoch takes 3 s, 3 at most in a 12 s segment: the chain cannot finish here
        # (20 segments) before its places are asked again (once a minute); on the pool host, 0.1 s.
        command = (
            f"PYTHONPATH={REPO} python3 trainer.py --lineage --epochs {EPOCHS} "
            "--epoch-time ${POOL_HOST:+0.1}${POOL_HOST:-3}"
        )
        job = work / "job.toml"
        job.write_text(
            f'name = "poolplace"\ncommand = "{command}"\nworkdir = "{work}"\ntotal_time = "30m"\n'
            f'walltime = "12s"\ngrace = "2s"\ntarget_epoch = {EPOCHS}\nmax_failures = 1\n'
            '[[cluster]]\nname = "lab"\nhosts = ["pool-a"]\nslots = 1\ncheckpoint_dir = "ckpt-lab"\n'
            '[[cluster]]\nname = "here"\nkind = "local"\ncheckpoint_dir = "ckpt-here"\n'
        )
        chain_id = submit(chainrun, job)

        def started_here() -> bool:
            return any(
                s["place"] == "here" and s["started_at"] for s in status(chainrun, chain_id)["segments"]
            )

        wait_for(started_here, 120, "a segment to start here, the pool host's slot taken")
        chainrun("cancel", blocker_id, check=True)
        wait_for(lambda: status(chainrun, chain_id)["state"] != "active", 300, "the chain to end")
        st = status(chainrun, chain_id)
        print(timeline(st))
        completed_free(st)
        ran = [s for s in st["segments"] if s["started_at"]]
        assert ran[0]["place"] == "here" and ran[-1]["place"] == "lab", timeline(st)
        assert {s["host"] for s in ran if s["place"] == "lab"} == {"pool-a"}, timeline(st)
        # The first segment on the pool host found the checkpoint copied there from here, verified.
        moved = next(s for s in ran if s["place"] == "lab")
        assert moved["copy"] is not None and moved["copy"]["bytes"] > 0 and moved["copy"]["sha256"], timeline(
            st
        )
        events = json.loads(chainrun("history", chain_id, "--json", check=True).stdout)["events"]
        copies = [e["message"] for e in events if e["kind"] == "copy"]
        assert any("from here" in c and "to lab" in c and "verified" in c for c in copies), copies
        assert any(e["kind"] == "move" and "goes to lab (host pool-a)" in e["message"] for e in events), (
            events
        )
        # Every epoch once, in order; the first trained here, the last on the pool host.
        sidecar = json.loads((work / "ckpt-lab" / "chainrun-progress.json").read_text())
        made = json.loads((work / "ckpt-lab" / sidecar["file"]).read_text())["history"]
        assert [e[0] for e in made] == list(range(1, EPOCHS + 1))
        at = {place: {s["n"] for s in ran if s["place"] == place} for place in ("here", "lab")}
        assert made[0][1] in at["here"] and made[-1][1] in at["lab"], (made[0], made[-1], timeline(st))
    finally:
        sshd.stop()
        # The runner's supervisors and jobs outlive their sshd: cancel what a failure left.
        for jobdir in machine_dir(state / "local").glob("jobs/*"):
            (jobdir / "cancel").touch()
