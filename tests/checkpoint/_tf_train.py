"""A small deterministic Keras custom loop with chainrun's TensorFlow Checkpointer (for test_ckpt_tensorflow).

Dropout (Keras seed generator state), noise from TensorFlow's global
generator, NumPy and Python random numbers, Adam with a decaying learning
rate keyed on its iteration count, and a tf.data pipeline shuffled with a seed
per epoch. ``--signal-at E:S`` sends the walltime signal to itself after batch
S of epoch E; then it saves, prints ``stopped`` and exits 0. At the end every
model and optimizer variable goes to ``--out`` (an .npz) for comparison.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys

import keras
import numpy as np
import tensorflow as tf

from chainrun.checkpoint.tensorflow import Checkpointer


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--signal-at", default="")
    args = parser.parse_args()

    keras.utils.set_random_seed(0)
    tf.config.experimental.enable_op_determinism()
    data = np.random.default_rng(42)
    x = data.normal(size=(96, 8)).astype("float32")
    y = np.tanh(x @ data.normal(size=(8, 1))).astype("float32")

    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(1),
        ]
    )
    optimizer = keras.optimizers.Adam(
        learning_rate=keras.optimizers.schedules.ExponentialDecay(0.01, 10, 0.9)
    )
    tf.random.set_global_generator(tf.random.Generator.from_seed(1))
    ckpt = Checkpointer(args.dir, model=model, optimizer=optimizer)
    start = ckpt.restore()
    print(start.describe(), flush=True)
    signal_at = tuple(int(v) for v in args.signal_at.split(":")) if args.signal_at else None
    generator = tf.random.get_global_generator()

    loss = tf.constant(0.0)  # a resume at the end of an epoch runs no step in it
    for epoch in range(start.epoch, args.epochs):
        batches = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(96, seed=100 + epoch).batch(8)
        for step, (xb, yb) in ckpt.steps(batches, epoch):
            noise = 0.01 * generator.normal(tf.shape(xb))
            weight = 1.0 + 0.1 * float(np.random.rand()) + 0.1 * random.random()
            with tf.GradientTape() as tape:
                loss = weight * tf.reduce_mean(tf.square(model(xb + noise, training=True) - yb))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            if signal_at == (epoch, step):
                os.kill(os.getpid(), signal.SIGUSR1)
            if ckpt.should_stop():
                ckpt.save(epoch, step + 1, metrics={"loss": loss})
                print(f"stopped at epoch {epoch} step {step + 1}", flush=True)
                return 0
        ckpt.save(epoch + 1, 0, done=epoch + 1 == args.epochs, metrics={"loss": loss})

    variables = {f"model/{i}/{v.path}": v.numpy() for i, v in enumerate(model.variables)}
    variables.update({f"optimizer/{i}/{v.path}": v.numpy() for i, v in enumerate(optimizer.variables)})
    variables["generator"] = generator.state.numpy()
    np.savez(args.out, **{k.replace("/", "|"): v for k, v in variables.items()})
    print("finished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
