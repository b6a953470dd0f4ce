"""`ASSpeed`: the model wrapper, its checks, and its state."""

import contextlib
import json
import warnings

import keras
import numpy as np
from keras import ops

from keras_as_softmax import filters as filters_lib
from keras_as_softmax._validation import check_int
from keras_as_softmax._validation import check_positive
from keras_as_softmax.callbacks import check_deltas
from keras_as_softmax.filters.base import as_list
from keras_as_softmax.filters.sample_ids import text_as_arrays
from keras_as_softmax.losses import ASSoftmaxLoss
from keras_as_softmax.losses import MultiLabelASSoftmaxLoss
from keras_as_softmax.losses._common import ignore_class_of
from keras_as_softmax.losses._common import valid_rows
from keras_as_softmax.metrics import MaskedRatio
from keras_as_softmax.metrics import count_masked_rows
from keras_as_softmax.training import _data
from keras_as_softmax.training import _filtering
from keras_as_softmax.training import _layout
from keras_as_softmax.training import _queue
from keras_as_softmax.training._filtering import FilterState
from keras_as_softmax.training.accumulation import AdaptiveSteps
from keras_as_softmax.training.optimizer import AccumulatingOptimizer

_BACKEND = keras.backend.backend()
# The filter queues' layout, kept beside the weights (`save_own_variables`).
_FILTER_SPEC_KEY = "filter_spec"
if _BACKEND == "tensorflow":
    from keras_as_softmax.training._tensorflow import ASSpeedTrainer
    from keras_as_softmax.training._tensorflow import is_multi_worker
    from keras_as_softmax.training._tensorflow import stateless_uniform
elif _BACKEND == "jax":
    import jax

    from keras_as_softmax.training._jax import ASSpeedTrainer
    from keras_as_softmax.training._jax import stateless_uniform
elif _BACKEND == "torch":
    from keras_as_softmax.training import _torch
    from keras_as_softmax.training._torch import ASSpeedTrainer
    from keras_as_softmax.training._torch import check_not_distributed
    from keras_as_softmax.training._torch import stateless_uniform
else:

    class ASSpeedTrainer:
        def __init__(self, *args, **kwargs):
            raise ValueError(
                "ASSpeed supports the tensorflow, jax and torch backends. "
                f"Received: the {_BACKEND!r} backend. Use "
                "keras_as_softmax.ASSoftmaxLoss alone on this backend, or "
                "set KERAS_BACKEND=tensorflow."
            )


_FILTER_REDUCTIONS = ("sum_over_batch_size", "sum")
_MASKING_LOSSES = (ASSoftmaxLoss, MultiLabelASSoftmaxLoss)
# Why a filter refuses batches of other shapes than its first.
_ONE_SHAPE = (
    "ASSpeed's sample filters queue rows of one shape, the first batch's: "
    "pad every batch to the same length (for tf.data, `padded_batch` with "
    "fixed `padded_shapes`; ragged inputs to dense ones), or train without "
    "a filter."
)
# The steps `ASSpeed` runs in place of the wrapped model's.
_KERAS_STEP = ("train_step", "test_step", "compute_loss", "compute_metrics")


@keras.saving.register_keras_serializable(package="keras_as_softmax")
class ASSpeed(ASSpeedTrainer, keras.Model):
    """Wraps a model so that `fit` accumulates more micro-batches per update
    as AS-Softmax masks more samples (AS-Speed, paper section 3.3), and,
    with a sample filter, leaves masked samples out of the training passes.

    Each batch that `fit` draws is a micro-batch: its gradient goes to the
    optimizer with its counted rows (`N_all`: samples, or tokens that are
    not `ignore_class`, with nonzero sample weight) and masked rows
    (`N_masked`: loss exactly 0). `compile()` wraps the optimizer in a
    `keras_as_softmax.AccumulatingOptimizer` that adds them to a window;
    when the window holds `accumulation_steps` micro-batches, the inner
    optimizer applies their *mean* gradient (an update has the scale of
    one plain batch) and the number of steps is re-estimated with
    `keras_as_softmax.AdaptiveSteps(lam, max_steps)` (eq. 19: never
    decreasing, growing by at most one, capped at `max_steps`). Between
    window ends the optimizer does not run (a compiled conditional).
    Learning-rate schedules and Adam's bias correction count updates
    (`optimizer.iterations`), not micro-batches. Every step is one
    compiled program that reads nothing back to the host.

    AS-Speed alone saves optimizer updates only. A `sample_filter`
    (`keras_as_softmax.filters`) saves forward and backward passes: the
    samples it keeps are queued, and a training pass runs on every full
    batch of them, so every pass has the static shape of a drawn batch and
    is full of samples that still have a gradient. Each queued row keeps
    the coefficient its drawn batch's loss gave it, so the window's mean is
    taken over the samples an unfiltered step would have counted and the
    effective learning rate does not rise as more samples are masked.

    Layers with training-time state such as `BatchNormalization` update it
    in the training passes only: without a filter, on every micro-batch;
    with one, on the batches of kept samples (their statistics are those
    of the harder samples). A scoring pass puts moving statistics back.

    `fit`'s logs show `masked_ratio` (masked / counted rows since the epoch
    began), `accum_steps` (micro-batches per update) and, with a filter,
    `trained_fraction` (the share of drawn batches that a training pass
    stood for) and, with a scoring filter, `scored_fraction` (the share
    that a scoring pass stood for). The training loss and metrics cover
    the drawn batches where a scoring filter scored them (from the scoring
    pass, regularization penalties included); else the samples a
    training pass ran on, which a memory filter alone or first chooses:
    the harder ones, revisits weighted `1 / revisit`. Watch validation
    metrics, not those, to judge overfitting or to stop early.

    With a filter, the weights' regularization penalties
    (`kernel_regularizer`, ...) act once per update, as without one. Those
    that depend on a pass's inputs (`activity_regularizer`, `add_loss`)
    act on the batches a training pass ran on, a `trained_fraction` of
    those drawn, and `fit` warns of the ones it sees.

    Rows that count are told by their labels (`ignore_class`), not by
    Keras masks: a model whose output carries one (`Embedding(...,
    mask_zero=True)`) is refused without `ignore_class`, by `compile`
    (functional models) or as `fit` traces its first step (subclassed
    ones, whose masks show only there). On TensorFlow an
    embedding's sparse gradient is summed dense, so Adam's moments decay
    on every row, as Keras's do on JAX and PyTorch (Keras's own TensorFlow
    step updates only the rows in the batch).

    Supported: one output, or several with `masked_outputs`; TensorFlow
    (eager, graph, `jit_compile=True`, `tf.distribute.MirroredStrategy`,
    and `MultiWorkerMirroredStrategy` without a filter), JAX (one
    device, or `keras.distribution.DataParallel`) and PyTorch (one
    device, eager or `jit_compile=True`: `torch.compile`). Filters on several
    devices take the same samples as on one, and need a batch size
    divisible by the number of devices.
    Everything that cannot work is refused by `compile()` or by `fit()`
    before the first batch.

    Args:
        model: the `keras.Model` to train (functional, sequential,
            subclassed, or a keras-hub task whose preprocessor runs in
            `fit`, `evaluate` and `predict`; `fit` shuffles its arrays of
            raw strings as `shuffle` says, where keras-hub's `fit` keeps
            their order).
        lam: the paper's lambda (> 0): the steps follow
            `lam * N_all / (N_all - N_masked)`. Defaults to `0.5`.
        max_steps: the cap `s` on accumulated micro-batches (int >= 1).
            Defaults to `4`.
        sample_filter: `None`, a filter of `keras_as_softmax.filters`
            (`SkipMasked`, `SelectiveBackprop`, `SkipMaskedLastSeen`,
            `InfoBatch`), or a filter that decides without a pass followed
            by one that scores, as `[SkipMaskedLastSeen(n), SkipMasked()]`.
            Defaults to `None`.
        masked_outputs: for a model with several outputs (a joint intent
            and slot model, say), the name or list of names of the outputs
            whose AS loss counts masked rows for the accumulation rule;
            the other outputs train as usual. `None` (the default) needs a
            model with one output and one loss. Filters need one output:
            a sample can be skipped only when its whole loss is 0.
        **kwargs: passed to `keras.Model` (e.g. `name`).

    Example:

    ```python
    model = keras_as_softmax.ASSpeed(
        base_model,
        lam=0.5,
        max_steps=4,
        sample_filter=keras_as_softmax.filters.SkipMasked(),
    )
    model.compile(optimizer="adamw",
                  loss=keras_as_softmax.ASSoftmaxLoss(0.3),
                  metrics=["accuracy"], jit_compile=True)
    model.fit(train_ds, validation_data=val_ds, epochs=8)
    ```

    Reference:
        Lv et al., "Adaptive Sparse Softmax: An Effective and Efficient
        Softmax Variant" (section 3.3, eq. 19); Jiang et al.,
        "Accelerating Deep Learning by Focusing on the Biggest Losers"
        (Selective-Backprop, 2019); Qin et al., "InfoBatch", ICLR 2024.
    """

    def __init__(
        self,
        model,
        lam=0.5,
        max_steps=4,
        sample_filter=None,
        masked_outputs=None,
        **kwargs,
    ):
        filter_spec = kwargs.pop("filter_spec", None)
        if not isinstance(model, keras.Model):
            raise ValueError(
                "Expected `model` to be a keras.Model (functional, "
                "sequential, subclassed or a keras-hub task). "
                f"Received: model={model!r}"
            )
        if isinstance(model, ASSpeed):
            raise ValueError(
                "Expected an unwrapped model. Received: an ASSpeed model."
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
        super().__init__(**kwargs)
        self.inner_model = model
        self.lam = check_positive(lam, "lam")
        self.max_steps = check_int(max_steps, "max_steps", 1)
        self.sample_filters = as_list(sample_filter)
        self.masked_outputs = _as_output_names(masked_outputs)
        self.shares_tracker = _StepShares(
            filters=bool(self.sample_filters),
            scoring=self._scoring_filter is not None,
        )
        self._filter_spec = None
        self._start_steps = None
        # A subclassed model built by `build(input_shape)` without a
        # `build` method of its own creates its weights on its first call.
        if model.built and model.variables:
            self._create_state()
            self.built = True
        if filter_spec is not None:
            self._create_filter_state(_current_spec(filter_spec))

    # ------------------------------------------------------------- structure

    @property
    def _scoring_filter(self):
        """The filter that runs a scoring pass, or `None`."""
        return next((f for f in self.sample_filters if f.scores), None)

    @property
    def _memory_filter(self):
        """The filter that decides from its memory, or `None`."""
        return next((f for f in self.sample_filters if not f.scores), None)

    def build(self, input_shape=None):
        if not self.inner_model.trainable_variables and input_shape is not None:
            # A subclassed model creates its weights on its first call.
            self.inner_model(
                keras.tree.map_shape_structure(keras.KerasTensor, input_shape)
            )
        self._create_state()
        self.built = True

    def _lock_state(self):
        # Like Keras's functional models, stays open to new state after
        # `build()`: the filters' queues are created by the first `fit()`,
        # once it knows the batch's shape.
        pass

    def _state(self, name, dtype, shape=(), initializer="zeros"):
        # Under tf.distribute every replica writes the same all-reduced
        # values, so the first replica's write is the one kept.
        return self.add_weight(
            shape=shape,
            dtype=dtype,
            initializer=initializer,
            trainable=False,
            aggregation="only_first_replica",
            name=name,
        )

    def _create_state(self):
        if getattr(self, "_state_created", False):
            return
        variables = self.inner_model.trainable_variables
        if not variables:
            raise ValueError(
                "ASSpeed needs a model with trainable weights. Received a "
                f"model with none: {self.inner_model.name!r}"
            )
        if self.sample_filters:
            # `[epoch, epochs]` of `fit`, written at each epoch's start by
            # `_EpochSchedule`: a weight, so no step is traced per `fit`.
            self._schedule = self._state(
                "epoch_schedule",
                "int32",
                (2,),
                keras.initializers.Constant([0, 1]),
            )
        # Each filter's state, as its `state_spec` says.
        self._filter_states = [
            {
                name: self._state(
                    name, dtype, shape, keras.initializers.Constant(initial)
                )
                for name, (shape, dtype, initial) in f.state_spec().items()
            }
            for f in self.sample_filters
        ]
        if any(f.needs_draws for f in self.sample_filters):
            # A filter's seed, or one from NumPy's global generator, which
            # `keras.utils.set_random_seed` seeds.
            seeds = [
                np.random.randint(2**31 - 1) if f.seed is None else f.seed
                for f in self.sample_filters
            ]
            self._filter_seeds = self._state(
                "filter_seeds",
                "int32",
                (len(seeds),),
                keras.initializers.Constant(seeds),
            )
            # Batches drawn in all of training: the key of the draws.
            self._drawn = self._state("drawn_batches", "int32")
        self._state_created = True

    def _create_filter_state(self, spec):
        """Creates the queues from `spec`: the batch size, then
        `(shape, dtype)` of every queued leaf and the model's output."""
        if self._filter_spec is not None:
            return
        if not self.built:
            self.build()
        size = spec["batch_size"]
        self._filter_batch_size = size
        self._row_tail = tuple(spec["row_tail"])
        self._output_tail = tuple(spec["output_tail"])
        self._output_dtype = spec["output_dtype"]
        layout = _layout.Layout(
            [(tuple(s), d) for s, d in spec["leaves"]], rows=True
        )
        self._queue_layout = layout

        def queue(prefix):
            return _queue.RowQueue(
                [
                    self._state(f"{prefix}_{i}", dtype, shape)
                    for i, (shape, dtype) in enumerate(
                        layout.buffer_shapes(2 * size)
                    )
                ],
                self._state(f"{prefix}_count", "int32"),
            )

        two = self._memory_filter is not None and self._scoring_filter
        # Under a `tf.distribute` strategy, a copy of each queue on every
        # replica, as the other weights: a step reads and writes its rows.
        with self._strategy_scope():
            self._score_queue = queue("score_queue") if two else None
            self._train_queue = queue("train_queue")
        self._filter_spec = spec

    def _filter_state(self):
        """The filter state as values (`FilterState`)."""

        def queue(q):
            if q is None:
                return None
            return _queue.RowQueue([b.value for b in q.buffers], q.count.value)

        return FilterState(
            score_queue=queue(self._score_queue),
            train_queue=queue(self._train_queue),
            states=[
                {name: v.value for name, v in variables.items()}
                for variables in self._filter_states
            ],
        )

    def _assign_filter_state(self, state):
        pairs = []
        for variables, values in (
            (self._score_queue, state.score_queue),
            (self._train_queue, state.train_queue),
        ):
            if variables is not None:
                pairs += zip(variables.buffers, values.buffers)
                pairs.append((variables.count, values.count))
        for variables, values in zip(self._filter_states, state.states):
            pairs += [(v, values[name]) for name, v in variables.items()]
        for variable, value in pairs:
            # Rows written in place (`_rows.write_rows`) are left as they are.
            if value is not variable.value:
                variable.assign(value)

    def _filter_variables(self):
        """The variables a filtered step assigns besides the model's."""
        found = [v for states in self._filter_states for v in states.values()]
        if hasattr(self, "_drawn"):
            found.append(self._drawn)
        return found + self._queue_variables()

    def _queue_variables(self):
        """The queues' variables, which the first `fit` creates."""
        if self._filter_spec is None:
            return []
        queues = [q for q in (self._score_queue, self._train_queue) if q]
        return [v for q in queues for v in (*q.buffers, q.count)]

    def _filtered_step(
        self, x, y, sample_weight, hooks, gather=None, queue_ops=_queue
    ):
        """Runs the filters on a drawn batch and keeps their new state.

        `gather`, under several replicas, all-gathers a replica's rows into
        the global batch, which the filters then see on every replica.
        `queue_ops`: how the queues are kept (`_filtering.filtered_step`).

        Returns:
            `(inputs, output)`: the inputs without sample ids, and the
            `_filtering.StepOutput`.
        """
        inputs, ids = filters_lib.split_sample_ids(x)
        if gather is not None:
            inputs, y, sample_weight, ids = (
                None if t is None else keras.tree.map_structure(gather, t)
                for t in (inputs, y, sample_weight, ids)
            )
        inputs, y = self._checked_row_shapes(inputs, y)

        def draws(index, size):
            # From the filter's seed and the batch's index in training, not
            # a generator's state: the same on every replica and device
            # count, and after a resume.
            if not self.sample_filters[index].needs_draws:
                return None
            seed = self._filter_seeds.value[index]
            return stateless_uniform(size, seed, self._drawn.value)

        output, state = _filtering.filtered_step(
            self,
            self._filter_state(),
            inputs,
            y,
            sample_weight,
            ids,
            draws,
            hooks,
            queue_ops=queue_ops,
        )
        self._assign_filter_state(state)
        if hasattr(self, "_drawn"):
            self._drawn.assign_add(1)
        return inputs, output

    def _epoch_state(self):
        """`(epoch, epochs)` of the running `fit`, int32 tensors."""
        schedule = self._schedule.value
        return schedule[0], schedule[1]

    # How many `train_step`s run (or are traced; one a replica under
    # `MirroredStrategy`): `call` warns when it runs in training mode
    # outside them, where nothing accumulates or filters.
    _train_steps_running = 0
    _warned_training_outside = False

    def train_step(self, *args):
        # Plain writes: `Layer.__setattr__`'s tracking would cost about
        # 10 us each on every eager PyTorch step.
        self._count_train_step(1)
        try:
            return super().train_step(*args)
        finally:
            self._count_train_step(-1)

    def _count_train_step(self, change):
        running = self._train_steps_running + change
        object.__setattr__(self, "_train_steps_running", running)

    def call(self, inputs, training=None):
        if training and not (
            self._train_steps_running or self._warned_training_outside
        ):
            self._warned_training_outside = True
            warnings.warn(
                f"ASSpeed {self.name!r} was called with training=True "
                "outside its own `fit`. If that trains it (as a layer of "
                "another model, or in a custom training loop), it trains as "
                "its inner model, without accumulation or sample filters: "
                "fit the ASSpeed itself, with the outer model as its inner "
                "one.",
                stacklevel=2,
            )
        inputs, _ = filters_lib.split_sample_ids(inputs)
        return self.inner_model(inputs, training=training)

    def export(self, filepath, format="tf_saved_model", **kwargs):
        """Exports the inner model, which is what serves: `ASSpeed` adds
        training only. Arguments as `keras.Model.export`."""
        return self.inner_model.export(filepath, format=format, **kwargs)

    @property
    def output_names(self):
        """The inner model's, after which Keras names the losses and
        metrics of several outputs (an AttributeError without them)."""
        return self.inner_model.output_names

    def compile(self, optimizer="rmsprop", loss=None, **kwargs):
        """`keras.Model.compile`, with the optimizer wrapped in a
        `keras_as_softmax.AccumulatingOptimizer` that follows the paper's
        rule (`AdaptiveSteps(lam, max_steps)`); an `AccumulatingOptimizer`
        passed in is kept, its rule in place of `lam` and `max_steps` (under
        `mixed_float16` with the loss scaling inside it). With a sample
        filter, the optimizer adds the weights' penalties to each update
        (`regularize_weights`)."""
        super().compile(optimizer=optimizer, loss=loss, **kwargs)
        self._scale_inside_window()
        if self.optimizer is not None and not isinstance(
            self.optimizer, AccumulatingOptimizer
        ):
            with self._strategy_scope():
                self.optimizer = AccumulatingOptimizer(
                    self.optimizer,
                    AdaptiveSteps(self.lam, self.max_steps),
                    name="accumulating_optimizer",
                )
            if self._start_steps is not None:
                self._built_optimizer()
        if self.sample_filters and self.optimizer is not None:
            # The training passes leave the weights' penalties out.
            self.optimizer.regularize_weights = True

    def _scale_inside_window(self):
        """Under `mixed_float16`, Keras's `compile` wraps an
        `AccumulatingOptimizer` passed in with a `LossScaleOptimizer`: the
        scaling moves inside the window, where `ASSpeed` puts it for an
        optimizer it wraps itself, so there is one window."""
        scaling = self.optimizer
        if not isinstance(
            scaling, keras.optimizers.LossScaleOptimizer
        ) or not isinstance(scaling.inner_optimizer, AccumulatingOptimizer):
            return
        window = scaling.inner_optimizer
        if not isinstance(
            window.inner_optimizer, keras.optimizers.LossScaleOptimizer
        ):
            with self._strategy_scope():
                window.inner_optimizer = keras.optimizers.LossScaleOptimizer(
                    window.inner_optimizer,
                    initial_scale=scaling.initial_scale,
                    dynamic_growth_steps=scaling.dynamic_growth_steps,
                )
            if window.built:
                window.inner_optimizer.build(window._trainable_variables)
        self.optimizer = window

    def compile_from_config(self, config):
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.built:
            self._built_optimizer()

    def _strategy_scope(self):
        if _BACKEND == "tensorflow":
            return self.distribute_strategy.scope()
        return contextlib.nullcontext()

    @property
    def _score_training(self):
        """Whether the scoring pass runs in training mode."""
        return self._scoring_filter.score_training

    def _built_optimizer(self):
        """The compiled `AccumulatingOptimizer`, built (or `None` before
        `compile()` or before the model has weights)."""
        optimizer = getattr(self, "optimizer", None)
        if optimizer is None or not self.trainable_variables:
            return None
        if not optimizer.built:
            with self._strategy_scope():
                optimizer.build(self.trainable_variables)
            if self._start_steps is not None:
                optimizer.set_accumulation_steps(self._start_steps)
        return optimizer

    @property
    def accumulation_steps(self):
        """The current number of micro-batches per optimizer update (int)."""
        optimizer = self._built_optimizer()
        if optimizer is None:
            return self._start_steps or 1
        return int(ops.convert_to_numpy(optimizer.accumulation_steps))

    @accumulation_steps.setter
    def accumulation_steps(self, value):
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not 1 <= value <= self.max_steps
        ):
            raise ValueError(
                "Expected `accumulation_steps` to be an int in "
                f"[1, {self.max_steps}] (max_steps). Received: {value!r}"
            )
        self._start_steps = value
        optimizer = self._built_optimizer()
        if optimizer is not None:
            optimizer.set_accumulation_steps(value)

    @property
    def last_seen_masked_fraction(self):
        """Share of the training set masked when last seen (or `None`)."""
        memory_filter = self._memory_filter
        if memory_filter is None:
            return None
        index = self.sample_filters.index(memory_filter)
        state = {k: v.value for k, v in self._filter_states[index].items()}
        masked = memory_filter.masked_when_seen(state)
        return float(np.mean(ops.convert_to_numpy(masked)))

    @property
    def preprocessor(self):
        """The wrapped keras-hub task's preprocessor, or `None`."""
        return getattr(self.inner_model, "preprocessor", None)

    # ---------------------------------------------------------------- checks

    def _check_compiled(self):
        """What `fit()` checks before the first batch: the loss, the
        filters' needs, the devices. Raises one `ValueError` naming what was
        expected and what came."""
        if not getattr(self, "compiled", False):
            raise ValueError(
                "Call `compile()` on the ASSpeed model before `fit()` (it "
                "compiles its own loss and optimizer, not the wrapped "
                "model's)."
            )
        loss = self.loss
        names = self._output_names()
        check_deltas([loss])
        if self.masked_outputs:
            self._check_masked_outputs(loss, names)
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
            raise _one_loss_for_outputs(loss, names)
        self._check_no_metric_named_masked_ratio()
        # Functional and sequential models show their masks here; a
        # subclassed model's show in the step (`_check_step_outputs`).
        masked = _filtering.check_no_keras_mask(
            loss,
            getattr(self.inner_model, "outputs", None) or [],
            names,
        )
        # Keras leaves the positions a Keras mask hides out of the metrics
        # (not JAX's stateless ones), but the filtered step's predictions
        # lose the mask: its metrics leave out the positions the loss's
        # `ignore_class` labels instead (`_step_metrics`).
        self._metrics_skip_ignored = masked and _BACKEND != "jax"
        for f in self.sample_filters:
            if f.needs_masking_loss and not isinstance(loss, _MASKING_LOSSES):
                raise ValueError(
                    f"{type(f).__name__} skips the samples whose loss is "
                    "exactly 0, which only an AS loss gives "
                    "(keras_as_softmax.ASSoftmaxLoss or "
                    "MultiLabelASSoftmaxLoss). With another loss, "
                    "SelectiveBackprop or InfoBatch select samples. "
                    f"Received: loss={loss!r}"
                )
        if self.sample_filters and loss.reduction not in _FILTER_REDUCTIONS:
            raise ValueError(
                "A sample filter reweights per-row losses, which needs the "
                f"reduction to be one of {_FILTER_REDUCTIONS}. Received: "
                f"reduction={loss.reduction!r}"
            )
        if _BACKEND == "torch":
            check_not_distributed()
        if self.sample_filters and _BACKEND == "tensorflow":
            if is_multi_worker(self.distribute_strategy):
                raise ValueError(
                    "ASSpeed's sample filters run on one worker (one device, "
                    "or MirroredStrategy's replicas on one machine). "
                    "Expected sample_filter=None under "
                    "MultiWorkerMirroredStrategy. Received: "
                    f"sample_filter={self.sample_filters!r}"
                )

    def _check_no_metric_named_masked_ratio(self):
        """`masked_ratio` in the logs is the compiled loss's share: a
        compiled metric of that name would be hidden by it, unless it
        computes the same (`MaskedRatio` of the compiled loss)."""
        config = self._compile_config.config
        for metrics in (config.get("metrics"), config.get("weighted_metrics")):
            if not isinstance(metrics, (list, tuple)):
                continue  # a dict names them after their outputs
            for metric in metrics:
                if getattr(metric, "name", None) != "masked_ratio" or (
                    isinstance(metric, MaskedRatio) and metric.loss is self.loss
                ):
                    continue
                raise ValueError(
                    "ASSpeed logs `masked_ratio`, the share of rows the "
                    "compiled loss masks, which would hide a compiled metric "
                    "of the same name. Expected that metric under another "
                    "name, e.g. MaskedRatio(loss, name='masked_ratio_0.9'). "
                    f"Received: metrics with {metric!r} named 'masked_ratio'"
                )

    def _output_names(self):
        """The inner model's output names; a subclassed model has none
        before its step, and a dict of losses names its dict outputs."""
        names = list(getattr(self.inner_model, "output_names", None) or [])
        if not names and isinstance(self.loss, dict):
            names = list(self.loss)
        return names

    def _check_masked_outputs(self, loss, names):
        if self.sample_filters:
            raise ValueError(
                "ASSpeed's sample filters need a model with one output and "
                "one loss: a sample can be skipped only when its whole loss "
                "is 0. Expected: sample_filter=None with masked_outputs. "
                f"Received: masked_outputs={self.masked_outputs!r}, "
                f"sample_filter={self.sample_filters!r}"
            )
        if not isinstance(loss, (dict, list, tuple)):
            raise ValueError(
                "`masked_outputs` picks losses of a model with several "
                "outputs: compile it with a dict (or list) of losses, one "
                f"per output{f' of {names}' if names else ''}. Received: "
                f"loss={loss!r}"
            )
        for name in self.masked_outputs:
            if name not in names:
                raise ValueError(
                    f"Expected `masked_outputs` among the model's outputs "
                    f"{names}. Received: {name!r}"
                )
            picked = _filtering.pick(loss, name, names)
            if not isinstance(picked, _MASKING_LOSSES):
                raise ValueError(
                    f"The loss of output {name!r} masks no rows: AS-Speed "
                    "counts rows whose loss is exactly 0, which only an AS "
                    "loss (keras_as_softmax.ASSoftmaxLoss or "
                    "MultiLabelASSoftmaxLoss) gives. Received: "
                    f"{picked!r}. Name only outputs trained with an AS loss "
                    "in `masked_outputs`."
                )

    def _count_masked(self, y, y_pred, sample_weight):
        """`(masked, counted)` rows of the step, as float32 scalars: of the
        one loss, or summed over `masked_outputs`."""
        if not self.masked_outputs:
            return count_masked_rows(self.loss, y, y_pred, sample_weight)
        names = self._output_names()
        masked = counted = 0.0
        for name in self.masked_outputs:
            weight = sample_weight
            if isinstance(sample_weight, (dict, list, tuple)):
                weight = _filtering.pick(sample_weight, name, names)
            m, c = count_masked_rows(
                _filtering.pick(self.loss, name, names),
                _filtering.pick(y, name, names),
                _filtering.pick(y_pred, name, names),
                weight,
            )
            masked, counted = masked + m, counted + c
        return masked, counted

    def _replicas(self):
        if _BACKEND == "tensorflow":
            return self.distribute_strategy.num_replicas_in_sync
        distribution = keras.distribution.distribution()
        if distribution is None:
            return 1
        return len(distribution.device_mesh.devices.flatten())

    # ------------------------------------------------------------- training

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        self._check_step_outputs(y_pred)
        return super().compute_loss(
            x=x,
            y=y,
            y_pred=y_pred,
            sample_weight=sample_weight,
            training=training,
        )

    def _check_step_outputs(self, y_pred):
        """A subclassed model's outputs and Keras mask show only on its
        predictions, as the step is traced (or run, on eager PyTorch):
        refused before the loss reads its labels and before anything is
        updated; a mask is followed by the filtered step's metrics
        (`_check_compiled`)."""
        names = self._output_names()
        outputs = keras.tree.flatten(y_pred)
        if isinstance(self.loss, keras.losses.Loss) and len(outputs) > 1:
            if isinstance(y_pred, dict):
                names = list(y_pred)
            raise _one_loss_for_outputs(self.loss, names or len(outputs))
        if _filtering.check_no_keras_mask(self.loss, y_pred, names):
            self._metrics_skip_ignored = _BACKEND != "jax"

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        # Evaluation counts masked rows here; train steps count them where
        # they have the per-row values and call `_step_metrics`.
        counts = self._count_masked(y, y_pred, sample_weight)
        self.shares_tracker.update_shares(counts)
        return super().compute_metrics(x, y, y_pred, sample_weight)

    def _step_metrics(
        self, x, y, y_pred, sample_weight, covered, counts, trained, scored=None
    ):
        """The train step's metric updates: counts it already has.

        A filtered step's rows have static shapes: besides those its logs
        cover (the drawn batch, or a training pass's rows), they hold a
        short batch's padding or the rows of a pass that did not run.
        `covered` is 1.0 on the rows that count. Keras gives no sample
        weight to the compiled `metrics` (only to `weighted_metrics`, which
        get `sample_weight`, 0 where not covered), so they get `covered`.
        """
        self.shares_tracker.update_shares(counts, trained, scored)
        metrics = self._compile_metrics
        if covered is None or metrics is None:
            return keras.Model.compute_metrics(
                self, x, y, y_pred, sample_weight
            )
        if not metrics.built:
            metrics.build(y, y_pred)
        # One output: sample filters refuse models with more.
        y, y_pred = keras.tree.flatten(y)[0], keras.tree.flatten(y_pred)[0]
        if getattr(self, "_metrics_skip_ignored", False):
            valid = ops.cast(
                valid_rows(y, tuple(covered.shape), ignore_class_of(self.loss)),
                "float32",
            )
            covered, sample_weight = covered * valid, sample_weight * valid
        for unweighted in metrics._flat_metrics:
            if unweighted:
                unweighted.update_state(y, y_pred, sample_weight=covered)
        for weighted in metrics._flat_weighted_metrics:
            if weighted:
                weighted.update_state(y, y_pred, sample_weight=sample_weight)
        return self.get_metrics_result()

    # ------------------------------------------------------ data and fit

    def _with_preprocessor(
        self, x, y, sample_weight, batch_size, shuffle=False
    ):
        """The data as a dataset of preprocessed batches, where the wrapped
        task has a preprocessor. Arrays are batched here and shuffled as
        `shuffle` says (`fit`'s: `True` the samples at each epoch, `"batch"`
        the batches), where keras-hub's own `fit` keeps their order."""
        preprocessor = self.preprocessor
        if preprocessor is None or x is None:
            return x, y, sample_weight
        import tensorflow as tf

        if not isinstance(x, tf.data.Dataset):
            data = keras.utils.pack_x_y_sample_weight(x, y, sample_weight)
            x = tf.data.Dataset.from_tensor_slices(data)
            if shuffle is True:
                x = x.shuffle(x.cardinality(), reshuffle_each_iteration=True)
            x = x.batch(batch_size or 32)
            if shuffle == "batch":
                x = x.shuffle(x.cardinality(), reshuffle_each_iteration=True)

        # The id helpers hold no tensor control flow, so AutoGraph leaves
        # them as they are (its cache of converted functions has called a
        # converted `attach_sample_ids` for `split_sample_ids` late in a
        # long test session).
        split_ids = tf.autograph.experimental.do_not_convert(
            filters_lib.split_sample_ids
        )
        attach_ids = tf.autograph.experimental.do_not_convert(
            filters_lib.attach_sample_ids
        )

        def preprocess(*element):
            inputs, ids = split_ids(element[0])
            out = preprocessor(inputs, *element[1:])
            if ids is None:
                return out
            if not isinstance(out, tuple):
                out = (out,)
            return (attach_ids(out[0], ids), *out[1:])

        x = x.map(preprocess, num_parallel_calls=tf.data.AUTOTUNE)
        return x.prefetch(tf.data.AUTOTUNE), None, None

    def fit(
        self,
        x=None,
        y=None,
        batch_size=None,
        epochs=1,
        verbose="auto",
        callbacks=None,
        validation_split=0.0,
        validation_data=None,
        shuffle=True,
        class_weight=None,
        sample_weight=None,
        initial_epoch=0,
        steps_per_epoch=None,
        validation_steps=None,
        validation_batch_size=None,
        validation_freq=1,
    ):
        self._check_compiled()
        if self.preprocessor is not None:
            x = text_as_arrays(x)
            # The preprocessor makes a dataset of the arrays, which Keras
            # cannot split: split them first, as keras-hub's tasks do.
            if validation_split and validation_data is None:
                (x, y, sample_weight), validation_data = _data.split_validation(
                    x, y, sample_weight, validation_split
                )
                validation_split = 0.0
            if validation_data is not None:
                validation_data = self._with_preprocessor(
                    *keras.utils.unpack_x_y_sample_weight(validation_data)
                    if isinstance(validation_data, tuple)
                    else (validation_data, None, None),
                    validation_batch_size or batch_size,
                )[0]
                validation_batch_size = None
        if self.sample_filters:
            x = self._prepare_filters(
                x,
                y,
                sample_weight,
                batch_size,
                steps_per_epoch,
                validation_split,
            )
            callbacks = [*(callbacks or []), _EpochSchedule(epochs)]
        if self.preprocessor is not None:
            arrays = _data.kind(x) == "arrays"
            x, y, sample_weight = self._with_preprocessor(
                x, y, sample_weight, batch_size, shuffle
            )
            if arrays:  # shuffled as batched: not for Keras to ignore
                shuffle = False
            batch_size = None
        return super().fit(
            x=x,
            y=y,
            batch_size=batch_size,
            epochs=epochs,
            verbose=verbose,
            callbacks=callbacks,
            validation_split=validation_split,
            validation_data=validation_data,
            shuffle=shuffle,
            class_weight=class_weight,
            sample_weight=sample_weight,
            initial_epoch=initial_epoch,
            steps_per_epoch=steps_per_epoch,
            validation_steps=validation_steps,
            validation_batch_size=validation_batch_size,
            validation_freq=validation_freq,
        )

    def _prepare_filters(
        self,
        x,
        y,
        sample_weight,
        batch_size,
        steps_per_epoch,
        validation_split,
    ):
        """Checks the data against the filters and builds their state,
        before the first batch. Returns the data to train on."""
        (first_x, first_y, first_w), x = _data.first_batch(
            x, y, sample_weight, batch_size, steps_per_epoch, validation_split
        )
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
        last_seen = self._memory_filter
        if last_seen is not None:
            data_kind = _data.kind(x)
            if ids is None:
                raise ValueError(
                    f"{type(last_seen).__name__} needs each sample's id. "
                    "Expected "
                    "inputs made by keras_as_softmax.filters.with_sample_ids "
                    "(arrays) or index_dataset (a tf.data.Dataset): a dict "
                    "{'inputs': x, 'sample_id': ids}. Received: "
                    f"{data_kind} whose inputs are of type "
                    f"{type(first_x).__name__}"
                )
            if data_kind not in ("tf.data.Dataset", "arrays"):
                raise ValueError(
                    f"{type(last_seen).__name__} checks the sample ids of "
                    "an epoch before training. Expected arrays made by "
                    "keras_as_softmax.filters.with_sample_ids or a "
                    "tf.data.Dataset made by index_dataset. Received: a "
                    f"{data_kind}"
                )
            self._check_ids(
                x,
                data_kind == "tf.data.Dataset",
                last_seen.num_samples,
                steps_per_epoch,
            )
        batch = int(np.shape(keras.tree.flatten(inputs)[0])[0])
        if ids is not None and (
            tuple(np.shape(ids)) != (batch,)
            or not _dtype(ids).startswith(("int", "uint"))
        ):
            raise ValueError(
                "Expected one integer sample id per sample: ids of shape "
                f"({batch},) in a batch of {batch}. Received: ids of shape "
                f"{tuple(np.shape(ids))}, dtype {_dtype(ids)}. "
                "(index_dataset numbers the elements of an unbatched "
                "dataset: call it before `batch`.)"
            )
        replicas = self._replicas()
        if batch % replicas:
            raise ValueError(
                "With sample filters on several devices, every training pass "
                "splits `batch_size` queued rows evenly over the devices. "
                f"Expected a batch size divisible by {replicas} (devices). "
                f"Received: {batch}"
            )
        if self.preprocessor is not None:
            data = self._with_preprocessor(first_x, first_y, first_w, batch)[0]
            first_x, first_y, first_w = keras.utils.unpack_x_y_sample_weight(
                next(iter(data))
            )
            inputs, _ = filters_lib.split_sample_ids(first_x)
        if not self.built:
            self.build(keras.tree.map_structure(np.shape, inputs))
        self._warn_of_penalties()
        output = self.inner_model.compute_output_spec(
            keras.tree.map_structure(
                lambda a: keras.KerasTensor(np.shape(a), _dtype(a)), inputs
            )
        )
        if isinstance(output, (list, tuple, dict)):
            raise ValueError(
                "ASSpeed's sample filters need a model with one output. "
                f"Received outputs: {output!r}"
            )
        row_tail = tuple(output.shape[1:-1])
        leaves = [
            (tuple(np.shape(a)[1:]), _dtype(a))
            for a in keras.tree.flatten(inputs) + keras.tree.flatten(first_y)
        ]
        if any(None in shape for shape, _ in leaves):
            raise ValueError(
                f"{_ONE_SHAPE} Received inputs and labels of shapes "
                f"{[shape for shape, _ in leaves]} after the batch axis"
            )
        row = (row_tail, "float32")
        leaves += [row, row, ((), "int32"), ((), "float32"), ((), "float32")]
        spec = {
            "format": 3,
            "batch_size": batch,
            "row_tail": list(row_tail),
            "output_tail": list(output.shape[1:]),
            "output_dtype": keras.backend.standardize_dtype(output.dtype),
            "leaves": [[list(s), d] for s, d in leaves],
        }
        if self._filter_spec is not None and self._filter_spec != spec:
            raise ValueError(
                "ASSpeed's filter queues were built by the first `fit()` for "
                "its batches; later fits need batches of the same shapes, "
                "or a new wrapper, `ASSpeed(model.inner_model, ...)`, whose "
                "queues start empty. "
                + _spec_difference(self._filter_spec, spec)
            )
        self._create_filter_state(spec)
        return x

    def _checked_row_shapes(self, inputs, y):
        """`(inputs, y)`, whose rows the queues hold in the first batch's
        shapes: a batch of other shapes (padded to its own longest
        sequence) is refused where its step is traced, or on TensorFlow,
        for a length unknown there (`padded_batch`), where it runs."""
        x_leaves = keras.tree.flatten(inputs)
        n_x = len(x_leaves)
        leaves = x_leaves + keras.tree.flatten(y)
        expected = [tuple(s) for s, _ in self._filter_spec["leaves"]]
        expected = expected[: len(leaves)]
        received = [tuple(leaf.shape[1:]) for leaf in leaves]
        size = self._filter_spec["batch_size"]
        batch = leaves[0].shape[0]
        too_large = (
            "ASSpeed's sample filters queue rows for passes of the first "
            f"batch's size, {size}: a larger batch would overflow them. "
            "Expected batches of at most the first one's size (arrays: give "
            "`batch_size`). Received a batch of "
        )
        if batch is not None and batch > size:
            raise ValueError(f"{too_large}{batch}")
        if batch is None and _BACKEND == "tensorflow":
            # Known as the graph runs, and checked there (an XLA program
            # would skip the check).
            import tensorflow as tf

            tf.debugging.assert_less_equal(
                tf.shape(leaves[0])[0], size, message=too_large
            )
        if any(
            len(r) != len(e) or any(a not in (None, b) for a, b in zip(r, e))
            for r, e in zip(received, expected)
        ):
            raise ValueError(
                f"{_ONE_SHAPE} Expected inputs and labels of shapes "
                f"{expected} after the batch axis. Received: {received}"
            )
        if _BACKEND == "tensorflow" and any(None in r for r in received):
            import tensorflow as tf

            leaves = [
                tf.ensure_shape(leaf, (None, *shape))
                for leaf, shape in zip(leaves, expected)
            ]
            inputs = keras.tree.pack_sequence_as(inputs, leaves[:n_x])
            y = keras.tree.pack_sequence_as(y, leaves[n_x:])
        return inputs, y

    def _warn_of_penalties(self):
        """Penalties of a pass's inputs enter the training passes only:
        with a filter they act on fewer batches than without one."""
        named = [
            layer.name
            for layer in self.inner_model._flatten_layers()
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

    @staticmethod
    def _check_ids(x, is_dataset, num_samples, steps_per_epoch):
        """Reads the ids of one epoch (a dataset of unknown or infinite
        length: its first `steps_per_epoch` batches) and checks their
        range."""
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

    def train_on_batch(
        self,
        x,
        y=None,
        sample_weight=None,
        class_weight=None,
        return_dict=False,
    ):
        """`keras.Model.train_on_batch`; with a sample filter, after a
        `fit` (or `load_weights`) has built the filters' state."""
        if self.sample_filters and self._filter_spec is None:
            raise ValueError(
                "ASSpeed's sample filters keep state shaped by the data and "
                "scheduled by the epochs, which `fit()` builds (or "
                "`load_weights`, from a file). Expected a fitted ASSpeed. "
                "Received: train_on_batch before any fit"
            )
        if self.sample_filters and _BACKEND == "torch":
            # Keras's torch trainer passes the arrays on as given; the
            # filtered step queues rows as tensors.
            x, y, sample_weight = keras.tree.map_structure(
                lambda a: a if a is None else ops.convert_to_tensor(a),
                (x, y, sample_weight),
            )
        return super().train_on_batch(
            x, y, sample_weight, class_weight, return_dict
        )

    def evaluate(
        self,
        x=None,
        y=None,
        batch_size=None,
        verbose="auto",
        sample_weight=None,
        steps=None,
        callbacks=None,
        return_dict=False,
        **kwargs,
    ):
        # From `fit`, the validation data is preprocessed already.
        if not kwargs.get("_use_cached_eval_dataset"):
            x, y, sample_weight = self._with_preprocessor(
                x, y, sample_weight, batch_size
            )
            if self.preprocessor is not None:
                batch_size = None
        with self._evaluation():
            return super().evaluate(
                x=x,
                y=y,
                batch_size=batch_size,
                verbose=verbose,
                sample_weight=sample_weight,
                steps=steps,
                callbacks=callbacks,
                return_dict=return_dict,
                **kwargs,
            )

    def test_on_batch(self, x, y=None, sample_weight=None, return_dict=False):
        with self._evaluation():
            return super().test_on_batch(x, y, sample_weight, return_dict)

    @contextlib.contextmanager
    def _evaluation(self):
        self._evaluating = True
        try:
            yield
        finally:
            self._evaluating = False

    def get_metrics_result(self):
        logs = super().get_metrics_result()
        if getattr(self, "_evaluating", False):
            # Shares of training passes: nothing to report on evaluation.
            logs.pop("trained_fraction", None)
            logs.pop("scored_fraction", None)
        elif getattr(getattr(self, "optimizer", None), "built", False):
            # Here, not added to a step's logs: Keras ends an epoch with
            # these results only if they have the step's keys, else with
            # the last step's logs (under MirroredStrategy, each replica's
            # ratios averaged).
            logs["accum_steps"] = self.optimizer.accumulation_steps
        return logs

    def predict(
        self, x, batch_size=None, verbose="auto", steps=None, callbacks=None
    ):
        if self.preprocessor is not None:
            x = self._with_preprocessor(x, None, None, batch_size)[0]
            batch_size = None
        return super().predict(
            x,
            batch_size=batch_size,
            verbose=verbose,
            steps=steps,
            callbacks=callbacks,
        )

    # ---------------------------------------------------------- serialization

    def get_config(self):
        config = super().get_config()
        config.update(
            model=keras.saving.serialize_keras_object(self.inner_model),
            lam=self.lam,
            max_steps=self.max_steps,
            sample_filter=[
                keras.saving.serialize_keras_object(f)
                for f in self.sample_filters
            ],
            filter_spec=self._filter_spec,
            masked_outputs=self.masked_outputs,
        )
        return config

    def set_weights(self, weights):
        if (
            self.sample_filters
            and self._filter_spec is None
            and len(weights) > len(self.weights)
        ):
            raise ValueError(
                "The filters' queues are weights too, built by the first "
                "`fit()` (or by `load_weights`, from the file's layout). "
                f"Expected {len(self.weights)} weights before they exist. "
                f"Received: {len(weights)}. Fit first, or save and load a "
                "weights file."
            )
        queues = {id(v) for v in self._queue_variables()}
        if queues and len(weights) == len(self.weights) - len(queues):
            # Weights taken before the first `fit` created the queues (the
            # initial ones, to train again from them): empty queues.
            given = iter(weights)
            weights = [
                np.zeros(v.shape, v.dtype) if id(v) in queues else next(given)
                for v in self.weights
            ]
        super().set_weights(weights)

    def save_own_variables(self, store):
        super().save_own_variables(store)
        if self._filter_spec is not None:
            # So that weights files (`save_weights`, `ModelCheckpoint`) load
            # into a new ASSpeed before its first fit creates the queues.
            spec = json.dumps(self._filter_spec).encode()
            store[_FILTER_SPEC_KEY] = np.frombuffer(spec, "uint8")

    def load_own_variables(self, store):
        keys = list(store.keys())
        if _FILTER_SPEC_KEY in keys:
            if not self.sample_filters:
                raise ValueError(
                    "These weights hold the queues of an ASSpeed with sample "
                    "filters. Expected an ASSpeed with the same filters. "
                    "Received: sample_filter=None"
                )
            spec = bytes(np.asarray(store[_FILTER_SPEC_KEY], "uint8"))
            spec = json.loads(spec.decode())
            store = {k: store[k] for k in keys if k != _FILTER_SPEC_KEY}
            saved_by_0_5_13 = "format" not in spec
            spec = _current_spec(spec)
            if self._filter_spec is None:
                self._create_filter_state(spec)
            elif spec != self._filter_spec:
                raise ValueError(
                    "These weights hold filter queues built for batches of "
                    "other shapes. " + _spec_difference(self._filter_spec, spec)
                )
            if saved_by_0_5_13:
                store = self._with_drawn_sizes(store)
        else:
            missing = self._stored_variables()[len(keys) :]
            if missing and _same(missing, self._queue_variables()):
                # Saved before the first `fit` created the queues (the
                # initial weights, to train again from them): empty queues.
                store = {k: store[k] for k in keys}
                for i, variable in enumerate(missing, len(keys)):
                    store[f"{i}"] = np.zeros(variable.shape, variable.dtype)
        super().load_own_variables(store)

    def _stored_variables(self):
        """This layer's own variables, in the order of the keys `"0"`,
        `"1"`, ... that Keras's `save_own_variables` writes."""
        return self._trainable_variables + self._non_trainable_variables

    def _with_drawn_sizes(self, store):
        """`store` of a file saved by 0.5.13 or earlier, whose queued rows
        lack the size of the batch each was drawn in: with it, as if every
        row came from a full batch (the rows an epoch's shorter last batch
        left then weigh as a full batch's in the next epoch's logged loss,
        as they did)."""
        size = self._filter_batch_size
        buffers = {
            id(b) for b in self._queue_variables() if b.dtype == "float32"
        }
        store = dict(store)
        for i, variable in enumerate(self._stored_variables()):
            if id(variable) in buffers:
                old = np.asarray(store[f"{i}"])
                column = np.full((old.shape[0], 1), size, "float32")
                store[f"{i}"] = np.concatenate([old, column], axis=1)
        return store

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["model"] = keras.saving.deserialize_keras_object(
            config["model"], custom_objects=custom_objects
        )
        config["sample_filter"] = [
            keras.saving.deserialize_keras_object(f)
            for f in config.get("sample_filter") or []
        ]
        return cls(**config)


class _StepShares(keras.metrics.Metric):
    """`masked_ratio`, and with filters `trained_fraction` (drawn batches
    with a training pass) and `scored_fraction` (with a scoring pass), in
    one metric with one variable: a compiled step passes each metric
    variable as a buffer of its own.

    The variable holds `[masked rows, counted rows, trained, scored, train
    steps]`; `result` is a dict of the shares, which Keras's logs take as
    entries of their own.
    """

    def __init__(
        self, filters=False, scoring=False, name="step_shares", dtype=None
    ):
        super().__init__(name=name, dtype=dtype)
        self.filters = filters
        self.scoring = scoring
        self.counts = self.add_variable(
            shape=(5,), initializer="zeros", name="counts"
        )

    def update_shares(self, counts, trained=None, scored=None):
        """Adds a step's `(masked, counted)` rows, and for a training step
        whether a training pass and a scoring pass ran (0.0 or 1.0)."""
        values = (
            *counts,
            0.0 if trained is None else trained,
            0.0 if scored is None else scored,
            0.0 if trained is None else 1.0,
        )
        if _BACKEND == "torch":
            # Eager steps: one stack and an in-place addition.
            _torch.add_to(self.counts, values)
            return
        values = [ops.cast(v, self.dtype) for v in values]
        self.counts.assign_add(ops.stack(values))

    def update_state(self, *args, **kwargs):
        raise NotImplementedError("ASSpeed calls `update_shares`.")

    def result(self):
        c = self.counts.value
        divide = ops.divide_no_nan
        if _BACKEND == "jax" and not isinstance(c, jax.core.Tracer):
            # At an epoch's end, outside the step: one read of the counts,
            # where a dispatch per slice and division would cost a small
            # model's epoch what several of its steps do.
            c = np.asarray(c, "float64")

            def divide(a, b):
                return np.float32(a / b if b else 0.0)

        elif _BACKEND == "torch":
            divide = _torch.divide_counts

        shares = {"masked_ratio": divide(c[0], c[1])}
        if self.filters:
            shares["trained_fraction"] = divide(c[2], c[4])
        if self.scoring:
            shares["scored_fraction"] = divide(c[3], c[4])
        return shares

    def get_config(self):
        config = super().get_config()
        config.update(filters=self.filters, scoring=self.scoring)
        return config


class _EpochSchedule(keras.callbacks.Callback):
    """Writes `[epoch, epochs]` of `fit` to the model's schedule weight at
    each epoch's start, where the JAX trainer re-reads its state, and after
    `BackupAndRestore` has restored the weights."""

    def __init__(self, epochs):
        super().__init__()
        self.epochs = int(epochs)

    def on_epoch_begin(self, epoch, logs=None):
        self.model._schedule.assign(np.array([epoch, self.epochs], "int32"))


def _dtype(a):
    return keras.backend.standardize_dtype(
        a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype
    )


def _same(variables, others):
    """Whether two lists hold the same variables, in any order."""
    return sorted(map(id, variables)) == sorted(map(id, others))


def _current_spec(spec):
    """A filter spec as this version lays out the queues: one saved by
    0.5.13 or earlier (no `format`) lacks the rows' last leaf, the size of
    the batch each was drawn in; one saved by 0.5.19 or earlier (format 2)
    packed wide leaves beside the others, which format 3 keeps in buffers
    of their own (`_layout.Layout`): the same layout if none is wide, else
    refused."""
    if "format" not in spec:
        spec = {
            **spec,
            "format": 2,
            "leaves": [*spec["leaves"], [[], "float32"]],
        }
    if spec["format"] == 2:
        wide = [
            shape
            for shape, _ in spec["leaves"]
            if _layout.Layout.has_own_buffer(shape)
        ]
        if wide:
            raise ValueError(
                "These weights were saved by keras-as-softmax 0.5.19 or "
                "earlier, whose filter queues packed rows of shapes "
                f"{wide} beside the others. Expected queues laid out as "
                f"0.5.20 lays them out: a row's leaf of "
                f"{_layout.Layout.OWN_BUFFER_WIDTH} values or more in a "
                "buffer of its own. To go on training, load the file with "
                "0.5.19, save `model.inner_model`'s weights, and wrap them "
                "anew (the queues start empty)."
            )
        spec = {**spec, "format": 3}
    return spec


def _spec_difference(expected, received):
    """ "Expected: ... Received: ..." over the entries of two filter specs
    that differ (`batch_size=8`, the queued leaves' shapes)."""
    keys = [k for k in received if received[k] != expected.get(k)]
    return (
        "Expected: "
        + ", ".join(f"{k}={expected.get(k)}" for k in keys)
        + ". Received: "
        + ", ".join(f"{k}={received[k]}" for k in keys)
    )


def _one_loss_for_outputs(loss, outputs):
    """The error for one loss compiled for several `outputs` (names, or
    their number)."""
    return ValueError(
        "ASSpeed counts masked rows of one loss. For a model with several "
        "outputs, compile a dict of losses, one per output, and name the "
        "outputs whose AS loss counts with "
        f"`ASSpeed(..., masked_outputs=[...])`. Received: one loss, "
        f"{loss!r}, for the outputs {outputs}"
    )


def _as_output_names(masked_outputs):
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
