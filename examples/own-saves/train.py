"""A training script that saves its own checkpoints, without chainrun's helper.

chainrun still keeps it going: with no progress sidecar in the checkpoint
directory, the service takes the newest checkpoint file's modification time
as progress. What such a script must do (and this one shows):

* save atomically: write a temp file in the same directory, flush and fsync
  it, then ``os.replace`` it over the checkpoint (a name starting with ``.``
  or ending in ``.tmp`` is ignored by chainrun's watch);
* on the walltime signal (``CHAINRUN_SIGNAL``, SIGUSR1 by default) and on
  SIGTERM, finish the current step, save, and exit 0; handle them from the
  start, before slow imports (a signal that comes first kills the script);
* exit 0 at the end of training too: without ``target_epoch`` in the job file,
  an exit 0 before the walltime is how chainrun knows the run is complete.

It saves once per epoch, so an epoch must be shorter than the job file's
``grace``. The model and data are small and synthetic; swap in your own.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any, Optional

stop_requested: Optional[str] = None


def request_stop(signum: int, frame: Any) -> None:
    global stop_requested
    stop_requested = signal.Signals(signum).name


# Before torch is imported: on a busy machine that import can outlast the grace
# period, and a walltime signal that comes meanwhile must only ask for a stop.
STOP_SIGNALS = {signal.Signals["SIG" + (os.environ.get("CHAINRUN_SIGNAL") or "USR1")], signal.SIGTERM}
for stop_signal in STOP_SIGNALS:
    signal.signal(stop_signal, request_stop)

import torch  # noqa: E402


def save(state: dict[str, Any], path: str) -> None:
    temp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".tmp")
    with open(temp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)
    directory = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(directory)  # makes the rename itself durable
    finally:
        os.close(directory)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    args = parser.parse_args()

    directory = os.environ.get("CHAINRUN_CHECKPOINT_DIR") or "checkpoints"
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "model.pt")

    torch.manual_seed(int(os.environ.get("CHAINRUN_SEED", "0")))  # the chain's own seed; 0 outside chainrun
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(32768, 64, generator=g)
    y = (x @ torch.randn(64, 10, generator=g)).argmax(dim=1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    epoch = 0
    if os.path.exists(path):
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        epoch = state["epoch"]
        print(f"resumed from {path} (epoch {epoch})", flush=True)

    while epoch < args.epochs:
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        for batch in order.split(128):  # one epoch, in an order that depends on the epoch only
            loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        epoch += 1
        save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, path)
        print(f"epoch {epoch}/{args.epochs} loss {loss.item():.4f}", flush=True)
        if stop_requested:  # checked between epochs: an epoch must fit in the grace period
            print(f"{stop_requested}: saved at epoch {epoch}, exiting to resume later", flush=True)
            return 0
    print("training done", flush=True)
    for sig in STOP_SIGNALS:
        if sig != signal.SIGTERM:  # a walltime signal landing while Python shuts down would kill it
            signal.signal(sig, signal.SIG_IGN)
    return 0


if __name__ == "__main__":
    sys.exit(main())
