"""What `ASSpeed.fit` reads of its data before Keras does: the first batch,
which the filters' queues are shaped after, and a validation split of
arrays, which a keras-hub task's preprocessor would otherwise turn into a
dataset before Keras could split it."""

import math
import sys
import types

import keras
import numpy as np


def kind(x):
    """What the data `x` given to `fit` is: "tf.data.Dataset",
    "PyDataset", "DataLoader" (torch's), "generator" or "arrays"."""
    tf = sys.modules.get("tensorflow")
    torch = sys.modules.get("torch")
    if tf is not None and isinstance(x, tf.data.Dataset):
        return "tf.data.Dataset"
    if isinstance(x, keras.utils.PyDataset):
        return "PyDataset"
    if torch is not None and isinstance(x, torch.utils.data.DataLoader):
        return "DataLoader"
    if isinstance(x, types.GeneratorType):
        return "generator"
    return "arrays"


def _put_back(first, rest):
    yield first
    # A loop, not `yield from`, which would close `rest` as Keras closes
    # this generator: the user's generator stays open for a later `fit`.
    for element in rest:  # noqa: UP028
        yield element


def first_batch(
    x, y, sample_weight, batch_size, steps_per_epoch=None, validation_split=0.0
):
    """The first batch `fit` will draw, read without using the data up:
    of arrays, Keras's batch (`batch_size`, else one of `steps_per_epoch`
    equal batches, else 32) of the share left after `validation_split`.

    Returns:
        `((x, y, sample_weight), x)`: the first batch, and the data to
        train on (a generator with its first batch put back).
    """
    data_kind = kind(x)
    if data_kind == "tf.data.Dataset":
        first = next(iter(x.take(1)))
    elif data_kind == "PyDataset":
        first = x[0]
    elif data_kind == "DataLoader":
        first = next(iter(x))
    elif data_kind == "generator":
        first = next(x)
        x = _put_back(first, x)
    else:
        expected = (
            "arrays, a tf.data.Dataset, a keras.utils.PyDataset, a torch "
            "DataLoader or a generator"
        )
        samples = _split_at(_samples(x, y, sample_weight), validation_split)
        size = batch_size or (
            math.ceil(samples / steps_per_epoch) if steps_per_epoch else 32
        )
        size = max(1, min(size, samples))
        first = tuple(
            _slice(t, 0, size, expected) for t in (x, y, sample_weight)
        )
    if isinstance(first, list):  # a DataLoader's batch
        first = tuple(first)
    return keras.utils.unpack_x_y_sample_weight(first), x


def _samples(x, y, sample_weight):
    """The number of samples in arrays `x`, `y`, `sample_weight`."""
    leaves = keras.tree.flatten((x, y, sample_weight))
    first = next((t for t in leaves if t is not None), None)
    return 0 if first is None else int(np.shape(first)[0])


def _split_at(samples, validation_split):
    """How many of `samples` Keras trains on after `validation_split`."""
    return int(math.floor(samples * (1.0 - validation_split)))


def split_validation(x, y, sample_weight, validation_split):
    """Keras's `validation_split` of arrays: the last share of the samples
    for validation, in order.

    Returns:
        `((x, y, sample_weight), (x, y, sample_weight))`: training and
        validation arrays.
    """
    samples = _samples(x, y, sample_weight)
    split_at = _split_at(samples, validation_split)
    if split_at in (0, samples):
        raise ValueError(
            f"Expected enough samples for validation_split="
            f"{validation_split} to leave some for training and some for "
            f"validation. Received: {samples} samples"
        )
    train = tuple(
        _slice(t, 0, split_at, "arrays, for validation_split")
        for t in (x, y, sample_weight)
    )
    validation = tuple(
        _slice(t, split_at, samples, "arrays, for validation_split")
        for t in (x, y, sample_weight)
    )
    return train, validation


def _slice(structure, start, stop, expected):
    """`structure`'s arrays, sliced `[start:stop]`; a leaf that is not an
    array raises, naming what was `expected`."""
    if structure is None:
        return None

    def take(a):
        if not getattr(a, "shape", None):
            raise ValueError(
                f"Expected data as {expected}. Received: an element of "
                f"type {type(a).__name__}"
            )
        return a[start:stop]

    return keras.tree.map_structure(take, structure)
