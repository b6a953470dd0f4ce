"""Investigation (issue 31): how should eager PyTorch run the filters'
passes? It decided PyTorch's eager default.

Three designs, each deciding as the filters do on every backend and
training on the kept rows with their drawn batch's coefficients:

* `queue`: `_filtering.filtered_step` with `_queue`'s static-shape queue,
  as under `torch.compile`: kept rows wait in a queue of `2 * batch`
  rows, a training pass runs on every full batch of them.
* `eager_queue`: the same queue and passes, pushed and popped with slices
  of the kept rows (`_torch.EagerQueue`): eager PyTorch's default.
* `kept_rows`: `kept_rows_step` below, no queue: a training pass on the
  kept rows of every drawn batch that keeps any, in a shape that changes
  from step to step.

`--filter skip_masked` (`SkipMasked(0.0)`) scores every drawn batch and,
with about 1% of the samples unmasked here, trains few rows;
`--filter selective_backprop` trains half of each drawn batch. Plain Keras
and `ASSpeed` without a filter are timed beside them, on
`benchmarks/step_overhead.py`'s tiny MLP (a step that is all overhead, the
stand-in for a fast accelerator) and on a wider one (`--hidden 1024`,
where compute counts).

    KERAS_BACKEND=torch python lab/torch_kept_rows.py
    KERAS_BACKEND=torch python lab/torch_kept_rows.py \
        --filter selective_backprop
    KERAS_BACKEND=torch python lab/torch_kept_rows.py --hidden 1024
"""

import argparse
import os
from unittest import mock

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
from keras import ops  # noqa: E402

import keras_as_softmax as kas  # noqa: E402
from as_softmax_lab.timing import epoch_fit  # noqa: E402
from as_softmax_lab.timing import print_table  # noqa: E402
from as_softmax_lab.timing import time_epochs  # noqa: E402
from as_softmax_lab.tiny_mlp import make_data  # noqa: E402
from keras_as_softmax.filters.base import View  # noqa: E402
from keras_as_softmax.training import _filtering  # noqa: E402
from keras_as_softmax.training import _queue  # noqa: E402
from keras_as_softmax.training import _torch  # noqa: E402


def kept_rows_step(engine, loss, state, x, y, sample_weight, ids, draws, hooks):
    """One train step with filters, each pass on exactly the rows kept.

    For a backend whose batch shape may change from step to step (PyTorch,
    eager). The filters decide as in `filtered_step`, with no queue: a
    scoring pass runs on the rows that the memory filter keeps, the
    training pass on the rows that the scoring filter keeps, in the step
    that drew them, and a pass with no rows does not run. A row's gradient
    is the same as through the queue; it is taken with the weights of the
    step that drew it.

    `hooks` are PyTorch's (`_torch._Hooks`): `score(x)`, `train(x, y,
    coefficients)` and `no_output(x)`.

    Returns:
        `(StepOutput, FilterState)`, the queues left as they were;
        `trained` is the share of the drawn samples trained on.
    """
    filters = engine.filters
    states = list(state.states)
    rows = _filtering._drawn_rows(
        loss, engine.row_tail, x, y, sample_weight, ids
    )
    batch = ops.shape(rows.ids)[0]
    epoch, epochs = engine.epoch_state()
    count_all = ops.zeros((), "float32")
    count_masked = ops.zeros((), "float32")

    def take(rows, keep):
        index = ops.nonzero(keep)[0]
        leaves = [ops.take(t, index, axis=0) for t in rows.flat()]
        return _filtering.Rows.unflat(leaves, len(rows.x), len(rows.y))

    def size(rows):
        return ops.shape(rows.ids)[0]

    for i in (i for i, f in enumerate(filters) if not f.scores):
        memory_filter = filters[i]
        view = View(rows.ids, draws(i, batch), epoch, epochs)
        keep, weight = memory_filter.select(view, states[i])
        keep, rows = _filtering._apply_weight(
            rows, memory_filter.active(epoch, epochs), keep, weight
        )
        skipped = _filtering._memory_skipped(rows, keep)
        count_all += skipped
        count_masked += skipped
        rows = take(rows, keep)

    scored = ops.zeros((), "float32")
    metric_out = None
    for i in (i for i, f in enumerate(filters) if f.scores):
        scoring_filter = filters[i]
        go = ops.logical_and(
            scoring_filter.active(epoch, epochs),
            scoring_filter.should_score(states[i]),
        )
        if not (size(rows) and bool(go)):
            continue
        score_y = keras.tree.pack_sequence_as(y, rows.y)
        y_pred, _ = hooks.score(keras.tree.pack_sequence_as(x, rows.x))
        view, counted, masked, values = _filtering._scoring_view(
            loss,
            rows,
            score_y,
            y_pred,
            True,
            draws(i, size(rows)),
            epoch,
            epochs,
        )
        metric_out = (
            score_y,
            y_pred,
            rows.metric_weight,
            ops.ones_like(rows.metric_weight),
            ops.sum(rows.coefficients * values),
            ops.ones((), "float32"),
        )
        keep, weight = scoring_filter.select(view, states[i])
        keep, rows = _filtering._apply_weight(rows, True, keep, weight)
        n_all, n_masked, seen = _filtering._pass_counts(
            rows, True, counted, masked, values, epoch
        )
        scored = ops.ones((), "float32")
        count_all += n_all
        count_masked += n_masked
        states = _filtering._observe(filters, states, seen)
        rows = rows._replace(counted=ops.ones_like(rows.counted))
        rows = take(rows, keep)

    grads, n_all, n_masked = None, 0.0, 0.0
    if size(rows):
        train_y = keras.tree.pack_sequence_as(y, rows.y)
        grads, y_pred, values, value = hooks.train(
            keras.tree.pack_sequence_as(x, rows.x), train_y, rows.coefficients
        )
        counted, masked, values = _filtering._pass_flags(
            loss, rows, train_y, y_pred, True, values
        )
        n_all, n_masked, seen = _filtering._pass_counts(
            rows, True, counted, masked, values, epoch
        )
        states = _filtering._observe(filters, states, seen)
        if metric_out is None:
            one = ops.ones((), "float32")
            weight = rows.metric_weight
            covered = ops.ones_like(weight)
            metric_out = (train_y, y_pred, weight, covered, value, one)
    if metric_out is None:
        # Nothing ran: the drawn rows, weighted 0.
        drawn = _filtering._drawn_rows(
            loss, engine.row_tail, x, y, sample_weight, ids
        )
        zero = ops.zeros((), "float32")
        metric_out = (
            y,
            hooks.no_output(x),
            ops.zeros_like(drawn.metric_weight),
            ops.zeros_like(drawn.metric_weight),
            zero,
            zero,
        )
    trained = ops.cast(size(rows), "float32") / ops.cast(batch, "float32")
    output = _filtering._output(
        grads,
        trained,
        scored,
        count_all + n_all,
        count_masked + n_masked,
        metric_out,
        None,
        None,
    )
    return output, state._replace(states=states)


class KeptRows(kas.ASSpeed):
    """The filters' passes on exactly the kept rows (`kept_rows_step`, run
    in place of `_filtering.filtered_step`)."""

    def train_step(self, *args):
        def step(*step_args, queue_ops):
            return kept_rows_step(*step_args)

        with mock.patch.object(_filtering, "filtered_step", step):
            return super().train_step(*args)


class Queue(kas.ASSpeed):
    """The static queue of `_filtering.filtered_step` in eager steps, as
    under `torch.compile`."""

    def train_step(self, *args):
        with mock.patch.object(_torch, "EagerQueue", _queue):
            return super().train_step(*args)


FILTERS = {
    # Scores every drawn batch, trains the unmasked rows (about 1% here).
    "skip_masked": lambda: kas.filters.SkipMasked(0.0),
    # Trains half of every drawn batch: a moderate kept share.
    "selective_backprop": lambda: kas.filters.SelectiveBackprop(seed=0),
}
DESIGNS = {"queue": Queue, "eager_queue": kas.ASSpeed, "kept_rows": KeptRows}


def make_model(variant, hidden, sample_filter):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(5),
        ]
    )
    if variant == "as_speed":
        model = kas.ASSpeed(model)
    elif variant in DESIGNS:
        model = DESIGNS[variant](model, sample_filter=FILTERS[sample_filter]())
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3), loss=kas.ASSoftmaxLoss(0.3)
    )
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--filter", choices=FILTERS, default="skip_masked")
    args = parser.parse_args(argv)
    x, y = make_data(args.samples)
    fits = {
        variant: epoch_fit(
            make_model(variant, args.hidden, args.filter),
            x,
            y,
            args.batch_size,
        )
        for variant in ("keras", "as_speed", *DESIGNS)
    }
    seconds, logs, _ = time_epochs(fits, args.warmup, args.rounds)
    print(
        f"backend={keras.backend.backend()} filter={args.filter} "
        f"hidden={args.hidden} "
        f"samples={args.samples} batch={args.batch_size} "
        f"warmup={args.warmup} rounds={args.rounds}"
    )
    steps = args.samples // args.batch_size
    print_table(seconds, logs, steps, reference="keras")


if __name__ == "__main__":
    main()
