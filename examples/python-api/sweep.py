"""Run a sweep from Python: two learning rates, two runs of each, on this machine.

Run `python3 sweep.py` here: with no chainrun service running, `wait` drives the
chains itself; with one (`chainrun daemon`), it follows them. Each run is a chain
of 10-second segments, each resuming where the one before stopped.
"""

from pathlib import Path

import chainrun

chains = chainrun.submit(
    {
        "name": "lr-demo",
        "command": "python3 train.py --lr {lr} --epochs 12",
        "workdir": str(Path(__file__).resolve().parent),
        "total_time": "10m",
        "walltime": "10s",
        "grace": "3s",
        "target_epoch": 12,
    },
    params={"lr": [0.1, 0.3]},
    reps=2,
)
for chain in chains:
    state = chain.wait(timeout=600)
    segments = chain.status()["segments_run"]
    print(
        f"{chain.name} lr={chain.params['lr']}: {state} at epoch {chain.progress.epoch}, {segments} segments"
    )
