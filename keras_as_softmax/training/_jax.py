"""ASSpeed's trainer on JAX: `train_step(state, data) -> (logs, state)`.

The accumulation window, the filters' queues and the last-seen memory are
non-trainable model variables, so they travel in `non_trainable_variables`
through the pure step. In one program (`train_step`), the end of a window
(the mean, the optimizer, the reset) runs inside `jax.lax.cond`, which
XLA compiles to a conditional that executes only the taken branch.

With filters and `jit_compile`, the step is staged: the host decides from
the queues whether a pass runs, and calls a program compiled for that
decision, in which the passes are straight-line code (`_Plan`). With the
training pass inside `jax.lax.cond`, a filtered step with nothing to skip
cost 1.77x a plain one on XLA:CPU; staged, 1.05x
(`benchmarks/jax_filter_cost.py`). The end of a window is its own
program, which the host calls when it reads that the window is due: a
`jax.lax.cond` returns fresh buffers, so its untaken branch copied the
weights, AdamW's moments and the window's sums on every step that ended
no window (42.8 ms of a MiniLM step that trains nothing, against 2.8 ms
without it, `benchmarks/jax_stage_cost.py`), and a program of its own
leaves one program, not two, holding the training pass to compile.
"""

import functools
from typing import NamedTuple

import jax
import keras
from jax.extend import core as jax_core

from keras_as_softmax import filters
from keras_as_softmax.training import _filtering
from keras_as_softmax.training import accumulation


def stateless_uniform(size, seed, counter):
    """`size` uniform draws in [0, 1), a function of `(seed, counter)`."""
    key = jax.random.fold_in(jax.random.key(seed), counter)
    return jax.random.uniform(key, (size,))


# Primitives whose sub-jaxpr `bfloat16_matmuls` evaluates inline (a forward
# pass needs no custom derivative rule), with the parameter that holds it;
# one without it is bound as it is.
_CALLS = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "checkpoint": "jaxpr",
    "remat": "jaxpr",
}


def bfloat16_matmuls(fn):
    """`fn` with its float32 matrix products computed from bfloat16 operands
    and accumulated in float32, and everything else as it was.

    `fn` is traced to a jaxpr, which is evaluated with every float32
    `dot_general` (matmul, einsum, attention) replaced, inside `jax.jit`
    calls and custom-derivative functions too (not inside control flow).
    XLA:CPU ignores `jax.default_matmul_precision`, so the operands are
    cast. For a forward pass only: custom derivative rules are dropped.
    """

    def wrapped(*args):
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        outputs = _eval_bfloat16(
            closed.jaxpr, closed.consts, jax.tree.leaves(args)
        )
        return jax.tree.unflatten(jax.tree.structure(shape), outputs)

    return wrapped


def _eval_bfloat16(jaxpr, consts, args):
    env = {}

    def read(v):
        return v.val if isinstance(v, jax_core.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    float32 = jax.numpy.float32
    for eqn in jaxpr.eqns:
        values = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name == "dot_general" and all(v.dtype == float32 for v in values):
            a, b = (v.astype(jax.numpy.bfloat16) for v in values)
            outputs = [
                jax.lax.dot_general(
                    a,
                    b,
                    eqn.params["dimension_numbers"],
                    preferred_element_type=float32,
                )
            ]
        elif eqn.params.get(_CALLS.get(name)) is not None:
            sub = eqn.params[_CALLS[name]]
            sub_consts = getattr(sub, "consts", ())
            sub = getattr(sub, "jaxpr", sub)
            outputs = _eval_bfloat16(sub, sub_consts, values)
        else:
            with eqn.ctx.manager:
                outputs = eqn.primitive.bind(
                    *values, **eqn.primitive.get_bind_params(eqn.params)
                )
            if not eqn.primitive.multiple_results:
                outputs = [outputs]
        env.update(zip(eqn.outvars, outputs))
    return [read(v) for v in jaxpr.outvars]


class _Stop(Exception):
    """Ends the trace of a deciding stage at the training pass, with what
    the stage returns."""

    def __init__(self, outputs):
        super().__init__()
        self.outputs = outputs


class _Plan(NamedTuple):
    """How a traced step runs its passes.

    `score`, the scoring pass: `"decide"` (no pass; note whether one is
    due, and the outputs of a step without it), `"run"` (run it and note
    its outputs) or `"given"` (the outputs, of either, come in `scored`).
    `train`, the training pass: `"stop"` (end the trace with what was
    noted and whether a pass is due), `True` or `False`. A plan of `None`
    is one program with each pass inside `jax.lax.cond`.
    """

    score: str
    train: object
    scored: object = None  # (y_pred, pass state) after the scoring pass


class _Hooks:
    """The passes of `_filtering.filtered_step` on JAX.

    The model state carried through conditionals is the values of the
    variables a pass can change (the inner model's non-trainable ones:
    dropout's seed state, moving statistics). The weights, the accumulation
    window and the queues stay outside: every value a conditional returns
    is a fresh buffer, so carrying them would copy the weights and the
    window out of two conditionals on every step.
    """

    def __init__(
        self, model, trainable, non_trainable, optimizer_variables, plan
    ):
        self.model = model
        self.plan = plan
        # What a deciding stage returns besides the training decision.
        self.noted = (False, None)
        self.trainable = list(trainable)
        self.non_trainable = list(non_trainable)
        self.optimizer_variables = optimizer_variables
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
        """The scoring pass's predictions if `pred`, else zeros."""

        def skip(state, x):
            return self._no_output(x), state

        plan = self.plan
        if plan is None:
            y_pred, self.state = jax.lax.cond(
                pred, self.score, skip, self.state, x
            )
        elif plan.score == "run":
            y_pred, self.state = self.score(self.state, x)
            self.noted = (y_pred, self.state)
        elif plan.score == "given":
            y_pred, self.state = plan.scored
        else:
            y_pred = self._no_output(x)
            # Fresh buffers: the last stage takes them beside the state
            # it donates.
            self.noted = (pred, (y_pred, self.state))
        return y_pred

    def maybe_train(self, pred, x, y, coefficients):
        """`(grads, y_pred, values, loss)` of the training pass if `pred`,
        else zeros (the gradients `None` when the plan knows no pass runs:
        nothing to add to the window)."""

        def skip(state, x, y, coefficients, grads=True):
            zeros = keras.ops.zeros_like
            outputs = (
                [zeros(t) for t in self.trainable] if grads else None,
                self._no_output(x),
                zeros(coefficients),
                keras.ops.zeros((), "float32"),
            )
            return outputs, state

        plan = self.plan
        if plan is None:
            outputs, self.state = jax.lax.cond(
                pred, self.train, skip, self.state, x, y, coefficients
            )
        elif plan.train == "stop":
            raise _Stop((self.noted, pred))
        elif plan.train:
            outputs, self.state = self.train(self.state, x, y, coefficients)
        else:
            outputs, _ = skip(self.state, x, y, coefficients, grads=False)
        return outputs

    def merged_non_trainable(self):
        """The model's non-trainable values with the passes' updates."""
        return self._full(self.state)

    def _no_output(self, x):
        model = self.model
        rows = keras.tree.flatten(x)[0].shape[0]
        return keras.ops.zeros((rows, *model._output_tail), model._output_dtype)

    def _full(self, state):
        values = list(self.non_trainable)
        for i, value in zip(self.pass_index, state):
            values[i] = value
        return values

    def _changed(self, values):
        return [values[i] for i in self.pass_index]

    def score(self, state, x):
        """A forward pass in training mode (in inference mode with
        `SkipMasked(score_training=False)`, its products in bfloat16 with
        `score_precision="bfloat16"`); only dropout's seed state advances
        (moving statistics stay as they were)."""
        model = self.model
        skip_masked = model._filter_pair[1]

        forward = functools.partial(
            model.stateless_call, training=skip_masked.score_training
        )
        if skip_masked.score_precision == "bfloat16":
            forward = bfloat16_matmuls(forward)
        y_pred, updated = forward(self.trainable, self._full(state), x)
        state = [
            new if keep else old
            for new, old, keep in zip(
                self._changed(updated), state, self.keep_after_scoring
            )
        ]
        return y_pred, state

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
            values = _filtering.row_values(model.loss, y, y_pred)
            loss = keras.ops.sum(coefficients * values)
            if losses:
                loss = loss + sum(losses)
            with keras.StatelessScope(state_mapping=optimizer_mapping):
                scaled = model.optimizer.scale_loss(loss)
            return scaled, (loss, y_pred, values, updated)

        (_, (loss, y_pred, values, updated)), grads = jax.value_and_grad(
            objective, has_aux=True
        )(self.trainable)
        return (grads, y_pred, values, loss), self._changed(updated)


class ASSpeedTrainer:
    """`train_step` of `ASSpeed` on JAX."""

    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return
        if not (self.sample_filters and self.jit_compile) or self.run_eagerly:
            super().make_train_function(force)
            return
        # Staged: decide on the host, then run a program without the
        # conditionals it does not need (see the module's docstring).
        out_shardings = sum_shardings = None
        index = self._non_trainable_index()
        sum_positions = [index[id(v)] for v in self._accumulation.grad_sum]
        if keras.distribution.distribution() is not None:
            out_shardings = (None, self._get_state_sharding_spec())
            sum_shardings = [out_shardings[1][1][i] for i in sum_positions]
        counts = [
            index[id(v)]
            for v in (
                self._accumulation.micro_batches,
                self._accumulation.steps,
            )
        ]

        def window_due(state):
            """Whether the window is due once this step's batch is added."""
            batches, steps = (int(state[1][i]) for i in counts)
            return batches + 1 >= steps

        decide = jax.jit(functools.partial(self._until_training, "decide"))
        score = jax.jit(functools.partial(self._until_training, "run"))
        finish = {
            train: jax.jit(
                lambda state, data, scored, train=train: self._step(
                    state, data, _Plan("given", train, scored), False
                ),
                donate_argnums=0,
                out_shardings=out_shardings,
            )
            for train in (False, True)
        }
        end_window = jax.jit(
            self._end_window, donate_argnums=0, out_shardings=out_shardings
        )

        # The sums' reset in a program of its own: in the program that
        # reads them, XLA:CPU writes the zeros through copies of the sums
        # (`benchmarks/window_reset_cost.py`).
        def zeros(sums):
            return [keras.ops.zeros_like(s) for s in sums]

        zero_sums = jax.jit(
            zeros, donate_argnums=0, out_shardings=sum_shardings
        )

        def reset_sums(state):
            trainable, non_trainable, *rest = state
            non_trainable = list(non_trainable)
            sums = zero_sums([non_trainable[i] for i in sum_positions])
            for i, value in zip(sum_positions, sums):
                non_trainable[i] = value
            return (trainable, non_trainable, *rest)

        def step(state, data):
            (score_due, scored), train_due = decide(state, data)
            if score_due:
                scored, train_due = score(state, data)
            due = window_due(state)
            logs, state = finish[bool(train_due)](state, data, scored)
            if due:
                window_logs, state = end_window(state)
                logs, state = {**logs, **window_logs}, reset_sums(state)
            return logs, state

        self.train_function = self._make_function(step)

    def _until_training(self, score, state, data):
        """Traces the step up to its training pass, with the scoring pass
        as `score` says (`_Plan`): `(noted, training pass due)`, where
        `noted` is `(scoring pass due, (y_pred, pass state) without it)`
        (`"decide"`; when no scoring pass is due, the training decision
        stands) or the scoring pass's `(y_pred, pass state)` (`"run"`).
        Every step then runs one program of two, with or without a
        training pass, whether or not it scored."""
        try:
            self._step(state, data, _Plan(score, "stop"))
        except _Stop as stop:
            return stop.outputs
        raise AssertionError("a filtered step reaches its training pass")

    def train_step(self, state, data):
        return self._step(state, data, None)

    def _non_trainable_index(self):
        """`{id(variable): position}` in the state's non-trainable values."""
        return {id(v): i for i, v in enumerate(self.non_trainable_variables)}

    def _step(self, state, data, plan, end_window=True):
        """One step: `plan` says how the passes run (`_Plan`);
        `end_window` whether the step may end the window (in
        `jax.lax.cond`). The staged step leaves the end of a window to its
        own program (`_end_window`)."""
        trainable, non_trainable, optimizer_vars, metrics_vars = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        variables = self.non_trainable_variables
        index = self._non_trainable_index()
        non_trainable = list(non_trainable)

        if self.sample_filters:
            hooks = _Hooks(self, trainable, non_trainable, optimizer_vars, plan)
            mapping = list(zip(self.trainable_variables, trainable)) + list(
                zip(variables, non_trainable)
            )
            with keras.StatelessScope(state_mapping=mapping) as scope:
                inputs, output = self._filtered_step(x, y, sample_weight, hooks)
            non_trainable = hooks.merged_non_trainable()
            for v in self._filter_variables():
                non_trainable[index[id(v)]] = scope.get_current_value(v)
            grads, loss_value = output.grads, output.loss
            loss_weight = output.trained
            rows, masked = output.rows, output.masked_rows
            metric_args = (
                inputs,
                output.y,
                output.y_pred,
                output.metric_weight,
            )
            trained, scored = output.trained, output.scored
        else:
            grad_fn = jax.value_and_grad(
                self.compute_loss_and_updates, has_aux=True
            )
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
            loss_value, y_pred, non_trainable, metrics_vars = aux
            non_trainable = list(non_trainable)
            masked, rows = self._count_masked(y, y_pred, sample_weight)
            loss_weight = keras.tree.flatten(x)[0].shape[0]
            metric_args = (x, y, y_pred, sample_weight)
            trained, scored = 1.0, None

        drawn = index[id(self._drawn)]
        non_trainable[drawn] = non_trainable[drawn] + 1
        window = accumulation.add(
            self._window(non_trainable), grads, rows, masked
        )
        if end_window:
            trainable, optimizer_vars, window = jax.lax.cond(
                accumulation.is_due(window),
                self._finish_window,
                lambda operands: operands,
                (list(trainable), list(optimizer_vars), window),
            )
        self._set_window(non_trainable, window)

        metrics_mapping = list(zip(self.metrics_variables, metrics_vars))
        with keras.StatelessScope(state_mapping=metrics_mapping) as scope:
            self._loss_tracker.update_state(
                loss_value, sample_weight=loss_weight
            )
            logs = self._step_metrics(
                *metric_args,
                counts=(masked, rows),
                trained=trained,
                scored=scored,
            )
        metrics_vars = [
            scope.get_current_value(v) for v in self.metrics_variables
        ]
        logs["accum_steps"] = window.steps
        return logs, (trainable, non_trainable, optimizer_vars, metrics_vars)

    def _window(self, non_trainable):
        """The accumulation window's state in the non-trainable values."""
        index = self._non_trainable_index()
        return accumulation.AccumulationState(
            *keras.tree.pack_sequence_as(
                tuple(self._accumulation),
                [
                    non_trainable[index[id(v)]]
                    for v in keras.tree.flatten(tuple(self._accumulation))
                ],
            )
        )

    def _set_window(self, non_trainable, window):
        """Writes `window` into the list of non-trainable values."""
        index = self._non_trainable_index()
        for v, value in zip(
            keras.tree.flatten(tuple(self._accumulation)),
            keras.tree.flatten(tuple(window)),
        ):
            non_trainable[index[id(v)]] = value

    def _end_window(self, state):
        """The staged step's end of a window, run when the host knows it
        is due: `(logs, state)`, the window's sums left as they were (the
        step resets them next). Its own program, so that the training pass
        compiles once, and no step that ends no window carries a
        conditional (whose untaken branch would copy every operand)."""
        trainable, non_trainable, optimizer_vars, metrics_vars = state
        non_trainable = list(non_trainable)
        window = self._window(non_trainable)
        trainable, optimizer_vars, fresh = self._finish_window(
            (list(trainable), list(optimizer_vars), window)
        )
        fresh = fresh._replace(grad_sum=window.grad_sum)
        self._set_window(non_trainable, fresh)
        state = (trainable, non_trainable, optimizer_vars, metrics_vars)
        return {"accum_steps": fresh.steps}, state

    def _finish_window(self, operands):
        """The end of a window: `(trainable, optimizer_vars, window)` after
        the optimizer applied the window's mean, with the window reset."""
        trainable, optimizer_vars, window = operands
        mean_grads, window = accumulation.finish_window(
            window, self.lam, self.max_steps
        )
        trainable, optimizer_vars = self.optimizer.stateless_apply(
            optimizer_vars, mean_grads, trainable
        )
        return list(trainable), list(optimizer_vars), window

    def test_step(self, state, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        x, _ = filters.split_sample_ids(x)
        return super().test_step(
            state, keras.utils.pack_x_y_sample_weight(x, y, sample_weight)
        )
