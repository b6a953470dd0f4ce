"""The tiny model of `benchmarks/step_overhead.py`, a step that is all
overhead (the stand-in for a fast accelerator): an MLP (16-32-5) on five
Gaussian blobs, `ASSoftmaxLoss(0.3)`, `jit_compile=True`, in each of the
benchmark's variants (its docstring describes them), with its command
line. Here for the benchmark and for the lab's scripts that time or
inspect the same model (`lab/state_tracking.py`,
`lab/torch_kept_rows.py`).
"""

import argparse

import keras
import numpy as np

import keras_as_softmax as kas
from as_softmax_lab.timing import split_variant

VARIANTS = ("keras", "as_speed", "skip_masked", "pair", "selective_backprop")


def parse_args(argv=None, description=None):
    """`step_overhead.py`'s command line; `parse_args([])` gives its
    defaults."""
    parser = argparse.ArgumentParser(description=description)
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
    """`(x, y)`: `n` samples of five Gaussian blobs in 16 features; with a
    wider `row_shape`, the blobs in the first 16 features of each
    position, zeros after them."""
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
    """A fresh model of `variant` (`NAME` or `NAME@STEP`) for `n` samples,
    compiled with `args`' settings (`parse_args`'s)."""
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
