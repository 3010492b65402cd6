"""Plain training against its compute time: a chainrun chain and a blind chain, on Slurm and SGE.

A plain trainer (steps of ``--step`` seconds, its step saved atomically on the walltime
signal or when its own budget is spent, resumed from it; done at ``--compute`` seconds of
steps) runs in segments of ``--walltime`` seconds, in the same run and side by side:

- **chainrun**: through the real CLI and service (``chainrun daemon``, its own home), the job
  file's ``progress`` naming the trainer's step file, the grace adaptive (no grace given);
- **blind**: the same trainer without chainrun, N jobs submitted at once, each held on the one
  before (Slurm ``sbatch --dependency=afterany``, SGE ``qsub -hold_jid``), each stopping its
  steps by a fixed budget of its own (``walltime - --margin``), as a script with no signal does.

Each trainer process writes one line when it exits: when its job script started (the start
of its parent, the segment runner, under chainrun; its own under the blind chain's ``exec``),
when it began, its first step, the signal, its last step's end, and when its save was done.
Under chainrun the segment runner's start and end markers (their mtimes) split the start-up
into the runner's own and the command's, and give the time after the save before the job ended.
The wall time runs from the first submission to the save of the last step; its overhead
beyond the compute is, exactly: the queue before the first job, each segment's start-up
(script start to first step) and save (last step's end to saved), and each gap (saved to the
next job's script start: the command's exit, the job's end, the scheduler's release of the
successor and its start).

Usage: ``python benchmarks/compute.py [--schedulers slurm sge] [--compute 300] [--walltime 120]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.chains import cli, environment, service, submit, until_ended  # noqa: E402
from chainrun.constants import DEFAULT_INTERVAL  # noqa: E402

TRAINER = """\
import json, os, signal, sys, time
began = time.time()
total, step_s, budget = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
def started(pid):  # a process's start, epoch seconds (to the clock tick)
    with open(f"/proc/{pid}/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        up = float(f.read().split()[0])
    return time.time() - (up - ticks / os.sysconf("SC_CLK_TCK"))
under = "CHAINRUN_SEGMENT" in os.environ
script = started(os.getppid() if under else os.getpid())  # the runner is the job script's exec
signalled = []
signal.signal(signal.SIGUSR1, lambda *_: signalled.append(time.time()))
try:
    with open("state.json") as f:
        step = json.load(f)["step"]
except OSError:
    step = 0
first = time.time()
before = step
while step < total and not signalled and (budget <= 0 or time.time() + step_s <= script + budget):
    time.sleep(step_s)  # resumed after a signal's handler: the step is finished, then saved
    step += 1
stop = time.time()
if step > before:
    with open("state.json.tmp", "w") as f:
        json.dump({"step": step}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace("state.json.tmp", "state.json")
    fd = os.open(".", os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
saved = time.time()
job = os.environ.get("SLURM_JOB_ID") or os.environ.get("JOB_ID") or ""
with open("bench.jsonl", "a") as f:
    f.write(json.dumps({
        "segment": int(os.environ.get("CHAINRUN_SEGMENT", 0)), "job": job, "script": script,
        "began": began, "first": first, "signal": signalled[0] if signalled else None, "stop": stop,
        "saved": saved, "steps": step - before, "step": step, "done": step >= total,
    }) + "\\n")
"""

BLIND = {
    "slurm": (
        "#!/bin/bash\n#SBATCH --job-name=blind\n#SBATCH --time={minutes}:{seconds:02d}\n"
        "#SBATCH --export=ALL\nexec python3 train.py {args}\n"
    ),
    "sge": (
        "#!/bin/bash\n#$ -N blind\n#$ -S /bin/bash\n#$ -j y\n#$ -l h_rt={walltime}\n#$ -V\n"
        "exec python3 train.py {args}\n"
    ),
}


def trainer_args(args: argparse.Namespace, budget: float) -> str:
    return f"{round(args.compute / args.step)} {args.step:g} {budget:g}"


def chainrun_chain(root: Path, kind: str, args: argparse.Namespace) -> Path:
    work = root / f"{kind}-chainrun"
    work.mkdir(parents=True)
    (work / "train.py").write_text(TRAINER)
    steps = round(args.compute / args.step)
    lines = [
        f'name = "compute-{kind}"',
        f'command = "python3 train.py {trainer_args(args, 0)}"',
        f'workdir = "{work}"',
        'checkpoint_dir = "ckpt"',
        'progress = "state.json:step"',
        f'total_time = "{args.compute * 4}s"',
        f'walltime = "{args.walltime}s"',
        f"target_epoch = {steps}",
        "[scheduler]",
        f'kind = "{kind}"',
    ]
    (work / "job.toml").write_text("\n".join(lines) + "\n")
    return work


def blind_chain(root: Path, kind: str, args: argparse.Namespace) -> tuple[Path, list[str]]:
    """The blind chain's jobs, each held on the one before: enough for the compute in jobs of
    ``walltime - margin`` seconds, and one more."""
    work = root / f"{kind}-blind"
    work.mkdir(parents=True)
    (work / "train.py").write_text(TRAINER)
    budget = args.walltime - args.margin
    script = work / "blind.sh"
    script.write_text(
        BLIND[kind].format(
            minutes=args.walltime // 60,
            seconds=args.walltime % 60,
            walltime=args.walltime,
            args=trainer_args(args, budget),
        )
    )
    return work, [str(script)] * (math.ceil(args.compute / (budget - 5)) + 1)


def submit_blind(kind: str, work: Path, scripts: list[str]) -> list[str]:
    ids: list[str] = []
    for script in scripts:
        if kind == "slurm":
            argv = ["sbatch", "--parsable", f"--output={work}/blind-%j.log", f"--chdir={work}"]
            argv += [f"--dependency=afterany:{ids[-1]}"] if ids else []
        else:
            argv = ["qsub", "-terse", "-o", f":{work}/blind.log", "-wd", str(work)]
            argv += ["-hold_jid", ids[-1]] if ids else []
        done = subprocess.run([*argv, script], capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            sys.exit(f"{argv[0]}: {done.stdout}{done.stderr}")
        ids.append(done.stdout.strip().split(";")[0])
    return ids


def records(work: Path) -> list[dict[str, Any]]:
    path = work / "bench.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return sorted((r for r in rows if r["steps"] > 0), key=lambda r: r["first"])


def blind_done(work: Path) -> bool:
    return any(r["done"] for r in records(work))


def markers(work: Path, n: int) -> tuple[Optional[float], Optional[float], Optional[int]]:
    """The mtimes of a chainrun segment's start and end markers (the runner writes them), and
    the grace its runner signalled at (the end marker's)."""
    times: list[Optional[float]] = []
    grace = None
    for suffix in ("start", "end"):
        found = list(work.glob(f".chainrun/*/seg-{n:04d}.{suffix}"))  # the chain's run directory
        times.append(found[0].stat().st_mtime if found else None)
        for line in found[0].read_text().splitlines() if found and suffix == "end" else []:
            grace = int(line[len("grace=") :]) if line.startswith("grace=") else grace
    return times[0], times[1], grace


def breakdown(work: Path, submitted: float, args: argparse.Namespace, chainrun: bool) -> dict[str, Any]:
    rows = records(work)
    if not rows or not rows[-1]["done"]:
        sys.exit(f"{work}: the trainer never reached its goal; see its logs there")
    last = rows[-1]
    for r, after in zip(rows, [*rows[1:], None]):
        r["startup"] = r["first"] - r["script"]
        r["save"] = r["saved"] - r["stop"]
        r["gap"] = after["script"] - r["saved"] if after else 0.0
        r["unused"] = r["script"] + args.walltime - r["saved"]
        r["runner"] = r["tail"] = r["grace"] = None
        if chainrun:
            start, end, grace = markers(work, r["segment"])
            r["runner"] = start - r["script"] if start else None
            r["tail"] = end - r["saved"] if end else None
            r["grace"] = grace
    wall = last["saved"] - submitted
    compute = sum(r["steps"] for r in rows) * args.step
    return {
        "rows": rows,
        "wall": wall,
        "compute": compute,
        "queue": rows[0]["script"] - submitted,
        "ratio": wall / compute,
    }


def seconds(values: list[Optional[float]]) -> str:
    shown = [v for v in values if v is not None]
    return " ".join(f"{v:.2f}" for v in shown) if shown else "-"


def table(kind: str, results: dict[str, dict[str, Any]]) -> None:
    print(f"\n{kind}:\n")
    print(
        "| chain | compute s | wall s (submit to done) | ratio | segments | queue before the first s "
        "| start-up s (script to first step), each | of it, the runner's own s | save s, each "
        "| gap s (saved to next script start), each | of it, after the save until the job ended s "
        "| walltime left unused s, each | grace s (the runner's) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, b in results.items():
        rows = b["rows"]
        print(
            f"| {name} | {b['compute']:.0f} | {b['wall']:.1f} | **{b['ratio']:.3f}x** | {len(rows)} "
            f"| {b['queue']:.2f} | {seconds([r['startup'] for r in rows])} "
            f"| {seconds([r['runner'] for r in rows])} | {seconds([r['save'] for r in rows])} "
            f"| {seconds([r['gap'] for r in rows[:-1]])} | {seconds([r['tail'] for r in rows[:-1]])} "
            f"| {seconds([r['unused'] for r in rows[:-1]])} "
            f"| {' '.join(str(r['grace'] or '-') for r in rows)} |"
        )
    print()
    for name, b in results.items():
        rows = b["rows"]
        over = b["wall"] - b["compute"]
        parts = {
            "queue": b["queue"],
            "start-up": sum(r["startup"] for r in rows),
            "save": sum(r["save"] for r in rows),
            "gaps": sum(r["gap"] for r in rows[:-1]),
        }
        print(
            f"{kind}, {name}: {over:.1f} s beyond the compute: "
            + ", ".join(f"{k} {v:.1f} s" for k, v in parts.items())
            + f"; median gap {statistics.median([r['gap'] for r in rows[:-1]] or [0]):.2f} s"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedulers", nargs="+", default=["slurm", "sge"], choices=["slurm", "sge"])
    ap.add_argument("--compute", type=int, default=300, help="seconds of steps to the goal")
    ap.add_argument("--step", type=float, default=1.0, help="seconds a step")
    ap.add_argument("--walltime", type=int, default=120)
    ap.add_argument("--interval", type=float, default=DEFAULT_INTERVAL, help="the service's, seconds")
    ap.add_argument("--margin", type=int, default=10, help="the blind chain's: walltime - steps' budget")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="chainrun-compute-"))
    env = environment(root)
    load_before = os.getloadavg()
    works: dict[tuple[str, str], Path] = {}
    submitted: dict[tuple[str, str], float] = {}
    with service(env, args.interval):
        time.sleep(3)  # the service started, as a user's runs before they submit
        for kind in args.schedulers:
            work = chainrun_chain(root, kind, args)
            works[(kind, "chainrun")] = work
            submitted[(kind, "chainrun")] = time.time()
            submit(env, work / "job.toml")
            work, scripts = blind_chain(root, kind, args)
            works[(kind, "blind")] = work
            submitted[(kind, "blind")] = time.time()
            blind_ids = submit_blind(kind, work, scripts)
            print(f"{kind}: blind chain {' '.join(blind_ids)}", file=sys.stderr)
        chains = until_ended(env)
    bad = [c for c in chains if c["state"] != "completed"]
    if bad:
        sys.exit(f"chains that did not complete: {bad}; see {root}")
    while not all(blind_done(w) for (k, name), w in works.items() if name == "blind"):
        time.sleep(5)
    load_after = os.getloadavg()
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for (kind, name), work in works.items():
        chainrun = name == "chainrun"
        results.setdefault(kind, {})[name] = breakdown(work, submitted[(kind, name)], args, chainrun)
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(
        f"Machine: {os.cpu_count()} cores, Python {sys.version.split()[0]}, commit {commit}; load average "
        f"(1, 5 min) {load_before[0]:.1f} {load_before[1]:.1f} before and {load_after[0]:.1f} "
        f"{load_after[1]:.1f} after; {args.compute} s of {args.step:g} s steps, walltime "
        f"{args.walltime} s, the service ticking every {args.interval:g} s, the blind chain's steps "
        f"stop {args.margin} s before it; "
        f"{' and '.join(args.schedulers)} side by side, each scheduler's two chains side by side."
    )
    for kind, by_name in results.items():
        table(kind, by_name)
    print()
    for kind in args.schedulers:  # chainrun's own account: its events, in whole seconds the markers'
        history = json.loads(cli(env, "history", "--json", f"compute-{kind}").stdout)
        stored = next(e["at"] for e in history["events"] if e["kind"] == "submitted")
        queued = next(e["at"] for e in history["events"] if e["kind"] == "job" and e["segment"] == 1)
        first = results[kind]["chainrun"]["rows"][0]["script"]
        gaps = [s["gap_seconds"] for s in history["segments"] if s.get("gap_seconds") is not None]
        print(
            f"{kind}, chainrun's queue before the first: `chainrun submit` until the chain was stored "
            f"{stored - submitted[(kind, 'chainrun')]:.2f} s, the service until segment 1 was submitted "
            f"{queued - stored:.2f} s, the scheduler until its script started {first - queued:.2f} s; "
            f"`chainrun history`: gaps {seconds(gaps)}, totals {json.dumps(history['totals'])}"
        )
    print(f"\n(work directories and the chains' home under {root})", file=sys.stderr)


if __name__ == "__main__":
    main()
