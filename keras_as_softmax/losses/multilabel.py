"""Multi-label categorical cross entropy and its AS-Softmax version."""

import keras
from keras import ops

from keras_as_softmax.losses import _common


def _log1p_sum_exp(x, include):
    """`log(1 + sum(exp(x[include])))` along the last axis, for any magnitude.

    The logsumexp of `x[include]` with an appended 0, shifted by its max.
    Excluded entries are replaced *before* the exponential (a double `where`)
    so that neither the value nor the gradient can meet `inf` or `0 * inf`.
    An empty `include` gives exactly 0.0.
    """
    top = ops.max(ops.where(include, x, 0.0), axis=-1, keepdims=True)
    top = ops.stop_gradient(ops.maximum(top, 0.0))
    exps = ops.where(include, ops.exp(ops.where(include, x, top) - top), 0.0)
    total = ops.exp(-top) + ops.sum(exps, axis=-1, keepdims=True)
    return ops.squeeze(top + ops.log(total), axis=-1)


def _prepare_multilabel(y_true, y_pred):
    y_true = ops.convert_to_tensor(y_true)
    y_pred = ops.convert_to_tensor(y_pred)
    _common.check_same_shape(y_true, y_pred, "multi-hot")
    logits = _common.to_logits(y_pred, from_logits=True)
    positive = ops.greater(ops.cast(y_true, logits.dtype), 0.5)
    return logits, positive


def _multilabel_terms(logits, positive, keep_neg, keep_pos):
    negative = ops.logical_not(positive)
    return _log1p_sum_exp(
        logits, ops.logical_and(negative, keep_neg)
    ) + _log1p_sum_exp(-logits, ops.logical_and(positive, keep_pos))


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
    return _multilabel_terms(logits, positive, True, True)


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
    negative = ops.logical_not(positive)
    o = ops.stop_gradient(logits)
    # Four row reductions give everything the masks need. With
    # e = exp(o - max) and p = e / sum(e), `p_a - p_b >= delta` is
    # `e_a - e_b >= delta * sum(e)`. Logits are clipped to +-1e30, so an
    # infinite min / max marks a row without positives / negatives.
    top = ops.max(o, axis=-1, keepdims=True)
    margin = ops.cast(delta, o.dtype) * ops.sum(ops.exp(o - top), axis=-1, keepdims=True)
    min_pos = ops.min(ops.where(positive, o, float("inf")), axis=-1, keepdims=True)
    max_neg = ops.max(ops.where(negative, o, -float("inf")), axis=-1, keepdims=True)
    has_pos = ops.less(min_pos, float("inf"))
    has_neg = ops.greater(max_neg, -float("inf"))
    e_min_pos = ops.exp(ops.where(has_pos, min_pos, top) - top)
    e_max_neg = ops.exp(max_neg - top)
    e = ops.exp(o - top)
    keep_neg = ops.logical_and(
        negative,
        ops.logical_not(ops.logical_and(has_pos, e_min_pos - e >= margin)),
    )
    keep_pos = ops.logical_and(
        positive,
        ops.logical_not(ops.logical_and(has_neg, e - e_max_neg >= margin)),
    )
    # The largest negative (smallest positive) is the last of its kind to be
    # dropped, so it is the shift over the kept ones; when it is dropped, all
    # are, which is exactly the masked row.
    masked = ops.logical_and(
        ops.logical_and(has_pos, has_neg), e_min_pos - e_max_neg >= margin
    )
    neg_empty = ops.logical_or(ops.logical_not(has_neg), masked)
    pos_empty = ops.logical_or(ops.logical_not(has_pos), masked)
    neg_shift = ops.where(neg_empty, 0.0, ops.maximum(max_neg, 0.0))
    pos_shift = ops.where(pos_empty, 0.0, ops.maximum(-min_pos, 0.0))
    return _log1p_sum_exp_shifted(
        logits, keep_neg, neg_shift, neg_empty
    ) + _log1p_sum_exp_shifted(-logits, keep_pos, pos_shift, pos_empty)


def _log1p_sum_exp_shifted(x, include, top, empty):
    """`log(1 + sum(exp(x[include])))` given a shift `top` >= 0 and >= every
    included `x`; 0.0 exactly where `empty`."""
    exps = ops.where(include, ops.exp(ops.where(include, x, top) - top), 0.0)
    total = ops.exp(-top) + ops.sum(exps, axis=-1, keepdims=True)
    return ops.squeeze(ops.where(empty, 0.0, top + ops.log(total)), axis=-1)


class _MultiLabelLoss(keras.losses.Loss):
    def get_config(self):
        config = super().get_config()
        config["dtype"] = self._dtype_policy.name
        return config


@keras.saving.register_keras_serializable(package="keras_as_softmax")
class MultiLabelCategoricalCrossentropy(_MultiLabelLoss):
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
    >>> loss = keras_as_softmax.MultiLabelCategoricalCrossentropy(reduction=None)
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
        super().__init__(name=name, reduction=reduction, dtype=dtype)

    def call(self, y_true, y_pred):
        return multilabel_categorical_crossentropy(y_true, y_pred)


@keras.saving.register_keras_serializable(package="keras_as_softmax")
class MultiLabelASSoftmaxLoss(_MultiLabelLoss):
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
        super().__init__(name=name, reduction=reduction, dtype=dtype)
        self.delta = _common.delta_variable(delta)

    def call(self, y_true, y_pred):
        return multilabel_as_softmax_cross_entropy(y_true, y_pred, self.delta)

    def get_config(self):
        config = super().get_config()
        config["delta"] = float(ops.convert_to_numpy(self.delta))
        return config
