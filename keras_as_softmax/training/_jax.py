"""ASSpeed's trainer on JAX: `train_step(state, data) -> (logs, state)`.

The filters' queues and the last-seen memory are non-trainable model
variables and the accumulation window lives in the optimizer's variables
(`AccumulatingOptimizer`), so all of them travel through the pure step.
Keras's `make_train_function` compiles the step into one program, with its
state donated; the scoring pass, the training pass and the end of a window
run inside `jax.lax.cond`, whose untaken branch XLA skips. Nothing is read
back to the host.

With `steps_per_execution=N`, N drawn batches run in one `jax.lax.scan`,
one dispatch, as Keras's own trainer does in its later releases
(`_make_function`).
"""

import itertools

import jax
import keras
from keras.src.backend.jax import trainer as keras_jax_trainer

from keras_as_softmax.training import _filtering
from keras_as_softmax.training import _step


def stateless_uniform(size, seed, counter):
    """`size` uniform draws in [0, 1), a function of `(seed, counter)`."""
    key = jax.random.fold_in(jax.random.key(seed), counter)
    return jax.random.uniform(key, (size,))


# Keras releases with keras-team/keras#23527 run a group of
# `steps_per_execution` batches in one `lax.scan` themselves; earlier ones
# loop on the host.
KERAS_SCANS_STEPS = hasattr(keras_jax_trainer, "_build_multi_step_scan")


def scan(step_function, concatenate_outputs=False):
    """`(state, batches) -> (outputs, state)`: `step_function` over the
    list `batches` in one `jax.lax.scan`, compiled with the state donated.
    The outputs are the last step's, or all steps' joined."""

    def run(state, batches):
        stacked = jax.tree.map(lambda *a: jax.numpy.stack(a), *batches)

        def body(state, batch):
            outputs, state = step_function(state, batch)
            return state, outputs

        state, outputs = jax.lax.scan(body, state, stacked)
        if concatenate_outputs:
            return jax.tree.map(_join_steps, outputs), state
        return jax.tree.map(lambda a: a[-1], outputs), state

    return jax.jit(run, donate_argnums=0)


def _join_steps(a):
    return a.reshape((a.shape[0] * a.shape[1], *a.shape[2:]))


def _stackable(batches):
    def signature(batch):
        leaves, structure = jax.tree.flatten(batch)
        return structure, [(leaf.shape, leaf.dtype) for leaf in leaves]

    first = signature(batches[0])
    return all(signature(batch) == first for batch in batches[1:])


class _Hooks:
    """The passes of `_filtering.filtered_step` on JAX.

    The model state carried through conditionals is the values of the
    variables a pass can change (the inner model's non-trainable ones:
    dropout's seed state, moving statistics). The weights, the accumulation
    window and the queues stay outside: every value a conditional returns
    is a fresh buffer, so carrying them would copy the weights and the
    window out of two conditionals on every step.
    """

    def __init__(self, model, trainable, non_trainable, optimizer_variables):
        self.model = model
        # The accumulation window's values: the training pass adds its
        # gradients to them inside its branch, so a drawn batch without a
        # training pass moves no gradient-sized memory.
        self.window = model.optimizer.stateless_window(optimizer_variables)
        self.trainable = list(trainable)
        self.non_trainable = list(non_trainable)
        self.optimizer_variables = optimizer_variables
        self.engine = model.filter_engine
        inner = {id(v) for v in model.inner_model.non_trainable_variables}
        self.pass_index = [
            i
            for i, v in enumerate(model.non_trainable_variables)
            if id(v) in inner
        ]
        self.keep_after_scoring = [
            model.non_trainable_variables[i].path.endswith(
                "seed_generator_state"
            )
            for i in self.pass_index
        ]
        self.state = [self.non_trainable[i] for i in self.pass_index]

    def maybe_score(self, pred, x):
        """`(y_pred, penalty)` of the scoring pass if `pred`, else zeros."""

        def skip(state, x):
            return (self._no_output(x), keras.ops.zeros((), "float32")), state

        scored, self.state = jax.lax.cond(pred, self.score, skip, self.state, x)
        return scored

    def maybe_train(self, pred, x, y, coefficients):
        """`(None, y_pred, values, loss)` of the training pass if `pred`,
        else zeros; the pass's gradients are added to `window`."""

        def skip(carried, x, y, coefficients):
            outputs = (
                self._no_output(x),
                keras.ops.zeros_like(coefficients),
                keras.ops.zeros((), "float32"),
            )
            return outputs, carried

        def train(carried, x, y, coefficients):
            state, window = carried
            (grads, *outputs), state = self.train(state, x, y, coefficients)
            window = self.model.optimizer.stateless_accumulate(window, grads)
            return tuple(outputs), (state, window)

        outputs, (self.state, self.window) = jax.lax.cond(
            pred,
            train,
            skip,
            (self.state, self.window),
            x,
            y,
            coefficients,
        )
        return (None, *outputs)

    def merged_non_trainable(self):
        """The model's non-trainable values with the passes' updates."""
        return self._full(self.state)

    def _no_output(self, x):
        return self.engine.no_output(keras.tree.flatten(x)[0].shape[0])

    def _full(self, state):
        values = list(self.non_trainable)
        for i, value in zip(self.pass_index, state):
            values[i] = value
        return values

    def _changed(self, values):
        return [values[i] for i in self.pass_index]

    def score(self, state, x):
        """A forward pass in training mode (in inference mode with
        `SkipMasked(score_training=False)`); only dropout's seed state
        advances (moving statistics stay as they were)."""
        model = self.model
        y_pred, updated, losses = model.stateless_call(
            self.trainable,
            self._full(state),
            x,
            return_losses=True,
            training=self.engine.score_training,
        )
        state = [
            new if keep else old
            for new, old, keep in zip(
                self._changed(updated), state, self.keep_after_scoring
            )
        ]
        return (y_pred, _filtering.penalty(model, losses)), state

    def train(self, state, x, y, coefficients):
        model = self.model
        non_trainable = self._full(state)
        optimizer_mapping = list(
            zip(model.optimizer.variables, self.optimizer_variables)
        )

        def objective(trainable):
            y_pred, updated, losses = model.stateless_call(
                trainable, non_trainable, x, return_losses=True, training=True
            )
            model.check_step_outputs(y_pred)
            values = _filtering.row_values(model.loss, y, y_pred)
            penalty = _filtering.penalty(model, losses)
            loss = keras.ops.sum(coefficients * values) + penalty
            with keras.StatelessScope(state_mapping=optimizer_mapping):
                scaled = model.optimizer.scale_loss(loss)
            return scaled, (loss, y_pred, values, updated)

        (_, (loss, y_pred, values, updated)), grads = jax.value_and_grad(
            objective, has_aux=True
        )(self.trainable)
        return (grads, y_pred, values, loss), self._changed(updated)


class _Step:
    """The stages of `_step.train_step` on JAX, as pure functions of the
    state `(trainable, non_trainable, optimizer, metrics)` values, which
    each stage replaces."""

    def __init__(self, model, state):
        self.model = model
        (
            self.trainable,
            non_trainable,
            self.optimizer_vars,
            self.metrics_vars,
        ) = state
        self.non_trainable = list(non_trainable)

    @property
    def state(self):
        return (
            self.trainable,
            self.non_trainable,
            self.optimizer_vars,
            self.metrics_vars,
        )

    def filtered(self, x, y, sample_weight):
        model = self.model
        hooks = _Hooks(
            model, self.trainable, self.non_trainable, self.optimizer_vars
        )
        mapping = list(zip(model.trainable_variables, self.trainable))
        mapping += zip(model.non_trainable_variables, self.non_trainable)
        with keras.StatelessScope(state_mapping=mapping) as scope:
            inputs, output = model.filter_engine.step(
                model.loss, x, y, sample_weight, hooks, stateless_uniform
            )
        index = {id(v): i for i, v in enumerate(model.non_trainable_variables)}
        self.non_trainable = hooks.merged_non_trainable()
        for v in model.filter_engine.variables():
            self.non_trainable[index[id(v)]] = scope.get_current_value(v)
        self.optimizer_vars = model.optimizer.stateless_with_window(
            self.optimizer_vars, hooks.window
        )
        return _step.filtered_result(inputs, output)

    def plain(self, x, y, sample_weight):
        model = self.model
        grad_fn = jax.value_and_grad(
            model.compute_loss_and_updates, has_aux=True
        )
        (_, aux), grads = grad_fn(
            self.trainable,
            self.non_trainable,
            self.metrics_vars,
            x,
            y,
            sample_weight,
            training=True,
            optimizer_variables=self.optimizer_vars,
        )
        loss, y_pred, non_trainable, self.metrics_vars = aux
        self.non_trainable = list(non_trainable)
        counts = model.count_masked(y, y_pred, sample_weight)
        batch = keras.tree.flatten(x)[0].shape[0]
        return _step.plain_result(
            grads, counts, loss, batch, x, y, y_pred, sample_weight
        )

    def apply(self, result):
        self.trainable, self.optimizer_vars = (
            self.model.optimizer.stateless_apply(
                self.optimizer_vars,
                result.grads,
                self.trainable,
                rows=result.rows,
                masked_rows=result.masked,
            )
        )

    def logs(self, result):
        model = self.model
        mapping = list(zip(model.metrics_variables, self.metrics_vars))
        mapping += zip(model.optimizer.variables, self.optimizer_vars)
        with keras.StatelessScope(state_mapping=mapping) as scope:
            logs = _step.update_logs(model, result)
        self.metrics_vars = [
            scope.get_current_value(v) for v in model.metrics_variables
        ]
        return logs


class ASSpeedTrainer:
    """`train_step` of `ASSpeed` on JAX: Keras's own `make_train_function`
    compiles it into one program (`jax.jit` with the state donated)."""

    def __setattr__(self, name, value):
        # Keras's JAX `fit` and `evaluate` keep each step's state arrays in
        # `_jax_state`, for a callback to sync. `Layer.__setattr__` would
        # walk that dict for variables to track (there are none) on every
        # step, at a host cost that grows with the number of arrays.
        if name == "_jax_state":
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    if not KERAS_SCANS_STEPS:

        def _make_function(self, step_function, concatenate_outputs=False):
            """Keras's `iterator_step`, with each full group of
            `steps_per_execution` batches in one `jax.lax.scan`.

            Keras's `fit` (before keras-team/keras#23527) dispatches each
            batch's compiled step from a Python loop, at a host cost that
            a GPU's step can fall to once the filters skip its passes; the
            scan pays it once a group. A group of fewer
            batches (an epoch's last) or of unequal shapes (one holding the
            epoch's short last batch) goes to Keras's loop over the
            compiled step.
            """
            keras_step = super()._make_function(
                step_function, concatenate_outputs
            )
            if (
                self.steps_per_execution == 1
                or self.run_eagerly
                or not self.jit_compile
            ):
                return keras_step
            scanned = scan(step_function, concatenate_outputs)

            def iterator_step(state, iterator):
                # Read at each call, as Keras's loop and epoch iterator do.
                steps = self.steps_per_execution
                batches = list(itertools.islice(iterator, steps))
                if steps > 1 and len(batches) == steps and _stackable(batches):
                    return scanned(state, batches)
                return keras_step(state, iter(batches))

            return iterator_step

    def train_step(self, state, data):
        step = _Step(self, state)
        logs = _step.train_step(step, data)
        return logs, step.state

    def test_step(self, state, data):
        return super().test_step(state, _step.without_ids(data))
