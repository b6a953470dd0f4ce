"""What resetting the window's gradient sums costs at the end of a window.

The end of an accumulation window applies the mean of the sums and resets
the sums to zero. Compiled by XLA on a CPU, a reset written as a constant
(`zeros_like`) into memory that the same program reads and updates in
place (a TF variable, a donated JAX buffer) can be written through copies.
This script times the end of a window on the backend it runs on, for two
states: all-MiniLM-L6-v2's weights with a 45-class head and AdamW (what
`benchmarks/as_speed.py` fine-tunes), and the 256-2048-2048-10 MLP of
`tests/test_filters.py` with SGD:

* TensorFlow: one XLA function that updates and resets; the update as an
  XLA function and the reset as graph ops after it (what `ASSpeed`'s
  filtered graph step runs); the update alone.
* JAX: one donated program that updates and resets; the update in one
  program and the reset in a program of its own (what the staged step
  runs); the update alone.

Median ms of 15 calls after one compiling call, the variants interleaved
round by round:

    python benchmarks/window_reset_cost.py
    KERAS_BACKEND=jax python benchmarks/window_reset_cost.py
    python benchmarks/window_reset_cost.py --quick   # smoke run
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402

MLP = [(256, 2048), (2048,), (2048, 2048), (2048,), (2048, 10), (10,)]


def minilm_shapes():
    import as_softmax_lab as lab

    backbone = lab.load_backbone("offline-minilm").backbone
    shapes = [tuple(v.shape) for v in backbone.trainable_variables]
    return shapes + [(backbone.hidden_dim, 45), (45,)]


def state(shapes, optimizer):
    """Weights, the window's sums, and `optimizer` built for the weights."""
    weights = [keras.Variable(keras.ops.ones(shape)) for shape in shapes]
    sums = [
        keras.Variable(keras.ops.ones(shape), trainable=False)
        for shape in shapes
    ]
    optimizer.build(weights)
    return weights, sums, optimizer


def tensorflow_variants(weights, sums, optimizer):
    import tensorflow as tf

    def update():
        optimizer.apply([s.value / 4.0 for s in sums], weights)

    def reset():
        for s in sums:
            s.assign(tf.zeros_like(s))

    def both():
        update()
        reset()

    xla_update = tf.function(update, jit_compile=True)

    def xla_update_graph_reset():
        xla_update()
        reset()

    return {
        "update and reset in one XLA function": tf.function(
            both, jit_compile=True
        ),
        "update in XLA, reset as graph ops after": tf.function(
            xla_update_graph_reset
        ),
        "update alone (XLA)": xla_update,
    }


def jax_variants(weights, sums, optimizer):
    import jax

    values = (
        [v.value for v in weights],
        [v.value for v in optimizer.variables],
        [v.value for v in sums],
    )

    def program(reset):
        def end(values):
            trainable, optimizer_values, grad_sums = values
            trainable, optimizer_values = optimizer.stateless_apply(
                optimizer_values, [s / 4.0 for s in grad_sums], trainable
            )
            if reset:
                grad_sums = zeros(grad_sums)
            return trainable, optimizer_values, grad_sums

        return jax.jit(end, donate_argnums=0)

    def zeros(grad_sums):
        return [keras.ops.zeros_like(s) for s in grad_sums]

    def call(*programs):
        def run():
            nonlocal values
            values = programs[0](values)
            if len(programs) > 1:
                values = (*values[:2], programs[1](values[2]))
            jax.block_until_ready(values)

        return run

    return {
        "update and reset in one program": call(program(True)),
        "update, then the reset in a program of its own": call(
            program(False), jax.jit(zeros, donate_argnums=0)
        ),
        "update alone": call(program(False)),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    args = parser.parse_args(argv)
    backend = keras.backend.backend()
    make = jax_variants if backend == "jax" else tensorflow_variants

    def adamw():
        return keras.optimizers.AdamW(1e-5)

    def sgd():
        return keras.optimizers.SGD(0.0)

    if args.quick:
        states, rounds = {"tiny, SGD": ([(8, 4), (4,)], sgd)}, 2
    else:
        states, rounds = (
            {
                "MiniLM + head, AdamW": (minilm_shapes(), adamw),
                "the MLP, SGD": (MLP, sgd),
            },
            15,
        )
    for label, (shapes, optimizer) in states.items():
        variants = make(*state(shapes, optimizer()))
        times = {name: [] for name in variants}
        for fn in variants.values():
            fn()
        for _ in range(rounds):
            for name, fn in variants.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        print(f"the end of a window on {backend}, {label}, median ms:")
        for name, seconds in times.items():
            print(f"  {name:48s} {1000 * statistics.median(seconds):8.2f}")


if __name__ == "__main__":
    main()
