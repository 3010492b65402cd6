"""Code snapshots (snapshot = "git"): the chain runs the code as it was at submit, and the
user's repository is left exactly as it was. Real git, the real CLI and service, and for the
remote case the real loopback sshd (scripts/start-sshd) with the real Slurm behind it."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Callable

import pytest
from conftest import need, wait_for

TRAINER = Path(__file__).parent / "data" / "trainer.py"
SSH_CONFIG = "/var/lib/chainrun-test/ssh/config"
CLI = Callable[..., "subprocess.CompletedProcess[str]"]


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


# What an ordinary ML repository does (issue 23): data and checkpoints are gitignored and reached
# by relative path, and its tools make output directories of their own where it runs.
TRAIN = """\
import json, os, signal, sys, time
epochs, stop = int(sys.argv[1]), []
signal.signal(signal.SIGUSR1, lambda *_: stop.append(1))
data = open("data/x.txt").read().strip()
epoch = json.load(open("ckpt/state.json"))["epoch"] if os.path.exists("ckpt/state.json") else 0
with open("ckpt/versions.txt", "a") as f:
    f.write(open("version.txt").read())
os.makedirs("outputs", exist_ok=True)
while epoch < epochs and not stop:
    time.sleep(1)
    epoch += 1
    with open("ckpt/state.json.tmp", "w") as f:
        json.dump({"epoch": epoch, "data": data}, f)
    os.replace("ckpt/state.json.tmp", "ckpt/state.json")
    with open("runs/events.txt", "a") as f:
        f.write(f"{epoch}\\n")
    with open("outputs/log.txt", "a") as f:
        f.write(f"{epoch}\\n")
"""


def make_repo(path: Path) -> Path:
    """A repository with a committed trainer and version file, then an uncommitted edit of the
    version and an untracked file: what a user has mid-work."""
    path.mkdir(parents=True)
    git(path, "init", "-q", "-b", "main")
    git(path, "config", "user.name", "Test User")
    git(path, "config", "user.email", "test@example.org")
    (path / "train.py").write_text(TRAIN)
    (path / "version.txt").write_text("v1\n")
    (path / ".gitignore").write_text("data/\nckpt/\nruns/\noutputs/\n")
    git(path, "add", ".")
    git(path, "commit", "-q", "-m", "v1")
    (path / "version.txt").write_text("v2\n")  # the uncommitted edit the chain must run
    (path / "notes.py").write_text("# untracked, not ignored: in the snapshot\n")
    make_data(path)
    git(path, "add", "notes.py")  # staged: the index must come through unchanged too
    (path / "notes.py").write_text("# untracked, not ignored: in the snapshot (edited)\n")
    return path


def make_data(workdir: Path) -> None:
    """The gitignored data the training reads by relative path: never in the snapshot."""
    (workdir / "data").mkdir()
    (workdir / "data" / "x.txt").write_text("the data\n")
    (workdir / "data" / "big.bin").write_bytes(b"\0" * 1024)


def repo_state(repo: Path) -> tuple[str, bytes, str, str]:
    """What the user sees of the repository: status, the index file's bytes, branch, HEAD."""
    return (
        git(repo, "status", "--porcelain=v2", "--branch", "--untracked-files=all"),
        (repo / ".git" / "index").read_bytes(),
        git(repo, "symbolic-ref", "HEAD"),
        git(repo, "rev-parse", "HEAD"),
    )


def write_job(repo: Path, host: str = "", workdir: Path | None = None) -> Path:
    # Slurm (over SSH) signals 10-40 s into a one-minute job, and later while its controller is
    # away (another test stops it): 90 s of training is more than one job holds, whenever it comes.
    epochs, walltime, grace = (90, "1m", "50s") if host else (6, "5s", "2s")
    lines = [
        'name = "snap"',
        f'command = "exec python3 train.py {epochs}"',
        'total_time = "30m"',
        f'walltime = "{walltime}"',
        f'grace = "{grace}"',
        f"target_epoch = {epochs}",
        'snapshot = "git"',
        'checkpoint_dir = "ckpt"',
        'progress = "ckpt/state.json:epoch"',
        'tensorboard_dir = "runs"',
    ]
    if workdir is not None:
        lines.append(f"workdir = {json.dumps(str(workdir))}")
    if host:
        lines += ["[scheduler]", 'kind = "slurm"', f"host = {json.dumps(host)}"]
    path = repo / "chain.toml"
    path.write_text("\n".join(lines) + "\n")
    git(repo, "add", "chain.toml")  # part of the user's work, like any file
    return path


def change_everything(repo: Path) -> None:
    """After submit the user edits, commits and resets: none of it may reach the chain."""
    (repo / "version.txt").write_text("v3\n")
    git(repo, "commit", "-q", "-am", "v3")
    git(repo, "reset", "-q", "--hard", "HEAD~1")
    (repo / "version.txt").write_text("v4\n")


def run_to_the_end(chainrun: CLI, service: Callable[..., object], chain_id: str) -> dict:  # type: ignore[type-arg]
    service(interval=0.3)

    def ended() -> bool:
        out = chainrun("status", chain_id, "--json", check=True).stdout
        return json.loads(out)[0]["state"] in ("completed", "failed", "exhausted")

    wait_for(ended, 600, "the chain to end")
    return json.loads(chainrun("status", chain_id, "--json", check=True).stdout)[0]  # type: ignore[no-any-return]


def check_chain(repo: Path, chainrun: CLI, service: Callable[..., object], path: Path, workdir: Path) -> None:
    """The chain runs the submitted code, reads the workdir's gitignored data, and leaves its
    checkpoints, TensorBoard files and outputs in the workdir, where status reads them."""
    before = repo_state(repo)
    submitted = chainrun("submit", str(path))
    assert submitted.returncode == 0, submitted.stderr
    chain_id = submitted.stdout.split()[0]
    assert repo_state(repo) == before, "submit changed the user's repository"
    ref = f"refs/chainrun/{chain_id}"
    assert git(repo, "show", f"{ref}:version.txt") == "v2\n"  # the uncommitted edit
    assert "(edited)" in git(repo, "show", f"{ref}:notes.py")
    assert "data/big.bin" not in git(repo, "ls-tree", "-r", "--name-only", ref)
    assert git(repo, "rev-parse", f"{ref}^") == before[3]  # on top of the user's HEAD

    change_everything(repo)
    st = run_to_the_end(chainrun, service, chain_id)
    assert st["state"] == "completed", st["reason"]
    ran = [s for s in st["segments"] if s["started_at"] is not None]
    assert len(ran) >= 2, "the chain should span segments"
    versions = (workdir / "ckpt" / "versions.txt").read_text().splitlines()
    told = [(s["n"], s["outcome"], s["ran"], s["reason"]) for s in st["segments"]]
    assert versions == ["v2"] * len(versions) and len(versions) >= 2, (versions, told)
    assert st["failures"] == 0, told
    state = json.loads((workdir / "ckpt" / "state.json").read_text())
    assert state == {"epoch": st["target_epoch"], "data": "the data"}
    assert (workdir / "runs" / "events.txt").read_text().split() == [
        str(e + 1) for e in range(state["epoch"])
    ]
    assert len((workdir / "outputs" / "log.txt").read_text().split()) == state["epoch"]
    code = workdir / ".chainrun" / chain_id / "code"  # the chain's own copy of the snapshot
    assert all((code / name).is_symlink() for name in ("data", "ckpt", "runs", "outputs"))
    assert (code / "version.txt").read_text() == "v2\n"


def test_a_local_snapshot_chain_runs_the_submitted_code_and_leaves_the_repository_as_it_was(
    tmp_path: Path, chainrun: CLI, service: Callable[..., object]
) -> None:
    repo = make_repo(tmp_path / "repo")
    path = write_job(repo)
    check_chain(repo, chainrun, service, path, repo)


@pytest.mark.slow
@pytest.mark.ssh
@pytest.mark.slurm
def test_a_snapshot_chain_over_ssh_runs_the_submitted_code_uploaded_once(
    tmp_path: Path,
    chainrun: CLI,
    service: Callable[..., object],
    monkeypatch: pytest.MonkeyPatch,
    shared_slurm: None,
) -> None:
    """The repository is the job file's, on this machine; the code lands in the workdir on the
    remote host (here the loopback sshd's root, with the real Slurm behind it)."""
    ok = subprocess.run(
        ["ssh", "-F", SSH_CONFIG, "-o", "BatchMode=yes", "root-local", "true"], capture_output=True
    )
    need("the test sshd", ok.returncode == 0, "sudo scripts/start-sshd")
    monkeypatch.setenv("CHAINRUN_SSH_CONFIG", SSH_CONFIG)
    repo = make_repo(tmp_path / "laptop")
    remote = tmp_path / "cluster work"
    remote.mkdir()
    make_data(remote)
    path = write_job(repo, host="root-local", workdir=remote)
    check_chain(repo, chainrun, service, path, remote)


def test_check_refuses_a_snapshot_outside_a_git_repository_in_one_line(tmp_path: Path, chainrun: CLI) -> None:
    work = tmp_path / "plain"
    work.mkdir()
    path = work / "chain.toml"
    path.write_text('name = "s"\ncommand = "true"\ntotal_time = "1h"\nwalltime = "10m"\nsnapshot = "git"\n')
    result = chainrun("check", str(path))
    assert result.returncode == 2
    assert result.stderr.strip().endswith("is not inside a git repository") and result.stderr.count("\n") == 1


def test_gc_removes_the_snapshots_of_chains_that_ended_long_ago_never_one_in_use(
    tmp_path: Path,
    chainrun: CLI,
    service: Callable[..., subprocess.Popen[bytes]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`chainrun gc` and the service remove refs/chainrun/ID and the unpacked code of chains that
    ended more than gc_after ago; a sweep's code directory stays while one of its chains runs."""
    config = tmp_path / "config"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config))
    repo = make_repo(tmp_path / "repo")
    job = repo / "sweep.toml"
    job.write_text(
        'name = "gc"\ncommand = "sleep {t}"\ntotal_time = "30m"\nwalltime = "10m"\nsnapshot = "git"\n'
        "[[sweep.points]]\nt = 0\n[[sweep.points]]\nt = 600\n"
    )
    assert chainrun("submit", str(job)).returncode == 0
    first = service(interval=0.3)

    def chains() -> dict[str, dict]:  # type: ignore[type-arg]
        out = json.loads(chainrun("status", "gc", "--json", "--all", check=True).stdout)
        return {c["params"]["t"]: c for c in out}

    wait_for(lambda: chains()[0]["state"] == "completed", 120, "the short chain to complete")
    short, long = chains()[0]["id"], chains()[600]["id"]
    refs = lambda: git(repo, "for-each-ref", "--format=%(refname)", "refs/chainrun/").split()  # noqa: E731
    (code,) = (repo / ".chainrun" / "code").iterdir()
    kept = chainrun("gc", check=True).stdout
    assert kept.strip() == "nothing to remove" and f"refs/chainrun/{short}" in refs()

    def collected() -> bool:
        assert chainrun("gc", "--older-than", "1s").returncode == 0
        return f"refs/chainrun/{short}" not in refs()

    wait_for(collected, 60, "gc --older-than 1s to remove the short chain's ref")
    assert refs() == [f"refs/chainrun/{long}"] and (code / "train.py").exists(), "the long chain runs there"

    chainrun("cancel", long, check=True)
    wait_for(lambda: chains()[600]["state"] == "cancelled", 120, "the long chain to be cancelled")
    # The service collects at its start (then daily): the chain must have ended gc_after ago by then.
    wait_for(lambda: time.time() > chains()[600]["ended_at"] + 1.5, 60, "the long chain to have ended 1s ago")
    first.terminate()
    first.wait(60)
    (config / "chainrun").mkdir(parents=True)
    (config / "chainrun" / "config.toml").write_text('gc_after = "1s"\n')
    service(interval=0.3)
    wait_for(lambda: not refs() and not code.exists(), 60, "the service to remove the last ref and the code")


# A sweep's chains write results the ordinary way: a row a step, each save a `.tmp` then
# `os.replace`, into a directory the repository tracks; they read data from the repository's
# parent of the job's directory, and each rewrites a tracked file (issue 35, items 4 to 6).
SWEEP_TRAIN = """\
import os, signal, sys, time
lr, epochs, stop = sys.argv[1], int(sys.argv[2]), []
signal.signal(signal.SIGUSR1, lambda *_: stop.append(1))
data = open("../data/x.txt").read().strip()
out = f"results/lr{lr}.csv"
rows = open(out).read().splitlines() if os.path.exists(out) else []
while len(rows) < epochs and not stop:
    time.sleep(0.4)
    rows.append(f"{len(rows) + 1},{lr},{data}")
    with open(out + ".tmp", "w") as f:
        f.write(rows[0] + "\\n")
        f.flush()
        time.sleep(0.3)  # half-written for a while, as a big save is
        f.write("".join(r + "\\n" for r in rows[1:]))
    os.replace(out + ".tmp", out)
    with open(os.path.join(os.environ["CHAINRUN_CHECKPOINT_DIR"], "step"), "w") as f:
        f.write(str(len(rows)))
with open("config.yaml", "w") as f:
    f.write(f"lr: {lr}\\n")
"""
LRS = (1, 2, 3, 4)
EPOCHS = 10


def make_sweep(top: Path, host: str = "", workdir: Path | None = None) -> Path:
    """A repository whose job sits in ``exp/``, with a tracked ``results/`` directory and a
    tracked ``config.yaml``; the data lies (ignored) in the repository's top, ``../data``."""
    exp = top / "exp"
    (exp / "results").mkdir(parents=True)
    git(top, "init", "-q", "-b", "main")
    git(top, "config", "user.name", "Test User")
    git(top, "config", "user.email", "test@example.org")
    (top / ".gitignore").write_text("data/\ncheckpoints/\n")
    (exp / "train.py").write_text(SWEEP_TRAIN)
    (exp / "config.yaml").write_text("lr: none\n")
    (exp / "results" / "README.md").write_text("results land here\n")
    make_data(top)
    lines = [
        'name = "outs"',
        f'command = "exec python3 train.py {{lr}} {EPOCHS}"',
        'total_time = "10m"',
        'walltime = "6s"',  # 4 s to train: Python's start under a busy suite takes some
        'grace = "2s"',
        'snapshot = "git"',
    ]
    if workdir is not None:
        lines.append(f"workdir = {json.dumps(str(workdir))}")
    if host:
        lines += ["[scheduler]", f"host = {json.dumps(host)}"]
    lines += ["[sweep.grid]", f"lr = {list(LRS)}"]
    (exp / "sweep.toml").write_text("\n".join(lines) + "\n")
    git(top, "add", ".")
    git(top, "commit", "-q", "-m", "the experiment")
    return exp / "sweep.toml"


@pytest.mark.parametrize("where", ["local", pytest.param("ssh", marks=pytest.mark.ssh)])
def test_a_snapshot_sweep_brings_every_output_home_and_gc_keeps_them(
    tmp_path: Path,
    chainrun: CLI,
    service: Callable[..., object],
    monkeypatch: pytest.MonkeyPatch,
    where: str,
) -> None:
    """Four chains of one snapshot sweep each write their results file through a `.tmp` and
    `os.replace` in a tracked directory, and rewrite a tracked file: no chain touches another's
    half-written file, every result reaches the workdir (a clone here; over SSH a plain
    directory that has no `results/`), the tracked file that several chains rewrote is kept
    once in place and beside it for the others, named in their history; the data in the
    repository's parent directory is reached; and `gc` then removes the code, not the results."""
    host, workdir = "", None
    if where == "ssh":
        ok = subprocess.run(
            ["ssh", "-F", SSH_CONFIG, "-o", "BatchMode=yes", "root-local", "true"], capture_output=True
        )
        need("the test sshd", ok.returncode == 0, "sudo scripts/start-sshd")
        monkeypatch.setenv("CHAINRUN_SSH_CONFIG", SSH_CONFIG)
        host, workdir = "root-local", tmp_path / "cluster" / "exp run"
        workdir.mkdir(parents=True)
        make_data(workdir.parent)
    job = make_sweep(tmp_path / "repo", host, workdir)
    work = workdir or job.parent
    submitted = chainrun("submit", str(job))
    assert submitted.returncode == 0, submitted.stderr
    service(interval=0.3)

    def chains() -> list[dict]:  # type: ignore[type-arg]
        return json.loads(chainrun("status", "outs", "--json", "--all", check=True).stdout)  # type: ignore[no-any-return]

    def report(seen: list[dict]) -> str:  # type: ignore[type-arg]
        """Each chain's state, failures and segments, in full (pytest cuts a long repr short)."""
        return "\n".join(
            f"lr={c['params']['lr']} {c['state']}, {c['failures']} failures: "
            + "; ".join(f"{s['n']} {s['outcome']} ({s['reason']})" for s in c["segments"])
            for c in seen
        )

    final = ("completed", "failed", "exhausted", "cancelled")
    seen: list[dict] = []  # type: ignore[type-arg]

    def finished() -> bool:
        seen[:] = chains()
        return all(c["state"] in final for c in seen)

    with contextlib.suppress(AssertionError):
        wait_for(finished, 600, "the sweep's four chains to end")
    assert finished(), report(seen)
    ended, told = seen, report(seen)
    assert [c["state"] for c in ended] == ["completed"] * 4, told
    assert all(c["failures"] == 0 for c in ended), told
    assert all(len([s for s in c["segments"] if s["started_at"]]) >= 2 for c in ended), told
    for lr in LRS:
        rows = (work / "results" / f"lr{lr}.csv").read_text().splitlines()
        assert rows == [f"{e},{lr},the data" for e in range(1, EPOCHS + 1)], f"lr={lr}\n{told}"
    assert not list(work.rglob("*.tmp"))
    # config.yaml: one chain's in place, each other's beside it under its chain's name.
    beside = {p.name: p.read_text() for p in work.glob("config.yaml.chainrun-*")}
    assert len(beside) == 3, sorted(beside)
    kept = {(work / "config.yaml").read_text(), *beside.values()}
    assert kept == {f"lr: {lr}\n" for lr in LRS}
    for c in ended:
        name = f"config.yaml.chainrun-{c['id']}"
        history = chainrun("history", c["id"], check=True).stdout
        assert (name in beside) == (name in history), history

    # A file a segment left in its copy (killed before its last share), where the workdir's
    # directory cannot take it now: gc names the copy and keeps it, and the commit it came from.
    late = work / ".chainrun" / ended[0]["id"] / "code" / "exp" / "results" / "late.csv"
    late.write_text("written after the last share\n")
    with read_only(work / "results"):
        blocked = chainrun("gc", "--older-than", "0s")
    assert blocked.returncode == 1 and "late.csv" in blocked.stderr, blocked
    assert late.read_text() == "written after the last share\n"
    assert [p.name for p in (work / ".chainrun").glob("*/code")] == ["code"], "only the blocked copy stays"
    assert list((work / ".chainrun" / "code").iterdir()), "the commit it was copied from stays"
    collected = chainrun("gc", "--older-than", "0s")
    assert collected.returncode == 0, collected.stderr
    assert f"brought home {work / 'results' / 'late.csv'}" in collected.stdout
    assert (work / "results" / "late.csv").read_text() == "written after the last share\n"
    assert not list((work / ".chainrun" / "code").iterdir())
    assert not list((work / ".chainrun").glob("*/code")), "a chain's working copy is left"
    for lr in LRS:
        assert len((work / "results" / f"lr{lr}.csv").read_text().splitlines()) == EPOCHS


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """``path`` mounted read-only over itself for a while (as root: scripts/test runs so)."""
    need("root, to mount a directory read-only", os.geteuid() == 0, "run the tests as root")
    subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True)
        yield
    finally:
        subprocess.run(["umount", str(path)], check=True)
