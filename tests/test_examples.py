"""The examples work as their comments say.

Each example (``examples/NAME/``) tells its reader how to try it, in the
comments of ``chain.toml`` and the docstring of ``train.py``. These tests read
those instructions and carry them out, in a copy of the example under
``tmp_path`` (never in the repository). The convention, which reads as plain
instructions to a person:

* a line ``$ COMMAND``, indented by four or more spaces (after the ``#`` in
  ``chain.toml``), is a shell command to run in the example's directory; the
  commands of a file run in order, each must exit 0, and a chain that
  ``chainrun run`` started must end completed;
* in ``chain.toml``, other lines indented so after the ``#`` are a TOML
  snippet the comment asks to put in the file: each key in it replaces that
  key, each table in it replaces that whole table. A file's commands run on
  the job file so edited.

``chainrun check`` passes on every job file, as written and as edited.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, cli_env

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

EXAMPLES = REPO / "examples"
NAMES = sorted(p.name for p in EXAMPLES.iterdir() if (p / "chain.toml").is_file())
COMMAND = re.compile(r"^#?\s{4,}\$ (?P<command>.+)$")
SNIPPET = re.compile(r"^#\s{4,}(?P<toml>[^\s$].*)$")
# Generous: the slowest instruction trains for about a minute on 2 loaded cores.
COMMAND_TIMEOUT = 600
# One compute thread per framework: beside the suite's other workers, a thread
# pool that waits for a second core slows training many times over.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}


@dataclass(frozen=True)
class Instructions:
    """What one file of an example tells its reader to do."""

    edit: dict[str, Any]
    commands: list[str]


def instructions(path: Path) -> Instructions:
    lines = path.read_text().splitlines()
    commands = [m["command"] for m in map(COMMAND.match, lines) if m]
    snippet = [m["toml"] for m in map(SNIPPET.match, lines) if m] if path.suffix == ".toml" else []
    return Instructions(tomllib.loads("\n".join(snippet)), commands)


def framework(name: str) -> str:
    """The training library the example imports (which marker its runs carry)."""
    source = (EXAMPLES / name / "train.py").read_text()
    return "tensorflow" if re.search(r"^import tensorflow", source, re.M) else "torch"


def to_toml(data: dict[str, Any]) -> str:
    """A job file's data as TOML (strings, numbers, lists and one level of tables)."""

    def lines(table: dict[str, Any]) -> str:
        return "".join(f"{k} = {json.dumps(v)}\n" for k, v in table.items() if not isinstance(v, dict))

    tables = [f"\n[{k}]\n{lines(v)}" for k, v in data.items() if isinstance(v, dict)]
    return lines(data) + "".join(tables)


def copy_example(name: str, tmp_path: Path, edit: dict[str, Any]) -> Path:
    """A copy of the example as its reader starts it (no run's leftovers), with ``edit`` applied."""
    work = tmp_path / name
    shutil.copytree(EXAMPLES / name, work, ignore=shutil.ignore_patterns("checkpoints", ".chainrun"))
    if edit:
        job = tomllib.loads((work / "chain.toml").read_text())
        (work / "chain.toml").write_text(to_toml({**job, **edit}))
    return work


def sh(command: str, cwd: Path, home: Path) -> subprocess.CompletedProcess[str]:
    """Run ``command`` with bash as the reader would, with chainrun and python3 on PATH."""
    proc = subprocess.Popen(
        ["bash", "-c", command],
        cwd=cwd,
        env={**cli_env(home), **ONE_THREAD},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=COMMAND_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(
            f"`{command}` ran over {COMMAND_TIMEOUT}s:\n{out[-3000:]}\n{err[-3000:]}"
        ) from None
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def test_every_job_file_says_how_to_run_it() -> None:
    """Each example's chain.toml names the command that runs it, in the form tested below."""
    assert NAMES, f"no examples found in {EXAMPLES}"
    missing = [n for n in NAMES if not instructions(EXAMPLES / n / "chain.toml").commands]
    assert not missing, f"chain.toml without a `#     $ chainrun ...` line: {missing}"


@pytest.mark.parametrize("name", NAMES)
def test_job_file_passes_check_as_written_and_as_its_comment_edits_it(
    name: str, tmp_path: Path, home: Path
) -> None:
    """`chainrun check` accepts the job file a user copies, and the one its comment says to try."""
    edit = instructions(EXAMPLES / name / "chain.toml").edit
    for label, work in [("as written", copy_example(name, tmp_path / "a", {}))] + (
        [("as edited", copy_example(name, tmp_path / "b", edit))] if edit else []
    ):
        result = sh("chainrun check chain.toml", work, home)
        assert result.returncode == 0 or beyond_this_cluster(result), f"{name} {label}: {result.stderr}"
        assert result.returncode or f"valid job file for chain '{name}'" in result.stdout


# What the test Slurm cannot give (it has no GPUs, and four CPUs a node): an example written
# for a real cluster asks for it. `check` asks the scheduler only once the job file is valid.
_NOT_HERE = ("Invalid generic resource (gres) specification", "Requested node configuration is not available")


def beyond_this_cluster(result: subprocess.CompletedProcess[str]) -> bool:
    """``chainrun check`` refused only because the test Slurm would never start the shape."""
    return result.returncode == 2 and any(
        f"slurm would never start a segment of this shape: {why}" in result.stderr for why in _NOT_HERE
    )


def runs() -> list[Any]:
    """One case per example file that holds commands, marked by what it needs."""
    cases = []
    for name in NAMES:
        for file in ("chain.toml", "train.py"):
            if instructions(EXAMPLES / name / file).commands:
                marks = [pytest.mark.slow, getattr(pytest.mark, framework(name))]
                cases.append(pytest.param(name, file, marks=marks, id=f"{name}/{file}"))
    return cases


@pytest.mark.parametrize(("name", "file"), runs())
def test_instructions_run_as_written(name: str, file: str, tmp_path: Path, home: Path) -> None:
    """Every command an example's comments give runs in a fresh copy and exits 0; its chains complete."""
    pytest.importorskip(framework(name))
    said = instructions(EXAMPLES / name / file)
    work = copy_example(name, tmp_path, said.edit)
    chain = tomllib.loads((work / "chain.toml").read_text())["name"]
    for command in said.commands:
        result = sh(command, work, home)
        if command.startswith("chainrun check") and beyond_this_cluster(result):
            continue
        assert result.returncode == 0, (
            f"{name}/{file}: `{command}` exited {result.returncode}:\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
        if command.startswith("chainrun run"):
            status = json.loads(sh(f"chainrun status {chain} --json", work, home).stdout)
            assert status[0]["state"] == "completed", status[0]


# What a newcomer would take for something gone wrong, in what the demo shows.
ALARMING = re.compile(r"warn|traceback|error|exception|deprecat|_conversion_method_template", re.I)


@pytest.mark.slow
@pytest.mark.torch
def test_the_demo_on_a_fresh_clone_shows_no_warning_or_traceback(tmp_path: Path, home: Path) -> None:
    """`scripts/demo` in a fresh copy of the repository (its own .venv, with what the demo
    installs and nothing of this one's) completes its chain, and from the chain's first line on
    shows no warning, error or traceback: the training's own progress, as its last line too.
    Before, PyTorch without NumPy warned at each segment's start (`cpu =
    _conversion_method_template(...)`, the last line the live view showed). The install's own
    output is left out: it depends on the machine's pip configuration, not on chainrun."""
    pytest.importorskip("torch")
    clone = tmp_path / "chainrun"
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True)
    for name in files.stdout.decode().split("\0"):
        if name and (REPO / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, clone / name)
    env = {**cli_env(home), **ONE_THREAD}
    env.pop("PYTHONPATH")  # the demo's own install, not this checkout
    env.pop("VIRTUAL_ENV", None)
    result = subprocess.run(
        ["scripts/demo"],
        cwd=clone,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # in the order a terminal shows them
        text=True,
        timeout=2 * COMMAND_TIMEOUT,
    )
    out = result.stdout
    assert result.returncode == 0, out[-3000:]
    shown = out[out.index("chain quickstart-") :].splitlines()
    assert any("chain completed" in line for line in shown), out[-3000:]
    # It resumed across walltime-limited segments, on a fast machine too (paced epochs).
    assert any(line.endswith("segment 2 is running") for line in shown), out[-3000:]
    alarming = [line for line in shown if ALARMING.search(line)]
    assert not alarming, "\n".join(alarming[:10])
