"""ASSpeed's train step on TensorFlow (eager, graph or XLA)."""

import keras
import tensorflow as tf
from keras import ops

from keras_as_softmax.as_speed import next_accumulation_steps
from keras_as_softmax.metrics import count_masked_rows


def _batch_size(x):
    return tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0]


def train_step(model, data):
    strategy = tf.distribute.get_strategy()
    if strategy.num_replicas_in_sync > 1:
        # The optimizer's cross-replica merge cannot sit inside the window's
        # conditional; see the README's "not yet supported" list.
        raise ValueError(
            "ASSpeed does not support tf.distribute with more than one replica "
            f"yet. Received: {type(strategy).__name__} with "
            f"{strategy.num_replicas_in_sync} replicas. Train on one device."
        )
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True)
        loss = model.compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
        model._loss_tracker.update_state(loss, sample_weight=_batch_size(x))
        scaled_loss = model.optimizer.scale_loss(loss)
    variables = model.trainable_variables
    grads = tape.gradient(scaled_loss, variables)

    masked, counted = count_masked_rows(model.loss, y, y_pred, sample_weight)
    model.masked_ratio_tracker.update_counts(masked, counted)

    for accumulator, grad in zip(model._accumulators, grads):
        if grad is not None:
            accumulator.assign_add(tf.convert_to_tensor(grad))
    model._window_batches.assign_add(1)
    model._window_all.assign_add(counted)
    model._window_masked.assign_add(masked)

    def apply_window():
        n = ops.cast(model._window_batches, "float32")
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
        return tf.constant(True)

    tf.cond(
        model._window_batches >= model._accum_steps,
        apply_window,
        lambda: tf.constant(False),
    )
    logs = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    logs["accum_steps"] = tf.convert_to_tensor(model._accum_steps)
    return logs
