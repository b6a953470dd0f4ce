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
* `SelectiveBackprop` keeps a fixed share of each scored batch, drawn by
  loss rank (Jiang et al. 2019, as Composer implements it), for any loss.
* A memory filter, then a scoring filter: `ASSpeed(model,
  sample_filter=[SkipMaskedLastSeen(n), SkipMasked()])`. The samples the
  first keeps are scored by the second.

A filter of your own subclasses `ScoringFilter` or `MemoryFilter` and
implements `select` (and, to keep state, `state_spec` and `observe`).

The samples a filter keeps are queued in fixed-size buffers, and a
training pass runs whenever a full batch of them is waiting, on exactly
that many samples (Selective-Backprop's queue). Every shape is static, so
filters compile under XLA and run on JAX. A filter is a plug-in
(`keras_as_softmax.filters.base`): it declares what it needs, owns the spec
of its state and decides keep and weight in one method; `ASSpeed` holds the
state (and the queues) as non-trainable weights, saved with the model.

Each filter trains on everything for its first `warmup_epochs` epochs
(Selective-Backprop) and, with `anneal_fraction`, for the last part of
training (InfoBatch trains on everything for its last 12.5% of epochs).
"""

from keras_as_softmax.filters.base import MemoryFilter
from keras_as_softmax.filters.base import RowUpdate
from keras_as_softmax.filters.base import SampleFilter
from keras_as_softmax.filters.base import ScoringFilter
from keras_as_softmax.filters.base import Seen
from keras_as_softmax.filters.base import View
from keras_as_softmax.filters.last_seen import InfoBatch
from keras_as_softmax.filters.last_seen import LastSeenFilter
from keras_as_softmax.filters.last_seen import SkipMaskedLastSeen
from keras_as_softmax.filters.sample_ids import INPUTS_KEY
from keras_as_softmax.filters.sample_ids import SAMPLE_ID_KEY
from keras_as_softmax.filters.sample_ids import attach_sample_ids
from keras_as_softmax.filters.sample_ids import index_dataset
from keras_as_softmax.filters.sample_ids import split_sample_ids
from keras_as_softmax.filters.sample_ids import with_sample_ids
from keras_as_softmax.filters.selective_backprop import SelectiveBackprop
from keras_as_softmax.filters.skip_masked import SkipMasked

__all__ = [
    "INPUTS_KEY",
    "SAMPLE_ID_KEY",
    "InfoBatch",
    "LastSeenFilter",
    "MemoryFilter",
    "RowUpdate",
    "SampleFilter",
    "ScoringFilter",
    "Seen",
    "SelectiveBackprop",
    "SkipMasked",
    "SkipMaskedLastSeen",
    "View",
    "attach_sample_ids",
    "index_dataset",
    "split_sample_ids",
    "with_sample_ids",
]
