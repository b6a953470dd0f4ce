"""Base class shared by the multi-class losses of this package."""

import keras
from keras import ops

from keras_as_softmax.losses import _common


class MultiClassLoss(keras.losses.Loss):
    """A `keras.losses.Loss` over logits `[..., C]` and one label per row.

    Subclasses set `fn` (the per-sample function) and implement
    `_fn_kwargs()` (its hyper-parameters). This class owns what every
    multi-class loss here shares: integer or one-hot labels, `from_logits`,
    and `ignore_class`, whose positions get loss 0 and are left out of the
    `"sum_over_batch_size"` / `"mean"` denominators, exactly as in
    `keras.losses.SparseCategoricalCrossentropy(ignore_class=...)`.
    """

    fn = None

    def __init__(
        self,
        *,
        from_logits=True,
        label_mode="int",
        ignore_class=None,
        reduction="sum_over_batch_size",
        name=None,
        dtype=None,
    ):
        super().__init__(name=name, reduction=reduction, dtype=dtype)
        _common.check_label_mode(label_mode, ignore_class)
        self.from_logits = bool(from_logits)
        self.label_mode = label_mode
        self.ignore_class = None if ignore_class is None else int(ignore_class)

    def _fn_kwargs(self):
        return {}

    def call(self, y_true, y_pred):
        return type(self).fn(
            y_true,
            y_pred,
            from_logits=self.from_logits,
            label_mode=self.label_mode,
            ignore_class=self.ignore_class,
            **self._fn_kwargs(),
        )

    def __call__(self, y_true, y_pred, sample_weight=None):
        y_true = ops.convert_to_tensor(y_true)
        y_pred = ops.convert_to_tensor(y_pred)
        row_rank = len(y_pred.shape) - 1
        if sample_weight is not None:
            # Per-sample weights `[batch]` also weight every token of a sample.
            sample_weight = ops.convert_to_tensor(sample_weight)
            while len(sample_weight.shape) < row_rank:
                sample_weight = ops.expand_dims(sample_weight, -1)
        if self.ignore_class is not None:
            # Fold the ignored positions into the sample weights with the same
            # `total / valid` rescaling that Keras applies to masked losses.
            labels = _common.squeeze_int_labels(y_true, y_pred)
            valid = ops.not_equal(ops.cast(labels, "int32"), self.ignore_class)
            weight = ops.cast(valid, self.dtype)
            if self.reduction in ("sum_over_batch_size", "mean"):
                total = ops.cast(ops.size(weight), self.dtype)
                weight = weight * ops.divide_no_nan(total, ops.sum(weight))
            if sample_weight is not None:
                weight = weight * ops.cast(sample_weight, self.dtype)
            sample_weight = weight
        return super().__call__(y_true, y_pred, sample_weight)

    def get_config(self):
        config = super().get_config()
        config.update(
            from_logits=self.from_logits,
            label_mode=self.label_mode,
            ignore_class=self.ignore_class,
            dtype=self._dtype_policy.name,
        )
        config.update(self._fn_kwargs())
        return config
