"""Benchmark the service's tick against fake Slurm tools, from 10 to 10,000 chains.

Fake ``sbatch``, ``squeue``, ``sacct`` and ``scancel`` (small bash scripts put
first on PATH) log every call and answer as Slurm does; the engine runs them
through the real local transport and the real Slurm backend, so a tick here
takes the path a tick on a cluster takes. The chains are created directly
through ``Store`` methods (submitting 10,000 chains one ``sbatch`` at a time
would take longer than the rest of the benchmark): each has segment 1 running
(its start marker written as the wrapper writes it), started an hour before the
first tick, and segment 2 queued behind it, which is a service's steady state.
Its script saved a checkpoint a minute ago, without a progress sidecar (a script
that saves its own checkpoints, the common case); at 1,000 chains also with one,
as the helper writes it.

Each case creates its chains in one interpreter and ticks them in a fresh one
(so its RSS is the service's own, as a service's is: the chains were
submitted by other processes), with the real ``Engine`` and a clock that
moves 10 s per tick. Measured per case: scheduler commands per tick, file-system
calls per tick (those the engine makes through its transport: each is a round trip
to the file server on a cluster's NFS home), CPU per tick (``time.process_time``,
the service's own process: the fake tools' CPU is theirs), and RSS after the ticks
and at its peak; at 1,000 chains also
with 100 running jobs gone from ``squeue`` without an end marker (accounting
does not know them yet), and with 10,000 ended chains in the same database;
then ``chainrun status`` and ``chainrun --help`` in a subprocess (``--status-only``:
those two alone), with the bytecode cached as an installed chainrun has it. Usage:
``python benchmarks/service.py [--sizes 10 100 1000 10000] [--ticks 5] [--status-only] [--out FILE]``.
Run it with the checkout to measure first on ``PYTHONPATH``: it prints the chainrun it imported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

TICK = 10.0  # simulated seconds between ticks
VANISHED = 100
ENDED = 10_000
WALLTIME = 4 * 3600
RAN = 3600  # segment 1 started this long before the first tick: past its first minute

FAKE = {
    "squeue": 'cat "$FAKE_SLURM/squeue.txt"',
    # Accounting has not caught up with the vanished jobs yet: it knows none of them.
    "sacct": "true",
    "sbatch": (
        'id=$(( $(cat "$FAKE_SLURM/next") + 0 )); echo $(( id + 1 )) > "$FAKE_SLURM/next"\n'
        # Listed under the name the script gives it (its tag), as squeue lists it.
        'name=$(sed -n "s/^#SBATCH --job-name=//p" "${@: -1}" | head -n 1)\n'
        'printf "%s|%s|PENDING|Priority|N/A|N/A|\\n" "$id" "$name" >> "$FAKE_SLURM/squeue.txt"\n'
        'echo "$id"'
    ),
    "scancel": "true",
}


def _tools(root: Path) -> Path:
    """The fake Slurm commands in ``root/bin``; each logs its argv to ``root/calls.log``."""
    bin_dir = root / "bin"
    bin_dir.mkdir()
    for name, body in FAKE.items():
        path = bin_dir / name
        path.write_text(
            f'#!/bin/bash\nprintf "%s\\n" "{name} $*" >> "$FAKE_SLURM/calls.log"\n{body}\n', encoding="utf-8"
        )
        path.chmod(0o755)
    (root / "calls.log").touch()
    (root / "next").write_text("1000000\n")
    return bin_dir


def _calls(root: Path) -> list[str]:
    return (root / "calls.log").read_text().splitlines()


def _rss_mb() -> tuple[float, float]:
    """This process's resident set now and at its peak, in MB."""
    fields = dict(
        line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line
    )
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


# What a transport does that touches files (``run`` runs commands: counted as the fake tools'
# calls); each is one round trip to the file server where the files are on NFS.
FS_CALLS = frozenset(
    {"read_file", "write_file", "create_file", "listdir", "stat", "makedirs", "remove", "rename"}
)


class CountingTransport:
    """The engine's real transport, counting the file-system calls made through it."""

    def __init__(self, inner: Any, counts: list[int]) -> None:
        self._inner = inner
        self._counts = counts

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in FS_CALLS:
            return attr
        counts = self._counts

        def counted(*args: Any, **kwargs: Any) -> Any:
            counts[0] += 1
            return attr(*args, **kwargs)

        return counted


def create(root: Path, n: int, ended: int, sidecar: bool) -> dict[str, Any]:
    """Create ``n`` active chains (and ``ended`` ended ones), their markers, checkpoints
    (with a progress sidecar if ``sidecar``) and the fake ``squeue`` output, as a submitter
    and running jobs would have left them."""
    os.environ["FAKE_SLURM"] = str(root)
    root.mkdir(parents=True, exist_ok=True)
    _tools(root)
    from chainrun.checkpoint._progress import encode_progress
    from chainrun.model import (
        NO_PROGRESS,
        Adopt,
        ChainState,
        EndSegment,
        Finish,
        JobSpec,
        Outcome,
        Progress,
        SchedulerSpec,
        Submit,
    )
    from chainrun.schedulers.segment import SegmentJob
    from chainrun.store import Store

    store = Store(root / "home")
    start = time.time()
    spec = JobSpec(
        name="bench",
        command="python train.py",
        workdir=str(root / "work"),
        total_time=72 * 3600,
        walltime=WALLTIME,
        target_epoch=200,
        max_failures=3,
        checkpoint_dir="",
        signal="USR1",
        grace=300,
        scheduler=SchedulerSpec(kind="slurm"),
    )
    old = start - 3 * 86400
    for i in range(ended):
        chain = store.add_chain(spec, NO_PROGRESS, old)
        store.journal_submit(chain.id, Submit(1, WALLTIME), old)
        done = Progress(epoch=200)
        store.record(
            chain.id,
            [
                Adopt(1, str(i + 1), "submitted"),
                EndSegment(1, Outcome.TIMEOUT, 0, False, WALLTIME, old, "timeout with progress", done),
                Finish(ChainState.COMPLETED, "target epoch 200 reached"),
            ],
            None,
            [],
            old,
        )
    lines: dict[str, str] = {}
    running: list[str] = []
    for i in range(n):
        ckpt = root / "ckpt" / str(i)
        ckpt.mkdir(parents=True)
        chain_spec = replace(spec, checkpoint_dir=str(ckpt))
        began = start - RAN
        chain = store.add_chain(chain_spec, NO_PROGRESS, began)
        first, second = str(100_000 + 2 * i), str(100_001 + 2 * i)
        store.journal_submit(chain.id, Submit(1, WALLTIME), began)
        store.record(chain.id, [Adopt(1, first, "submitted")], None, [], began)
        store.journal_submit(chain.id, Submit(2, WALLTIME, after=first), began)
        store.record(chain.id, [Adopt(2, second, f"submitted after job {first}")], None, [], began)
        job = SegmentJob(chain.id, 1, chain_spec, WALLTIME)
        Path(job.run_dir).mkdir(parents=True)
        Path(job.stem + ".start").write_text(f"job={first}\nat={began}\n")
        (ckpt / "model.pt").write_bytes(b"weights")
        os.utime(ckpt / "model.pt", (start - 60, start - 60))  # saved a minute ago
        if sidecar:
            written = {"version": 1, "epoch": 3, "step": 300, "file": "model.pt", "size": 7}
            written.update(
                {"sha256": "0" * 64, "saved_at": start, "done": False, "segment": 1, "metrics": {}}
            )
            (ckpt / "chainrun-progress.json").write_bytes(encode_progress(written))
            os.utime(ckpt / "chainrun-progress.json", (start - 60, start - 60))
        lines[first] = f"{first}|cr.{chain.id}.1|RUNNING|None|{int(began)}|{int(began) + WALLTIME}|node1"
        lines[second] = f"{second}|cr.{chain.id}.2|PENDING|Dependency|N/A|N/A|"
        running.append(first)
    (root / "squeue.txt").write_text("".join(line + "\n" for line in lines.values()))
    store.close()
    meta = {"start": start, "lines": lines, "running": running, "created_s": time.time() - start}
    (root / "meta.json").write_text(json.dumps(meta))
    return meta


def one_case(root: Path, ticks: int, vanish: int) -> dict[str, Any]:
    """Tick the service over the chains ``create`` left in ``root``, and measure. A fresh
    process, as a service is: the chains were submitted by other processes."""
    os.environ["FAKE_SLURM"] = str(root)
    os.environ["PATH"] = f"{root / 'bin'}:{os.environ['PATH']}"
    os.environ["CHAINRUN_HOME"] = str(root / "home")
    import chainrun
    from chainrun import logsetup
    from chainrun.engine import Engine
    from chainrun.store import Store
    from chainrun.transport import transport_for

    logsetup.setup("info", stream=sys.stderr, pretty=False)  # as the service logs under journald
    meta = json.loads((root / "meta.json").read_text())
    start, lines, running = meta["start"], meta["lines"], meta["running"]
    store = Store(root / "home")
    now = [start]

    def clock() -> float:
        return now[0]

    fs = [0]
    engine = Engine(store, clock=clock, transports=lambda host: CountingTransport(transport_for(host), fs))

    def tick() -> tuple[float, int]:
        before = len(_calls(root))
        now[0] += TICK
        cpu = time.process_time()
        engine.tick()
        return time.process_time() - cpu, len(_calls(root)) - before

    def steady_ticks(count: int) -> tuple[list[tuple[float, int]], list[int]]:
        ticked, calls = [], []
        for _ in range(count):
            fs[0] = 0
            ticked.append(tick())
            calls.append(fs[0])
        return ticked, calls

    tick()  # the first tick reads every start marker and checkpoint once, and notes the start times
    steady, fs_calls = steady_ticks(ticks)
    result: dict[str, Any] = {
        "n": len(running),
        "code": chainrun.__file__,
        "created_s": meta["created_s"],
        "cpu_ms": 1000 * statistics.median(c for c, _ in steady),
        "commands": max(k for _, k in steady),
        "fs_median": statistics.median(fs_calls),
        "fs_max": max(fs_calls),
        "fs_per_minute": sum(fs_calls) * 60 / (TICK * ticks),
    }
    if vanish:
        # Running jobs leave squeue (MinJobAge passed) without an end marker; sacct does not
        # know them yet. Tick until just before they would be declared lost.
        gone = set(running[:vanish])
        (root / "squeue.txt").write_text("".join(v + "\n" for k, v in lines.items() if k not in gone))
        from chainrun.decide import LOST_AFTER

        before = len(_calls(root))
        seen = [tick() for _ in range(int(LOST_AFTER // TICK) - 1)]
        calls = _calls(root)[before:]
        result.update(
            vanished_ticks=len(seen),
            vanished_max=max(k for _, k in seen),
            vanished_sacct=sum(1 for c in calls if c.startswith("sacct")),
            vanished_cpu_ms=1000 * statistics.median(c for c, _ in seen),
        )
    result["rss_mb"], result["peak_mb"] = _rss_mb()
    store.close()
    return result


def _case(n: int, ticks: int, vanish: int = 0, ended: int = 0, sidecar: bool = False) -> dict[str, Any]:
    """One case in a fresh interpreter, so that its memory is its own."""
    with tempfile.TemporaryDirectory(prefix="chainrun-bench-") as tmp:
        _create(Path(tmp), n, ended, sidecar)
        argv = [sys.executable, __file__, "--one", "--ticks", str(ticks), "--root", tmp]
        out = subprocess.run([*argv, "--vanish", str(vanish)], check=True, capture_output=True, text=True)
        return dict(json.loads(out.stdout.splitlines()[-1]))


def _create(root: Path, n: int, ended: int, sidecar: bool = False) -> None:
    argv = [sys.executable, __file__, "--create", str(n), "--ended", str(ended), "--root", str(root)]
    argv += ["--sidecar"] if sidecar else []
    subprocess.run(argv, check=True, capture_output=True)


def _timed(argv: list[str], env: dict[str, str], repeats: int = 5) -> tuple[float, float]:
    """Median wall and CPU (user + system) seconds of a command, after one untimed run
    (warm caches). On a loaded machine the CPU time is the steadier of the two."""
    subprocess.run(argv, env=env, check=True, capture_output=True)
    walls, cpus = [], []
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        subprocess.run(argv, env=env, check=True, capture_output=True)
        walls.append(time.perf_counter() - t)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return statistics.median(walls), statistics.median(cpus)


def _status_case(active: int, ended: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """``chainrun status`` and ``chainrun --help`` (wall, CPU) with that many chains stored."""
    with tempfile.TemporaryDirectory(prefix="chainrun-bench-") as tmp:
        _create(Path(tmp), active, ended)
        argv = [sys.executable, __file__, "--one", "--ticks", "1", "--root", tmp]
        subprocess.run(argv, check=True, capture_output=True)
        # As an installed chainrun runs: its bytecode cached (written by the untimed first run),
        # not compiled again at every start as under PYTHONDONTWRITEBYTECODE.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["CHAINRUN_HOME"] = str(Path(tmp) / "home")
        chainrun = [sys.executable, "-m", "chainrun"]
        return _timed([*chainrun, "status"], env), _timed([*chainrun, "--help"], env)


def _machine() -> str:
    model = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{os.cpu_count()} cores ({model}), Python {platform.python_version()}, {platform.system()};"
        f" load average at the end {load} (other work shared the machine)"
    )


# Issue 38: at most one file-system call per chain that changed; none does in a steady tick.
FS_GOAL = "<= 1 per chain that changed (none did)"


def _fs(r: dict[str, Any]) -> str:
    """A case's file-system calls per steady tick: the median, the most, and per minute."""
    return f"{r['fs_median']:g} (most {r['fs_max']}; {r['fs_per_minute']:.0f} a minute)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 1000, 10_000])
    parser.add_argument("--ticks", type=int, default=5)
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    parser.add_argument(
        "--status-only", action="store_true", help="only `chainrun status` and `--help` (about a minute)"
    )
    parser.add_argument("--create", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--vanish", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--ended", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--sidecar", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.create is not None:
        create(args.root, args.create, args.ended, args.sidecar)
        return
    if args.one:
        print(json.dumps(one_case(args.root, args.ticks, args.vanish)))
        return

    rows = []
    goal_cpu = {1000: 20.0, 10_000: 100.0}  # issue 38, chains without a sidecar
    for n in [] if args.status_only else args.sizes:
        r = _case(n, args.ticks)
        print(f"{n}: {r}", file=sys.stderr)
        goal = f"<= {goal_cpu[n]:g} ms" if n in goal_cpu else ""
        rss_goal = "< 150 MB" if n == 10_000 else ""
        rows.append(
            (f"{n:,} active chains: commands per tick (steady)", f"{r['commands']}", "<= 2 per cluster")
        )
        rows.append((f"{n:,} active chains: file-system calls per tick (steady)", _fs(r), FS_GOAL))
        rows.append((f"{n:,} active chains: CPU per tick", f"{r['cpu_ms']:.1f} ms", goal))
        rss = f"{r['rss_mb']:.0f} MB (peak {r['peak_mb']:.0f} MB)"
        rows.append((f"{n:,} active chains: RSS after the ticks (peak)", rss, rss_goal))
    if not args.status_only:
        w = _case(1000, args.ticks, sidecar=True)
        print(f"sidecar: {w}", file=sys.stderr)
        rows.append(("1,000 active chains with a sidecar: file-system calls per tick", _fs(w), ""))
        rows.append(("1,000 active chains with a sidecar: CPU per tick", f"{w['cpu_ms']:.1f} ms", "<= 50 ms"))
        v = _case(1000, args.ticks, vanish=VANISHED)
        print(f"vanished: {v}", file=sys.stderr)
        rows.append(
            (
                f"1,000 active, {VANISHED} jobs gone without an end marker: most commands in one tick "
                f"({v['vanished_ticks']} ticks of {TICK:g} s)",
                f"{v['vanished_max']}",
                "<= 2 per cluster",
            )
        )
        rows.append(
            (
                f"same: sacct calls in those {v['vanished_ticks']} ticks (each for all gone jobs due)",
                f"{v['vanished_sacct']}",
                "",
            )
        )
        rows.append(("same: CPU per tick", f"{v['vanished_cpu_ms']:.1f} ms", ""))
        e = _case(1000, args.ticks, ended=ENDED)
        print(f"ended: {e}", file=sys.stderr)
        base = _case(1000, args.ticks)
        rows.append(("1,000 active: CPU per tick", f"{base['cpu_ms']:.1f} ms", ""))
        rows.append(
            (
                f"1,000 active + {ENDED:,} ended: CPU per tick",
                f"{e['cpu_ms']:.1f} ms ({e['cpu_ms'] / base['cpu_ms']:.2f}x)",
                "unchanged (1.0x)",
            )
        )
    (status_wall, status_cpu), (help_wall, help_cpu) = _status_case(1000, ENDED)
    rows.append(
        (
            f"`chainrun status`, 1,000 active + {ENDED:,} ended: wall (CPU)",
            f"{status_wall:.3f} s ({status_cpu:.3f} s)",
            "<= 0.2 s",
        )
    )
    rows.append(("`chainrun --help`: wall (CPU)", f"{help_wall:.3f} s ({help_cpu:.3f} s)", "<= 0.1 s"))
    rows.append(
        (
            "`status` less `--help` (CPU): reading and showing the chains",
            f"{status_cpu - help_cpu:.3f} s",
            "",
        )
    )

    width = max(len(r[0]) for r in rows)
    table = [
        f"Machine: {_machine()}",
        "",
        f"| {'measure':<{width}} | measured | goal |",
        f"|{'-' * (width + 2)}|---|---|",
    ]
    table += [f"| {a:<{width}} | {b} | {c} |" for a, b, c in rows]
    text = "\n".join(table)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
