"""What `ASSpeed` checks before it trains: the model, the compiled loss and
metrics, the filters' needs and the data. Each check raises one
`ValueError` that names what was expected and what came."""

import warnings

import keras
import numpy as np

from keras_as_softmax import filters as filters_lib
from keras_as_softmax.callbacks import check_deltas
from keras_as_softmax.losses import ASSoftmaxLoss
from keras_as_softmax.losses import MultiLabelASSoftmaxLoss
from keras_as_softmax.metrics import MaskedRatio
from keras_as_softmax.metrics import count_masked_rows
from keras_as_softmax.training import _data
from keras_as_softmax.training import _filtering
from keras_as_softmax.training.filter_engine import dtype_of

MASKING_LOSSES = (ASSoftmaxLoss, MultiLabelASSoftmaxLoss)
_FILTER_REDUCTIONS = ("sum_over_batch_size", "sum")
# The steps `ASSpeed` runs in place of the wrapped model's.
_KERAS_STEP = ("train_step", "test_step", "compute_loss", "compute_metrics")


def check_wrappable(model):
    """Refuses a model whose own steps `ASSpeed` would not run."""
    if not isinstance(model, keras.Model):
        raise ValueError(
            "Expected `model` to be a keras.Model (functional, "
            "sequential, subclassed or a keras-hub task). "
            f"Received: model={model!r}"
        )
    own = [
        name
        for name in _KERAS_STEP
        if getattr(type(model), name) is not getattr(keras.Model, name)
    ]
    if own:
        raise ValueError(
            "ASSpeed trains with its own steps around the model's "
            f"forward pass, so {type(model).__name__}'s own "
            f"{', '.join(own)} would not run. Expected a model that "
            f"keeps keras.Model's {', '.join(_KERAS_STEP)} (a loss term "
            "of its own goes in `add_loss`, a metric in `compile`). "
            f"Received: {type(model).__name__} overrides {', '.join(own)}"
        )


def check_compiled(model, names):
    """What `fit()` checks before the first batch: the loss, the filters'
    needs, the devices.

    Args:
        model: the `ASSpeed`.
        names: the inner model's output names.

    Returns:
        Whether an output carries a Keras mask.
    """
    if not getattr(model, "compiled", False):
        raise ValueError(
            "Call `compile()` on the ASSpeed model before `fit()` (it "
            "compiles its own loss and optimizer, not the wrapped "
            "model's)."
        )
    loss, filters = model.loss, model.sample_filters
    config = model._compile_config.config
    metrics_config = (config.get("metrics"), config.get("weighted_metrics"))
    check_deltas([loss])
    if model.masked_outputs:
        _check_masked_outputs(loss, names, model.masked_outputs, filters)
    elif not isinstance(loss, keras.losses.Loss):
        raise ValueError(
            "ASSpeed counts masked rows with the loss's per-row values, "
            "so compile it with one keras.losses.Loss instance, such as "
            "keras_as_softmax.ASSoftmaxLoss(0.3), or for a model with "
            "several outputs, name the outputs whose AS loss counts with "
            "`ASSpeed(..., masked_outputs=[...])`. "
            f"Received: loss={loss!r}"
        )
    elif len(names) > 1:
        raise one_loss_for_outputs(loss, names)
    _check_no_metric_named_masked_ratio(metrics_config, loss)
    for f in filters:
        if f.needs_masking_loss and not isinstance(loss, MASKING_LOSSES):
            raise ValueError(
                f"{type(f).__name__} skips the samples whose loss is "
                "exactly 0, which only an AS loss gives "
                "(keras_as_softmax.ASSoftmaxLoss or "
                "MultiLabelASSoftmaxLoss). With another loss, "
                "SelectiveBackprop or InfoBatch select samples. "
                f"Received: loss={loss!r}"
            )
    if filters and loss.reduction not in _FILTER_REDUCTIONS:
        raise ValueError(
            "A sample filter reweights per-row losses, which needs the "
            f"reduction to be one of {_FILTER_REDUCTIONS}. Received: "
            f"reduction={loss.reduction!r}"
        )
    _check_devices(model)
    # Functional and sequential models show their masks here; a subclassed
    # model's show in the step (`check_step_outputs`).
    outputs = getattr(model.inner_model, "outputs", None) or []
    return _filtering.check_no_keras_mask(loss, outputs, names)


def _check_no_metric_named_masked_ratio(metrics_config, loss):
    """`masked_ratio` in the logs is the compiled loss's share: a compiled
    metric of that name would be hidden by it, unless it computes the same
    (`MaskedRatio` of the compiled loss)."""
    for metrics in metrics_config:
        if not isinstance(metrics, (list, tuple)):
            continue  # a dict names them after their outputs
        for metric in metrics:
            if getattr(metric, "name", None) != "masked_ratio" or (
                isinstance(metric, MaskedRatio) and metric.loss is loss
            ):
                continue
            raise ValueError(
                "ASSpeed logs `masked_ratio`, the share of rows the "
                "compiled loss masks, which would hide a compiled metric "
                "of the same name. Expected that metric under another "
                "name, e.g. MaskedRatio(loss, name='masked_ratio_0.9'). "
                f"Received: metrics with {metric!r} named 'masked_ratio'"
            )


def _check_masked_outputs(loss, names, masked_outputs, filters):
    if filters:
        raise ValueError(
            "ASSpeed's sample filters need a model with one output and "
            "one loss: a sample can be skipped only when its whole loss "
            "is 0. Expected: sample_filter=None with masked_outputs. "
            f"Received: masked_outputs={masked_outputs!r}, "
            f"sample_filter={filters!r}"
        )
    if not isinstance(loss, (dict, list, tuple)):
        raise ValueError(
            "`masked_outputs` picks losses of a model with several "
            "outputs: compile it with a dict (or list) of losses, one "
            f"per output{f' of {names}' if names else ''}. Received: "
            f"loss={loss!r}"
        )
    for name in masked_outputs:
        if name not in names:
            raise ValueError(
                f"Expected `masked_outputs` among the model's outputs "
                f"{names}. Received: {name!r}"
            )
        picked = _filtering.pick(loss, name, names)
        if not isinstance(picked, MASKING_LOSSES):
            raise ValueError(
                f"The loss of output {name!r} masks no rows: AS-Speed "
                "counts rows whose loss is exactly 0, which only an AS "
                "loss (keras_as_softmax.ASSoftmaxLoss or "
                "MultiLabelASSoftmaxLoss) gives. Received: "
                f"{picked!r}. Name only outputs trained with an AS loss "
                "in `masked_outputs`."
            )


def output_names(inner_model, loss):
    """The inner model's output names; a subclassed model has none before
    its step, and a dict of losses names its dict outputs."""
    names = list(getattr(inner_model, "output_names", None) or [])
    if not names and isinstance(loss, dict):
        names = list(loss)
    return names


def replicas(model):
    """The devices a step of `model` runs on."""
    if keras.backend.backend() == "tensorflow":
        return model.distribute_strategy.num_replicas_in_sync
    distribution = keras.distribution.distribution()
    if distribution is None:
        return 1
    return len(distribution.device_mesh.devices.flatten())


def count_masked(loss, masked_outputs, names, y, y_pred, sample_weight):
    """`(masked, counted)` rows of a step, as float32 scalars: of the one
    loss, or summed over `masked_outputs`."""
    if not masked_outputs:
        return count_masked_rows(loss, y, y_pred, sample_weight)
    masked = counted = 0.0
    for name in masked_outputs:
        weight = sample_weight
        if isinstance(sample_weight, (dict, list, tuple)):
            weight = _filtering.pick(sample_weight, name, names)
        m, c = count_masked_rows(
            _filtering.pick(loss, name, names),
            _filtering.pick(y, name, names),
            _filtering.pick(y_pred, name, names),
            weight,
        )
        masked, counted = masked + m, counted + c
    return masked, counted


def check_step_outputs(loss, names, y_pred):
    """A subclassed model's outputs and Keras mask show only on its
    predictions, as the step is traced (or run, on eager PyTorch): refused
    before the loss reads its labels and before anything is updated.
    Returns whether an output carries a mask (its loss ignores a class)."""
    outputs = keras.tree.flatten(y_pred)
    if isinstance(loss, keras.losses.Loss) and len(outputs) > 1:
        if isinstance(y_pred, dict):
            names = list(y_pred)
        raise one_loss_for_outputs(loss, names or len(outputs))
    return _filtering.check_no_keras_mask(loss, y_pred, names)


def one_loss_for_outputs(loss, outputs):
    """The error for one loss compiled for several `outputs` (names, or
    their number)."""
    return ValueError(
        "ASSpeed counts masked rows of one loss. For a model with several "
        "outputs, compile a dict of losses, one per output, and name the "
        "outputs whose AS loss counts with "
        f"`ASSpeed(..., masked_outputs=[...])`. Received: one loss, "
        f"{loss!r}, for the outputs {outputs}"
    )


def as_output_names(masked_outputs):
    """`masked_outputs` as a list of names, or `None`."""
    if masked_outputs is None:
        return None
    names = masked_outputs
    if isinstance(names, str):
        names = [names]
    if (
        not isinstance(names, (list, tuple))
        or not names
        or not all(isinstance(n, str) for n in names)
    ):
        raise ValueError(
            "Expected `masked_outputs` to be an output name or a non-empty "
            f"list of them. Received: masked_outputs={masked_outputs!r}"
        )
    return list(names)


# ------------------------------------------------------------------ the data


def _check_devices(model):
    """Refuses what the backend cannot distribute."""
    backend = keras.backend.backend()
    if backend == "torch":
        from keras_as_softmax.training._torch import check_not_distributed

        check_not_distributed()
    if model.sample_filters and backend == "tensorflow":
        from keras_as_softmax.training._tensorflow import is_multi_worker

        if is_multi_worker(model.distribute_strategy):
            raise ValueError(
                "ASSpeed's sample filters run on one worker (one device, "
                "or MirroredStrategy's replicas on one machine). "
                "Expected sample_filter=None under "
                "MultiWorkerMirroredStrategy. Received: "
                f"sample_filter={model.sample_filters!r}"
            )


def check_data(engine, x, first_x, first_y, steps_per_epoch, replicas):
    """Checks the data against the filters' needs: labels, sample ids
    where a filter reads them (in range for a memory filter), a batch the
    devices split evenly.

    Args:
        engine: the `FilterEngine`.
        x: the data `fit` got (to read the ids of an epoch).
        first_x, first_y: its first batch's inputs and labels.
        steps_per_epoch: `fit`'s.
        replicas: the devices a step runs on.
    """
    data_kind = _data.kind(x)
    filters = engine.filters
    if first_y is None:
        raise ValueError(
            "ASSpeed's sample filters weigh each sample by its loss. "
            "Expected labels: `y`, or batches `(x, y)` or "
            "`(x, y, sample_weight)`. Received: no labels"
        )
    inputs, ids = filters_lib.split_sample_ids(first_x)
    if ids is not None and np.ndim(ids) == 0:
        raise ValueError(
            "Expected one integer sample id per sample of a batch. "
            "Received one id for the whole element: index_dataset "
            "numbers the elements of an unbatched dataset, so call it "
            "before `batch`: `index_dataset(ds).batch(batch_size)`."
        )
    batch = int(np.shape(keras.tree.flatten(inputs)[0])[0])
    for f in filters:
        if f.needs_sample_ids:
            _check_ids_given(f, ids, data_kind, first_x)
    if ids is not None and (
        tuple(np.shape(ids)) != (batch,)
        or not dtype_of(ids).startswith(("int", "uint"))
    ):
        raise ValueError(
            "Expected one integer sample id per sample: ids of shape "
            f"({batch},) in a batch of {batch}. Received: ids of shape "
            f"{tuple(np.shape(ids))}, dtype {dtype_of(ids)}. "
            "(index_dataset numbers the elements of an unbatched "
            "dataset: call it before `batch`.)"
        )
    if batch % replicas:
        raise ValueError(
            "With sample filters on several devices, every training pass "
            "splits `batch_size` queued rows evenly over the devices. "
            f"Expected a batch size divisible by {replicas} (devices). "
            f"Received: {batch}"
        )
    memory = engine.memory_filter
    if memory is not None:
        _check_id_range(
            x,
            data_kind == "tf.data.Dataset",
            memory.num_samples,
            steps_per_epoch,
        )


def _check_ids_given(f, ids, data_kind, first_x):
    name = type(f).__name__
    if ids is None:
        raise ValueError(
            f"{name} needs each sample's id. Expected inputs made by "
            "keras_as_softmax.filters.with_sample_ids (arrays) or "
            "index_dataset (a tf.data.Dataset): a dict "
            "{'inputs': x, 'sample_id': ids}. Received: "
            f"{data_kind} whose inputs are of type {type(first_x).__name__}"
        )
    if data_kind not in ("tf.data.Dataset", "arrays"):
        raise ValueError(
            f"{name} checks the sample ids of an epoch before training. "
            "Expected arrays made by keras_as_softmax.filters."
            "with_sample_ids or a tf.data.Dataset made by index_dataset. "
            f"Received: a {data_kind}"
        )


def _check_id_range(x, is_dataset, num_samples, steps_per_epoch):
    """Reads the ids of one epoch (a dataset of unknown or infinite
    length: its first `steps_per_epoch` batches) and checks their range."""
    if is_dataset:
        import tensorflow as tf

        ids = x.map(
            lambda x, *_: tf.cast(
                tf.reshape(x[filters_lib.SAMPLE_ID_KEY], [-1]), tf.int64
            )
        )
        if int(x.cardinality()) < 0:
            if steps_per_epoch is None:
                raise ValueError(
                    "A last-seen filter checks the sample ids of one "
                    "epoch before training: pass `steps_per_epoch` for "
                    "a dataset of unknown or infinite length. "
                    "Received: steps_per_epoch=None"
                )
            ids = ids.take(steps_per_epoch)
        low, high = ids.reduce(
            (tf.int64.max, tf.int64.min),
            lambda bounds, b: (
                tf.minimum(bounds[0], tf.reduce_min(b)),
                tf.maximum(bounds[1], tf.reduce_max(b)),
            ),
        )
        low, high = int(low), int(high)
    else:
        ids = np.asarray(x[filters_lib.SAMPLE_ID_KEY])
        high, low = int(ids.max()), int(ids.min())
    if low < 0 or high >= num_samples:
        raise ValueError(
            "Expected sample ids in [0, num_samples) = "
            f"[0, {num_samples}). Received ids in [{low}, {high}]."
        )


def warn_training_outside(name):
    """Warns that an `ASSpeed` called in training mode outside its own
    `fit` trains as its inner model."""
    warnings.warn(
        f"ASSpeed {name!r} was called with training=True outside its own "
        "`fit`. If that trains it (as a layer of another model, or in a "
        "custom training loop), it trains as its inner model, without "
        "accumulation or sample filters: fit the ASSpeed itself, with the "
        "outer model as its inner one.",
        stacklevel=3,
    )


def warn_of_penalties(inner_model):
    """Penalties of a pass's inputs enter the training passes only: with a
    filter they act on fewer batches than without one."""
    named = [
        layer.name
        for layer in inner_model._flatten_layers()
        if getattr(layer, "activity_regularizer", None) is not None
    ]
    if named:
        warnings.warn(
            "ASSpeed's sample filters skip the passes of masked samples, "
            "and the activity penalties with them: such a penalty acts "
            "on the batches a training pass ran on (`trained_fraction` "
            "of them), not on every batch as without a filter (the "
            "weights' own penalties act on every update). Layers with "
            f"an activity_regularizer: {', '.join(named[:4])}"
            + (f" and {len(named) - 4} more" if len(named) > 4 else ""),
            stacklevel=4,
        )
