"""A small deterministic PyTorch training run with chainrun's Checkpointer (for test_ckpt_torch).

Everything that can break an exact resume is in it: dropout and input noise
(torch RNG), NumPy and Python random numbers in the loss, AdamW state, a
OneCycleLR schedule stepped per batch, a GradScaler whose scale changes, and a
shuffling loader. ``--signal-at E:S`` sends the walltime signal to itself after
batch S of epoch E; the test can also send one from outside. On the signal it
saves, prints ``stopped``, and exits 0; at the end it writes every state to
``--out`` for comparison. ``--no-seed`` leaves the seeding to the helper (``CHAINRUN_SEED``).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time

from chainrun.checkpoint import SegmentClock

# Made before torch is imported, as examples/quickstart does: on a busy machine that
# import can outlast the time before the walltime signal, which then only asks the loop
# to stop (after its first step, so the segment still makes progress) instead of
# killing the process unsaved.
CLOCK = SegmentClock()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from chainrun.checkpoint.torch import Checkpointer, ResumableSampler  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--sampler", choices=["resumable", "shuffle"], default="resumable")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--signal-at", default="")
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument(
        "--no-seed", action="store_true", help="seed nothing: the helper seeds from CHAINRUN_SEED"
    )
    args = parser.parse_args()

    torch.set_num_threads(1)
    if not args.no_seed:
        torch.manual_seed(0)
        np.random.seed(0)
        random.seed(0)
    data = torch.Generator().manual_seed(42)
    x = torch.randn(96, 8, generator=data)
    y = (x @ torch.randn(8, 1, generator=data)).tanh()
    dataset = TensorDataset(x, y)
    if args.sampler == "resumable":
        sampler = ResumableSampler(dataset) if args.no_seed else ResumableSampler(dataset, seed=7)
        loader = DataLoader(dataset, batch_size=8, sampler=sampler, num_workers=args.workers)
    else:
        loader = DataLoader(dataset, batch_size=8, shuffle=True, num_workers=args.workers)

    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=0.05, total_steps=args.epochs * len(loader)
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=5)
    ckpt = Checkpointer(
        args.dir,
        clock=CLOCK,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        async_save=args.async_save,
    )
    start = ckpt.restore()
    print(start.describe(), flush=True)
    signal_at = tuple(int(v) for v in args.signal_at.split(":")) if args.signal_at else None
    stop_signal = signal.Signals["SIG" + os.environ.get("CHAINRUN_SIGNAL", "USR1")]
    print("training", flush=True)

    loss = torch.zeros(())  # a resume at the end of an epoch runs no step in it
    for epoch in range(start.epoch, args.epochs):
        for step, (xb, yb) in ckpt.steps(loader, epoch):
            xb = xb + 0.01 * torch.randn_like(xb)
            weight = 1.0 + 0.1 * float(np.random.rand()) + 0.1 * random.random()
            loss = weight * torch.nn.functional.mse_loss(model(xb), yb)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            time.sleep(args.step_sleep)
            if signal_at == (epoch, step):
                os.kill(os.getpid(), stop_signal)
            if ckpt.should_stop():
                ckpt.save(epoch, step + 1, metrics={"loss": loss})
                print(f"stopped at epoch {epoch} step {step + 1}", flush=True)
                return 0
        ckpt.save(epoch + 1, 0, done=epoch + 1 == args.epochs, metrics={"loss": loss})

    ckpt.wait()
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "rng": torch.get_rng_state(),
        },
        args.out,
    )
    print("finished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
