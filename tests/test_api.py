"""The Python API: ``chainrun.submit`` a dict or a job file (a sweep through ``params`` and
``reps``), follow the chains with ``Chain.wait``/``status``/``progress``, cancel them, and
``import chainrun`` that stays cheap until the API is used."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import REPO, cli_env, wait_for

import chainrun
from chainrun.errors import JobFileError, UsageError

TRAINER = Path(__file__).parent / "data" / "trainer.py"
EXAMPLE = REPO / "examples" / "python-api"
Service = Callable[..., "subprocess.Popen[bytes]"]


def job(work: Path, command: str, **more: Any) -> dict[str, Any]:
    """A job dict running ``command`` in ``work`` on the local runner."""
    return {"name": "lrs", "command": command, "workdir": str(work), "total_time": "1h", **more}


def test_import_chainrun_imports_nothing_else_until_the_api_is_used() -> None:
    """``import chainrun`` and ``import chainrun.checkpoint`` (inside training jobs) load no
    other module of chainrun, nor any library; ``chainrun.submit`` loads the API then."""
    probe = (
        "import json, sys\n"
        "before = set(sys.modules)\n"
        "import chainrun\n"
        "alone = sorted(set(sys.modules) - before)\n"
        "import chainrun.checkpoint\n"
        "ours = sorted(m for m in set(sys.modules) - before if m.startswith('chainrun'))\n"
        "api = 'chainrun.api' in sys.modules\n"
        "chainrun.submit, chainrun.chains, chainrun.Chain\n"
        "print(json.dumps([alone, ours, api, 'chainrun.api' in sys.modules]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env=cli_env(Path("/nonexistent")),
        check=True,
    ).stdout
    alone, ours, api_at_import, api_at_use = json.loads(out)
    assert alone == ["chainrun"]
    assert all(m == "chainrun" or re.fullmatch(r"chainrun\.checkpoint(\._\w+)?", m) for m in ours), ours
    assert (api_at_import, api_at_use) == (False, True)
    assert {"submit", "chains", "Chain"} <= set(dir(chainrun))
    with pytest.raises(AttributeError, match="no attribute 'nosuch'"):
        chainrun.nosuch  # type: ignore[attr-defined]  # noqa: B018


@pytest.mark.slow
def test_a_dict_sweep_of_two_rates_times_two_runs_completes_each_with_its_own_values(
    tmp_path: Path, home: Path, service: Service
) -> None:
    """Submitted from a dict with no service running, picked up by the one started after:
    every chain resumes over two segments or more, sees its own values in its command and
    environment, and ``wait`` returns its final state."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(TRAINER, work / "trainer.py")
    record = 'echo "{lr} $CHAINRUN_PARAM_LR $CHAINRUN_REP" >> "$CHAINRUN_CHECKPOINT_DIR/seen.txt"'
    train = f"exec {sys.executable} trainer.py --epochs 6 --epoch-time 1"
    data = job(work, f"{record}; {train}", total_time="5m", walltime="5s", grace="2s", target_epoch=6)
    chains = chainrun.submit(data, params={"lr": [0.1, 0.01]}, reps=2, home=home)
    assert sorted((c.params["lr"], c.rep) for c in chains) == [(0.01, 0), (0.01, 1), (0.1, 0), (0.1, 1)]
    assert all(c.sweep == "lrs" and c.name.startswith("lrs-") for c in chains)
    assert {c.state for c in chains} == {"active"}
    assert set(chainrun.chains("lrs", home=home)) == set(chains)

    service(interval=0.3)
    assert [c.wait(timeout=400, poll=0.3) for c in chains] == ["completed"] * 4
    for c in chains:
        lr, rep = c.params["lr"], c.rep
        lines = (work / "checkpoints" / c.name / "seen.txt").read_text().splitlines()
        assert len(lines) >= 2, f"{c.name} ran {len(lines)} segment(s)"
        assert set(lines) == {f"{lr} {lr} {rep}"}
        assert c.progress.epoch == 6
        status = c.status()
        assert (status["id"], status["state"], status["params"], status["rep"]) == (
            c.id,
            "completed",
            {"lr": lr},
            rep,
        )
        assert status["segments_run"] >= 2


def test_submit_a_job_file_whose_sweep_params_replace_then_cancel_without_a_service(
    tmp_path: Path, home: Path
) -> None:
    """A job file's own [sweep] is replaced by ``params`` (points here) and ``reps``; its
    relative workdir starts at the file. With no service, ``cancel`` carries the cancel out."""
    (tmp_path / "work").mkdir()
    path = tmp_path / "sweep.toml"
    path.write_text(
        'name = "c"\ncommand = "sleep 600"\nworkdir = "work"\ntotal_time = "1h"\nwalltime = "10m"\n'
        "[sweep]\nreps = 3\n[sweep.grid]\nx = [1, 2, 3]\n"
    )
    assert len(chainrun.submit(path, home=home)) == 9  # as the file says
    (other,) = chainrun.submit(str(path), params=[{"x": 5, "y": "a b"}], reps=1, home=home)
    assert (other.params, other.rep) == ({"x": 5, "y": "a b"}, 0)
    spec = other.status()
    assert spec["sweep"] == "c" and spec["state"] == "active"
    assert len(chainrun.chains("c", home=home)) == 10 and len(chainrun.chains(home=home)) == 10
    assert chainrun.chains(other.id, home=home) == [other]

    assert other.cancel() == "cancelled"
    assert other.state == "cancelled" and other.wait(timeout=0) == "cancelled"
    assert other.cancel() == "cancelled"  # already ended: nothing more to do
    left = [c.state for c in chainrun.chains("c", home=home) if c != other]
    assert left == ["active"] * 9  # only that chain was ticked


def test_cancel_with_a_service_running_is_requested_and_carried_out_by_it(
    tmp_path: Path, home: Path, service: Service
) -> None:
    """The running service owns the chains: ``cancel`` asks, the service cancels the job."""
    (chain,) = chainrun.submit(job(tmp_path, "sleep 600", walltime="10m"), home=home)
    service(interval=0.3)
    wait_for(
        lambda: chain.status()["segments"][:1] != [] and chain.status()["segments"][0]["phase"] == "running",
        120,
        "the segment to run",
    )
    assert chain.cancel() in ("active", "cancelled")
    assert chain.wait(timeout=120, poll=0.2) == "cancelled"
    assert chain.status()["segments"][0]["outcome"] == "cancelled"


def test_wait_raises_timeout_error_while_the_chain_goes_on(tmp_path: Path, home: Path) -> None:
    (chain,) = chainrun.submit(job(tmp_path, "sleep 600", walltime="10m"), home=home)
    with pytest.raises(TimeoutError, match=f"chain {chain.id}: still active after 0.2s"):
        chain.wait(timeout=0.2, poll=0.05)
    assert chain.state == "active" and chain.progress.epoch is None
    assert chain.cancel() == "cancelled"


def test_status_names_the_jobs_whose_cancel_the_scheduler_did_not_take_until_it_is_sent(
    tmp_path: Path, home: Path
) -> None:
    """A cancel that did not reach the scheduler is owed, kept in the store until sent:
    ``status()`` lists its jobs, as ``status --json`` does, and no more once it is settled."""
    from chainrun.store import OwedCancel, Store

    (chain,) = chainrun.submit(job(tmp_path, "sleep 600", walltime="10m"), home=home)
    assert chain.status()["cancel_owed"] == []
    store = Store(home)
    try:
        store.owe_cancels(
            ("slurm", ""),
            {
                "41": OwedCancel(chain.id, 1, 1000.0, "cr.x.1"),
                "42": OwedCancel(chain.id, 2, 1000.0, "cr.x.2"),
            },
        )
        assert chain.status()["cancel_owed"] == [
            {"job_id": "41", "since": 1000.0},
            {"job_id": "42", "since": 1000.0},
        ]
        store.settle_cancels(("slurm", ""), ["41", "42"])
    finally:
        store.close()
    assert chain.status()["cancel_owed"] == []
    assert chain.cancel() == "cancelled"


def test_wait_with_no_service_drives_the_chains_to_their_end_and_then_lets_go(
    tmp_path: Path, home: Path, service: Service
) -> None:
    """No service runs: ``Chain.wait`` and ``chainrun.wait`` are the service, as `chainrun
    run` is, until the chains have ended (never a silent wait for ever), then let go of
    the state directory, so that a service can start after."""
    shutil.copy(TRAINER, tmp_path / "trainer.py")
    spec = job(tmp_path, "python3 trainer.py --epochs 3 --epoch-time 0.2", walltime="1m", target_epoch=3)
    first, second = chainrun.submit(spec, params={"lr": [1, 2]}, home=home)
    assert first.wait(timeout=120, poll=0.2) == "completed"
    assert chainrun.wait([first, second], timeout=120) == ["completed", "completed"]
    assert second.progress.epoch == 3
    service(interval=0.3)  # the directory is free again: a service takes it
    wait_for(lambda: (home / "service.status").exists(), 120, "the service's first tick")


def test_submit_returns_the_sweep_s_chains_already_active_with_the_new_ones(
    tmp_path: Path, home: Path
) -> None:
    """Submitting a sweep again with one more value stores only that chain, and returns the
    handles of all three, the two already active among them, in the sweep's order."""
    spec = job(tmp_path, "sleep 600", walltime="10m")
    before = chainrun.submit(spec, params={"lr": [1, 2]}, home=home)
    again = chainrun.submit(spec, params={"lr": [1, 2, 3]}, home=home)
    assert again[:2] == before and [c.params for c in again] == [{"lr": 1}, {"lr": 2}, {"lr": 3}]
    assert len(chainrun.chains("lrs", home=home)) == 3
    assert [c.cancel() for c in again] == ["cancelled"] * 3


@pytest.mark.parametrize(
    ("more", "params", "error", "needle"),
    [
        ({"walltime": "4x"}, None, JobFileError, "job dict: walltime = '4x': not a duration"),
        ({"walltime": "10m", "nosuch": 1}, None, JobFileError, "job dict: unknown key nosuch"),
        (
            {"walltime": "10m"},
            {"lr": []},
            JobFileError,
            "job dict: sweep.grid.lr = []: expected a non-empty list",
        ),
        ({"walltime": "10m"}, "lr", UsageError, "params='lr': give a dict of name -> list of values"),
    ],
)
def test_bad_input_raises_one_line_and_stores_nothing(
    tmp_path: Path, home: Path, more: dict[str, Any], params: Any, error: type, needle: str
) -> None:
    with pytest.raises(error) as err:
        chainrun.submit(job(tmp_path, "true", **more), params=params, home=home)
    assert str(err.value).startswith(needle) and "\n" not in str(err.value)
    assert chainrun.chains(home=home) == []


def test_a_missing_job_file_and_an_unknown_chain_are_the_cli_s_errors(tmp_path: Path, home: Path) -> None:
    with pytest.raises(JobFileError, match=r"nosuch\.toml: no such job file"):
        chainrun.submit(tmp_path / "nosuch.toml", home=home)
    with pytest.raises(UsageError, match="no chain 'nosuch'"):
        chainrun.chains("nosuch", home=home)


@pytest.mark.slow
def test_the_python_api_example_runs(tmp_path: Path, home: Path, service: Service) -> None:
    """examples/python-api/sweep.py, as docs/python-api.md shows it, with a service running."""
    copy = tmp_path / "python-api"
    shutil.copytree(EXAMPLE, copy, ignore=shutil.ignore_patterns("checkpoints", "__pycache__"))
    service(interval=0.3)
    result = subprocess.run(
        [sys.executable, "sweep.py"], cwd=copy, env=cli_env(home), capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 4, result.stdout
    assert all(
        re.fullmatch(r"lr-demo-\w+-r[01] lr=0\.[13]: completed at epoch 12, [2-9] segments", line)
        for line in lines
    ), lines


def test_the_docs_show_the_example_as_it_is() -> None:
    """docs/python-api.md holds examples/python-api/sweep.py word for word."""
    page = (REPO / "docs" / "python-api.md").read_text()
    found = re.search(r"<!-- python-api example -->\n```python\n(.*?)```\n", page, re.S)
    assert found is not None, "docs/python-api.md has no <!-- python-api example --> section"
    assert found.group(1) == (EXAMPLE / "sweep.py").read_text()


def test_ctrl_c_in_a_wait_that_drives_raises_keyboard_interrupt_and_the_chain_goes_on(
    tmp_path: Path, home: Path
) -> None:
    """Ctrl-C while ``wait`` is the service: KeyboardInterrupt in the script, the chain still
    active with its job running, and the state directory free for a service."""
    script = tmp_path / "wait.py"
    script.write_text(
        "import sys, chainrun\n"
        "(chain,) = chainrun.submit(dict(name='k', command='sleep 600', workdir=sys.argv[1],"
        " total_time='1h', walltime='10m'))\n"
        "print(chain.id, flush=True)\n"
        "try:\n    chain.wait()\nexcept KeyboardInterrupt:\n    print('interrupted', flush=True)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)], env=cli_env(home), stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        (chain,) = chainrun.chains(proc.stdout.readline().strip(), home=home)
        wait_for(lambda: chain.status()["segments"][:1] != [], 120, "the segment to be submitted")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 0 and proc.stdout.read() == "interrupted\n"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert chain.state == "active" and chain.status()["segments"][0]["phase"] in ("pending", "running")
    assert chain.cancel() == "cancelled"  # no service holds the directory: done here, at once
