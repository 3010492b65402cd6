"""Benchmark chainrun's checkpoint saves against plain torch.save and the disk's own limit.

For each state size (default about 100 MB and 1 GB of float32 tensors) and in
the same run, interleaved repetition by repetition (in a shuffled order, so no
measurement always follows the same other one):

* ``torch.save`` to a path, no fsync (what most scripts do; not durable);
* chainrun's synchronous ``Checkpointer.save`` (atomic write with sha256,
  fsync of file and directory, sidecar; the ``.sha256`` companion and
  retention of the previous checkpoint run after it returns, and are finished
  untimed before the next measurement);
* ``torch.save`` + fsync (durable, but not atomic and unverified);
* a raw ``os.write`` + ``fsync`` of the same serialized bytes (the disk's limit),
  and a sha256 of those bytes alone (chainrun's sidecar records one);
* an async ``Checkpointer.save``: how long the training loop is blocked (the
  copy to host memory), first with fresh buffers and then reusing them, and
  when the background write is committed;
* the time ``import chainrun.checkpoint`` takes in a fresh interpreter.

Medians are reported with ratios against baselines measured in the same run,
with the spread of the per-repetition ratio (quartiles) beside them, and the
load average before and after (the machine may be shared). ``os.sync()`` runs
(untimed) between measurements so that one's dirty pages do not slow the next.
Usage: ``python benchmarks/checkpoint.py [--sizes-mb 100 1000] [--repeats 21 7]
[--dir DIR]``; it prints the Markdown for ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import io
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.rawio import write_fsync  # noqa: E402
from chainrun.checkpoint import SegmentClock  # noqa: E402
from chainrun.checkpoint.torch import Checkpointer  # noqa: E402

GOAL_ATOMIC_VS_RAW = 1.15
GOAL_ASYNC_BLOCKING = 0.10
GOAL_IMPORT_MS = 30.0


def make_state(size_mb: int) -> dict[str, torch.Tensor]:
    """About ``size_mb`` MB of float32 weights in 8 tensors, like a small model's state."""
    numel = size_mb * 1_000_000 // 4 // 8
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(numel, generator=g) for i in range(8)}


def timed(fn: Callable[[], object]) -> float:
    os.sync()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_size(size_mb: int, repeats: int, root: Path) -> dict[str, list[float]]:
    state = make_state(size_mb)
    model = torch.nn.Module()
    for name, tensor in state.items():
        model.register_buffer(name.replace(".", "_"), tensor)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    data = buffer.getbuffer()
    keys = ("plain", "plain_fsync", "raw", "sha256", "atomic", "async_first", "async_steady", "async_total")
    results: dict[str, list[float]] = {k: [] for k in keys}
    clock = SegmentClock(install=False)
    plain_path, raw_path = root / "plain.pt", root / "raw.bin"
    sync_ckpt = Checkpointer(root / "sync", model=model, keep=1, clock=clock)

    def chainrun_sync(rep: int) -> None:
        results["atomic"].append(timed(functools.partial(sync_ckpt.save, rep + 1, 0)))
        sync_ckpt.wait()  # the companion and the previous checkpoint's deletion, off the measured path

    def chainrun_async(rep: int) -> None:
        async_ckpt = Checkpointer(root / "async", model=model, keep=1, clock=clock, async_save=True)
        for key in ("async_first", "async_steady"):
            os.sync()
            start = time.perf_counter()
            async_ckpt.save(rep + 1, 0)
            results[key].append(time.perf_counter() - start)
            async_ckpt.wait()
            if key == "async_steady":
                results["async_total"].append(time.perf_counter() - start)
        shutil.rmtree(root / "async")

    steps: list[Callable[[int], None]] = [
        lambda rep: results["plain"].append(timed(lambda: torch.save(model.state_dict(), plain_path))),
        lambda rep: results["plain_fsync"].append(timed(lambda: torch_save_fsync(model, plain_path))),
        lambda rep: results["raw"].append(timed(lambda: write_fsync(data, raw_path))),
        lambda rep: results["sha256"].append(timed(lambda: hashlib.sha256(data).hexdigest())),
        chainrun_sync,
        chainrun_async,
    ]
    order = random.Random(size_mb)
    for rep in range(repeats):
        order.shuffle(steps)
        for step in steps:
            step(rep)
        for path in (plain_path, raw_path):
            path.unlink()
    shutil.rmtree(root / "sync")
    return results


def torch_save_fsync(model: torch.nn.Module, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(model.state_dict(), f)
        f.flush()
        os.fsync(f.fileno())


def import_times(runs: int = 15) -> list[float]:
    code = "import time; t = time.perf_counter(); import chainrun.checkpoint; print(time.perf_counter() - t)"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run(
        [sys.executable, "-c", code], env=env, check=True, capture_output=True
    )  # warm the bytecode cache
    return [
        float(
            subprocess.run(
                [sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True
            ).stdout
        )
        for _ in range(runs)
    ]


def ms(seconds: float) -> str:
    return f"{1000 * seconds:.0f} ms"


def quartiles(values: list[float]) -> tuple[float, float]:
    """The first and third quartile (the middle half of the repetitions lies between)."""
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def describe_disk(path: Path) -> str:
    out = subprocess.run(["df", "-hT", str(path)], capture_output=True, text=True).stdout.splitlines()
    return out[-1] if out else "?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 1000])
    parser.add_argument(
        "--repeats", type=int, nargs="+", default=[21, 7], help="repetitions per size (the last one repeats)"
    )
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="chainrun-bench-", dir=args.dir))
    load_before = os.getloadavg()
    sync_rows, async_rows, counts = [], [], []
    try:
        for index, size in enumerate(args.sizes_mb):
            repeats = args.repeats[min(index, len(args.repeats) - 1)]
            counts.append(f"{repeats} at {size} MB")
            runs = bench_size(size, repeats, root)
            r = {k: statistics.median(v) for k, v in runs.items()}
            # Each ratio is taken within one repetition, so a slow spell of the shared
            # machine moves both of its terms; the table gives their median and quartiles.
            ratios = [a / b for a, b in zip(runs["atomic"], runs["raw"])]
            blockings = [a / b for a, b in zip(runs["async_steady"], runs["atomic"])]
            ratio, blocking = statistics.median(ratios), statistics.median(blockings)
            lo, hi = quartiles(ratios)
            block_lo, block_hi = quartiles(blockings)
            sync_rows.append(
                f"| {size} MB | {ms(r['plain'])} | {ms(r['plain_fsync'])} | {ms(r['raw'])} | "
                f"{ms(r['sha256'])} | {ms(r['atomic'])} | "
                f"**{ratio:.2f}x** {verdict(ratio <= GOAL_ATOMIC_VS_RAW)} ({lo:.2f}-{hi:.2f}) | "
                f"{r['atomic'] / r['plain_fsync']:.2f}x |"
            )
            async_rows.append(
                f"| {size} MB | {ms(r['atomic'])} | {ms(r['async_first'])} | {ms(r['async_steady'])} | "
                f"**{blocking:.1%}** {verdict(blocking < GOAL_ASYNC_BLOCKING)} "
                f"({block_lo:.1%}-{block_hi:.1%}) | "
                f"{ms(r['async_total'])} |"
            )
            print(sync_rows[-1], async_rows[-1], sep="\n", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load_after = os.getloadavg()
    lines = [
        f"Machine: {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}; "
        f"disk: `{describe_disk(root.parent)}`; load average {load_before[0]:.1f} before and "
        f"{load_after[0]:.1f} after. Medians of {', '.join(counts)} interleaved repetitions; a ratio is "
        "the median of the ratios within each repetition, with their middle half (quartiles) in brackets.",
        "",
        "Synchronous saves (chainrun: torch.save into an atomic write with sha256 on the way, fsync of file "
        "and directory, sidecar written the same way; companion and retention after it returns):",
        "",
        "| state | torch.save, no fsync | torch.save + fsync | raw write + fsync (disk limit) | "
        f"sha256 of the bytes alone | chainrun save | chainrun / raw (goal <= {GOAL_ATOMIC_VS_RAW}x) | "
        "chainrun / torch.save + fsync |",
        "|---|---|---|---|---|---|---|---|",
        *sync_rows,
        "",
        "Async saves (the loop blocks while the state is copied to host memory; first save allocates the "
        "buffers, later ones reuse them):",
        "",
        "| state | chainrun sync save | async blocking, first | async blocking, reused buffers | "
        f"blocking / sync save (goal < {GOAL_ASYNC_BLOCKING:.0%}) | async save until committed |",
        "|---|---|---|---|---|---|",
        *async_rows,
    ]
    imports = import_times()
    median_ms = 1000 * statistics.median(imports)
    lines += [
        "",
        f"`import chainrun.checkpoint` in a fresh interpreter: median {median_ms:.1f} ms, max "
        f"{1000 * max(imports):.1f} ms over {len(imports)} runs (goal < {GOAL_IMPORT_MS:.0f} ms: "
        f"{verdict(median_ms < GOAL_IMPORT_MS)}).",
    ]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
