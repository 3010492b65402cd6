"""The house in layers (DESIGN.md "Layers"): every module of chainrun has a layer, an import
only ever points down (a layer may use those below it, never one above), and nothing imports
itself round in a circle, type-only imports and imports inside functions included. A module
is small enough to hold one job. Read from the source with ``ast``: nothing is imported."""

from __future__ import annotations

import ast
import glob
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "chainrun"

# Lowest first. A module is placed by its name, or by the package it is in.
LAYERS: dict[str, tuple[str, ...]] = {
    "base": (
        "chainrun.constants",
        "chainrun.errors",
        "chainrun.logsetup",
        "chainrun.values",  # how the many-instance values are declared: with slots (3.10 on)
        "chainrun.places",  # where a chain runs: a scheduler table, a place of several, a start
        "chainrun.result",  # what a finished command returned
        "chainrun.model",
        "chainrun.fields",
        "chainrun.text",
        "chainrun.home",  # where the state lives: the store's, the CLI's, the local runner's
        "chainrun.starts",  # when a segment would start at one place (Cluster.expected_start)
        "chainrun.checkpoint",  # the helper: inside training jobs, the standard library alone
    ),
    "rules": ("chainrun.schema", "chainrun.sweep", "chainrun.container", "chainrun.decide"),
    "backends": ("chainrun.schedulers",),
    "node": ("chainrun.node",),  # the segment runner, in the job: shipped with the rules it applies
    "wire": (
        "chainrun.transport",
        "chainrun.localrunner",
        "chainrun.cluster",
        "chainrun.rundir",
        "chainrun.markers",
        "chainrun.progress",
        "chainrun.snapshot",
        "chainrun.transfer",  # a checkpoint copied, verified, from one place to another
        "chainrun.jobfile",
        "chainrun.testing",
        "chainrun.hostserver",
        "chainrun.location",  # where a checkpoint directory really is, asked of its host
    ),
    "memory": ("chainrun.store",),
    "service": (
        "chainrun.engine",
        "chainrun.service",
        "chainrun.lock",
        "chainrun.heartbeat",
        "chainrun.doorbell",  # `chainrun submit` asks the running service to tick now
        "chainrun.systemd",
        "chainrun.sdnotify",
        "chainrun.config",
        "chainrun.notify",
        "chainrun.carry",
        "chainrun.gc",
    ),
    "face": (
        "chainrun",  # the package itself: the Python API, loaded on first use
        "chainrun.__main__",
        "chainrun.cli",  # the commands; cli.group its click frame, cli.web the web commands
        "chainrun.check",
        "chainrun.status",
        "chainrun.poolstatus",
        "chainrun.sweepstatus",
        "chainrun.sweeprun",
        "chainrun.run",
        "chainrun.history",
        "chainrun.accounting",
        "chainrun.ui",
        "chainrun.submission",
        "chainrun.cancel",
        "chainrun.api",
        "chainrun.tensorboard",
    ),
}
ORDER = list(LAYERS)
MAX_LINES = 700
LONGER_ALLOWED = {"chainrun.checkpoint.torch"}  # the PyTorch helper


def modules() -> dict[str, Path]:
    """Every module of the package, by its dotted name."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def layer(name: str) -> str:
    """The layer of module ``name``: its own entry, else its package's (the longest match)."""
    best, where = "", ""
    for level, names in LAYERS.items():
        for prefix in names:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > len(best):
                best, where = prefix, level
    if not where:
        raise AssertionError(f"{name} has no layer: add it to LAYERS (and to DESIGN.md's table)")
    return where


def imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """The chainrun modules ``name`` imports, each with its line: at the top, under
    TYPE_CHECKING, or inside a function alike."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "chainrun":
                    yield _module(alias.name, known), node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], base]).rstrip(".")
            if base.split(".")[0] != "chainrun":
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield (full if full in known else _module(base, known)), node.lineno


def _module(name: str, known: dict[str, Path]) -> str:
    while name not in known:
        name = name.rpartition(".")[0]
    return name


def graph() -> dict[str, dict[str, int]]:
    known = modules()
    return {
        name: {target: line for target, line in imports(name, path, known) if target != name}
        for name, path in known.items()
    }


def test_every_module_has_a_layer_and_imports_point_down_only() -> None:
    """An import of a module in a higher layer is a wrong arrow: the lower layer would
    depend on what is built on it."""
    upward = [
        f"{name}:{line} ({layer(name)}) imports {target} ({layer(target)})"
        for name, targets in graph().items()
        for target, line in targets.items()
        if ORDER.index(layer(target)) > ORDER.index(layer(name))
    ]
    assert upward == []


def test_no_module_takes_a_name_of_the_python_api() -> None:
    """``chainrun.submit(...)`` is the API's; a module ``chainrun/submit.py``, once imported,
    would replace it with itself (a package's submodule is set as its attribute)."""
    import chainrun

    assert {f"chainrun.{name}" for name in chainrun.__all__} & modules().keys() == set()


def test_no_module_imports_itself_round_a_circle() -> None:
    """No cycle among the imports, type-only ones included (a depth-first search)."""
    edges = graph()
    state: dict[str, int] = {}  # 1: on the path now, 2: done
    path: list[str] = []
    cycles: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for target in sorted(edges[name]):
            if state.get(target) == 1:
                cycles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target)
        path.pop()
        state[name] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name)
    assert cycles == []


@pytest.mark.parametrize("name", sorted(modules()))
def test_a_module_holds_one_job_in_at_most_700_lines(name: str) -> None:
    """A module past 700 lines does several jobs: split it along them (the PyTorch helper aside)."""
    lines = len(modules()[name].read_text().splitlines())
    assert name in LONGER_ALLOWED or lines <= MAX_LINES, f"{name}: {lines} lines"


def test_the_backends_run_nothing_and_touch_no_file() -> None:
    """A backend builds commands and parses answers: it imports no transport, no store, and
    nothing that starts a process (``subprocess``, ``os.system``); ``Cluster.call`` runs what it builds."""
    for name, path in modules().items():
        if layer(name) not in ("rules", "backends"):
            continue
        tree = ast.parse(path.read_text())
        used = {
            alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])
        }
        assert not used & {"subprocess", "socket", "sqlite3", "paramiko"}, (name, used)
        assert "os.system" not in path.read_text(), name


def test_only_the_cluster_runs_what_a_backend_builds() -> None:
    """A backend's commands (``*_argv``) are built for ``Cluster.call``, the one function that
    runs a scheduler command; ``check``'s plan builds the first submission only to show it."""
    builders = re.compile(r"\.(poll|submit|cancel|accounting|explain|array_submit)_argv\(")
    allowed = {"chainrun.cluster", "chainrun.check", "chainrun.testing"}
    found = [
        name
        for name, path in modules().items()
        if layer(name) != "backends" and name not in allowed and builders.search(path.read_text())
    ]
    assert found == []
    calls = re.findall(r"\.transport\.run\(|transport\.run\(", (PACKAGE / "cluster.py").read_text())
    assert len(calls) == 1  # in Cluster.call


# Where an epoch is compared with the target outside the rule, and why that is no second rule.
TARGET_COMPARED_ELSEWHERE = {"chainrun.status": "the ETA shown: 0 s once the epoch is there"}


def test_the_completion_rule_is_defined_once() -> None:
    """Whether a chain's goal is reached (done, target_epoch, or exit 0 on its own) is
    ``decide.goal``'s alone: before, decide, the carrier and submit each spelled it out."""
    spelled = set()
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.GtE, ast.LtE)) for op in node.ops):
                text = ast.unparse(node)
                if "epoch" in text and "target" in text:
                    spelled.add(name)
    assert spelled - set(TARGET_COMPARED_ELSEWHERE) == {"chainrun.decide.goal"}, spelled


def test_no_shell_script_in_the_package_holds_policy() -> None:
    """Rules live in Python, where unit tests and mutants reach them: a shell file shipped in
    the package is at most 60 lines (the segment wrapper was 429, with 21 functions)."""
    long = {
        str(path.relative_to(PACKAGE)): n
        for path in PACKAGE.rglob("*.sh")
        if (n := len(path.read_text().splitlines())) > 60
    }
    assert long == {}


@pytest.mark.parametrize("runner", ["SEGMENT_RUNNER", "LOCAL_RUNNER", "CARRIER"])
def test_a_runner_ships_with_what_it_imports_and_runs_on_python_3_8(runner: str) -> None:
    """The segment runner and the local runner run on a node's python3, without chainrun:
    each and the modules it takes along import the standard library and each other alone, in
    Python 3.8's syntax."""
    from chainrun.schedulers import ship

    shipped = {
        ("chainrun." + name[: -len(".py")].replace("/", ".")).removesuffix(".__init__")
        for name in getattr(ship, runner).modules
    }
    known = modules()
    for name in shipped:
        ast.parse(known[name].read_text(), feature_version=(3, 8))
        outside = {target for target, _ in imports(name, known[name], known)} - shipped
        assert outside == set(), name


def pythons() -> dict[str, str]:
    """Each Python 3.8 or later on this machine, by version: this one, those on PATH
    (``python3.N``), and pyenv's."""
    found = {".".join(map(str, sys.version_info[:2])): sys.executable}
    candidates = [shutil.which(f"python3.{minor}") for minor in range(8, 20)]
    candidates += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.*/bin/python3")))
    for path in filter(None, candidates):
        answer = subprocess.run(
            [path, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True
        )
        version = answer.stdout.strip()
        if answer.returncode == 0 and tuple(map(int, version.split("."))) >= (3, 8):
            found.setdefault(version, path)
    return found


@pytest.mark.parametrize("runner", ["SEGMENT_RUNNER", "LOCAL_RUNNER", "CARRIER"])
def test_each_runner_archive_imports_on_every_python_from_3_8_here(runner: str, tmp_path: Path) -> None:
    """Parsing is not running: a ``tuple[int, int]`` outside an annotation, ``functools.cache``
    or ``str.removeprefix`` parse as 3.8 and fail there. Each archive is imported (the
    carrier: run with ``--probe``, as submit does) by every interpreter from 3.8 on found
    here (pyenv's on the project's machines)."""
    from chainrun.schedulers import ship

    shipped = getattr(ship, runner)
    archive = tmp_path / shipped.name()
    archive.write_bytes(shipped.data())
    entry = {"SEGMENT_RUNNER": "chainrun.node.runner", "LOCAL_RUNNER": "chainrun.localrunner"}
    for version, python in sorted(pythons().items()):
        if runner == "CARRIER":
            argv = [python, "-I", str(archive), "--probe", ship.SEGMENT_RUNNER.name()]
        else:
            argv = [
                python,
                "-I",
                "-c",
                f"import sys; sys.path.insert(0, sys.argv[1]); import {entry[runner]}",
            ]
            argv.append(str(archive))
        answer = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert answer.returncode == 0, (version, answer.stderr[-2000:])


# The rules the engine may call besides decide(): what to observe and what a carried-out
# action came to (engine/__init__.py says why each). Everything a tick does comes from decide.
ENGINE_MAY_CALL = {
    "chain.decide",
    "chain.quiet_until",
    "chain.listed_as_its",  # a listed job is a segment's under its id and its name alone
    "facts.Facts",
    "facts.JobFacts",
    "placement.held_back",
    "placement.observe_on",
    "placement.free_slots",
    "placement.shared",
    "places.asks",  # a chain with several places about to queue: its places are asked
    "places.copy_from",  # a segment at another place: its checkpoint copied there first
    "places.copy_host",  # ... read on the host the chain ran on there (a pool's)
    "places.pool_start",  # a pool place's answer: its hosts' soonest
    "placement.pools",  # every pool host a chain may be placed on is polled
    "places.ASK_EVERY",
    "places.saved",  # a move's source checkpoint missing: an error once the chain has saved
    "chain.questions",  # what each place is asked: the next segment's shape there
    "retry.after_fault",
    "retry.after_submit",
    "retry.array_refused",
    "retry.accounting_due",
    "retry.accounting_again",
    "retry.owed_to_send",  # a cancel owed on a cluster that answers: sent to the jobs it lists
    "retry.owed_given_up",  # ... or given up after a week
    "carry.applies",
    "startup.slow_start",  # what to warn the webhook of, once
}


def _decide_names(path: Path) -> set[str]:
    """The names of ``chainrun.decide`` a module uses, as ``submodule.name``: imported by
    name, or reached as an attribute of an imported submodule."""
    import chainrun.decide as decide

    tree = ast.parse(path.read_text())
    used: set[str] = set()
    modules_as: dict[str, str] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("chainrun.decide"):
            continue
        for alias in node.names:
            local = alias.asname or alias.name
            if node.module == "chainrun.decide":
                target = getattr(decide, alias.name)
                if isinstance(target, type(decide)):
                    modules_as[local] = alias.name
                else:
                    used.add(f"{target.__module__.rsplit('.', 1)[1]}.{alias.name}")
            else:
                used.add(f"{node.module.rsplit('.', 1)[1]}.{alias.name}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules_as
        ):
            used.add(f"{modules_as[node.value.id]}.{node.attr}")
    return used


def test_the_engine_calls_decide_and_a_short_list_of_rules_alone() -> None:
    """Where a new segment goes, why a chain waits, which jobs a host that is back must
    cancel: decide answers, as actions the history shows. The engine asks it, and besides it
    only the rules that say what to observe and what an action came to."""
    used = set().union(
        *(_decide_names(path) for name, path in modules().items() if name.startswith("chainrun.engine"))
    )
    assert used <= ENGINE_MAY_CALL, used - ENGINE_MAY_CALL
    assert "chain.decide" in used
