"""`ASSpeed`: the Keras `Model` face of AS-Speed and its sample filters."""

import contextlib

import keras
import numpy as np
from keras import ops

from keras_as_softmax import filters as filters_lib
from keras_as_softmax._validation import check_int
from keras_as_softmax.filters.base import as_list
from keras_as_softmax.training import _checks
from keras_as_softmax.training import _data
from keras_as_softmax.training.accumulation import AdaptiveSteps
from keras_as_softmax.training.filter_engine import SPEC_KEY
from keras_as_softmax.training.filter_engine import FilterEngine
from keras_as_softmax.training.filter_engine import current_spec
from keras_as_softmax.training.optimizer import AccumulatingOptimizer
from keras_as_softmax.training.optimizer import scaling_inside_window
from keras_as_softmax.training.step_shares import StepShares

_BACKEND = keras.backend.backend()
if _BACKEND == "tensorflow":
    from keras_as_softmax.training._tensorflow import ASSpeedTrainer
elif _BACKEND == "jax":
    from keras_as_softmax.training._jax import ASSpeedTrainer
elif _BACKEND == "torch":
    from keras_as_softmax.training._torch import ASSpeedTrainer
else:

    class ASSpeedTrainer:
        def __init__(self, *args, **kwargs):
            raise ValueError(
                "ASSpeed supports the tensorflow, jax and torch backends. "
                f"Received: the {_BACKEND!r} backend. Use "
                "keras_as_softmax.ASSoftmaxLoss alone on this backend, or "
                "set KERAS_BACKEND=tensorflow."
            )


@keras.saving.register_keras_serializable(package="keras_as_softmax")
class ASSpeed(ASSpeedTrainer, keras.Model):
    """Wraps a model so that `fit` accumulates more micro-batches per update
    as AS-Softmax masks more samples (AS-Speed, paper section 3.3), and,
    with a sample filter, leaves masked samples out of the training passes.

    Each drawn batch is a micro-batch. `compile()` wraps the optimizer in
    an `AccumulatingOptimizer`, which applies the mean gradient of
    `accumulation_steps` micro-batches, and re-estimates that number from
    the masked share of the window (`AdaptiveSteps(lam, max_steps)`, the
    paper's eq. 19). A `sample_filter` (`keras_as_softmax.filters`) saves
    the passes of the samples it leaves out: the kept ones are queued, and
    a training pass runs on every full batch of them. What cannot work is
    refused by `compile()` or by `fit()` before the first batch.

    Args:
        model: the `keras.Model` to train (functional, sequential,
            subclassed, or a keras-hub task, whose preprocessor runs in
            `fit`, `evaluate` and `predict`).
        lam: the paper's lambda (> 0): the steps follow
            `lam * N_all / (N_all - N_masked)`. Defaults to `0.5`.
        max_steps: the cap `s` on accumulated micro-batches (int >= 1).
            Defaults to `4`.
        sample_filter: `None` (the default), a filter, or a
            `MemoryFilter` then a `ScoringFilter`.
        masked_outputs: for a model with several outputs, the names of
            those whose AS loss counts masked rows. Defaults to `None`.
        **kwargs: passed to `keras.Model` (e.g. `name`).

    Example:

    ```python
    model = keras_as_softmax.ASSpeed(
        base_model, sample_filter=keras_as_softmax.filters.SkipMasked()
    )
    model.compile(optimizer="adamw",
                  loss=keras_as_softmax.ASSoftmaxLoss(0.3),
                  metrics=["accuracy"], jit_compile=True)
    model.fit(train_ds, validation_data=val_ds, epochs=8)
    ```

    Reference:
        Lv et al., "Adaptive Sparse Softmax: An Effective and Efficient
        Softmax Variant" (section 3.3, eq. 19).
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
        _checks.check_wrappable(model)
        if isinstance(model, ASSpeed):
            raise ValueError(
                "Expected an unwrapped model. Received: an ASSpeed model."
            )
        super().__init__(**kwargs)
        self.inner_model = model
        self.steps_rule = AdaptiveSteps(lam, max_steps)  # checks them
        self.lam = self.steps_rule.lam
        self.max_steps = self.steps_rule.max_steps
        self.sample_filters = as_list(sample_filter)
        self.masked_outputs = _checks.as_output_names(masked_outputs)
        self.filter_engine = None
        if self.sample_filters:
            self.filter_engine = FilterEngine(self.sample_filters)
        self.shares_tracker = StepShares(
            filters=bool(self.sample_filters),
            scoring=any(f.scores for f in self.sample_filters),
        )
        self._start_steps = None
        # A subclassed model without a `build` of its own creates its
        # weights on its first call.
        if model.built and model.variables:
            self._create_state()
            self.built = True
        if filter_spec is not None:
            self._create_queues(current_spec(filter_spec))

    def build(self, input_shape=None):
        if not self.inner_model.trainable_variables and input_shape is not None:
            # A subclassed model creates its weights on its first call.
            self.inner_model(
                keras.tree.map_shape_structure(keras.KerasTensor, input_shape)
            )
        self._create_state()
        self.built = True

    def _lock_state(self):
        # Open to new state after `build()`, as Keras's functional models:
        # the first `fit()` creates the queues, once it knows the batch.
        pass

    def _create_state(self):
        if getattr(self, "_state_created", False):
            return
        if not self.inner_model.trainable_variables:
            raise ValueError(
                "ASSpeed needs a model with trainable weights. Received a "
                f"model with none: {self.inner_model.name!r}"
            )
        if self.filter_engine is not None:
            self.filter_engine.create_state(self.add_weight)
        self._state_created = True

    def _create_queues(self, spec):
        if not self.built:
            self.build()
        # Under a `tf.distribute` strategy, a copy of each queue on every
        # replica, as the other weights: a step reads and writes its rows.
        with _strategy_scope(self):
            self.filter_engine.create_queues(spec, self.add_weight)

    # How many `train_step`s run (or are traced; one a replica under
    # `MirroredStrategy`): `call` warns when it runs in training mode
    # outside them, where nothing accumulates or filters.
    _train_steps_running = 0
    _warned_training_outside = False

    def train_step(self, *args):
        # Plain writes: `Layer.__setattr__`'s tracking would cost more than
        # the rest of an eager PyTorch step's bookkeeping.
        _count_running(self, 1)
        try:
            return super().train_step(*args)
        finally:
            _count_running(self, -1)

    def call(self, inputs, training=None):
        if training and not (
            self._train_steps_running or self._warned_training_outside
        ):
            self._warned_training_outside = True
            _checks.warn_training_outside(self.name)
        inputs, _ = filters_lib.split_sample_ids(inputs)
        return self.inner_model(inputs, training=training)

    def export(self, filepath, format="tf_saved_model", **kwargs):
        """Exports the inner model: `ASSpeed` adds training only."""
        return self.inner_model.export(filepath, format=format, **kwargs)

    @property
    def output_names(self):
        """The inner model's, after which Keras names the losses and
        metrics of several outputs (an AttributeError without them)."""
        return self.inner_model.output_names

    def compile(self, optimizer="rmsprop", loss=None, **kwargs):
        """`keras.Model.compile`, with the optimizer wrapped in an
        `AccumulatingOptimizer(optimizer, AdaptiveSteps(lam, max_steps))`;
        an `AccumulatingOptimizer` passed in is kept, with its own rule."""
        super().compile(optimizer=optimizer, loss=loss, **kwargs)
        if self.optimizer is None:
            return
        with _strategy_scope(self):
            optimizer = scaling_inside_window(self.optimizer)
            wrap = not isinstance(optimizer, AccumulatingOptimizer)
            if wrap:
                optimizer = AccumulatingOptimizer(
                    optimizer,
                    self.steps_rule,
                    name="accumulating_optimizer",
                )
        self.optimizer = optimizer
        if wrap and self._start_steps is not None:
            self._built_optimizer()
        if self.sample_filters:
            # The training passes leave the weights' penalties out.
            optimizer.regularize_weights = True

    def compile_from_config(self, config):
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.built:
            self._built_optimizer()

    def _built_optimizer(self):
        """The compiled `AccumulatingOptimizer`, built (or `None` before
        `compile()` or before the model has weights)."""
        optimizer = getattr(self, "optimizer", None)
        if optimizer is None or not self.trainable_variables:
            return None
        if not optimizer.built:
            with _strategy_scope(self):
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
        value = check_int(value, "accumulation_steps", 1, self.max_steps)
        self._start_steps = value
        optimizer = self._built_optimizer()
        if optimizer is not None:
            optimizer.set_accumulation_steps(value)

    @property
    def last_seen_masked_fraction(self):
        """Share of the training set masked when last seen (or `None`)."""
        if self.filter_engine is None:
            return None
        return self.filter_engine.masked_when_seen()

    @property
    def preprocessor(self):
        """The wrapped keras-hub task's preprocessor, or `None`."""
        return getattr(self.inner_model, "preprocessor", None)

    def _output_names(self):
        return _checks.output_names(self.inner_model, self.loss)

    def _check_compiled(self):
        masked = _checks.check_compiled(self, self._output_names())
        self.shares_tracker.skip_ignored = masked and _BACKEND != "jax"

    def count_masked(self, y, y_pred, sample_weight=None):
        """`(masked, counted)` rows of a batch, as float32 scalars: of the
        compiled loss, or summed over `masked_outputs`. The steps call it."""
        return _checks.count_masked(
            self.loss,
            self.masked_outputs,
            self._output_names(),
            y,
            y_pred,
            sample_weight,
        )

    def check_step_outputs(self, y_pred):
        """Refuses predictions that the compiled loss cannot count: several
        outputs for one loss, or a Keras mask without `ignore_class`. The
        passes call it, where a subclassed model's outputs first show."""
        names = self._output_names()
        if _checks.check_step_outputs(self.loss, names, y_pred):
            self.shares_tracker.skip_ignored = _BACKEND != "jax"

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        self.check_step_outputs(y_pred)
        return super().compute_loss(x, y, y_pred, sample_weight, training)

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        # Evaluation counts masked rows here; train steps count them where
        # they have the per-row values (`_step.update_logs`).
        counts = self.count_masked(y, y_pred, sample_weight)
        self.shares_tracker.update_shares(counts)
        return super().compute_metrics(x, y, y_pred, sample_weight)

    def _with_preprocessor(
        self, x, y, sample_weight, batch_size, shuffle=False
    ):
        return _data.preprocessed(
            self.preprocessor, x, y, sample_weight, batch_size, shuffle
        )

    def fit(
        self,
        x=None,
        y=None,
        batch_size=None,
        epochs=1,
        verbose="auto",
        callbacks=None,
        **kwargs,
    ):
        """`keras.Model.fit`, with the filters' queues built from the first
        batch and a keras-hub task's preprocessor applied (as keras-hub's
        own `Task.fit`)."""
        self._check_compiled()
        args = dict(kwargs, x=x, y=y, batch_size=batch_size, verbose=verbose)
        if self.preprocessor is not None:
            args = _data.with_hub_validation(self.preprocessor, args)
        if self.sample_filters:
            args["x"] = self._prepare_filters(args)
            schedule = self.filter_engine.schedule_callback(epochs)
            callbacks = [*(callbacks or []), schedule]
        if self.preprocessor is not None:
            args = _data.with_hub_training(self.preprocessor, args)
        return super().fit(epochs=epochs, callbacks=callbacks, **args)

    def _prepare_filters(self, args):
        """Checks the data of `fit`'s `args` against the filters and builds
        their queues, before the first batch. Returns the data to train on."""
        steps_per_epoch = args.get("steps_per_epoch")
        (first_x, first_y, first_w), x = _data.first_batch(
            args["x"],
            args["y"],
            args.get("sample_weight"),
            args["batch_size"],
            steps_per_epoch,
            args.get("validation_split", 0.0),
        )
        engine = self.filter_engine
        _checks.check_data(
            engine, x, first_x, first_y, steps_per_epoch, _checks.replicas(self)
        )
        if self.preprocessor is not None:
            batch = int(np.shape(keras.tree.flatten(first_x)[0])[0])
            data = self._with_preprocessor(first_x, first_y, first_w, batch)[0]
            first_x, first_y, _ = keras.utils.unpack_x_y_sample_weight(
                next(iter(data))
            )
        inputs, _ = filters_lib.split_sample_ids(first_x)
        if not self.built:
            self.build(keras.tree.map_structure(np.shape, inputs))
        _checks.warn_of_penalties(self.inner_model)
        self._create_queues(engine.spec_of(self.inner_model, inputs, first_y))
        return x

    def train_on_batch(self, x, y=None, sample_weight=None, **kwargs):
        """`keras.Model.train_on_batch`; with a sample filter, after a
        `fit` (or `load_weights`) has built the filters' state."""
        if self.filter_engine is not None:
            x, y, sample_weight = self.filter_engine.batch_for_step(
                x, y, sample_weight
            )
        return super().train_on_batch(x, y, sample_weight, **kwargs)

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
            # Here, not in a step's logs: Keras ends an epoch with these
            # results only if they have the step's keys.
            logs["accum_steps"] = self.optimizer.accumulation_steps
        return logs

    def predict(self, x, batch_size=None, *args, **kwargs):
        if self.preprocessor is not None:
            x = self._with_preprocessor(x, None, None, batch_size)[0]
            batch_size = None
        return super().predict(x, batch_size, *args, **kwargs)

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
            filter_spec=self.filter_engine and self.filter_engine.spec,
            masked_outputs=self.masked_outputs,
        )
        return config

    def set_weights(self, weights):
        if self.filter_engine is not None:
            weights = self.filter_engine.with_empty_queues(
                weights, self.weights
            )
        super().set_weights(weights)

    def save_own_variables(self, store):
        super().save_own_variables(store)
        if self.filter_engine is not None:
            self.filter_engine.save_spec(store)

    def load_own_variables(self, store):
        # This layer's own variables, in the order of the keys "0", "1", ...
        # that Keras's `save_own_variables` writes.
        own = self._trainable_variables + self._non_trainable_variables
        if SPEC_KEY in store.keys() and not self.sample_filters:
            raise ValueError(
                "These weights hold the queues of an ASSpeed with sample "
                "filters. Expected an ASSpeed with the same filters. "
                "Received: sample_filter=None"
            )
        if self.filter_engine is not None:
            store = self.filter_engine.load(store, own, self._create_queues)
        super().load_own_variables(store)

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


def _count_running(model, change):
    running = model._train_steps_running + change
    object.__setattr__(model, "_train_steps_running", running)


def _strategy_scope(model):
    if _BACKEND == "tensorflow":
        return model.distribute_strategy.scope()
    return contextlib.nullcontext()
