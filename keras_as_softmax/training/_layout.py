"""`Layout`: many tensors held as one buffer per dtype.

A compiled step passes each buffer of its state in and out at a cost per
buffer (JAX dispatches, donates and re-wraps each one; TensorFlow reads
and assigns each variable), and a small model's step feels that cost. So
state made of many tensors (a filter queue's row leaves, the accumulated
gradients of every weight) lives packed: one buffer per dtype, and views
of it where a tensor is needed, which a compiler fuses into their use.
"""

import numpy as np
from keras import ops


class Layout:
    """Where each tensor lives: a span of its dtype's buffer.

    Args:
        leaves: `(shape, dtype)` of each tensor (without the row axis,
            with `rows=True`).
        rows: whether the tensors share a leading row axis, kept in the
            buffers (`[rows, width]`, one row's leaves side by side), or
            not (`[width]`, the tensors end to end).
    """

    def __init__(self, leaves, rows=False):
        self.rows = rows
        self.dtypes, self.widths, self.slots = [], [], []
        for shape, dtype in leaves:
            if dtype not in self.dtypes:
                self.dtypes.append(dtype)
                self.widths.append(0)
            index = self.dtypes.index(dtype)
            start = self.widths[index]
            self.widths[index] += int(np.prod(shape, dtype="int64"))
            self.slots.append((index, start, self.widths[index], tuple(shape)))

    def buffer_shapes(self, rows=None):
        """`(shape, dtype)` of each buffer (`rows` rows, with `rows=True`)."""
        lead = (rows,) if self.rows else ()
        return [((*lead, w), d) for w, d in zip(self.widths, self.dtypes)]

    def pack(self, leaves):
        """The tensors as one buffer per dtype."""
        parts = [[] for _ in self.dtypes]
        lead = (-1,) if self.rows else ()
        for leaf, (index, start, stop, _) in zip(leaves, self.slots):
            leaf = ops.cast(leaf, self.dtypes[index])
            parts[index].append(ops.reshape(leaf, (*lead, stop - start)))
        axis = 1 if self.rows else 0
        return [
            p[0] if len(p) == 1 else ops.concatenate(p, axis) for p in parts
        ]

    def unpack(self, buffers):
        """The tensors of packed `buffers` (the inverse of `pack`); on
        PyTorch, views of the buffers."""
        if self.rows:
            return [
                ops.reshape(buffers[index][:, start:stop], (-1, *shape))
                for index, start, stop, shape in self.slots
            ]
        return [
            ops.reshape(buffers[index][start:stop], shape)
            for index, start, stop, shape in self.slots
        ]
