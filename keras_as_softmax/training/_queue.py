"""A fixed-capacity queue of rows held as tensors (Selective-Backprop's
queue), in `keras.ops` with static shapes, for XLA and JAX.

A queue is a list of buffers, each `[capacity, ...]`, and an int32 count
of the rows waiting at the front. `push` appends the kept rows of a batch
in their order, `pop` takes the first `size` rows. Rows past the count hold
stale values that are never read.

A row has several leaves (inputs, labels, weights, ids); a
`_layout.Layout(rows=True)` packs them into one `[rows, width]` buffer per
dtype, so that a queue holds a buffer or two whatever the model's inputs
and moves each with one gather.
"""

from typing import NamedTuple

from keras import ops


class RowQueue(NamedTuple):
    buffers: list
    count: object


def push(queue, rows, keep):
    """Appends `rows[i]` for every `keep[i]`, in order.

    The caller keeps `count + sum(keep) <= capacity`.
    """
    capacity = queue.buffers[0].shape[0]
    size = ops.shape(keep)[0]
    keep = ops.cast(keep, "int32")
    # Kept rows first, in their order: a stable sort on unique keys.
    order = ops.argsort((1 - keep) * size + ops.arange(size, dtype="int32"))
    slots = ops.arange(capacity, dtype="int32")
    count = queue.count
    taken = ops.sum(keep)
    source = ops.where(slots < count, slots, capacity + slots - count)
    source = ops.where(slots < count + taken, source, slots)
    buffers = []
    for buffer, row in zip(queue.buffers, rows):
        compact = ops.take(ops.cast(row, buffer.dtype), order, axis=0)
        both = ops.concatenate([buffer, compact], axis=0)
        buffers.append(ops.take(both, source, axis=0))
    return RowQueue(buffers, count + taken)


def pop(queue, size):
    """`(rows, queue)`: the first `size` rows and the queue without them
    (whether or not that many were waiting; check `count` first)."""
    capacity = queue.buffers[0].shape[0]
    rest = ops.minimum(ops.arange(capacity, dtype="int32") + size, capacity - 1)
    rows = [b[:size] for b in queue.buffers]
    buffers = [ops.take(b, rest, axis=0) for b in queue.buffers]
    return rows, RowQueue(buffers, ops.maximum(queue.count - size, 0))


def select(condition, a, b):
    """`a` where the scalar `condition` holds, else `b` (queues or lists)."""
    return RowQueue(
        [ops.where(condition, x, y) for x, y in zip(a.buffers, b.buffers)],
        ops.where(condition, a.count, b.count),
    )
