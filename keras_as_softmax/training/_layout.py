"""`Layout`: many tensors held as one buffer per dtype (a wide row leaf:
one of its own).

A compiled step passes each buffer of its state in and out at a cost per
buffer (JAX dispatches, donates and re-wraps each one; TensorFlow reads
and assigns each variable), and a small model's step feels that cost. So
state made of many tensors (a filter queue's row leaves, the accumulated
gradients of every weight) lives packed: one buffer per dtype, and views
of it where a tensor is needed, which a compiler fuses into their use.
"""

import keras
import numpy as np
from keras import ops

# Eager PyTorch pays a conversion per `keras.ops` call, and a filtered step
# packs and unpacks its rows on every drawn batch: there the layout uses
# tensor methods, which `torch.compile` traces as well.
_TORCH = keras.backend.backend() == "torch"


class Layout:
    """Where each tensor lives: a span of its dtype's buffer.

    Args:
        leaves: `(shape, dtype)` of each tensor (without the row axis,
            with `rows=True`).
        rows: whether the tensors share a leading row axis, kept in the
            buffers (`[rows, width]`, one row's leaves side by side), or
            not (`[width]`, the tensors end to end). A row's leaf of
            `OWN_BUFFER_WIDTH` values or more keeps a buffer of its own:
            packed beside others it would be copied (a concatenation along
            the rows' inner axis) at every push and pop of a queue, which
            costs more than a buffer.
    """

    OWN_BUFFER_WIDTH = 4096

    def __init__(self, leaves, rows=False):
        self.rows = rows
        self.dtypes, self.widths, self.slots = [], [], []
        keys = []
        for shape, dtype in leaves:
            width = int(np.prod(shape, dtype="int64"))
            key = dtype
            if rows and self.has_own_buffer(shape):
                key = (dtype, len(self.slots))
            if key not in keys:
                keys.append(key)
                self.dtypes.append(dtype)
                self.widths.append(0)
            index = keys.index(key)
            start = self.widths[index]
            self.widths[index] += width
            self.slots.append((index, start, self.widths[index], tuple(shape)))

    @classmethod
    def has_own_buffer(cls, shape):
        """Whether a row's leaf of `shape` keeps a buffer of its own."""
        return np.prod(shape, dtype="int64") >= cls.OWN_BUFFER_WIDTH

    def buffer_shapes(self, rows=None):
        """`(shape, dtype)` of each buffer (`rows` rows, with `rows=True`)."""
        lead = (rows,) if self.rows else ()
        return [((*lead, w), d) for w, d in zip(self.widths, self.dtypes)]

    def pack(self, leaves):
        """The tensors as one buffer per dtype."""
        parts = [[] for _ in self.dtypes]
        lead = (-1,) if self.rows else ()
        for leaf, (index, start, stop, _) in zip(leaves, self.slots):
            shape = (*lead, stop - start)
            if _TORCH:
                leaf = leaf.to(_torch_dtype(self.dtypes[index])).reshape(shape)
            else:
                leaf = ops.reshape(ops.cast(leaf, self.dtypes[index]), shape)
            parts[index].append(leaf)
        axis = 1 if self.rows else 0
        concatenate = _torch_cat if _TORCH else ops.concatenate
        return [p[0] if len(p) == 1 else concatenate(p, axis) for p in parts]

    def unpack(self, buffers):
        """The tensors of packed `buffers` (the inverse of `pack`); on
        PyTorch, views of the buffers."""
        reshape = _torch_reshape if _TORCH else ops.reshape
        if self.rows:
            return [
                reshape(buffers[index][:, start:stop], (-1, *shape))
                for index, start, stop, shape in self.slots
            ]
        return [
            reshape(buffers[index][start:stop], shape)
            for index, start, stop, shape in self.slots
        ]


def _torch_dtype(dtype):
    import torch

    return getattr(torch, dtype)


def _torch_cat(tensors, axis):
    import torch

    return torch.cat(tensors, axis)


def _torch_reshape(tensor, shape):
    return tensor.reshape(shape)
