"""A lab made real (issue 22): three "machines", each its own PID, hostname and mount
namespaces (``scripts/lab-machine``: its own /etc/machine-id and boot id) running its own
sshd on a loopback port, all sharing one home and one data directory, as an NFS lab does.

One sweep of 3 configurations x 2 repetitions (slots = 2, gpus_per_slot = 1) serves every
assertion: it completes; no host ever runs two runs on one GPU index (a lock per host and
GPU in the command) or more than its slots; no chain ever runs two segments at once (the
trainer's lock on its checkpoint directory); one machine is killed mid-run (its namespace's
init: a power loss), its chains are shown unreachable, then lost at no cost, and resume on
another machine from their checkpoint, each chain training every epoch exactly once; the
machine started again with the same identity runs nothing twice and its runner reads the
jobs it had as ended by the restart.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import REPO, need, wait_for
from private_sshd import PrivateSSHD

from chainrun.schedulers.local import runner_path

TRAINER = Path(__file__).parent / "data" / "trainer.py"
LAB_MACHINE = REPO / "scripts" / "lab-machine"
NAMES = ("lab-a", "lab-b", "lab-c")
TARGET = 16
CLI = Callable[..., "subprocess.CompletedProcess[str]"]


def _namespaces_work() -> bool:
    probe = ["unshare", "--pid", "--uts", "--mount", "--mount-proc", "--time", "--fork", "true"]
    return shutil.which("unshare") is not None and subprocess.run(probe, capture_output=True).returncode == 0


class Lab:
    """The machines, their client config, and the shared home their runners keep state in;
    with ``private``, that directory is each machine's own (its local disk)."""

    def __init__(self, root: Path, names: tuple[str, ...] = NAMES, private: Path | None = None) -> None:
        need("PID, hostname and mount namespaces", _namespaces_work(), "root and util-linux's unshare")
        self.root = root
        self.home = root / "shared-home"  # CHAINRUN_HOME of every machine: one NFS home
        self.machines: dict[str, PrivateSSHD] = {}
        env = ("env", f"LAB_PRIVATE={private}") if private is not None else ()
        for name in names:
            (root / name).mkdir(parents=True)
            self.machines[name] = PrivateSSHD(
                root / name,
                alias=name,
                server=f"SetEnv CHAINRUN_HOME={self.home}\n",
                launcher=(*env, str(LAB_MACHINE), name, str(self.dir(name))),
            )
        self.config = root / "ssh_config"
        self.config.write_text("".join(m.config.read_text() for m in self.machines.values()))
        self.config.chmod(0o600)

    def dir(self, name: str) -> Path:
        """Machine ``name``'s own files: its identity, and its copy of the private directory."""
        return self.root / name / "machine"

    def ssh(self, name: str, command: str) -> str:
        done = subprocess.run(
            ["ssh", "-F", str(self.config), name, command], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done
        return done.stdout


@contextlib.contextmanager
def running(lab: Lab, monkeypatch: pytest.MonkeyPatch) -> Iterator[Lab]:
    """The lab's machines started, the CLI and the service pointed at them; all stopped after."""
    monkeypatch.setenv("CHAINRUN_SSH_CONFIG", str(lab.config))
    try:
        for machine in lab.machines.values():
            machine.start()
        yield lab
    finally:
        for machine in lab.machines.values():
            machine.stop()  # the namespace's init, and with it all the machine ran


@pytest.fixture
def lab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Lab]:
    with running(Lab(tmp_path), monkeypatch) as made:
        yield made


def _chains(chainrun: CLI) -> list[dict[str, Any]]:
    return list(json.loads(chainrun("status", "--all", "--json", check=True).stdout))


def _hosts(chainrun: CLI) -> dict[str, dict[str, Any]]:
    return {h["host"]: h for h in json.loads(chainrun("status", "--hosts", "--json", check=True).stdout)}


def _live_host(chain: dict[str, Any]) -> str | None:
    return next((s["host"] for s in chain["segments"] if s["phase"] == "running"), None)


@pytest.mark.slow
@pytest.mark.ssh
def test_a_lab_of_three_machines_on_one_home_survives_losing_one_mid_run(
    lab: Lab, tmp_path: Path, chainrun: CLI, service: Callable[..., subprocess.Popen[bytes]]
) -> None:
    """The whole story of a lab's week, in one sweep (see the module's docstring)."""
    seen = {name: lab.ssh(name, "hostname; cat /etc/machine-id").split() for name in NAMES}
    assert [s[0] for s in seen.values()] == list(NAMES)
    assert len({s[1] for s in seen.values()}) == 3, seen  # three machine identities

    work = tmp_path / "data"  # the one data directory, seen by every machine
    work.mkdir()
    shutil.copy(TRAINER, work / "trainer.py")
    # A second run on one host's GPU at once finds its lock held (exit 42, noted); a second
    # segment of one chain at once finds the checkpoint directory locked (trainer --exclusive).
    command = (
        'flock -n -E 42 \\"gpu-$(hostname)-$CUDA_VISIBLE_DEVICES.lock\\" '
        f"python3 trainer.py --exclusive --epochs {TARGET} --epoch-time 1; rc=$?; "
        '[ $rc != 42 ] || echo \\"$(hostname) GPU $CUDA_VISIBLE_DEVICES\\" >>overlaps.log; '
        'echo \\"$(hostname) $CUDA_VISIBLE_DEVICES $CHAINRUN_SLOT\\" >>placements.log; exit $rc'
    )
    job = work / "sweep.toml"
    job.write_text(
        f'name = "lab"\ncommand = "{command}"\nworkdir = "{work}"\ncheckpoint_dir = "ckpt"\n'
        f'total_time = "10m"\nwalltime = "12s"\ngrace = "2s"\ntarget_epoch = {TARGET}\nmax_failures = 2\n'
        '[scheduler]\nhosts = ["lab-a", "lab-b", "lab-c"]\nslots = 2\ngpus_per_slot = 1\nhost_timeout = "20s"\n'
        "[sweep]\nreps = 2\n[sweep.grid]\nlr = [0.1, 0.01, 0.001]\n"
    )
    plan = chainrun("check", str(job), check=True).stdout
    assert f"{work} (shared by lab-a, lab-b, lab-c: a chain may resume on any of them)" in plan, plan
    chainrun("submit", str(job), check=True)
    service()

    # lab-a loses its power while chains run there, once they have saved an epoch.
    def under_way_on_a() -> bool:
        return any(_live_host(c) == "lab-a" and (c["epoch"] or 0) >= 1 for c in _chains(chainrun))

    wait_for(under_way_on_a, 180, "a chain under way on lab-a")
    lab.machines["lab-a"].stop()
    victims: set[str] = set()

    given: set[tuple[str, int]] = set()  # GPUs status --hosts showed given out, by host

    def shown_unreachable() -> bool:
        hosts = _hosts(chainrun)
        for h in hosts.values():
            if h["reachable"] and h["used"] is not None:
                assert h["used"] <= 2 and set(h["gpus"]) <= {0, 1}, h
                given.update((h["host"], g) for g in h["gpus"])
        a = hosts["lab-a"]
        victims.update(c["chain"] for c in a["chains"])
        return a["reachable"] is False and bool(victims)

    wait_for(shown_unreachable, 60, "lab-a shown unreachable with its chains")
    assert given, "status --hosts showed the GPUs given out on lab-b and lab-c"
    table = chainrun("status", "--hosts", check=True).stdout
    assert re.search(r"lab-a +UNREACHABLE since", table), table

    def lost() -> dict[str, list[dict[str, Any]]]:
        chains = [c for c in _chains(chainrun) if c["id"] in victims]
        return {c["id"]: [s for s in c["segments"] if s["outcome"] == "lost"] for c in chains}

    wait_for(lambda: all(lost().values()), 120, "lab-a's segments to be declared lost")
    for segments in lost().values():
        assert all(not s["charged"] and "host lab-a has not answered" in s["reason"] for s in segments)

    def moved() -> bool:
        """Each of lab-a's chains has a segment under way, or done, on another machine."""
        return all(
            any(s["host"] != "lab-a" and (s["ran"] or s["phase"] == "running") for s in c["segments"])
            for c in _chains(chainrun)
            if c["id"] in victims
        )

    wait_for(moved, 180, "lab-a's chains to resume on another machine")
    lab.machines["lab-a"].start()  # the same identity, a new boot
    polled = [json.loads(line) for line in lab.ssh("lab-a", f"python3 {runner_path()} poll").splitlines()]
    assert polled and all(j["state"] == "ended" for j in polled), polled
    assert any("machine restarted" in j["reason"] for j in polled), polled
    # The service sees lab-a again at its next poll of lab-a, after the tick it is in: with
    # six chains over SSH on a loaded machine (load 5-12 beside the suite), 60 s ran out.
    wait_for(lambda: _hosts(chainrun)["lab-a"]["reachable"] is True, 240, "lab-a shown reachable again")

    wait_for(
        lambda: [c["state"] for c in _chains(chainrun)] == ["completed"] * 6, 400, "six completed chains"
    )
    assert not (work / "overlaps.log").exists(), (work / "overlaps.log").read_text()
    placements = [line.split() for line in (work / "placements.log").read_text().splitlines()]
    assert {(host, gpu) for host, gpu, _ in placements} <= {(h, g) for h in NAMES for g in ("0", "1")}
    for c in _chains(chainrun):
        assert c["failures"] == 0, c
        epochs: list[int] = []
        for s in c["segments"]:
            log = work / ".chainrun" / c["id"] / f"seg-{s['n']:04d}.log"
            if log.exists():
                epochs += [int(m) for m in re.findall(r"^epoch (\d+) done$", log.read_text(), re.M)]
        assert sorted(epochs) == list(range(1, TARGET + 1)), (c["name"], epochs)  # each epoch once
        if c["id"] in victims:
            assert any(s["host"] != "lab-a" and s["ran"] for s in c["segments"]), c


@pytest.mark.slow
@pytest.mark.ssh
def test_a_chain_on_a_pool_without_a_shared_workdir_starts_and_stays_where_its_checkpoint_is(
    tmp_path: Path,
    chainrun: CLI,
    service: Callable[..., subprocess.Popen[bytes]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each machine has its own copy of the workdir (a local disk): `check` says it is not
    shared; at submit the checkpoint is found on lab-b's disk alone, so the chain starts
    there from it, stays there, and trains only the epochs that were left."""
    work = tmp_path / "local-disk"
    work.mkdir()
    lab = Lab(tmp_path / "lab", ("lab-a", "lab-b"), private=work)
    for name in lab.machines:
        (lab.dir(name) / "private").mkdir(parents=True)
        shutil.copy(TRAINER, lab.dir(name) / "private" / "trainer.py")
    on_b = lab.dir("lab-b") / "private"
    seeded = subprocess.run(
        [sys.executable, "trainer.py", "--epochs", "2", "--epoch-time", "0"],
        cwd=on_b,
        env={"CHAINRUN_CHECKPOINT_DIR": str(on_b / "ckpt"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
    )
    assert seeded.returncode == 0, seeded
    job = tmp_path / "job.toml"
    job.write_text(
        f'name = "disk"\ncommand = "python3 trainer.py --epochs 6 --epoch-time 1"\nworkdir = "{work}"\n'
        'checkpoint_dir = "ckpt"\ntotal_time = "5m"\nwalltime = "12s"\ngrace = "2s"\ntarget_epoch = 6\n'
        '[scheduler]\nhosts = ["lab-a", "lab-b"]\n'
    )
    with running(lab, monkeypatch):
        plan = chainrun("check", str(job), check=True).stdout
        assert "not shared: a file written through lab-a is not seen through lab-b" in plan, plan
        chainrun("submit", str(job), check=True)
        service()
        wait_for(
            lambda: [c["state"] for c in _chains(chainrun)] == ["completed"], 240, "the chain to complete"
        )
    (chain,) = _chains(chainrun)
    assert {s["host"] for s in chain["segments"]} == {"lab-b"}, chain
    assert chain["failures"] == 0 and chain["epoch"] == 6
    logs = (on_b / ".chainrun" / chain["id"]).glob("seg-*.log")
    epochs = [int(m) for log in logs for m in re.findall(r"^epoch (\d+) done$", log.read_text(), re.M)]
    assert sorted(epochs) == [3, 4, 5, 6]  # from lab-b's checkpoint of epoch 2, each once
    assert not (lab.dir("lab-a") / "private" / "ckpt").exists()


@pytest.mark.slow
@pytest.mark.ssh
def test_a_pool_host_cut_off_while_it_trains_never_commits_after_its_chain_moved_on(
    tmp_path: Path,
    chainrun: CLI,
    service: Callable[..., subprocess.Popen[bytes]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """lab-a is cut off (its sshd stopped), not killed: its segment trains on into the shared
    checkpoint directory. After host_timeout the chain resumes on lab-b, whose segment takes
    the directory's fence: lab-a's segment is stopped without committing again, and the
    successor queued behind it there, which starts once it ends, never runs its command.
    When lab-a is back, the chain completes, and the final checkpoint's history holds each
    epoch once, every one after the move trained on lab-b."""
    lab = Lab(tmp_path / "lab", ("lab-a", "lab-b"))
    work = tmp_path / "data"
    work.mkdir()
    shutil.copy(TRAINER, work / "trainer.py")
    epochs = 200  # 100 s: still training on lab-a when the chain moves on
    job = work / "job.toml"
    job.write_text(
        f'name = "cut"\ncommand = "python3 trainer.py --lineage --epochs {epochs} --epoch-time 0.5"\n'
        f'workdir = "{work}"\ncheckpoint_dir = "ckpt"\ntotal_time = "10m"\nwalltime = "5m"\n'
        f'grace = "5s"\ntarget_epoch = {epochs}\nmax_failures = 1\n'
        '[scheduler]\nhosts = ["lab-a", "lab-b"]\nhost_timeout = "15s"\n'
        f'[env]\nPYTHONPATH = "{REPO}"\n'  # the helper, as the nodes of a lab find it on the shared disk
    )
    with running(lab, monkeypatch):
        chainrun("submit", str(job), check=True)
        service()

        def under_way_on_a() -> bool:
            (chain,) = _chains(chainrun)
            return _live_host(chain) == "lab-a" and (chain["epoch"] or 0) >= 2

        wait_for(under_way_on_a, 180, "the chain under way on lab-a")
        lab.machines["lab-a"].cut_off()
        (chain,) = _chains(chainrun)
        run_dir = work / ".chainrun" / chain["id"]

        def moved() -> bool:
            (c,) = _chains(chainrun)
            return any(s["host"] == "lab-b" and s["phase"] == "running" for s in c["segments"])

        wait_for(moved, 240, "the chain to resume on lab-b")
        first = next(s["n"] for s in _chains(chainrun)[0]["segments"] if s["host"] == "lab-a")
        wait_for(lambda: (run_dir / f"seg-{first:04d}.end").exists(), 60, "lab-a's segment to stop")
        end = (run_dir / f"seg-{first:04d}.end").read_text()
        assert re.search(r"^fenced=segment \d+ \(job \d+\)$", end, re.M), end
        lab.machines["lab-a"].reconnect()
        wait_for(lambda: _chains(chainrun)[0]["state"] == "completed", 300, "the chain to complete")
    (chain,) = _chains(chainrun)
    assert chain["failures"] == 0, chain
    ckpt = work / "ckpt"
    committed = json.loads((ckpt / "chainrun-progress.json").read_text())
    history = json.loads((ckpt / committed["file"]).read_text())["history"]
    assert [e for e, _, _ in history] == list(range(1, epochs + 1)), history  # each epoch once
    moved_at = next(i for i, (_, _, host) in enumerate(history) if host == "lab-b")
    assert {host for _, _, host in history[moved_at:]} == {"lab-b"}, history
    queued = [s for s in chain["segments"] if s["host"] == "lab-a" and s["n"] != first]
    for s in queued:  # queued behind the cut-off one: it started after the move, and stopped at once
        marker = run_dir / f"seg-{s['n']:04d}.end"
        if marker.exists():
            assert "skipped=1" in marker.read_text() and "fenced=segment" in marker.read_text()
    logs = [run_dir / f"seg-{s['n']:04d}.log" for s in queued]
    assert not [log for log in logs if log.exists() and re.search(r"^epoch \d+ done$", log.read_text(), re.M)]
