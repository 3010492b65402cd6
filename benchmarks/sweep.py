"""Scheduler commands a sweep of 1,000 configurations costs per wave on Slurm.

The service's real ``Engine``, the real Slurm backend and the real local
transport run fake Slurm tools (bash scripts first on PATH, as in
``benchmarks/service.py``, whose fake ``sbatch`` here also understands
``--array``: one ``BASE_INDEX`` line per task in the fake ``squeue``). A sweep
of N configurations is stored as ``chainrun submit`` stores it, then ticked:

- **first wave**: the tick that submits every chain's first segment;
- **successors**: the next tick, which queues each chain's second segment
  behind its first (``--dependency=afterany:BASE_INDEX``);
- **steady**: ticks with nothing to submit (the poll alone).

Each is measured twice, in fresh interpreters: with job arrays (a sweep on
Slurm) and without (the same chains as separate job files: every first
segment its own ``sbatch``, as before arrays). Usage:
``python benchmarks/sweep.py [--sizes 1000] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

TICK = 10.0

# The fake Slurm: squeue prints its file, sbatch appends the job (or each array task) to it.
FAKE = {
    "squeue": 'cat "$FAKE_SLURM/squeue.txt"',
    "sacct": "true",
    "scancel": "true",
    "sbatch": r"""id=$(( $(cat "$FAKE_SLURM/next") + 0 )); echo $(( id + 1 )) > "$FAKE_SLURM/next"
array=""
for arg in "$@"; do case $arg in --array=*) array=${arg#--array=} ;; esac; done
name=$(sed -n 's/^#SBATCH --job-name=//p' "${*: -1}" | head -n 1)  # its tag, or its array's name
if [ -n "$array" ]; then
    range=${array%%\%*}
    for part in ${range//,/ }; do
        for ((i = ${part%-*}; i <= ${part#*-}; i++)); do
            printf '%s_%s|%s|PENDING|JobArrayTaskLimit|N/A|N/A|\n' "$id" "$i" "$name"
        done
    done >> "$FAKE_SLURM/squeue.txt"
else
    printf '%s|%s|PENDING|Priority|N/A|N/A|\n' "$id" "$name" >> "$FAKE_SLURM/squeue.txt"
fi
echo "$id"
""",
}


def _tools(root: Path) -> Path:
    bin_dir = root / "bin"
    bin_dir.mkdir()
    for name, body in FAKE.items():
        path = bin_dir / name
        path.write_text(f'#!/bin/bash\nprintf "%s\\n" "{name} $*" >> "$FAKE_SLURM/calls.log"\n{body}\n')
        path.chmod(0o755)
    (root / "calls.log").touch()
    (root / "squeue.txt").touch()
    (root / "next").write_text("1000000\n")
    return bin_dir


def one_case(root: Path, n: int, arrays: bool) -> dict[str, Any]:
    """Store a sweep of ``n`` chains, tick through its waves, count the commands of each."""
    os.environ["FAKE_SLURM"] = str(root)
    os.environ["PATH"] = f"{_tools(root)}:{os.environ['PATH']}"
    from chainrun import logsetup
    from chainrun.engine import Engine
    from chainrun.model import NO_PROGRESS, JobSpec, SchedulerSpec
    from chainrun.store import Store
    from chainrun.sweep import expand

    logsetup.setup("warning", stream=sys.stderr, pretty=False)
    (root / "work").mkdir()
    spec = JobSpec(
        name="bench",
        command="python train.py --lr {lr}",
        workdir=str(root / "work"),
        total_time=72 * 3600,
        walltime=4 * 3600,
        target_epoch=200,
        max_failures=3,
        checkpoint_dir=str(root / "work" / "ckpt"),
        signal="USR1",
        grace=300,
        scheduler=SchedulerSpec(kind="slurm"),
        sweep=tuple((("lr", json.dumps(1e-4 * (i + 1))),) for i in range(n)),
    )
    specs = expand(spec)
    if not arrays:  # the same chains as separate job files: no sweep, no array
        specs = [replace(s, sweep_name="", params=(), rep=0) for s in specs]
    store = Store(root / "home")
    now = [time.time()]
    store.add_chains([(s, NO_PROGRESS) for s in specs], now[0])
    engine = Engine(store, clock=lambda: now[0])

    def tick() -> dict[str, Any]:
        before = len((root / "calls.log").read_text().splitlines())
        now[0] += TICK
        wall = time.perf_counter()
        engine.tick()
        wall = time.perf_counter() - wall
        calls = (root / "calls.log").read_text().splitlines()[before:]
        return {"commands": dict(collections.Counter(c.split()[0] for c in calls)), "wall_s": wall}

    result = {"n": n, "arrays": arrays, "first": tick(), "successors": tick(), "steady": tick()}
    store.close()
    return result


def _case(n: int, arrays: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="chainrun-bench-") as tmp:
        argv = [sys.executable, __file__, "--one", str(n), "--root", tmp]
        out = subprocess.run(
            [*argv, *(["--arrays"] if arrays else [])], check=True, capture_output=True, text=True
        )
        return dict(json.loads(out.stdout.splitlines()[-1]))


def _count(wave: dict[str, Any]) -> str:
    commands = wave["commands"]
    text = ", ".join(f"{k} {v}" for k, v in sorted(commands.items()))
    return f"{sum(commands.values())} ({text})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000])
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--arrays", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one_case(args.root, args.one, args.arrays)))
        return
    rows = []
    for n in args.sizes:
        for arrays in (True, False):
            r = _case(n, arrays)
            print(f"{n} arrays={arrays}: {r}", file=sys.stderr)
            how = "sweep, job arrays" if arrays else "separate chains, no arrays"
            for wave in ("first", "successors", "steady"):
                rows.append((f"{n:,} chains, {how}: {wave}", _count(r[wave]), f"{r[wave]['wall_s']:.2f} s"))
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    table = [f"{os.cpu_count()} cores, load average at the end {load}", ""]
    table += ["| sweep and wave (one tick) | scheduler commands | tick wall time |", "|---|---|---|"]
    table += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    text = "\n".join(table)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
