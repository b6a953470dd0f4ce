"""Benchmark: what an `ASSpeed` step costs beyond a plain Keras step when
the model's own compute is negligible, as on a fast accelerator.

A tiny MLP (16-32-5), batch 32, 4096 samples of five Gaussian blobs,
`jit_compile=True`, AS-Softmax (delta 0.3) in every variant. After
`--warmup` epochs each, the variants train one epoch in turn, `--rounds`
times, in one process; each epoch's time over its steps is one sample, and
the table prints each variant's median per-step time and its ratio to the
plain Keras step measured beside it, and `host ms`: the calling thread's
CPU milliseconds a step (Keras's loop, the dispatch and, on a CPU, what of
the step runs in that thread). Where the wall time a step exceeds it by
far, the step waits for other threads. Compilation happens in the warm-up.

The variants:

* `keras`: a plain `keras.Model` compiled with the same loss.
* `keras_metrics` (not run by default): the plain model logging two
  metrics (`MaskedRatio`), as many log entries as `ASSpeed` adds
  (`masked_ratio`, `accum_steps`): Keras reads each entry of every
  step's logs on the host (on JAX and PyTorch in a thread beside the
  training loop, on TensorFlow in it).
* `keras_untracked` (not run by default): the plain model keeping Keras's
  per-step `_jax_state` out of attribute tracking, as `ASSpeed` does on
  JAX (elsewhere the same as `keras`): what the plain step costs without
  that host work, for a ratio that leaves it out.
* `as_speed`: `ASSpeed(model)`, the paper's accumulation (lam 0.5, cap 4).
* `skip_masked`: `ASSpeed(model, sample_filter=SkipMasked())`.
* `pair`: `[SkipMaskedLastSeen(n), SkipMasked()]`.
* `selective_backprop`: `SelectiveBackprop()`.

A variant `NAME@one_program` (or `@xla_passes`) compiles its filtered step
on TensorFlow as one XLA program (or as a graph whose passes are XLA
functions) whatever the platform; `NAME` alone takes the platform's
default (the graph on CPUs).

The filters are active after their one warm-up epoch; the trained and
scored fractions of the last epoch are printed beside each ratio.

`--row-shape 128,768` gives every sample wide inputs instead (the blobs in
the first 16 features of each of 128 positions, zeros after them), which
the model averages over the positions before its two layers: a step that
reads its batch once, as a model on precomputed token embeddings does,
to show what the filters' queues cost per byte of a row.

Usage:

```
python benchmarks/step_overhead.py
KERAS_BACKEND=jax python benchmarks/step_overhead.py
KERAS_BACKEND=torch python benchmarks/step_overhead.py --jit-compile auto
python benchmarks/step_overhead.py --steps-per-execution 8
python benchmarks/step_overhead.py --variants keras,pair,pair@one_program
python benchmarks/step_overhead.py --row-shape 128,768 --samples 512
python benchmarks/step_overhead.py --quick     # smoke run
```
"""

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_as_softmax as kas  # noqa: E402
from benchmarks._interleaved import epoch_fit  # noqa: E402
from benchmarks._interleaved import print_table  # noqa: E402
from benchmarks._interleaved import split_variant  # noqa: E402
from benchmarks._interleaved import time_epochs  # noqa: E402

VARIANTS = ("keras", "as_speed", "skip_masked", "pair", "selective_backprop")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps-per-execution", type=int, default=1)
    parser.add_argument(
        "--row-shape",
        default="16",
        help="a sample's input shape, e.g. `128,768`: positions, features",
    )
    parser.add_argument(
        "--jit-compile",
        choices=("true", "auto"),
        default="true",
        help="`auto`: Keras's default (eager on PyTorch)",
    )
    args = parser.parse_args(argv)
    args.row_shape = tuple(int(d) for d in args.row_shape.split(","))
    if len(args.row_shape) not in (1, 2) or args.row_shape[-1] < 16:
        parser.error(
            "--row-shape: expected FEATURES or POSITIONS,FEATURES with at "
            f"least 16 features. Received: {args.row_shape}"
        )
    if args.quick:
        args.samples, args.warmup, args.rounds = 512, 2, 2
    return args


def make_data(n, row_shape=(16,), seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 5, n).astype("int32")
    centers = rng.normal(size=(5, 16)) * 2.0
    x = (centers[y] + rng.normal(size=(n, 16))).astype("float32")
    if row_shape == (16,):
        return x, y
    wide = np.zeros((n, *row_shape), "float32")
    wide[..., :16] = x.reshape((n,) + (1,) * (len(row_shape) - 1) + (16,))
    return wide, y


class UntrackedSequential(keras.Sequential):
    """`keras.Sequential` that sets Keras's per-step `_jax_state` (a dict of
    the step's arrays) as `ASSpeed` does on JAX: without
    `Layer.__setattr__`'s walk of it."""

    def __setattr__(self, name, value):
        if name == "_jax_state":
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)


def make_model(variant, n, args):
    variant, step = split_variant(variant)
    keras.utils.set_random_seed(0)
    sequential = (
        UntrackedSequential
        if variant == "keras_untracked"
        else keras.Sequential
    )
    pool = [keras.layers.GlobalAveragePooling1D()] * (len(args.row_shape) > 1)
    model = sequential(
        [
            keras.Input(args.row_shape),
            *pool,
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(5),
        ]
    )
    loss = kas.ASSoftmaxLoss(0.3)
    metrics = None
    if variant == "keras_metrics":
        metrics = [kas.MaskedRatio(loss, name=m) for m in ("first", "second")]
    filters = {
        "keras": lambda: None,
        "keras_metrics": lambda: None,
        "keras_untracked": lambda: None,
        "as_speed": lambda: [],
        "skip_masked": lambda: [kas.filters.SkipMasked()],
        "pair": lambda: [
            kas.filters.SkipMaskedLastSeen(n, seed=1),
            kas.filters.SkipMasked(),
        ],
        "selective_backprop": lambda: [kas.filters.SelectiveBackprop()],
    }[variant]()
    if filters is not None:
        model = kas.ASSpeed(model, sample_filter=filters or None)
        model._tf_filtered_step = step
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=loss,
        metrics=metrics,
        jit_compile=True if args.jit_compile == "true" else "auto",
        steps_per_execution=args.steps_per_execution,
    )
    return model


def main(argv=None):
    args = parse_args(argv)
    x, y = make_data(args.samples, args.row_shape)
    steps = args.samples // args.batch_size
    fits = {}
    for variant in args.variants.split(","):
        model = make_model(variant, args.samples, args)
        pair = split_variant(variant)[0] == "pair"
        inputs = kas.filters.with_sample_ids(x) if pair else x
        fits[variant] = epoch_fit(model, inputs, y, args.batch_size)
    seconds, logs, host = time_epochs(fits, args.warmup, args.rounds)
    print(
        f"keras={keras.__version__} backend={keras.backend.backend()} "
        f"samples={args.samples} "
        f"batch={args.batch_size} warmup={args.warmup} rounds={args.rounds} "
        f"steps_per_execution={args.steps_per_execution} "
        f"row_shape={','.join(map(str, args.row_shape))} "
        f"jit_compile={args.jit_compile}"
    )
    print_table(seconds, logs, steps, reference=next(iter(fits)), host=host)


if __name__ == "__main__":
    main()
