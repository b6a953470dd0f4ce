"""JAX: what a filtered step costs when nothing is masked, and why.

Fits four models on the low-share test's MLP (256-2048-2048-10, batch
128, random labels, learning rate 0, so nothing is masked): plain
`ASSpeed`; `ASSpeed` with `SkipMasked` (never scoring, every batch goes to
a training pass through the queue) as it runs, staged (the host decides
from the queue, then calls a program whose training pass is straight-line
code); the same as one program with each pass inside `jax.lax.cond`; and a
plain Keras model. Three interleaved rounds of 4 epochs; prints each
model's median epoch (the compiling epoch left out) and its ratio to plain
`ASSpeed`.

    python benchmarks/jax_filter_cost.py
"""

import os
import sys
import time

os.environ["KERAS_BACKEND"] = "jax"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import keras
import numpy as np

import keras_as_softmax as kas
from keras_as_softmax import filters
from keras_as_softmax.training import _jax

rng = np.random.default_rng(0)
n, width = 2048, 2048
x = rng.standard_normal((n, 256)).astype("float32")
y = rng.integers(0, 10, n).astype("int32")


def model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((256,))
    h = keras.layers.Dense(width, activation="relu")(inputs)
    h = keras.layers.Dense(width, activation="relu")(h)
    return keras.Model(inputs, keras.layers.Dense(10)(h))


class Times(keras.callbacks.Callback):
    def __init__(self):
        self.times = []

    def on_epoch_begin(self, e, logs=None):
        self.t = time.perf_counter()

    def on_epoch_end(self, e, logs=None):
        self.times.append(time.perf_counter() - self.t)


cands = {
    "plain": None,
    "skip_staged": filters.SkipMasked(min_masked_ratio=0.5, warmup_epochs=0),
    "skip_one_program": filters.SkipMasked(
        min_masked_ratio=0.5, warmup_epochs=0
    ),
    "keras": "keras",
}
wrapped = {}
for name, f in cands.items():
    if f == "keras":
        m = model()
        m.compile(
            optimizer=keras.optimizers.SGD(0.0),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    else:
        m = kas.ASSpeed(model(), sample_filter=f)
        m.compile(
            optimizer=keras.optimizers.SGD(0.0), loss=kas.ASSoftmaxLoss(0.3)
        )
        if name == "skip_one_program":
            # Keras's own: `train_step` jitted whole, passes in lax.cond.
            m.make_train_function = super(
                _jax.ASSpeedTrainer, m
            ).make_train_function
    wrapped[name] = m
times = {k: [] for k in cands}
for _ in range(3):
    for name, m in wrapped.items():
        t = Times()
        m.fit(x, y, batch_size=128, epochs=4, verbose=0, callbacks=[t])
        times[name] += t.times[1:]
base = np.median(times["plain"])
for name in cands:
    print(
        f"{name:16s}",
        f"{np.median(times[name]):.3f}s",
        f"{np.median(times[name]) / base:.2f}x",
        [round(t, 3) for t in times[name]],
    )
