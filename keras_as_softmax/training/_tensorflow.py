"""ASSpeed's trainer on TensorFlow (eager, graph, XLA, tf.distribute)."""

import contextlib

import tensorflow as tf

from keras_as_softmax.training import _filtering
from keras_as_softmax.training import _step


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

    Keras's `fit` builds the model from a probe batch that it averages
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
    """A step's logs, ready for Keras's reduction across workers.

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

    Under `jit_compile=True` the whole step is one XLA program, its
    conditionals decided on the device, except where `xla_passes` chooses
    otherwise (CPUs, several replicas): there each pass is its own XLA
    function, called from a step that runs as a TensorFlow graph.
    """

    def __init__(self, model, context=None, accumulate=None):
        self.model = model
        self.engine = model.filter_engine
        # With `accumulate` (the optimizer's), the branch that runs the
        # training pass adds its gradients to the window's sums in place, so
        # a drawn batch without a training pass moves no gradient-sized
        # memory. The adds stay graph ops outside the pass's XLA function,
        # which returns the gradients: measured, that is the faster place.
        self.accumulate = accumulate
        self._score = _maybe_xla(self._score_pass, model)
        self._train = _maybe_xla(self._train_pass, model)
        # Under MirroredStrategy (a replica `context`) the filters see the
        # global batch on every replica and take the same decisions; each
        # pass runs on the replica's slice of its rows.
        self.context = context
        # Set when a trace of the scoring pass finds regularization losses:
        # without them its penalty is a constant zero, and the replicas'
        # sum needs no collective.
        self._scored_penalty = False

    def maybe_score(self, pred, x):
        """`(y_pred, penalty)` of the scoring pass if `pred`, else zeros.
        Under several replicas the predictions are the global batch's and
        the penalty the replicas' mean."""
        rows = self._local(x)

        def skip():
            return self._no_output(rows), tf.zeros((), "float32")

        y_pred, penalty = tf.cond(pred, lambda: self._score(rows), skip)
        if self.context is not None and self._scored_penalty:
            penalty = self.context.all_reduce("sum", penalty)
        return self.gather(y_pred), penalty

    def maybe_train(self, pred, x, y, coefficients):
        """`(grads, y_pred, values, loss)` of the training pass if `pred`,
        else zeros. Under several replicas the gradients are this replica's
        (the step all-reduces them); the rest is the global batch's."""
        rows = self._local((x, y, coefficients))

        def skip():
            y_pred = self._no_output(rows[0])
            values = tf.zeros(tf.shape(rows[2]), "float32")
            zero = tf.zeros((), "float32")
            if self.accumulate is not None:
                return y_pred, values, zero
            variables = self.model.trainable_variables
            return [tf.zeros_like(v) for v in variables], y_pred, values, zero

        run = self._train if self.accumulate is None else self._add_pass
        outputs = tf.cond(pred, lambda: run(*rows), skip)
        if self.accumulate is not None:
            grads, (y_pred, values, loss) = None, outputs
        else:
            grads, y_pred, values, loss = outputs
        if self.context is not None:
            loss = self.context.all_reduce("sum", loss)
        return grads, self.gather(y_pred), self.gather(values), loss

    def _no_output(self, x):
        return self.engine.no_output(_batch_size(x))

    def _local(self, rows):
        """This replica's slice of the global batch's rows."""
        if self.context is None:
            return rows
        context = self.context
        size = self.engine.batch_size // context.num_replicas_in_sync
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
        """A forward pass in training mode, its moving statistics put back
        (`_filtering.moving_statistics`); in inference mode with
        `SkipMasked(score_training=False)`."""
        model = self.model
        if not self.engine.score_training:
            y_pred = model(x, training=False)
            return tf.identity(y_pred), self._score_penalty()
        saved_variables = _filtering.moving_statistics(model)
        saved = [tf.identity(v.value) for v in saved_variables]
        with tf.control_dependencies(saved):
            y_pred = model(x, training=True)
        with tf.control_dependencies(tf.nest.flatten(y_pred)):
            for v, value in zip(saved_variables, saved):
                v.assign(value)
        return tf.identity(y_pred), self._score_penalty()

    def _score_penalty(self):
        losses = self.model.losses
        self._scored_penalty = bool(losses)
        return _filtering.penalty(self.model, losses)

    def _train_pass(self, x, y, coefficients):
        model = self.model
        variables = model.trainable_variables
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            model.check_step_outputs(y_pred)
            values = _filtering.row_values(model.loss, y, y_pred)
            penalty = _filtering.penalty(model, model.losses)
            loss = tf.reduce_sum(coefficients * values) + penalty
            scaled = model.optimizer.scale_loss(loss)
        grads = _dense_grads(tape.gradient(scaled, variables), variables)
        return grads, y_pred, values, loss

    def _add_pass(self, x, y, coefficients):
        """The training pass (XLA under `jit_compile`), its gradients added
        to the window's sums by graph ops."""
        grads, y_pred, values, loss = self._train(x, y, coefficients)
        self.accumulate(grads)
        return y_pred, values, loss


def _maybe_xla(fn, model):
    if model._passes_jit_compile:
        return tf.function(fn, jit_compile=True, reduce_retracing=True)
    return fn


def runs_on_cpus(strategy):
    """Whether a step under `strategy` runs on CPUs only."""
    try:
        devices = strategy.extended.worker_devices
    except RuntimeError:  # the default strategy: TensorFlow places the step
        return not tf.config.list_logical_devices("GPU")
    return all(
        tf.DeviceSpec.from_string(d).device_type == "CPU" for d in devices
    )


FILTERED_STEPS = ("auto", "one_program", "xla_passes")


def xla_passes(model):
    """Whether a filtered step under `jit_compile=True` runs as a graph
    whose passes are XLA functions, rather than as one XLA program.

    The one place this platform choice is made (beside
    `xla_unreachable`, which makes every step a graph). One program, its
    conditionals decided on the device, is the default on a GPU or TPU.
    On CPUs the graph is the faster, by far at MiniLM's shape: XLA's CPU
    backend runs conditionals slowly (measured as the step overhead).
    Under several replicas the graph stays: on two logical
    CPUs, one program could not reach the second replica's variables.
    The two take the same decisions, except that TensorFlow's stateless
    random ops draw other numbers from one key under XLA. The model's
    `_tf_filtered_step` ("one_program", "xla_passes") overrides the
    choice, for tests and benchmarks.
    """
    if not (
        model.sample_filters and model.jit_compile and not model.run_eagerly
    ):
        return False
    choice = model._tf_filtered_step
    if choice not in FILTERED_STEPS:
        raise ValueError(
            f"Expected _tf_filtered_step to be one of {FILTERED_STEPS}. "
            f"Received: {choice!r}"
        )
    if choice == "auto":
        strategy = model.distribute_strategy
        return strategy.num_replicas_in_sync > 1 or runs_on_cpus(strategy)
    return choice == "xla_passes"


def xla_unreachable(model):
    """Whether the model's variables live on several CPUs, whose replicas'
    variables one XLA program cannot reach (TensorFlow's known issue: a
    plain Keras model under `jit_compile=True` fails the same way), so that
    every step runs as a graph."""
    strategy = model.distribute_strategy
    return strategy.num_replicas_in_sync > 1 and runs_on_cpus(strategy)


class _Step:
    """The stages of `_step.train_step` on TensorFlow, in replica context
    under a `tf.distribute` strategy."""

    def __init__(self, model):
        self.model = model
        self.replicas = tf.distribute.get_strategy().num_replicas_in_sync
        self.context = tf.distribute.get_replica_context()

    def filtered(self, x, y, sample_weight):
        model = self.model
        if self.replicas > 1:
            # One global queue: every replica sees the whole batch and
            # takes the same decisions, as one device would.
            hooks = _Hooks(model, self.context)
            gather = hooks.gather
        else:
            if not model.optimizer.built:
                # Keras builds it in the step's first trace.
                model.optimizer.build(model.trainable_variables)
            hooks = _Hooks(model, accumulate=model.optimizer.accumulate)
            gather = None
        inputs, output = model.filter_engine.step(
            model.loss, x, y, sample_weight, hooks, stateless_uniform, gather
        )
        return _step.filtered_result(inputs, output)

    def plain(self, x, y, sample_weight):
        model = self.model
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            # Divided by the number of replicas, like every Keras loss.
            loss = model.compute_loss(x, y, y_pred, sample_weight)
            scaled_loss = model.optimizer.scale_loss(loss)
        variables = model.trainable_variables
        grads = _dense_grads(tape.gradient(scaled_loss, variables), variables)
        counts = model.count_masked(y, y_pred, sample_weight)
        if self.replicas > 1:  # the rule counts the global batch
            counts = self.context.all_reduce("sum", list(counts))
        return _step.plain_result(
            grads,
            counts,
            loss * self.replicas,
            _batch_size(x),
            x,
            y,
            y_pred,
            sample_weight,
        )

    def apply(self, result):
        # Under several replicas a filtered step's gradients are zeros
        # where no training pass ran: they bring no gradient to the window.
        self.model.optimizer.apply(
            result.grads,
            self.model.trainable_variables,
            rows=result.rows,
            masked_rows=result.masked,
            from_pass=tf.convert_to_tensor(result.trained) > 0.5,
        )

    def logs(self, result):
        return multi_worker_logs(_step.update_logs(self.model, result))


class ASSpeedTrainer:
    """`train_step` and `test_step` of `ASSpeed` on TensorFlow."""

    _passes_jit_compile = False
    _tf_filtered_step = "auto"

    def make_train_function(self, force=False):
        self._passes_jit_compile = xla_passes(self)
        graph = self._passes_jit_compile or xla_unreachable(self)
        with self._without_jit(graph):
            return super().make_train_function(force)

    def make_test_function(self, force=False):
        with self._without_jit(xla_unreachable(self)):
            return super().make_test_function(force)

    @contextlib.contextmanager
    def _without_jit(self, graph):
        """Keras builds the step as a TensorFlow graph if `graph`."""
        jit_compile = self.jit_compile
        if graph:
            self._jit_compile = False
        try:
            yield
        finally:
            self._jit_compile = jit_compile

    def train_step(self, data):
        return _step.train_step(_Step(self), data)

    def test_step(self, data):
        return multi_worker_logs(super().test_step(_step.without_ids(data)))

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        if iterator is not None and is_multi_worker(self.distribute_strategy):
            data_batch = local_batch(iterator, self.distribute_strategy)
            iterator = None
        return super()._maybe_symbolic_build(
            iterator=iterator, data_batch=data_batch
        )
