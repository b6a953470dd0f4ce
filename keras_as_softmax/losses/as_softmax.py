"""Adaptive Sparse Softmax (AS-Softmax) cross entropy for multi-class tasks."""

import keras
from keras import ops

from keras_as_softmax import _validation
from keras_as_softmax.losses import _common
from keras_as_softmax.losses._base import PerRowLoss
from keras_as_softmax.losses._base import label_kwargs

# Up to this many classes, the row max and the target logit come from one
# reduction over the logits stacked with their target-only copy: XLA on CPU
# runs every reduction and gather as a kernel of its own, and at small row
# sizes those launches, not the arithmetic, are the cost. Past it, the
# stacked copy would double the memory traffic of the largest pass.
_STACKED_ROW_LIMIT = 256


def _row_max_and_target(y_pred, logits, labels, is_target, from_logits):
    """`(max, target logit)` per row, `[..., 1]` each, as constants for
    autodiff: the loss's gradient is written out, and JAX refuses a custom
    gradient that closes over values it differentiates."""
    if logits.shape[-1] is not None and logits.shape[-1] <= _STACKED_ROW_LIMIT:
        both = ops.max(
            ops.stack(
                [logits, ops.where(is_target, logits, -float("inf"))], -2
            ),
            axis=-1,
        )
        return ops.stop_gradient(both[..., :1]), ops.stop_gradient(
            both[..., 1:]
        )
    # `to_logits` is monotone, so max(to_logits(y)) == to_logits(max(y)):
    # reducing the raw input keeps XLA from materializing the clipped logits.
    top = _common.to_logits(
        ops.max(y_pred, axis=-1, keepdims=True), from_logits
    )
    # A label outside [0, C) has no target logit: -inf, as the stacked
    # reduction gives it (its gather reads class 0, not out of bounds,
    # which a TensorFlow graph would refuse).
    classes = ops.shape(logits)[-1]
    in_range = ops.expand_dims(
        ops.logical_and(labels >= 0, labels < classes), -1
    )
    index = ops.where(in_range, ops.expand_dims(labels, -1), 0)
    target = ops.take_along_axis(logits, index, axis=-1)
    target = ops.where(in_range, target, -float("inf"))
    return ops.stop_gradient(top), ops.stop_gradient(target)


@keras.saving.register_keras_serializable(package="keras_as_softmax")
def as_softmax_cross_entropy(
    y_true,
    y_pred,
    delta=0.3,
    from_logits=True,
    label_mode="int",
    ignore_class=None,
    classes="kept",
):
    """Per-sample AS-Softmax cross entropy.

    Drops, per row, every class whose probability trails the target's by at
    least `delta`, and takes softmax cross entropy over the classes left.
    A row whose target leads every other class by `delta` gets a loss and a
    gradient of exactly 0.0 (it is "masked").

    Formula:

    ```
    p      = softmax(o)
    keep_i = (p_t - p_i < delta) or (i == t)
    loss   = logsumexp(o[keep]) - o_t
    ```

    Args:
        y_true: integer labels `[...]` (or `[..., 1]`), or one-hot labels
            `[..., C]` with `label_mode="categorical"`.
        y_pred: logits `[..., C]` (probabilities if `from_logits=False`).
            Half-precision inputs are computed in float32.
        delta: margin in [0, 1]. `1.0` gives softmax cross entropy, `0.0`
            drops every class less likely than the target. Defaults to `0.3`.
        from_logits: whether `y_pred` holds logits. With `False`, `y_pred`
            must hold probabilities in [0, 1]. Defaults to `True`.
        label_mode: `"int"` or `"categorical"`. Defaults to `"int"`.
        ignore_class: optional int label whose positions get loss 0 and a
            Keras mask that leaves them out of a loss's mean. Defaults to
            `None`.
        classes: `"kept"` (AS-Softmax) takes the cross entropy over the
            classes within the margin; `"all"` takes softmax cross entropy
            over every class in the rows not masked: the same masked rows
            (loss and gradient exactly 0), softmax's gradient elsewhere.
            Defaults to `"kept"`.

    Returns:
        Loss values of shape `[...]`, float32 (float64 for float64 inputs).
        The gradient is written out (`softmax over kept classes - one_hot`),
        so masked rows get an exact 0.0 in every precision; second
        derivatives are not available.

    Example:

    >>> import numpy as np
    >>> import keras_as_softmax
    >>> logits = np.array([[4.0, 0.0, 0.0], [1.0, 0.8, -1.0]])
    >>> values = keras_as_softmax.as_softmax_cross_entropy(
    ...     np.array([0, 0]), logits, delta=0.3
    ... )
    >>> [round(float(v), 4) for v in values]
    [0.0, 0.5981]

    Reference:
        Lv et al., "Adaptive Sparse Softmax: An Effective and Efficient
        Softmax Variant" (eq. 5-7).
    """
    checked = _common.check_delta(delta)
    if classes not in ("kept", "all"):
        raise ValueError(
            f"Expected `classes` 'kept' or 'all'. Received: classes={classes!r}"
        )
    y_pred = ops.convert_to_tensor(y_pred)
    logits, labels, is_target, valid = _common.prepare_multiclass(
        y_true, y_pred, from_logits, label_mode, ignore_class
    )
    top, target = _row_max_and_target(
        y_pred, logits, labels, is_target, from_logits
    )
    delta = ops.cast(checked, logits.dtype)

    @ops.custom_gradient
    def cross_entropy_within_margin(x):
        exps = ops.exp(x - top)
        total = ops.sum(exps, axis=-1, keepdims=True)
        # p_t - p_i < delta  <=>  e_i > e_t - delta * sum(e), e = exp(o - max)
        target_exp = ops.exp(target - top)
        threshold = target_exp - delta * total
        keep = ops.logical_or(ops.greater(exps, threshold), is_target)
        kept_exps = ops.where(keep, exps, 0.0)
        kept = ops.sum(kept_exps, axis=-1, keepdims=True)
        # Only the target kept: exactly 0.0, where `log(e_t) - (o_t - top)`
        # would be a rounding (the target below the max by less than float
        # resolution). `target_exp` is the exp of the same difference as
        # the target's entry of `exps`; a second reduction to read that
        # entry would make XLA write `exps` out.
        # `log(kept) + (top - target)`: with `top + log(kept)` first, a
        # large common offset of the logits would round the log away.
        masked = kept == target_exp
        if classes == "all":
            kept_exps, kept = exps, total
        values = ops.where(masked, 0.0, ops.log(kept) + (top - target))
        # A NaN logit makes the row NaN, as in softmax cross entropy: the
        # comparisons alone would drop it, and TensorFlow's XLA `max`
        # skips NaN; `total` carries it.
        values = ops.squeeze(ops.where(ops.isnan(total), total, values), -1)

        def grad(*args, upstream=None):
            if upstream is None:  # TensorFlow and JAX pass it positionally.
                (upstream,) = args
            softmax_kept = kept_exps / kept
            if classes == "all":
                upstream = ops.where(ops.squeeze(masked, -1), 0.0, upstream)
            return ops.expand_dims(upstream, -1) * (
                softmax_kept - ops.cast(is_target, softmax_kept.dtype)
            )

        return values, grad

    values = _common.check_delta_value(
        cross_entropy_within_margin(logits), checked
    )
    return _common.mask_rows(values, valid)


@keras.saving.register_keras_serializable(package="keras_as_softmax")
class ASSoftmaxLoss(PerRowLoss):
    """Adaptive Sparse Softmax (AS-Softmax) cross entropy.

    A drop-in replacement for
    `keras.losses.SparseCategoricalCrossentropy(from_logits=True)` that stops
    pushing the target probability toward 1 once the target leads every
    other class by a margin `delta`. Per row, the classes whose probability
    trails the target's by at least `delta` are dropped and cross entropy is
    taken over the classes left; when only the target is left, the row's
    loss and gradient are exactly 0 and the row is "masked". Works for
    sentence classification (`[batch]` labels, `[batch, C]` logits) and
    token classification (`[batch, seq]` labels, `[batch, seq, C]` logits,
    with `ignore_class` for padding and sub-word pieces).

    `from_logits` defaults to `True`, unlike Keras's cross entropies: the
    method is defined on logits, and a model ending in a softmax would waste
    precision. `delta` lives in a non-trainable `keras.Variable`
    (`loss.delta`), so callbacks such as
    `keras_as_softmax.DeltaWarmup` can change it during training without
    recompiling on TensorFlow and PyTorch (JAX bakes it into the compiled
    steps, and `DeltaWarmup` traces the train and test steps again when it
    changes it).

    Formula:

    ```
    p      = softmax(o)
    keep_i = (p_t - p_i < delta) or (i == t)
    loss   = logsumexp(o[keep]) - o_t
    ```

    Args:
        delta: margin in [0, 1]. `1.0` is softmax cross entropy; smaller
            values mask more rows. Defaults to `0.3`, the paper's advice.
            Stored in a non-trainable `keras.Variable` of the loss's own
            (`loss.delta`); a variable given here gives its value.
        from_logits: whether `y_pred` holds logits; with `False` it must
            hold probabilities in [0, 1]. Defaults to `True`.
        label_mode: `"int"` for integer labels (`[...]`), `"categorical"`
            for one-hot labels (`[..., C]`, hard labels only). Defaults to
            `"int"`.
        ignore_class: optional int label (e.g. `-100` or `-1`) whose
            positions get loss 0, are left out of the mean, and are never
            counted as masked rows. Defaults to `None`.
        classes: `"kept"` (AS-Softmax) takes the cross entropy over the
            classes within the margin. `"all"` takes softmax cross entropy
            over every class in the rows that are not masked: the same
            rows are masked (loss and gradient exactly 0, so the filters
            skip them alike), and the others train as with
            `SparseCategoricalCrossentropy`. Defaults to `"kept"`.
        reduction: as in `keras.losses.Loss`. Defaults to
            `"sum_over_batch_size"`; `None` returns per-row values (0 at
            ignored positions). Sample weights of shape `[batch]` weight
            every token of a sample. An empty batch gives a loss of 0.
        name: defaults to `"as_softmax_loss"`.
        dtype: as in `keras.losses.Loss`. The math always runs in at least
            float32.

    Returns:
        The reduced loss, or per-row values with `reduction=None`. Eager
        calls check the labels (integers in range, or one-hot rows), with
        `from_logits=False` the probabilities, and the value of
        `loss.delta` (assigned outside [0, 1]), and raise a `ValueError`.
        A compiled step cannot check them without reading a device value
        back to the host: there a label outside `[0, C)`, or a row that is
        not one-hot, gives its row an infinite loss (`loss: inf` in
        `fit`'s logs), and a `delta` outside [0, 1] a NaN loss. To find
        such labels, `compile(..., run_eagerly=True)` and fit once.

    Example:

    >>> import numpy as np
    >>> import keras_as_softmax
    >>> loss = keras_as_softmax.ASSoftmaxLoss(delta=0.3, reduction=None)
    >>> logits = np.array([[4.0, 0.0, 0.0], [1.0, 0.8, -1.0]])
    >>> [round(float(v), 4) for v in loss(np.array([0, 0]), logits)]
    [0.0, 0.5981]

    Reference:
        Lv et al., "Adaptive Sparse Softmax: An Effective and Efficient
        Softmax Variant", ICLR 2023 submission / 2025 (eq. 5-7).
    """

    def __init__(
        self,
        delta=0.3,
        from_logits=True,
        label_mode="int",
        ignore_class=None,
        classes="kept",
        reduction="sum_over_batch_size",
        name="as_softmax_loss",
        dtype=None,
    ):
        if classes not in ("kept", "all"):
            raise ValueError(
                "Expected `classes` 'kept' or 'all'. "
                f"Received: classes={classes!r}"
            )
        super().__init__(
            as_softmax_cross_entropy,
            reduction=reduction,
            name=name,
            dtype=dtype,
            delta=_common.delta_variable(delta),
            from_logits=_validation.check_bool(from_logits, "from_logits"),
            classes=classes,
            **label_kwargs(label_mode, ignore_class),
        )
