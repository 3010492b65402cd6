"""A typical PyTorch training loop made resumable with chainrun, with what real runs use.

AdamW with warmup and cosine decay, mixed precision with a GradScaler on GPU,
a DataLoader with worker processes, a validation pass, the best score kept as
an extra, a background (async) save every ``--save-every`` steps so a node
failure loses little work, and the walltime signal handled mid-epoch. With
``--tensorboard DIR`` it logs the loss of every step to TensorBoard, one run for
the whole chain (``DIR/$CHAINRUN_RUN_ID``), each step once even after a crash
(``purge_step``). The data is synthetic; swap in your dataset and model. Runs on
CPU or one GPU.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

from chainrun.checkpoint.torch import Checkpointer, ResumableSampler


def make_data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 16, 16, generator=g)
    y = (x.mean(dim=(1, 2, 3)) > 0).long() + (x[:, 0].std(dim=(1, 2)) > 1).long()
    return TensorDataset(x, y)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--save-every", type=int, default=200, help="steps between background saves")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--tensorboard", metavar="DIR", help="log each step's loss to TensorBoard here")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # Seeded by the helper from the chain's own CHAINRUN_SEED (a constant seed here would make
    # a sweep's repetitions copies); the data are the same in every run.
    train_set, val_set = make_data(20000, seed=1), make_data(2000, seed=2)
    sampler = ResumableSampler(train_set)  # the chain's seed: the same order per epoch in every segment
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers)
    val_loader = DataLoader(val_set, batch_size=256)

    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(4),
        torch.nn.Flatten(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(32 * 16, 3),
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    total_steps, warmup = args.epochs * len(loader), len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (
            min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps))
        ),
    )
    scaler = torch.amp.GradScaler(device.type, enabled=device.type == "cuda")

    ckpt = Checkpointer(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, async_save=True)
    start = ckpt.restore()
    print(start.describe(), flush=True)
    best = float(start.extras.get("best_accuracy", 0.0))
    if start.done:
        print(f"already done; best validation accuracy {best:.3f}")
        return 0

    writer = None
    if args.tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        # One run for the whole chain, and a resume after a crash voids what the crashed
        # segment logged past its last save: each step is on the curve once.
        run_dir = os.path.join(args.tensorboard, os.environ.get("CHAINRUN_RUN_ID", "run"))
        writer = SummaryWriter(run_dir, purge_step=start.global_step(len(loader)))

    loss = torch.zeros((), device=device)  # a resume at the end of an epoch runs no step in it
    for epoch in range(start.epoch, args.epochs):
        model.train()
        for step, (xb, yb) in ckpt.steps(loader, epoch):
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.float16, enabled=device.type == "cuda"):
                loss = torch.nn.functional.cross_entropy(model(xb), yb)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if writer is not None:
                writer.add_scalar("loss", loss.item(), epoch * len(loader) + step)
            if ckpt.should_stop():  # the walltime signal: finishes any background save first
                ckpt.save(epoch, step + 1, extras={"best_accuracy": best})
                print(f"stopping at epoch {epoch} step {step + 1} ({ckpt.clock.reason})", flush=True)
                if writer is not None:
                    writer.close()
                return 0
            if (step + 1) % args.save_every == 0:
                ckpt.save(epoch, step + 1, extras={"best_accuracy": best})  # async: training goes on

        accuracy = evaluate(model, val_loader, device)
        best = max(best, accuracy)
        done = epoch + 1 == args.epochs
        ckpt.save(epoch + 1, 0, done=done, metrics={"val_accuracy": accuracy}, extras={"best_accuracy": best})
        print(
            f"epoch {epoch + 1}/{args.epochs} loss {loss.item():.4f} val_accuracy {accuracy:.3f}", flush=True
        )

    ckpt.wait()
    if writer is not None:
        writer.close()
    print(f"training done; best validation accuracy {best:.3f}")
    return 0


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, loader: DataLoader[tuple[torch.Tensor, ...]], device: torch.device
) -> float:
    # Evaluation draws no random numbers, so it does not disturb an exact resume.
    model.eval()
    correct = total = 0
    for xb, yb in loader:
        correct += int((model(xb.to(device)).argmax(dim=1) == yb.to(device)).sum())
        total += len(yb)
    model.train()
    return correct / total


if __name__ == "__main__":
    sys.exit(main())
