"""Benchmark a checkpoint save against a raw write of the same bytes, on the GPU when there is one.

The state is a model of four float32 parameters and its AdamW state (two more
tensors per parameter, as in issue 38), ``--size-mb`` in all, on the GPU when
CUDA is there, else on the CPU. In each repetition, in a shuffled order, and
with ``os.sync()`` (untimed) before each measurement:

* **raw write + fsync**: the serialized checkpoint's bytes, already in host
  memory (pinned on a GPU machine), written in one go and fsynced: the disk's
  own limit and the baseline (1.00);
* **torch.save + fsync** of the same state (durable, not atomic, unverified);
* **helper, synchronous save**: ``Checkpointer.save`` (atomic write with the
  chunked sha256 beside it, fsync of file and directory, the sidecar); the
  companion and retention that follow it are finished untimed;
* **helper, async save, blocking part**: how long ``save()`` holds the loop
  (the copy to host memory), for the first save of a ``Checkpointer`` made
  right before it (its buffers still being allocated in the background), the
  first save once those buffers are ready (a training step or more later, as
  in a real loop), and a later save (steady);
* **copy to host memory**: the state copied into ready host buffers, the floor
  of the blocking part.

Every figure is a median over the repetitions; each ratio is the median of the
ratios to the raw write taken within each repetition. Usage: ``python
benchmarks/save.py [--size-mb 256] [--repeats 5] [--dir DIR] [--device cpu|cuda]``;
it prints the Markdown for ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import ctypes
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

ROWS = (
    ("raw", "raw write + fsync of the same bytes (baseline)"),
    ("torch_save", "`torch.save` + fsync"),
    ("sync", "the helper's synchronous save"),
    ("async_created", "async save, blocking part: first, Checkpointer made just before"),
    ("async_ready", "async save, blocking part: first, buffers allocated ahead"),
    ("async_steady", "async save, blocking part: steady"),
    ("copy", "copy of the state to ready host buffers (the blocking part's floor)"),
)


def make_state(size_mb: int, device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Four parameters and their AdamW state (exp_avg, exp_avg_sq): ``size_mb`` MB in all."""
    numel = max(1, size_mb * 1_000_000 // 4 // 3 // 4)
    model = torch.nn.Module()
    g = torch.Generator().manual_seed(0)
    for i in range(4):
        model.register_parameter(f"p{i}", torch.nn.Parameter(torch.randn(numel, generator=g).to(device)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()  # creates the AdamW state
    return model, optimizer


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str) -> float:
    os.sync()
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def torch_save_fsync(state: object, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def copy_to_host(host: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """What the async save's copy does at best: a DMA per tensor from the GPU, a memcpy on the CPU."""
    for h, src in zip(host, sources):
        if src.is_cuda:
            h.copy_(src, non_blocking=True)
        else:
            ctypes.memmove(h.data_ptr(), src.data_ptr(), src.nbytes)


def free_pinned_cache() -> None:
    """Hand torch's cached pinned blocks back, so each 'first' save allocates anew."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if torch.cuda.is_available() and empty is not None:
        empty()


def bench(size_mb: int, repeats: int, root: Path, device: str) -> dict[str, list[float]]:
    model, optimizer = make_state(size_mb, device)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    raw = buffer.getbuffer()
    if device == "cuda":  # the baseline writes from pinned memory, as the async save does
        pinned = torch.empty(len(raw), dtype=torch.uint8, pin_memory=True)
        pinned.numpy()[:] = memoryview(raw).cast("B")
        raw = memoryview(pinned.numpy()).cast("B")
    clock = SegmentClock(install=False)
    results: dict[str, list[float]] = {key: [] for key, _ in ROWS}

    def helper(name: str, async_save: bool) -> Checkpointer:
        return Checkpointer(
            root / name, model=model, optimizer=optimizer, keep=1, clock=clock, async_save=async_save
        )

    sync = helper("sync", False)

    def sync_save(rep: int) -> None:
        results["sync"].append(timed(lambda: sync.save(rep + 1, 0), device))
        sync.wait()

    def async_saves(rep: int) -> None:
        free_pinned_cache()
        ckpt = helper(f"async-{rep}", True)  # allocates its buffers in the background
        results["async_created"].append(timed(lambda: ckpt.save(rep + 1, 0), device))
        ckpt.wait()
        shutil.rmtree(root / f"async-{rep}")
        free_pinned_cache()
        ckpt = helper(f"async-{rep}", True)
        reserving = getattr(ckpt, "_reserving", None)  # None too in chainrun before it (to compare)
        if reserving is not None:  # what a training step or more gives it in a real loop
            reserving.join()
        for key in ("async_ready", "async_steady"):
            results[key].append(timed(lambda: ckpt.save(rep + 1, 0), device))
            ckpt.wait()
        sources = list(model.state_dict().values()) + [
            t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)
        ]
        host = [torch.empty_like(t, device="cpu", pin_memory=device == "cuda") for t in sources]
        for h, src in zip(host, sources):  # ready: touched once, as a reused buffer is
            h.copy_(src)
        results["copy"].append(timed(lambda: copy_to_host(host, sources), device))
        shutil.rmtree(root / f"async-{rep}")

    steps: list[Callable[[int], None]] = [
        lambda rep: results["raw"].append(timed(lambda: write_fsync(raw, root / "raw.bin"), device)),
        lambda rep: results["torch_save"].append(
            timed(lambda: torch_save_fsync(state, root / "t.pt"), device)
        ),
        sync_save,
        async_saves,
    ]
    order = random.Random(size_mb)
    for rep in range(repeats):
        order.shuffle(steps)
        for run in steps:
            run(rep)
    return results


def describe_machine(root: Path, device: str) -> str:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    disk = subprocess.run(["df", "-hT", str(root)], capture_output=True, text=True).stdout.splitlines()
    gpu = f", GPU {torch.cuda.get_device_name()}" if device == "cuda" else ""
    return (
        f"{os.cpu_count()} cores ({cpu}){gpu}, Python {platform.python_version()}, "
        f"torch {torch.__version__}; disk: `{disk[-1] if disk else '?'}`"
    )


def commit() -> str:
    out = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return out.stdout.strip() or "?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size-mb", type=int, default=256, help="the state's size, parameters and AdamW state"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    args = parser.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="chainrun-save-bench-", dir=args.dir))
    load_before = os.getloadavg()
    try:
        runs = bench(args.size_mb, args.repeats, root, args.device)
        machine = describe_machine(root, args.device)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load_after = os.getloadavg()
    lines = [
        f"State: {args.size_mb} MB on {args.device} (four parameters and their AdamW state); "
        f"commit {commit()}; {machine}; load average {load_before[0]:.1f} before and "
        f"{load_after[0]:.1f} after; medians of {args.repeats} interleaved repetitions; a ratio is the "
        "median of the ratios to the raw write within each repetition.",
        "",
        "| what | seconds | against raw |",
        "|---|---|---|",
    ]
    for key, label in ROWS:
        ratio = statistics.median(a / b for a, b in zip(runs[key], runs["raw"]))
        lines.append(f"| {label} | {statistics.median(runs[key]):.3g} | {ratio:.2f} |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
