"""Multi-label categorical cross entropy and its AS-Softmax version."""

import keras
from keras import ops

from keras_as_softmax.losses import _common


def _prepare_multilabel(y_true, y_pred):
    y_true = ops.convert_to_tensor(y_true)
    y_pred = ops.convert_to_tensor(y_pred)
    _common.check_same_shape(y_true, y_pred, "multi-hot")
    logits = _common.to_logits(y_pred, from_logits=True)
    positive = ops.greater(ops.cast(y_true, logits.dtype), 0.5)
    return logits, positive


def _per_side(positive, sides):
    """Picks, per class, the negative side's (`sides[..., :1]`) or the
    positive side's (`sides[..., 1:]`) row value."""
    return ops.where(positive, sides[..., 1:], sides[..., :1])


def _split_sum(positive, x):
    """Row sums of `x` over the negatives and over the positives, `[..., 2]`,
    in one reduction (XLA runs each reduction as a kernel of its own, which
    dominates the cost at small sizes)."""
    return ops.sum(
        ops.stack([ops.where(positive, 0.0, x), ops.where(positive, x, 0.0)], -2),
        axis=-1,
    )


def _two_sided_log1p_sum_exp(logits, positive, keep, shifts):
    """`log(1 + sum_{neg, keep} exp(o)) + log(1 + sum_{pos, keep} exp(-o))`.

    Each side is a logsumexp with an appended 0, shifted by a constant:
    `shifts[..., 0]` for the negatives' `o`, `shifts[..., 1]` for the
    positives' `-o`, each >= 0 and >= every kept term of its side. A side
    with nothing kept and shift 0 is `log(1) == 0.0` exactly. Excluded
    entries are replaced before the exponential, so neither the value nor
    the gradient can meet `inf` or `0 * inf`. The gradient is written out
    (`+-exp(z - shift) / total` per kept class), which keeps the compiled
    loss to a few fused passes.
    """
    shift = _per_side(positive, shifts)

    @ops.custom_gradient
    def two_sided(x):
        z = ops.where(positive, -x, x)
        exps = ops.where(keep, ops.exp(ops.where(keep, z, shift) - shift), 0.0)
        totals = ops.exp(-shifts) + _split_sum(positive, exps)
        values = ops.sum(shifts + ops.log(totals), axis=-1)

        def grad(*args, upstream=None):
            if upstream is None:  # TensorFlow and JAX pass it positionally.
                (upstream,) = args
            signed_totals = totals * ops.convert_to_tensor([1.0, -1.0], totals.dtype)
            return ops.expand_dims(upstream, -1) * (
                exps / _per_side(positive, signed_totals)
            )

        return values, grad

    return two_sided(logits)


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
    o = ops.stop_gradient(logits)
    # max(0, largest negative), max(0, -smallest positive)
    shifts = ops.max(
        ops.stack([ops.where(positive, 0.0, o), ops.where(positive, -o, 0.0)], -2),
        axis=-1,
    )
    return _two_sided_log1p_sum_exp(logits, positive, True, shifts)


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
    # Two row reductions give everything the masks need: three maxima in
    # one, then the softmax sum. With e = exp(o - max) and p = e / sum(e),
    # `p_a - p_b >= delta` is `e_a - e_b >= delta * sum(e)`. Logits are
    # clipped to +-1e30, so an infinite extreme marks a row without
    # negatives / positives.
    inf = float("inf")
    maxima = ops.max(
        ops.stack(
            [
                ops.where(positive, -inf, o),  # largest negative
                ops.where(positive, -o, -inf),  # minus the smallest positive
                ops.where(positive, o, -inf),  # largest positive
            ],
            axis=-2,
        ),
        axis=-1,
    )
    # extremes[..., 0] = largest negative, [..., 1] = smallest positive.
    extremes = maxima[..., :2] * ops.convert_to_tensor([1.0, -1.0], o.dtype)
    present = ops.less(ops.abs(extremes), inf)
    top = ops.maximum(maxima[..., :1], maxima[..., 2:])
    e = ops.exp(o - top)
    margin = ops.cast(delta, o.dtype) * ops.sum(e, axis=-1, keepdims=True)
    e_max_neg, e_min_pos = ops.split(
        ops.where(present, ops.exp(ops.where(present, extremes, top) - top), 0.0),
        2,
        axis=-1,
    )
    has_neg, has_pos = ops.split(present, 2, axis=-1)
    # A negative is dropped once the weakest positive leads it by delta, a
    # positive once it leads the strongest negative by delta.
    dropped = ops.where(
        positive,
        ops.logical_and(has_neg, e - e_max_neg >= margin),
        ops.logical_and(has_pos, e_min_pos - e >= margin),
    )
    # The largest negative (smallest positive) is the last of its kind to be
    # dropped, and by the same comparison as the row's: when it goes, all go,
    # which is exactly the masked row. Both shifts then become 0, so the loss
    # is log(1) + log(1) == 0.0 exactly.
    masked = ops.logical_and(
        ops.logical_and(has_pos, has_neg), e_min_pos - e_max_neg >= margin
    )
    shifts = ops.where(
        ops.logical_and(present, ops.logical_not(masked)),
        ops.maximum(maxima[..., :2], 0.0),
        0.0,
    )
    return _two_sided_log1p_sum_exp(
        logits, positive, ops.logical_not(dropped), shifts
    )


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
