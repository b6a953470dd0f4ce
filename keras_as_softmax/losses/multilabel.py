"""Multi-label categorical cross entropy and its AS-Softmax version."""

import keras
from keras import ops

from keras_as_softmax.losses import _common
from keras_as_softmax.losses._base import PerRowLoss

_INF = float("inf")


def _prepare_multilabel(y_true, y_pred):
    y_true = ops.convert_to_tensor(y_true)
    y_pred = ops.convert_to_tensor(y_pred)
    _common.check_same_shape(y_true, y_pred, "multi-hot")
    _common.check_values(
        y_true,
        ops.logical_and(ops.not_equal(y_true, 0), ops.not_equal(y_true, 1)),
        "multi-hot labels (1 for a positive class, 0 for a negative one)",
        "values other than 0 and 1",
    )
    logits = _common.to_logits(y_pred, from_logits=True)
    positive = ops.greater(ops.cast(y_true, logits.dtype), 0.5)
    return logits, positive


def _log1p_sum_exp(x):
    """`log(1 + sum(exp(x)))` over the last axis, as a logsumexp with an
    appended 0: never overflows, and `-inf` entries drop out of both the
    value and the gradient (a row of only `-inf` gives `0.0` exactly)."""
    return ops.logsumexp(
        ops.concatenate([ops.zeros_like(x[..., :1]), x], axis=-1), axis=-1
    )


def _two_sided(logits, negatives, positives):
    """`log(1 + sum_{negatives} exp(o)) + log(1 + sum_{positives} exp(-o))`
    for boolean class masks `negatives` and `positives`.

    Classes outside a mask are replaced by `-inf` before the exponential,
    so their gradient is exactly 0. XLA runs two plain logsumexps faster
    than the single hand-fused pass with a written-out gradient that this
    module used before (README, "Cost of the loss").
    """
    return _log1p_sum_exp(ops.where(negatives, logits, -_INF)) + _log1p_sum_exp(
        ops.where(positives, -logits, -_INF)
    )


@keras.saving.register_keras_serializable(package="keras_as_softmax")
def multilabel_categorical_crossentropy(y_true, y_pred):
    """Per-sample multi-label categorical cross entropy (Su, 2020).

    Formula:

    ```
    loss = log(1 + sum_{i in neg} exp(o_i)) + log(1 + sum_{t in pos} exp(-o_t))
    ```

    Args:
        y_true: multi-hot labels `[..., C]` (1 for positive classes).
        y_pred: logits `[..., C]`; a class is predicted positive where its
            logit is > 0.

    Returns:
        Loss values of shape `[...]`.
    """
    logits, positive = _prepare_multilabel(y_true, y_pred)
    return _two_sided(logits, ops.logical_not(positive), positive)


@keras.saving.register_keras_serializable(package="keras_as_softmax")
def multilabel_as_softmax_cross_entropy(y_true, y_pred, delta=0.05):
    """Per-sample multi-label AS-Softmax cross entropy (eq. 14-18).

    Formula:

    ```
    p    = stop_gradient(softmax(o))
    z_i  = 0 if p_t_min - p_i >= delta          (negative i)
    z_t  = 0 if p_t - p_i_max >= delta          (positive t)
    loss = log(1 + sum_{neg} z_i exp(o_i)) + log(1 + sum_{pos} z_t exp(-o_t))
    ```

    Args:
        y_true: multi-hot labels `[..., C]`.
        y_pred: logits `[..., C]`.
        delta: margin in [0, 1]. Defaults to `0.05` (the paper's Eurlex
            setting; it used 0.35 on WOS).

    Returns:
        Loss values of shape `[...]`; exactly 0.0 for masked rows.
    """
    delta = _common.check_delta(delta)
    logits, positive = _prepare_multilabel(y_true, y_pred)
    o = ops.stop_gradient(logits)
    # The masks compare probabilities: with e = exp(o - max) and
    # p = e / sum(e), `p_a - p_b >= delta` is `e_a - e_b >= delta * sum(e)`.
    # Logits are clipped to +-1e30, so an infinite extreme marks a row
    # without negatives / positives (its e is exp(-inf) == 0).
    max_negative = ops.max(
        ops.where(positive, -_INF, o), axis=-1, keepdims=True
    )
    max_positive = ops.max(
        ops.where(positive, o, -_INF), axis=-1, keepdims=True
    )
    min_positive = -ops.max(
        ops.where(positive, -o, -_INF), axis=-1, keepdims=True
    )
    top = ops.maximum(max_negative, max_positive)
    e = ops.exp(o - top)
    margin = ops.cast(delta, o.dtype) * ops.sum(e, axis=-1, keepdims=True)
    e_max_negative = ops.exp(max_negative - top)
    e_min_positive = ops.exp(min_positive - top)
    has_negative = ops.greater(max_negative, -_INF)
    has_positive = ops.greater(max_positive, -_INF)
    # A negative is dropped once the weakest positive leads it by delta, a
    # positive once it leads the strongest negative by delta. Rounding is
    # monotone, so once the weakest positive leads the strongest negative
    # (the row is masked), every class is dropped and the loss is
    # log(1) + log(1) == 0.0 exactly, with a zero gradient.
    dropped = ops.where(
        positive,
        ops.logical_and(has_negative, e - e_max_negative >= margin),
        ops.logical_and(has_positive, e_min_positive - e >= margin),
    )
    kept = ops.logical_not(dropped)
    return _two_sided(
        logits,
        ops.logical_and(ops.logical_not(positive), kept),
        ops.logical_and(positive, kept),
    )


@keras.saving.register_keras_serializable(package="keras_as_softmax")
class MultiLabelCategoricalCrossentropy(PerRowLoss):
    """Multi-label categorical cross entropy (Su, 2020), the paper's baseline.

    Scores positives above 0 and negatives below 0 with one softmax-like
    loss instead of C independent sigmoids. Stable for logits of any
    magnitude.

    Formula:

    ```
    loss = log(1 + sum_{i in neg} exp(o_i)) + log(1 + sum_{t in pos} exp(-o_t))
    ```

    Args:
        reduction: as in `keras.losses.Loss`. Defaults to
            `"sum_over_batch_size"`.
        name: defaults to `"multilabel_categorical_crossentropy"`.
        dtype: as in `keras.losses.Loss`.

    Returns:
        The reduced loss, or per-row values with `reduction=None`.

    Example:

    >>> import numpy as np
    >>> import keras_as_softmax
    >>> loss = keras_as_softmax.MultiLabelCategoricalCrossentropy(
    ...     reduction=None
    ... )
    >>> y = np.array([[1.0, 0.0, 1.0]])
    >>> [round(float(v), 4) for v in loss(y, np.array([[5.0, -5.0, 5.0]]))]
    [0.0201]

    Reference:
        Su, "Extending softmax and cross entropy to multi-label
        classification", 2020; Lv et al., AS-Softmax, eq. 14.
    """

    def __init__(
        self,
        reduction="sum_over_batch_size",
        name="multilabel_categorical_crossentropy",
        dtype=None,
    ):
        super().__init__(
            multilabel_categorical_crossentropy,
            reduction=reduction,
            name=name,
            dtype=dtype,
        )


@keras.saving.register_keras_serializable(package="keras_as_softmax")
class MultiLabelASSoftmaxLoss(PerRowLoss):
    """Multi-label AS-Softmax loss.

    The multi-label categorical cross entropy in which a negative class is
    dropped once the weakest positive's probability leads it by `delta`, and
    a positive class once it leads the strongest negative by `delta`
    (probabilities from one softmax over all classes). When the weakest
    positive leads the strongest negative by `delta`, the row's loss and
    gradient are exactly 0 (the row is masked). Labels are multi-hot; a
    class is predicted positive where its logit is > 0. Stable for logits of
    any magnitude (every sum of exponentials is a shifted logsumexp).

    Formula:

    ```
    p    = stop_gradient(softmax(o))
    z_i  = 0 if p_t_min - p_i >= delta          (negative i)
    z_t  = 0 if p_t - p_i_max >= delta          (positive t)
    loss = log(1 + sum_{neg} z_i exp(o_i)) + log(1 + sum_{pos} z_t exp(-o_t))
    ```

    Args:
        delta: margin in [0, 1]. Multi-label tasks want small values: the
            paper used 0.05 on Eurlex (127 labels) and 0.35 on WOS.
            Defaults to `0.05`. Stored in a non-trainable `keras.Variable`
            (`loss.delta`).
        reduction: as in `keras.losses.Loss`. Defaults to
            `"sum_over_batch_size"`.
        name: defaults to `"multilabel_as_softmax_loss"`.
        dtype: as in `keras.losses.Loss`.

    Returns:
        The reduced loss, or per-row values with `reduction=None`.

    Example:

    >>> import numpy as np
    >>> import keras_as_softmax
    >>> loss = keras_as_softmax.MultiLabelASSoftmaxLoss(0.05, reduction=None)
    >>> y = np.array([[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    >>> logits = np.array([[5.0, -5.0, 5.0], [0.5, 0.4, -3.0]])
    >>> [round(float(v), 4) for v in loss(y, logits)]
    [0.0, 1.3871]

    Reference:
        Lv et al., "Adaptive Sparse Softmax: An Effective and Efficient
        Softmax Variant" (eq. 14-18).
    """

    def __init__(
        self,
        delta=0.05,
        reduction="sum_over_batch_size",
        name="multilabel_as_softmax_loss",
        dtype=None,
    ):
        super().__init__(
            multilabel_as_softmax_cross_entropy,
            reduction=reduction,
            name=name,
            dtype=dtype,
            delta=_common.delta_variable(delta),
        )
