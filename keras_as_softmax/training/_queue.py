"""A fixed-capacity queue of rows held as tensors (Selective-Backprop's
queue), in `keras.ops` with static shapes, for XLA and JAX.

A queue is a list of buffers, each `[capacity, ...]`, and an int32 count
of the rows waiting at the front. A step pushes a batch's kept rows and
pops the first `size` rows if that many wait (`push_pop`). Rows past the
count hold stale values that are never read.

A step reads and writes rows in proportion to a batch, never the whole
queue: the popped rows come from the front and the batch, and the batch's
rows are written where they wait after the pop, in one scatter (in place
where the buffers are variables: `_rows.write_rows`; XLA updates a donated
buffer in place). Fewer than `size` rows wait between steps, so a capacity
of `2 * size` holds them and a batch of up to `size` rows.

A row has several leaves (inputs, labels, weights, ids); a
`_layout.Layout(rows=True)` packs them into one `[rows, width]` buffer per
dtype, so that a queue holds a buffer or two whatever the model's inputs
and moves each with one gather.
"""

from typing import NamedTuple

from keras import ops

from keras_as_softmax.filters.base import RowUpdate
from keras_as_softmax.training._rows import read_rows
from keras_as_softmax.training._rows import reads_first
from keras_as_softmax.training._rows import write_rows


class RowQueue(NamedTuple):
    buffers: list  # [capacity, width] each
    count: object  # int32 scalar: the rows waiting at the front


def push_pop(queue, rows, keep, size):
    """Appends `rows[i]` for every `keep[i]`, in order, then takes the
    first `size` rows if that many wait.

    Args:
        queue: a `RowQueue` with fewer than `size` rows waiting.
        rows: one `[n, width]` tensor per buffer, `n <= size`.
        keep: bool `[n]`.
        size: the rows a pop takes.

    Returns:
        `(popped, ready, queue)`: the first `size` rows after the push (one
        tensor per buffer), whether that many waited, and the queue left:
        without them if so, else with the kept rows after its own.
    """
    capacity = queue.buffers[0].shape[0]
    n = ops.shape(keep)[0]
    keep = ops.cast(keep, "int32")
    taken = ops.sum(keep)
    count = queue.count
    ready = count + taken >= size
    # Each row's place among the batch's, kept rows first in their order,
    # and the inverse: the batch's rows in that order.
    place = ops.where(
        keep > 0, ops.cumsum(keep) - 1, taken + ops.cumsum(1 - keep) - 1
    )
    order = ops.argsort(place)
    # The front after the push: the waiting rows, then the batch's.
    front = ops.arange(size, dtype="int32")
    waiting = ops.expand_dims(front < count, -1)
    from_batch = ops.take(order, ops.clip(front - count, 0, n - 1))
    rows = [ops.cast(row, b.dtype) for b, row in zip(queue.buffers, rows)]
    popped = [
        ops.where(
            waiting,
            read_rows(buffer, front),
            ops.take(row, from_batch, axis=0),
        )
        for buffer, row in zip(queue.buffers, rows)
    ]
    # Where the batch's rows wait after the pop: behind the waiting rows,
    # or, if the front was taken, moved forward by `size` (the rows taken
    # wrap around to the stale end).
    ready_int = ops.cast(ready, "int32")  # Python ints would follow floatx
    shift = ready_int * (capacity - size)
    slots = (place + count + shift) % capacity
    popped, buffers = reads_first(popped, queue.buffers)
    buffers = [
        write_rows(buffer, RowUpdate(slots, row))
        for buffer, row in zip(buffers, rows)
    ]
    left = count + taken - ready_int * size
    return popped, ready, RowQueue(buffers, left)
