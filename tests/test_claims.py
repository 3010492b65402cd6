"""One chain per checkpoint directory (issue 26.1).

`chainrun submit job.toml` twice printed two chain ids, and both chains ran at once: the
second resumed from what the first had saved. Now a job file whose chain is still active
gets that chain back; any other chain training into the same directory is refused at
`check` and `submit`, naming the chain that holds it; and the refusal is made again inside
the transaction that stores, so two commands at once cannot both pass.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import REPO, cli_env

from chainrun import control, jobfile, progress
from chainrun.errors import ChainrunError
from chainrun.store import Store

CLI = Callable[..., subprocess.CompletedProcess[str]]
TRAINER = REPO / "tests" / "data" / "trainer.py"


def job(work: Path, name: str = "net", checkpoint_dir: str = "checkpoints", **extra: str) -> Path:
    """A job file in ``work`` for a trainer far too long to end during the test."""
    work.mkdir(exist_ok=True)
    shutil.copy(TRAINER, work / "trainer.py")
    path = work / f"{name}.toml"
    lines = [
        f'name = "{name}"',
        'command = "python3 trainer.py --epochs 1000 --epoch-time 1"',
        'total_time = "1h"',
        'walltime = "10m"',
        "target_epoch = 1000",
        f"checkpoint_dir = {json.dumps(checkpoint_dir)}",
        *(f"{k} = {json.dumps(v)}" for k, v in extra.items()),
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def stored(home: Path) -> list[tuple[str, str]]:
    """The chains in the state directory: (id, name), oldest first."""
    store = Store(home, readonly=True)
    try:
        return [(c.id, c.spec.name) for c in store.chains()]
    finally:
        store.close()


def test_submitting_a_job_file_twice_returns_the_chain_still_running(
    tmp_path: Path, home: Path, chainrun: CLI
) -> None:
    """The second submit prints the first chain's id, says it is still running, exits 0
    and stores nothing; `run` of the same job file follows that chain."""
    path = job(tmp_path / "work")
    first = chainrun("submit", str(path), check=True)
    again = chainrun("submit", str(path))
    assert again.returncode == 0, again.stderr
    assert again.stdout == first.stdout
    (chain_id,) = first.stdout.split()
    assert f"net: still running as chain {chain_id}; left as it is" in again.stderr
    assert stored(home) == [(chain_id, "net")]
    check = chainrun("check", str(path))
    assert check.returncode == 0, check.stderr
    assert f"net is still running as chain {chain_id}; submit returns it as it is" in check.stderr
    follow = subprocess.Popen(
        [sys.executable, "-m", "chainrun", "run", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=cli_env(home),
    )
    try:
        assert follow.stdout is not None
        assert follow.stdout.readline() == f"following chain {chain_id}, already running\n"
    finally:
        follow.kill()
        follow.wait()
    assert stored(home) == [(chain_id, "net")]


def test_another_job_training_into_the_same_directory_is_refused_at_check_and_submit(
    tmp_path: Path, home: Path, chainrun: CLI
) -> None:
    """A job of another name whose checkpoint_dir is the same directory (here through a
    symlink) is refused at check and submit with the holder's id and what to do; nothing
    is stored. A directory of its own is taken."""
    work = tmp_path / "work"
    (chain_id,) = chainrun("submit", str(job(work)), check=True).stdout.split()
    (work / "checkpoints").mkdir(exist_ok=True)
    os.symlink(work / "checkpoints", tmp_path / "link")
    other = job(tmp_path / "other", name="net2", checkpoint_dir=str(tmp_path / "link"))
    for command in ("check", "submit"):
        refused = chainrun(command, str(other))
        assert refused.returncode == 1 and refused.stdout == "", refused.stdout + refused.stderr
        assert refused.stderr == (
            f"chainrun: {other}: checkpoint_dir {tmp_path / 'link'} is where chain {chain_id} (net) "
            "still trains, and two chains there would resume from each other's checkpoints; give "
            f"this job a checkpoint_dir of its own, or cancel that chain first (`chainrun cancel {chain_id}`)\n"
        )
    assert stored(home) == [(chain_id, "net")]
    own = job(tmp_path / "other", name="net2", checkpoint_dir="own")
    assert len(chainrun("submit", str(own), check=True).stdout.split()) == 1
    assert len(stored(home)) == 2


def test_a_directory_inside_or_around_an_active_chains_is_refused_too(
    tmp_path: Path, home: Path, chainrun: CLI
) -> None:
    """A chain in ckpt/ and another in ckpt/run1/ each see the other's files, and --fresh on
    the outer one would move the inner one's checkpoints aside: refused, both ways round,
    naming the chain and the directory; the same job file moved into a subdirectory of its
    own running chain is not that chain submitted again, and is refused as well. A sibling
    directory (ckpt-2/, a name that only starts the same) is free."""
    work = tmp_path / "work"
    outer = work / "ckpt"
    (chain_id,) = chainrun("submit", str(job(work, checkpoint_dir=str(outer))), check=True).stdout.split()
    for name, directory, how in (
        ("inner", outer / "run1", f"is inside {outer}"),
        ("around", work, f"holds {outer}"),
        ("net", outer / "again", f"is inside {outer}"),  # the same name, another directory
    ):
        other = job(tmp_path / name, name=name, checkpoint_dir=str(directory))
        for command in ("check", "submit"):
            refused = chainrun(command, str(other))
            assert refused.returncode == 1, refused.stdout + refused.stderr
            assert refused.stderr.startswith(
                f"chainrun: {other}: checkpoint_dir {directory} {how}, where chain {chain_id} (net) still trains"
            ), refused.stderr
    assert stored(home) == [(chain_id, "net")]
    sibling = job(tmp_path / "sibling", name="sibling", checkpoint_dir=str(work / "ckpt-2"))
    assert len(chainrun("submit", str(sibling), check=True).stdout.split()) == 1


def test_fresh_never_moves_the_directory_of_a_chain_still_training(
    tmp_path: Path, home: Path, chainrun: CLI
) -> None:
    """--fresh on a job file whose chain is active is refused: moving its checkpoints
    aside would pull them from under it. Once that chain is cancelled, --fresh starts over."""
    path = job(tmp_path / "work")
    (chain_id,) = chainrun("submit", str(path), check=True).stdout.split()
    (tmp_path / "work" / "checkpoints").mkdir()
    refused = chainrun("submit", "--fresh", str(path))
    assert refused.returncode == 1, refused.stderr
    assert f"chain {chain_id} of net still trains in" in refused.stderr
    assert f"cancel it first (`chainrun cancel {chain_id}`)" in refused.stderr
    assert (tmp_path / "work" / "checkpoints").is_dir()
    assert [p.name for p in (tmp_path / "work").iterdir() if ".old-" in p.name] == []
    chainrun("cancel", chain_id, check=True)
    fresh = chainrun("submit", "--fresh", str(path), check=True)
    assert fresh.stdout.split() != [chain_id] and len(stored(home)) == 2


def test_two_jobs_of_one_submission_sharing_a_directory_are_refused(
    tmp_path: Path, home: Path, chainrun: CLI
) -> None:
    """Two job files submitted together with one checkpoint_dir: nothing is stored; a sweep
    whose checkpoint_dir forgets a parameter is refused the same way."""
    shared = str(tmp_path / "ckpt")
    one, two = (
        job(tmp_path / "a", checkpoint_dir=shared),
        job(tmp_path / "b", name="b", checkpoint_dir=shared),
    )
    refused = chainrun("submit", str(one), str(two))
    assert refused.returncode == 1 and f"checkpoint_dir {shared} is also net's" in refused.stderr
    sweep = job(tmp_path / "s", name="lrs", checkpoint_dir="ckpt/{rep}")
    sweep.write_text(sweep.read_text() + "[sweep]\nreps = 1\n[sweep.grid]\nlr = [0.1, 0.01]\n")
    refused = chainrun("submit", str(sweep))
    assert refused.returncode == 1 and "is also lrs-" in refused.stderr, refused.stderr
    outer, inner = (
        job(tmp_path / "c", name="outer", checkpoint_dir=str(tmp_path / "nest")),
        job(tmp_path / "d", name="inner", checkpoint_dir=str(tmp_path / "nest" / "in")),
    )
    refused = chainrun("submit", str(outer), str(inner))
    assert refused.returncode == 1, refused.stderr
    assert f"is inside {tmp_path / 'nest'}, which is outer's, submitted with it" in refused.stderr
    assert stored(home) == []


def test_a_chain_submitted_meanwhile_is_seen_by_the_transaction_that_stores(
    tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two shells submitting at once: the other one stores its chain after this one looked
    at the active chains and before it stores. The check inside the storing transaction
    sees it, and this submission stores nothing."""
    spec = jobfile.load(str(job(tmp_path / "work")))
    read = progress.read
    store = Store(home)
    raced: list[str] = []
    looked: list[bool] = []

    def the_other_shell_submits(*args: object) -> object:
        if not looked:
            looked.append(True)
            other = Store(home)
            try:
                raced.extend(chain_id for chain_id, _, _ in control.submit_all(other, [spec]))
            finally:
                other.close()
        return read(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(progress, "read", the_other_shell_submits)
    try:
        with pytest.raises(ChainrunError, match="submitted meanwhile; nothing stored"):
            control.submit_all(store, [spec])
    finally:
        store.close()
    assert stored(home) == [(raced[0], "net")]


def test_claims_clash_on_one_directory_or_one_inside_the_other_seen_from_a_machine_in_common() -> None:
    from chainrun.decide.claims import Claim, ancestors, inside

    here = frozenset({""})
    assert Claim(here, "/w/ckpt").clashes(Claim(here, "/w/ckpt"))
    assert Claim(here, "/w/ckpt/run1").clashes(Claim(here, "/w/ckpt"))
    assert Claim(here, "/w").clashes(Claim(here, "/w/ckpt/run1"))
    assert not Claim(here, "/w/ckpt-2").clashes(Claim(here, "/w/ckpt"))  # a name that starts the same
    assert not Claim(frozenset({"gpu1"}), "/w/ckpt").clashes(Claim(here, "/w/ckpt"))  # another machine's
    assert inside("/a/b", "/") and not inside("/", "/") and not inside("/a", "/a/b")
    assert ancestors("/a/b/c") == ["/a/b", "/a", "/"] and ancestors("/") == []


def test_the_chain_a_submission_meets_is_its_own_job_first_and_only_in_its_own_directory() -> None:
    from chainrun.decide.claims import Claim, Holder, holder, inside, same_job

    here = frozenset({""})
    mine = Claim(here, "/w/ckpt")
    other = Holder("other-1", "other", Claim(here, "/w/ckpt"))
    own = Holder("net-1", "net", Claim(here, "/w/ckpt"))
    nested = Holder("net-2", "net", Claim(here, "/w/ckpt/run1"))
    assert same_job("net", mine, own)
    assert not same_job("net", mine, other) and not same_job("net", mine, nested)
    assert holder("net", mine, [other, nested, own]) == own  # its own job file's chain, found first
    assert holder("net", mine, [other, nested]) == other
    assert holder("net", mine, []) is None
    assert inside("/w/ckptX/a", "/w/ckptX") and not inside("/w/ckpt", "/w/ckptX")


def test_aliases_are_named_by_the_hostname_and_port_they_reach(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ssh -G`'s view: two aliases of one HostName and port are one name, whatever case it is
    written in; another port is another sshd; an alias with no HostName names itself."""
    from chainrun.transport import canonical_host

    config = tmp_path / "config"
    config.write_text(
        "Host gpu gpu-again\n    HostName Node1.example.org\n\nHost other\n    HostName node1.example.org\n"
        "    Port 2200\n\nHost *\n    User me\n"
    )
    monkeypatch.setenv("CHAINRUN_SSH_CONFIG", str(config))
    assert canonical_host("gpu") == canonical_host("gpu-again") == "node1.example.org:22"
    assert canonical_host("other") == "node1.example.org:2200"
    assert canonical_host("node1") == "node1:22"
