"""How long the web page (`chainrun ui`) takes to answer with 2,000 chains stored.

A state directory is filled through the store as the service fills it: 1,000 chains of
their own and 5 sweeps of 200, each chain with 6 segments (5 ended: timeouts with their
signal time, one crash; 1 running) and a progress record per epoch (30 each, with a loss
and an accuracy), one chain with 60 segments and 600 progress records. The real server
(``chainrun.ui``) then answers over real HTTP on 127.0.0.1, one request at a time, each
page asked for ``--repeats`` times; the table gives the median and the slowest, against
the goal of under a second. Usage: ``python benchmarks/ui.py [--chains 2000] [--repeats 7]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chainrun.model import (
    Adopt,
    ChainState,
    EndSegment,
    Finish,
    JobSpec,
    Outcome,
    Phase,
    Progress,
    SchedulerSpec,
    Submit,
    Track,
)
from chainrun.store import Store
from chainrun.ui import open_server, url_of

WALLTIME = 4 * 3600
SPEC = JobSpec(
    name="bench",
    command="python train.py",
    workdir="/scratch/bench",
    total_time=72 * 3600,
    walltime=WALLTIME,
    target_epoch=200,
    max_failures=3,
    checkpoint_dir="/scratch/bench/ckpt",
    signal="USR1",
    grace=300,
    scheduler=SchedulerSpec(kind="slurm", options=("--gres=gpu:2",)),
)


def fill(store: Store, segments: int, epochs: int, spec: JobSpec, start: float) -> str:
    """One chain as the service records it: ``segments`` - 1 ended, the last running."""
    chain = store.add_chain(spec, Progress(), start)
    t = start
    epoch = 0
    per = max(1, epochs // segments)
    for n in range(1, segments + 1):
        job = str(abs(hash((chain.id, n))) % 10_000_000)
        store.journal_submit(chain.id, Submit(n, WALLTIME), t)
        store.record(chain.id, [Adopt(n, job, "submitted")], None, [], t)
        started = t + 60
        store.record(chain.id, [Track(n, Phase.RUNNING, "", started, None)], None, [], started)
        for _ in range(per):
            epoch += 1
            metrics = (("acc", 1 - 1 / (epoch + 1)), ("loss", 1 / (epoch + 1)))
            saved = Progress(epoch=epoch, saved_at=started + epoch * 60, metrics=metrics)
            store.record(chain.id, [], saved, [], started + epoch * 60)
        if n == segments:
            break
        crash = n == 2
        end = started + (600 if crash else WALLTIME)
        ending = EndSegment(
            n,
            Outcome.FAILED if crash else Outcome.TIMEOUT,
            1 if crash else 0,
            crash,
            end - started,
            end,
            "failed (exit 1)" if crash else "timeout with progress",
            Progress(epoch=epoch),
            ("Traceback (most recent call last):", "RuntimeError: CUDA error") if crash else (),
            None if crash else end - 240,
        )
        store.record(chain.id, [ending], None, [], end)
        t = end + 30
    return chain.id


def build(home: Path, chains: int) -> tuple[str, str]:
    """The state directory; a chain of its own with a long history, and a sweep's name."""
    store = Store(home)
    start = time.time() - 30 * 86400
    long_one = fill(store, 60, 600, SPEC, start)
    sweeps, size = 5, chains // 10
    for s in range(sweeps):
        for i in range(size):
            spec = replace(
                SPEC, name=f"sweep{s}-{i:04d}", sweep_name=f"sweep{s}", params=(("lr", str(10**-i)),)
            )
            fill(store, 6, 30, spec, start)
    for i in range(chains - 1 - sweeps * size):
        fill(store, 6, 30, replace(SPEC, name=f"run-{i:05d}"), start)
    ended = store.chains()[: chains // 4]
    for chain in ended:  # a quarter of them over, as after a month
        store.record(chain.id, [Finish(ChainState.COMPLETED, "target epoch 200 reached")], None, [], start)
    store.close()
    return long_one, "sweep0"


def timed(url: str, cookie: str, repeats: int) -> tuple[float, float, int]:
    times = []
    size = 0
    for _ in range(repeats):
        t = time.perf_counter()
        with urllib.request.urlopen(
            urllib.request.Request(url, headers={"Cookie": cookie}), timeout=60
        ) as answer:
            size = len(answer.read())
        times.append(time.perf_counter() - t)
    return statistics.median(times), max(times), size


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chains", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        home = Path(root) / "home"
        t = time.perf_counter()
        long_one, sweep = build(home, args.chains)
        print(f"filled {args.chains} chains in {time.perf_counter() - t:.0f} s", file=sys.stderr)
        server, _ = open_server(home)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        base = url_of(server).split("/?token=")[0]
        cookie = f"{server.cookie}={server.token}"  # as a browser sends it after the first visit
        pages = [
            ("overview (every chain)", "/"),
            ("overview, the part a live page fetches again", "/?fragment=1"),
            ("every chain as JSON", "/api/chains"),
            ("a chain of 60 segments, 600 progress records", f"/chain/{long_one}"),
            (f"a sweep of {args.chains // 10} chains", f"/sweep/{sweep}"),
        ]
        load = os.getloadavg()[0]
        cpus = os.cpu_count()
        print(f"{args.chains} chains; load average {load:.1f} on {cpus} CPUs; {args.repeats} requests each\n")
        print("| page | median | slowest | size | under 1 s |")
        print("|---|---|---|---|---|")
        for label, path in pages:
            median, slowest, size = timed(base + path, cookie, args.repeats)
            ok = "yes" if slowest < 1 else "no"
            print(
                f"| {label} | {median * 1000:.0f} ms | {slowest * 1000:.0f} ms | {size // 1024} KiB | {ok} |"
            )
        server.shutdown()


if __name__ == "__main__":
    main()
