"""Sample filters for `keras_as_softmax.ASSpeed`: which samples to train on.

A masked sample has AS-Softmax loss and gradient exactly 0, so running the
forward and backward passes on it is wasted work. A filter decides, for
each batch that `fit` draws, which samples go on to a training pass:

* `SkipMasked` scores the batch with a forward pass in training mode and
  keeps the samples that are not masked now. Exact: the masked samples'
  gradient is 0 (up to dropout, which draws anew in the training pass).
  With `score_training=False` it scores in inference mode: cheaper, and
  no longer exact where dropout would unmask a sample.
* `SkipMaskedLastSeen` leaves out, without any pass, the samples that were
  masked when last seen, revisiting each with probability `revisit` and
  weighting it `1 / revisit` so that the expected gradient is the full one
  (InfoBatch's rescaling). An estimate: a sample that became hard again is
  missed until it is revisited.
* `InfoBatch` is the baseline it is measured against (Qin et al. 2024):
  it leaves out, at random, samples whose loss when last seen was below
  the mean, for any loss.
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
from keras_as_softmax._validation import check_one_of


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
    on, moving statistics put back afterwards; or in inference mode, with
    `score_training=False`); the samples with a nonzero loss are queued,
    and a training pass runs on every full batch of them.
    Scoring costs a forward pass, so it runs only while the masked share
    of recent samples (an exponential moving average over batches) is at
    least `min_masked_ratio`; below it, every sample goes to training as
    in a plain step. The decision is taken inside the compiled step, from
    counts the step keeps: training is deterministic for a seed.

    The break-even share is where scoring a batch costs what it saves: if
    a scoring pass costs `b` and a training pass `c`, scoring pays once
    more than `b / c` of the samples are masked. A training pass is a
    forward and a backward pass, the backward about two forwards, so the
    default is a third. A model whose backward pass is relatively dearer
    (frozen embeddings aside, most are near 2x) breaks even earlier.

    Args:
        min_masked_ratio: the masked share in [0, 1] of the recent samples
            from which batches are scored. Defaults to `1 / 3`.
        warmup_epochs: epochs trained on everything first. Defaults to `1`.
        anneal_fraction: fraction of the epochs, at the end, trained on
            everything. Defaults to `0.0`.
        score_training: whether the scoring pass runs in training mode, as
            the training pass does (`True`, the default: exact up to
            dropout's draws). `False` scores in inference mode, which
            saves dropout's random draws, about a third of a forward pass
            on a CPU (MiniLM), but leaves out the samples that are masked
            without dropout and not with it: their gradient is small, and
            not 0.
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

    needs_sample_ids = False
    scores = True

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
        self.score_training = bool(
            check_one_of(score_training, "score_training", (True, False))
        )
        self.score_margin = check_fraction(score_margin, "score_margin")

    def get_config(self):
        return {
            "min_masked_ratio": self.min_masked_ratio,
            **super().get_config(),
            "score_training": self.score_training,
            "score_margin": self.score_margin,
        }


class LastSeenFilter(SampleFilter):
    """Base class of the filters that leave samples out without a pass,
    from what the last pass that saw each sample recorded.

    `ASSpeed` keeps one float32 value per sample id (a non-trainable
    weight, so `.keras` files and `BackupAndRestore` keep it): every pass
    writes `record(...)` for the samples it ran on, and a drawn sample is
    a candidate for leaving out when `candidates(...)` says so. A
    candidate is still trained on with probability `revisit` and then
    weighted `1 / revisit`, so that the expected gradient is the full one.
    At most `max_skipped_fraction` of a batch is left out: when a batch
    holds more candidates, its revisit probability rises to keep the cap,
    and the weight follows it.

    The batches carry each sample's id: wrap the inputs with
    `keras_as_softmax.filters.with_sample_ids` (arrays) or
    `keras_as_softmax.filters.index_dataset` (a `tf.data.Dataset`).
    """

    needs_sample_ids = True
    scores = False
    # Name and initial value of the per-sample memory.
    memory_name = None
    memory_initial = 0.0

    def __init__(
        self,
        num_samples,
        revisit,
        max_skipped_fraction,
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

    def record(self, sample_loss, sample_masked, epoch):
        """The memory value of samples that a pass just saw.

        Args:
            sample_loss: float32 `[batch]`, the mean loss of each sample's
                counted rows (0 without any).
            sample_masked: float32 `[batch]`, 1.0 where all of them are
                masked.
            epoch: int32 scalar, the running epoch (0-based).
        """
        raise NotImplementedError

    def candidates(self, remembered, memory, epoch):
        """bool `[batch]`: which drawn samples may be left out in `epoch`,
        from their `remembered` values and the whole `memory`."""
        raise NotImplementedError

    def masked_when_seen(self, memory):
        """float32 per sample: 1.0 where masked when last seen."""
        raise NotImplementedError

    def select(self, candidate, draws):
        """Which rows to keep, and their weights.

        Args:
            candidate: bool `[batch]`, may be left out.
            draws: float `[batch]`, uniform in [0, 1).

        Returns:
            `(keep, weight)`: bool `[batch]` and float32 `[batch]`.
        """
        batch = ops.cast(ops.shape(candidate)[0], "float32")
        n_candidates = ops.sum(ops.cast(candidate, "float32"))
        cap = self.max_skipped_fraction * batch
        revisit = ops.maximum(
            self.revisit, 1.0 - cap / ops.maximum(n_candidates, 1.0)
        )
        keep = ops.logical_or(ops.logical_not(candidate), draws < revisit)
        weight = ops.where(
            ops.logical_and(candidate, keep),
            1.0 / ops.maximum(revisit, 1e-6),
            1.0,
        )
        return keep, weight

    def get_config(self):
        return {
            "num_samples": self.num_samples,
            "seed": self.seed,
            **super().get_config(),
        }


@keras.saving.register_keras_serializable(package="keras_as_softmax")
class SkipMaskedLastSeen(LastSeenFilter):
    """Leaves out the samples that were masked when last seen.

    Needs no extra pass: `ASSpeed` remembers, per sample id, whether the
    sample was masked the last time a pass saw it. A sample masked when
    last seen is revisited with probability `revisit` and then weighted
    `1 / revisit`, so the expected gradient equals the full one
    (InfoBatch's rescaling, Qin et al. 2024). At most
    `max_skipped_fraction` of a batch is left out: when more of it was
    masked, the revisit probability of that batch rises to keep the cap,
    and the weight follows it. Samples never seen count as not masked, so
    the first epoch trains on everything.

    What the memory says goes stale: a left-out sample is not seen, and
    some of them have a gradient again epochs later. With
    `max_skipped_epochs=k`, a sample last seen masked more than `k` epochs
    ago is seen again (with weight 1: it is not a random revisit), so each
    sample is seen at least once every `k + 1` epochs.

    The batches carry each sample's id: wrap the inputs with
    `keras_as_softmax.filters.with_sample_ids` (arrays) or
    `keras_as_softmax.filters.index_dataset` (a `tf.data.Dataset`).

    Args:
        num_samples: size of the training set (ids are in
            `[0, num_samples)`).
        revisit: probability in (0, 1] that a sample masked when last seen
            is trained on anyway. Defaults to `0.5`.
        max_skipped_fraction: the largest share of a batch left out
            without a pass, in [0, 1]. Defaults to `0.75`.
        seed: optional int seed of the revisit draws.
        max_skipped_epochs: `None` (the default), or an int >= 1: the most
            epochs in a row that a sample masked when last seen is left
            out for.
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

    memory_name = "last_seen_masked"

    def __init__(
        self,
        num_samples,
        revisit=0.5,
        max_skipped_fraction=0.75,
        seed=None,
        max_skipped_epochs=None,
        warmup_epochs=1,
        anneal_fraction=0.0,
    ):
        super().__init__(
            num_samples,
            revisit,
            max_skipped_fraction,
            seed,
            warmup_epochs,
            anneal_fraction,
        )
        self.max_skipped_epochs = (
            None
            if max_skipped_epochs is None
            else check_int(max_skipped_epochs, "max_skipped_epochs", 1)
        )

    # The memory holds `1 + the epoch` in which a sample was last seen
    # masked, and 0 where it was last seen with a gradient.

    def record(self, sample_loss, sample_masked, epoch):
        return sample_masked * (ops.cast(epoch, "float32") + 1.0)

    def candidates(self, remembered, memory, epoch):
        masked = remembered > 0.5
        if self.max_skipped_epochs is None:
            return masked
        age = ops.cast(epoch, "float32") + 1.0 - remembered
        return ops.logical_and(masked, age <= self.max_skipped_epochs)

    def masked_when_seen(self, memory):
        return ops.cast(memory > 0.5, "float32")

    def get_config(self):
        return {
            "revisit": self.revisit,
            "max_skipped_fraction": self.max_skipped_fraction,
            "max_skipped_epochs": self.max_skipped_epochs,
            **super().get_config(),
        }


@keras.saving.register_keras_serializable(package="keras_as_softmax")
class InfoBatch(LastSeenFilter):
    """InfoBatch's pruning: leaves out, at random, samples whose loss when
    last seen was below the mean.

    The baseline that `SkipMaskedLastSeen` is measured against, and a
    filter for any loss, softmax cross entropy included: a sample whose
    last recorded loss is below the mean of all recorded losses is left
    out with probability `prune`, and trained on otherwise with weight
    `1 / (1 - prune)`. Every sample starts at a recorded loss of 1, so the
    first epoch trains on everything, and by default the last 12.5% of
    the epochs train on everything too (InfoBatch's annealing). Wrap the
    inputs as for `SkipMaskedLastSeen`.

    Under `ASSpeed`, left-out samples count as masked for the accumulation
    rule; with a loss that masks nothing, pass `max_steps=1` to keep one
    drawn batch per update.

    Args:
        num_samples: size of the training set (ids are in
            `[0, num_samples)`).
        prune: probability in [0, 1) that a below-mean sample is left out.
            Defaults to `0.5` (InfoBatch's default).
        seed: optional int seed of the pruning draws.
        warmup_epochs: epochs trained on everything first. Defaults to `1`.
        anneal_fraction: fraction of the epochs, at the end, trained on
            everything. Defaults to `0.125`.

    Reference:
        Qin et al., "InfoBatch: Lossless Training Speed Up by Unbiased
        Dynamic Data Pruning", ICLR 2024
        (github.com/NUS-HPC-AI-Lab/InfoBatch).
    """

    memory_name = "last_seen_loss"
    memory_initial = 1.0

    def __init__(
        self,
        num_samples,
        prune=0.5,
        seed=None,
        warmup_epochs=1,
        anneal_fraction=0.125,
    ):
        prune = check_fraction(prune, "prune")
        if prune == 1.0:
            raise ValueError(
                "Expected `prune` in [0, 1): a sample pruned with "
                "probability 1 is never trained on again. Received: prune=1.0"
            )
        super().__init__(
            num_samples, 1.0 - prune, 1.0, seed, warmup_epochs, anneal_fraction
        )
        self.prune = prune

    def record(self, sample_loss, sample_masked, epoch):
        return sample_loss

    def candidates(self, remembered, memory, epoch):
        return remembered < ops.mean(memory)

    def masked_when_seen(self, memory):
        return ops.cast(ops.equal(memory, 0.0), "float32")

    def get_config(self):
        return {"prune": self.prune, **super().get_config()}


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
                "Expected `sample_filter` to be a keras_as_softmax.filters "
                "SkipMasked, SkipMaskedLastSeen or InfoBatch, or a list of "
                f"them. Received: {f!r}"
            )
    last_seen = [isinstance(f, LastSeenFilter) for f in filters]
    if len(filters) > 2 or (len(filters) == 2 and last_seen != [True, False]):
        raise ValueError(
            "Expected at most two filters: a last-seen filter first "
            "(SkipMaskedLastSeen or InfoBatch), then SkipMasked, as in "
            "[SkipMaskedLastSeen(n), SkipMasked()]. "
            f"Received: sample_filter={filters!r}"
        )
    return filters
