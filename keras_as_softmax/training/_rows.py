"""Reading and writing some rows of a step's state: in place where the
state is a variable.

A filtered step keeps its queues and a memory filter's per-sample memory as
model variables, and touches a few rows of each per step. Written as values
(`take`, `scatter_update`), XLA updates the donated buffers in place; a
TensorFlow graph without XLA and eager PyTorch would copy each variable
whole, at a cost in proportion to the data set or a row's width. So where
the step holds the variable itself, rows are read and written through it.
"""

import keras
from keras import ops

from keras_as_softmax.filters.base import RowUpdate


def read_rows(current, ids):
    """`current`'s rows `ids` (int32 `[n]`), a new tensor: on a TensorFlow
    variable a gather from it, which leaves it free for `write_rows` to
    write in place (a read of the whole variable would make that write
    copy it first). A `tf.distribute` variable, which has no such gather,
    is read whole, as is one `in_place` refuses."""
    if keras.backend.backend() == "tensorflow" and hasattr(
        current, "sparse_read"
    ):
        import tensorflow as tf

        distributed = isinstance(current, tf.distribute.DistributedValues)
        if not distributed and in_place(current.dtype, current.device):
            return current.sparse_read(ids)
        # Read first: `tf.gather` would gather from the variable itself.
        current = tf.convert_to_tensor(current)
    return ops.take(current, ids, axis=0)


def in_place(dtype, device):
    """Whether TensorFlow gathers and scatters the rows of a variable of
    `dtype` on `device` (its device string) in place. It registers no GPU
    kernel for either on int32, so such a variable is read whole and
    assigned its new value (a copy a step, of a queue buffer of token ids,
    say)."""
    import tensorflow as tf

    if tf.as_dtype(dtype) != tf.int32:
        return True
    return (
        bool(device) and tf.DeviceSpec.from_string(device).device_type == "CPU"
    )


def reads_first(reads, buffers):
    """`(reads, buffers)` as they are, the reads ordered before any write
    to the buffers. XLA updates a donated buffer in place only where it
    can order the reads of it before the write: without the order, recent
    jaxlib releases on a CPU copy the buffer whole, twice, and an
    optimization barrier spares the copies."""
    if keras.backend.backend() != "jax":
        return reads, buffers
    import jax

    # Older jax releases lack it: there the reads stay as they are (a copy,
    # not another result).
    barrier = getattr(jax.lax, "optimization_barrier", None)
    if barrier is None:
        return reads, buffers
    return barrier((reads, buffers))


def write_rows(current, update):
    """A state entry after a step: `update` itself, or `current` with the
    rows of a `RowUpdate` written. Where `current` is a variable (a
    TensorFlow graph or eager step, an eager PyTorch one) they are written
    in place and the variable returned, which the trainer then leaves as
    it is. XLA writes the scattered value in place."""
    if not isinstance(update, RowUpdate):
        return update
    backend = keras.backend.backend()
    if (
        backend == "tensorflow"
        and hasattr(current, "scatter_update")
        and in_place(current.dtype, current.device)
    ):
        import tensorflow as tf

        values = ops.cast(update.values, current.dtype)
        current.scatter_update(tf.IndexedSlices(values, update.ids))
        return current
    if backend == "torch":
        import torch

        if isinstance(current, torch.nn.Parameter):
            with torch.no_grad():
                current.index_copy_(
                    0, update.ids.long(), update.values.to(current.dtype)
                )
            return current
    ids = ops.expand_dims(update.ids, -1)
    return ops.scatter_update(current, ids, update.values)
