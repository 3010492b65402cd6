"""A stand-in training script (standard library only): fits w to 3 by gradient descent.

Each epoch takes --epoch-time seconds and then saves its state and chainrun's
progress sidecar, atomically. On the walltime signal it stops, having saved,
and exits 0; the next segment resumes from the saved epoch. Swap in your own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from chainrun.checkpoint import SegmentClock, atomic_write, write_progress


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--epoch-time", type=float, default=1.0)
    args = parser.parse_args()

    clock = SegmentClock()  # says when to save and exit: the walltime signal or the deadline
    directory = os.environ.get("CHAINRUN_CHECKPOINT_DIR") or "checkpoints"
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "state.json")
    state = {"epoch": 0, "w": 0.0}
    if os.path.exists(path):
        with open(path) as f:
            state = json.load(f)
        print(f"resumed at epoch {state['epoch']}", flush=True)

    while state["epoch"] < args.epochs:
        if clock.should_stop():
            print(f"{clock.reason}: stopping at epoch {state['epoch']}, to resume later", flush=True)
            return 0
        time.sleep(args.epoch_time)  # the real work would go here
        state["w"] -= args.lr * 2 * (state["w"] - 3.0)
        state["epoch"] += 1
        loss = (state["w"] - 3.0) ** 2
        atomic_write(path, json.dumps(state).encode())
        write_progress(
            directory,
            epoch=int(state["epoch"]),
            step=0,
            file="state.json",
            done=state["epoch"] >= args.epochs,
            metrics={"loss": loss},
        )
        print(f"lr {args.lr}: epoch {state['epoch']}/{args.epochs}  loss {loss:.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
