"""Shared pieces of the multi-class losses: label handling, checks, kernels.

Everything here is written with `keras.ops` so that it runs on every backend,
eagerly and under XLA: fixed shapes, `where` instead of boolean indexing, no
host round trips except for label checks on concrete (eager) values.
"""

import keras
import numpy as np
from keras import ops

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
    """True when `x` holds values (eager), False while tracing a graph."""
    if isinstance(x, np.ndarray):
        return True
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


def check_delta(delta, name="delta"):
    """Validates a margin given as a Python number (variables pass as is)."""
    if isinstance(delta, keras.Variable):
        return delta
    try:
        value = float(delta)
    except (TypeError, ValueError):
        raise ValueError(
            f"Expected `{name}` to be a number in [0, 1]. "
            f"Received: {name}={delta!r}"
        ) from None
    if not 0.0 <= value <= 1.0 or value != value:
        raise ValueError(
            f"Expected `{name}` to be in [0, 1]. Received: {name}={delta!r}"
        )
    return value


def delta_variable(delta):
    """The non-trainable float32 `keras.Variable` that holds a loss's delta.

    Callbacks (`DeltaWarmup`) assign it during training without recompiling.
    """
    return keras.Variable(check_delta(delta), dtype="float32", trainable=False, name="delta")


def check_positive(value, name):
    if not float(value) > 0:
        raise ValueError(
            f"Expected `{name}` to be > 0. Received: {name}={value!r}"
        )
    return value


def check_label_mode(label_mode, ignore_class):
    if label_mode not in LABEL_MODES:
        raise ValueError(
            f"Expected `label_mode` to be one of {LABEL_MODES}. "
            f"Received: label_mode={label_mode!r}"
        )
    if ignore_class is not None:
        if label_mode != "int":
            raise ValueError(
                "`ignore_class` needs integer labels (`label_mode='int'`). "
                f"Received: label_mode={label_mode!r}, "
                f"ignore_class={ignore_class!r}"
            )
        if not isinstance(ignore_class, (int, np.integer)):
            raise ValueError(
                "Expected `ignore_class` to be an int or None. "
                f"Received: ignore_class={ignore_class!r}"
            )


def _shapes_match(a, b):
    return len(a) == len(b) and all(
        x is None or y is None or x == y for x, y in zip(a, b)
    )


def squeeze_int_labels(y_true, y_pred):
    """Checks integer labels against logits; drops a trailing unit axis."""
    true_shape = tuple(y_true.shape)
    pred_shape = tuple(y_pred.shape)
    if len(pred_shape) < 1:
        raise ValueError(
            "Expected `y_pred` of shape [..., num_classes]. "
            f"Received: y_pred.shape={pred_shape}"
        )
    if (
        len(true_shape) == len(pred_shape)
        and true_shape[-1] == 1
        and _shapes_match(true_shape[:-1], pred_shape[:-1])
    ):
        y_true = ops.squeeze(y_true, axis=-1)
        true_shape = true_shape[:-1]
    if not _shapes_match(true_shape, pred_shape[:-1]):
        raise ValueError(
            "Expected integer labels of shape y_pred.shape[:-1] = "
            f"{pred_shape[:-1]} (one label per row of logits). Received: "
            f"y_true.shape={true_shape}, y_pred.shape={pred_shape}. "
            "For one-hot labels pass `label_mode='categorical'`."
        )
    return y_true


def check_same_shape(y_true, y_pred, what):
    if not _shapes_match(tuple(y_true.shape), tuple(y_pred.shape)):
        raise ValueError(
            f"Expected {what} labels with the shape of `y_pred`. Received: "
            f"y_true.shape={tuple(y_true.shape)}, "
            f"y_pred.shape={tuple(y_pred.shape)}"
        )


def _check_label_range(labels, num_classes, ignore_class):
    values = ops.convert_to_numpy(labels)
    if ignore_class is not None:
        values = values[values != ignore_class]
    if values.size and (values.min() < 0 or values.max() >= num_classes):
        bad = values[(values < 0) | (values >= num_classes)]
        raise ValueError(
            f"Expected integer labels in [0, {num_classes - 1}] "
            f"(num_classes={num_classes}"
            + (f", ignore_class={ignore_class}" if ignore_class is not None else "")
            + f"). Received labels outside that range, e.g. {bad[:5].tolist()}"
        )


def to_logits(y_pred, from_logits):
    """Float logits in the compute dtype, with infinities clipped."""
    dtype = compute_dtype(y_pred)
    y_pred = ops.cast(y_pred, dtype)
    if not from_logits:
        # softmax(log p) == p, so log-probabilities serve as logits.
        y_pred = ops.log(ops.maximum(y_pred, np.finfo(dtype).tiny))
    return ops.clip(y_pred, -_LOGIT_LIMIT, _LOGIT_LIMIT)


def prepare_multiclass(y_true, y_pred, from_logits, label_mode, ignore_class):
    """Standardizes multi-class inputs.

    Returns:
        `(logits, is_target, valid)`: float logits `[..., C]`, a boolean
        one-hot of the target `[..., C]`, and a boolean `[...]` mask of the
        rows that count (`None` when every row counts).
    """
    logits, _, is_target, valid = prepare_multiclass_labels(
        y_true, y_pred, from_logits, label_mode, ignore_class
    )
    return logits, is_target, valid


def prepare_multiclass_labels(
    y_true, y_pred, from_logits, label_mode, ignore_class
):
    """`prepare_multiclass` that also returns the int32 labels `[...]`
    (0 at ignored positions): `(logits, labels, is_target, valid)`."""
    y_true = ops.convert_to_tensor(y_true)
    y_pred = ops.convert_to_tensor(y_pred)
    num_classes = y_pred.shape[-1] if len(y_pred.shape) else None
    logits = to_logits(y_pred, from_logits)
    if label_mode == "categorical":
        check_same_shape(y_true, y_pred, "one-hot")
        labels = ops.argmax(y_true, axis=-1)
    else:
        y_true = squeeze_int_labels(y_true, y_pred)
        true_dtype = keras.backend.standardize_dtype(y_true.dtype)
        limit = _EXACT_INT_LIMIT.get(true_dtype)
        if limit is not None and num_classes is not None and num_classes > limit:
            raise ValueError(
                f"Integer labels arrived as {true_dtype}, which represents "
                f"integers exactly only up to {limit}, but y_pred has "
                f"{num_classes} classes. Use a float32 loss dtype "
                "(the default) or integer labels."
            )
        labels = ops.cast(y_true, "int32")
        if num_classes is not None and is_concrete(labels):
            _check_label_range(labels, num_classes, ignore_class)
    valid = None
    if ignore_class is not None:
        valid = ops.not_equal(labels, ignore_class)
        labels = ops.where(valid, labels, 0)
    class_ids = ops.arange(ops.shape(logits)[-1], dtype="int32")
    is_target = ops.equal(ops.expand_dims(labels, -1), class_ids)
    return logits, labels, is_target, valid


def target_logit(logits, is_target):
    return ops.sum(ops.where(is_target, logits, 0.0), axis=-1)


def kept_cross_entropy(logits, is_target, keep=None, shifted=None):
    """Cross entropy over the kept classes: `logsumexp(o[keep]) - o_t`.

    `keep` must contain the target (it always does here). The max is taken
    over all classes: it is a kept class whenever the target is kept, so the
    shift is exact, and for a row where only the target is kept it equals
    `o_t`, making the loss `o_t + log(1) - o_t == 0.0` exactly, with a
    gradient `1 - 1 == 0.0` exactly.

    Args:
        logits: float `[..., C]`.
        is_target: bool `[..., C]` one-hot of the target.
        keep: optional bool `[..., C]`; `None` keeps every class (plain
            softmax cross entropy).
        shifted: optional `(top, exp(logits - top))` already computed.
    """
    if shifted is None:
        shifted = shift_exp(logits)
    top, exps = shifted
    if keep is not None:
        exps = ops.where(keep, exps, 0.0)
    return (
        ops.squeeze(top, axis=-1)
        + ops.log(ops.sum(exps, axis=-1))
        - target_logit(logits, is_target)
    )


def shift_exp(logits):
    """`(max, exp(logits - max))` with the max held constant for gradients."""
    top = ops.stop_gradient(ops.max(logits, axis=-1, keepdims=True))
    return top, ops.exp(logits - top)


def zero_invalid(values, valid):
    return values if valid is None else ops.where(valid, values, 0.0)
