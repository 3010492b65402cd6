"""The driver of a small Ray Tune experiment that chainrun runs in segments.

segment.sh starts the Ray cluster over the job's nodes and runs this. The first
segment starts the experiment; every later one finds it under ``ray_results``
(a directory every node sees) and resumes it with ``Tuner.restore``: finished
trials stay finished, unfinished ones go on from their last checkpoint, so no
trial starts over. On the walltime signal the experiment is stopped as Ctrl-C
would stop it (Tune saves its state), and this exits 0.

Progress for chainrun: ``progress.json``, ``{"epoch": N}`` where N is the
fewest steps any trial has done (``progress = "progress.json:epoch"``), so the
chain completes once every trial has done ``--steps``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
from ray import tune

EXPERIMENT = "tune-lr"
STORAGE = Path("ray_results").resolve()
PROGRESS = Path("progress.json")


def trainable(config: dict[str, Any]) -> None:
    """A toy training: ``x`` grows by ``lr`` each step; a checkpoint every step."""
    step, x = 0, 0.0
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            state = json.loads((Path(directory) / "state.json").read_text())
        step, x = state["step"], state["x"]
    name = f"trial lr={config['lr']}"
    how = f"resumed at step {step}" if checkpoint else "fresh start"
    print(f"{name}: {how} on {socket.gethostname()}", flush=True)
    while step < config["steps"]:
        time.sleep(config["step_seconds"])
        step, x = step + 1, x + config["lr"]
        with tempfile.TemporaryDirectory() as directory:
            (Path(directory) / "state.json").write_text(json.dumps({"step": step, "x": x}))
            tune.report({"step": step, "x": x}, checkpoint=tune.Checkpoint.from_directory(directory))
        record(Path(config["workdir"]), name, step, config["trials"])


def record(workdir: Path, name: str, step: int, trials: int) -> None:
    """progress.json for chainrun: the fewest steps any trial has done (0 until all started)."""
    steps = workdir / "steps"
    steps.mkdir(exist_ok=True)
    write(steps / name, {"step": step})
    done = [json.loads(p.read_text())["step"] for p in steps.iterdir() if not p.name.startswith(".")]
    write(workdir / PROGRESS, {"epoch": min(done) if len(done) == trials else 0})


def write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--step-seconds", type=float, default=1.0)
    args = parser.parse_args()
    # The walltime signal stops the experiment as Ctrl-C does: Tune saves it, fit() returns.
    stop = signal.Signals["SIG" + os.environ.get("CHAINRUN_SIGNAL", "USR1")]
    signal.signal(stop, lambda *_: signal.raise_signal(signal.SIGINT))
    ray.init(address=args.address)
    lrs = [0.1, 0.2, 0.3, 0.4][: max(2, args.nodes)]
    path = STORAGE / EXPERIMENT
    if tune.Tuner.can_restore(path):
        print(f"resuming the experiment in {path}", flush=True)
        tuner = tune.Tuner.restore(str(path), trainable, resume_unfinished=True, resume_errored=True)
    else:
        tuner = tune.Tuner(
            trainable,
            param_space={
                "lr": tune.grid_search(lrs),
                "trials": len(lrs),
                "workdir": str(Path.cwd()),  # a trial runs in a directory of its own
                "steps": args.steps,
                "step_seconds": args.step_seconds,
            },
            run_config=tune.RunConfig(name=EXPERIMENT, storage_path=str(STORAGE)),
        )
    results = tuner.fit()
    finished = sum(r.metrics.get("step") == args.steps for r in results)
    print(f"experiment stopped: {finished} of {len(results)} trials finished", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
