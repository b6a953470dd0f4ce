"""`SelectiveBackprop`: train on a fixed share of each batch, drawn by
loss rank (Jiang et al. 2019), for any loss."""

import keras
from keras import ops

from keras_as_softmax._validation import check_bool
from keras_as_softmax._validation import check_fraction
from keras_as_softmax._validation import check_int
from keras_as_softmax.filters.base import ScoringFilter


@keras.saving.register_keras_serializable(package="keras_as_softmax")
class SelectiveBackprop(ScoringFilter):
    """Keeps a fixed share of each scored batch, drawn by loss rank.

    Each batch is scored by a forward pass; a sample whose loss ranks at
    percentile `q` (the mean rank over the batch, in (0, 1)) is drawn with
    probability proportional to `q ** (1 / keep - 1)`, without
    replacement, until `round(keep * batch)` samples are drawn: the
    selection of Jiang et al.'s Selective-Backprop as Composer implements
    it (`select_using_loss`), with Gumbel top-k sampling so that the draw
    has a static shape. The kept samples are weighted `batch / kept`, so
    the training pass's loss is their mean, as Composer's is.

    Works with any loss, softmax cross entropy included. Unlike
    `SkipMasked` it is not exact: it trains on the hardest samples more
    often than on the others, and never skips more or less than its share.
    Under `ASSpeed`, its scored samples count for the accumulation rule
    as they are: masked or not.

    Args:
        keep: the share of each batch kept, in (0, 1]. Defaults to `0.5`
            (Composer's default).
        seed: optional int seed of the draws.
        warmup_epochs: epochs trained on everything first. Defaults to `1`.
        anneal_fraction: fraction of the epochs, at the end, trained on
            everything. Defaults to `0.0`.
        score_training: whether the scoring pass runs in training mode.
            Defaults to `True`.

    Example:

    ```python
    model = keras_as_softmax.ASSpeed(
        base_model,
        max_steps=1,
        sample_filter=keras_as_softmax.filters.SelectiveBackprop(keep=0.5),
    )
    ```

    Reference:
        Jiang et al., "Accelerating Deep Learning by Focusing on the
        Biggest Losers", 2019; MosaicML Composer,
        `composer/algorithms/selective_backprop`.
    """

    needs_draws = True

    def __init__(
        self,
        keep=0.5,
        seed=None,
        warmup_epochs=1,
        anneal_fraction=0.0,
        score_training=True,
    ):
        super().__init__(warmup_epochs, anneal_fraction)
        self.keep = check_fraction(keep, "keep")
        if self.keep == 0.0:
            raise ValueError(
                "Expected `keep` in (0, 1]: a filter that keeps nothing "
                "never trains. Received: keep=0.0"
            )
        self.seed = None if seed is None else check_int(seed, "seed", 0)
        self.score_training = check_bool(score_training, "score_training")

    def select(self, view, state):
        loss = view.sample_loss
        size = ops.shape(loss)[0]
        n = ops.cast(size, "float32")
        if isinstance(size, int):
            kept = max(1, round(self.keep * size))
        else:  # a batch size known only when the step runs
            kept = ops.maximum(ops.cast(ops.round(self.keep * n), "int32"), 1)
        order = ops.argsort(loss)
        rank = ops.cast(ops.argsort(order), "float32")
        percentile = (rank + 0.5) / n
        log_p = (1.0 / self.keep - 1.0) * ops.log(percentile)
        # Gumbel top-k: the `kept` largest keys are a draw without
        # replacement with probabilities proportional to `exp(log_p)`.
        uniform = ops.clip(view.draws, 1e-7, 1.0 - 1e-7)
        keys = log_p - ops.log(-ops.log(uniform))
        threshold = ops.sort(keys)[size - kept]
        keep = keys >= threshold
        return keep, ops.full((size,), n / ops.cast(kept, "float32"))

    def get_config(self):
        return {
            "keep": self.keep,
            "seed": self.seed,
            **super().get_config(),
            "score_training": self.score_training,
        }
