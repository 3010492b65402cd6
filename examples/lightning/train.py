"""A small PyTorch Lightning run that chainrun can stop and resume exactly.

The three lines that make a Lightning script chainable are marked ``# chainrun``. The
loader shuffles with a ``ResumableSampler`` so that a segment stopped mid-epoch resumes on
the very next batch of the same order. To try it without chainrun:

    $ python3 train.py --epochs 2

``--stop-after N`` asks the callback to stop after N batches (as the walltime signal
would), ``--out`` writes the final weights, ``--step-sleep`` slows each step down,
``--devices 2`` trains with DDP on two CPU processes. ``--mlflow EXPERIMENT`` logs every step
with Lightning's own ``MLFlowLogger``, ``--wandb PROJECT`` with its ``WandbLogger``: in a chain
with ``[tracking] mlflow = true`` (``wandb = true``) every segment logs into the chain's one run.
"""

from __future__ import annotations

import argparse
import time

import lightning as L
import torch
from lightning.pytorch.loggers import Logger, MLFlowLogger, WandbLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from chainrun.checkpoint.lightning import ChainrunCallback  # chainrun
from chainrun.checkpoint.torch import ResumableSampler


class Regressor(L.LightningModule):
    def __init__(self, step_sleep: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
        self.step_sleep = step_sleep

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        time.sleep(self.step_sleep)
        return loss

    def configure_optimizers(self) -> dict[str, object]:
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", default="")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--stop-after", type=int, default=0)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--mlflow", default="", metavar="EXPERIMENT")
    parser.add_argument("--wandb", default="", metavar="PROJECT")
    args = parser.parse_args()

    cb = ChainrunCallback()  # chainrun: first, so the walltime signal finds its handler
    L.seed_everything(0, verbose=False)
    data = torch.Generator().manual_seed(42)
    x = torch.randn(96, 8, generator=data)
    y = torch.tanh(x @ torch.randn(8, 1, generator=data))
    train_set = TensorDataset(x, y)
    loader = DataLoader(train_set, batch_size=8, sampler=ResumableSampler(train_set, seed=7))

    model = Regressor(args.step_sleep)
    if args.stop_after:
        StopAfter(cb, args.stop_after)
    trainer = L.Trainer(
        callbacks=[cb],  # chainrun
        max_epochs=args.epochs,
        deterministic=True,
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        use_distributed_sampler=False,  # keep the ResumableSampler (each rank sees every batch here)
        logger=loggers(args),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader, ckpt_path=cb.ckpt_path)  # chainrun: ckpt_path
    if not trainer.is_global_zero:  # rank 0 commits and writes
        return
    if cb.last_saved is None or not cb.last_saved.done:
        print(f"stopped ({cb.clock.reason})", flush=True)
    elif args.out:
        torch.save({"model": model.state_dict(), "optimizer": trainer.optimizers[0].state_dict()}, args.out)


def loggers(args: argparse.Namespace) -> list[Logger]:
    """The trackers asked for; none by default."""
    chosen: list[Logger] = []
    if args.mlflow:
        chosen.append(MLFlowLogger(experiment_name=args.mlflow))  # chainrun: no run_id needed
    if args.wandb:
        chosen.append(WandbLogger(project=args.wandb))  # chainrun: no id needed
    return chosen


class StopAfter:
    """Asks the callback's clock to stop after ``n`` more training batches (a stand-in signal)."""

    def __init__(self, cb: ChainrunCallback, n: int) -> None:
        self.cb, self.left = cb, n
        original = cb.on_train_batch_end

        def counted(*args: object, **kwargs: object) -> None:
            self.left -= 1
            if self.left == 0:
                cb.clock.request_stop("--stop-after reached")
            original(*args, **kwargs)  # type: ignore[arg-type]

        cb.on_train_batch_end = counted  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
