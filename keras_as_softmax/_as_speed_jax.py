"""ASSpeed's train step on JAX: a pure function of the state tuples.

The counters and accumulators are non-trainable model variables, so they
travel in `non_trainable_variables`; the optimizer runs inside
`jax.lax.cond`, which XLA compiles to a conditional that executes only the
taken branch.
"""

import jax
import keras
from keras import ops

from keras_as_softmax.as_speed import next_accumulation_steps
from keras_as_softmax.metrics import count_masked_rows


def train_step(model, state, data):
    trainable, non_trainable, optimizer_vars, metrics_vars = state
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    grad_fn = jax.value_and_grad(model.compute_loss_and_updates, has_aux=True)
    (_, aux), grads = grad_fn(
        trainable,
        non_trainable,
        metrics_vars,
        x,
        y,
        sample_weight,
        training=True,
        optimizer_variables=optimizer_vars,
    )
    unscaled_loss, y_pred, non_trainable, metrics_vars = aux

    index = {id(v): i for i, v in enumerate(model.non_trainable_variables)}

    def get(variable):
        return non_trainable[index[id(variable)]]

    masked, counted = count_masked_rows(model.loss, y, y_pred, sample_weight)
    accumulators = [get(a) + g for a, g in zip(model._accumulators, grads)]
    batches = get(model._window_batches) + 1
    n_all = get(model._window_all) + counted
    n_masked = get(model._window_masked) + masked
    steps = get(model._accum_steps)

    def apply_window(operands):
        trainable, optimizer_vars, accumulators, batches, n_all, n_masked, steps = operands
        n = ops.cast(batches, "float32")
        mean_grads = [ops.cast(a / n, a.dtype) for a in accumulators]
        trainable, optimizer_vars = model.optimizer.stateless_apply(
            optimizer_vars, mean_grads, trainable
        )
        steps = next_accumulation_steps(steps, n_all, n_masked, model.lam, model.max_steps)
        zero = [ops.zeros_like(a) for a in accumulators]
        return (
            trainable,
            optimizer_vars,
            zero,
            ops.zeros_like(batches),
            ops.zeros_like(n_all),
            ops.zeros_like(n_masked),
            steps,
        )

    operands = (trainable, optimizer_vars, accumulators, batches, n_all, n_masked, steps)
    (
        trainable,
        optimizer_vars,
        accumulators,
        batches,
        n_all,
        n_masked,
        steps,
    ) = jax.lax.cond(batches >= steps, apply_window, lambda ops_: ops_, operands)

    non_trainable = list(non_trainable)
    updates = list(zip(model._accumulators, accumulators)) + [
        (model._window_batches, batches),
        (model._window_all, n_all),
        (model._window_masked, n_masked),
        (model._accum_steps, steps),
    ]
    for variable, value in updates:
        non_trainable[index[id(variable)]] = value

    logs, metrics_vars = model._compute_metrics_with_counts(
        (masked, counted),
        lambda: model._update_metrics_variables(
            metrics_vars, unscaled_loss, x, y, y_pred, sample_weight
        ),
    )
    logs["accum_steps"] = steps
    return logs, (trainable, non_trainable, optimizer_vars, metrics_vars)
