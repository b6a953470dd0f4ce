"""Sample filters for `keras_as_softmax.ASSpeed`: which samples to train on.

A masked sample has AS-Softmax loss and gradient exactly 0, so running the
forward and backward passes on it is wasted work. A filter decides, for
each batch that `fit` draws, which samples go on to a training pass:

* `SkipMasked` scores the batch with a forward pass in training mode and
  keeps the samples that are not masked now. Exact: the masked samples'
  gradient is 0 (up to dropout, which draws anew in the training pass).
* `SkipMaskedLastSeen` leaves out, without any pass, the samples that were
  masked when last seen, revisiting each with probability `revisit` and
  weighting it `1 / revisit` so that the expected gradient is the full one
  (InfoBatch's rescaling). An estimate: a sample that became hard again is
  missed until it is revisited.
* Both, in that order: `ASSpeed(model, sample_filter=[SkipMaskedLastSeen(n),
  SkipMasked()])`. The samples the first keeps are scored by the second.

The samples a filter keeps are queued in fixed-size buffers, and a
training pass runs whenever a full batch of them is waiting, on exactly
that many samples (Selective-Backprop's queue). Every shape is static, so
filters compile under XLA and run on JAX. A filter is a policy: it holds
its settings, and `ASSpeed` holds its state (queues, the last-seen memory)
as non-trainable weights, saved with the model.

Each filter trains on everything for its first `warmup_epochs` epochs
(Selective-Backprop) and, with `anneal_fraction`, for the last part of
training (InfoBatch trains on everything for its last 12.5% of epochs).
"""

import keras
from keras import ops

from keras_as_softmax._validation import check_fraction
from keras_as_softmax._validation import check_int


class SampleFilter:
    """Base class of the filters: the shared schedule and config."""

    def __init__(self, warmup_epochs=1, anneal_fraction=0.0):
        self.warmup_epochs = check_int(warmup_epochs, "warmup_epochs", 0)
        self.anneal_fraction = check_fraction(
            anneal_fraction, "anneal_fraction"
        )

    def active(self, epoch, epochs):
        """Whether the filter skips anything in `epoch` (0-based) of
        `epochs` (int32 tensors)."""
        epochs = ops.cast(epochs, "float32")
        last = epochs - ops.ceil(self.anneal_fraction * epochs)
        epoch = ops.cast(epoch, "float32")
        return ops.logical_and(epoch >= self.warmup_epochs, epoch < last)

    def get_config(self):
        return {
            "warmup_epochs": self.warmup_epochs,
            "anneal_fraction": self.anneal_fraction,
        }

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


@keras.saving.register_keras_serializable(package="keras_as_softmax")
class SkipMasked(SampleFilter):
    """Trains only on the samples that AS-Softmax masks *now*.

    Each batch is first scored by a forward pass in training mode (dropout
    on, moving statistics put back afterwards); the samples with a nonzero
    loss are queued, and a training pass runs on every full batch of them.
    Scoring costs a forward pass, so it runs only while the masked share
    of recent samples is at least `min_masked_ratio`; below it, every
    sample goes to training as in a plain step.

    The break-even share is where the scoring pass costs what it saves:
    with a training pass (forward and backward) about three forward
    passes, scoring pays once more than a third of the samples are
    masked. `min_masked_ratio=0.5` leaves a margin for the queue's copies
    and for models whose backward pass is relatively cheaper;
    `benchmarks/step_cost.py` measures the break-even for a model.

    Args:
        min_masked_ratio: masked share of the recent samples (an
            exponential moving average over batches) from which batches
            are scored. Defaults to `0.5`.
        warmup_epochs: epochs trained on everything first. Defaults to `1`.
        anneal_fraction: fraction of the epochs, at the end, trained on
            everything. Defaults to `0.0`.

    Example:

    ```python
    model = keras_as_softmax.ASSpeed(
        base_model, sample_filter=keras_as_softmax.filters.SkipMasked()
    )
    ```
    """

    needs_sample_ids = False
    scores = True

    def __init__(
        self, min_masked_ratio=0.5, warmup_epochs=1, anneal_fraction=0.0
    ):
        super().__init__(warmup_epochs, anneal_fraction)
        self.min_masked_ratio = check_fraction(
            min_masked_ratio, "min_masked_ratio"
        )

    def get_config(self):
        return {
            "min_masked_ratio": self.min_masked_ratio,
            **super().get_config(),
        }


@keras.saving.register_keras_serializable(package="keras_as_softmax")
class SkipMaskedLastSeen(SampleFilter):
    """Leaves out the samples that were masked when last seen.

    Needs no extra pass: `ASSpeed` remembers, per sample id, whether the
    sample was masked the last time a pass saw it (a non-trainable weight,
    so `.keras` files and `BackupAndRestore` keep it). A sample masked when
    last seen is revisited with probability `revisit` and then weighted
    `1 / revisit`, so the expected gradient equals the full one
    (InfoBatch, Qin et al. 2024). At most `max_skipped_fraction` of a
    batch is left out: when more of it was masked, the revisit probability
    of that batch rises to keep the cap, and the weight follows it.
    Samples never seen count as not masked, so the first epoch trains on
    everything.

    The batches carry each sample's id: wrap the inputs with
    `keras_as_softmax.filters.with_sample_ids` (arrays) or
    `keras_as_softmax.filters.index_dataset` (a `tf.data.Dataset`).

    Args:
        num_samples: size of the training set (ids are in
            `[0, num_samples)`).
        revisit: probability in (0, 1] that a sample masked when last seen
            is trained on anyway. Defaults to `0.2`.
        max_skipped_fraction: the largest share of a batch left out
            without a pass, in [0, 1]. Defaults to `0.75`.
        seed: optional int seed of the revisit draws.
        warmup_epochs: epochs trained on everything first. Defaults to `1`.
        anneal_fraction: fraction of the epochs, at the end, trained on
            everything. Defaults to `0.0`.

    Example:

    ```python
    n = len(y_train)
    model = keras_as_softmax.ASSpeed(
        base_model,
        sample_filter=keras_as_softmax.filters.SkipMaskedLastSeen(n),
    )
    x = keras_as_softmax.filters.with_sample_ids(x_train)
    model.fit(x, y_train, batch_size=32, epochs=8)
    ```

    Reference:
        Qin et al., "InfoBatch: Lossless Training Speed Up by Unbiased
        Dynamic Data Pruning", ICLR 2024.
    """

    needs_sample_ids = True
    scores = False

    def __init__(
        self,
        num_samples,
        revisit=0.2,
        max_skipped_fraction=0.75,
        seed=None,
        warmup_epochs=1,
        anneal_fraction=0.0,
    ):
        super().__init__(warmup_epochs, anneal_fraction)
        self.num_samples = check_int(num_samples, "num_samples", 1)
        self.revisit = check_fraction(revisit, "revisit")
        if self.revisit == 0.0:
            raise ValueError(
                "Expected `revisit` in (0, 1]: a sample that is never "
                "revisited stays out for good. Received: revisit=0.0"
            )
        self.max_skipped_fraction = check_fraction(
            max_skipped_fraction, "max_skipped_fraction"
        )
        self.seed = None if seed is None else check_int(seed, "seed", 0)

    def select(self, was_masked, draws):
        """Which rows to keep, and their weights.

        Args:
            was_masked: bool `[batch]`, masked when last seen.
            draws: float `[batch]`, uniform in [0, 1).

        Returns:
            `(keep, weight)`: bool `[batch]` and float32 `[batch]`.
        """
        batch = ops.cast(ops.shape(was_masked)[0], "float32")
        n_was = ops.sum(ops.cast(was_masked, "float32"))
        cap = self.max_skipped_fraction * batch
        revisit = ops.maximum(self.revisit, 1.0 - cap / ops.maximum(n_was, 1.0))
        keep = ops.logical_or(ops.logical_not(was_masked), draws < revisit)
        weight = ops.where(
            ops.logical_and(was_masked, keep),
            1.0 / ops.maximum(revisit, 1e-6),
            1.0,
        )
        return keep, weight

    def get_config(self):
        return {
            "num_samples": self.num_samples,
            "revisit": self.revisit,
            "max_skipped_fraction": self.max_skipped_fraction,
            "seed": self.seed,
            **super().get_config(),
        }


INPUTS_KEY = "inputs"
SAMPLE_ID_KEY = "sample_id"


def with_sample_ids(x, ids=None):
    """Attaches sample ids to inputs `x` (arrays, a tuple or a dict).

    Returns `{"inputs": x, "sample_id": ids}`, the form that
    `ASSpeed` with `SkipMaskedLastSeen` trains on; `ids` default to
    `0..n-1`. Prediction and evaluation take the plain `x` as well.
    """
    import numpy as np

    first = keras.tree.flatten(x)[0]
    n = len(first)
    ids = np.arange(n, dtype="int32") if ids is None else np.asarray(ids)
    return attach_sample_ids(x, ids.astype("int32"))


def index_dataset(dataset):
    """Attaches each element's position to an *unbatched* `tf.data.Dataset`
    of `(x, y)` or `(x, y, sample_weight)` elements.

    Call it before `shuffle` and `batch`, so that a sample keeps its id
    across epochs:

    ```python
    data = keras_as_softmax.filters.index_dataset(
        tf.data.Dataset.from_tensor_slices((x, y))
    ).shuffle(n).batch(32)
    ```
    """

    import tensorflow as tf  # tf.data runs TensorFlow ops on every backend

    def attach(index, element):
        x, *rest = element
        return (attach_sample_ids(x, tf.cast(index, tf.int32)), *rest)

    return dataset.enumerate().map(attach)


def attach_sample_ids(x, ids):
    """`{"inputs": x, "sample_id": ids}` for tensors of one batch."""
    return {INPUTS_KEY: x, SAMPLE_ID_KEY: ids}


def split_sample_ids(x):
    """`(inputs, ids)` from inputs made by `with_sample_ids`, else
    `(x, None)`."""
    if isinstance(x, dict) and set(x) == {INPUTS_KEY, SAMPLE_ID_KEY}:
        return x[INPUTS_KEY], x[SAMPLE_ID_KEY]
    return x, None


def as_list(sample_filter):
    """The filters as a list (`None` gives `[]`), checked."""
    if sample_filter is None:
        return []
    filters = (
        list(sample_filter)
        if isinstance(sample_filter, (list, tuple))
        else [sample_filter]
    )
    for f in filters:
        if not isinstance(f, SampleFilter):
            raise ValueError(
                "Expected `sample_filter` to be a "
                "keras_as_softmax.filters.SkipMasked or SkipMaskedLastSeen, "
                f"or a list of them. Received: {f!r}"
            )
    kinds = [type(f) for f in filters]
    if len(set(kinds)) != len(kinds) or (
        len(filters) == 2 and not isinstance(filters[0], SkipMaskedLastSeen)
    ):
        raise ValueError(
            "Expected at most one filter of each kind, with "
            "SkipMaskedLastSeen first: [SkipMaskedLastSeen(n), SkipMasked()]. "
            f"Received: sample_filter={filters!r}"
        )
    return filters
