"""Sweeps: a [sweep] job file makes one chain per configuration x repetition, each with its
values in its command and environment, its own checkpoint directory and a stable name."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Callable

import pytest
from conftest import wait_for

from chainrun import jobfile, sweep
from chainrun.errors import JobFileError

TRAINER = Path(__file__).parent / "data" / "trainer.py"
CLI = Callable[..., "subprocess.CompletedProcess[str]"]
BASE = (
    'name = "lr"\ncommand = "python3 train.py --lr {lr} --tag {tag}"\ntotal_time = "1h"\nwalltime = "10m"\n'
)


def load(tmp_path: Path, text: str) -> jobfile.JobSpec:  # type: ignore[name-defined]
    path = tmp_path / "sweep.toml"
    path.write_text(text)
    return jobfile.load(path)


def test_a_grid_times_repetitions_makes_one_chain_each_with_stable_names(tmp_path: Path) -> None:
    spec = load(
        tmp_path, BASE + '[sweep]\nreps = 2\n[sweep.grid]\nlr = [0.1, 0.01]\ntag = ["a b", "$(id)"]\n'
    )
    chains = sweep.expand(spec)
    assert len(chains) == 8
    again = sweep.expand(
        load(tmp_path, BASE + '[sweep]\nreps = 2\n[sweep.grid]\nlr = [0.1, 0.01]\ntag = ["a b", "$(id)"]\n')
    )
    assert [c.name for c in chains] == [c.name for c in again]  # stable across submissions
    assert len({c.name for c in chains}) == 8 and all(c.name.startswith("lr-") for c in chains)
    first = chains[0]
    assert first.name.endswith("-r0") and chains[1].name.endswith("-r1")
    assert first.command == "python3 train.py --lr 0.1 --tag 'a b'"
    assert chains[2].command == "python3 train.py --lr 0.1 --tag '$(id)'"
    assert len({c.checkpoint_dir for c in chains}) == 8
    assert first.checkpoint_dir == str(tmp_path / "checkpoints" / first.name)
    assert (first.sweep_name, first.rep, dict(first.params)) == ("lr", 0, {"lr": "0.1", "tag": '"a b"'})


def test_checkpoint_dir_placeholders_and_values_that_stay_as_they_are(tmp_path: Path) -> None:
    text = (
        'name = "s"\ncommand = "echo {x} ${x} {unknown}"\ntotal_time = "1h"\nwalltime = "10m"\n'
        'checkpoint_dir = "ck/{x}-{rep}"\n[[sweep.points]]\nx = "{rep}"\n[[sweep.points]]\nx = 3\n'
    )
    a, b = sweep.expand(load(tmp_path, text))
    assert a.command == "echo '{rep}' ${x} {unknown}"  # one pass: a value is never expanded again
    assert a.checkpoint_dir == str(tmp_path / "ck" / "{rep}-0") and b.checkpoint_dir == str(
        tmp_path / "ck" / "3-0"
    )


@pytest.mark.parametrize(
    ("sweep_text", "needle"),
    [
        ("[sweep]\nreps = 2\n", "give either [sweep.grid]"),
        ("[sweep.grid]\nlr = []\n", "expected a non-empty list"),
        ("[sweep.grid]\nlr = [1, 1]\n", "a value is listed twice"),
        ('[sweep.grid]\n"l-r" = [1]\n', "a parameter name is letters"),
        ("[sweep.grid]\nlr = [[1]]\n", "a value is a string, number or boolean"),
        ("[sweep.grid]\nlr = [nan]\n", "not a finite number"),
        ("[[sweep.points]]\nlr = 1\n[[sweep.points]]\nlr = 1\n", "points 1 and 2 are the same"),
        ("[sweep]\nreps = 0\n[sweep.grid]\nlr = [1]\n", "must be 1 to"),
        ("[sweep]\nrepz = 2\n[sweep.grid]\nlr = [1]\n", "unknown key sweep.repz"),
        (
            "[sweep.grid]\na = " + str(list(range(400))) + "\nb = " + str(list(range(400))) + "\n",
            "160000 chains",
        ),
    ],
)
def test_bad_sweeps_are_one_line_naming_the_key(tmp_path: Path, sweep_text: str, needle: str) -> None:
    with pytest.raises(JobFileError) as err:
        load(tmp_path, BASE + sweep_text)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_path_unsafe_value_in_checkpoint_dir_is_refused(tmp_path: Path) -> None:
    text = BASE.replace('walltime = "10m"\n', 'walltime = "10m"\ncheckpoint_dir = "ck/{tag}"\n')
    with pytest.raises(JobFileError, match="cannot be part of a directory name"):
        sweep.expand(load(tmp_path, text + '[sweep.grid]\nlr = [1]\ntag = ["../up"]\n'))


@pytest.mark.slow
def test_a_sweep_of_three_rates_times_two_runs_six_chains_each_with_its_own_values(
    tmp_path: Path, chainrun: CLI, service: Callable[..., object]
) -> None:
    """On the local runner: every chain sees its values in its command and environment,
    resumes over two segments or more, and `status SWEEP` shows all six completed.
    Submitting the sweep again while it runs duplicates nothing."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(TRAINER, work / "trainer.py")
    record = (
        'echo "{lr} $CHAINRUN_PARAM_LR $CHAINRUN_REP $CHAINRUN_PARAMS" >> "$CHAINRUN_CHECKPOINT_DIR/seen.txt"'
    )
    (work / "sweep.toml").write_text(
        'name = "lrs"\n'
        f"command = {json.dumps(record + '; exec python3 trainer.py --epochs 6 --epoch-time 1')}\n"
        'total_time = "5m"\nwalltime = "5s"\ngrace = "2s"\ntarget_epoch = 6\n'
        "[sweep]\nreps = 2\n[sweep.grid]\nlr = [0.1, 0.01, 0.001]\n"
    )
    check = chainrun("check", str(work / "sweep.toml"), check=True).stdout
    assert "a sweep of 6 chains" in check and "lr=0.1" in check
    ids = chainrun("submit", str(work / "sweep.toml"), check=True).stdout.split()
    assert len(ids) == 6
    again = chainrun("submit", str(work / "sweep.toml"))
    assert again.returncode == 0 and again.stdout.split() == ids
    assert again.stderr.count("still running as chain") == 6
    service(interval=0.3)

    def done() -> bool:
        out = json.loads(chainrun("status", "lrs", "--json", check=True).stdout)
        return all(c["state"] in ("completed", "failed", "exhausted") for c in out)

    wait_for(done, 400, "the sweep's six chains to end")
    chains = json.loads(chainrun("status", "lrs", "--json", check=True).stdout)
    assert sorted(c["id"] for c in chains) == sorted(ids)
    assert all(c["state"] == "completed" for c in chains), [c["reason"] for c in chains]
    seen_values = set()
    for c in chains:
        lr, rep = c["params"]["lr"], c["rep"]
        seen_values.add((lr, rep))
        ckpt = work / "checkpoints" / c["name"]
        lines = (ckpt / "seen.txt").read_text().splitlines()
        assert len(lines) >= 2, f"{c['name']} ran {len(lines)} segment(s)"
        assert set(lines) == {f"{lr} {lr} {rep} {json.dumps({'lr': lr}, separators=(',', ':'))}"}
    assert seen_values == {(lr, r) for lr in (0.1, 0.01, 0.001) for r in (0, 1)}
    text = chainrun("status", "lrs", check=True).stdout
    head = text.splitlines()[0]
    assert head.startswith("sweep lrs: [") and head.endswith("6/6 completed; 6 completed")


def test_cancel_sweep_asks_and_cancels_every_chain(tmp_path: Path, chainrun: CLI) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "sweep.toml").write_text(
        'name = "c"\ncommand = "sleep 600"\ntotal_time = "1h"\nwalltime = "10m"\n[sweep.grid]\nx = [1, 2]\n'
    )
    ids = chainrun("submit", str(work / "sweep.toml"), check=True).stdout.split()
    refused = chainrun("cancel", "c")
    assert refused.returncode == 1 and "add --yes" in refused.stderr
    done = chainrun("cancel", "c", "--yes", check=True).stdout
    assert all(f"chain {i} cancelled" in done for i in ids)
    states = {c["state"] for c in json.loads(chainrun("status", "c", "--json", check=True).stdout)}
    assert states == {"cancelled"}


def test_the_sweep_line_counts_states_and_names_each_metrics_lowest_and_highest(tmp_path: Path) -> None:
    """The metrics come from the helper's sidecar (write_progress(metrics=...)) through the
    same reader the service uses, and the sweep's head line names whose is lowest and highest."""
    from dataclasses import replace

    from chainrun import progress as reading
    from chainrun import status
    from chainrun.checkpoint import write_progress
    from chainrun.model import Chain, ChainState
    from chainrun.transport import LocalTransport

    spec = load(tmp_path, BASE + '[sweep.grid]\nlr = [1, 2, 3]\ntag = ["x"]\n')
    chains = []
    for i, (one, loss) in enumerate(zip(sweep.expand(spec), (0.5, 0.125, 0.25))):
        ckpt = tmp_path / f"ck{i}"
        ckpt.mkdir()
        (ckpt / "m.pt").write_bytes(b"weights")
        write_progress(ckpt, epoch=3, step=0, file="m.pt", metrics={"loss": loss, "note": "text"})
        progress = reading.read(LocalTransport(), replace(one, checkpoint_dir=str(ckpt)))
        assert progress is not None and progress.metrics == (("loss", loss),)
        state = ChainState.COMPLETED if i else ChainState.ACTIVE
        chains.append(
            Chain(id=f"{one.name}-00000{i}", spec=one, state=state, created_at=0.0, latest=progress)
        )
    head, metric = status.sweep_line("lr", chains, 120).splitlines()
    assert head.startswith("sweep lr: [") and head.endswith("2/3 completed; 2 completed, 1 active")
    assert metric == f"  loss: lowest 0.125 ({chains[1].id}), highest 0.5 ({chains[0].id})"
