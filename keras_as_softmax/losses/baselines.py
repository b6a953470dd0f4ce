"""The softmax variants the AS-Softmax paper compares against.

Sparse-Softmax (top-k), AM-Softmax, temperature softmax, the Sparsemax loss
and the 1.5-Entmax loss, with the conventions of `ASSoftmaxLoss` (integer or
one-hot labels, any leading shape, `ignore_class`, float32 math). Label
smoothing is Keras's own (`keras.losses.CategoricalCrossentropy`), and the
unmasked multi-label baseline is `MultiLabelCategoricalCrossentropy`.
"""

import keras
from keras import ops

from keras_as_softmax import _validation
from keras_as_softmax.losses import _common
from keras_as_softmax.losses._base import PerRowLoss
from keras_as_softmax.losses._base import label_kwargs


def _check_k(k, num_classes):
    if num_classes is not None and k > num_classes:
        raise ValueError(
            f"Expected `k` <= the number of classes ({num_classes}). "
            f"Received: k={k}"
        )


@keras.saving.register_keras_serializable(package="keras_as_softmax")
def sparse_softmax_cross_entropy(
    y_true, y_pred, k=10, from_logits=True, label_mode="int", ignore_class=None
):
    """Per-sample Sparse-Softmax cross entropy (Sun et al., 2021).

    Cross entropy over the `k` largest logits of each row, with the target
    added when it is not among them (ties at the k-th value are all kept).

    Formula:

    ```
    keep_i = (o_i >= k-th largest logit) or (i == t)
    loss   = logsumexp(o[keep]) - o_t
    ```

    Args:
        y_true: integer labels `[...]`, or one-hot `[..., C]` with
            `label_mode="categorical"`.
        y_pred: logits `[..., C]`.
        k: number of classes kept, 1 <= k <= C. Defaults to `10`.
        from_logits, label_mode, ignore_class: as in
            `as_softmax_cross_entropy`.

    Returns:
        Loss values of shape `[...]`.

    Example:

    >>> import numpy as np
    >>> import keras_as_softmax
    >>> values = keras_as_softmax.sparse_softmax_cross_entropy(
    ...     np.array([2]), np.array([[3.0, 2.0, 1.0]]), k=2
    ... )
    >>> [round(float(v), 4) for v in values]
    [2.4076]

    Reference:
        Sun et al., "Sparsing and Smoothing for the seq2seq Models", 2021.
    """
    k = _validation.check_int(k, "k")
    logits, _, is_target, valid = _common.prepare_multiclass(
        y_true, y_pred, from_logits, label_mode, ignore_class
    )
    _check_k(k, logits.shape[-1])
    kth = ops.top_k(ops.stop_gradient(logits), k, sorted=True)[0][..., -1:]
    keep = ops.logical_or(ops.greater_equal(logits, kth), is_target)
    values = _common.cross_entropy_over_kept(logits, is_target, keep)
    return _common.mask_rows(values, valid)


@keras.saving.register_keras_serializable(package="keras_as_softmax")
def am_softmax_cross_entropy(
    y_true,
    y_pred,
    scale=10.0,
    margin=0.3,
    from_logits=True,
    label_mode="int",
    ignore_class=None,
):
    """Per-sample additive-margin softmax cross entropy (paper eq. 21).

    Formula:

    ```
    loss = -log(exp(s (o_t - m)) / (exp(s (o_t - m)) + sum_{j != t} exp(s o_j)))
    ```

    Args:
        y_true, y_pred, from_logits, label_mode, ignore_class: as in
            `as_softmax_cross_entropy`.
        scale: `s`. Defaults to `10.0`.
        margin: `m`, subtracted from the target logit. Defaults to `0.3`.

    Returns:
        Loss values of shape `[...]`.

    Example:

    >>> import numpy as np
    >>> import keras_as_softmax
    >>> values = keras_as_softmax.am_softmax_cross_entropy(
    ...     np.array([0]), np.array([[1.0, 0.0]]), scale=2.0, margin=0.5
    ... )
    >>> [round(float(v), 4) for v in values]
    [0.3133]

    Reference:
        Wang et al., "Additive Margin Softmax for Face Verification", 2018.
    """
    if not ops.is_tensor(scale):
        scale = _validation.check_positive(scale, "scale")
    if not ops.is_tensor(margin):
        margin = _validation.check_positive(margin, "margin", allow_zero=True)
    logits, _, is_target, valid = _common.prepare_multiclass(
        y_true, y_pred, from_logits, label_mode, ignore_class
    )
    # Clipped again: XLA may compute the scaled logits twice, rounding
    # them apart, and at 1e30 that gap overflows `exp(o - max)`.
    logits = _common.to_logits(
        scale * ops.where(is_target, logits - margin, logits), True
    )
    values = _common.cross_entropy_over_kept(logits, is_target)
    return _common.mask_rows(values, valid)


@keras.saving.register_keras_serializable(package="keras_as_softmax")
def temperature_softmax_cross_entropy(
    y_true,
    y_pred,
    temperature=1.0,
    from_logits=True,
    label_mode="int",
    ignore_class=None,
):
    """Per-sample cross entropy of `softmax(o / temperature)` (T-Softmax).

    Args:
        y_true, y_pred, from_logits, label_mode, ignore_class: as in
            `as_softmax_cross_entropy`.
        temperature: `tau` > 0; larger is smoother. Defaults to `1.0`.

    Returns:
        Loss values of shape `[...]`.

    Example:

    >>> import numpy as np
    >>> import keras_as_softmax
    >>> values = keras_as_softmax.temperature_softmax_cross_entropy(
    ...     np.array([0]), np.array([[2.0, 0.0]]), temperature=2.0
    ... )
    >>> [round(float(v), 4) for v in values]
    [0.3133]
    """
    if not ops.is_tensor(temperature):
        temperature = _validation.check_positive(temperature, "temperature")
    logits, _, is_target, valid = _common.prepare_multiclass(
        y_true, y_pred, from_logits, label_mode, ignore_class
    )
    logits = _common.to_logits(logits / temperature, True)  # as AM-Softmax
    values = _common.cross_entropy_over_kept(logits, is_target)
    return _common.mask_rows(values, valid)


def _sorted_desc(x):
    return ops.flip(ops.sort(x, axis=-1), axis=-1)


def _cumsum(x):
    """`ops.cumsum` along the last axis, in `x`'s dtype.

    On PyTorch, Keras's `cumsum` computes float64 input in float32 (its
    `result_type` of float64 is float32, as `maximum(x, 0.0)`'s, hence
    `relu` below), so there the sum is torch's own.
    """
    if keras.backend.backend() == "torch":
        import torch

        return torch.cumsum(x, dim=-1)
    return ops.cumsum(x, axis=-1)


def _gather_last(x, index):
    return ops.squeeze(ops.take_along_axis(x, index, axis=-1), axis=-1)


def sparsemax(logits):
    """Sparsemax (Martins & Astudillo, 2016), sort-based, along the last axis.

    The Euclidean projection of the logits onto the probability simplex:
    `max(o - tau, 0)` with the threshold `tau` that makes it sum to 1.
    """
    logits = ops.convert_to_tensor(logits)
    z = logits - ops.max(logits, axis=-1, keepdims=True)
    z_sorted = _sorted_desc(z)
    rank = ops.arange(1, ops.shape(z)[-1] + 1, dtype=z.dtype)
    cumsum = _cumsum(z_sorted)
    support = ops.greater(1.0 + rank * z_sorted, cumsum)
    size = ops.sum(ops.cast(support, "int32"), axis=-1, keepdims=True)
    tau = (_gather_last(cumsum, size - 1) - 1.0) / ops.cast(
        ops.squeeze(size, -1), z.dtype
    )
    return ops.relu(z - ops.expand_dims(tau, -1))


def entmax15(logits):
    """1.5-Entmax (Peters et al., 2019), exact sort-based algorithm.

    `max(o / 2 - tau, 0) ** 2` with the threshold `tau` that makes it sum to
    1; it interpolates between softmax and sparsemax.
    """
    logits = ops.convert_to_tensor(logits)
    z = (logits - ops.max(logits, axis=-1, keepdims=True)) / 2.0
    z_sorted = _sorted_desc(z)
    rank = ops.arange(1, ops.shape(z)[-1] + 1, dtype=z.dtype)
    mean = _cumsum(z_sorted) / rank
    mean_sq = _cumsum(ops.square(z_sorted)) / rank
    spread = rank * (mean_sq - ops.square(mean))
    tau_all = mean - ops.sqrt(ops.relu((1.0 - spread) / rank))
    size = ops.sum(
        ops.cast(ops.less_equal(tau_all, z_sorted), "int32"),
        axis=-1,
        keepdims=True,
    )
    tau = ops.expand_dims(_gather_last(tau_all, size - 1), -1)
    return ops.square(ops.relu(z - tau))


def _check_logits_only(from_logits, name):
    if not from_logits:
        raise ValueError(
            f"{name} is defined on logits only: expected from_logits=True. "
            f"Received: from_logits={from_logits!r}"
        )


def _tsallis_loss(logits, is_target, probs, alpha):
    """Fenchel-Young loss of the Tsallis alpha-entropy at `probs`.

    `(1 - sum p^alpha) / (alpha (alpha - 1)) + <p - onehot, o>`, whose
    gradient with `p` held constant is `p - onehot`, the exact gradient;
    `inf` for a row without a target.
    """
    probs = ops.stop_gradient(probs)
    onehot = ops.cast(is_target, logits.dtype)
    entropy = (1.0 - ops.sum(probs**alpha, axis=-1)) / (alpha * (alpha - 1.0))
    # `p - onehot` sums to 0, so the product is the same for logits
    # shifted by their max, where a large common offset rounds nothing
    # away.
    shifted = logits - ops.stop_gradient(ops.max(logits, -1, keepdims=True))
    values = entropy + ops.sum((probs - onehot) * shifted, axis=-1)
    return _common.inf_without_target(values, is_target)


@keras.saving.register_keras_serializable(package="keras_as_softmax")
def sparsemax_loss(
    y_true, y_pred, from_logits=True, label_mode="int", ignore_class=None
):
    """Per-sample Sparsemax loss (Martins & Astudillo, 2016).

    Formula:

    ```
    p    = sparsemax(o)
    loss = (1 - ||p||^2) / 2 + <p - onehot(t), o>
    ```

    Args:
        y_true, y_pred, label_mode, ignore_class: as in
            `as_softmax_cross_entropy`.
        from_logits: must be `True`: the loss is defined on logits.

    Returns:
        Loss values of shape `[...]`, zero once `p` is the one-hot target.

    Example:

    >>> import numpy as np
    >>> import keras_as_softmax
    >>> logits = np.array([[3.0, 0.0, 0.0], [1.0, 0.5, 0.0]])
    >>> values = keras_as_softmax.sparsemax_loss(np.array([0, 1]), logits)
    >>> [round(float(v), 4) for v in values]
    [0.0, 0.5625]

    Reference:
        Martins & Astudillo, "From Softmax to Sparsemax", ICML 2016.
    """
    _check_logits_only(from_logits, "sparsemax_loss")
    logits, _, is_target, valid = _common.prepare_multiclass(
        y_true, y_pred, True, label_mode, ignore_class
    )
    values = _tsallis_loss(logits, is_target, sparsemax(logits), 2.0)
    return _common.mask_rows(values, valid)


@keras.saving.register_keras_serializable(package="keras_as_softmax")
def entmax15_loss(
    y_true, y_pred, from_logits=True, label_mode="int", ignore_class=None
):
    """Per-sample 1.5-Entmax loss (Peters et al., 2019).

    Formula:

    ```
    p    = entmax15(o)
    loss = (1 - sum p^1.5) / 0.75 + <p - onehot(t), o>
    ```

    Args:
        y_true, y_pred, label_mode, ignore_class: as in
            `as_softmax_cross_entropy`.
        from_logits: must be `True`: the loss is defined on logits.

    Returns:
        Loss values of shape `[...]`.

    Example:

    >>> import numpy as np
    >>> import keras_as_softmax
    >>> logits = np.array([[5.0, 0.0, 0.0], [1.0, 0.5, 0.0]])
    >>> values = keras_as_softmax.entmax15_loss(np.array([0, 1]), logits)
    >>> [round(float(v), 4) for v in values]
    [0.0, 0.7033]

    Reference:
        Peters, Niculae & Martins, "Sparse Sequence-to-Sequence Models",
        ACL 2019.
    """
    _check_logits_only(from_logits, "entmax15_loss")
    logits, _, is_target, valid = _common.prepare_multiclass(
        y_true, y_pred, True, label_mode, ignore_class
    )
    values = _tsallis_loss(logits, is_target, entmax15(logits), 1.5)
    return _common.mask_rows(values, valid)


@keras.saving.register_keras_serializable(package="keras_as_softmax")
class SparseSoftmaxLoss(PerRowLoss):
    """Sparse-Softmax cross entropy: softmax over the top-k logits only.

    The predecessor of AS-Softmax: each row keeps its `k` largest logits
    (and the target, if it is not among them) and takes cross entropy over
    those.

    Formula:

    ```
    keep_i = (o_i >= k-th largest logit) or (i == t)
    loss   = logsumexp(o[keep]) - o_t
    ```

    Args:
        k: number of classes kept, 1 <= k <= C. Defaults to `10`.
        from_logits: whether `y_pred` holds logits. Defaults to `True`.
        label_mode: `"int"` or `"categorical"`. Defaults to `"int"`.
        ignore_class: optional int label to ignore. Defaults to `None`.
        reduction: as in `keras.losses.Loss`. Defaults to
            `"sum_over_batch_size"`.
        name: defaults to `"sparse_softmax_loss"`.
        dtype: as in `keras.losses.Loss`.

    Example:

    >>> import numpy as np
    >>> import keras_as_softmax
    >>> loss = keras_as_softmax.SparseSoftmaxLoss(k=2, reduction=None)
    >>> logits = np.array([[3.0, 2.0, 1.0]])
    >>> [round(float(v), 4) for v in loss(np.array([2]), logits)]
    [2.4076]

    Reference:
        Sun et al., "Sparsing and Smoothing for the seq2seq Models", 2021.
    """

    def __init__(
        self,
        k=10,
        from_logits=True,
        label_mode="int",
        ignore_class=None,
        reduction="sum_over_batch_size",
        name="sparse_softmax_loss",
        dtype=None,
    ):
        super().__init__(
            sparse_softmax_cross_entropy,
            reduction=reduction,
            name=name,
            dtype=dtype,
            k=_validation.check_int(k, "k"),
            from_logits=_validation.check_bool(from_logits, "from_logits"),
            **label_kwargs(label_mode, ignore_class),
        )


@keras.saving.register_keras_serializable(package="keras_as_softmax")
class AMSoftmaxLoss(PerRowLoss):
    """Additive-margin softmax cross entropy (AM-Softmax), paper eq. 21.

    The target logit is lowered by `margin` and all logits are scaled by
    `scale` before softmax cross entropy.

    Formula:

    ```
    loss = -log(exp(s (o_t - m)) / (exp(s (o_t - m)) + sum_{j != t} exp(s o_j)))
    ```

    Args:
        scale: `s` > 0. Defaults to `10.0`.
        margin: `m` >= 0. Defaults to `0.3`.
        from_logits: whether `y_pred` holds logits. Defaults to `True`.
        label_mode: `"int"` or `"categorical"`. Defaults to `"int"`.
        ignore_class: optional int label to ignore. Defaults to `None`.
        reduction: as in `keras.losses.Loss`. Defaults to
            `"sum_over_batch_size"`.
        name: defaults to `"am_softmax_loss"`.
        dtype: as in `keras.losses.Loss`.

    Example:

    >>> import numpy as np
    >>> import keras_as_softmax
    >>> loss = keras_as_softmax.AMSoftmaxLoss(scale=1.0, margin=0.0)
    >>> round(float(loss(np.array([0]), np.array([[0.0, 0.0]]))), 4)
    0.6931

    Reference:
        Wang et al., "Additive Margin Softmax for Face Verification", 2018.
    """

    def __init__(
        self,
        scale=10.0,
        margin=0.3,
        from_logits=True,
        label_mode="int",
        ignore_class=None,
        reduction="sum_over_batch_size",
        name="am_softmax_loss",
        dtype=None,
    ):
        super().__init__(
            am_softmax_cross_entropy,
            reduction=reduction,
            name=name,
            dtype=dtype,
            scale=_validation.check_positive(scale, "scale"),
            margin=_validation.check_positive(
                margin, "margin", allow_zero=True
            ),
            from_logits=_validation.check_bool(from_logits, "from_logits"),
            **label_kwargs(label_mode, ignore_class),
        )


@keras.saving.register_keras_serializable(package="keras_as_softmax")
class TemperatureSoftmaxLoss(PerRowLoss):
    """Cross entropy of a temperature softmax (T-Softmax).

    Formula:

    ```
    loss = -log softmax(o / tau)_t
    ```

    Args:
        temperature: `tau` > 0; larger is smoother. Defaults to `1.0`.
        from_logits: whether `y_pred` holds logits. Defaults to `True`.
        label_mode: `"int"` or `"categorical"`. Defaults to `"int"`.
        ignore_class: optional int label to ignore. Defaults to `None`.
        reduction: as in `keras.losses.Loss`. Defaults to
            `"sum_over_batch_size"`.
        name: defaults to `"temperature_softmax_loss"`.
        dtype: as in `keras.losses.Loss`.

    Example:

    >>> import numpy as np
    >>> import keras_as_softmax
    >>> loss = keras_as_softmax.TemperatureSoftmaxLoss(temperature=2.0)
    >>> round(float(loss(np.array([0]), np.array([[2.0, 0.0]]))), 4)
    0.3133
    """

    def __init__(
        self,
        temperature=1.0,
        from_logits=True,
        label_mode="int",
        ignore_class=None,
        reduction="sum_over_batch_size",
        name="temperature_softmax_loss",
        dtype=None,
    ):
        super().__init__(
            temperature_softmax_cross_entropy,
            reduction=reduction,
            name=name,
            dtype=dtype,
            temperature=_validation.check_positive(temperature, "temperature"),
            from_logits=_validation.check_bool(from_logits, "from_logits"),
            **label_kwargs(label_mode, ignore_class),
        )


@keras.saving.register_keras_serializable(package="keras_as_softmax")
class SparsemaxLoss(PerRowLoss):
    """Sparsemax loss (Martins & Astudillo, 2016), on logits.

    Formula:

    ```
    p    = sparsemax(o)
    loss = (1 - ||p||^2) / 2 + <p - onehot(t), o>
    ```

    Args:
        label_mode: `"int"` or `"categorical"`. Defaults to `"int"`.
        ignore_class: optional int label to ignore. Defaults to `None`.
        reduction: as in `keras.losses.Loss`. Defaults to
            `"sum_over_batch_size"`.
        name: defaults to `"sparsemax_loss"`.
        dtype: as in `keras.losses.Loss`.

    Example:

    >>> import numpy as np
    >>> import keras_as_softmax
    >>> loss = keras_as_softmax.SparsemaxLoss()
    >>> round(float(loss(np.array([0]), np.array([[3.0, 0.0, 0.0]]))), 4)
    0.0

    Reference:
        Martins & Astudillo, "From Softmax to Sparsemax", ICML 2016.
    """

    def __init__(
        self,
        label_mode="int",
        ignore_class=None,
        reduction="sum_over_batch_size",
        name="sparsemax_loss",
        dtype=None,
    ):
        super().__init__(
            sparsemax_loss,
            reduction=reduction,
            name=name,
            dtype=dtype,
            **label_kwargs(label_mode, ignore_class),
        )


@keras.saving.register_keras_serializable(package="keras_as_softmax")
class Entmax15Loss(PerRowLoss):
    """1.5-Entmax loss (Peters et al., 2019), on logits.

    Formula:

    ```
    p    = entmax15(o)
    loss = (1 - sum p^1.5) / 0.75 + <p - onehot(t), o>
    ```

    Args:
        label_mode: `"int"` or `"categorical"`. Defaults to `"int"`.
        ignore_class: optional int label to ignore. Defaults to `None`.
        reduction: as in `keras.losses.Loss`. Defaults to
            `"sum_over_batch_size"`.
        name: defaults to `"entmax15_loss"`.
        dtype: as in `keras.losses.Loss`.

    Example:

    >>> import numpy as np
    >>> import keras_as_softmax
    >>> loss = keras_as_softmax.Entmax15Loss()
    >>> round(float(loss(np.array([0]), np.array([[5.0, 0.0, 0.0]]))), 4)
    0.0

    Reference:
        Peters, Niculae & Martins, "Sparse Sequence-to-Sequence Models",
        ACL 2019.
    """

    def __init__(
        self,
        label_mode="int",
        ignore_class=None,
        reduction="sum_over_batch_size",
        name="entmax15_loss",
        dtype=None,
    ):
        super().__init__(
            entmax15_loss,
            reduction=reduction,
            name=name,
            dtype=dtype,
            **label_kwargs(label_mode, ignore_class),
        )
