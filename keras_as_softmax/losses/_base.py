"""The base class of every loss of this package."""

import keras
from keras import ops
from keras.src.backend.common.masking import get_keras_mask
from keras.src.backend.common.masking import set_keras_mask

from keras_as_softmax.losses import _common


class PerRowLoss(keras.losses.Loss):
    """A `keras.losses.Loss` that applies a per-row loss function.

    Like `keras.losses.LossFunctionWrapper`: the instance holds `fn` (a
    function `fn(y_true, y_pred, **kwargs)` returning one value per row,
    `[...]` for `y_pred` of shape `[..., C]`) and its keyword arguments;
    `call` applies it. A subclass's constructor validates its arguments and
    passes `fn`, `reduction`, `name`, `dtype` and the rest as keyword
    arguments of `fn`; `get_config` then lists exactly those arguments (a
    `keras.Variable` argument, such as `delta`, as its current value, or
    the chosen one while `DeltaWarmup` holds it).

    The keyword arguments read as attributes (`loss.delta`,
    `loss.ignore_class`). `fn` gives 0 on the rows labelled
    `ignore_class`, and `__call__` leaves them out of the mean, as
    `keras.losses.SparseCategoricalCrossentropy(ignore_class=...)` does,
    together with the rows a Keras mask on `y_pred` leaves out.
    Sample weights of shape `[batch]` weight every row of a sample (every
    token of a sentence). A batch without rows gives empty per-row values,
    and a reduced loss of 0.

    Args:
        fn: the per-row loss function.
        reduction: as in `keras.losses.Loss`. Defaults to
            `"sum_over_batch_size"`.
        name: as in `keras.losses.Loss`. Defaults to `None`.
        dtype: as in `keras.losses.Loss`. Defaults to `None`.
        **kwargs: the keyword arguments of `fn`.
    """

    def __init__(
        self,
        fn,
        reduction="sum_over_batch_size",
        name=None,
        dtype=None,
        **kwargs,
    ):
        super().__init__(name=name, reduction=reduction, dtype=dtype)
        self.fn = fn
        self._fn_kwargs = kwargs

    def __getattr__(self, name):
        # Only called for names that are not set on the instance.
        kwargs = self.__dict__.get("_fn_kwargs", {})
        if name in kwargs:
            return kwargs[name]
        raise AttributeError(
            f"{type(self).__name__!r} object has no attribute {name!r}"
        )

    def call(self, y_true, y_pred):
        if _common.has_no_rows(y_pred):
            return _common.no_rows(y_pred)
        values = self.fn(y_true, y_pred, **self._fn_kwargs)
        # `__call__` leaves the ignored rows out through the weights: the
        # function's Keras mask on them would take the mean a second time.
        set_keras_mask(values, None)
        return values

    def row_values(self, y_true, y_pred, **overrides):
        """The per-row values, float32, with some keyword arguments of
        `fn` overridden (`delta=0.5`): what the same loss with other
        settings would give, for a filter that needs it."""
        y_true = keras.tree.map_structure(
            lambda t: ops.convert_to_tensor(t, dtype=self.dtype), y_true
        )
        y_pred = ops.convert_to_tensor(y_pred, dtype=self.dtype)
        kwargs = {**self._fn_kwargs, **overrides}
        return ops.cast(self.fn(y_true, y_pred, **kwargs), "float32")

    def __call__(self, y_true, y_pred, sample_weight=None):
        rows = ops.shape(y_pred)[:-1]
        if sample_weight is not None:
            # `[batch]` weights weight every row of a sample. A new tensor of
            # the rows' shape: Keras multiplies a mask into it in place on
            # torch.
            sample_weight = _common.rows_rank(sample_weight, rows)
            sample_weight = sample_weight * ops.ones(rows, sample_weight.dtype)
        valid = _common.valid_rows(
            y_true, rows, self._fn_kwargs.get("ignore_class")
        )
        if valid is not None:
            mask = get_keras_mask(y_pred)
            if mask is not None:
                # Keras would take the mean over the rows its mask keeps a
                # second time: the mask joins `valid`, on outputs without it.
                valid = ops.logical_and(valid, ops.cast(mask, "bool"))
                y_pred = ops.copy(y_pred)
            sample_weight = _common.row_weights(
                valid, sample_weight, self.reduction
            )
        loss = super().__call__(y_true, y_pred, sample_weight)
        if self.reduction not in (None, "none") and len(loss.shape):
            # Keras returns the values of a `[0]` batch unreduced.
            loss = ops.sum(loss)
        return loss

    def get_config(self):
        config = super().get_config()
        config["dtype"] = self._dtype_policy.name
        for key, value in self._fn_kwargs.items():
            if isinstance(value, keras.Variable):
                value = _common.chosen_delta(value)
            config[key] = value
        return config


def label_kwargs(label_mode, ignore_class):
    """The validated label arguments shared by the multi-class losses."""
    _common.check_label_mode(label_mode, ignore_class)
    return {
        "label_mode": label_mode,
        "ignore_class": None if ignore_class is None else int(ignore_class),
    }
