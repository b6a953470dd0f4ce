"""Skipping training samples that AS-Softmax has masked (beyond the paper).

AS-Speed (paper eq. 19) saves optimizer updates, but every masked sample
still costs a full forward and backward pass for a gradient that is exactly
zero. `MaskedSampleSkipper` removes that work: `ASSpeed` records, from the
forward pass it runs anyway, which samples were masked, and the skipper's
`tf.data` pipeline leaves those samples out of the next pass over the data,
except for a random `revisit` fraction that keeps checking whether they are
still easy. A skipped sample that would have become hard again is missed
until it is revisited: this is an approximation, so measure its effect on
quality (`benchmarks/as_speed.py` does).
"""

import numpy as np


class MaskedSampleSkipper:
    """Remembers which training samples were masked when last seen.

    Works with `keras_as_softmax.ASSpeed` on the TensorFlow backend (one
    device): pass it as `ASSpeed(..., sample_skipper=skipper)` and train on
    `skipper.dataset(...)`. A token-classification sample counts as masked
    when all of its counted tokens are. The filtered dataset has no known
    length, so Keras may warn that the "input ran out of data" when an epoch
    ends early: that is the skipping, and training goes on.

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
                  jit_compile=True)
    model.fit(skipper.dataset(x_train, y_train, batch_size=32, seed=0), epochs=5)
    ```
    """

    def __init__(self, num_samples, revisit=0.2, seed=None, id_key="sample_id"):
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

    @property
    def masked_fraction(self):
        """Fraction of the training set masked at its last visit."""
        return float(np.mean(self.masked.numpy()))

    def dataset(self, x, y, batch_size, seed=None):
        """A shuffled `tf.data.Dataset` that skips remembered masked samples.

        Args:
            x: dict of input arrays (one row per sample).
            y: label array.
            batch_size: batch size; partial batches are dropped so that
                every batch has one shape (one XLA compilation).
            seed: shuffle seed.

        Returns:
            A dataset of `(x with an id_key entry, y)` batches. It reads the
            memory each time it is iterated, so every epoch skips what the
            previous ones found masked.
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
        revisit, key = self.revisit, self.id_key

        def keep(features, labels):
            was_masked = tf.gather(self.masked, features[key])
            return tf.logical_or(
                tf.logical_not(was_masked), tf.random.uniform([], seed=self.seed) < revisit
            )

        data = data.filter(keep)
        return data.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)

    def record(self, sample_ids, masked, counted):
        """Stores each sample's state from per-row flags (`[batch, ...]`)."""
        import tensorflow as tf

        axes = list(range(1, len(masked.shape)))
        if axes:
            masked = tf.reduce_all(tf.logical_or(masked, tf.logical_not(counted)), axis=axes)
        self.masked.scatter_nd_update(tf.expand_dims(sample_ids, -1), masked)
