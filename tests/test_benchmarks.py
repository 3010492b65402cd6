"""The mutation scores in benchmarks/README.md hold for the rules as they are: each mutated
module of the decide, rules, runner and fence targets is recorded (benchmarks/mutation.json) with a
sha256 of the bytes that were measured. The save benchmark runs in a quick mode."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from conftest import need

REPO = Path(__file__).resolve().parent.parent
CHECKED = ("decide", "rules", "runner", "fence")  # the targets whose scores carry a goal (issue 35)


def benchmark(name: str = "mutation") -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", REPO / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_mutated_rule_is_unchanged_since_its_mutation_score_was_measured() -> None:
    """A module of the decide, rules, runner or fence target whose bytes differ from those measured
    (or that was never measured) fails here, naming the module and how to measure it again."""
    mutation = benchmark()
    record = json.loads(mutation.RECORD.read_text())["modules"]
    stale = []
    for target in CHECKED:
        for path in mutation.TARGETS[target][0]:
            now = hashlib.sha256((REPO / path).read_bytes()).hexdigest()
            seen = record.get(path)
            if seen is None:
                stale.append(f"{path}: never measured; run: {command(target)}")
            elif seen["sha256"] != now:
                stale.append(
                    f"{path}: changed since its mutation score was measured at {seen['commit']} "
                    f"({seen['measured']}); run: {command(target)}"
                )
    assert not stale, (
        "the mutation scores in benchmarks/README.md no longer describe these modules:\n  "
        + "\n  ".join(stale)
        + '\nthen put the new table in benchmarks/README.md ("## Mutation score"), explain or kill '
        "each survivor, and commit benchmarks/mutation.json, which the run rewrites"
    )


def command(target: str) -> str:
    return f".venv/bin/python benchmarks/mutation.py --modules {target} --max-children 2"


def test_the_record_names_only_modules_the_benchmark_mutates() -> None:
    """A module dropped from TARGETS leaves no stale entry claiming a score."""
    mutation = benchmark()
    mutated = {path for files, _ in mutation.TARGETS.values() for path in files}
    record = json.loads(mutation.RECORD.read_text())["modules"]
    assert set(record) <= mutated, sorted(set(record) - mutated)
    assert all(entry["target"] in mutation.TARGETS for entry in record.values())


def test_the_save_benchmark_prints_its_table_in_a_quick_run(tmp_path: Path) -> None:
    """benchmarks/save.py on a 3 MB state, one repetition: every row, each with seconds and a
    ratio to the raw write measured in the same run, which is 1.00 itself."""
    need("torch", importlib.util.find_spec("torch") is not None, "scripts/setup-venv (the torch extra)")
    quick = ("--size-mb", "3", "--repeats", "1", "--dir", str(tmp_path))
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "save.py"), *quick],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [
        line.split(" | ") for line in run.stdout.splitlines() if line.startswith("| ") and "---" not in line
    ]
    assert rows[0] == ["| what", "seconds", "against raw |"]
    assert [row[0].removeprefix("| ") for row in rows[1:]] == [label for _, label in benchmark("save").ROWS]
    assert rows[1][2] == "1.00 |"
    for row in rows[1:]:
        assert float(row[1]) > 0 and float(row[2].removesuffix(" |")) > 0, row
    assert "commit " in run.stdout and "cores" in run.stdout
