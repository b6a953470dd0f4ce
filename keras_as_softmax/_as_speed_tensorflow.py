"""ASSpeed's train step on TensorFlow (eager, graph, XLA or tf.distribute)."""

import keras
import tensorflow as tf
from keras import ops

from keras_as_softmax.as_speed import next_accumulation_steps
from keras_as_softmax.metrics import masked_rows


def _batch_size(x):
    return tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0]


def train_step(model, data):
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    skipper = model.sample_skipper
    if skipper is not None:
        x = dict(x)
        sample_ids = x.pop(skipper.id_key)
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True)
        # Divided by the number of replicas, like every Keras loss.
        loss = model.compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
        model._loss_tracker.update_state(loss * replicas, sample_weight=_batch_size(x))
        scaled_loss = model.optimizer.scale_loss(loss)
    variables = model.trainable_variables
    grads = tape.gradient(scaled_loss, variables)
    grads = [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g) for g, v in zip(grads, variables)]
    row_masked, row_counted = masked_rows(model.loss, y, y_pred, sample_weight)
    if skipper is not None:
        skipper.record(sample_ids, row_masked, row_counted)
    masked = tf.reduce_sum(tf.cast(row_masked, "float32"))
    counted = tf.reduce_sum(tf.cast(row_counted, "float32"))

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
    return logs
