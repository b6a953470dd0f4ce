"""Backend-specific test helpers: gradients and compiled calls."""

import keras
import numpy as np
from keras import ops

BACKEND = keras.backend.backend()


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


def to_numpy(x):
    return ops.convert_to_numpy(x)
