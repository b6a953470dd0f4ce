"""Sample ids for the filters that remember samples: attach them to the
inputs, and split them off again."""

import keras

INPUTS_KEY = "inputs"
SAMPLE_ID_KEY = "sample_id"


def with_sample_ids(x, ids=None):
    """Attaches sample ids to inputs `x` (arrays, a tuple or a dict).

    Returns `{"inputs": x, "sample_id": ids}`, the form that
    `ASSpeed` with `SkipMaskedLastSeen` trains on; `ids` default to
    `0..n-1`. Prediction and evaluation take the plain `x` as well.
    """
    import numpy as np

    first = keras.tree.flatten(x)[0]
    n = len(first)
    ids = np.arange(n, dtype="int32") if ids is None else np.asarray(ids)
    return attach_sample_ids(x, ids.astype("int32"))


def index_dataset(dataset):
    """Attaches each element's position to an *unbatched* `tf.data.Dataset`
    of `(x, y)` or `(x, y, sample_weight)` elements.

    Call it before `shuffle` and `batch`, so that a sample keeps its id
    across epochs:

    ```python
    data = keras_as_softmax.filters.index_dataset(
        tf.data.Dataset.from_tensor_slices((x, y))
    ).shuffle(n).batch(32)
    ```
    """

    import tensorflow as tf  # tf.data runs TensorFlow ops on every backend

    def attach(index, element):
        x, *rest = element
        return (attach_sample_ids(x, tf.cast(index, tf.int32)), *rest)

    return dataset.enumerate().map(attach)


def attach_sample_ids(x, ids):
    """`{"inputs": x, "sample_id": ids}` for tensors of one batch."""
    return {INPUTS_KEY: x, SAMPLE_ID_KEY: ids}


def split_sample_ids(x):
    """`(inputs, ids)` from inputs made by `with_sample_ids`, else
    `(x, None)`."""
    if isinstance(x, dict) and set(x) == {INPUTS_KEY, SAMPLE_ID_KEY}:
        return x[INPUTS_KEY], x[SAMPLE_ID_KEY]
    return x, None
