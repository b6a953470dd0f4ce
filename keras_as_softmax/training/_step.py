"""The train step's shape, written once for every backend.

```
x, y, sample_weight = the drawn batch
result = backend.filtered(...)  if the model has sample filters
         backend.plain(...)     else
backend.apply(result)           the optimizer's window adds the batch
return backend.logs(result)     the loss, the compiled metrics, the shares
```

A backend's step object supplies only what differs: how gradients are
taken and how state is passed (JAX threads it through a pure function,
TensorFlow and PyTorch assign variables). Each returns a `StepResult`.
"""

from typing import NamedTuple

import keras
from keras import ops

from keras_as_softmax import filters
from keras_as_softmax.losses._common import ignore_class_of
from keras_as_softmax.losses._common import valid_rows


class StepResult(NamedTuple):
    grads: list  # one per trainable variable, or None: added already
    rows: object  # counted rows of the drawn batch (`N_all`)
    masked: object  # masked rows among them (`N_masked`)
    loss: object  # the loss the logs show
    loss_weight: object  # its weight in the epoch's mean (rows it covers)
    metric_args: tuple  # `(x, y, y_pred, sample_weight, covered)`
    trained: object  # 1.0 where a training pass ran
    scored: object  # 1.0 where a scoring pass ran (None: no scoring)


def train_step(backend, data):
    """Runs one step through `backend`'s stages and returns its logs."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    if backend.model.sample_filters:
        result = backend.filtered(x, y, sample_weight)
    else:
        result = backend.plain(x, y, sample_weight)
    backend.apply(result)
    return backend.logs(result)


def filtered_result(inputs, output):
    """The `StepResult` of `FilterEngine.step`'s `(inputs, output)`."""
    return StepResult(
        grads=output.grads,
        rows=output.rows,
        masked=output.masked_rows,
        loss=output.loss,
        loss_weight=output.loss_weight,
        metric_args=output.metric_args(inputs),
        trained=output.trained,
        scored=output.scored,
    )


def plain_result(grads, counts, loss, loss_weight, x, y, y_pred, weight):
    """The `StepResult` of a step without filters: every row trained."""
    masked, rows = counts
    metric_args = (x, y, y_pred, weight, None)
    return StepResult(
        grads, rows, masked, loss, loss_weight, metric_args, 1.0, None
    )


def update_logs(model, result):
    """Updates the loss tracker and the metrics with what the step has,
    and returns the logs.

    A filtered step's rows have static shapes: besides those its logs
    cover (the drawn batch, or a training pass's rows), they hold a short
    batch's padding or the rows of a pass that did not run. `covered` is
    1.0 on the rows that count. Keras gives no sample weight to the
    compiled `metrics` (only to `weighted_metrics`, which get
    `sample_weight`, 0 where not covered), so they get `covered`.
    """
    model._loss_tracker.update_state(
        result.loss, sample_weight=result.loss_weight
    )
    shares = model.shares_tracker
    shares.update_shares(
        (result.masked, result.rows), result.trained, result.scored
    )
    x, y, y_pred, sample_weight, covered = result.metric_args
    metrics = model._compile_metrics
    if covered is None or metrics is None:
        return keras.Model.compute_metrics(model, x, y, y_pred, sample_weight)
    if not metrics.built:
        metrics.build(y, y_pred)
    # One output: sample filters refuse models with more.
    y, y_pred = keras.tree.flatten(y)[0], keras.tree.flatten(y_pred)[0]
    if shares.skip_ignored:
        # Keras leaves the positions a Keras mask hides out of the metrics,
        # but the queued predictions lose the mask: the positions the
        # loss's `ignore_class` labels are left out instead.
        ignore = ignore_class_of(model.loss)
        valid = valid_rows(y, tuple(covered.shape), ignore)
        valid = ops.cast(valid, "float32")
        covered, sample_weight = covered * valid, sample_weight * valid
    for unweighted in metrics._flat_metrics:
        if unweighted:
            unweighted.update_state(y, y_pred, sample_weight=covered)
    for weighted in metrics._flat_weighted_metrics:
        if weighted:
            weighted.update_state(y, y_pred, sample_weight=sample_weight)
    return model.get_metrics_result()


def without_ids(data):
    """`data` with the sample ids taken out of its inputs (`test_step`)."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    x, _ = filters.split_sample_ids(x)
    return keras.utils.pack_x_y_sample_weight(x, y, sample_weight)
