"""ASSpeed's train step on TensorFlow (eager, graph, XLA or tf.distribute)."""

import keras
import tensorflow as tf
from keras import ops

from keras_as_softmax.as_speed import next_accumulation_steps
from keras_as_softmax.metrics import masked_rows


def is_multi_worker(strategy):
    """Whether `strategy` is a `MultiWorkerMirroredStrategy` spanning
    several workers."""
    return isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy
    ) and strategy.extended._in_multi_worker_mode()


def local_batch(iterator, strategy):
    """The first batch of a Keras `TFEpochIterator`, as the first local
    replica sees it.

    Keras 3.15's `fit` builds the model from a probe batch that it averages
    over replicas with `strategy.reduce`, which `MultiWorkerMirroredStrategy`
    cannot do eagerly (keras-team/keras#20585); the probe only needs
    shapes, which one replica's batch has.
    """
    for _, _, it in iterator:
        return tf.nest.map_structure(
            lambda v: strategy.experimental_local_results(v)[0]
            if isinstance(v, tf.distribute.DistributedValues)
            else v,
            next(it),
        )
    return None


def multi_worker_logs(logs):
    """A step's logs, ready for Keras 3.15's reduction across workers.

    Under `MultiWorkerMirroredStrategy`, Keras averages the logs over
    workers along axis 0, which a scalar lacks (keras-team/keras#20585):
    give each log that axis. Elsewhere the logs are returned as they are.
    """
    if not is_multi_worker(tf.distribute.get_strategy()):
        return logs
    return {name: tf.reshape(value, [1]) for name, value in logs.items()}


def _batch_size(x):
    return tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0]


def _take_rows(data, index):
    """The rows `index` of every tensor in `data` (`None` stays `None`)."""
    if data is None:
        return None
    return tf.nest.map_structure(lambda t: tf.gather(t, index), data)


# skip_masked trains on chunks of 1/_CHUNKS of the micro-batch.
_CHUNKS = 4


def _dense_grads(grads, variables):
    return [
        tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
        for g, v in zip(grads, variables)
    ]


def _plain_pass(model, x, y, sample_weight):
    """Forward and backward over the whole micro-batch."""
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True)
        # Divided by the number of replicas, like every Keras loss.
        loss = model.compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
        scaled_loss = model.optimizer.scale_loss(loss)
    variables = model.trainable_variables
    grads = _dense_grads(tape.gradient(scaled_loss, variables), variables)
    row_masked, row_counted = masked_rows(model.loss, y, y_pred, sample_weight)
    return loss, y_pred, grads, row_masked, row_counted, tf.constant(1.0)


def _row_coefficients(loss, y, y_pred, sample_weight, rows):
    """`d loss(y, y_pred, sample_weight) / d values`, one per row.

    Every Keras reduction is linear in the per-row values that `loss.call`
    returns, so these coefficients turn per-row values into the batch's loss
    exactly (sample weights, `ignore_class` rescaling, the mean's
    denominator) for any `keras.losses.Loss`. They are read off a copy of
    the loss whose `call` returns a probe shaped like `rows` (a per-row
    tensor the caller already has), so the loss itself is not run again.
    """
    probe = tf.zeros(tf.shape(rows), loss.dtype)
    # A shallow copy (`copy.copy` would go through the loss's config).
    linear = object.__new__(type(loss))
    linear.__dict__.update(loss.__dict__)
    linear.call = lambda y_true, y_pred: probe
    with tf.GradientTape() as tape:
        tape.watch(probe)
        total = linear(y, y_pred, sample_weight=sample_weight)
    return tape.gradient(total, probe)


def _unmasked_pass(model, x, y, index, row_weights, regularize):
    """Training forward and backward passes on the samples `index` only,
    their per-row loss values weighted by `row_weights` (0 for the padding
    of a chunk). Adds the regularization losses when `regularize` is
    true."""
    variables = model.trainable_variables
    dtype = model.loss.dtype
    with tf.GradientTape() as tape:
        values = model.loss.call(
            ops.convert_to_tensor(_take_rows(y, index), dtype=dtype),
            ops.convert_to_tensor(
                model(_take_rows(x, index), training=True), dtype=dtype
            ),
        )
        loss = tf.reduce_sum(row_weights * values)
        if model.losses:  # regularization: once per micro-batch
            loss += tf.cast(regularize, loss.dtype) * tf.add_n(model.losses)
        scaled = model.optimizer.scale_loss(loss)
    return _dense_grads(tape.gradient(scaled, variables), variables)


def _score(model, x):
    """The scoring forward pass: in training mode, so that a sample is
    masked or not under dropout, as the plain step would find it. Layers'
    training-time state that the pass changes (`BatchNormalization`'s
    moving statistics) is put back afterwards: it follows the training
    passes only. Dropout's seed state is left to advance."""
    state = [
        v for v in model.inner_model.non_trainable_variables
        if not v.path.endswith("seed_generator_state")
    ]
    saved = [tf.identity(v.value) for v in state]
    with tf.control_dependencies(saved):
        y_pred = model(x, training=True)
    with tf.control_dependencies(tf.nest.flatten(y_pred)):
        for v, value in zip(state, saved):
            v.assign(value)
    return y_pred


def _compact_pass(model, x, y, sample_weight):
    """Scores the micro-batch with a forward pass, then runs the training
    forward and backward passes only on the samples it did not mask.

    As a TensorFlow graph, those samples are gathered, in order, into one
    batch of their own size (none when every sample is masked). Under XLA,
    which needs static shapes, they go in chunks of a quarter of the
    micro-batch through a compiled loop (one copy of the model in the
    program), the last chunk padded with rows of weight 0.

    Each row is weighted by the coefficient that the whole micro-batch's
    loss gives it, so the gradient is the micro-batch's AS-Softmax gradient
    without the masked samples' zeros, up to what dropout changes between
    the two passes. Rows masked by the scoring pass stay out even if the
    training pass would not mask them. Regularization losses are added
    once, so a micro-batch with every sample masked adds none.
    """
    y_pred = _score(model, x)
    loss = model.compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
    )
    row_masked, row_counted = masked_rows(model.loss, y, y_pred, sample_weight)
    trains = tf.logical_and(row_counted, tf.logical_not(row_masked))
    coefficients = _row_coefficients(model.loss, y, y_pred, sample_weight, trains)
    coefficients *= tf.cast(trains, coefficients.dtype)
    axes = list(range(1, len(trains.shape)))
    needed = tf.reduce_any(trains, axis=axes) if axes else trains
    count = tf.reduce_sum(tf.cast(needed, tf.int32))
    batch = _batch_size(x)
    variables = model.trainable_variables
    no_grads = lambda: [tf.zeros_like(v) for v in variables]  # noqa: E731

    if not model.jit_compile:
        index = tf.reshape(tf.where(needed), [-1])
        grads = tf.cond(
            count > 0,
            lambda: _unmasked_pass(
                model, x, y, index, tf.gather(coefficients, index), True
            ),
            no_grads,
        )
        trained = tf.cast(count, tf.float32) / tf.cast(batch, tf.float32)
        return loss, y_pred, grads, row_masked, row_counted, trained

    chunk = (batch + _CHUNKS - 1) // _CHUNKS
    # The samples to train on first, in their original order, padded to four
    # chunks; slots past `count` (masked samples, then sample 0 as padding)
    # get coefficient 0.
    order = tf.argsort(tf.cast(tf.logical_not(needed), tf.int32), stable=True)
    order = tf.concat([order, tf.zeros([_CHUNKS * chunk - batch], order.dtype)], 0)
    slot_weight = tf.cast(tf.range(_CHUNKS * chunk) < count, coefficients.dtype)
    slot_coefficients = tf.gather(coefficients, order) * tf.reshape(
        slot_weight, [-1] + [1] * len(axes)
    )
    chunks = (count + chunk - 1) // chunk

    def body(i, grads):
        part = slice(i * chunk, (i + 1) * chunk)
        new = _unmasked_pass(
            model, x, y, order[part], slot_coefficients[part], i == 0
        )
        return i + 1, [g + n for g, n in zip(grads, new)]

    _, grads = tf.while_loop(
        lambda i, grads: i < chunks, body, (tf.constant(0), no_grads()),
        maximum_iterations=_CHUNKS,
    )
    trained = tf.cast(chunks * chunk, tf.float32) / tf.cast(batch, tf.float32)
    return loss, y_pred, grads, row_masked, row_counted, trained


def train_step(model, data):
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    skipper = model.sample_skipper
    if model._drops_samples and replicas > 1:
        raise ValueError(
            "ASSpeed(skip_masked=True) and ASSpeed(sample_skipper=...) train "
            f"on one device. Received a distribution strategy with {replicas} replicas."
        )
    if skipper is not None:
        # Samples masked when last seen (but those revisited) leave the
        # micro-batch before any pass.
        x = dict(x)
        sample_ids = x.pop(skipper.id_key)
        keep = skipper.keep(sample_ids)
        kept_share = tf.reduce_mean(tf.cast(keep, tf.float32))
        index = tf.reshape(tf.where(keep), [-1])
        x, y, sample_weight, sample_ids = (
            _take_rows(t, index) for t in (x, y, sample_weight, sample_ids)
        )
    passes = (model, x, y, sample_weight)
    if model.skip_masked:
        # Scoring first costs a forward pass; it pays off
        # only when enough samples are masked (judged on the last batch).
        outputs = tf.cond(
            model._last_masked_ratio >= model.SKIP_FROM_MASKED_RATIO,
            lambda: _compact_pass(*passes),
            lambda: _plain_pass(*passes),
        )
    else:
        outputs = _plain_pass(*passes)
    loss, y_pred, grads, row_masked, row_counted, trained = outputs
    model._loss_tracker.update_state(loss * replicas, sample_weight=_batch_size(x))
    variables = model.trainable_variables
    if skipper is not None:
        skipper.record(sample_ids, row_masked, row_counted)
        trained *= kept_share  # a share of the batch drawn
    masked = tf.reduce_sum(tf.cast(row_masked, "float32"))
    counted = tf.reduce_sum(tf.cast(row_counted, "float32"))
    if model.skip_masked:
        model._last_masked_ratio.assign(masked / tf.maximum(counted, 1.0))
    if model._drops_samples:
        model.backward_fraction_tracker.update_state(trained)

    context = tf.distribute.get_replica_context()
    if replicas > 1:
        # Every replica accumulates the same all-reduced values (the state
        # variables aggregate "only_first_replica"), so all of them take the
        # same decisions at the same micro-batch.
        grads = context.all_reduce("sum", grads)
        masked, counted = context.all_reduce("sum", [masked, counted])

    for accumulator, grad in zip(model._accumulators, grads):
        accumulator.assign_add(grad)
    model._window_batches.assign_add(1)
    model._window_all.assign_add(counted)
    model._window_masked.assign_add(masked)

    def apply_window():
        # The optimizer sums gradients over replicas again: pre-divide.
        n = ops.cast(model._window_batches * replicas, "float32")
        mean_grads = [ops.cast(a / n, a.dtype) for a in model._accumulators]
        model.optimizer.apply(mean_grads, variables)
        model._accum_steps.assign(
            next_accumulation_steps(
                model._accum_steps,
                model._window_all,
                model._window_masked,
                model.lam,
                model.max_steps,
            )
        )
        for accumulator in model._accumulators:
            accumulator.assign(ops.zeros_like(accumulator))
        model._window_batches.assign(0)
        model._window_all.assign(0.0)
        model._window_masked.assign(0.0)

    window_done = model._window_batches >= model._accum_steps
    if replicas > 1:
        # The optimizer's cross-replica merge may not sit in a conditional
        # built in replica context: build it in cross-replica context, as
        # keras.optimizers.LossScaleOptimizer does.
        def cross_replica(distribution, window_done):
            done = distribution.experimental_local_results(window_done)[0]
            tf.cond(
                done,
                lambda: distribution.extended.call_for_each_replica(apply_window),
                lambda: None,
            )

        context.merge_call(cross_replica, args=(window_done,))
    else:
        tf.cond(window_done, apply_window, lambda: None)

    logs = model._compute_metrics_with_counts(
        (masked, counted),
        lambda: model.compute_metrics(x, y, y_pred, sample_weight=sample_weight),
    )
    logs["accum_steps"] = tf.convert_to_tensor(model._accum_steps)
    return multi_worker_logs(logs)
