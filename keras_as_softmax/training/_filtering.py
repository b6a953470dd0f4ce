"""The filtered train step, written once for every backend.

A drawn batch goes through the filters in order, with a queue after each:

```
drawn batch -> [a memory filter: SkipMaskedLastSeen, InfoBatch] -> queue
            -> [a scoring filter: SkipMasked, SelectiveBackprop] -> queue
            -> training pass on `batch_size` queued rows, when that many wait
```

The filters are plug-ins (`keras_as_softmax.filters.base`): the step calls
their `select` and `observe` and never asks for their types.

Every shape is static: the scoring and training passes run on exactly
`batch_size` rows. The passes come in as `hooks` from the backend's trainer:
`maybe_score(pred, x)` (predictions and regularization penalty) and
`maybe_train(pred, x, y, coefficients)` run one behind a conditional and
return zeros when `pred` is false, so a conditional holds a pass and nothing
else (the gathers of several replicas stay outside). A trainer that adds the
training pass's gradients to the window's sums inside its branch returns
`None` for them.
Everything else is `keras.ops`, and a pass's results are used through
`where` on its predicate.

Each row carries the coefficient that the drawn batch's loss gives it
(`sample_weight`, `ignore_class` positions and the mean's denominator of the
batch it was drawn in), times the `1 / revisit` weight of a revisited
sample. A training pass minimises the sum of coefficient times per-row loss
over its rows, so the gradients of a window add up to the sum of the
windows' batch gradients, without the masked rows' zeros, and their mean
over the drawn batches has the scale of a plain step's.
"""

from typing import NamedTuple

import keras
from keras import ops
from keras.src.backend.common.masking import get_keras_mask

from keras_as_softmax.filters.base import Seen
from keras_as_softmax.filters.base import View
from keras_as_softmax.losses._common import ignore_class_of
from keras_as_softmax.losses._common import rows_rank
from keras_as_softmax.losses._common import valid_rows
from keras_as_softmax.training import _queue
from keras_as_softmax.training._rows import write_rows


class FilterState(NamedTuple):
    score_queue: object  # RowQueue or None (not two filters)
    train_queue: object  # RowQueue
    states: list  # one dict of tensors per filter (`state_spec`)


class StepOutput(NamedTuple):
    grads: list
    trained: object  # float32 scalar: 1.0 when a training pass ran
    scored: object  # float32 scalar: 1.0 when a scoring pass ran
    rows: float  # counted rows observed this step
    masked_rows: float  # masked rows among them
    y: object  # labels of the rows the metrics cover
    y_pred: object  # their predictions (zeros if no pass ran)
    metric_weight: object  # per-row metric weight (0 if not covered)
    covered: object  # per-row 1.0 where the logs cover the row, else 0.0
    loss: object  # the loss of those rows (0 if no pass ran)
    loss_weight: object  # float32 scalar: the loss's weight in the mean

    def metric_args(self, inputs):
        """`(x, y, y_pred, sample_weight, covered)` for the step's
        metrics (`step_shares.update_step_metrics`)."""
        return inputs, self.y, self.y_pred, self.metric_weight, self.covered


def row_flags(loss, y, values, sample_weight):
    """`(counted, masked, valid)` bool per row from per-row loss values.

    `valid`: not `ignore_class`; `counted`: valid with nonzero weight;
    `masked`: counted with a loss of exactly 0.
    """
    valid = row_valid(loss, y, ops.shape(values))
    counted = valid
    if sample_weight is not None:
        weight = _to_rows(sample_weight, values)
        counted = ops.logical_and(valid, ops.not_equal(weight, 0))
    masked = ops.logical_and(counted, ops.equal(values, 0.0))
    return counted, masked, valid


def pick(structure, name, names):
    """The entry of output `name` in a dict keyed by output name, or in a
    list in the order of `names`; anything else is returned as it is."""
    if isinstance(structure, dict):
        return structure[name]
    if isinstance(structure, (list, tuple)):
        return structure[names.index(name)]
    return structure


def check_no_keras_mask(loss, outputs, names=()):
    """Refuses an output that carries a Keras mask (`Embedding(...,
    mask_zero=True)`, `Masking`) where its loss has no `ignore_class`:
    ASSpeed tells the rows that count by their labels, so the mask's rows
    would be counted and trained.

    Args:
        loss: the compiled loss: one, or one per output in a dict or list.
        outputs: a functional model's symbolic outputs, or a step's
            predictions as traced or computed (a subclassed model's mask
            shows only there).
        names: the model's output names, in the order of `outputs`.

    Returns:
        Whether an output carries a mask (its loss has an `ignore_class`).
    """
    names = list(names)
    if isinstance(outputs, dict):
        named = list(outputs.items())
    else:
        outputs = keras.tree.flatten(outputs)
        named = [
            (names[i] if i < len(names) else None, output)
            for i, output in enumerate(outputs)
        ]
    masked = False
    for name, output in named:
        if get_keras_mask(output) is None:
            continue
        masked = True
        output_loss = pick(loss, name, names) if name in names else loss
        if ignore_class_of(output_loss) is None:
            output = "the output" if name is None else f"output {name!r}"
            raise ValueError(
                "ASSpeed counts the rows of a batch by their labels, not "
                f"by Keras masks, and {output} carries one "
                "(from `Embedding(mask_zero=True)` or `Masking`). "
                "Expected the masked positions labelled with a class to "
                "ignore, and the loss told so, e.g. "
                "keras_as_softmax.ASSoftmaxLoss(ignore_class=-1). "
                f"Received: loss={output_loss!r} without `ignore_class`"
            )
    return masked


def row_values(loss, y, y_pred):
    """The loss's per-row values, float32, computed as `Loss.__call__`
    would. The passes that make `y_pred` check its Keras mask first
    (`_checks.check_step_outputs`)."""
    y = keras.tree.map_structure(
        lambda t: ops.convert_to_tensor(t, dtype=loss.dtype), y
    )
    y_pred = keras.tree.map_structure(
        lambda t: ops.convert_to_tensor(t, dtype=loss.dtype), y_pred
    )
    return ops.cast(loss.call(y, y_pred), "float32")


def penalty(model, losses):
    """The sum of a pass's regularization penalties (`losses`, the model's
    `losses` after the pass) as Keras's own step adds them: on TensorFlow
    divided by the number of replicas, whose losses are summed.

    The weights' own penalties (`kernel_regularizer`, ...: Keras lists
    them last, one per regularized trainable weight) count in the value
    but stay out of a training pass's gradients: the
    `AccumulatingOptimizer` adds them once per update
    (`regularize_weights`), as a plain update holds them, however few of a
    window's micro-batches a pass ran on. The rest (activity penalties,
    `add_loss`) depend on the pass's inputs and train with it."""
    in_gradient = len(losses)
    if losses:
        in_gradient -= sum(
            getattr(v, "regularizer", None) is not None
            for v in model.trainable_weights
        )
    total = ops.zeros((), "float32")
    for i, loss in enumerate(losses):
        loss = ops.cast(model._aggregate_additional_loss(loss), "float32")
        total += loss if i < in_gradient else ops.stop_gradient(loss)
    return total


def moving_statistics(model):
    """The inner model's variables that a scoring pass puts back: its
    non-trainable ones (`BatchNormalization`'s moving statistics), except
    dropout's seed state, which advances as in a plain step."""
    return [
        v
        for v in model.inner_model.non_trainable_variables
        if not v.path.endswith("seed_generator_state")
    ]


def _to_rows(weight, rows):
    weight = rows_rank(weight, rows.shape)
    return ops.cast(weight, "float32") * ops.ones_like(rows, "float32")


def row_valid(loss, y, row_shape):
    """Rows that are not `ignore_class`, from the labels alone."""
    valid = valid_rows(y, row_shape, ignore_class_of(loss))
    return ops.ones(row_shape, "bool") if valid is None else valid


def row_coefficients(loss, y, sample_weight, row_shape):
    """`d loss(y, y_pred, sample_weight) / d values` per row, for the
    `"sum_over_batch_size"` and `"sum"` reductions."""
    valid = ops.cast(row_valid(loss, y, row_shape), "float32")
    coefficients = valid
    if sample_weight is not None:
        coefficients = coefficients * _to_rows(sample_weight, valid)
    if loss.reduction == "sum_over_batch_size":
        # The mean is over the valid rows: every row without `ignore_class`.
        coefficients = coefficients / ops.maximum(ops.sum(valid), 1.0)
    return coefficients


def _sample_masked(counted, masked):
    """A sample is masked when all of its counted rows are."""
    flags = ops.logical_or(masked, ops.logical_not(counted))
    while len(flags.shape) > 1:
        flags = ops.all(flags, axis=-1)
    return ops.cast(flags, "float32")


def _sample_counted(counted):
    """1.0 where a sample has a counted row."""
    flags = counted
    while len(flags.shape) > 1:
        flags = ops.any(flags, axis=-1)
    return ops.cast(flags, "float32")


def _sample_loss(counted, values):
    """Each sample's mean loss over its counted rows (0 without any)."""
    counted = ops.cast(counted, "float32")
    total, n = values * counted, counted
    while len(total.shape) > 1:
        total, n = ops.sum(total, axis=-1), ops.sum(n, axis=-1)
    return total / ops.maximum(n, 1.0)


def _pass_flags(loss, rows, y, y_pred, ran, values=None):
    """`(counted, masked, values)` of the rows a pass ran on (none counted
    if it did not run): counted rows carry a nonzero coefficient."""
    if values is None:
        values = row_values(loss, y, y_pred)
    counted, masked, _ = row_flags(loss, rows.y[0], values, None)
    counted = ops.logical_and(counted, rows.coefficients != 0)
    counted = ops.logical_and(counted, ran)
    return counted, ops.logical_and(masked, counted), values


def _rows_of(flag, rows):
    """The scalar `flag` for every row of `rows`."""
    return ops.logical_and(ops.ones_like(rows.counted) > 0, flag)


def _pad_rows(t, size):
    """`t` with rows of zeros after its own, up to `size` rows."""
    rows = ops.shape(t)[0]
    if isinstance(rows, int) and rows == size:
        return t
    zeros = ops.zeros((size - rows, *ops.shape(t)[1:]), t.dtype)
    return ops.concatenate([t, zeros], axis=0)


def _broadcast_rows(values, rows):
    while len(values.shape) < len(rows.shape):
        values = ops.expand_dims(values, -1)
    return values


class Rows(NamedTuple):
    """The per-row pieces a queue carries (each `[batch, ...]`)."""

    x: list  # flattened inputs
    y: list  # flattened labels
    coefficients: object  # float32 row shape
    metric_weight: object  # float32 row shape
    ids: object  # int32 [batch]
    counted: object  # float32 [batch]: 1.0 once the step counted it
    drawn: object  # float32 [batch]: the size of the batch it was drawn in

    def flat(self):
        return [
            *self.x,
            *self.y,
            self.coefficients,
            self.metric_weight,
            self.ids,
            self.counted,
            self.drawn,
        ]

    def logged_loss(self, values):
        """The sum of these rows' per-row `values` as a plain step logs
        their loss, over their number: Keras weighs each drawn batch's
        loss by its size in the epoch's mean, so a row's share is its
        coefficient times the size of the batch it was drawn in."""
        scale = _broadcast_rows(self.drawn, self.coefficients)
        rows = ops.cast(ops.shape(self.drawn)[0], "float32")
        return ops.sum(self.coefficients * scale * values) / rows

    @classmethod
    def unflat(cls, leaves, n_x, n_y):
        x, y = leaves[:n_x], leaves[n_x : n_x + n_y]
        return cls(x, y, *leaves[n_x + n_y :])


def _observe(filters, states, seen):
    """Each filter's state after a pass saw `seen`."""
    observed = [f.observe(seen, state) for f, state in zip(filters, states)]
    return [
        {name: write_rows(state[name], value) for name, value in new.items()}
        for state, new in zip(states, observed)
    ]


def _apply_weight(rows, go, keep, weight):
    """`keep` and the coefficients times `weight` where `go`; else every
    row kept as it was."""
    keep = ops.where(go, keep, True)
    weight = ops.where(ops.logical_and(go, keep), weight, 1.0)
    coefficients = rows.coefficients * _broadcast_rows(
        ops.cast(weight, "float32"), rows.coefficients
    )
    return keep, rows._replace(coefficients=coefficients)


def _drawn_rows(loss, row_tail, x, y, sample_weight, ids):
    """The drawn batch as `Rows`, each with its coefficient in the batch's
    loss, none counted yet."""
    x_leaves = keras.tree.flatten(x)
    y_leaves = keras.tree.flatten(y)
    batch = ops.shape(x_leaves[0])[0]
    row_shape = (batch, *row_tail)
    coefficients = row_coefficients(loss, y_leaves[0], sample_weight, row_shape)
    metric_weight = (
        ops.ones(row_shape, "float32")
        if sample_weight is None
        else _to_rows(sample_weight, coefficients)
    )
    if ids is None:
        ids = ops.zeros((batch,), "int32")
    return Rows(
        x_leaves,
        y_leaves,
        coefficients,
        metric_weight,
        ops.cast(ids, "int32"),
        ops.zeros((batch,), "float32"),
        ops.ones((batch,), "float32") * ops.cast(batch, "float32"),
    )


def _memory_skipped(rows, keep):
    """Counted rows (a nonzero coefficient: valid, weighted) of the samples
    a memory filter leaves out: they count as masked for AS-Speed's rule."""
    counted = ops.cast(rows.coefficients != 0, "float32")
    skipped = _broadcast_rows(
        ops.cast(ops.logical_not(keep), "float32"), counted
    )
    return ops.sum(counted * skipped)


def _scoring_view(loss, rows, y, y_pred, go, draws, epoch, epochs):
    """`(view, counted, masked, values)` of a scoring pass over `rows`."""
    counted, masked, values = _pass_flags(loss, rows, y, y_pred, go)
    view = View(
        rows.ids,
        draws,
        epoch,
        epochs,
        sample_loss=_sample_loss(counted, values),
        sample_masked=_sample_masked(counted, masked),
        counted=_sample_counted(counted),
        loss=loss,
        y_true=y,
        y_pred=y_pred,
        counted_rows=counted,
    )
    return view, counted, masked, values


def _pass_counts(rows, ran, counted, masked, values, epoch):
    """What a pass over `rows` (if `ran`) counts that no earlier pass of
    this step counted (`rows.counted`).

    Returns:
        `(rows, masked_rows, seen)`: float32 sums of such fresh counted
        and masked rows (AS-Speed's counts), and the `Seen` the filters
        observe, whose sample counts are of fresh samples.
    """
    not_seen = 1.0 - rows.counted
    counted_rows = ops.cast(counted, "float32")
    fresh_rows = counted_rows * _broadcast_rows(not_seen, counted_rows)
    sample_masked = _sample_masked(counted, masked)
    fresh_samples = _sample_counted(counted) * not_seen
    seen = Seen(
        rows.ids,
        _rows_of(ran, rows),
        _sample_loss(counted, values),
        sample_masked,
        ops.sum(fresh_samples),
        ops.sum(fresh_samples * sample_masked),
        epoch,
    )
    n_masked = ops.sum(ops.cast(masked, "float32") * fresh_rows)
    return ops.sum(fresh_rows), n_masked, seen


def filtered_step(
    engine,
    loss,
    state,
    x,
    y,
    sample_weight,
    ids,
    draws,
    hooks,
    queue_ops=_queue,
):
    """One train step with filters.

    Args:
        engine: the `FilterEngine` (its filters, queue layout and size,
            epoch schedule).
        loss: the compiled loss.
        state: a `FilterState`.
        x, y, sample_weight: the drawn batch.
        ids: int32 `[batch]` sample ids, or None.
        draws: a function `(filter index, size) -> float32 [size]` of
            uniform draws for the filters that need them.
        hooks: the backend's passes (`filter_engine.Hooks`).
        queue_ops: the queues' `push_pop`: `_queue`'s, or the same for
            eager steps (`_torch.EagerQueue`).

    Returns:
        `(StepOutput, FilterState)`.
    """
    filters = engine.filters
    states = list(state.states)
    memory_at = [i for i, f in enumerate(filters) if not f.scores]
    scoring_at = [i for i, f in enumerate(filters) if f.scores]
    size = engine.batch_size
    layout = engine.layout
    rows = _drawn_rows(loss, engine.row_tail, x, y, sample_weight, ids)
    batch = ops.shape(rows.ids)[0]
    n_x, n_y = len(rows.x), len(rows.y)

    def push_pop(queue, rows, keep):
        """`(rows, ready, queue)`: the first `size` rows after `rows`'
        kept ones joined the queue, whether that many waited, and the
        queue left (without them if so)."""
        packed = layout.pack(rows.flat())
        popped, ready, queue = queue_ops.push_pop(queue, packed, keep, size)
        rows = Rows.unflat(layout.unpack(popped), n_x, n_y)
        return rows, ready, queue

    epoch, epochs = engine.epoch_state()
    count_all = ops.zeros((), "float32")
    count_masked = ops.zeros((), "float32")
    ready = None

    # A memory filter: leave out, without a pass, what it names.
    for i in memory_at:
        memory_filter = filters[i]
        view = View(rows.ids, draws(i, batch), epoch, epochs)
        keep, weight = memory_filter.select(view, states[i])
        keep, rows = _apply_weight(
            rows, memory_filter.active(epoch, epochs), keep, weight
        )
        skipped = _memory_skipped(rows, keep)
        count_all += skipped
        count_masked += skipped
        if scoring_at:
            rows, ready, queue = push_pop(state.score_queue, rows, keep)
            state = state._replace(score_queue=queue)

    # A scoring filter: score, keep what it selects.
    scored = ops.zeros((), "float32")
    for i in scoring_at:
        scoring_filter = filters[i]
        go = ops.logical_and(
            scoring_filter.active(epoch, epochs),
            scoring_filter.should_score(states[i]),
        )
        if ready is not None:
            go = ops.logical_and(go, ready)
        score_x = keras.tree.pack_sequence_as(x, rows.x)
        score_y = keras.tree.pack_sequence_as(y, rows.y)
        y_pred, penalty = hooks.maybe_score(go, score_x)
        n_rows = ops.shape(rows.ids)[0]
        view, counted, masked, values = _scoring_view(
            loss, rows, score_y, y_pred, go, draws(i, n_rows), epoch, epochs
        )
        scored_rows = (score_y, y_pred, rows, values, penalty)
        keep, weight = scoring_filter.select(view, states[i])
        keep, rows = _apply_weight(rows, go, keep, weight)
        if ready is not None:
            keep = ops.logical_and(keep, ready)
        n_all, n_masked, seen = _pass_counts(
            rows, go, counted, masked, values, epoch
        )
        scored = ops.cast(go, "float32")
        count_all += n_all
        count_masked += n_masked
        states = _observe(filters, states, seen)
        rows = rows._replace(
            counted=ops.where(go, ops.ones_like(rows.counted), rows.counted)
        )

    # The training pass, on `size` queued rows.
    rows, full, queue = push_pop(state.train_queue, rows, keep)
    state = state._replace(train_queue=queue)
    train_x = keras.tree.pack_sequence_as(x, rows.x)
    train_y = keras.tree.pack_sequence_as(y, rows.y)
    grads, y_pred, values, value = hooks.maybe_train(
        full, train_x, train_y, rows.coefficients
    )
    counted, masked, values = _pass_flags(
        loss, rows, train_y, y_pred, full, values
    )
    n_all, n_masked, seen = _pass_counts(
        rows, full, counted, masked, values, epoch
    )
    state = state._replace(states=_observe(filters, states, seen))
    trained = ops.cast(full, "float32")
    # The pass's loss is `sum(coefficients * values) + penalty`; a row drawn
    # in a smaller batch (an epoch's last) has a larger coefficient there.
    penalty = value - ops.sum(rows.coefficients * values)
    train_out = (
        train_y,
        y_pred,
        rows.metric_weight * trained,
        ops.ones_like(rows.metric_weight) * trained,
        penalty + rows.logged_loss(values),
        trained * size,
    )
    output = _output(
        grads,
        trained,
        scored,
        count_all + n_all,
        count_masked + n_masked,
        train_out,
        scored_rows if scoring_at else None,
        go if scoring_at else None,
    )
    return output, state


def _output(
    grads, trained, scored, rows, masked_rows, train_out, scored_rows, go
):
    """The `StepOutput`. The logs cover what a plain step's would, the rows
    drawn, where a scoring pass saw them; else the rows a training pass ran
    on (`train_out`: labels, predictions, metric weights, the rows
    covered, loss, and the loss's weight in the epoch's mean: its rows, as
    Keras weighs a batch's loss by its size)."""
    metric_y, metric_pred, metric_weight, covered, value, loss_weight = (
        train_out
    )
    if scored_rows is not None:
        score_y, score_pred, score_rows, score_values, penalty = scored_rows
        # A drawn batch smaller than a training pass's (an epoch's last)
        # is scored as it is; for the logs, zero rows that they do not
        # cover pad it to the pass's rows.
        drawn = ops.shape(score_rows.metric_weight)[0]
        pass_rows = ops.shape(metric_weight)[0]
        pad = lambda t: _pad_rows(t, pass_rows)  # noqa: E731
        pick = lambda a, b: ops.where(go, pad(a), b)  # noqa: E731
        metric_y = keras.tree.map_structure(pick, score_y, metric_y)
        metric_pred = pick(score_pred, metric_pred)
        metric_weight = pick(score_rows.metric_weight, metric_weight)
        covered = pick(ops.ones_like(score_rows.metric_weight), covered)
        score_value = score_rows.logged_loss(score_values)
        value = ops.where(go, score_value + penalty, value)
        loss_weight = ops.where(go, ops.cast(drawn, "float32"), loss_weight)
    return StepOutput(
        grads=grads,
        trained=trained,
        scored=scored,
        rows=rows,
        masked_rows=masked_rows,
        y=metric_y,
        y_pred=metric_pred,
        metric_weight=metric_weight,
        covered=covered,
        loss=value,
        loss_weight=loss_weight,
    )
