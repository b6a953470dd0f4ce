"""What a sample filter's machinery costs when it skips nothing.

Trains a 3 x 1024 MLP (4096 samples, batch 64) with `ASSpeed` plain and
with each filter held in its warm-up (so every sample is trained, as in a
plain step), and prints each one's median epoch time over the plain one's.
The difference is the price of the queues and the conditionals around the
passes.

    python benchmarks/filter_overhead.py                  # TensorFlow, XLA
    python benchmarks/filter_overhead.py --no-xla         # TensorFlow graph
    KERAS_BACKEND=jax python benchmarks/filter_overhead.py

A timing script, not a test. Quote the ratios, measured side by side.
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-xla", action="store_true")
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args(argv)

    import keras
    import numpy as np

    import keras_as_softmax as kas
    from keras_as_softmax import filters

    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, 256)).astype("float32")
    y = x[:, :10].argmax(-1).astype("int32")

    def make():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((256,))
        h = inputs
        for _ in range(3):
            h = keras.layers.Dense(1024, activation="relu")(h)
        return keras.Model(inputs, keras.layers.Dense(10)(h))

    class EpochTimes(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times = []

        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.times.append(time.perf_counter() - self.start)

    never = 10**6  # warm-up epochs: the filters never skip
    variants = {
        "plain": None,
        "SkipMaskedLastSeen": filters.SkipMaskedLastSeen(
            4096, warmup_epochs=never
        ),
        "SkipMasked": filters.SkipMasked(warmup_epochs=never),
        "both": [
            filters.SkipMaskedLastSeen(4096, warmup_epochs=never),
            filters.SkipMasked(warmup_epochs=never),
        ],
    }
    jit = keras.backend.backend() == "jax" or not args.no_xla
    medians = {}
    for name, sample_filter in variants.items():
        model = kas.ASSpeed(make(), sample_filter=sample_filter)
        model.compile(
            optimizer="adam", loss=kas.ASSoftmaxLoss(0.3), jit_compile=jit
        )
        times = EpochTimes()
        inputs = (
            filters.with_sample_ids(x) if model._last_seen is not None else x
        )
        model.fit(
            inputs,
            y,
            batch_size=64,
            epochs=args.epochs,
            verbose=0,
            callbacks=[times],
        )
        medians[name] = statistics.median(times.times[1:])
    mode = "XLA" if jit else "graph"
    print(f"{keras.backend.backend()}, {mode}: epoch time / plain epoch time")
    for name, value in medians.items():
        print(f"  {name:<20} {value:6.2f} s   x {value / medians['plain']:.2f}")


if __name__ == "__main__":
    sys.exit(main())
