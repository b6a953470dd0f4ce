"""The filters that leave samples out without a pass, from what the last
pass that saw each sample recorded: `SkipMaskedLastSeen` and `InfoBatch`."""

import keras
from keras import ops

from keras_as_softmax._validation import check_fraction
from keras_as_softmax._validation import check_int
from keras_as_softmax.filters.base import MemoryFilter
from keras_as_softmax.filters.base import RowUpdate


class LastSeenFilter(MemoryFilter):
    """Base class of the filters that leave samples out without a pass,
    from what the last pass that saw each sample recorded.

    `ASSpeed` keeps one float32 value per sample id (a non-trainable
    weight, so `.keras` files and `BackupAndRestore` keep it): every pass
    writes `record(...)` for the samples it ran on, and a drawn sample is
    a candidate for leaving out when `candidates(...)` says so. A
    candidate is still trained on with probability `revisit` and then
    weighted `1 / revisit`, so that the expected gradient is the full one.
    At most `max_skipped_fraction` of a batch is left out on average: when
    a batch holds more candidates, its revisit probability rises to keep
    the cap in expectation, and the weight follows it. Each candidate is
    drawn on its own, so one batch may leave out more than the cap.

    The batches carry each sample's id: wrap the inputs with
    `keras_as_softmax.filters.with_sample_ids` (arrays) or
    `keras_as_softmax.filters.index_dataset` (a `tf.data.Dataset`).
    """

    needs_draws = True
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
        super().__init__(num_samples, warmup_epochs, anneal_fraction)
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

    def state_spec(self):
        return {
            self.memory_name: (
                (self.num_samples,),
                "float32",
                self.memory_initial,
            )
        }

    def select(self, view, state):
        memory = state[self.memory_name]
        remembered = ops.take(memory, view.ids, axis=0)
        candidate = self.candidates(remembered, memory, view.epoch)
        return self.revisit_some(candidate, view.draws)

    def observe(self, seen, state):
        memory = state[self.memory_name]
        new = self.record(seen.sample_loss, seen.sample_masked, seen.epoch)
        new = ops.where(seen.ran, new, ops.take(memory, seen.ids, axis=0))
        return {self.memory_name: RowUpdate(seen.ids, new)}

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

    def revisit_some(self, candidate, draws):
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
    `max_skipped_fraction` of a batch is left out on average: when more
    of it was masked, the revisit probability of that batch rises to keep
    the cap in expectation, and the weight follows it (one batch may leave
    out more, as each sample is drawn on its own). Samples never seen
    count as not masked, so the first epoch trains on everything.

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
        max_skipped_fraction: the largest expected share of a batch left out
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

    needs_masking_loss = True

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

    def masked_when_seen(self, state):
        return ops.cast(state[self.memory_name] > 0.5, "float32")

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
    `1 / (1 - prune)`. A sample is pruned only on the evidence of its own
    recorded loss: one that no pass has seen yet is always trained on
    (with weight 1), and the mean is over the samples seen so far. So the
    first epoch of a fresh model trains on everything, warm-up or not
    (`warmup_epochs=0`, or a `fit` from an `initial_epoch` past the
    warm-up); by default that epoch is the warm-up anyway, and the last
    12.5% of the epochs train on everything too (InfoBatch's annealing).
    Wrap the inputs as for `SkipMaskedLastSeen`.

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
    # No loss recorded yet: below any loss a pass records (which may be
    # negative, as `keras.losses.CosineSimilarity`'s is). Files saved
    # before this sentinel hold 1.0 in their unseen slots, and those
    # samples count as seen with a loss of 1, as they did then.
    memory_initial = float("-inf")

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
        # Below the mean loss of the samples seen so far, and seen.
        seen = memory > self.memory_initial
        total = ops.sum(ops.where(seen, memory, 0.0))
        count = ops.sum(ops.cast(seen, "float32"))
        mean = total / ops.maximum(count, 1.0)
        return ops.logical_and(
            remembered > self.memory_initial, remembered < mean
        )

    def masked_when_seen(self, state):
        return ops.cast(ops.equal(state[self.memory_name], 0.0), "float32")

    def get_config(self):
        return {"prune": self.prune, **super().get_config()}
