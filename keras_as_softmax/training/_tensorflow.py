"""ASSpeed's trainer on TensorFlow (eager, graph, XLA, tf.distribute)."""

import functools

import keras
import tensorflow as tf

from keras_as_softmax import filters
from keras_as_softmax.training import _filtering
from keras_as_softmax.training import accumulation


def is_multi_worker(strategy):
    """Whether `strategy` is a `MultiWorkerMirroredStrategy` spanning
    several workers."""
    return (
        isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        and strategy.extended._in_multi_worker_mode()
    )


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
            lambda v: (
                strategy.experimental_local_results(v)[0]
                if isinstance(v, tf.distribute.DistributedValues)
                else v
            ),
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


def stateless_uniform(size, seed, counter):
    """`size` uniform draws in [0, 1), a function of `(seed, counter)`."""
    seed = tf.cast(tf.stack([seed, counter]), "int64")
    return tf.random.stateless_uniform([size], seed)


def _dense_grads(grads, variables):
    return [
        tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
        for g, v in zip(grads, variables)
    ]


def _batch_size(x):
    return tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0]


class _Hooks:
    """The passes of `_filtering.filtered_step` on TensorFlow, each behind
    a `tf.cond` that runs it only when due.

    With `jit_compile=True`, each pass is its own XLA function, called from
    a step that runs as a TensorFlow graph: the queues and conditionals are
    graph ops on a few rows, and XLA compiles two straight-line passes, as
    fast as a plain step's, in the time a plain step takes to compile. One
    XLA program holding both passes inside conditionals compiles for
    minutes on a CPU and runs several times slower.
    """

    def __init__(self, model, context=None, grad_sums=None):
        self.model = model
        # With `grad_sums` (the window's sum variables), the branch that
        # runs the training pass adds its gradients to them in place, so a
        # drawn batch without a training pass moves no gradient-sized
        # memory. The adds stay graph ops: written inside the pass's XLA
        # function, they made a step that trains 1.3x slower here.
        self.grad_sums = grad_sums
        self._score = _maybe_xla(self._score_pass, model)
        self._train = _maybe_xla(self._train_pass, model)
        # Under MirroredStrategy (a replica `context`) the filters see the
        # global batch on every replica and take the same decisions; each
        # pass runs on the replica's slice of its rows.
        self.context = context

    def maybe_score(self, pred, x):
        """The scoring pass's predictions if `pred`, else zeros."""
        rows = self._local(x)
        y_pred = tf.cond(
            pred, lambda: self._score(rows), lambda: self._no_output(rows)
        )
        return self.gather(y_pred)

    def maybe_train(self, pred, x, y, coefficients):
        """`(grads, y_pred, values, loss)` of the training pass if `pred`,
        else zeros. Under several replicas the gradients are this replica's
        (the step all-reduces them); the rest is the global batch's."""
        rows = self._local((x, y, coefficients))

        def skip():
            y_pred = self._no_output(rows[0])
            values = tf.zeros(tf.shape(rows[2]), "float32")
            zero = tf.zeros((), "float32")
            if self.grad_sums is not None:
                return y_pred, values, zero
            variables = self.model.trainable_variables
            return [tf.zeros_like(v) for v in variables], y_pred, values, zero

        run = self._train if self.grad_sums is None else self._add_pass
        outputs = tf.cond(pred, lambda: run(*rows), skip)
        if self.grad_sums is not None:
            grads, (y_pred, values, loss) = None, outputs
        else:
            grads, y_pred, values, loss = outputs
        if self.context is not None:
            loss = self.context.all_reduce("sum", loss)
        return grads, self.gather(y_pred), self.gather(values), loss

    def _no_output(self, x):
        model = self.model
        rows = _batch_size(x)
        return tf.zeros((rows, *model._output_tail), model._output_dtype)

    def _local(self, rows):
        """This replica's slice of the global batch's rows."""
        if self.context is None:
            return rows
        context = self.context
        size = self.model._filter_batch_size // context.num_replicas_in_sync
        start = context.replica_id_in_sync_group * size
        return tf.nest.map_structure(lambda t: t[start : start + size], rows)

    def gather(self, rows):
        """All-gathers the replicas' rows (outside any conditional: a
        collective may not sit in one built in replica context)."""
        if self.context is None:
            return rows
        return tf.nest.map_structure(
            lambda t: self.context.all_gather(t, axis=0), rows
        )

    def _score_pass(self, x):
        """A forward pass in training mode (dropout as in a plain step);
        moving statistics such as `BatchNormalization`'s are put back, and
        dropout's seed state is left to advance. In inference mode with
        `SkipMasked(score_training=False)`."""
        model = self.model
        if not model._filter_pair[1].score_training:
            return tf.identity(model(x, training=False))
        saved_variables = [
            v
            for v in model.inner_model.non_trainable_variables
            if not v.path.endswith("seed_generator_state")
        ]
        saved = [tf.identity(v.value) for v in saved_variables]
        with tf.control_dependencies(saved):
            y_pred = model(x, training=True)
        with tf.control_dependencies(tf.nest.flatten(y_pred)):
            for v, value in zip(saved_variables, saved):
                v.assign(value)
        return tf.identity(y_pred)

    def _train_pass(self, x, y, coefficients):
        model = self.model
        variables = model.trainable_variables
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            values = _filtering.row_values(model.loss, y, y_pred)
            loss = tf.reduce_sum(coefficients * values)
            if model.losses:
                loss += tf.cast(tf.add_n(model.losses), loss.dtype)
            scaled = model.optimizer.scale_loss(loss)
        grads = _dense_grads(tape.gradient(scaled, variables), variables)
        return grads, y_pred, values, loss

    def _add_pass(self, x, y, coefficients):
        """The training pass (XLA under `jit_compile`), its gradients added
        to `grad_sums` by graph ops."""
        grads, y_pred, values, loss = self._train(x, y, coefficients)
        for total, grad in zip(self.grad_sums, grads):
            total.assign_add(tf.cast(grad, total.dtype))
        return y_pred, values, loss


def _maybe_xla(fn, model):
    if model._passes_jit_compile:
        return tf.function(fn, jit_compile=True, reduce_retracing=True)
    return fn


class ASSpeedTrainer:
    """`train_step` and `test_step` of `ASSpeed` on TensorFlow."""

    _passes_jit_compile = False

    def make_train_function(self, force=False):
        # With filters and `jit_compile=True`, the step is a graph and its
        # passes and the end of a window are XLA functions (see `_Hooks`).
        self._passes_jit_compile = bool(
            self.sample_filters and self.jit_compile and not self.run_eagerly
        )
        if not self._passes_jit_compile:
            return super().make_train_function(force)
        self._jit_compile = False
        try:
            return super().make_train_function(force)
        finally:
            self._jit_compile = True

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        strategy = tf.distribute.get_strategy()
        replicas = strategy.num_replicas_in_sync
        context = tf.distribute.get_replica_context()
        if self.sample_filters:
            if replicas > 1:
                # One global queue: every replica sees the whole batch and
                # takes the same decisions, as one device would.
                hooks = _Hooks(self, context)
                gather = hooks.gather
            else:
                grad_sums = self._accumulation.grad_sum
                hooks, gather = _Hooks(self, grad_sums=grad_sums), None
            inputs, output = self._filtered_step(
                x, y, sample_weight, hooks, gather
            )
            grads, loss = output.grads, output.loss
            rows, masked = output.rows, output.masked_rows
            metric_args = (
                inputs,
                output.y,
                output.y_pred,
                output.metric_weight,
            )
            trained, scored = output.trained, output.scored
            self._loss_tracker.update_state(loss, sample_weight=output.trained)
        else:
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                # Divided by the number of replicas, like every Keras loss.
                loss = self.compute_loss(
                    x=x,
                    y=y,
                    y_pred=y_pred,
                    sample_weight=sample_weight,
                    training=True,
                )
                scaled_loss = self.optimizer.scale_loss(loss)
            variables = self.trainable_variables
            grads = _dense_grads(
                tape.gradient(scaled_loss, variables), variables
            )
            masked, rows = self._count_masked(y, y_pred, sample_weight)
            metric_args = (x, y, y_pred, sample_weight)
            trained, scored = tf.constant(1.0), None
            self._loss_tracker.update_state(
                loss * replicas, sample_weight=_batch_size(x)
            )
        # Read after the forward pass, which builds a subclassed model.
        # `grads` is None where the training pass added its gradients to
        # the sums already: then the sums are neither read nor written here.
        window = self._accumulation
        if grads is None:
            window = window._replace(grad_sum=[])
        state = accumulation.AccumulationState(
            *keras.tree.map_structure(lambda v: v.value, tuple(window))
        )
        self._drawn.assign_add(1)
        if replicas > 1:
            # Every replica accumulates the same all-reduced values (the
            # state variables aggregate "only_first_replica"), so all of
            # them take the same decisions at the same micro-batch.
            grads = context.all_reduce("sum", grads)
            if not self.sample_filters:  # counted on the global batch
                masked, rows = context.all_reduce("sum", [masked, rows])
        state = accumulation.add(state, grads, rows, masked)
        for variable, value in zip(
            keras.tree.flatten(tuple(window)),
            keras.tree.flatten(tuple(state)),
        ):
            variable.assign(value)
        self._finish_window_if_due(state, replicas, context)
        logs = self._step_metrics(
            *metric_args, counts=(masked, rows), trained=trained, scored=scored
        )
        logs["accum_steps"] = tf.convert_to_tensor(self._accumulation.steps)
        return multi_worker_logs(logs)

    def _finish_window_if_due(self, state, replicas, context):
        variables = self.trainable_variables
        window = self._accumulation

        def apply_window(reset_sums=True):
            # The optimizer sums gradients over replicas again: pre-divide.
            current = accumulation.AccumulationState(
                *keras.tree.map_structure(lambda v: v.value, tuple(window))
            )
            mean_grads, fresh = accumulation.finish_window(
                current, self.lam, self.max_steps, divisor=replicas
            )
            self.optimizer.apply(mean_grads, variables)
            targets = window
            if not reset_sums:
                targets = window._replace(grad_sum=[])
                fresh = fresh._replace(grad_sum=[])
            for variable, value in zip(
                keras.tree.flatten(tuple(targets)),
                keras.tree.flatten(tuple(fresh)),
            ):
                variable.assign(value)

        due = accumulation.is_due(state)
        if replicas > 1:
            # The optimizer's cross-replica merge may not sit in a
            # conditional built in replica context: build it in
            # cross-replica context, as LossScaleOptimizer does.
            def cross_replica(distribution, due):
                done = distribution.experimental_local_results(due)[0]
                tf.cond(
                    done,
                    lambda: distribution.extended.call_for_each_replica(
                        apply_window
                    ),
                    lambda: None,
                )

            context.merge_call(cross_replica, args=(due,))
        else:
            end_window = apply_window
            if self._passes_jit_compile:
                # The graph step's update as a third XLA function: as graph
                # ops, AdamW's update made an unfiltered epoch 4% slower.
                # The sums are reset after it, as graph ops: XLA:CPU writes
                # zeros into a variable through copies of it
                # (`benchmarks/window_reset_cost.py`).
                update = tf.function(
                    functools.partial(apply_window, reset_sums=False),
                    jit_compile=True,
                )

                def end_window():
                    update()
                    for variable in window.grad_sum:
                        variable.assign(tf.zeros_like(variable))

            tf.cond(due, end_window, lambda: None)

    def test_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        x, _ = filters.split_sample_ids(x)
        logs = super().test_step(
            keras.utils.pack_x_y_sample_weight(x, y, sample_weight)
        )
        return multi_worker_logs(logs)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        if iterator is not None and is_multi_worker(self.distribute_strategy):
            data_batch = local_batch(iterator, self.distribute_strategy)
            iterator = None
        return super()._maybe_symbolic_build(
            iterator=iterator, data_batch=data_batch
        )
