"""Sweeps: a [sweep] job file makes one chain per configuration x repetition, each with its
values in its command and environment, its own checkpoint directory and a stable name."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
from conftest import settings_of, wait_for

from chainrun import jobfile, status, sweep, sweepstatus
from chainrun.errors import JobFileError
from chainrun.model import Chain, ChainState

TRAINER = Path(__file__).parent / "data" / "trainer.py"
TORCH_TRAINER = Path(__file__).parent / "checkpoint" / "_torch_train.py"
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
        'name = "s"\ncommand = "echo {x} ${x} {a,b} {1..3} {{x}} {{"\ntotal_time = "1h"\nwalltime = "10m"\n'
        'checkpoint_dir = "ck/{x}-{rep}"\n[[sweep.points]]\nx = "{rep}"\n[[sweep.points]]\nx = 3\n'
    )
    a, b = sweep.expand(load(tmp_path, text))
    # One pass: a value is never expanded again; bash's ${x} and brace expansion stay as they are.
    assert a.command == "echo '{rep}' ${x} {a,b} {1..3} {x} {"
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


def test_an_unknown_placeholder_is_refused_at_check_and_submit_naming_it_and_a_close_match(
    tmp_path: Path, chainrun: CLI
) -> None:
    """Before, `--bs {batch}` with only `batch_size` in the sweep passed check and ran with a
    literal {batch}. Now check and submit refuse it in one line: the file, the name, the
    names known and the closest one; nothing is stored."""
    path = tmp_path / "sweep.toml"
    path.write_text(
        'name = "lr"\ncommand = "python3 train.py --lr {lr} --bs {batch}"\ntotal_time = "1h"\n'
        'walltime = "10m"\n[sweep.grid]\nlr = [0.1]\nbatch_size = [64]\n'
    )
    for verb in ("check", "submit"):
        result = chainrun(verb, str(path))
        assert result.returncode == 2, (verb, result.stdout, result.stderr)
        assert result.stderr == (
            f"chainrun: {path}: command uses {{batch}}, which is unknown (did you mean {{batch_size}}?); "
            "known: {lr}, {batch_size}, {name}, {rep}; write {{ or }} for a literal brace\n"
        )
    assert json.loads(chainrun("status", "--json", "--all", check=True).stdout) == []


@pytest.mark.parametrize(
    ("field", "line"),
    [
        ("command", 'command = "python3 train.py --epochs {epochs}"'),
        ("env.DATA", 'command = "true"\n[env]\nDATA = "/data/{dataset}"'),
        (
            "scheduler.options",
            'command = "true"\n[scheduler]\nkind = "slurm"\noptions = ["--gres=gpu:{gpu}"]',
        ),
        ("workdir", 'command = "true"\nworkdir = "runs/{run}"'),
        ("checkpoint_dir", 'command = "true"\ncheckpoint_dir = "ck/{run}"'),
        ("tensorboard_dir", 'command = "true"\ntensorboard_dir = "tb/{run}"'),
    ],
)
def test_every_field_that_takes_placeholders_refuses_an_unknown_one(
    tmp_path: Path, field: str, line: str
) -> None:
    """A chain that is no sweep knows {name} alone: anything else is a typo, in any field."""
    (tmp_path / "runs").mkdir()
    with pytest.raises(JobFileError) as err:
        load(tmp_path, f'name = "one"\ntotal_time = "1h"\nwalltime = "10m"\n{line}\n')
    assert f"{field} uses {{" in str(err.value) and "known: {name};" in str(err.value)


def test_placeholders_fill_env_options_and_paths_and_every_value_stays_quoted(tmp_path: Path) -> None:
    """`--gres=gpu:{gpus}`, [env] values, workdir and tensorboard_dir are filled in by the same
    renderer as the command; in the batch script each value is quoted as a whole, so a value of
    quotes and $(...) arrives as it is and a line break cannot start a directive."""
    from chainrun.schedulers import scheduler_for
    from chainrun.schedulers.script import render_script
    from chainrun.schedulers.segment import SegmentJob

    (tmp_path / "runs").mkdir()
    hostile = "it's $(touch pwned)"
    text = (
        'name = "p"\ncommand = "echo {tag}"\ntotal_time = "1h"\nwalltime = "10m"\n'
        'workdir = "runs/{gpus}"\ntensorboard_dir = "tb/{name}"\n'
        '[env]\nTAG = "<{tag}>"\n[scheduler]\nkind = "slurm"\noptions = ["--gres=gpu:{gpus}"]\n'
        f"[sweep.grid]\ngpus = [2]\ntag = {json.dumps([hostile])}\n"
    )
    (one,) = sweep.expand(load(tmp_path, text))
    assert one.workdir == str(tmp_path / "runs" / "2")
    assert one.tensorboard_dir == str(tmp_path / "runs" / "2" / "tb" / one.name)
    assert one.checkpoint_dir == str(tmp_path / "runs" / "2" / "checkpoints" / one.name)
    assert one.scheduler.options == ("--gres=gpu:2",) and one.env == (("TAG", f"<{hostile}>"),)
    script = render_script(scheduler_for("slurm", None), SegmentJob(one.name + "-a1b2c3", 1, one, 600))
    assert "\n#SBATCH --gres=gpu:2\n" in script
    assert settings_of(script)["env"]["TAG"] == "<it's $(touch pwned)>"
    assert one.command == "echo " + shlex.quote(hostile)
    assert settings_of(script)["command"] == one.command
    broken = text.replace("gpu:{gpus}", "gpu:{tag}").replace(
        json.dumps([hostile]), '["a\\n#SBATCH --wrap=x"]'
    )
    with pytest.raises(JobFileError, match=r"scheduler\.options uses a placeholder whose value"):
        sweep.expand(load(tmp_path, broken))


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


def test_check_on_a_sweep_shows_each_chains_own_checkpoint_dir_and_seed(
    tmp_path: Path, chainrun: CLI
) -> None:
    """`check` lists each chain with the directory its checkpoints go to (placeholders filled
    in) and its seed; no line shows checkpoint_dir's placeholders as if they were a path."""
    path = tmp_path / "sweep.toml"
    path.write_text(
        BASE
        + 'checkpoint_dir = "ck/{lr}-{rep}"\n[sweep]\nreps = 2\n[sweep.grid]\nlr = [0.1, 0.01]\ntag = ["x"]\n'
    )
    (tmp_path / "train.py").write_text("pass\n")
    out = chainrun("check", str(path), check=True).stdout
    for one in sweep.expand(jobfile.load(path)):
        assert f"checkpoint_dir {os.path.relpath(one.checkpoint_dir, tmp_path)}, seed {one.seed}" in out
    assert "checkpoint_dir ck/0.01-1, seed" in out
    assert "checkpoint_dir and seed; all under way at once (no max_concurrent)" in out
    path.write_text(path.read_text().replace("reps = 2\n", "reps = 2\nmax_concurrent = 3\n"))
    out = chainrun("check", str(path), check=True).stdout
    assert "checkpoint_dir and seed; at most 3 under way at once (max_concurrent)" in out
    assert not any("{rep}" in line for line in out.splitlines()), out


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


def sweep_chains(tmp_path: Path, metrics: list[dict[str, float]]) -> list[Chain]:
    """The chains of a sweep of lr x batch, 2 repetitions, each with ``metrics`` (one a chain,
    in expand's order) saved by the helper and read back by the reader the service uses."""
    from dataclasses import replace

    from chainrun import progress as reading
    from chainrun.checkpoint import write_progress
    from chainrun.transport import LocalTransport

    spec = load(
        tmp_path,
        BASE.replace("{tag}", "{batch}")
        + "[sweep]\nreps = 2\n[sweep.grid]\nlr = [0.1, 0.01]\nbatch = [64, 128]\n",
    )
    chains = []
    for i, (one, values) in enumerate(zip(sweep.expand(spec), metrics)):
        ckpt = tmp_path / f"ck{i}"
        ckpt.mkdir()
        (ckpt / "m.pt").write_bytes(b"weights")
        write_progress(ckpt, epoch=3, step=0, file="m.pt", metrics={**values, "note": "text"})
        progress = reading.read(LocalTransport(), replace(one, checkpoint_dir=str(ckpt)))
        assert progress is not None
        state = ChainState.COMPLETED if i % 3 else ChainState.ACTIVE
        chains.append(
            Chain(id=f"{one.name}-a0b1c{i}", spec=one, state=state, created_at=0.0, latest=progress)
        )
    return chains


def test_status_sweep_compares_each_metric_over_repetitions_best_first_in_80_columns(tmp_path: Path) -> None:
    """Per configuration, the mean and spread of each metric over its repetitions, the best
    first (lowest for a loss, highest for an accuracy), the parameters as columns, and how many
    repetitions reported it; no line past 80 columns."""
    chains = sweep_chains(
        tmp_path,
        [
            {"val_loss": 0.5, "acc": 0.5},  # lr 0.1, batch 64, r0
            {"val_loss": 0.7, "acc": 0.25},  # r1
            {"val_loss": 0.25, "acc": 0.875},  # lr 0.1, batch 128
            {"val_loss": 0.25, "acc": 0.625},
            {"val_loss": 1.5},  # lr 0.01, batch 64: only r0 has reported an accuracy
            {"val_loss": 0.5, "acc": 0.125},
            {"val_loss": 1.0, "acc": 0.5},  # lr 0.01, batch 128
            {"val_loss": 0.5, "acc": 0.5},
        ],
    )
    text = sweepstatus.summary("lr", chains, 80)
    assert max(map(len, text.splitlines())) <= 80
    assert text.splitlines() == [
        "sweep lr: [######....] 5/8 completed; 5 completed, 3 active",
        "acc, highest first (mean and spread over repetitions):",
        "  lr    batch  MEAN   SPREAD  REPS",
        "  0.1   128    0.75   ±0.18   2 of 2",
        "  0.01  128    0.5    ±0      2 of 2",
        "  0.1   64     0.375  ±0.18   2 of 2",
        "  0.01  64     0.125  -       1 of 2",
        "val_loss, lowest first (mean and spread over repetitions):",
        "  lr    batch  MEAN  SPREAD  REPS",
        "  0.1   128    0.25  ±0      2 of 2",
        "  0.1   64     0.6   ±0.14   2 of 2",
        "  0.01  128    0.75  ±0.35   2 of 2",
        "  0.01  64     1     ±0.71   2 of 2",
    ]


def test_status_sweep_names_chains_by_their_parameters_and_shows_hashes_only_verbose(tmp_path: Path) -> None:
    """In the sweep's table a chain is its parameters and repetition, not its hashed name;
    `-v` adds the configuration's hash (and each chain's id above its details)."""
    chains = sweep_chains(tmp_path, [{"loss": 1.0}] * 8)
    now = 1000.0
    text = status.table(chains, now, label=sweepstatus.label(chains, 80))
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["lr", "batch", "REP", "STATE"]
    assert lines[1].split()[:4] == ["0.1", "64", "0", "active"]
    hashes = {sweep.digest(c.spec.params) for c in chains}
    assert not any(h in text for h in hashes) and max(map(len, lines)) <= 80
    verbose = status.table(chains, now, verbose=True, label=sweepstatus.label(chains, 80, verbose=True))
    assert verbose.splitlines()[0].split()[:4] == ["CONFIG", "lr", "batch", "REP"]
    assert verbose.splitlines()[1].split()[0] == sweep.digest(chains[0].spec.params)
    assert all(f"{c.id}:" in verbose for c in chains)
    compared = sweepstatus.summary("lr", chains, 80, verbose=True).splitlines()
    assert compared[2].split()[:3] == ["CONFIG", "lr", "batch"] and compared[3].split()[0] in hashes


def test_many_long_parameters_still_fit_80_columns(tmp_path: Path) -> None:
    """Six parameters with long values: each column is shortened with "…", no line passes 80."""
    from chainrun.model import Progress

    point = "[[sweep.points]]\n" + "".join(f'{k}_parameter = "{k * 30}"\n' for k in "abcdef")
    spec = load(tmp_path, BASE.replace(" --lr {lr} --tag {tag}", "") + point + point.replace('"a', '"z'))
    chains = [
        Chain(
            id=f"{one.name}-00000{i}",
            spec=one,
            state=ChainState.ACTIVE,
            created_at=0.0,
            latest=Progress(epoch=1, metrics=(("loss", 0.5 + i),)),
        )
        for i, one in enumerate(sweep.expand(spec))
    ]
    for verbose in (False, True):
        text = sweepstatus.summary("lr", chains, 80, verbose) + "\n"
        text += status.table(chains, 0.0, verbose=verbose, label=sweepstatus.label(chains, 80, verbose))
        assert max(map(len, text.splitlines())) <= 80, text
        assert "…" in text


def test_a_sweep_without_metrics_says_how_to_report_them(tmp_path: Path) -> None:
    """No chain has reported a metric yet: one line says where they come from."""
    chains = sweep_chains(tmp_path, [{}] * 8)
    assert sweepstatus.summary("lr", chains).splitlines()[1] == (
        "no metrics yet: the helper's save(..., metrics={...}) reports them"
    )


def test_which_way_is_better_is_read_from_the_metrics_name() -> None:
    """Losses, errors and the like are better low; accuracy and anything else, high."""
    low = ("loss", "val_loss", "top1_err", "error_rate", "val/mse", "ppl", "epoch_time")
    high = ("acc", "accuracy", "f1", "auc", "reward", "bleu", "precision")
    assert all(sweepstatus.lower_is_better(m) for m in low)
    assert not any(sweepstatus.lower_is_better(m) for m in high)


def test_each_chain_of_a_sweep_gets_its_own_seed_the_same_at_every_submit(tmp_path: Path) -> None:
    """CHAINRUN_SEED: distinct for every configuration and repetition, the same when the sweep is
    submitted again, and within what NumPy's seed accepts."""
    text = BASE + '[sweep]\nreps = 3\n[sweep.grid]\nlr = [0.1, 0.01, 0.001]\ntag = ["a", "b"]\n'
    chains = sweep.expand(load(tmp_path, text))
    seeds = [c.seed for c in chains]
    assert len(set(seeds)) == len(chains) == 18
    assert all(s is not None and 0 <= s < 2**32 for s in seeds)
    assert [c.seed for c in sweep.expand(load(tmp_path, text))] == seeds
    renamed = sweep.expand(load(tmp_path, text.replace('name = "lr"', 'name = "lr2"')))
    assert not set(seeds) & {c.seed for c in renamed}


def test_seeds_that_coincide_are_moved_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """32 bits of a hash can coincide (among 100,000 chains, about once): the later chain moves on."""
    monkeypatch.setattr(sweep, "seed_of", lambda *words: 2**32 - 1)
    chains = sweep.expand(load(tmp_path, BASE + '[sweep]\nreps = 3\n[sweep.grid]\nlr = [1]\ntag = ["a"]\n'))
    assert [c.seed for c in chains] == [2**32 - 1, 0, 1]


@pytest.mark.slow
@pytest.mark.torch
def test_repetitions_differ_and_each_resumes_as_one_uninterrupted_run_with_its_seed(
    tmp_path: Path, chainrun: CLI, service: Callable[..., object]
) -> None:
    """Two repetitions of one configuration of a PyTorch script that seeds nothing, on the local
    runner: each chain gets its own CHAINRUN_SEED, so the two train differently; each, stopped
    mid-epoch by the walltime signal and resumed in a second segment, ends bit-equal to one
    uninterrupted run with its seed; and `status SWEEP` compares their loss."""
    torch = pytest.importorskip("torch")
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(TORCH_TRAINER, work / "torch_train.py")
    args = "--epochs 2 --no-seed"
    out = '--dir "$CHAINRUN_CHECKPOINT_DIR" --out "$CHAINRUN_CHECKPOINT_DIR/final.pt"'
    # The trainer sends itself the walltime signal after batch 4 of epoch 0 (a resumed
    # segment starts past it): two segments each, however long importing torch takes on a
    # loaded machine.
    (work / "sweep.toml").write_text(
        'name = "seeds"\n'
        f"command = {json.dumps(f'python3 torch_train.py {out} {args} --signal-at 0:4')}\n"
        'total_time = "30m"\nwalltime = "10m"\ngrace = "1m"\ntarget_epoch = 2\n'
        "[sweep]\nreps = 2\n[sweep.grid]\nlr = [0.01]\n"
    )
    chainrun("submit", str(work / "sweep.toml"), check=True)
    service(interval=0.5)

    def ended() -> bool:
        out = json.loads(chainrun("status", "seeds", "--json", check=True).stdout)
        return all(c["state"] in ("completed", "failed", "exhausted") for c in out)

    wait_for(ended, 600, "the sweep's two chains to end")
    chains = sorted(
        json.loads(chainrun("status", "seeds", "--json", check=True).stdout), key=lambda c: c["rep"]
    )
    assert [c["state"] for c in chains] == ["completed", "completed"], [c["reason"] for c in chains]
    assert [c["segments_run"] for c in chains] == [2, 2]
    seeds = [c["seed"] for c in chains]
    assert seeds[0] != seeds[1]
    finals = [torch.load(work / "checkpoints" / c["name"] / "final.pt", weights_only=True) for c in chains]
    assert not torch.equal(finals[0]["model"]["0.weight"], finals[1]["model"]["0.weight"])

    for seed, final in zip(seeds, finals):
        ref = tmp_path / f"reference-{seed}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("CHAINRUN_")}
        env.update(CHAINRUN_SEED=str(seed), PYTHONPATH=str(Path(__file__).parent.parent))
        subprocess.run(
            [
                sys.executable,
                str(TORCH_TRAINER),
                "--dir",
                str(ref),
                "--out",
                str(ref / "final.pt"),
                *args.split(),
            ],
            env=env,
            check=True,
            capture_output=True,
            timeout=300,
        )
        expected = torch.load(ref / "final.pt", weights_only=True)
        assert expected["model"].keys() == final["model"].keys()
        assert all(torch.equal(expected["model"][k], final["model"][k]) for k in final["model"])
        assert torch.equal(expected["rng"], final["rng"])

    text = chainrun("status", "seeds", check=True).stdout
    lines = text.splitlines()
    assert max(map(len, lines)) <= 80
    at = lines.index("loss, lowest first (mean and spread over repetitions):")
    assert lines[at + 1].split() == ["lr", "MEAN", "SPREAD", "REPS"]
    assert lines[at + 2].split()[0] == "0.01" and lines[at + 2].endswith("2 of 2")
    assert any(line.split()[:4] == ["lr", "REP", "STATE", "PROGRESS"] for line in lines)


def test_run_of_a_sweep_half_done_follows_the_running_chains_and_counts_the_completed(
    tmp_path: Path, chainrun: CLI, service: Callable[..., object]
) -> None:
    """One chain of the sweep completed, the other still trains: `run` of the sweep again
    neither refuses (the completed checkpoint) nor starts anything; it follows the running
    chain and reports the completed one, and exits 0 once both have completed."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(TRAINER, work / "trainer.py")
    (work / "sweep.toml").write_text(
        'name = "half"\ncommand = "python3 trainer.py --epochs 3 --epoch-time {t}"\n'
        'total_time = "10m"\nwalltime = "2m"\ntarget_epoch = 3\n[sweep.grid]\nt = [0.1, 8]\n'
    )
    ids = chainrun("submit", str(work / "sweep.toml"), check=True).stdout.split()
    service(interval=0.3)

    def states() -> list[str]:
        return [
            c["state"] for c in json.loads(chainrun("status", "half", "--json", "--all", check=True).stdout)
        ]

    wait_for(lambda: "completed" in states(), 120, "the quick chain to complete")
    assert sorted(states()) == ["active", "completed"], "the slow chain ended already: make it slower"
    followed = chainrun("run", str(work / "sweep.toml"), timeout=240)
    assert followed.returncode == 0, followed
    first = followed.stdout.splitlines()[0]
    assert (
        first
        == "sweep half: 2 chains: 0 submitted now, 1 already running, followed as they are, 1 already completed"
    )
    assert "already completed as chain" in followed.stderr
    assert sorted(
        c["id"] for c in json.loads(chainrun("status", "half", "--json", "--all").stdout)
    ) == sorted(ids)
    assert states() == ["completed", "completed"]
