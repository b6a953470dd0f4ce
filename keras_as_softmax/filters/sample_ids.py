"""Sample ids for the filters that remember samples: attach them to the
inputs, and split them off again."""

import keras

INPUTS_KEY = "inputs"
SAMPLE_ID_KEY = "sample_id"


def text_as_arrays(x):
    """`x` with each list (or tuple) of strings, the raw text a keras-hub
    task takes, as one NumPy array, also under a dict (sample ids): Keras's
    structure utilities would take each string for an array."""

    def is_text(v):
        return (
            isinstance(v, (list, tuple))
            and len(v) > 0
            and all(isinstance(s, (str, bytes)) for s in v)
        )

    if is_text(x):
        import numpy as np

        return np.array(x)
    if isinstance(x, dict):
        return {k: text_as_arrays(v) for k, v in x.items()}
    return x


def with_sample_ids(x, ids=None):
    """Attaches sample ids to inputs `x` (arrays, a tuple or a dict; raw
    text as a list of strings).

    Returns `{"inputs": x, "sample_id": ids}`, the form that
    `ASSpeed` with `SkipMaskedLastSeen` trains on; `ids` default to
    `0..n-1`. Prediction and evaluation take the plain `x` as well.
    """
    import numpy as np

    x = text_as_arrays(x)
    first = keras.tree.flatten(x)[0]
    n = len(first)
    if ids is None:
        return attach_sample_ids(x, np.arange(n, dtype="int32"))
    ids = np.asarray(ids)
    if ids.shape != (n,) or ids.dtype.kind not in "iu":
        raise ValueError(
            f"Expected `ids` to be {n} integers, one per sample (shape "
            f"({n},)). Received: ids of shape {ids.shape}, dtype {ids.dtype}"
        )
    if n and (ids.min() < 0 or ids.max() > np.iinfo("int32").max):
        raise ValueError(
            "Expected sample ids in [0, 2**31 - 1]. Received ids in "
            f"[{ids.min()}, {ids.max()}]"
        )
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

    if not isinstance(dataset.element_spec, tuple):
        raise ValueError(
            "Expected a dataset of `(x, y)` or `(x, y, sample_weight)` "
            f"elements. Received elements: {dataset.element_spec}"
        )

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
