"""A Keras model trained with a custom TensorFlow loop, made resumable with chainrun.

The checkpoint holds the model, the optimizer (its slots and iteration count,
so the learning-rate schedule continues), the dropout seed state and the RNGs.
The tf.data pipeline is shuffled with a seed per epoch, so a resumed epoch
sees the same order and ``ckpt.steps`` skips the batches already trained.
The data is synthetic; swap in your own.
"""

from __future__ import annotations

import argparse
import sys

import keras
import numpy as np
import tensorflow as tf

from chainrun.checkpoint.tensorflow import Checkpointer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    # Importing the helper seeded TensorFlow, NumPy and random from the chain's own
    # CHAINRUN_SEED (keras.utils.set_random_seed(0) would make a sweep's repetitions copies).
    rng = np.random.default_rng(1)  # the data: the same in every run
    x = rng.normal(size=(20000, 32)).astype("float32")
    y = (x @ rng.normal(size=(32, 1)) > 0).astype("float32")

    model = keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(1),
        ]
    )
    schedule = keras.optimizers.schedules.CosineDecay(
        1e-3, decay_steps=args.epochs * len(x) // args.batch_size
    )
    optimizer = keras.optimizers.Adam(schedule)
    loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    ckpt = Checkpointer(model=model, optimizer=optimizer)
    start = ckpt.restore()
    print(start.describe(), flush=True)
    if start.done:
        return 0

    @tf.function
    def train_step(xb: tf.Tensor, yb: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        optimizer.apply_gradients(
            zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        )
        return loss

    loss = tf.constant(0.0)  # a resume at the end of an epoch runs no step in it
    for epoch in range(start.epoch, args.epochs):
        batches = (
            tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=epoch).batch(args.batch_size)
        )
        for step, (xb, yb) in ckpt.steps(batches, epoch):
            loss = train_step(xb, yb)
            if ckpt.should_stop():
                ckpt.save(epoch, step + 1, metrics={"loss": loss})
                print(f"stopping at epoch {epoch} step {step + 1} ({ckpt.clock.reason})", flush=True)
                return 0
        ckpt.save(epoch + 1, 0, done=epoch + 1 == args.epochs, metrics={"loss": loss})
        print(f"epoch {epoch + 1}/{args.epochs} loss {float(loss):.4f}", flush=True)
    print("training done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
