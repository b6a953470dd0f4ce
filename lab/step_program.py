"""What `ASSpeed`'s compiled training step holds, counted: to tell whether
a change to the package touched the step, where timing it cannot (on the
tiny model of `benchmarks/step_overhead.py`, a step's time varies more
between runs than a few operations cost).

For each variant (`keras`, `as_speed`, `skip_masked`, `pair`), the model
of `benchmarks/step_overhead.py` (MLP 16-32-5, `ASSoftmaxLoss(0.3)`,
`jit_compile=True`) is fitted for an epoch, then its `train_step` is
traced for one batch of 32:

* JAX: the optimized HLO of `jax.jit(train_step)` (what XLA runs),
  counted by instruction;
* TensorFlow: the graph of `tf.function(train_step)` with the functions
  it calls (conditionals' branches, the passes' XLA functions), counted
  by operation.

It prints one line per variant: the total, then the count of each kind.
Run it on two checkouts and compare; for instance, with the package of
another checkout first on the path:

    KERAS_BACKEND=jax python lab/step_program.py
    python lab/step_program.py --variants as_speed,skip_masked
"""

import argparse
import collections
import re

import keras
import numpy as np

import keras_as_softmax as kas
from keras_as_softmax import filters

VARIANTS = ("keras", "as_speed", "skip_masked", "pair")


def make_model(variant, samples):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(32, activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(5)(hidden))
    if variant == "keras":
        return model
    sample_filter = {
        "as_speed": None,
        "skip_masked": filters.SkipMasked(),
        "pair": [filters.SkipMaskedLastSeen(samples), filters.SkipMasked()],
    }[variant]
    return kas.ASSpeed(model, sample_filter=sample_filter)


def count(model, x, y):
    """`Counter` of the compiled step's instructions (JAX) or operations
    (TensorFlow) for the batch `(x, y)`."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        state = (
            [v.value for v in model.trainable_variables],
            [v.value for v in model.non_trainable_variables],
            [v.value for v in model.optimizer.variables],
            [v.value for v in model.metrics_variables],
        )
        hlo = jax.jit(model.train_step).lower(state, (x, y)).compile()
        return collections.Counter(
            re.findall(r"= \S+ ([a-z][\w-]*)\(", hlo.as_text())
        )
    if backend == "tensorflow":
        import tensorflow as tf

        step = tf.function(model.train_step).get_concrete_function(
            tf.nest.map_structure(tf.constant, (x, y))
        )
        graph = step.graph.as_graph_def()
        counts = collections.Counter(node.op for node in graph.node)
        for function in graph.library.function:
            counts.update(node.op for node in function.node_def)
        return counts
    raise SystemExit(
        f"step_program.py runs on JAX or TensorFlow, not {backend}"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--quick", action="store_true", help="smoke run")
    args = parser.parse_args()
    samples = 128 if args.quick else args.samples
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, 16)).astype("float32")
    y = x[:, :5].argmax(axis=1).astype("int32")
    print(
        f"keras={keras.__version__} backend={keras.backend.backend()} "
        f"keras_as_softmax={kas.__version__}"
    )
    for variant in args.variants.split(","):
        model = make_model(variant, samples)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=kas.ASSoftmaxLoss(0.3),
            jit_compile=True,
        )
        data = filters.with_sample_ids(x) if variant == "pair" else x
        model.fit(data, y, batch_size=32, epochs=1, verbose=0)
        batch = keras.tree.map_structure(lambda a: a[:32], data)
        counts = count(model, batch, y[:32])
        kinds = " ".join(f"{k}={n}" for k, n in sorted(counts.items()))
        print(f"{variant}: {sum(counts.values())} | {kinds}")


if __name__ == "__main__":
    main()
