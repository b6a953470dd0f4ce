"""`AccumulatingOptimizer`: adaptive gradient accumulation as an optimizer
wrapper, after Keras's `LossScaleOptimizer`."""

import keras
from keras import ops

from keras_as_softmax.training import _layout
from keras_as_softmax.training import accumulation

# The base optimizer's arguments that act on an update: the inner
# optimizer's to set.
_INNER_ONLY = (
    "learning_rate",
    "weight_decay",
    "clipnorm",
    "clipvalue",
    "global_clipnorm",
    "use_ema",
    "ema_momentum",
    "ema_overwrite_frequency",
    "loss_scale_factor",
    "gradient_accumulation_steps",
)


@keras.saving.register_keras_serializable(package="keras_as_softmax")
class AccumulatingOptimizer(keras.optimizers.Optimizer):
    """Adds micro-batch gradients to a window and applies their mean with
    an inner optimizer once the window is full; the window's length follows
    a rule of the counts it saw (AS-Speed's accumulation).

    Each call of `apply` (or `stateless_apply` on JAX) adds one
    micro-batch: its gradients to the window's sums, and its counted and
    masked rows to the window's counts. When the window holds `steps`
    micro-batches and a gradient (a micro-batch on which a sample filter
    ran no training pass brings none), the inner optimizer applies their
    *mean*, so an update has the scale of one batch however many
    micro-batches it spans, and the next window's length is
    `steps_rule(steps, rows, masked_rows)`.
    The decision is a compiled conditional (`keras.ops.cond`): no value is
    read back to the host, and a micro-batch that ends no window runs no
    optimizer arithmetic.

    Learning-rate schedules and Adam's bias correction count updates:
    `iterations` is the inner optimizer's.

    A trainer whose micro-batch gradients leave out the weights'
    regularization penalties (`kernel_regularizer`, ..., as `ASSpeed`'s
    sample filters do: their training passes run on a share of the
    micro-batches) sets `regularize_weights`, and each update adds the
    penalties' gradient once, as a plain accumulated update holds it.

    Args:
        inner_optimizer: the `keras.optimizers.Optimizer` that applies the
            mean gradient.
        steps_rule: the window's length: an int >= 1 (fixed), or a callable
            `(steps, rows, masked_rows) -> next_steps` of `keras.ops`
            scalars, evaluated at the end of each window, whose result is
            an integer scalar (below 1 counts as 1), such as
            `keras_as_softmax.training.accumulation.AdaptiveSteps`, the
            paper's rule. Defaults to `1`.
        regularize_weights: whether each update adds the gradient of the
            variables' regularization penalties (`variable.regularizer`)
            to the window's mean. Defaults to `False`: the micro-batch
            gradients hold them, as in Keras's own train step. `ASSpeed`
            sets it when it runs a sample filter.
        name: the optimizer's name.

    Example:

    ```python
    optimizer = keras_as_softmax.AccumulatingOptimizer(
        keras.optimizers.AdamW(2e-5),
        steps_rule=keras_as_softmax.AdaptiveSteps(lam=0.5, max_steps=4),
    )
    ```
    `ASSpeed.compile` wraps the optimizer this way by itself.
    """

    def __init__(
        self,
        inner_optimizer,
        steps_rule=1,
        regularize_weights=False,
        name=None,
        **kwargs,
    ):
        given = sorted(
            k for k in _INNER_ONLY if kwargs.get(k) not in (None, False)
        )
        if given:
            raise ValueError(
                "The inner optimizer applies the updates: set "
                f"{', '.join(given)} on it (`inner_optimizer`), where "
                "they act on each window's mean gradient. Received: "
                + ", ".join(f"{k}={kwargs[k]!r}" for k in given)
            )
        super().__init__(learning_rate=0.0, name=name, **kwargs)
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise ValueError(
                "Expected `inner_optimizer` to be a keras.optimizers."
                f"Optimizer. Received: inner_optimizer={inner_optimizer!r}"
            )
        inner_steps = getattr(inner_optimizer, "gradient_accumulation_steps", 0)
        if inner_steps and inner_steps > 1:
            raise ValueError(
                "The window accumulates the gradients: its inner optimizer "
                "would accumulate again. Expected an inner optimizer without "
                "`gradient_accumulation_steps` (use `steps_rule`). Received: "
                f"gradient_accumulation_steps={inner_steps}"
            )
        self.inner_optimizer = inner_optimizer
        self.steps_rule = accumulation.as_rule(steps_rule)
        self.regularize_weights = bool(regularize_weights)

    def build(self, var_list):
        if self.built:
            return
        # The window's sums of every weight's gradients, end to end in one
        # buffer per dtype: a compiled step passes each of its variables
        # as a buffer of its own, at a cost per buffer that a step feels
        # when the model has hundreds of weights or a fast accelerator.
        self._layout = _layout.Layout([(v.shape, v.dtype) for v in var_list])
        self.grad_sums = [
            self.add_variable(
                shape,
                initializer="zeros",
                dtype=dtype,
                name="accumulated_gradients",
            )
            for shape, dtype in self._layout.buffer_shapes()
        ]
        # `[micro-batches, rows, masked rows, steps, has_grads]` in one
        # variable, for the same reason.
        steps = getattr(self.steps_rule, "initial_steps", 1)
        self.window_counts = self.add_variable(
            (5,),
            initializer=keras.initializers.Constant(
                [0.0, 0.0, 0.0, steps, 0.0]
            ),
            dtype="float32",
            name="window_counts",
        )
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    @property
    def variables(self):
        # The base class's own `iteration` and `learning_rate` stay out:
        # the inner optimizer's count the updates.
        if not self.built:  # a model saved before its first step
            return list(self.inner_optimizer.variables)
        return [
            *self.grad_sums,
            self.window_counts,
            *(self.inner_optimizer.variables),
        ]

    @property
    def accumulation_steps(self):
        """int32 scalar tensor: micro-batches per update in this window."""
        return ops.cast(self.window_counts[3], "int32")

    def set_accumulation_steps(self, steps):
        """Sets the micro-batches per update of the running window."""
        counts = ops.convert_to_numpy(self.window_counts).copy()
        counts[3] = steps
        self.window_counts.assign(counts)

    def _values(self, sums, counts):
        return accumulation.AccumulationState(
            list(sums),
            ops.cast(counts[0], "int32"),
            counts[1],
            counts[2],
            ops.cast(counts[3], "int32"),
            ops.greater(counts[4], 0.5),
        )

    @staticmethod
    def _counts(state):
        return ops.stack(
            [
                ops.cast(state.micro_batches, "float32"),
                ops.cast(state.rows, "float32"),
                ops.cast(state.masked_rows, "float32"),
                ops.cast(state.steps, "float32"),
                ops.cast(state.has_grads, "float32"),
            ]
        )

    def _pack(self, grads):
        """Gradients, one per weight (`None` for none), as the sums' packed
        buffers; `None` for `None`."""
        if grads is None:
            return None
        self._check_count(grads)
        grads = [
            ops.zeros(shape, self._layout.dtypes[index]) if g is None else g
            for g, (index, _, _, shape) in zip(grads, self._layout.slots)
        ]
        return self._layout.pack(grads)

    def _check_count(self, grads):
        if grads is not None and len(grads) != len(self._layout.slots):
            raise ValueError(
                f"Expected gradients for the {len(self._layout.slots)} "
                "trainable variables the optimizer was built with. Received: "
                f"{len(grads)} gradients. If a layer's `trainable` changed "
                "after `compile`, compile the model again."
            )

    def _window(self):
        """The window's values, as an `AccumulationState` (sums packed)."""
        return self._values(
            [v.value for v in self.grad_sums], self.window_counts.value
        )

    def _assign_window(self, state, sums=True):
        if sums:
            for variable, value in zip(self.grad_sums, state.grad_sum):
                variable.assign(value)
        self.window_counts.assign(self._counts(state))

    # ------------------------------------------------------------ stateless

    def stateless_window(self, optimizer_variables):
        """The window's values among `optimizer_variables` (in the order
        of `variables`): its gradient sums, then its counts."""
        return list(optimizer_variables[: len(self.grad_sums) + 1])

    def stateless_accumulate(self, window, grads):
        """`accumulate` as a pure function of the window's values: for a
        trainer that adds a pass's gradients where the pass runs (inside a
        conditional, carrying only the window), then calls
        `stateless_apply` with `grads=None`."""
        n = len(self.grad_sums)
        state = accumulation.add_gradients(
            self._values(window[:n], window[n]), self._pack(grads)
        )
        return [*state.grad_sum, self._counts(state)]

    def stateless_with_window(self, optimizer_variables, window):
        """`optimizer_variables` with the window's values replaced."""
        return [*window, *optimizer_variables[len(window) :]]

    def stateless_apply(
        self,
        optimizer_variables,
        grads,
        trainable_variables,
        rows=0.0,
        masked_rows=0.0,
        from_pass=True,
    ):
        """`apply` as a pure function of values (JAX): returns the new
        `(trainable_variables, optimizer_variables)`."""
        if not self.built:
            raise ValueError(
                f"To call `stateless_apply`, {type(self).__name__} must be "
                "built: call `optimizer.build(trainable_variables)`."
            )
        n = len(self.grad_sums)
        # Values: `LossScaleOptimizer` passes its inner optimizer's
        # variables themselves, which no conditional may return.
        values = [
            v.value if isinstance(v, keras.Variable) else v
            for v in optimizer_variables
        ]
        inner = values[n + 1 :]
        window = self._values(values[:n], values[n])
        window = accumulation.add(
            window, self._pack(grads), rows, masked_rows, from_pass
        )
        due = accumulation.is_due(window)

        # The update runs in the conditional (with the state donated, its
        # untaken branch aliases what it carries). The sums only enter it
        # to be read: a conditional that returned them would copy them.
        def apply_mean():
            mean = self._layout.unpack(accumulation.window_mean(window))
            mapping = list(zip(self.inner_optimizer.variables, inner))
            with keras.StatelessScope(state_mapping=mapping):
                mean = self._regularized(
                    mean, self._trainable_variables, trainable_variables
                )
            new_trainable, new_inner = self.inner_optimizer.stateless_apply(
                inner, mean, trainable_variables
            )
            return list(new_trainable), list(new_inner)

        def carry():
            return list(trainable_variables), inner

        trainable, inner = ops.cond(due, apply_mean, carry)
        window = accumulation.end_window_where(due, window, self.steps_rule)
        return trainable, [*window.grad_sum, self._counts(window), *inner]

    def _regularized(self, mean, variables, values, divisor=1):
        """`mean` (one gradient per variable) plus the gradient of the
        loss-scaled sum of `variables`' regularization penalties at
        `values`, over `divisor` (the replicas whose gradients an optimizer
        sums); `mean` itself without `regularize_weights` or penalties."""
        if not self.regularize_weights:
            return mean
        regularized = [
            i
            for i, v in enumerate(variables)
            if getattr(v, "regularizer", None) is not None
        ]
        if not regularized:
            return mean

        def scaled_penalty(weights):
            total = sum(
                ops.cast(variables[i].regularizer(w), "float32")
                for i, w in zip(regularized, weights)
            )
            return self.inner_optimizer.scale_loss(total)

        grads = _gradients(scaled_penalty, [values[i] for i in regularized])
        mean = list(mean)
        for i, grad in zip(regularized, grads):
            mean[i] = mean[i] + ops.cast(grad, mean[i].dtype) / divisor
        return mean

    # ------------------------------------------------------------- stateful

    def accumulate(self, grads):
        """Adds `grads` to the window's sums in place, without counting a
        micro-batch (a trainer that adds a pass's gradients where the pass
        runs, then calls `apply(None, ...)`)."""
        if keras.backend.backend() == "torch":
            self._check_count(grads)
            _torch_accumulate(self, grads)
            return
        self._assign_window(
            accumulation.add_gradients(self._window(), self._pack(grads))
        )

    def apply(
        self,
        grads,
        trainable_variables=None,
        rows=0.0,
        masked_rows=0.0,
        from_pass=True,
    ):
        """Adds one micro-batch and applies the window's mean when due.

        Args:
            grads: the micro-batch's gradients, or `None` when they were
                added with `accumulate` already.
            trainable_variables: the variables, as for any optimizer.
            rows: counted rows of the micro-batch (`N_all`), a scalar.
            masked_rows: masked rows among them (`N_masked`), a scalar.
            from_pass: a bool scalar, false where `grads` are zeros that
                stand for no training pass (as TensorFlow's replicas
                all-reduce gradients whether or not a pass ran): they bring
                no gradient to the window.
        """
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
        backend = keras.backend.backend()
        if backend == "tensorflow":
            _tf_apply(
                self, grads, trainable_variables, rows, masked_rows, from_pass
            )
        elif backend == "jax":
            # Branches of `jax.lax.cond` cannot assign: run the pure form.
            variables = trainable_variables or self._trainable_variables
            new_variables, new_state = self.stateless_apply(
                [v.value for v in self.variables],
                grads,
                [v.value for v in variables],
                rows=rows,
                masked_rows=masked_rows,
                from_pass=from_pass,
            )
            for variable, value in zip(variables, new_variables):
                variable.assign(value)
            for variable, value in zip(self.variables, new_state):
                variable.assign(value)
        elif backend == "torch":
            if not from_pass:  # zeros that stand for no training pass
                grads = None
            _torch_apply(self, grads, trainable_variables, rows, masked_rows)
        else:
            self._common_apply(
                grads, trainable_variables, rows, masked_rows, from_pass
            )

    def _add(self, packed, rows, masked_rows, from_pass=True):
        window = accumulation.add(
            self._window(), packed, rows, masked_rows, from_pass
        )
        self._assign_window(window, sums=packed is not None)

    def _finish(self, trainable_variables, divisor=1):
        mean, fresh = accumulation.finish_window(
            self._window(), self.steps_rule, divisor
        )
        variables = trainable_variables or self._trainable_variables
        mean = self._regularized(
            self._layout.unpack(mean), variables, variables, divisor
        )
        self.inner_optimizer.apply(mean, trainable_variables)
        # The sums stay as they are, marked stale.
        self._assign_window(fresh, sums=False)

    def _common_apply(
        self, grads, trainable_variables, rows, masked_rows, from_pass=True
    ):
        self._add(self._pack(grads), rows, masked_rows, from_pass)
        ops.cond(
            accumulation.is_due(self._window()),
            lambda: self._finish(trainable_variables),
            lambda: None,
        )

    # ------------------------------------------------------- as the inner

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    @property
    def optimizers(self):
        # A `MultiOptimizer`'s, for Keras's learning-rate callbacks, which
        # set each one's rate (an AttributeError for any other).
        return self.inner_optimizer.optimizers

    def exclude_from_weight_decay(self, var_list=None, var_names=None):
        """The inner optimizer's (under mixed precision, the one inside
        its `LossScaleOptimizer`): the optimizer that decays the weights."""
        optimizer = self.inner_optimizer
        while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            optimizer = optimizer.inner_optimizer
        optimizer.exclude_from_weight_decay(var_list, var_names)

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def get_config(self):
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(
                self.inner_optimizer
            ),
            "steps_rule": keras.saving.serialize_keras_object(self.steps_rule),
            "regularize_weights": self.regularize_weights,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        rule = keras.saving.deserialize_keras_object(
            config.pop("steps_rule"), custom_objects=custom_objects
        )
        return cls(inner, rule, **config)


def _gradients(fn, weights):
    """The gradients of the scalar `fn(weights)` with respect to `weights`
    (variables, or values on JAX)."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.grad(fn)(list(weights))
    if backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            values = [
                tf.convert_to_tensor(getattr(w, "value", w)) for w in weights
            ]
            tape.watch(values)
            total = fn(values)
        return tape.gradient(total, values)
    if backend == "torch":
        import torch

        with torch.enable_grad():
            values = [w.value.detach().requires_grad_() for w in weights]
            return torch.autograd.grad(fn(values), values)
    raise ValueError(
        "Expected the TensorFlow, JAX or PyTorch backend for weight "
        f"penalties. Received: backend={backend}"
    )


def _tf_apply(
    optimizer, grads, trainable_variables, rows, masked_rows, from_pass
):
    """TensorFlow: under several replicas, every replica adds the
    all-reduced gradients (the window's variables keep the first
    replica's copy), and the window ends in cross-replica context, as
    `LossScaleOptimizer` builds its conditional."""
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    if context is None or replicas == 1:
        # One device: a filtered step adds its gradients inside the
        # training pass's branch and passes none here.
        optimizer._common_apply(
            grads, trainable_variables, rows, masked_rows, from_pass
        )
        return
    if grads is not None:
        grads = context.all_reduce("sum", optimizer._pack(grads))
    optimizer._add(grads, rows, masked_rows, from_pass)

    def cross_replica(distribution, due):
        done = distribution.experimental_local_results(due)[0]
        # The inner optimizer sums the replicas' gradients again.
        ops.cond(
            done,
            lambda: distribution.extended.call_for_each_replica(
                optimizer._finish, args=(trainable_variables, replicas)
            ),
            lambda: None,
        )

    due = accumulation.is_due(optimizer._window())
    context.merge_call(cross_replica, args=(due,))


def _torch_sums(optimizer):
    """Views of the sums' buffers, one per weight."""
    return optimizer._layout.unpack([v.value for v in optimizer.grad_sums])


def _torch_accumulate(optimizer, grads, has_grads=None):
    import torch

    counts = optimizer.window_counts.value
    if has_grads is None:
        has_grads = bool(counts[4])
    with torch.no_grad():
        sums = _torch_sums(optimizer)
        grads = _torch_grads(grads, sums)
        if has_grads:
            torch._foreach_add_(sums, grads)
        else:
            torch._foreach_copy_(sums, grads)
            counts[4] = 1.0


def _torch_apply(optimizer, grads, trainable_variables, rows, masked_rows):
    """PyTorch runs eagerly: the window's end is a Python `if` on the
    counts, read on the host once a step (as the torch trainer decides
    its passes; `keras.ops.cond` would build an operation on every
    call), and the sums and counts are updated in place. A window's
    last gradients go into its mean without a copy into the sums, so a
    window of one micro-batch applies them as a plain step does."""
    import torch

    optimizer._check_count(grads)
    counts = optimizer.window_counts.value
    with torch.no_grad():
        counts[0] += 1.0
        counts[1] += rows
        counts[2] += masked_rows
    micro_batches, _, _, steps, has_grads = counts.tolist()
    if grads is not None and (micro_batches < steps or has_grads):
        _torch_accumulate(optimizer, grads, has_grads)
        grads, has_grads = None, True
    # As `accumulation.is_due`: `steps` micro-batches and a gradient.
    if micro_batches < steps or (grads is None and not has_grads):
        return
    with torch.no_grad():
        sums = _torch_sums(optimizer)
        grads = sums if grads is None else _torch_grads(grads, sums)
        if micro_batches != 1:
            grads = torch._foreach_div(grads, micro_batches)
    variables = trainable_variables or optimizer._trainable_variables
    grads = optimizer._regularized(grads, variables, variables)
    optimizer.inner_optimizer.apply(grads, trainable_variables)
    # The sums stay as they are, marked stale.
    window = accumulation.end_window_where(
        True, optimizer._window(), optimizer.steps_rule
    )
    optimizer._assign_window(window, sums=False)


def _torch_grads(grads, sums):
    """`grads` as tensors like the sums, zeros where a variable got none."""
    import torch

    return [
        torch.zeros_like(s)
        if g is None
        else torch.as_tensor(g, dtype=s.dtype, device=s.device)
        for s, g in zip(sums, grads)
    ]


def scaling_inside_window(optimizer):
    """The optimizer `compile` made, with loss scaling inside the window.

    Under `mixed_float16`, Keras's `compile` wraps an `AccumulatingOptimizer`
    passed in with a `LossScaleOptimizer`: the scaling moves inside the
    window, where `ASSpeed` puts it for an optimizer it wraps itself, so
    that there is one window. Any other optimizer is returned as it is.
    """
    if not isinstance(
        optimizer, keras.optimizers.LossScaleOptimizer
    ) or not isinstance(optimizer.inner_optimizer, AccumulatingOptimizer):
        return optimizer
    window = optimizer.inner_optimizer
    if not isinstance(
        window.inner_optimizer, keras.optimizers.LossScaleOptimizer
    ):
        window.inner_optimizer = keras.optimizers.LossScaleOptimizer(
            window.inner_optimizer,
            initial_scale=optimizer.initial_scale,
            dynamic_growth_steps=optimizer.dynamic_growth_steps,
        )
        if window.built:
            window.inner_optimizer.build(window._trainable_variables)
    return window
