"""Shared pieces of the losses: input checks, label handling, row masks.

Everything here is written with `keras.ops` so that it runs on every backend,
eagerly and under XLA: fixed shapes, `where` instead of boolean indexing, no
host round trips except for checks on concrete (eager) values.
"""

import weakref

import keras
import numpy as np
from keras import ops
from keras.src.backend.common.masking import set_keras_mask
from keras.src.backend.common.symbolic_scope import in_symbolic_scope

from keras_as_softmax import _validation

LABEL_MODES = ("int", "categorical")

# Logits are clipped to this magnitude so that +-inf (masked vocabulary
# entries, overflowed float16 activations) never turn into NaN. Inside the
# range the clip is the identity, so finite logits are untouched.
_LOGIT_LIMIT = 1e30

# Largest integer label that a float dtype represents exactly: labels travel
# through `keras.losses.Loss.__call__`, which casts them to the loss dtype.
_EXACT_INT_LIMIT = {"float16": 2048, "bfloat16": 256}


def compute_dtype(x):
    """float32 for half-precision inputs, else the input's own float dtype."""
    dtype = keras.backend.standardize_dtype(x.dtype)
    return dtype if dtype in ("float32", "float64") else "float32"


def is_concrete(x):
    """True when `x` holds values (eager), False while tracing a graph or
    inferring shapes (Keras's symbolic scope, where PyTorch's placeholders
    are tensors of ones)."""
    if isinstance(x, np.ndarray):
        return True
    if in_symbolic_scope():
        return False
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.executing_eagerly()
    if backend == "jax":
        import jax

        return not isinstance(x, jax.core.Tracer)
    if backend == "torch":
        import torch

        return not torch.compiler.is_compiling()
    return False


def check_delta(delta):
    """Checks a margin in [0, 1]: a number, or a scalar tensor, whose value
    is checked where it holds one; a `keras.Variable` (checked when made,
    and where a loss reads it: `check_delta_value`) passes through
    unread."""
    if isinstance(delta, keras.Variable) or ops.is_tensor(delta):
        if len(delta.shape):
            raise ValueError(
                "Expected `delta` to be a scalar. Received: "
                f"delta.shape={tuple(delta.shape)}"
            )
        if not isinstance(delta, keras.Variable) and is_concrete(delta):
            _validation.check_fraction(ops.convert_to_numpy(delta), "delta")
        return delta
    return _validation.check_fraction(delta, "delta")


def check_delta_value(values, delta):
    """The loss `values`, once `delta` is known to lie in [0, 1]: a tensor
    or a loss's variable, which may have been assigned since, would mask
    every row (a loss of 0) or none, with nothing to tell. Refused
    eagerly; in a compiled step, which cannot raise, the values are NaN."""
    if not (isinstance(delta, keras.Variable) or ops.is_tensor(delta)):
        return values  # a number, checked by `check_delta`
    delta = ops.convert_to_tensor(delta)
    if is_concrete(values):
        _validation.check_fraction(ops.convert_to_numpy(delta), "delta")
        return values
    fits = ops.logical_and(
        ops.greater_equal(delta, 0), ops.less_equal(delta, 1)
    )
    return ops.where(fits, values, float("nan"))


def delta_variable(delta):
    """The non-trainable float32 `keras.Variable` that holds a loss's delta.

    Callbacks (`DeltaWarmup`) assign it during training, without
    recompiling on TensorFlow and PyTorch; a compiled JAX step holds the
    value it was traced with.
    A `keras.Variable` or a tensor that holds a value is checked by it; the
    loss's variable takes a variable's value, not the variable itself (on
    every backend alike: assigning one leaves the other as it is).
    """
    if isinstance(delta, keras.Variable):
        delta = delta_value(check_delta(delta))  # a scalar's
    return keras.Variable(
        check_delta(delta), dtype="float32", trainable=False, name="delta"
    )


# The chosen value of each delta variable that a warm-up holds at another,
# by the variable's id: a loss's config, and so a `.keras` file written
# during the warm-up, keeps the chosen delta.
_HELD = {}


def delta_value(variable):
    """A delta variable's value as a Python float, read on the host (also
    a `MirroredVariable`'s, on TensorFlow)."""
    value = variable.value
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        value = tf.convert_to_tensor(value)
    return float(ops.stop_gradient(value))  # a torch one's, detached


def hold_delta(variable, value):
    """Assigns `value` to a delta variable until `release_delta`, keeping
    its value until then as the chosen one (`chosen_delta`); True."""
    key = id(variable)
    if key not in _HELD:
        chosen = delta_value(variable)
        _HELD[key] = (chosen, weakref.finalize(variable, _HELD.pop, key, None))
    variable.assign(value)
    return True


def release_delta(variable):
    """Assigns a held delta variable its chosen value again; whether it was
    held."""
    held = _HELD.pop(id(variable), None)
    if held is not None:
        chosen, finalizer = held
        finalizer.detach()
        variable.assign(chosen)
    return held is not None


def chosen_delta(variable):
    """A delta variable's value, or its chosen one while a warm-up holds
    it."""
    held = _HELD.get(id(variable))
    return held[0] if held else checked_delta(variable)


def checked_delta(variable):
    """A delta variable's value, which may have been assigned since the
    loss was made: refused outside [0, 1]."""
    value = delta_value(variable)
    if not 0.0 <= value <= 1.0:
        raise ValueError(
            "Expected a loss's `delta` to be in [0, 1]. Received: its "
            f"`delta` variable holds {value} (assigned after the loss was "
            "made)"
        )
    return value


def check_label_mode(label_mode, ignore_class):
    _validation.check_one_of(label_mode, "label_mode", LABEL_MODES)
    if ignore_class is not None:
        if label_mode != "int":
            raise ValueError(
                "`ignore_class` needs integer labels (`label_mode='int'`). "
                f"Received: label_mode={label_mode!r}, "
                f"ignore_class={ignore_class!r}"
            )
        _validation.check_int(ignore_class, "ignore_class", minimum=None)


def has_no_rows(y_pred):
    """True when `y_pred`'s static shape holds no row (a 0 before the
    class axis): Keras's `ops.max` refuses empty tensors on TensorFlow and
    torch."""
    return any(dim == 0 for dim in tuple(y_pred.shape)[:-1])


def no_rows(y_pred):
    """Per-row values for a `y_pred` without rows: zeros of shape
    `y_pred.shape[:-1]`, connected to `y_pred` so that it has a gradient."""
    y_pred = ops.convert_to_tensor(y_pred)
    return ops.sum(ops.cast(y_pred, compute_dtype(y_pred)) * 0.0, axis=-1)


def _static(shape):
    """A shape's known sizes, `None` for the others (a `None` or a tensor in
    a traced graph)."""
    return tuple(d if isinstance(d, int) else None for d in shape)


def _shapes_match(a, b):
    a, b = _static(a), _static(b)
    return len(a) == len(b) and all(
        x is None or y is None or x == y for x, y in zip(a, b, strict=True)
    )


def _label_rows(y_true, row_shape, pred_shape=None):
    """Integer labels of `row_shape` (one per row of logits), from labels of
    that shape or with a trailing unit axis; else a `ValueError`."""
    true_shape = tuple(y_true.shape)
    rank = len(row_shape)
    if (
        len(true_shape) == rank + 1
        and true_shape[-1] == 1
        and _shapes_match(true_shape[:-1], row_shape)
    ):
        return ops.squeeze(y_true, axis=-1)
    if not _shapes_match(true_shape, row_shape):
        pred = "" if pred_shape is None else f", y_pred.shape={pred_shape}"
        raise ValueError(
            "Expected integer labels of shape y_pred.shape[:-1] = "
            f"{_static(row_shape)} (one label per row of logits). "
            f"Received: y_true.shape={true_shape}{pred}. "
            "For one-hot labels pass `label_mode='categorical'`."
        )
    return y_true


def squeeze_int_labels(y_true, y_pred):
    """Checks integer labels against logits; drops a trailing unit axis."""
    pred_shape = tuple(y_pred.shape)
    if len(pred_shape) < 1:
        raise ValueError(
            "Expected `y_pred` of shape [..., num_classes]. "
            f"Received: y_pred.shape={pred_shape}"
        )
    return _label_rows(y_true, pred_shape[:-1], pred_shape)


def rows_rank(sample_weight, row_shape):
    """Sample weights with the rank of the rows, to broadcast against them.

    `[batch]` weights weight every row of a sample (every token of a
    sentence), as `[batch, 1]` ones do; a trailing unit axis is dropped,
    as Keras does. Sizes that are known must match the rows'; else a
    `ValueError`.
    """
    weight = ops.convert_to_tensor(sample_weight)
    received = tuple(weight.shape)
    rank = len(row_shape)
    while len(weight.shape) > rank and weight.shape[-1] == 1:
        weight = ops.squeeze(weight, axis=-1)
    # `[batch, 1]` broadcasts over the tokens, as in Keras.
    while 1 < len(weight.shape) and weight.shape[-1] == 1:
        if tuple(row_shape)[len(weight.shape) - 1] == 1:
            break
        weight = ops.squeeze(weight, axis=-1)
    weight_shape = tuple(weight.shape)
    if len(weight_shape) > rank or not _shapes_match(
        weight_shape, tuple(row_shape)[: len(weight_shape)]
    ):
        rows = _static(row_shape)
        expected = f"{rows} (one weight per row of logits)"
        if rank > 1:
            expected = f"{rows[:1]} (one per sample) or {expected}"
        raise ValueError(
            f"Expected `sample_weight` of shape {expected}. Received: "
            f"sample_weight.shape={received}"
        )
    while len(weight.shape) < rank:
        weight = ops.expand_dims(weight, -1)
    return weight


def check_same_shape(y_true, y_pred, what):
    if not _shapes_match(tuple(y_true.shape), tuple(y_pred.shape)):
        raise ValueError(
            f"Expected {what} labels with the shape of `y_pred`. Received: "
            f"y_true.shape={tuple(y_true.shape)}, "
            f"y_pred.shape={tuple(y_pred.shape)}"
        )


def _examples(values, bad):
    """Up to five offending values, for an error message: `[0.5, 2.0]`."""
    found = ops.convert_to_numpy(values)[ops.convert_to_numpy(bad)][:5]
    return "[" + ", ".join(str(value) for value in found) + "]"


def _any(bad):
    return bool(ops.convert_to_numpy(ops.any(bad)))


def check_values(values, bad, expected, received):
    """Raises a `ValueError` when any of `bad` is true.

    The message reads "Expected {expected}. Received: {received}, e.g."
    followed by up to five of the `values` where `bad` is true. Only on
    concrete values: while tracing a graph the check is skipped. It moves
    one boolean to the host unless something is wrong.
    """
    if is_concrete(values) and _any(bad):
        raise ValueError(
            f"Expected {expected}. Received: {received}, "
            f"e.g. {_examples(values, bad)}"
        )


def check_zero_one(labels, expected):
    """Labels of 0s and 1s (one-hot, multi-hot), on concrete values."""
    check_values(
        labels,
        ops.logical_and(ops.not_equal(labels, 0), ops.not_equal(labels, 1)),
        expected,
        "values other than 0 and 1",
    )


def _check_label_range(labels, num_classes, ignore_class):
    bad = ops.logical_or(
        ops.less(labels, 0), ops.greater_equal(labels, num_classes)
    )
    if ignore_class is not None:
        bad = ops.logical_and(bad, ops.not_equal(labels, ignore_class))
    ignored = "" if ignore_class is None else f", ignore_class={ignore_class}"
    check_values(
        labels,
        bad,
        f"integer labels in [0, {num_classes - 1}] "
        f"(num_classes={num_classes}{ignored})",
        "labels outside that range",
    )


def check_probabilities(y_pred):
    """With `from_logits=False`, `y_pred` must hold values in [0, 1]."""
    check_values(
        y_pred,
        ops.logical_not(
            ops.logical_and(
                ops.greater_equal(y_pred, 0.0), ops.less_equal(y_pred, 1.0)
            )
        ),
        "probabilities in [0, 1] in `y_pred` with `from_logits=False` "
        "(pass `from_logits=True` for logits)",
        "values outside [0, 1]",
    )


def to_logits(y_pred, from_logits):
    """Float logits in the compute dtype, with infinities clipped."""
    dtype = compute_dtype(y_pred)
    y_pred = ops.cast(y_pred, dtype)
    if not from_logits:
        # softmax(log p) == p, so log-probabilities serve as logits; a
        # probability below `keras.config.epsilon()` counts as it, as in
        # Keras's own cross entropies.
        y_pred = ops.log(ops.maximum(y_pred, keras.config.epsilon()))
    return ops.clip(y_pred, -_LOGIT_LIMIT, _LOGIT_LIMIT)


def _int_labels(y_true, y_pred, ignore_class):
    """int32 labels `[...]` from integer (or integral float) labels."""
    y_true = squeeze_int_labels(y_true, y_pred)
    num_classes = y_pred.shape[-1]
    true_dtype = keras.backend.standardize_dtype(y_true.dtype)
    limit = _EXACT_INT_LIMIT.get(true_dtype)
    if limit is not None and num_classes is not None and num_classes > limit:
        raise ValueError(
            f"Integer labels arrived as {true_dtype}, which represents "
            f"integers exactly only up to {limit}, but y_pred has "
            f"{num_classes} classes. Use a float32 loss dtype "
            "(the default) or integer labels."
        )
    if "float" in true_dtype:
        # Keras casts labels to the loss dtype: 2.0 is label 2, 0.5 is no
        # label at all.
        check_values(
            y_true,
            ops.not_equal(y_true, ops.round(y_true)),
            "integer labels with `label_mode='int'` (for one-hot labels "
            "use `label_mode='categorical'`)",
            "non-integral labels",
        )
    labels = ops.cast(y_true, "int32")
    if num_classes is not None:
        _check_label_range(labels, num_classes, ignore_class)
    return labels


def _is_one_hot(y_true):
    """bool `[...]`: the rows of `y_true` `[..., C]` that are one-hot."""
    ones = ops.equal(y_true, 1)
    zero_one = ops.logical_or(ones, ops.equal(y_true, 0))
    return ops.logical_and(
        ops.all(zero_one, axis=-1),
        ops.equal(ops.sum(ops.cast(ones, "int32"), axis=-1), 1),
    )


def _check_one_hot(y_true):
    """One-hot labels: 0 or 1, one 1 per row (on concrete values)."""
    if not is_concrete(y_true):
        return
    expected = (
        "one-hot labels with `label_mode='categorical'` (1 for the target "
        "class, 0 for the others)"
    )
    check_zero_one(y_true, expected)
    ones = ops.sum(ops.cast(ops.equal(y_true, 1), "int32"), axis=-1)
    check_values(
        ones,
        ops.not_equal(ones, 1),
        expected,
        "rows whose number of 1s is not 1",
    )


def check_has_classes(y_pred):
    """Refuses logits `[..., 0]`, by their shape."""
    if len(y_pred.shape) and y_pred.shape[-1] == 0:
        raise ValueError(
            "Expected `y_pred` with at least one class on its last axis. "
            f"Received: y_pred.shape={tuple(y_pred.shape)}"
        )


def prepare_multiclass(y_true, y_pred, from_logits, label_mode, ignore_class):
    """Checks and standardizes multi-class inputs.

    Returns:
        `(logits, labels, is_target, valid)`: float logits `[..., C]`,
        int32 labels `[...]` (0 at ignored positions), a boolean one-hot of
        the target `[..., C]`, and a boolean `[...]` mask of the rows that
        count (`None` when every row counts).
    """
    check_label_mode(label_mode, ignore_class)
    y_true = ops.convert_to_tensor(y_true)
    y_pred = ops.convert_to_tensor(y_pred)
    check_has_classes(y_pred)
    if not from_logits:
        check_probabilities(y_pred)
    logits = to_logits(y_pred, from_logits)
    if label_mode == "categorical":
        check_same_shape(y_true, y_pred, "one-hot")
        _check_one_hot(y_true)
        labels = ops.cast(ops.argmax(y_true, axis=-1), "int32")
        if not is_concrete(y_true):
            # A compiled step cannot raise: a row that is not one-hot (all
            # zeros, smoothed) has no target, and so an infinite loss, as
            # an integer label out of range has.
            labels = ops.where(_is_one_hot(y_true), labels, -1)
    else:
        labels = _int_labels(y_true, y_pred, ignore_class)
    valid = None
    if ignore_class is not None:
        valid = ops.not_equal(labels, ignore_class)
        labels = ops.where(valid, labels, 0)
    class_ids = ops.arange(ops.shape(logits)[-1], dtype="int32")
    is_target = ops.equal(ops.expand_dims(labels, -1), class_ids)
    return logits, labels, is_target, valid


def cross_entropy_over_kept(logits, is_target, keep=None):
    """Cross entropy over the kept classes: `logsumexp(o[keep]) - o_t`.

    `keep` must contain the target. The max is taken over all classes: it
    is a kept class whenever the target is kept, so the shift is exact,
    and for a row where only the target is kept it equals `o_t`, making the
    loss `log(1) + (o_t - o_t) == 0.0` exactly, with a gradient
    `1 - 1 == 0.0` exactly.

    Args:
        logits: float `[..., C]`.
        is_target: bool `[..., C]` one-hot of the target.
        keep: optional bool `[..., C]`; `None` keeps every class (plain
            softmax cross entropy).

    Returns:
        Float values `[...]`; `inf` for a row without a target (a label
        outside `[0, C)`, where a compiled step cannot raise).
    """
    top = ops.stop_gradient(ops.max(logits, axis=-1, keepdims=True))
    exps = ops.exp(logits - top)
    if keep is not None:
        exps = ops.where(keep, exps, 0.0)
    target = ops.sum(ops.where(is_target, logits, 0.0), axis=-1)
    # `log(sum) + (top - target)`: with `top + log(sum)` first, a large
    # common offset of the logits would round the log away.
    values = ops.log(ops.sum(exps, axis=-1)) + (
        ops.squeeze(top, axis=-1) - target
    )
    if keep is not None:
        # A NaN logit makes the row NaN, as without `keep`, which drops it
        # (TensorFlow's XLA `max`, and so `top`, skips NaN).
        nan = ops.any(ops.isnan(logits), axis=-1)
        values = ops.where(nan, float("nan"), values)
    return inf_without_target(values, is_target)


def inf_without_target(values, is_target):
    """`values` `[...]`, `inf` in the rows whose `is_target` `[..., C]`
    holds no target (a label out of range)."""
    return ops.where(ops.any(is_target, axis=-1), values, float("inf"))


def mask_rows(values, valid):
    """Zeroes the rows that do not count (`valid` false) and gives the
    values `valid` as their Keras mask, as
    `keras.losses.sparse_categorical_crossentropy(..., ignore_class=...)`
    does: a loss or metric made of the function leaves those rows out of
    its mean. `valid=None` returns `values` unchanged. `PerRowLoss`
    leaves the same rows out through its weights (`row_weights`)."""
    if valid is None:
        return values
    values = ops.where(valid, values, 0.0)
    set_keras_mask(values, valid)
    return values


def ignore_class_of(loss):
    """The `ignore_class` a loss leaves out, or `None`. Keras's own losses
    keep it in their function's keyword arguments (`_fn_kwargs`), which
    later Kerases no longer copy to an attribute; ours keep both."""
    ignore_class = getattr(loss, "ignore_class", None)
    if ignore_class is None:
        ignore_class = getattr(loss, "_fn_kwargs", {}).get("ignore_class")
    return ignore_class


def valid_rows(y_true, row_shape, ignore_class):
    """Rows whose integer label is not `ignore_class` (bool, `row_shape`),
    or `None` when `ignore_class` is `None`."""
    if ignore_class is None:
        return None
    labels = _label_rows(ops.convert_to_tensor(y_true), row_shape)
    return ops.not_equal(ops.cast(labels, "int32"), ignore_class)


def row_weights(valid, sample_weight, reduction):
    """Sample weights that leave the rows that are not `valid` out of a
    loss, as Keras's own `ignore_class` does: weight 0, and for the
    `"sum_over_batch_size"` and `"mean"` reductions, the others weighted
    `rows / valid rows`, so the mean is over the valid rows only."""
    weights = ops.cast(valid, "float32")
    if reduction in ("mean", "sum_over_batch_size"):
        total = ops.cast(ops.size(weights), "float32")
        weights = weights * ops.divide_no_nan(total, ops.sum(weights))
    if sample_weight is None:
        return weights
    return ops.cast(sample_weight, "float32") * weights
