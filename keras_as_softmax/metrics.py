"""The masked-sample ratio of AS-Softmax as a Keras metric."""

import keras
from keras import ops
from keras.src.backend.common.masking import get_keras_mask

from keras_as_softmax.losses._common import ignore_class_of
from keras_as_softmax.losses._common import rows_rank
from keras_as_softmax.losses._common import valid_rows


def masked_rows(loss, y_true, y_pred, sample_weight=None):
    """Which rows a loss masks, and which rows count.

    A row (a sample, or a token) is *masked* when its loss is exactly 0.0.
    Rows that the loss leaves out of its mean (labelled with the loss's
    `ignore_class`, or hidden by a Keras mask on `y_pred`) and rows whose
    sample weight is 0 are not counted at all, so padding never inflates
    the ratio.

    Args:
        loss: a `keras.losses.Loss` whose `call` returns per-row values,
            such as `keras_as_softmax.ASSoftmaxLoss`.
        y_true: labels, as the loss takes them.
        y_pred: model outputs, as the loss takes them.
        sample_weight: optional weights broadcastable to the rows.

    Returns:
        `(masked, counted)`: bool tensors with one value per row.
    """
    mask = get_keras_mask(y_pred)
    y_true = ops.convert_to_tensor(y_true, dtype=loss.dtype)
    y_pred = ops.convert_to_tensor(y_pred, dtype=loss.dtype)
    values = loss.call(y_true, y_pred)
    counted = ops.ones_like(values, dtype="bool")
    valid = valid_rows(y_true, ops.shape(values), ignore_class_of(loss))
    if valid is not None:
        counted = valid
    if mask is not None:
        counted = ops.logical_and(counted, ops.cast(mask, "bool"))
    values = ops.stop_gradient(values)
    if sample_weight is not None:
        sample_weight = rows_rank(sample_weight, values.shape)
        counted = ops.logical_and(counted, ops.not_equal(sample_weight, 0))
    return ops.logical_and(counted, ops.equal(values, 0.0)), counted


def count_masked_rows(loss, y_true, y_pred, sample_weight=None):
    """Counts the rows a loss masks, over the rows that count.

    See `masked_rows`; returns `(masked, counted)` as float32 scalars.
    """
    masked, counted = masked_rows(loss, y_true, y_pred, sample_weight)
    return (
        ops.sum(ops.cast(masked, "float32")),
        ops.sum(ops.cast(counted, "float32")),
    )


@keras.saving.register_keras_serializable(package="keras_as_softmax")
class MaskedRatio(keras.metrics.Metric):
    """Fraction of counted rows whose AS-Softmax loss is exactly 0.

    The quantity behind the paper's Figure 1 and AS-Speed: the share of
    samples (or non-ignored tokens) that the loss has "masked" because
    their target already leads every other class by `delta`. Give it the
    same loss object you compile with, so that it follows any change to
    `loss.delta` (for instance by `keras_as_softmax.DeltaWarmup`).

    Args:
        loss: the loss whose zeros are counted. Defaults to
            `keras_as_softmax.ASSoftmaxLoss()` (delta 0.3).
        name: defaults to `"masked_ratio"`.
        dtype: the metric's dtype.

    Example:

    >>> import numpy as np
    >>> import keras_as_softmax
    >>> loss = keras_as_softmax.ASSoftmaxLoss(0.3)
    >>> metric = keras_as_softmax.MaskedRatio(loss)
    >>> logits = np.array([[5.0, 0.0], [0.0, 0.1]])
    >>> metric.update_state(np.array([0, 1]), logits)
    >>> float(metric.result())
    0.5

    In `compile`:

    ```python
    loss = keras_as_softmax.ASSoftmaxLoss(delta=0.3)
    model.compile(loss=loss, metrics=[keras_as_softmax.MaskedRatio(loss)])
    ```
    """

    def __init__(self, loss=None, name="masked_ratio", dtype=None):
        super().__init__(name=name, dtype=dtype)
        if loss is None:
            from keras_as_softmax.losses import ASSoftmaxLoss

            loss = ASSoftmaxLoss()
        if not isinstance(loss, keras.losses.Loss):
            raise ValueError(
                "Expected `loss` to be a keras.losses.Loss instance such as "
                f"keras_as_softmax.ASSoftmaxLoss. Received: loss={loss!r}"
            )
        self.loss = loss
        # `[masked, counted]` in one variable: a compiled step passes every
        # variable as a buffer of its own.
        self.counts = self.add_variable(
            shape=(2,), initializer="zeros", name="counts"
        )

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.update_counts(
            *count_masked_rows(self.loss, y_true, y_pred, sample_weight)
        )

    def update_counts(self, masked, counted):
        """Adds rows counted elsewhere (as `keras_as_softmax.ASSpeed` does)."""
        self.counts.assign_add(
            ops.stack(
                [ops.cast(masked, self.dtype), ops.cast(counted, self.dtype)]
            )
        )

    def result(self):
        return ops.divide_no_nan(self.counts[0], self.counts[1])

    def get_config(self):
        return {
            "name": self.name,
            "dtype": self.dtype,
            "loss": keras.saving.serialize_keras_object(self.loss),
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["loss"] = keras.saving.deserialize_keras_object(config["loss"])
        return cls(**config)
