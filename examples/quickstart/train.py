"""chainrun quickstart: a small PyTorch model that survives walltime kills and resumes exactly.

A 2-layer MLP learns a synthetic classification task (the data comes from a
fixed seed, so every segment sees the same dataset). Each epoch takes one to
three seconds on a laptop CPU; ``--epoch-seconds`` makes it take at least that
long, as a larger model's would (chain.toml asks for 4, so the demo spans
several segments on any machine). It runs on its own, as any training script
does (here 3 epochs, saved to ``checkpoints/``)::

    $ python3 train.py --epochs 3

Under chainrun (``chainrun run chain.toml``, see chain.toml), chainrun sends
SIGUSR1 ten seconds before each segment's walltime; the script saves where it
is, even in the middle of an epoch, and exits 0; the next segment resumes from
there. Remove ``checkpoints/`` after a run on its own: chainrun takes the
checkpoint it finds as the run's, and that one is already done.
"""

from __future__ import annotations

import argparse
import sys
import time

from chainrun.checkpoint import SegmentClock


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--samples", type=int, default=131072, help="dataset size (sets the epoch length)")
    parser.add_argument("--epoch-seconds", type=float, default=0.0, help="the least time an epoch takes")
    args = parser.parse_args()

    # chainrun line 1: when to stop (the walltime signal or the deadline). Made
    # before torch is imported: on a busy machine that import can outlast the
    # grace period, and a signal that comes meanwhile then asks the loop to stop
    # (it saves after its first step) instead of killing the process unsaved.
    clock = SegmentClock()
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from chainrun.checkpoint.torch import Checkpointer, ResumableSampler

    # No torch.manual_seed here: importing the helper seeded torch, NumPy and random from
    # the chain's own CHAINRUN_SEED (a constant would make a sweep's repetitions copies).
    data = torch.Generator().manual_seed(1234)
    x = torch.randn(args.samples, 64, generator=data)
    y = (x @ torch.randn(64, 10, generator=data)).argmax(dim=1)
    dataset = TensorDataset(x, y)
    loader = DataLoader(dataset, batch_size=128, sampler=ResumableSampler(dataset))

    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(loader))

    # chainrun line 2: what to save (everything needed to continue exactly).
    ckpt = Checkpointer(model=model, optimizer=optimizer, scheduler=scheduler, clock=clock)
    start = ckpt.restore()
    print(
        start.describe() if not start.fresh else f"starting fresh, checkpoints in {ckpt.directory}",
        flush=True,
    )
    if start.done or start.epoch >= args.epochs:
        print("training already done", flush=True)
        return 0

    step_seconds = args.epoch_seconds * loader.batch_size / args.samples  # loader.batch_size: 128
    for epoch in range(start.epoch, args.epochs):
        began = time.monotonic()
        total, count = 0.0, 0
        for step, (xb, yb) in ckpt.steps(loader, epoch):
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            total, count = total + loss.item(), count + 1
            # Paced (--epoch-seconds): each step ends no sooner than its share of an epoch.
            time.sleep(max(0.0, began + count * step_seconds - time.monotonic()))
            if ckpt.should_stop():
                ckpt.save(epoch, step + 1, metrics={"loss": loss.item()})
                # Epochs count those completed, as chainrun's progress does: "epoch 3 step 593"
                # is 593 steps into the fourth.
                print(
                    f"{clock.reason}: saved at epoch {epoch} step {step + 1}, exiting to resume later",
                    flush=True,
                )
                return 0  # exit 0 after a signal-triggered save: chainrun resubmits
        done = epoch + 1 == args.epochs
        ckpt.save(epoch + 1, 0, done=done, metrics={"loss": total / max(count, 1)})
        print(
            f"epoch {epoch + 1}/{args.epochs}  loss {total / max(count, 1):.4f}  "
            f"lr {scheduler.get_last_lr()[0]:.4f}  {time.monotonic() - began:.2f}s",
            flush=True,
        )
    print("training done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
