"""The delta warm-up of AS-Softmax (paper appendix A.4) as a callback."""

import threading

import keras

from keras_as_softmax._validation import check_fraction
from keras_as_softmax._validation import check_int
from keras_as_softmax.losses._common import checked_delta
from keras_as_softmax.losses._common import hold_delta
from keras_as_softmax.losses._common import release_delta


def find_delta_variables(objects):
    """The `delta` variables of the losses among `objects`, and of the
    losses that metrics among them compute (`MaskedRatio(loss)`)."""
    found = []
    stack = list(objects)
    while stack:
        obj = stack.pop()
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(getattr(obj, "delta", None), keras.Variable):
            if not any(obj.delta is v for v in found):
                found.append(obj.delta)
        elif isinstance(getattr(obj, "loss", None), keras.losses.Loss):
            stack.append(obj.loss)
    return found


def check_deltas(objects):
    """Reads the `delta` variables among `objects` (`find_delta_variables`)
    once, before training: a loss checks its delta when made, and a value
    assigned since (`loss.delta.assign(...)`) is checked here."""
    for variable in find_delta_variables(objects):
        checked_delta(variable)


class DeltaWarmup(keras.callbacks.Callback):
    """Trains with `delta = 1` (plain softmax) for the first steps.

    Early in training the classifier is weak and AS-Softmax could drop
    classes that still matter; the paper keeps `delta = 1` for the first
    fraction `r` of training steps (`r = 0.15` on Clinc_oos, `0.25` on
    CoNLL 2003) and then switches to the chosen delta. This callback does
    that to every AS-Softmax loss the model was compiled with (any loss
    with a `delta` variable), or to the `losses` you pass. At the end of
    training the chosen delta is restored even if the switch never came;
    meanwhile a loss's config, and so a `.keras` checkpoint, keeps it.

    Steps are the batches `fit` runs (micro-batches under
    `keras_as_softmax.ASSpeed`), counted from epoch 0 of each `fit` call:
    a `fit` that resumes at `initial_epoch=k` (or through
    `BackupAndRestore`) starts at step `k * steps_per_epoch`, so a warm-up
    that ended before does not run again. Where `fit` does not know the
    steps per epoch, they count from the `fit` call's first batch.
    With `steps_per_execution=N` delta changes between groups of N
    batches: the warm-up ends with the first group that starts at or
    after the switch.
    On JAX, where a compiled step holds delta as a constant, each change
    of delta (at the start, the switch and the end) traces the train and
    test steps again; TensorFlow and PyTorch read the variable at every
    step. The callback reads no step's logs: on JAX and PyTorch, Keras
    still hands them to the batch-end callbacks from a thread of its own,
    so that the training loop does not wait for each step to finish.

    Args:
        warmup_ratio: fraction `r` in [0, 1] of the training steps that use
            `warmup_delta`. Defaults to `0.15`.
        warmup_delta: delta during the warm-up. Defaults to `1.0`.
        total_steps: number of training steps of the `fit` call, from epoch
            0. Defaults to `steps_per_epoch * epochs` as `fit` reports them;
            pass it when the dataset's length is unknown.
        losses: optional list of losses (or metrics) to control. Defaults to
            the model's compiled loss.

    Example:

    ```python
    loss = keras_as_softmax.ASSoftmaxLoss(delta=0.3)
    model.compile(optimizer="adam", loss=loss)
    model.fit(x, y, epochs=10,
              callbacks=[keras_as_softmax.DeltaWarmup(warmup_ratio=0.15)])
    ```
    """

    # Keras may call `on_train_batch_end` from threads of its own, which
    # it does only if every callback allows it (see the docstring).
    async_safe = True

    def __init__(
        self, warmup_ratio=0.15, warmup_delta=1.0, total_steps=None, losses=None
    ):
        super().__init__()
        self.warmup_ratio = check_fraction(warmup_ratio, "warmup_ratio")
        self.warmup_delta = check_fraction(warmup_delta, "warmup_delta")
        if total_steps is not None:
            total_steps = check_int(total_steps, "total_steps")
        self.total_steps = total_steps
        if losses is not None and not isinstance(losses, (list, tuple)):
            raise ValueError(
                "Expected `losses` to be a list of losses. "
                f"Received: losses={losses!r}"
            )
        self.losses = losses
        self._variables = []

    def on_train_begin(self, logs=None):
        sources = self.losses if self.losses is not None else [self.model.loss]
        check_deltas(sources)
        self._variables = find_delta_variables(sources)
        if not self._variables:
            raise ValueError(
                "DeltaWarmup found no loss with a `delta` variable. Compile "
                "the model with keras_as_softmax.ASSoftmaxLoss (or "
                "MultiLabelASSoftmaxLoss), or pass `losses=[...]`. "
                + (
                    f"Received: model.loss={self.model.loss!r}"
                    if self.losses is None
                    else f"Received: losses={self.losses!r}"
                )
            )
        total = self.total_steps
        if total is None:
            steps, epochs = self.params.get("steps"), self.params.get("epochs")
            if steps is None or epochs is None:
                raise ValueError(
                    "DeltaWarmup needs the number of training steps, but fit "
                    "does not know the dataset's length. Pass "
                    "`total_steps=...`."
                )
            total = steps * epochs
        self._switch_step = int(round(self.warmup_ratio * total))
        self._step = 0  # this `fit`'s step count, from epoch 0 if known
        self._last_batches = {}
        self._warm = None  # decided at the first epoch, which may resume

    def on_epoch_begin(self, epoch, logs=None):
        steps = self.params.get("steps")
        self._epoch_start = self._step if steps is None else epoch * steps
        if self._warm is None:
            self._warm = self._epoch_start < self._switch_step
            if self._warm:
                self._assign(hold_delta, self.warmup_delta)
            else:  # held still by a `fit` that stopped on an error
                self._assign(release_delta)

    def on_train_batch_begin(self, batch, logs=None):
        # `batch` is the epoch's index of the group's first batch.
        if self._warm and self._epoch_start + batch >= self._switch_step:
            self._end_warmup()

    def on_train_batch_end(self, batch, logs=None):
        # `batch` is the epoch's index of the group's last batch. Each of
        # Keras's threads takes its calls in order, and they may run in
        # parallel: each keeps its own last one (an atomic assignment).
        self._last_batches[threading.get_ident()] = batch

    def on_epoch_end(self, epoch, logs=None):
        # Keras has made every batch-end call of the epoch by now.
        if self._last_batches:
            last = max(self._last_batches.values())
            self._step = self._epoch_start + last + 1
        self._last_batches = {}

    def on_train_end(self, logs=None):
        if self._warm:
            self._end_warmup()

    def _end_warmup(self):
        self._assign(release_delta)
        self._warm = False

    def _assign(self, assign, *args):
        changed = [assign(variable, *args) for variable in self._variables]
        if keras.backend.backend() == "jax" and any(changed):
            # A compiled JAX step holds delta as a constant: trace the train
            # and test steps again, for training, validation and later fits.
            self.model.make_train_function(force=True)
            self.model.make_test_function(force=True)
