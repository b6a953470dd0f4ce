"""Shared test helpers: gradients and compiled calls on each backend, and
a subclassed model whose Keras mask shows only on its predictions."""

import keras
import numpy as np
from keras import ops

BACKEND = keras.backend.backend()


def release(version):
    """`(major, minor)` of a version string: "2.21.0" -> (2, 21)."""
    return tuple(int(part) for part in version.split(".")[:2])


def value_and_grad(fn, x):
    """Value of `sum(fn(x))` and its gradient with respect to `x` (NumPy)."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        x = tf.convert_to_tensor(x)
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = fn(x)
            total = tf.reduce_sum(out)
        return out.numpy(), tape.gradient(total, x).numpy()
    if BACKEND == "jax":
        import jax

        out = fn(x)
        grad = jax.grad(lambda v: fn(v).sum())(x)
        return np.asarray(out), np.asarray(grad)
    if BACKEND == "torch":
        import torch

        x = torch.tensor(x, requires_grad=True)
        out = fn(x)
        out.sum().backward()
        return out.detach().numpy(), x.grad.numpy()
    raise NotImplementedError(BACKEND)


def compiled(fn):
    """`fn` compiled with XLA (TensorFlow `jit_compile=True`, `jax.jit`)."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.function(fn, jit_compile=True)
    if BACKEND == "jax":
        import jax

        return jax.jit(fn)
    return None


def compilers():
    """What compiles a step here: `compiled`, and on TensorFlow also a
    `tf.function` graph without XLA, as `fit` runs one on CPUs by default."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return [compiled, tf.function]
    return [compiled]


def to_numpy(x):
    return ops.convert_to_numpy(x)


class MaskedTagger(keras.Model):
    """A subclassed token tagger whose output carries the embedding's mask:
    its symbolic outputs do not show it, its traced and eager calls do."""

    def __init__(self, width=4, classes=3, **kwargs):
        super().__init__(**kwargs)
        self.embedding = keras.layers.Embedding(20, width, mask_zero=True)
        self.dense = keras.layers.Dense(classes)

    def call(self, tokens):
        return self.dense(self.embedding(tokens))


def run_json_script(script, timeout=600):
    """Runs `script` in a fresh Python process and returns the JSON that
    its last line of output prints; fails with its stderr if it fails."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
