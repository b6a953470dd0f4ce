"""Multi-label categorical cross entropy and its AS-Softmax version."""

import keras
from keras import ops

from keras_as_softmax.losses import _common
from keras_as_softmax.losses._base import PerRowLoss

_INF = float("inf")


def _prepare_multilabel(y_true, y_pred):
    y_true = ops.convert_to_tensor(y_true)
    y_pred = ops.convert_to_tensor(y_pred)
    _common.check_has_classes(y_pred)
    _common.check_same_shape(y_true, y_pred, "multi-hot")
    _common.check_zero_one(
        y_true,
        "multi-hot labels (1 for a positive class, 0 for a negative one)",
    )
    logits = _common.to_logits(y_pred, from_logits=True)
    y_true = ops.cast(y_true, logits.dtype)
    # Labels other than 0 and 1 (`y * y != y`, NaN too), which a compiled
    # step cannot refuse: their rows' loss is made infinite (`_sides`).
    unlabelled = ops.not_equal(y_true * y_true, y_true)
    return logits, ops.greater(y_true, 0.5), unlabelled


# Stands in for -inf in the per-side copies of the logits: below every
# clipped logit (+-1e30) and finite, so that arithmetic on it never meets
# `inf - inf`; `exp(-_EXCLUDED - shift)` is 0.
_EXCLUDED = 3e38


def _sides(logits, positive, unlabelled):
    """The negatives' logits and the positives' negated logits, `[..., C]`
    each, with `-_EXCLUDED` for the classes of the other side, and
    `+_EXCLUDED` among the positives for a label other than 0 or 1
    (`unlabelled`): the positives' row max, which both losses take, then
    marks the row (`_inf_unless_multi_hot`) without a pass of its own.

    These two selects are the only `[..., C]` temporaries of the forward
    pass: every row reduction below reads one of them (or the raw logits)
    and keeps the rest of its arithmetic inside its own kernel (XLA on CPU
    fuses arithmetic into a reduction, but not selects or comparisons).
    """
    o = ops.stop_gradient(logits)
    negatives = ops.where(positive, -_EXCLUDED, o)
    positives = ops.where(
        unlabelled, _EXCLUDED, ops.where(positive, -o, -_EXCLUDED)
    )
    return negatives, positives


def _inf_unless_multi_hot(values, max_positive):
    """`values` `[...]`, `inf` in the rows whose labels are not all 0 or 1,
    marked by `_sides` in their positives' row max `max_positive`
    `[..., 1]`: as a one-hot row that is not one
    (`_common.inf_without_target`), never a silent guess at what a soft
    label meant. The row's sums stay finite, so its gradient is 0, not
    NaN. A NaN `max_positive` (a NaN logit) leaves the row NaN.
    """
    marked = ops.squeeze(max_positive, -1) >= _EXCLUDED
    return ops.where(marked, _INF, values)


def _log1p_sum_exp(shift, total):
    """`log(1 + sum(exp(x)))` from `total = sum(exp(x - shift))` and its
    shift `shift >= max(x, 0)`: a logsumexp with an appended 0, without
    materializing the appended column. Never overflows; `0.0` exactly
    when `shift == 0` and `total == 0`."""
    return shift + ops.log(ops.exp(-shift) + total)


def _row_max(x):
    return ops.max(x, axis=-1, keepdims=True)


def _row_sum(x):
    return ops.sum(x, axis=-1, keepdims=True)


def _two_sided(
    logits, lse_negative, lse_positive, keep_negative, keep_positive
):
    """`lse_negative + lse_positive` per row (both `[..., 1]`, constants),
    with the gradient with respect to `logits` written out: the softmax of
    each side (with its appended 0) over the classes it keeps, with the
    sign of its exponent, `exp(o - lse_negative)` on kept negatives and
    `-exp(-o - lse_positive)` on kept positives, and 0 elsewhere.

    `keep_negative` and `keep_positive` are boolean `[..., C]` masks. XLA
    fuses the gradient into one pass over the logits.
    """

    @ops.custom_gradient
    def two_sided(x):
        values = ops.squeeze(lse_negative + lse_positive, axis=-1)

        def grad(*args, upstream=None):
            if upstream is None:  # TensorFlow and JAX pass it positionally.
                (upstream,) = args
            upstream = ops.expand_dims(upstream, -1)
            return ops.where(
                keep_positive,
                -upstream * ops.exp(-x - lse_positive),
                ops.where(
                    keep_negative, upstream * ops.exp(x - lse_negative), 0.0
                ),
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
        Loss values of shape `[...]`; `inf` for a row whose labels are not
        all 0 or 1, where a compiled call cannot raise (an eager one does).
    """
    logits, positive, unlabelled = _prepare_multilabel(y_true, y_pred)
    negatives, positives = _sides(logits, positive, unlabelled)
    max_positive = _row_max(positives)
    # max(0, largest o) over the negatives, max(0, largest -o) over the
    # positives: the shifts of the two logsumexps with an appended 0.
    shift_negative = ops.relu(_row_max(negatives))
    shift_positive = ops.relu(max_positive)
    values = _two_sided(
        logits,
        _log1p_sum_exp(
            shift_negative, _row_sum(ops.exp(negatives - shift_negative))
        ),
        _log1p_sum_exp(
            shift_positive, _row_sum(ops.exp(positives - shift_positive))
        ),
        ops.logical_not(positive),
        positive,
    )
    return _inf_unless_multi_hot(values, max_positive)


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
        Loss values of shape `[...]`; exactly 0.0 for masked rows; `inf`
        for a row whose labels are not all 0 or 1, where a compiled call
        cannot raise (an eager one does).
    """
    delta = _common.check_delta(delta)
    logits, positive, unlabelled = _prepare_multilabel(y_true, y_pred)
    negatives, positives = _sides(logits, positive, unlabelled)
    # The extremes; a side without classes gives -_EXCLUDED, made -inf.
    max_negative = _row_max(negatives)
    max_positive = _row_max(positives)
    min_positive = -max_positive
    has_negative = max_negative > -_EXCLUDED
    has_positive = min_positive < _EXCLUDED
    max_negative = ops.where(has_negative, max_negative, -_INF)
    min_positive = ops.where(has_positive, min_positive, _INF)
    # Clipping is monotone: the largest clipped logit is the clipped max.
    x = ops.stop_gradient(ops.cast(ops.convert_to_tensor(y_pred), logits.dtype))
    top = _common.to_logits(_row_max(x), True)
    # The masks compare probabilities: with e = exp(o - top) and
    # p = e / sum(e), `p_a - p_b >= delta` is `e_a - e_b >= margin`.
    # min(x - top, -1e-45) is o - top for the clipped logits o (up to
    # -1e-45, whose exp is 1), except below -1e30, where exp gives 0
    # instead of 1: only rows whose every logit is clipped from below can
    # tell, and there every e is 1. (-1e-45, not 0: XLA would share a
    # [..., C] zero with the gradient and write it out. The cast undoes
    # the float32 result of Keras's `minimum` on torch.)
    total = _row_sum(ops.exp(ops.cast(ops.minimum(x - top, -1e-45), x.dtype)))
    total = ops.where(
        top > -_common._LOGIT_LIMIT, total, ops.cast(ops.shape(x)[-1], x.dtype)
    )
    margin = ops.cast(delta, logits.dtype) * total
    e_max_negative = ops.exp(max_negative - top)
    e_min_positive = ops.where(has_positive, ops.exp(min_positive - top), 0.0)
    # The weakest positive leads the strongest negative by delta: every
    # class is dropped (the row is masked, its loss is exactly 0).
    masked = ops.logical_and(
        ops.logical_and(has_negative, has_positive),
        e_min_positive - e_max_negative >= margin,
    )
    # The masks as thresholds on the logits, measured from the strongest
    # negative and the weakest positive (not from `top + log(...)`, which
    # rounds away at large magnitudes): a negative is kept while
    # `e > e_min_positive - margin`, i.e. `o - max_negative > lower`; a
    # positive while `e < e_max_negative + margin`, i.e.
    # `min_positive - o > upper`.
    floor = e_min_positive - margin
    lower = ops.where(
        ops.logical_and(has_positive, floor > 0.0),
        (top - max_negative) + ops.log(ops.relu(floor)),
        -_INF,
    )
    upper = ops.where(
        has_negative,
        (min_positive - top) - ops.log(e_max_negative + margin),
        -_INF,
    )
    lower = ops.where(masked, _INF, lower)
    upper = ops.where(masked, _INF, upper)
    # Dropping takes the smallest negatives and the largest positives
    # first, so a side keeps something iff it keeps its strongest class.
    keeps_negative = lower < 0.0
    keeps_positive = upper < 0.0
    # Finite references (a side without classes keeps nothing anyway).
    max_negative = ops.where(has_negative, max_negative, 0.0)
    min_positive = ops.where(has_positive, min_positive, 0.0)
    shift_negative = ops.relu(max_negative)
    shift_positive = ops.relu(-min_positive)
    # The kept sums, with the keep masks as arithmetic, 1 where d > 0, else
    # 0: `max(sign(d), -0.0)`, and `(sign(d) + |sign(d)|) / 2` for the
    # other side. XLA would share one [..., C] constant 0 between the two
    # reductions and the gradient, and write it out.
    crossed = ops.sign(negatives - max_negative - lower)
    sum_negative = 0.5 * _row_sum(
        ops.exp(negatives - shift_negative) * (crossed + ops.abs(crossed))
    )
    sum_positive = _row_sum(
        ops.exp(positives - shift_positive)
        * ops.maximum(ops.sign(positives + min_positive - upper), -0.0)
    )
    lse_negative = ops.where(
        keeps_negative, _log1p_sum_exp(shift_negative, sum_negative), 0.0
    )
    lse_positive = ops.where(
        keeps_positive, _log1p_sum_exp(shift_positive, sum_positive), 0.0
    )
    # A NaN logit makes `top` NaN, or `total` where the row max skips NaN
    # (TensorFlow's XLA): carry it into the loss, which the masks alone
    # would hide (every comparison with NaN is false).
    lse_negative = lse_negative + 0.0 * (top + total)
    values = _two_sided(
        logits,
        ops.stop_gradient(lse_negative),
        ops.stop_gradient(lse_positive),
        # The same tests, written with negated thresholds: XLA would
        # otherwise write out the broadcast thresholds the sums also read.
        ops.logical_and(
            ops.logical_not(positive),
            ops.negative(logits + (-max_negative)) < -lower,
        ),
        ops.logical_and(positive, logits + (-min_positive) < -upper),
    )
    return _common.check_delta_value(
        _inf_unless_multi_hot(values, max_positive), delta
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
        The reduced loss, or per-row values with `reduction=None`. Eager
        calls check that the labels are 0 or 1, and raise a `ValueError`.
        A compiled step cannot check them without reading a device value
        back to the host: there a row with a label other than 0 or 1 (a
        soft label, a -1 for padding) gets an infinite loss (`loss: inf` in
        `fit`'s logs). To find such labels,
        `compile(..., run_eagerly=True)` and fit once.

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
            of the loss's own (`loss.delta`); a variable given here gives
            its value.
        reduction: as in `keras.losses.Loss`. Defaults to
            `"sum_over_batch_size"`.
        name: defaults to `"multilabel_as_softmax_loss"`.
        dtype: as in `keras.losses.Loss`.

    Returns:
        The reduced loss, or per-row values with `reduction=None`. Eager
        calls check that the labels are 0 or 1, and the value of
        `loss.delta` (assigned outside [0, 1]), and raise a `ValueError`.
        A compiled step cannot check them without reading a device value
        back to the host: there a row with a label other than 0 or 1 (a
        soft label, a -1 for padding) gets an infinite loss (`loss: inf` in
        `fit`'s logs), and a `delta` outside [0, 1] a NaN loss. To find
        such labels, `compile(..., run_eagerly=True)` and fit once.

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
