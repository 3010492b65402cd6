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
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import REPO, cli_env, need

from chainrun import jobfile, progress, submission
from chainrun.errors import ChainrunError
from chainrun.store import Store

CLI = Callable[..., subprocess.CompletedProcess[str]]
TRAINER = REPO / "tests" / "data" / "trainer.py"
SSH_CONFIG = "/var/lib/chainrun-test/ssh/config"  # root-local and root-alias: this machine, as root


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
    symlink) is refused at check and submit with the holder's id and what to do, and the
    directory as written and as resolved; nothing is stored. A directory of its own is taken."""
    work = tmp_path / "work"
    (chain_id,) = chainrun("submit", str(job(work)), check=True).stdout.split()
    (work / "checkpoints").mkdir(exist_ok=True)
    os.symlink(work / "checkpoints", tmp_path / "link")
    other = job(tmp_path / "other", name="net2", checkpoint_dir=str(tmp_path / "link"))
    for command in ("check", "submit"):
        refused = chainrun(command, str(other))
        assert refused.returncode == 1 and refused.stdout == "", refused.stdout + refused.stderr
        assert refused.stderr == (
            f"chainrun: {other}: checkpoint_dir {tmp_path / 'link'} ({work / 'checkpoints'} on this "
            f"machine) is where chain {chain_id} (net) "
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
                raced.extend(chain_id for chain_id, _, _ in submission.submit_all(other, [spec]))
            finally:
                other.close()
        return read(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(progress, "read", the_other_shell_submits)
    try:
        with pytest.raises(ChainrunError, match="submitted meanwhile; nothing stored"):
            submission.submit_all(store, [spec])
    finally:
        store.close()
    assert stored(home) == [(raced[0], "net")]


def test_holds_clash_on_one_directory_or_one_inside_the_other_seen_from_a_machine_in_common() -> None:
    from chainrun.decide.holds import Hold, ancestors, inside

    here = frozenset({""})
    assert Hold(here, "/w/ckpt").clashes(Hold(here, "/w/ckpt"))
    assert Hold(here, "/w/ckpt/run1").clashes(Hold(here, "/w/ckpt"))
    assert Hold(here, "/w").clashes(Hold(here, "/w/ckpt/run1"))
    assert not Hold(here, "/w/ckpt-2").clashes(Hold(here, "/w/ckpt"))  # a name that starts the same
    assert not Hold(frozenset({"gpu1"}), "/w/ckpt").clashes(Hold(here, "/w/ckpt"))  # another machine's
    assert inside("/a/b", "/") and not inside("/", "/") and not inside("/a", "/a/b")
    assert ancestors("/a/b/c") == ["/a/b", "/a", "/"] and ancestors("/") == []


def test_the_chain_a_submission_meets_is_its_own_job_first_and_only_in_its_own_directory() -> None:
    from chainrun.decide.holds import Hold, Holder, holder, inside, same_job

    here = frozenset({""})
    mine = Hold(here, "/w/ckpt")
    other = Holder("other-1", "other", Hold(here, "/w/ckpt"))
    own = Holder("net-1", "net", Hold(here, "/w/ckpt"))
    nested = Holder("net-2", "net", Hold(here, "/w/ckpt/run1"))
    assert same_job("net", mine, own)
    assert not same_job("net", mine, other) and not same_job("net", mine, nested)
    assert holder("net", mine, [other, nested, own]) == own  # its own job file's chain, found first
    assert holder("net", mine, [other, nested]) == other
    assert holder("net", mine, []) is None
    assert inside("/w/ckptX/a", "/w/ckptX") and not inside("/w/ckpt", "/w/ckptX")


def remote_job(work: Path, name: str, host: str, checkpoint_dir: Path) -> Path:
    """A job file for ``host``, its workdir ``work`` there (here: this machine, through the sshd)."""
    path = job(work, name=name, checkpoint_dir=str(checkpoint_dir), workdir=str(work))
    path.write_text(path.read_text() + f"[scheduler]\nhost = {json.dumps(host)}\n")
    return path


@pytest.fixture
def sshd(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loopback sshd (scripts/start-sshd), its client config in CHAINRUN_SSH_CONFIG."""
    ok = subprocess.run(
        ["ssh", "-F", SSH_CONFIG, "-o", "BatchMode=yes", "root-alias", "true"], capture_output=True
    )
    need("the test sshd with its root-alias", ok.returncode == 0, "sudo scripts/start-sshd")
    monkeypatch.setenv("CHAINRUN_SSH_CONFIG", SSH_CONFIG)


def refused_at_check_and_submit(chainrun: CLI, path: Path) -> str:
    """The one line both ``check`` and ``submit`` refuse ``path`` with (exit 1, nothing printed)."""
    lines = []
    for command in ("check", "submit"):
        refused = chainrun(command, str(path))
        assert refused.returncode == 1 and refused.stdout == "", refused.stdout + refused.stderr
        lines.append(refused.stderr)
    assert lines[0] == lines[1] and lines[0].count("\n") == 1, lines
    return lines[0]


def test_two_aliases_of_one_host_are_one_machine(
    tmp_path: Path, home: Path, chainrun: CLI, sshd: None
) -> None:
    """A chain on `root-local` holds its directory against a job on `root-alias`, another alias of
    the same HostName and port: the same machine, the same directory."""
    ckpt = tmp_path / "ckpt"
    first = remote_job(tmp_path / "a", "net", "root-local", ckpt)
    (chain_id,) = chainrun("submit", str(first), check=True).stdout.split()
    other = remote_job(tmp_path / "b", "net2", "root-alias", ckpt)
    assert refused_at_check_and_submit(chainrun, other) == (
        f"chainrun: {other}: checkpoint_dir {ckpt} is where chain {chain_id} (net) still trains, and two "
        "chains there would resume from each other's checkpoints; give this job a checkpoint_dir of its "
        f"own, or cancel that chain first (`chainrun cancel {chain_id}`)\n"
    )
    assert stored(home) == [(chain_id, "net")]


def test_a_path_through_a_symlink_on_the_host_is_its_target(
    tmp_path: Path, home: Path, chainrun: CLI, sshd: None
) -> None:
    """On the host, `link` points at `ckpt` (and `nest` inside it): a job whose checkpoint_dir is
    the link, or is inside the link, is refused as the chain in `ckpt`, and the refusal says the
    directory as written, what it is on which host."""
    ckpt = tmp_path / "ckpt"
    (chain_id,) = chainrun(
        "submit", str(remote_job(tmp_path / "a", "net", "root-local", ckpt)), check=True
    ).stdout.split()
    ckpt.mkdir(exist_ok=True)
    os.symlink(ckpt, tmp_path / "link")
    same = remote_job(tmp_path / "b", "net2", "root-local", tmp_path / "link")
    assert refused_at_check_and_submit(chainrun, same).startswith(
        f"chainrun: {same}: checkpoint_dir {tmp_path / 'link'} ({ckpt} on root-local) is where chain {chain_id} (net)"
    )
    within = remote_job(tmp_path / "c", "net3", "root-alias", tmp_path / "link" / "run1")
    assert refused_at_check_and_submit(chainrun, within).startswith(
        f"chainrun: {within}: checkpoint_dir {tmp_path / 'link' / 'run1'} ({ckpt / 'run1'} on root-alias) "
        f"is inside {ckpt}, where chain {chain_id} (net) still trains"
    )
    assert stored(home) == [(chain_id, "net")]


def test_a_host_that_is_this_machine_clashes_with_a_chain_here(
    tmp_path: Path, home: Path, chainrun: CLI, sshd: None
) -> None:
    """`root-local` has this machine's machine id: a job there training into the directory of a
    chain run here is refused, and so is the other way round."""
    ckpt = tmp_path / "ckpt"
    (here,) = chainrun(
        "submit", str(job(tmp_path / "a", checkpoint_dir=str(ckpt))), check=True
    ).stdout.split()
    there = remote_job(tmp_path / "b", "net2", "root-local", ckpt)
    assert f"is where chain {here} (net) still trains" in refused_at_check_and_submit(chainrun, there)
    chainrun("cancel", here, check=True)
    (remote,) = chainrun("submit", str(there), check=True).stdout.split()
    again = job(tmp_path / "c", name="net3", checkpoint_dir=str(ckpt / "run1"))
    assert f"is inside {ckpt}, where chain {remote} (net2)" in refused_at_check_and_submit(chainrun, again)


def test_an_unreachable_host_is_compared_as_stored_and_submits_as_before(
    tmp_path: Path, home: Path, chainrun: CLI, sshd: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a host said at submit is kept with the chain: once `flaky` stops answering, a job on
    `root-alias` (the same machine) is still refused for its directory, and other jobs submit
    without waiting on it. A job on a host that does not answer is `check`ed (its directory
    compared as written) and refused at `submit` with one line, as before, nothing stored."""
    config = tmp_path / "ssh_config"
    flaky = "Host flaky\n    HostName 127.0.0.1\n    Port {port}\n    User root\n"
    answers = (
        Path(SSH_CONFIG).read_text().replace("Host root-local root-alias", "Host root-local root-alias flaky")
    )
    config.write_text(answers)
    monkeypatch.setenv("CHAINRUN_SSH_CONFIG", str(config))
    ckpt = tmp_path / "ckpt"
    (chain_id,) = chainrun(
        "submit", str(remote_job(tmp_path / "a", "net", "flaky", ckpt)), check=True
    ).stdout.split()
    config.write_text(Path(SSH_CONFIG).read_text() + flaky.format(port=1))  # connection refused from now on
    alias = remote_job(tmp_path / "b", "net2", "root-alias", ckpt)
    assert f"is where chain {chain_id} (net) still trains" in refused_at_check_and_submit(chainrun, alias)
    own = remote_job(tmp_path / "c", "net3", "root-alias", tmp_path / "own")
    assert len(chainrun("submit", str(own), check=True).stdout.split()) == 1
    down = remote_job(tmp_path / "d", "net4", "flaky", tmp_path / "elsewhere")
    chainrun("check", str(down), check=True)
    refused = chainrun("submit", str(down))
    assert refused.returncode == 1 and refused.stderr.startswith(
        "chainrun: cannot reach flaky: ssh flaky: "
    ), refused.stderr
    assert refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr
    assert [name for _, name in stored(home)] == ["net", "net3"]


def test_one_machine_goes_by_its_canonical_name_and_its_identity() -> None:
    """The names of a machine in holds: its ssh HostName and port; its machine id where known,
    and "" (this machine) when that id is this machine's. Holds clash through any name shared."""
    from chainrun.decide.holds import HERE, Hold, machines

    here = "aa11"
    for canonical, identity, names in (
        ("node1:22", "", {"node1:22"}),  # not reached: its canonical name alone
        ("node1:22", "bb22", {"node1:22", "id:bb22"}),
        ("127.0.0.1:2222", here, {"127.0.0.1:2222", "id:aa11", HERE}),  # a host that is this machine
        (HERE, here, {HERE, "id:aa11"}),  # this machine itself
        (HERE, "", {HERE}),  # this machine, with no machine id
    ):
        assert machines(canonical, identity, here) == names, (canonical, identity)
    local = Hold(machines(HERE, here, here), "/w/ckpt")
    for other, clash in (
        (machines("node1:22", "", here), False),
        (machines("127.0.0.1:2222", here, here), True),  # this machine by its id
        (machines("127.0.0.1:2222", "", here), False),  # not known to be this machine
        (machines("other-alias:22", here, here), True),
    ):
        assert Hold(other, "/w/ckpt").clashes(local) is clash, other
    alias = Hold(machines("node1:22", "", here), "/w/ckpt")
    assert Hold(machines("node1:22", "bb22", here), "/w/ckpt/run1").clashes(alias)  # one HostName and port
    assert Hold(machines("node2:22", "bb22", here), "/w").clashes(
        Hold(machines("node1:22", "bb22", here), "/w")
    )
    assert not Hold(machines("node1:2200", "", here), "/w/ckpt").clashes(alias)  # another port, another sshd


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


def test_a_hold_is_the_one_settled_at_submit_and_survives_the_store() -> None:
    """A spec keeps where its checkpoint_dir was found at submit through JSON; one stored before
    that has none, and is compared by its hosts as written."""
    from chainrun.decide.holds import Hold, hold, written
    from chainrun.model import JobSpec, SchedulerSpec

    spec = JobSpec("net", "true", "/w", 60, 60, None, 0, "/w/link", "USR1", 10, SchedulerSpec(host="gpu"))
    assert hold(spec) is None
    assert written(spec, "/w/link") == Hold(frozenset({"gpu"}), "/w/link")
    older = spec.to_json()
    settled = replace(spec, checkpoint_real="/w/ckpt", checkpoint_machines=("gpu:22", "id:bb22"))
    assert JobSpec.from_json(json.loads(json.dumps(settled.to_json()))) == settled
    assert hold(settled) == Hold(frozenset({"gpu:22", "id:bb22"}), "/w/ckpt")
    del older["checkpoint_real"], older["checkpoint_machines"]
    assert JobSpec.from_json(older) == spec


def test_a_hold_as_written_is_seen_from_this_machine_the_one_host_or_every_host_of_a_pool() -> None:
    """Where a chain's checkpoint directory is, as the job file names it: "" for this machine (a cluster without
    ``host`` is reached from here, so its paths are this machine's), its host, or its pool."""
    from dataclasses import replace

    from test_decide import SPEC

    from chainrun.decide.holds import written
    from chainrun.model import SchedulerSpec

    def machines(scheduler: SchedulerSpec) -> frozenset[str]:
        return written(replace(SPEC, scheduler=scheduler), "/w/ckpt").machines

    assert machines(SchedulerSpec(kind="slurm")) == {""}
    assert machines(SchedulerSpec(kind="slurm", host="login1")) == {"login1"}
    assert machines(SchedulerSpec(kind="local", hosts=("a", "b"))) == {"a", "b"}
    assert written(SPEC, "/w/ckpt").path == "/w/ckpt"
