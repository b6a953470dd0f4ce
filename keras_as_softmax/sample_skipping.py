"""Skipping training samples that AS-Softmax has masked (beyond the paper).

AS-Speed (paper eq. 19) saves optimizer updates, but every masked sample
still costs a full forward and backward pass for a gradient that is exactly
zero. `MaskedSampleSkipper` removes that work: `ASSpeed` records, from the
forward pass it runs anyway, which samples were masked, and its train step
leaves those samples out the next time they are drawn, except for a random
`revisit` fraction that keeps checking whether they are still easy. A
skipped sample that would have become hard again is missed until it is
revisited: this is an approximation, so measure its effect on quality
(`benchmarks/as_speed.py` does).

The skipping happens inside the train step, not in the input pipeline: the
pipeline stays an ordinary one (every epoch has the same number of batches,
so it can be `.repeat()`ed with a fixed `steps_per_epoch`). A pipeline that
filtered samples out would end each epoch early, and Keras would then start
a new `tf.data` iterator every epoch; on TensorFlow 2.21 each of those
stalled the first step of an epoch by seconds to tens of seconds with a
BERT model (the stall goes away while the old iterators are kept alive).
"""

import numpy as np


class MaskedSampleSkipper:
    """Remembers which training samples were masked when last seen.

    Works with `keras_as_softmax.ASSpeed` on the TensorFlow backend, on one
    device, compiled as a graph (`jit_compile=False`: the samples left form
    a batch of data-dependent size, which XLA cannot compile). Pass it as
    `ASSpeed(..., sample_skipper=skipper)` and train on batches that carry
    each sample's index under `id_key` (`skipper.dataset(...)` makes them).
    Each train step then drops the samples that were masked at their last
    visit (keeping a random `revisit` fraction of them, and at least one
    sample) and trains on the rest as a smaller micro-batch; the samples it
    trains on update the memory. A token-classification sample counts as
    masked when all of its counted tokens are.

    Args:
        num_samples: size of the training set.
        revisit: probability in [0, 1] that a sample masked at its last visit
            is trained on anyway. Defaults to `0.2`.
        seed: optional seed of the revisit draws.
        id_key: the input key that carries each sample's index. Defaults to
            `"sample_id"`.

    Example:

    ```python
    skipper = keras_as_softmax.MaskedSampleSkipper(len(y_train))
    model = keras_as_softmax.ASSpeed(base_model, sample_skipper=skipper)
    model.compile(optimizer="adamw", loss=keras_as_softmax.ASSoftmaxLoss(0.3),
                  jit_compile=False)
    data = skipper.dataset(x_train, y_train, batch_size=32, seed=0)
    model.fit(data.repeat(), steps_per_epoch=len(y_train) // 32, epochs=5)
    ```
    """

    def __init__(self, num_samples, revisit=0.2, seed=None, id_key="sample_id"):
        import keras
        import tensorflow as tf

        if not isinstance(num_samples, (int, np.integer)) or num_samples < 1:
            raise ValueError(
                f"Expected `num_samples` to be an int >= 1. Received: {num_samples!r}"
            )
        if not 0.0 <= float(revisit) <= 1.0:
            raise ValueError(f"Expected `revisit` in [0, 1]. Received: revisit={revisit!r}")
        self.num_samples = int(num_samples)
        self.revisit = float(revisit)
        self.seed = seed
        self.id_key = id_key
        self.masked = tf.Variable(
            tf.zeros([self.num_samples], tf.bool), trainable=False, name="masked_samples"
        )
        self._seed_generator = keras.random.SeedGenerator(seed)

    @property
    def masked_fraction(self):
        """Fraction of the training set masked at its last visit."""
        return float(np.mean(self.masked.numpy()))

    def dataset(self, x, y, batch_size, seed=None):
        """A shuffled `tf.data.Dataset` of batches that carry sample ids.

        Args:
            x: dict of input arrays (one row per sample).
            y: label array.
            batch_size: batch size; partial batches are dropped so that
                every batch has one shape.
            seed: shuffle seed (the order changes on every pass).

        Returns:
            A dataset of `(x with an id_key entry, y)` batches, one pass
            over the data; `.repeat()` it and give `fit` a `steps_per_epoch`
            to keep one iterator for the whole fit.
        """
        import tensorflow as tf

        if not isinstance(x, dict):
            raise ValueError(
                "MaskedSampleSkipper.dataset expects `x` as a dict of arrays "
                f"(it adds the {self.id_key!r} key). Received: {type(x).__name__}"
            )
        n = len(y)
        if n != self.num_samples:
            raise ValueError(
                f"Expected {self.num_samples} samples (num_samples). Received: {n}"
            )
        x = dict(x)
        x[self.id_key] = np.arange(n, dtype="int32")
        data = tf.data.Dataset.from_tensor_slices((x, y))
        data = data.shuffle(n, seed=seed, reshuffle_each_iteration=True)
        return data.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)

    def keep(self, sample_ids):
        """Which samples of a batch to train on (bool, `[batch]`).

        Those not masked at their last visit, and each masked one with
        probability `revisit`. If that leaves none, the first sample is
        kept, so that a step never trains on an empty batch.
        """
        import keras
        import tensorflow as tf

        was_masked = tf.gather(self.masked, sample_ids)
        draws = keras.random.uniform(tf.shape(sample_ids), seed=self._seed_generator)
        keep = tf.logical_or(tf.logical_not(was_masked), draws < self.revisit)
        first = tf.equal(tf.range(tf.shape(keep)[0]), 0)
        return tf.logical_or(keep, tf.logical_and(first, tf.logical_not(tf.reduce_any(keep))))

    def record(self, sample_ids, masked, counted):
        """Stores each sample's state from per-row flags (`[batch, ...]`)."""
        import tensorflow as tf

        axes = list(range(1, len(masked.shape)))
        if axes:
            masked = tf.reduce_all(tf.logical_or(masked, tf.logical_not(counted)), axis=axes)
        self.masked.scatter_nd_update(tf.expand_dims(sample_ids, -1), masked)
