"""`StepShares`: the shares `ASSpeed` logs, in one metric."""

import keras
import numpy as np
from keras import ops

_BACKEND = keras.backend.backend()


class StepShares(keras.metrics.Metric):
    """`masked_ratio`, and with filters `trained_fraction` (drawn batches
    with a training pass) and `scored_fraction` (with a scoring pass), in
    one metric with one variable: a compiled step passes each metric
    variable as a buffer of its own.

    The variable holds `[masked rows, counted rows, trained, scored, train
    steps]`; `result` is a dict of the shares, which Keras's logs take as
    entries of their own.
    """

    def __init__(
        self, filters=False, scoring=False, name="step_shares", dtype=None
    ):
        super().__init__(name=name, dtype=dtype)
        self.filters = filters
        self.scoring = scoring
        # Set where an output carries a Keras mask, which a filtered step's
        # queued predictions lose (`_step.update_logs`).
        self.skip_ignored = False
        self.counts = self.add_variable(
            shape=(5,), initializer="zeros", name="counts"
        )

    def update_shares(self, counts, trained=None, scored=None):
        """Adds a step's `(masked, counted)` rows, and for a training step
        whether a training pass and a scoring pass ran (0.0 or 1.0)."""
        values = (
            *counts,
            0.0 if trained is None else trained,
            0.0 if scored is None else scored,
            0.0 if trained is None else 1.0,
        )
        if _BACKEND == "torch":
            # Eager steps: one stack and an in-place addition, where
            # `keras.ops` would convert and check each value.
            import torch

            total = self.counts.value
            total.add_(
                torch.stack(
                    [
                        torch.as_tensor(
                            v, dtype=total.dtype, device=total.device
                        )
                        for v in values
                    ]
                )
            )
            return
        values = [ops.cast(v, self.dtype) for v in values]
        self.counts.assign_add(ops.stack(values))

    def update_state(self, *args, **kwargs):
        raise NotImplementedError("ASSpeed calls `update_shares`.")

    def result(self):
        c = self.counts.value
        divide = ops.divide_no_nan
        if _BACKEND == "jax" and not _is_tracer(c):
            # At an epoch's end, outside the step: one read of the counts,
            # where a dispatch per slice and division would cost a small
            # model's epoch what several of its steps do.
            c = np.asarray(c, "float64")

            def divide(a, b):
                return np.float32(a / b if b else 0.0)

        elif _BACKEND == "torch":
            # Whole counts: two tensor operations.
            def divide(a, b):
                return a / b.clamp(min=1.0)

        shares = {"masked_ratio": divide(c[0], c[1])}
        if self.filters:
            shares["trained_fraction"] = divide(c[2], c[4])
        if self.scoring:
            shares["scored_fraction"] = divide(c[3], c[4])
        return shares

    def get_config(self):
        config = super().get_config()
        config.update(filters=self.filters, scoring=self.scoring)
        return config


def _is_tracer(value):
    import jax

    return isinstance(value, jax.core.Tracer)
