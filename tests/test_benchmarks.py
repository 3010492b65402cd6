"""The mutation scores in benchmarks/README.md hold for the rules as they are: each mutated
module of the decide, rules, runner and fence targets is recorded (benchmarks/mutation.json) with a
sha256 of the bytes that were measured."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent
CHECKED = ("decide", "rules", "runner", "fence")  # the targets whose scores carry a goal (issue 35)


def benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mutation_benchmark", REPO / "benchmarks" / "mutation.py")
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
