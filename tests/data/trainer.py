"""A stand-in training script for chain tests: stdlib only, deterministic.

Each "epoch" sleeps --epoch-time seconds; after each epoch it saves a
checkpoint and the progress sidecar atomically (as the contract says). On the
walltime signal it saves and exits 0. --mode crash exits --exit-code (1) at
once; --mode stall runs but never advances its checkpoint; --mode corrupt
leaves a half-written sidecar behind. --ignore-signals ignores the walltime
signal and SIGTERM, so only the scheduler's kill stops it. --exclusive holds
a lock on the checkpoint directory while it runs: a second copy that finds it
held (two jobs of one chain at once) says so in overlaps.log and exits 3.
--lineage commits through chainrun's helper (its commit checks the fence) a
file per epoch that holds the checkpoint's history: each epoch with the segment
and host that trained it, so the final checkpoint shows what it was made of.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import signal
import sys
import time


def atomic(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def lineage(epochs: int, epoch_time: float) -> int:
    """Train, committing through the helper a file per epoch that holds its history."""
    from chainrun.checkpoint import load_progress, write_progress

    ckdir = os.environ["CHAINRUN_CHECKPOINT_DIR"]
    os.makedirs(ckdir, exist_ok=True)
    segment = os.environ.get("CHAINRUN_SEGMENT", "0")
    committed = load_progress(ckdir)
    history: list[list[object]] = []
    if committed is not None:
        with open(os.path.join(ckdir, committed["file"])) as f:
            history = json.load(f)["history"]
    stop: list[int] = []
    signal.signal(
        getattr(signal, "SIG" + os.environ.get("CHAINRUN_SIGNAL", "USR1")), lambda *_: stop.append(1)
    )
    epoch = len(history)
    while epoch < epochs and not stop:
        deadline = time.time() + epoch_time
        while time.time() < deadline and not stop:
            time.sleep(0.05)
        if stop:
            break
        epoch += 1
        history = [*history, [epoch, int(segment), os.uname().nodename]]
        name = f"model-e{epoch:04d}-s{segment}.ckpt"
        atomic(os.path.join(ckdir, name), json.dumps({"history": history}).encode())
        write_progress(ckdir, epoch=epoch, step=0, file=name)  # refused once another segment owns ckdir
        print(f"epoch {epoch} done", flush=True)
    print("stopping" + (" on signal" if stop else ""), flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--epoch-time", type=float, default=1.0)
    p.add_argument("--mode", choices=["ok", "crash", "stall", "corrupt"], default="ok")
    p.add_argument("--exit-code", type=int, default=1)
    p.add_argument("--ignore-signals", action="store_true")
    p.add_argument("--exclusive", action="store_true")
    p.add_argument("--lineage", action="store_true")
    args = p.parse_args()
    if args.lineage:
        return lineage(args.epochs, args.epoch_time)
    ckdir = os.environ.get("CHAINRUN_CHECKPOINT_DIR", "checkpoints")
    os.makedirs(ckdir, exist_ok=True)
    if args.exclusive:
        lock = open(os.path.join(ckdir, ".run.lock"), "a")  # noqa: SIM115 - held until exit
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            with open("overlaps.log", "a") as f:
                f.write(f"segment {os.environ.get('CHAINRUN_SEGMENT')} found another copy running\n")
            return 3
    sidecar = os.path.join(ckdir, "chainrun-progress.json")
    epoch = 0
    if os.path.exists(sidecar):
        try:
            with open(sidecar) as f:
                epoch = json.load(f)["epoch"]
            print(f"resumed from model.ckpt (epoch {epoch})", flush=True)
        except ValueError:
            print("sidecar unreadable; starting from epoch 0", flush=True)
    if args.mode == "crash":
        print("crashing", flush=True)
        return args.exit_code
    stop = []
    sig = os.environ.get("CHAINRUN_SIGNAL", "USR1")
    if args.ignore_signals:
        for name in {sig, "TERM"}:
            signal.signal(getattr(signal, "SIG" + name), signal.SIG_IGN)
    else:
        signal.signal(getattr(signal, "SIG" + sig), lambda *_: stop.append(1))
    while epoch < args.epochs and not stop:
        deadline = time.time() + args.epoch_time
        while time.time() < deadline and not stop:
            time.sleep(0.05)
        if stop:
            break
        if args.mode == "stall":
            continue
        if args.mode == "corrupt":  # a half-written, non-atomic sidecar
            with open(sidecar, "w") as f:
                f.write(f'{{"epoch": {epoch + 1}, "sa')
            continue
        epoch += 1
        data = f"weights after epoch {epoch}\n".encode()
        atomic(os.path.join(ckdir, "model.ckpt"), data)
        atomic(
            sidecar,
            (
                json.dumps(
                    {
                        "version": 1,
                        "epoch": epoch,
                        "step": 0,
                        "file": "model.ckpt",
                        "size": len(data),
                        "sha256": hashlib.sha256(data).hexdigest(),
                        "saved_at": time.time(),
                        "done": False,
                        "segment": int(os.environ.get("CHAINRUN_SEGMENT", "0")) or None,
                        "metrics": {},
                    },
                    sort_keys=True,
                )
                + "\n"
            ).encode(),
        )
        print(f"epoch {epoch} done", flush=True)
    print("stopping" + (" on signal" if stop else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
