"""Investigation: the host time that Keras's JAX `fit` spends after every
step on setting `model._jax_state`, the dict of the step's state arrays
that a callback may sync back into the variables.

`Layer.__setattr__` walks that dict for variables, layers and metrics to
track; it holds only arrays, so nothing is tracked, but the walk costs
each step per array. `ASSpeed` sets the attribute directly
(`object.__setattr__`). This builds `benchmarks/gpu_check.py`'s models
(random init: MiniLM's shape, BERT-base's, and `--quick`'s tiny one) and
the tiny MLP of `benchmarks/step_overhead.py`, and prints, per model, the
number of state arrays and the median time of one assignment each way.

    KERAS_BACKEND=jax python lab/state_tracking.py
    KERAS_BACKEND=jax python lab/state_tracking.py --models mlp,minilm
    python lab/state_tracking.py --quick     # a smoke test: mlp, tiny
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

if os.environ["KERAS_BACKEND"] != "tensorflow":
    # As `benchmarks/gpu_check.py` does: `import tensorflow` now fails, as
    # on a GPU image without it.
    sys.modules["tensorflow"] = None

from as_softmax_lab import random_bert  # noqa: E402
from as_softmax_lab import tiny_mlp  # noqa: E402


def build(name):
    if name == "mlp":
        args = tiny_mlp.parse_args([])
        return tiny_mlp.make_model("keras", 4096, args)
    args = random_bert.parse_args([])
    shape = random_bert.TINY if name == "tiny" else random_bert.SHAPES[name]
    return random_bert.make_variant("softmax", shape, args)


def median_seconds(fn, calls, repeats=7):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def time_assignments(model, calls):
    """`(arrays, tracked, direct)`: the state arrays, and the seconds of
    `model._jax_state = state` through `Layer.__setattr__` and directly."""
    model.optimizer.build(model.trainable_variables)
    names = (
        "trainable_variables",
        "non_trainable_variables",
        "optimizer_variables",
        "metrics_variables",
    )
    state = dict(zip(names, model._get_jax_state(**dict.fromkeys(names, True))))

    def tracked():
        model._jax_state = state

    def direct():
        object.__setattr__(model, "_jax_state", state)

    arrays = sum(len(v) for v in state.values())
    return arrays, median_seconds(tracked, calls), median_seconds(direct, calls)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp,tiny,minilm,bert_base")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help="smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.calls = "mlp,tiny", 5
    print(f"keras={keras.__version__} backend={keras.backend.backend()}")
    print(f"{'model':<12}{'arrays':>8}{'tracked us':>12}{'direct us':>11}")
    for name in args.models.split(","):
        arrays, tracked, direct = time_assignments(build(name), args.calls)
        print(
            f"{name:<12}{arrays:>8}{1e6 * tracked:>12.1f}{1e6 * direct:>11.1f}"
        )


if __name__ == "__main__":
    main()
