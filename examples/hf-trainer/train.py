"""A tiny GPT-2 trained with the Hugging Face Trainer, which chainrun can stop and resume.

The model is built from a config (nothing is downloaded) and trains on random tokens. The
lines that make a Trainer script chainable are marked ``# chainrun``. To try it without
chainrun:

    $ python3 train.py --epochs 2

``--stop-after N`` asks the callback to stop after N steps (as the walltime signal would),
``--out`` writes the logged losses (JSON) once the run is done, ``--step-sleep`` slows each
step down.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from chainrun.checkpoint.hf import ChainrunTrainerCallback, newest_checkpoint  # chainrun


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(42))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Slow(TrainerCallback):  # type: ignore[misc]
    def __init__(self, cb: ChainrunTrainerCallback, stop_after: int, sleep: float) -> None:
        self.cb, self.left, self.sleep = cb, stop_after, sleep

    def on_step_begin(self, args: object, state: object, control: object, **kwargs: object) -> None:
        time.sleep(self.sleep)
        self.left -= 1
        if self.left == 0:
            self.cb.clock.request_stop("--stop-after reached")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", default="")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--stop-after", type=int, default=0)
    parser.add_argument(
        "--report-to", default="none", help="mlflow, wandb, or mlflow,wandb: the Trainer's own loggers"
    )
    args = parser.parse_args()

    cb = ChainrunTrainerCallback()  # chainrun: first, so the walltime signal finds its handler
    output_dir = os.environ.get("CHAINRUN_CHECKPOINT_DIR", "checkpoints")
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=output_dir,
        num_train_epochs=args.epochs,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",  # chainrun's callback saves on the walltime signal and at the end
        seed=0,
        data_seed=0,
        use_cpu=True,
        report_to=args.report_to.split(","),
        disable_tqdm=True,
    )
    callbacks = [cb]  # chainrun
    if args.stop_after or args.step_sleep:
        callbacks.append(Slow(cb, args.stop_after, args.step_sleep))
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(96), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=newest_checkpoint(output_dir))  # chainrun
    if cb.last_saved is None or not cb.last_saved.done:
        print(f"stopped ({cb.clock.reason})", flush=True)
    elif args.out:
        losses = [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e]
        with open(args.out, "w") as f:
            json.dump(
                {
                    "losses": losses,
                    "weights": float(sum(p.detach().double().sum() for p in model.parameters())),
                },
                f,
            )


if __name__ == "__main__":
    main()
