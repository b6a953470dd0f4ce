"""AS-Speed: adaptive gradient accumulation driven by AS-Softmax's masked rows."""

import warnings

import keras
from keras import ops

from keras_as_softmax.metrics import MaskedRatio
from keras_as_softmax.metrics import count_masked_rows

SUPPORTED_BACKENDS = ("tensorflow", "jax")


def _has_accelerator():
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU") or tf.config.list_physical_devices("TPU"))


def next_accumulation_steps(steps, n_all, n_masked, lam, max_steps):
    """The AS-Speed rule (paper eq. 19 with its three restrictions).

    ```
    proposal = round(lam * N_all / (N_all - N_masked)), at least 1
    steps'   = steps + 1 if proposal > steps and steps < max_steps else steps
    ```

    The number of accumulated micro-batches never decreases, grows by at most
    one per optimizer update and never exceeds `max_steps`. A window with no
    counted rows keeps the current value; a window with every row masked
    proposes growth.

    Args:
        steps: int32 scalar, the current number of steps.
        n_all: float scalar, counted rows in the last window.
        n_masked: float scalar, masked rows among them.
        lam: the paper's lambda.
        max_steps: the cap `s`.

    Returns:
        int32 scalar, the next number of steps.
    """
    n_all = ops.cast(n_all, "float32")
    n_masked = ops.cast(n_masked, "float32")
    unmasked = n_all - n_masked
    ratio = ops.where(unmasked > 0, n_all / ops.maximum(unmasked, 1.0), 1e9)
    proposal = ops.floor(lam * ratio + 0.5)
    grow = ops.logical_and(
        ops.logical_and(proposal > ops.cast(steps, "float32"), n_all > 0),
        steps < max_steps,
    )
    return ops.where(grow, steps + 1, steps)


@keras.saving.register_keras_serializable(package="keras_as_softmax")
class ASSpeed(keras.Model):
    """Wraps a model so that `fit` accumulates more micro-batches per update
    as AS-Softmax masks more samples (AS-Speed, paper section 3.3).

    Each batch that `fit` draws is a micro-batch: its gradient is added to an
    accumulator, and its counted rows (`N_all`: samples, or tokens that are
    not `ignore_class`, with nonzero sample weight) and masked rows
    (`N_masked`: loss exactly 0) are added to the window's counts. When the
    window holds `accumulation_steps` micro-batches the optimizer applies
    their *mean* gradient, so an update has the scale of one softmax batch,
    and the number of steps is re-estimated with
    `keras_as_softmax.as_speed.next_accumulation_steps` (eq. 19: never
    decreasing, growing by at most one, capped at `max_steps`). On other
    micro-batches the optimizer does not run at all (a compiled conditional:
    XLA executes only the taken branch), which is where the time goes:
    learning-rate schedules and Adam's bias correction count updates
    (`optimizer.iterations`), not micro-batches.

    The wrapper predicts, evaluates and saves like the model it wraps; its
    counters and gradient accumulators are non-trainable weights, so they
    are saved in `.keras` files and restored by
    `keras.callbacks.BackupAndRestore`. A keras-hub task (for instance
    `keras_hub.models.BertTextClassifier`) keeps its preprocessor: `fit`,
    `evaluate` and `predict` apply it to raw inputs as the task would.

    Layers with training-time state, such as `BatchNormalization`, update
    that state on every micro-batch, with the micro-batch's statistics (as
    in Keras's and PyTorch's fixed gradient accumulation): the moving
    statistics see every sample once, and batch statistics are those of
    the batch `fit` draws.

    `fit`'s logs show `masked_ratio` (masked / counted rows since the epoch
    began) and `accum_steps` (the current number of steps).

    Supported backends: TensorFlow (eagerly, as a graph, or with
    `jit_compile=True`; also under `tf.distribute.MirroredStrategy` and
    `MultiWorkerMirroredStrategy`, where the masked counts and gradients
    are all-reduced so that every replica uses the same number of steps)
    and JAX.

    Args:
        model: the `keras.Model` to train.
        lam: the paper's lambda (> 0): the steps follow
            `lam * N_all / (N_all - N_masked)`. Defaults to `0.5`.
        max_steps: the cap `s` on accumulated micro-batches (int >= 1).
            Defaults to `4`.
        sample_skipper: optional `keras_as_softmax.MaskedSampleSkipper`
            (TensorFlow, one device, `jit_compile=False`; not saved in the
            config): each train step leaves out the samples that were
            masked when last seen (but a `revisit` fraction), trains on the
            others as a smaller micro-batch and records which of them are
            masked now. The inputs carry each sample's index under the
            skipper's `id_key`. An extension beyond the paper; `fit`'s logs
            add `backward_fraction`.
        skip_masked: whether to spare the training forward and backward
            passes of samples that are masked now (TensorFlow, one device;
            an extension beyond the paper). Once the last micro-batch had at
            least `SKIP_FROM_MASKED_RATIO` (1/2) of its rows masked, each
            micro-batch is first scored by a forward pass in training mode
            (dropout decides which samples are masked, as in a plain step;
            moving statistics such as `BatchNormalization`'s are put back
            after it), and the training passes run only on the samples
            with a nonzero loss (none when all are masked), each row
            weighted as in the whole batch's loss. Compiled as a TensorFlow
            graph (`jit_compile=False`, Keras's default on CPU) those
            samples form one batch of their own size; under XLA, which
            needs static shapes, they go through a loop in chunks of a
            quarter of the micro-batch (moving statistics then see each
            chunk, its padding rows included), and on CPU XLA runs that loop
            several times slower than TensorFlow's own kernels (even on
            steps that do not score), so prefer `jit_compile=False` there. The training
            loss and metrics of such a step are those of the scoring pass,
            and `fit`'s logs add `backward_fraction` (the share of samples
            that went through the training passes). Defaults to `False`.
        **kwargs: passed to `keras.Model` (e.g. `name`).

    Example:

    ```python
    model = keras_as_softmax.ASSpeed(base_model, lam=0.5, max_steps=5)
    model.compile(optimizer="adamw",
                  loss=keras_as_softmax.ASSoftmaxLoss(0.3),
                  metrics=["accuracy"], jit_compile=True)
    model.fit(train_ds, validation_data=val_ds, epochs=5)
    model.accumulation_steps  # e.g. 3
    ```

    Reference:
        Lv et al., "Adaptive Sparse Softmax: An Effective and Efficient
        Softmax Variant" (section 3.3, eq. 19; Table 6 for lambda and s).
    """

    # skip_masked scores a micro-batch first only from this masked ratio on.
    # benchmarks/step_cost.py (MiniLM, batch 32): scoring makes a step with
    # nothing masked 1.32x as long; with half masked the step takes 0.90x.
    SKIP_FROM_MASKED_RATIO = 0.5

    def __init__(
        self, model, lam=0.5, max_steps=4, sample_skipper=None, skip_masked=False, **kwargs
    ):
        backend = keras.backend.backend()
        if backend not in SUPPORTED_BACKENDS:
            raise ValueError(
                f"ASSpeed supports the {' and '.join(SUPPORTED_BACKENDS)} "
                f"backends. Received: the {backend!r} backend. Use "
                "keras_as_softmax.ASSoftmaxLoss alone on this backend, or set "
                "KERAS_BACKEND=tensorflow."
            )
        if not isinstance(model, keras.Model):
            raise ValueError(
                "Expected `model` to be a keras.Model (functional, sequential, "
                f"subclassed or a keras-hub task). Received: model={model!r}"
            )
        if isinstance(model, ASSpeed):
            raise ValueError("Expected an unwrapped model. Received: an ASSpeed model.")
        if not float(lam) > 0:
            raise ValueError(f"Expected `lam` > 0. Received: lam={lam!r}")
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(
                f"Expected `max_steps` to be an int >= 1. Received: max_steps={max_steps!r}"
            )
        if sample_skipper is not None and backend != "tensorflow":
            raise ValueError(
                "`sample_skipper` needs the tensorflow backend (a batch of "
                f"data-dependent size). Received: the {backend!r} backend."
            )
        if skip_masked and backend != "tensorflow":
            raise ValueError(
                "`skip_masked=True` needs the tensorflow backend (a batch of "
                f"data-dependent size). Received: the {backend!r} backend."
            )
        super().__init__(**kwargs)
        self.inner_model = model
        self.sample_skipper = sample_skipper
        self.skip_masked = bool(skip_masked)
        if self._drops_samples:
            self.backward_fraction_tracker = keras.metrics.Mean(name="backward_fraction")
        self.lam = float(lam)
        self.max_steps = max_steps
        self.masked_ratio_tracker = MaskedRatio(name="masked_ratio")
        self._step_counts = None
        if model.built:
            self._create_state()
            self.built = True

    # ------------------------------------------------------------- structure

    def build(self, input_shape=None):
        if not self.inner_model.trainable_variables and input_shape is not None:
            # A subclassed model creates its weights on its first call.
            self.inner_model(keras.tree.map_shape_structure(keras.KerasTensor, input_shape))
        self._create_state()
        self.built = True

    def _create_state(self):
        if getattr(self, "_state_created", False):
            return
        if not self.inner_model.trainable_variables:
            raise ValueError(
                "ASSpeed needs a model with trainable weights. Received a "
                f"model with none: {self.inner_model.name!r}"
            )

        # Under tf.distribute every replica writes the same all-reduced
        # values, so the first replica's write is the one kept.
        def state(name, dtype, shape=(), initializer="zeros"):
            return self.add_weight(
                shape=shape,
                dtype=dtype,
                initializer=initializer,
                trainable=False,
                aggregation="only_first_replica",
                name=name,
            )

        self._accum_steps = state("accum_steps", "int32", initializer="ones")
        self._window_batches = state("window_batches", "int32")
        self._window_all = state("window_rows", "float32")
        self._window_masked = state("window_masked_rows", "float32")
        if self.skip_masked:
            self._last_masked_ratio = state("last_masked_ratio", "float32")
        self._accumulators = [
            state(f"grad_accumulator_{i}", v.dtype, shape=v.shape)
            for i, v in enumerate(self.inner_model.trainable_variables)
        ]
        self._state_created = True

    def call(self, inputs, training=None):
        if self.sample_skipper is not None and isinstance(inputs, dict):
            inputs = {k: v for k, v in inputs.items() if k != self.sample_skipper.id_key}
        return self.inner_model(inputs, training=training)

    @property
    def _drops_samples(self):
        """Whether a train step may train on fewer samples than it draws
        (`skip_masked` or a `sample_skipper`)."""
        return self.skip_masked or self.sample_skipper is not None

    @property
    def accumulation_steps(self):
        """The current number of micro-batches per optimizer update (int)."""
        return int(ops.convert_to_numpy(self._accum_steps))

    @accumulation_steps.setter
    def accumulation_steps(self, value):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= self.max_steps:
            raise ValueError(
                f"Expected `accumulation_steps` to be an int in [1, {self.max_steps}] "
                f"(max_steps). Received: {value!r}"
            )
        self._accum_steps.assign(value)

    @property
    def preprocessor(self):
        """The wrapped keras-hub task's preprocessor, or `None`."""
        return getattr(self.inner_model, "preprocessor", None)

    # ------------------------------------------------------------- training

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        # Called by train and test steps on every backend (inside JAX's
        # stateless scope too), so `masked_ratio` is right in both. A train
        # step hands over the counts it already has (`_step_counts`) instead
        # of running the loss once more.
        counts = self._step_counts
        if counts is None and isinstance(self.loss, keras.losses.Loss):
            counts = count_masked_rows(self.loss, y, y_pred, sample_weight)
        if counts is not None:
            self.masked_ratio_tracker.update_counts(*counts)
        return super().compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _compute_metrics_with_counts(self, counts, compute):
        """Runs `compute()` with the train step's `(masked, counted)`."""
        self._step_counts = counts
        try:
            return compute()
        finally:
            self._step_counts = None

    def train_step(self, *args):
        # Runs once per trace, not per step.
        if not isinstance(self.loss, keras.losses.Loss):
            raise ValueError(
                "ASSpeed counts masked rows with the loss's per-row values, so "
                "compile it with one keras.losses.Loss instance, such as "
                "keras_as_softmax.ASSoftmaxLoss(0.3). "
                f"Received: loss={self.loss!r}"
            )
        if keras.backend.backend() == "jax":
            from keras_as_softmax import _as_speed_jax

            return _as_speed_jax.train_step(self, *args)
        from keras_as_softmax import _as_speed_tensorflow

        if self.sample_skipper is not None and self.jit_compile:
            raise ValueError(
                "ASSpeed(sample_skipper=...) trains each step on the samples "
                "its skipper keeps, a batch of data-dependent size that XLA "
                "cannot compile. Compile with jit_compile=False. "
                f"Received: jit_compile={self.jit_compile!r}"
            )
        if self.skip_masked and self.jit_compile and not _has_accelerator():
            warnings.warn(
                "ASSpeed(skip_masked=True) with jit_compile=True on CPU: XLA "
                "runs the loop around the model's passes several times "
                "slower than TensorFlow's own kernels. Compile with "
                "jit_compile=False.",
                stacklevel=2,
            )
        return _as_speed_tensorflow.train_step(self, *args)

    def test_step(self, *args):
        logs = super().test_step(*args)
        if keras.backend.backend() == "tensorflow":
            from keras_as_softmax import _as_speed_tensorflow

            logs = _as_speed_tensorflow.multi_worker_logs(logs)
        return logs

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Called by Keras's TensorFlow trainer only.
        from keras_as_softmax import _as_speed_tensorflow

        if iterator is not None and _as_speed_tensorflow.is_multi_worker(self.distribute_strategy):
            data_batch = _as_speed_tensorflow.local_batch(iterator, self.distribute_strategy)
            iterator = None
        return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    # ------------------------------------------------------ keras-hub inputs

    def _with_preprocessor(self, x, y, sample_weight, batch_size):
        preprocessor = self.preprocessor
        if preprocessor is None or x is None:
            return x, y, sample_weight
        import tensorflow as tf

        if not isinstance(x, tf.data.Dataset):
            data = keras.utils.pack_x_y_sample_weight(x, y, sample_weight)
            x = tf.data.Dataset.from_tensor_slices(data).batch(batch_size or 32)
        x = x.map(preprocessor, num_parallel_calls=tf.data.AUTOTUNE)
        return x.prefetch(tf.data.AUTOTUNE), None, None

    def fit(self, x=None, y=None, batch_size=None, sample_weight=None, validation_data=None, **kwargs):
        x, y, sample_weight = self._with_preprocessor(x, y, sample_weight, batch_size)
        if validation_data is not None and self.preprocessor is not None:
            validation_data = self._with_preprocessor(
                *keras.utils.unpack_x_y_sample_weight(validation_data)
                if isinstance(validation_data, tuple)
                else (validation_data, None, None),
                batch_size,
            )[0]
        if self.preprocessor is not None:
            batch_size = None
        return super().fit(
            x=x,
            y=y,
            batch_size=batch_size,
            sample_weight=sample_weight,
            validation_data=validation_data,
            **kwargs,
        )

    def evaluate(self, x=None, y=None, batch_size=None, sample_weight=None, **kwargs):
        x, y, sample_weight = self._with_preprocessor(x, y, sample_weight, batch_size)
        if self.preprocessor is not None:
            batch_size = None
        return super().evaluate(
            x=x, y=y, batch_size=batch_size, sample_weight=sample_weight, **kwargs
        )

    def predict(self, x, batch_size=None, **kwargs):
        if self.preprocessor is not None:
            x = self._with_preprocessor(x, None, None, batch_size)[0]
            batch_size = None
        return super().predict(x, batch_size=batch_size, **kwargs)

    # ---------------------------------------------------------- serialization

    def get_config(self):
        config = super().get_config()
        config.update(
            model=keras.saving.serialize_keras_object(self.inner_model),
            lam=self.lam,
            max_steps=self.max_steps,
            skip_masked=self.skip_masked,
        )
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["model"] = keras.saving.deserialize_keras_object(
            config["model"], custom_objects=custom_objects
        )
        return cls(**config)
