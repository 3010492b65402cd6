"""The mutation score of chainrun's pure core: how many small, plausible bugs the fast tests catch.

mutmut (a well-kept mutation tester) makes every small change it knows to the modules below
(an operator flipped, a constant moved by one, a string changed, a branch inverted, an
argument dropped), one at a time, and runs the fast, cluster-free tests that reach the
changed function against each. A mutant the tests fail on is *killed*; one they pass on
*survived*: either a bug the suite would let through, or a change that means nothing
(*equivalent*). ``benchmarks/README.md`` keeps the table and says of every survivor of the
decide module which it is.

The run happens in a copy of the repository (mutmut writes its ``mutants/`` tree there), so
the working tree is never touched. It is not part of ``scripts/test``: it takes minutes.
Each module measured is recorded in ``benchmarks/mutation.json`` (the commit, a sha256 of
the bytes mutated, the counts), so that ``tests/test_benchmarks.py`` fails when a module
changed after its score was measured.

Usage: ``.venv/bin/python benchmarks/mutation.py [--modules decide ...] [--max-children N]
[--keep DIR]``; prints a Markdown table and the survivors, one line each.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MUTMUT = "mutmut==3.8.1"
RECORD = REPO / "benchmarks" / "mutation.json"  # what was measured: each module's commit and sha256

# What is mutated, by name: the modules, and the fast tests that pin them.
TARGETS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "decide": (
        (
            "chainrun/decide/chain.py",
            "chainrun/decide/charge.py",
            "chainrun/decide/retry.py",
            "chainrun/decide/placement.py",
            "chainrun/decide/grace.py",
            "chainrun/decide/startup.py",
            "chainrun/decide/places.py",
        ),
        (
            "tests/test_decide.py",
            "tests/test_decide_edges.py",
            "tests/test_rules.py",
            "tests/test_boundaries.py",
            "tests/test_invariants.py",
            "tests/test_engine.py",
            "tests/test_arrays.py",
            "tests/test_pool.py",
            "tests/test_decide_places.py",
            "tests/test_decide_pool_places.py",
        ),
    ),
    "rules": (  # what a segment may queue while the service is away, and who holds a directory
        ("chainrun/decide/carry.py", "chainrun/decide/holds.py"),
        ("tests/test_carry.py", "tests/test_holds.py", "tests/test_holds_places.py", "tests/test_decide.py"),
    ),
    "runner": (  # the rules the segment runner applies in the job, and the completion rule
        ("chainrun/decide/segment.py", "chainrun/decide/goal.py"),
        (
            "tests/test_segment_rules.py",
            "tests/test_decide.py",
            "tests/test_decide_edges.py",
            "tests/test_rules.py",
            "tests/test_carry.py",
        ),
    ),
    # Which segment may commit into a checkpoint directory. Its own target, with the tests that
    # call it in the test's process: a segment runner started as a job ships the module's
    # mutated copy, which does not run there (mutmut's trampoline), so those tests would fail
    # on every mutant, and on the runner target's too.
    "fence": (
        ("chainrun/checkpoint/_fence.py",),
        tuple(
            f"tests/test_fence.py::test_{name}"
            for name in (
                "the_helper_commits_while_its_segment_holds_the_fence_and_never_after",
                "a_requeued_run_of_a_segment_is_newer_and_a_later_job_of_one_segment_wins",
                "a_fence_reads_only_as_four_fields_with_numbers_where_numbers_go",
                "only_the_fences_token_or_no_fence_at_all_lets_a_segment_commit",
                "taking_the_fence_replaces_it_whole_and_leaves_no_temporary_file",
                "only_a_fences_first_512_bytes_are_read",
            )
        ),
    ),
    "schema": (
        ("chainrun/schema.py",),
        (
            "tests/test_jobfile.py",
            "tests/test_boundaries.py",
            "tests/test_sweep.py",
            "tests/test_pool.py",
            "tests/test_container.py",
        ),
    ),
    "renderer": (
        ("chainrun/schedulers/script.py",),
        (
            "tests/test_slurm_backend.py",
            "tests/test_sge_backend.py",
            "tests/test_wrapper.py",
            "tests/test_container.py",
            "tests/test_arrays.py",
        ),
    ),
}
FAST = (
    "not slurm and not sge and not ssh and not slow and not torch and not tensorflow and not tests_the_tests"
)


def config(files: tuple[str, ...], tests: tuple[str, ...]) -> str:
    """mutmut's section of pyproject.toml for one target."""

    def toml_list(values: tuple[str, ...] | list[str]) -> str:
        return "[" + ", ".join(f'"{v}"' for v in values) + "]"

    return (
        "\n[tool.mutmut]\n"
        'source_paths = ["chainrun"]\n'
        'also_copy = ["docs"]\n'  # tests read the pages they point users to
        f"only_mutate = {toml_list(files)}\n"
        f"pytest_add_cli_args_test_selection = {toml_list(tests)}\n"
        f"pytest_add_cli_args = {toml_list(['-p', 'no:cacheprovider', '-x', '-q', '-m', FAST])}\n"
    )


def copy_repository(into: Path) -> None:
    for name in ("chainrun", "tests", "docs"):
        shutil.copytree(REPO / name, into / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("setup.cfg", "pyproject.toml"):
        shutil.copy(REPO / name, into / name)


def mutmut(where: Path, *args: str, log: Path | None = None) -> str:
    """Run mutmut in ``where``; its output (the progress spinner goes to ``log``)."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "CHAINRUN_REQUIRE_CLUSTERS": "0"}
    argv = [sys.executable, "-m", "mutmut", *args]
    if log is None:
        return subprocess.run(argv, cwd=where, env=env, capture_output=True, text=True, check=True).stdout
    with open(log, "w") as out:
        subprocess.run(argv, cwd=where, env=env, stdout=out, stderr=subprocess.STDOUT, check=True)
    return ""


def statuses(where: Path) -> dict[str, str]:
    """Every mutant's name and what became of it (killed, survived, timeout, ...)."""
    found = {}
    for line in mutmut(where, "results", "--all", "true").splitlines():
        name, _, status = line.strip().rpartition(": ")
        if name:
            found[name] = status
    return found


def change(where: Path, name: str) -> str:
    """A mutant's change as one line: ``old  ->  new``."""
    diff = mutmut(where, "show", name).splitlines()
    old = [line[1:].strip() for line in diff if line.startswith("-") and not line.startswith("---")]
    new = [line[1:].strip() for line in diff if line.startswith("+") and not line.startswith("+++")]
    return f"{' '.join(old)[:90]}  ->  {' '.join(new)[:90]}"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def commit_of(path: str) -> str:
    """The commit the working tree is at, ``+changes`` where ``path`` differs from it."""
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    changed = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", path], cwd=REPO).returncode != 0
    return head + ("+changes" if changed else "")


def record(measured: dict[str, dict[str, object]]) -> None:
    """Merge this run's modules into ``RECORD``, keeping those it did not measure."""
    modules = json.loads(RECORD.read_text())["modules"] if RECORD.exists() else {}
    modules.update(measured)
    text = json.dumps({"mutmut": MUTMUT, "modules": dict(sorted(modules.items()))}, indent=2)
    RECORD.write_text(text + "\n")


def run(target: str, max_children: int, keep: Path | None) -> tuple[list[str], list[str]]:
    files, tests = TARGETS[target]
    scratch = Path(tempfile.mkdtemp(prefix=f"chainrun-mutation-{target}-"))
    try:
        copy_repository(scratch)
        measured: dict[str, dict[str, object]] = {
            path: {"target": target, "commit": commit_of(path), "sha256": sha256(scratch / path)}
            for path in files
        }
        with open(scratch / "pyproject.toml", "a") as f:
            f.write(config(files, tests))
        started = time.monotonic()
        mutmut(scratch, "run", "--max-children", str(max_children), log=scratch / "mutmut.log")
        took = time.monotonic() - started
        found = statuses(scratch)
        rows, survivors = [], []
        for path in files:
            module = path.removesuffix(".py").replace("/", ".")
            mine = {n: s for n, s in found.items() if re.match(re.escape(module) + r"\.x", n)}
            killed = sum(1 for s in mine.values() if s == "killed")
            survived = sorted((n for n, s in mine.items() if s == "survived"), key=_order)
            other = len(mine) - killed - len(survived)
            score = f"{100 * killed / len(mine):.1f}%" if mine else "-"
            rows.append(f"| {path} | {len(mine)} | {killed} | {len(survived)} | {other} | {score} |")
            measured[path].update(mutants=len(mine), killed=killed, survived=len(survived))
            measured[path]["measured"] = datetime.date.today().isoformat()
            survivors += [f"- `{n.removeprefix(module + '.x')}`: `{change(scratch, n)}`" for n in survived]
        rows.append(f"| ({target}: {took / 60:.1f} min with {max_children} workers) | | | | | |")
        record(measured)
        return rows, survivors
    finally:
        if keep is not None:
            shutil.copytree(scratch, keep / target, dirs_exist_ok=True)
        shutil.rmtree(scratch, ignore_errors=True)


def _order(name: str) -> tuple[str, int]:
    function, _, n = name.rpartition("__mutmut_")
    return function, int(n) if n.isdigit() else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modules", nargs="+", choices=list(TARGETS), default=list(TARGETS))
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--keep", type=Path, default=None, help="keep mutmut's trees here, to look at them")
    args = parser.parse_args()
    try:
        import mutmut  # noqa: F401
    except ImportError:
        print(f"mutation: needs {MUTMUT}: scripts/setup-venv mutation", file=sys.stderr)
        return 2
    load = os.getloadavg()[0]
    python = sys.version.split()[0]
    print(f"Machine: {os.cpu_count()} cores, Python {python}; load average {load:.1f} at the start.")
    print()
    print("| module | mutants | killed | survived | other (timeout, no test) | killed share |")
    print("|---|---|---|---|---|---|")
    all_survivors = []
    for target in args.modules:
        rows, survivors = run(target, args.max_children, args.keep)
        print("\n".join(rows), flush=True)
        all_survivors += [f"**{target}**", *survivors] if survivors else []
    print()
    print("Survivors:" if all_survivors else "No survivors.")
    for line in all_survivors:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
