"""What `ASSpeed.fit` reads of its data before Keras does: the first batch,
which the filters' queues are shaped after, and a validation split of
arrays, which a keras-hub task's preprocessor would otherwise turn into a
dataset before Keras could split it."""

import math
import sys
import types

import keras
import numpy as np

from keras_as_softmax import filters
from keras_as_softmax.filters.sample_ids import text_as_arrays


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


def preprocessed(preprocessor, x, y, sample_weight, batch_size, shuffle=False):
    """The data as a dataset of preprocessed batches, where the wrapped
    task has a preprocessor. Arrays are batched here and shuffled as
    `shuffle` says (`fit`'s: `True` the samples at each epoch, `"batch"`
    the batches), where keras-hub's own `fit` keeps their order."""
    if preprocessor is None or x is None:
        return x, y, sample_weight
    import tensorflow as tf

    if not isinstance(x, tf.data.Dataset):
        data = keras.utils.pack_x_y_sample_weight(x, y, sample_weight)
        x = tf.data.Dataset.from_tensor_slices(data)
        if shuffle is True:
            x = x.shuffle(x.cardinality(), reshuffle_each_iteration=True)
        x = x.batch(batch_size or 32)
        if shuffle == "batch":
            x = x.shuffle(x.cardinality(), reshuffle_each_iteration=True)

    # The id helpers hold no tensor control flow, so AutoGraph leaves
    # them as they are (its cache of converted functions has called a
    # converted `attach_sample_ids` for `split_sample_ids` late in a
    # long test session).
    split_ids = tf.autograph.experimental.do_not_convert(
        filters.split_sample_ids
    )
    attach_ids = tf.autograph.experimental.do_not_convert(
        filters.attach_sample_ids
    )

    def preprocess(*element):
        inputs, ids = split_ids(element[0])
        out = preprocessor(inputs, *element[1:])
        if ids is None:
            return out
        if not isinstance(out, tuple):
            out = (out,)
        return (attach_ids(out[0], ids), *out[1:])

    x = x.map(preprocess, num_parallel_calls=tf.data.AUTOTUNE)
    return x.prefetch(tf.data.AUTOTUNE), None, None


def with_hub_validation(preprocessor, args):
    """`fit`'s `args` for a keras-hub task, before the filters read them:
    arrays of raw strings as arrays, a validation split taken from them
    (the preprocessor makes a dataset, which Keras cannot split; keras-hub's
    tasks split first too), and the validation data preprocessed."""
    args = dict(args, x=text_as_arrays(args["x"]))
    split = args.get("validation_split")
    if split and args.get("validation_data") is None:
        (x, y, weight), args["validation_data"] = split_validation(
            args["x"], args.get("y"), args.get("sample_weight"), split
        )
        args.update(x=x, y=y, sample_weight=weight, validation_split=0.0)
    data = args.get("validation_data")
    if data is not None:
        data = (
            keras.utils.unpack_x_y_sample_weight(data)
            if isinstance(data, tuple)
            else (data, None, None)
        )
        batch = args.pop("validation_batch_size", None) or args["batch_size"]
        args["validation_data"] = preprocessed(preprocessor, *data, batch)[0]
    return args


def with_hub_training(preprocessor, args):
    """`fit`'s `args` for a keras-hub task, the training data preprocessed
    into batches: arrays are batched and shuffled here, as `shuffle` says,
    where keras-hub's own `fit` keeps their order."""
    arrays = kind(args["x"]) == "arrays"
    x, y, weight = preprocessed(
        preprocessor,
        args["x"],
        args.get("y"),
        args.get("sample_weight"),
        args["batch_size"],
        args.get("shuffle", True),
    )
    args = dict(args, x=x, y=y, sample_weight=weight, batch_size=None)
    if arrays:  # shuffled as batched: not for Keras to ignore
        args["shuffle"] = False
    return args
