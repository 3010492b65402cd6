"""Forks children that save checkpoints in a loop until they are SIGKILLed (for test_ckpt_crash).

Started once per test as ``python _crash_child.py core|torch DIR`` (it imports
everything once, then forks cheaply). For each ``run SEED PLAN`` line on stdin
it forks a child that saves forever, prints ``pid N``, waits for it and prints
``exit STATUS PHASE``: PHASE is the file operation the child was in when it
died (``write``, ``fsync``, ``replace``, ``unlink`` or ``-``), read from a shared
byte the child updates around each call. PLAN ``timed`` leaves the killing to
the test; ``FUNC:N:before|after`` makes the child SIGKILL itself around its
N-th call of os.FUNC, so every step of a save is hit on purpose too.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import random
import signal
import sys
from typing import IO, Any, Callable

from chainrun.checkpoint import CheckpointDir, SegmentClock, load_progress

PHASES = {"write": 1, "fsync": 2, "replace": 3, "unlink": 4}
PHASE_NAMES = {0: "-", 1: "write", 2: "fsync", 3: "replace", 4: "unlink"}
KEEP = 2
TRAILER = 64  # core payload: body, then {epoch, step} padded to this, newline, sha256 of all before


def write_all(chunks: list[bytes]) -> Callable[[IO[bytes]], None]:
    """A writer that hands the chunks over one write call each, as a serializer would."""

    def write(f: IO[bytes]) -> None:
        for chunk in chunks:
            f.write(chunk)

    return write


def core_setup() -> Callable[[str, int], None]:
    # Payload bodies and their hashes are made once, before forking, so that a
    # child spends its life in the save itself rather than in making data.
    bodies = []
    for size in (1_000, 100_000, 2_000_000, 12_000_000):
        body = os.urandom(size)
        bodies.append(([body[i : i + (1 << 20)] for i in range(0, size, 1 << 20)], hashlib.sha256(body)))

    def loop(directory: str, seed: int) -> None:
        store = CheckpointDir(directory, prefix="ckpt", suffix=".bin", keep=KEEP)
        progress = load_progress(directory)
        epoch, step = (progress["epoch"], progress["step"]) if progress else (0, 0)
        rng = random.Random(seed)
        while True:
            epoch, step = (epoch + 1, 0) if step >= 3 else (epoch, step + 1)
            chunks, body_hash = rng.choice(bodies)
            trailer = json.dumps({"epoch": epoch, "step": step}).encode().ljust(TRAILER) + b"\n"
            digest = body_hash.copy()
            digest.update(trailer)
            payload = [*chunks, trailer, digest.digest()]
            store.save(write_all(payload), epoch=epoch, step=step)

    return loop


def torch_setup() -> Callable[[str, int], None]:
    import torch

    from chainrun.checkpoint.torch import Checkpointer

    torch.set_num_threads(1)  # no thread pool before fork
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 256))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 256)).sum().backward()
    optimizer.step()

    def loop(directory: str, seed: int) -> None:
        ckpt = Checkpointer(
            directory, model=model, optimizer=optimizer, keep=KEEP, clock=SegmentClock(install=False)
        )
        progress = load_progress(directory)
        epoch, step = (progress["epoch"], progress["step"]) if progress else (0, 0)
        with torch.no_grad():
            model[0].weight.fill_(float(epoch * 10 + step))
        while True:
            epoch, step = (epoch + 1, 0) if step >= 3 else (epoch, step + 1)
            with torch.no_grad():
                model[0].weight.fill_(float(epoch * 10 + step))  # restore checks this matches the name
            ckpt.save(epoch, step)

    return loop


def instrument(phase: mmap.mmap, plan: str) -> None:
    """Wrap the os calls a save makes: record the phase, and SIGKILL self where the plan says."""
    target, nth, when = plan.split(":") if plan != "timed" else ("", "0", "")
    count = {"n": 0}

    def wrap(name: str) -> None:
        real = getattr(os, name)
        code = PHASES[name]

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            hit = False
            if name == target:
                count["n"] += 1
                hit = count["n"] == int(nth)
            if hit and when == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            phase[0] = code
            result = real(*args, **kwargs)
            phase[0] = 0
            if hit:
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        setattr(os, name, wrapper)

    for name in PHASES:
        wrap(name)


def main() -> None:
    mode, directory = sys.argv[1], sys.argv[2]
    loop = core_setup() if mode == "core" else torch_setup()
    phase = mmap.mmap(-1, 1)  # anonymous and shared: the child writes, we read after it died
    print("ready", flush=True)
    for line in sys.stdin:
        _, seed, plan = line.split()
        phase[0] = 0
        pid = os.fork()
        if pid == 0:
            try:
                instrument(phase, plan)
                loop(directory, int(seed))
            finally:
                os._exit(3)  # a save loop only ends by SIGKILL; anything else is a failure
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exit {status} {PHASE_NAMES.get(phase[0], '?')}", flush=True)


if __name__ == "__main__":
    main()
