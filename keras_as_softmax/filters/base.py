"""The sample-filter plug-in protocol of `ASSpeed`'s filtered step.

A filter decides, for the rows of a drawn batch, which go on to a training
pass and with what weight. It declares what it needs and owns its state;
the filtered step (`keras_as_softmax.training._filtering`) loops over the
filters without knowing their types:

* `scores`: whether it decides from a scoring pass (a forward pass over the
  batch before training, `ScoringFilter`), or without a pass from what it
  remembers of each sample (`MemoryFilter`).
* `needs_sample_ids` and `needs_draws`: the inputs it reads besides the
  scores: sample ids (`with_sample_ids`, `index_dataset`; `fit` refuses
  data without them) and uniform draws that are a function of its `seed`
  and of the batch's index in training, so a run is repeatable and a
  resumed run draws the same.
* `needs_masking_loss`: whether it skips the samples whose loss is exactly
  0, which only an AS loss gives (`ASSpeed` then refuses other losses).
* `state_spec()`: its state, `{name: (shape, dtype, initial value)}`.
  `ASSpeed` holds it as non-trainable weights (saved with the model,
  carried through JAX's pure step) and passes it as a dict of tensors.
* `select(view, state)`: the one deciding method: `(keep, weight)`, bool
  and float32 per sample.
* `observe(seen, state)`: the new state after a pass saw some samples.

A step runs the memory filter first, on the drawn batch, and the scoring
filter on what it keeps: a pass is worth running only on the samples that
memory did not leave out. `as_list` checks that order.

Every method is written in `keras.ops` on static shapes, so a filter runs
inside one compiled step on every backend.
"""

from typing import NamedTuple

from keras import ops

from keras_as_softmax._validation import check_fraction
from keras_as_softmax._validation import check_int


class View(NamedTuple):
    """What a filter sees of the samples it decides on (each `[batch]`).

    Attributes:
        ids: int32 sample ids (zeros without them).
        draws: float32 uniform draws in [0, 1) (`None` unless
            `needs_draws`).
        epoch, epochs: int32 scalars, the running epoch (0-based) of
            `fit` and its number of epochs.
        sample_loss: float32, each sample's mean loss over its counted rows
            (scoring filters only; else `None`).
        sample_masked: float32, 1.0 where all counted rows of the sample
            have loss exactly 0 (scoring filters only).
        counted: float32, 1.0 where the sample has a counted row (scoring
            filters only).
        loss: the compiled loss (scoring filters only).
        y_true, y_pred: the labels and the scoring pass's predictions
            (scoring filters only), from which a filter may compute what
            it needs beyond the loss's values.
        counted_rows: bool, the counted rows, in the loss's row shape
            (`[batch]`, or `[batch, tokens]`; scoring filters only).
    """

    ids: object
    draws: object
    epoch: object
    epochs: object
    sample_loss: object = None
    sample_masked: object = None
    counted: object = None
    loss: object = None
    y_true: object = None
    y_pred: object = None
    counted_rows: object = None


class RowUpdate(NamedTuple):
    """A state entry that `observe` changed in some rows only: `values`
    written at `ids` along its first axis, the other rows as they were.
    `ASSpeed` writes them in place where the state is a variable
    (TensorFlow, PyTorch), so that a step does not copy a per-sample
    memory whole, and scatters them into the value on JAX.

    Attributes:
        ids: int32 `[n]`, the rows written.
        values: `[n, ...]`, their new values.
    """

    ids: object
    values: object


class Seen(NamedTuple):
    """What a pass saw, for `observe`.

    Attributes:
        ids: int32 `[batch]` sample ids of the pass's rows.
        ran: bool `[batch]`, the rows the pass ran on.
        sample_loss, sample_masked: float32 `[batch]`, as in `View`.
        samples, masked_samples: float32 scalars: the samples with a
            counted row that the pass saw first in this step, and those
            among them that are masked.
        epoch: int32 scalar.
    """

    ids: object
    ran: object
    sample_loss: object
    sample_masked: object
    samples: object
    masked_samples: object
    epoch: object


class SampleFilter:
    """Base class of the filters: the schedule, the config, the protocol.

    Args:
        warmup_epochs: epochs trained on everything first. Defaults to `1`.
        anneal_fraction: fraction of the epochs, at the end, trained on
            everything. Defaults to `0.0`.
    """

    scores = False
    needs_masking_loss = False
    needs_sample_ids = False
    needs_draws = False
    seed = None

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

    def state_spec(self):
        """`{name: (shape, dtype, initial value)}` of the filter's state."""
        return {}

    def select(self, view, state):
        """`(keep, weight)`: bool and float32 `[batch]`. A kept sample's
        loss is multiplied by its weight in the training pass."""
        raise NotImplementedError

    def observe(self, seen, state):
        """The state after a pass saw `seen` (a `Seen`): its entries, each
        a new value or the `RowUpdate` of the rows that changed."""
        return state

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


class ScoringFilter(SampleFilter):
    """A filter that decides from a scoring pass: a forward pass over the
    batch, in training mode unless `score_training` is False.

    `should_score(state)` says whether a batch is worth the pass (by
    default always); a batch that is not scored goes to training whole.
    """

    scores = True
    score_training = True

    def should_score(self, state):
        """bool scalar: whether to score the next batch."""
        return ops.convert_to_tensor(True)


class MemoryFilter(SampleFilter):
    """A filter that decides without a pass, from what it remembers of
    each sample (its state holds one value per sample id).

    Args:
        num_samples: the size of the training set: sample ids are in
            `[0, num_samples)`, which `fit` checks before training.
        warmup_epochs, anneal_fraction: as in `SampleFilter`.
    """

    needs_sample_ids = True

    def __init__(self, num_samples, warmup_epochs=1, anneal_fraction=0.0):
        super().__init__(warmup_epochs, anneal_fraction)
        self.num_samples = check_int(num_samples, "num_samples", 1)

    def get_config(self):
        return {"num_samples": self.num_samples, **super().get_config()}

    def masked_when_seen(self, state):
        """float32 per sample: 1.0 where masked when last seen."""
        raise NotImplementedError


def as_list(sample_filter):
    """The filters as a list (`None` gives `[]`), checked: at most one
    memory filter, first, then at most one scoring filter."""
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
                "filter (SkipMasked, SelectiveBackprop, SkipMaskedLastSeen, "
                f"InfoBatch), or a list of them. Received: {f!r}"
            )
    kinds = ["score" if f.scores else "memory" for f in filters]
    if kinds not in ([], ["score"], ["memory"], ["memory", "score"]):
        raise ValueError(
            "Expected at most two filters: a MemoryFilter (such as "
            "SkipMaskedLastSeen or InfoBatch) first, which leaves samples "
            "out without a pass, then a ScoringFilter (such as SkipMasked "
            "or SelectiveBackprop), which scores what the first kept, as "
            "in [SkipMaskedLastSeen(n), SkipMasked()]. "
            f"Received: sample_filter={filters!r}"
        )
    return filters
