"""How much of each allocation trains: the adaptive grace against today's fixed default.

Chains of a plain trainer (SegmentClock, a loop of 50 ms steps, then a save that takes
``--save`` seconds through CheckpointDir) run through the real CLI and service, side by
side in one run: on each scheduler asked for, one chain with no grace in its job file
(adaptive) and one with the default written out (``min(5m, walltime/4)``, what every
chain got before). Each segment's trainer records when its wrapper started (the deadline
minus the walltime), when it began and stopped training, and when its save was done; the
share is the training time over the walltime asked for.

The 1-hour row is not run: it is the same rule (``decide.grace``) applied to the stops and
start-up measured here, at a walltime of 3600 s (a scaled clock, not an hour of waiting).
Usage: ``python benchmarks/grace.py [--schedulers local slurm] [--walltime 120]
[--segments 4] [--save 1]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.chains import environment, serve_until_ended, submit  # noqa: E402
from chainrun.decide.grace import grace_in_force  # noqa: E402
from chainrun.model import JobSpec, Outcome, Phase, Segment  # noqa: E402
from chainrun.schema import default_grace  # noqa: E402

TRAINER = """\
import json, os, sys, time
began = time.time()
from chainrun.checkpoint import CheckpointDir, SegmentClock, load_progress
clock = SegmentClock()
directory = os.environ["CHAINRUN_CHECKPOINT_DIR"]
progress = load_progress(directory)
epoch = progress["epoch"] if progress else 0
start = time.time()
while not clock.should_stop():
    time.sleep(0.05)
stop = time.time()
def write(f):
    time.sleep(float(sys.argv[1]))  # the save the benchmark asks for
    f.write(b"state")
CheckpointDir(directory).save(write, epoch=epoch + 1, step=0)
deadline = float(os.environ["CHAINRUN_DEADLINE"])
with open("bench.jsonl", "a") as f:
    f.write(json.dumps({
        "segment": int(os.environ["CHAINRUN_SEGMENT"]), "grace": int(os.environ["CHAINRUN_GRACE"]),
        "deadline": deadline, "python": began, "start": start, "stop": stop, "saved": time.time(),
        "reason": clock.reason,
    }) + "\\n")
"""


def job_file(work: Path, kind: str, walltime: int, segments: int, save: float, fixed: bool) -> Path:
    work.mkdir(parents=True)
    (work / "train.py").write_text(TRAINER)
    lines = [
        f'name = "{work.name}"',
        f'command = "python3 train.py {save}"',
        f'workdir = "{work}"',
        'checkpoint_dir = "ckpt"',
        f'total_time = "{walltime * segments}s"',
        f'walltime = "{walltime}s"',
        "target_epoch = 100000",
        "max_failures = 0",
    ]
    if fixed:
        lines.append(f'grace = "{default_grace(walltime)}s"')
    lines += ["[scheduler]", f'kind = "{kind}"']
    path = work / "job.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def shares(work: Path, walltimes: dict[int, int]) -> list[dict[str, Any]]:
    """Each segment's record, with its share of its walltime (the last one, clamped to the
    time budget, is shorter than the others)."""
    rows = [json.loads(line) for line in (work / "bench.jsonl").read_text().splitlines()]
    for r in rows:
        walltime = walltimes[r["segment"]]
        r["walltime"] = walltime
        r["share"] = (r["stop"] - r["start"]) / walltime
        r["startup"] = r["start"] - (r["deadline"] - walltime)
        r["stopping"] = r["saved"] - r["stop"]
    return sorted(rows, key=lambda r: r["segment"])


def hour(rows: list[dict[str, Any]], adaptive: bool) -> tuple[int, float]:
    """The grace and share at a 1-hour walltime, from this run's stops and start-up."""
    spec = JobSpec("h", "x", "/w", 3600 * 4, 3600, None, 0, "/c", "USR1", default_grace(3600))
    spec = replace(spec, adaptive_grace=adaptive)
    segs = [
        Segment("h", r["segment"], 3600, Phase.ENDED, outcome=Outcome.TIMEOUT, stop=r["stopping"])
        for r in rows
    ]
    grace = grace_in_force(spec, segs).seconds
    startup = statistics.median(r["startup"] for r in rows)
    return grace, (3600 - grace - startup) / 3600


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedulers", nargs="+", default=["local", "slurm"])
    ap.add_argument("--walltime", type=int, default=120)
    ap.add_argument("--segments", type=int, default=4)
    ap.add_argument("--save", type=float, default=1.0)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="chainrun-grace-"))
    env = environment(root)
    runs = {}
    for kind in args.schedulers:
        for fixed in (True, False):
            work = root / f"{kind}-{'fixed' if fixed else 'adaptive'}"
            path = job_file(work, kind, args.walltime, args.segments, args.save, fixed)
            runs[(kind, fixed)] = work
            submit(env, path)
    load_before = os.getloadavg()[0]
    chains = serve_until_ended(env)
    walltimes = {c["name"]: {s["n"]: s["walltime"] for s in c["segments"]} for c in chains}
    records = {key: shares(work, walltimes[work.name]) for key, work in runs.items()}
    print(
        f"Machine: {os.cpu_count()} cores, Python {sys.version.split()[0]}; load average {load_before:.1f} "
        f"before and {os.getloadavg()[0]:.1f} after; walltime {args.walltime}s, a {args.save:g} s save, "
        f"{args.segments} segments a chain, the two chains of a scheduler side by side.\n"
    )
    print(
        "| scheduler | grace | walltime | segments' grace | training share, each segment "
        "| median of the full segments | goal |"
    )
    print("|---|---|---|---|---|---|---|")
    for (kind, fixed), rows in records.items():
        graces = " ".join(f"{r['grace']}s" for r in rows)
        each = " ".join(
            f"{100 * r['share']:.1f}%" + ("" if r["walltime"] == args.walltime else f" (of {r['walltime']}s)")
            for r in rows
        )
        median = statistics.median(r["share"] for r in rows if r["walltime"] == args.walltime)
        goal = "" if fixed else (f"{'met' if median >= 0.9 else 'MISSED'} (>= 90%)")
        label = "fixed default" if fixed else "adaptive"
        cells = f"{graces} | {each} | **{100 * median:.1f}%** | {goal}"
        print(f"| {kind} | {label} | {args.walltime}s | {cells} |")
        grace, share = hour(rows, not fixed)
        goal = "" if fixed else (f"{'met' if share >= 0.98 else 'MISSED'} (>= 98%)")
        print(f"| {kind} | {label} | 1h (scaled) | {grace}s | - | **{100 * share:.1f}%** | {goal} |")
    print()
    for (kind, fixed), rows in records.items():
        print(
            f"{kind}, {'fixed' if fixed else 'adaptive'}: start-up (wrapper to first step) median "
            f"{statistics.median(r['startup'] for r in rows):.2f}s; stop (signal to saved) max "
            f"{max(r['stopping'] for r in rows):.2f}s; stopped by: "
            + ", ".join(sorted({str(r["reason"]).split(" (")[0] for r in rows}))
        )


if __name__ == "__main__":
    main()
