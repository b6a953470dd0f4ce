"""One fine-tuning run of one method, measured.

`run` trains a fresh classifier on a `PreparedData`, fed as a seeded,
shuffled `tf.data` pipeline. Each run records the masked ratio of every
training batch (paper Fig. 1; for softmax the ratio an
`ASSoftmaxLoss(delta)` *would* mask on the same batches), periodic
validation loss and metric (paper Table 4), training wall-clock per epoch
(XLA compilation excluded and reported separately; on JAX also the
programs compiled after the first step), and the test set's
probability margins `p_target - max p_other` (paper Fig. 4).
"""

import dataclasses
import time

import keras
import numpy as np
from keras import ops

from as_softmax_lab.data import make_dataset
from as_softmax_lab.methods import DEFAULT_DELTA
from as_softmax_lab.methods import IGNORE_CLASS
from as_softmax_lab.methods import get_method
from as_softmax_lab.methods import make_loss
from as_softmax_lab.methods import wrap_model
from as_softmax_lab.models import build_classifier
from as_softmax_lab.task_metrics import probability_margins
from as_softmax_lab.task_metrics import task_metric
from keras_as_softmax import ASSpeed
from keras_as_softmax.callbacks import DeltaWarmup
from keras_as_softmax.losses import ASSoftmaxLoss
from keras_as_softmax.losses import MultiLabelASSoftmaxLoss
from keras_as_softmax.metrics import MaskedRatio


class _CompileClock:
    """Seconds JAX spends tracing, lowering and compiling, by wall time.

    A filtered JAX step compiles its scoring program when it first scores,
    in the middle of training; `run` leaves that out of the training time
    as it leaves out the first step's. JAX reports each phase's duration
    when it ends (`jax.monitoring`); nested phases (a `jit` traced inside
    another's trace) overlap, so only their union counts. Counts nothing
    on the other backends, where compilation happens in the first step.
    """

    _intervals = None  # (start, end) in `time.perf_counter` seconds

    @classmethod
    def start(cls):
        if cls._intervals is not None or keras.backend.backend() != "jax":
            return
        import jax

        cls._intervals = []

        def listen(event, seconds, **kwargs):
            if event.startswith("/jax/core/compile/"):
                end = time.perf_counter()
                cls._intervals.append((end - seconds, end))

        jax.monitoring.register_event_duration_secs_listener(listen)

    @classmethod
    def seconds(cls, start, end):
        """Compiling seconds within `[start, end]`."""
        if not cls._intervals:
            return 0.0
        # Steps are timed in order: what ended before this one is done.
        cls._intervals = [i for i in cls._intervals if i[1] > start]
        total, reached = 0.0, start
        for a, b in sorted(cls._intervals):
            a, b = max(a, reached), min(b, end)
            if b > a:
                total += b - a
                reached = b
        return total


class _Recorder(keras.callbacks.Callback):
    """Per-batch masked ratio and timing, periodic validation.

    With `patience`, stops training once the validation metric has not
    improved for `patience` epochs. With `evaluate_test`, each evaluation
    also scores the test set (`test_loss`, `test_metric`), so that any
    stopping rule can be replayed on the evaluations afterwards.
    """

    def __init__(
        self, tracker, evaluate, eval_every, patience=None, evaluate_test=None
    ):
        super().__init__()
        self.tracker = tracker
        self.evaluate = evaluate
        self.eval_every = eval_every
        self.patience = patience
        self.evaluate_test = evaluate_test
        self.stopped_epoch = None
        self._best_metric, self._best_epoch = -np.inf, -1
        self.step = 0
        self.masked_ratio, self.accum_steps = [], []
        self.evals, self.epoch_times, self.epoch_batches = [], [], []
        self.trained_fraction = []
        self.step_times = []  # (epoch, batch, seconds), the first step left out
        self.compile_time = 0.0
        self.train_time = 0.0  # cumulative, compile and evaluation excluded
        self._prev = (0.0, 0.0)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch_batches.append(0)
        self._prev = (0.0, 0.0)
        self._epoch_time = 0.0
        self._t = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        # On JAX, `fit` keeps the variables' values in its own state during
        # an epoch; reading `self.model` writes them back to the variables.
        model = self.model
        counts = ops.convert_to_numpy(self.tracker.counts).tolist()
        masked, counted = counts[:2]  # `MaskedRatio`, or ASSpeed's shares
        elapsed = now - self._t
        if self.step == 0:
            self.compile_time = elapsed
        else:
            compiling = _CompileClock.seconds(self._t, now)
            self.compile_time += compiling
            elapsed -= compiling
            self._epoch_time += elapsed
            self.train_time += elapsed
            self.step_times.append((len(self.epoch_batches), batch, elapsed))
        self.step += 1
        self.epoch_batches[-1] += 1
        dm, dc = masked - self._prev[0], counted - self._prev[1]
        self._prev = (masked, counted)
        self.masked_ratio.append(dm / dc if dc > 0 else float("nan"))
        if isinstance(model, ASSpeed):
            self.accum_steps.append(model.accumulation_steps)
        if self.eval_every and self.step % self.eval_every == 0:
            self._evaluate(None)
        self._t = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_times.append(self._epoch_time)
        if logs and "trained_fraction" in logs:
            self.trained_fraction.append(float(logs["trained_fraction"]))
        if not self.evals or self.evals[-1]["step"] != self.step:
            self._evaluate(epoch)
        if self.evals[-1]["epoch"] is None:
            self.evals[-1]["epoch"] = epoch
        if self.patience is not None:
            best = max(e["val_metric"] for e in self.evals)
            if best > self._best_metric:
                self._best_metric, self._best_epoch = best, epoch
            elif epoch - self._best_epoch >= self.patience:
                self.stopped_epoch = epoch
                self.model.stop_training = True

    def _evaluate(self, epoch):
        loss, metric = self.evaluate(self.model)
        record = {
            "step": self.step,
            "epoch": epoch,
            "time": self.train_time,
            "seconds": self.train_time + self.compile_time,
            "val_loss": loss,
            "val_metric": metric,
        }
        if self.evaluate_test is not None:
            record["test_loss"], record["test_metric"] = self.evaluate_test(
                self.model
            )
        self.evals.append(record)


# -------------------------------------------------------------------- run


@dataclasses.dataclass
class RunResult:
    """What one `run` measured.

    Attributes:
        method, seed, task, metric_name, dataset: identify the run.
        epochs: number of epochs trained (fewer than asked for when
            `patience` stopped the run).
        steps_per_epoch: training batches per epoch.
        optimizer_updates: optimizer steps taken (fewer than batches under
            AS-Speed).
        compile_time: seconds of the first batch (tracing + XLA compile)
            and, on JAX, of the programs compiled in later steps.
        epoch_times: training seconds per epoch, compile and validation
            excluded.
        batches_per_epoch: training batches run in each epoch (the skipping
            methods drop samples inside a batch, not batches).
        masked_ratio: per training batch, the fraction of counted rows whose
            AS-Softmax loss is exactly 0 (for softmax: that an
            `ASSoftmaxLoss(delta)` would mask).
        accum_steps: per batch, `ASSpeed.accumulation_steps` (AS-Speed only).
        evals: list of dicts `step`, `epoch`, `time` (cumulative training
            seconds, compilation excluded), `seconds` (the same with
            compilation: the clock of time to target), `val_loss` (the
            method's own loss), `val_metric`.
        val_metric, val_loss: at the end of training.
        test_metric, test_loss: at the end of training.
        test_margins: `probability_margins` on the test set.
        trained_fraction: per epoch, the share of drawn samples that went
            through the training passes (the `"as_skip*"` methods).
        step_times: `(epoch, batch, seconds)` of every training step but
            the first (epochs counted from 1).
        model: the trained model (not printed).
        selected: with `run(..., select_test=True)`, a dict with keys
            `"best_val"` (the evaluation with the best validation metric)
            and `"min_val_loss"` (the one with the lowest validation loss,
            what `EarlyStopping(monitor="val_loss")` would keep), each a
            dict `eval` (index into `evals`), `val_metric`, `val_loss`,
            `test_metric`, `test_loss`; else `None`.
    """

    method: str
    seed: int
    task: str
    metric_name: str
    dataset: str
    epochs: int
    steps_per_epoch: int
    optimizer_updates: int
    compile_time: float
    epoch_times: list
    batches_per_epoch: list
    masked_ratio: list
    accum_steps: list
    evals: list
    val_metric: float
    val_loss: float
    test_metric: float
    test_loss: float
    test_margins: np.ndarray = dataclasses.field(repr=False)
    trained_fraction: list = dataclasses.field(default_factory=list)
    step_times: list = dataclasses.field(default_factory=list, repr=False)
    model: object = dataclasses.field(default=None, repr=False)
    selected: dict | None = None

    @property
    def train_time(self):
        """Total training seconds (compile and validation excluded)."""
        return float(sum(self.epoch_times))

    @property
    def time_per_epoch(self):
        return self.train_time / max(self.epochs, 1)

    @property
    def best_val_metric(self):
        return max(e["val_metric"] for e in self.evals)

    def time_to_reach(self, target):
        """Training seconds until a validation metric >= `target`, or `None`."""
        for e in self.evals:
            if e["val_metric"] >= target - 1e-12:
                return e["time"]
        return None


def _predict(model, x, batch_size):
    return model.predict(x, batch_size=batch_size, verbose=0)


def _loss_value(loss, y, logits):
    return float(
        ops.convert_to_numpy(
            loss(ops.convert_to_tensor(y), ops.convert_to_tensor(logits))
        )
    )


def run(
    method,
    data,
    backbone,
    seed=0,
    epochs=2,
    batch_size=32,
    learning_rate=1e-4,
    weight_decay=0.01,
    delta=None,
    lam=0.5,
    max_steps=5,
    revisit=0.5,
    filter_options=None,
    warmup_ratio=0.0,
    evals_per_epoch=1,
    eval_batch_size=128,
    jit_compile=None,
    verbose=1,
    keep_model=False,
    loss_kwargs=None,
    build_model=None,
    patience=None,
    select_test=False,
):
    """Fine-tunes one model with one method and measures it.

    Args:
        method: a `METHODS` or `BASELINE_METHODS` key, e.g. `"softmax"`,
            `"as_softmax"`, `"as_speed"`, `"sparsemax"`.
        data: a `PreparedData` (see `prepare_data`).
        backbone: a `Backbone` (each run starts from its initial weights);
            unused (may be `None`) when `build_model` is given.
        seed: seeds the head's initialisation, dropout and shuffling.
        epochs: training epochs (passes over `data.train`).
        batch_size: micro-batch size (AS-Speed accumulates several).
        learning_rate: AdamW's learning rate. Defaults to `1e-4`.
        weight_decay: AdamW's weight decay. Defaults to `0.01`.
        delta: AS-Softmax margin; defaults to `DEFAULT_DELTA[task]`. Also
            the margin of the masked ratio recorded for softmax.
        lam, max_steps: AS-Speed's lambda and cap `s` (Clinc: 0.5 / 5).
        revisit: for `"as_skip_stale"` and `"as_skip_hybrid"`, the
            probability that a sample masked at its last visit is trained
            on anyway. Defaults to `0.2`.
        filter_options: optional dict of further filter arguments
            (`anneal_fraction`, `warmup_epochs`, `max_skipped_fraction`,
            `min_masked_ratio`, ...; see `wrap_model`).
        warmup_ratio: if > 0, the AS methods train with `delta = 1` for
            this fraction of steps (`DeltaWarmup`).
        evals_per_epoch: validation passes per epoch (more points for the
            loss-vs-metric correlation). Defaults to `1`.
        eval_batch_size: batch size of validation/test prediction.
        jit_compile: defaults to `True` on TensorFlow, `"auto"` otherwise.
            (On CPU, XLA runs a filtered step's passes inside conditionals
            more slowly than a plain step: the demo and benchmarks pass
            `False` for every method, so that all run alike.)
        verbose: 1 shows Keras's progress bar, 0 nothing.
        keep_model: keep the trained model in the result.
        loss_kwargs: dict of hyper-parameters of a baseline method's loss
            (see `make_loss`). Defaults to the loss's own defaults.
        build_model: optional callable `(task, num_classes) -> keras.Model`
            returning logits, used instead of a BERT classifier on
            `backbone` (e.g. a small model trained from scratch).
        patience: if set, `epochs` is a maximum: training stops once the
            validation metric has not improved for `patience` epochs.
        select_test: also score the test set at every evaluation
            (`test_loss` and `test_metric` in `RunResult.evals`), and pick
            the evaluations with the best validation metric and the lowest
            validation loss (`RunResult.selected`).

    The validation (and test) loss is the method's loss with its final
    hyper-parameters: a separate instance, so `warmup_ratio` does not
    change the loss the evaluations are scored with.

    Returns:
        A `RunResult`.
    """
    method = get_method(method)
    task = data.task
    delta = DEFAULT_DELTA[task] if delta is None else delta
    if jit_compile is None:
        jit_compile = keras.backend.backend() == "tensorflow" or "auto"
    if patience is not None and (not isinstance(patience, int) or patience < 1):
        raise ValueError(
            f"Expected `patience` None or an int >= 1. Received: {patience!r}"
        )
    loss_kwargs = dict(loss_kwargs or {})
    keras.utils.set_random_seed(seed)
    if build_model is not None:
        model = build_model(task, data.num_classes)
    else:
        model = build_classifier(task, data.num_classes, backbone)
    loss = make_loss(method, task, delta, **loss_kwargs)
    eval_loss = make_loss(method, task, delta, **loss_kwargs)
    optimizer = keras.optimizers.AdamW(
        learning_rate=learning_rate, weight_decay=weight_decay
    )
    model = wrap_model(
        method,
        model,
        num_samples=len(data.train[1]),
        lam=lam,
        max_steps=max_steps,
        revisit=revisit,
        seed=seed,
        filter_options=filter_options,
    )
    if isinstance(model, ASSpeed):
        model.compile(optimizer=optimizer, loss=loss, jit_compile=jit_compile)
        tracker = model.shares_tracker
    else:
        if method.as_loss:
            tracker = MaskedRatio(loss)
        elif task == "multilabel":
            tracker = MaskedRatio(MultiLabelASSoftmaxLoss(delta))
        else:
            ignore = IGNORE_CLASS if task == "tokens" else None
            tracker = MaskedRatio(ASSoftmaxLoss(delta, ignore_class=ignore))
        model.compile(
            optimizer=optimizer,
            loss=loss,
            metrics=[tracker],
            jit_compile=jit_compile,
        )

    def evaluator(split):
        x, y = split

        def evaluate(m):
            logits = _predict(m, x, eval_batch_size)
            return _loss_value(eval_loss, y, logits), task_metric(
                task, y, logits, data.class_names
            )

        return evaluate

    n_train = len(data.train[1])
    steps_per_epoch = n_train // batch_size
    if steps_per_epoch < 1:
        raise ValueError(
            f"Need at least batch_size={batch_size} training examples. "
            f"Received: {n_train}"
        )
    eval_every = (
        max(1, steps_per_epoch // evals_per_epoch) if evals_per_epoch > 1 else 0
    )
    _CompileClock.start()
    recorder = _Recorder(
        tracker,
        evaluator(data.validation),
        eval_every,
        patience=patience,
        evaluate_test=evaluator(data.test) if select_test else None,
    )
    callbacks = [recorder]
    if warmup_ratio > 0 and method.as_loss:
        callbacks.append(DeltaWarmup(warmup_ratio=warmup_ratio))
    # One iterator for the whole fit (reshuffled every pass): a new
    # iterator per epoch stalled the first step of an epoch by up to tens
    # of seconds here, in every method alike.
    train_ds = make_dataset(
        data.train,
        batch_size,
        shuffle_seed=seed,
        drop_remainder=True,
        sample_ids=method.sample_ids,
    )
    model.fit(
        train_ds.repeat(),
        epochs=epochs,
        steps_per_epoch=steps_per_epoch,
        callbacks=callbacks,
        verbose=verbose,
        shuffle=False,
    )

    x_test, y_test = data.test
    test_logits = _predict(model, x_test, eval_batch_size)
    final = recorder.evals[-1]
    selected = None
    if select_test:
        evals = recorder.evals
        # Ties keep the earlier evaluation, as EarlyStopping does.
        picks = {
            "best_val": int(np.argmax([e["val_metric"] for e in evals])),
            "min_val_loss": int(np.argmin([e["val_loss"] for e in evals])),
        }
        selected = {
            key: {"eval": index, **evals[index]} for key, index in picks.items()
        }
    return RunResult(
        method=method.name,
        seed=seed,
        task=task,
        metric_name=data.metric_name,
        dataset=data.name,
        epochs=len(recorder.epoch_times),
        steps_per_epoch=steps_per_epoch,
        optimizer_updates=int(ops.convert_to_numpy(model.optimizer.iterations)),
        compile_time=recorder.compile_time,
        epoch_times=recorder.epoch_times,
        batches_per_epoch=recorder.epoch_batches,
        masked_ratio=recorder.masked_ratio,
        accum_steps=recorder.accum_steps,
        evals=recorder.evals,
        val_metric=final["val_metric"],
        val_loss=final["val_loss"],
        test_metric=task_metric(task, y_test, test_logits, data.class_names),
        test_loss=_loss_value(eval_loss, y_test, test_logits),
        test_margins=probability_margins(task, y_test, test_logits),
        trained_fraction=recorder.trained_fraction,
        step_times=recorder.step_times,
        model=model if keep_model else None,
        selected=selected,
    )
