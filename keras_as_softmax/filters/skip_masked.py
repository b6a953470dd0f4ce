"""`SkipMasked`: train only on the samples AS-Softmax masks *now*."""

import keras
from keras import ops

from keras_as_softmax._validation import check_bool
from keras_as_softmax._validation import check_fraction
from keras_as_softmax.filters.base import ScoringFilter

# Weight of the newest pass in the moving masked share.
_EMA = 0.1


@keras.saving.register_keras_serializable(package="keras_as_softmax")
class SkipMasked(ScoringFilter):
    """Trains only on the samples that AS-Softmax masks *now*.

    Each batch is first scored by a forward pass in training mode (dropout
    on, moving statistics put back afterwards; or in inference mode, with
    `score_training=False`); the samples with a nonzero loss are queued,
    and a training pass runs on every full batch of them. Exact: a masked
    sample's loss and gradient are 0 (up to dropout, which draws anew in
    the training pass).

    Scoring costs a forward pass, so it runs only while the masked share
    of recent samples (an exponential moving average over passes) is at
    least `min_masked_ratio`; below it, every sample goes to training as
    in a plain step. The decision is taken inside the compiled step, from
    counts the step keeps: training is deterministic for a seed.

    The break-even share is where scoring a batch costs what it saves: if
    a scoring pass costs `b` and a training pass `c`, scoring pays once
    more than `b / c` of the samples are masked. A training pass is a
    forward and a backward pass, the backward about two forwards, so the
    default is a third.

    Args:
        min_masked_ratio: the masked share in [0, 1] of the recent samples
            from which batches are scored. Defaults to `1 / 3`.
        warmup_epochs: epochs trained on everything first. Defaults to `1`.
        anneal_fraction: fraction of the epochs, at the end, trained on
            everything. Defaults to `0.0`.
        score_training: whether the scoring pass runs in training mode, as
            the training pass does (`True`, the default: exact up to
            dropout's draws). `False` scores in inference mode, which
            saves dropout's random draws, but leaves out the samples that
            are masked without dropout and not with it: their gradient is
            small, and not 0.
        score_margin: a scored sample is left out only when its target
            leads by `delta + score_margin` (capped at 1): a margin against
            dropout's noise, for `score_training=False` above all. The
            samples in between go to training, where the training pass's
            loss decides. Masked shares and AS-Speed's counts still use
            `delta`. Defaults to `0.0`.

    Example:

    ```python
    model = keras_as_softmax.ASSpeed(
        base_model, sample_filter=keras_as_softmax.filters.SkipMasked()
    )
    ```
    """

    needs_masking_loss = True

    def __init__(
        self,
        min_masked_ratio=1 / 3,
        warmup_epochs=1,
        anneal_fraction=0.0,
        score_training=True,
        score_margin=0.0,
    ):
        super().__init__(warmup_epochs, anneal_fraction)
        self.min_masked_ratio = check_fraction(
            min_masked_ratio, "min_masked_ratio"
        )
        self.score_training = check_bool(score_training, "score_training")
        self.score_margin = check_fraction(score_margin, "score_margin")

    def state_spec(self):
        return {"masked_share": ((), "float32", 0.0)}

    def should_score(self, state):
        return state["masked_share"] >= self.min_masked_ratio

    def select(self, view, state):
        masked = view.sample_masked
        if self.score_margin:
            masked = _masked_with_margin(view, self.score_margin)
        return masked < 0.5, ops.ones_like(masked)

    def observe(self, seen, state):
        share = state["masked_share"]
        new = seen.masked_samples / ops.maximum(seen.samples, 1.0)
        share = ops.where(
            seen.samples > 0, (1 - _EMA) * share + _EMA * new, share
        )
        return {"masked_share": share}

    def get_config(self):
        return {
            "min_masked_ratio": self.min_masked_ratio,
            **super().get_config(),
            "score_training": self.score_training,
            "score_margin": self.score_margin,
        }


def _masked_with_margin(view, margin):
    """1.0 where every counted row of a sample has a loss of exactly 0 under
    the same AS loss at `delta + margin` (at most 1)."""
    loss = view.loss
    delta = ops.minimum(ops.convert_to_tensor(loss.delta) + margin, 1.0)
    values = loss.row_values(view.y_true, view.y_pred, delta=delta)
    left = ops.logical_and(view.counted_rows, ops.not_equal(values, 0.0))
    while len(left.shape) > 1:
        left = ops.any(left, axis=-1)
    return ops.cast(ops.logical_not(left), "float32")
