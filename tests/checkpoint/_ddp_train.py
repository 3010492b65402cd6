"""A small 2-process DDP training run (gloo, CPU) with chainrun's Checkpointer.

Each rank finds its place in the group from torchrun's variables (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or from srun's (SLURM_PROCID,
SLURM_NTASKS; MASTER_PORT from the environment). Each rank draws its own
dropout and input noise (seeded by rank), so a resume must give every rank its
own RNG states back. ``--signal-at E:S:R`` makes rank R alone send the walltime
signal to itself after batch S of epoch E; ``--die-in-save N:R`` makes rank R
kill itself (SIGKILL) in its Nth save, after it handed its states to rank 0 and
before the commit. ``--pids DIR`` has each rank write its pid to DIR/rank-R.pid.
On the stop it saves, prints ``stopped at epoch E step S`` and exits 0; at the
end rank 0 writes the model and optimizer states to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import time
from typing import Any

from chainrun.checkpoint import SegmentClock

# Made before torch is imported, as examples/quickstart does: on a busy machine that
# import can outlast the time before the walltime signal, which then only asks the loop
# to stop (after its first step, so the segment still makes progress) instead of
# killing the process unsaved.
CLOCK = SegmentClock()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

from chainrun.checkpoint.torch import Checkpointer  # noqa: E402


def _die_in_save(nth: int) -> None:
    """Wrap all_gather_object, which save() calls once per save: the Nth call hands this
    rank's states over and then kills the process, as a node failure mid-save would."""
    real = dist.all_gather_object
    calls = 0

    def gather(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        result = real(*args, **kwargs)
        calls += 1
        if calls == nth:
            print("dying in save", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    dist.all_gather_object = gather


def leave() -> None:
    """Tear the process group down once every rank is past its last collective: a rank whose
    peer had already exited aborted once in gloo's teardown here ("terminate called without an
    active exception", SIGABRT), after its checkpoint was saved."""
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--signal-at", default="")
    parser.add_argument("--die-in-save", default="")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--pids", default="")
    args = parser.parse_args()

    torch.set_num_threads(1)
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:  # started by srun
        os.environ.update(
            RANK=os.environ["SLURM_PROCID"],
            WORLD_SIZE=os.environ["SLURM_NTASKS"],
            MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        )
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    if args.pids:
        os.makedirs(args.pids, exist_ok=True)
        with open(os.path.join(args.pids, f"rank-{rank}.pid"), "w") as f:
            f.write(f"{os.getpid()}\n")
    if args.die_in_save:
        nth, who = (int(v) for v in args.die_in_save.split(":"))
        if who == rank:
            _die_in_save(nth)

    torch.manual_seed(0)  # the same initial weights everywhere (DDP also broadcasts rank 0's)
    data = torch.Generator().manual_seed(42)
    x = torch.randn(64, 8, generator=data)
    y = (x @ torch.randn(8, 1, generator=data)).tanh()
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, shuffle=True, seed=7)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler)
    model = DistributedDataParallel(
        torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
        )
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(100 + rank)  # each rank's own dropout and noise
    ckpt = Checkpointer(args.dir, model=model, optimizer=optimizer, clock=CLOCK)
    start = ckpt.restore()
    print(f"rank {rank}: {start.describe()}", flush=True)
    signal_at = tuple(int(v) for v in args.signal_at.split(":")) if args.signal_at else None
    stop_signal = signal.Signals["SIG" + os.environ.get("CHAINRUN_SIGNAL", "USR1")]
    print(f"rank {rank}: training", flush=True)

    for epoch in range(start.epoch, args.epochs):
        for step, (xb, yb) in ckpt.steps(loader, epoch):
            xb = xb + 0.01 * torch.randn_like(xb)
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            time.sleep(args.step_sleep)
            if signal_at is not None and signal_at == (epoch, step, rank):
                os.kill(os.getpid(), stop_signal)
            if ckpt.should_stop():
                ckpt.save(epoch, step + 1)
                print(f"rank {rank}: stopped at epoch {epoch} step {step + 1}", flush=True)
                leave()
                return 0
        ckpt.save(epoch + 1, 0, done=epoch + 1 == args.epochs)

    if rank == 0:
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}, args.out)
    leave()
    print(f"rank {rank}: finished", flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    # Out without the interpreter's teardown: gloo's worker threads may still hold work whose
    # tensors Python frees then, after the interpreter stopped taking the GIL, and torch aborts
    # ("terminate called without an active exception", SIGABRT) after the rank has finished
    # and saved (twice in some thousand runs here, each after "finished"). The checkpoint is on
    # disk and fsynced by then; that abort is torch's, not what these tests measure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
