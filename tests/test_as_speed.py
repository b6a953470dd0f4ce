"""AS-Speed wrapper: runs on the tensorflow, jax and torch backends in CI."""

import os
import threading
import warnings

import keras
import numpy as np
import pytest
from keras import ops

import keras_as_softmax as kas
from keras_as_softmax.training.accumulation import next_accumulation_steps
from tests.backend_utils import BACKEND
from tests.backend_utils import MaskedTagger
from tests.backend_utils import run_json_script

JIT = BACKEND in ("tensorflow", "jax")  # XLA; PyTorch runs eagerly.


def make_model(num_classes=4, batch_norm=False, seed=1):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    if batch_norm:
        hidden = keras.layers.BatchNormalization(momentum=0.5)(hidden)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(hidden))


def data(n=64, num_classes=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 6)).astype("float32")
    return x, rng.integers(0, num_classes, n)


def max_weight_diff(a, b):
    return max(
        float(np.abs(u - v).max())
        for u, v in zip(a.get_weights(), b.get_weights())
    )


class StepLog(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.steps, self.ratios = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append(int(logs["accum_steps"]))
        self.ratios.append(float(logs["masked_ratio"]))


# --------------------------------------------------------------- the rule


def simulate(ratios, lam, max_steps, batches_per_window_counts):
    """Pure-Python eq. 19 with the three restrictions, one window at a time."""
    steps, out = 1, []
    for n_all, n_masked in batches_per_window_counts:
        proposal = max(
            1, int(np.floor(lam * n_all / max(n_all - n_masked, 1e-9) + 0.5))
        )
        if n_all > 0 and proposal > steps and steps < max_steps:
            steps += 1
        out.append(steps)
    return out


def test_rule_follows_eq19_with_restrictions():
    # (N_all, N_masked) per window: the proposal jumps, stalls and falls.
    windows = [
        (32, 0),
        (32, 16),
        (32, 30),
        (32, 31),
        (32, 0),
        (0, 0),
        (32, 32),
        (32, 32),
    ]
    steps = ops.convert_to_tensor(1, "int32")
    got = []
    for n_all, n_masked in windows:
        steps = next_accumulation_steps(
            steps, n_all, n_masked, lam=0.5, max_steps=5
        )
        got.append(int(ops.convert_to_numpy(steps)))
    # lam * ratio: 0.5 (->1), 1, 8, 16, 0.5, -, inf, inf: grow by one,
    # never shrink, cap 5.
    assert got == [1, 1, 2, 3, 3, 3, 4, 5]
    assert got == simulate(None, 0.5, 5, windows)
    assert (
        int(ops.convert_to_numpy(next_accumulation_steps(1, 10, 0, 1.5, 4)))
        == 2
    )


class ScriptedLoss(keras.losses.Loss):
    """Loss 0 ("masked") on rows whose second label column is 1."""

    def call(self, y_true, y_pred):
        flag = y_true[:, 1]
        ce = keras.losses.sparse_categorical_crossentropy(
            y_true[:, 0], y_pred, from_logits=True
        )
        return ops.where(flag > 0, 0.0 * ce, ce)


def test_steps_follow_the_rule_in_training():
    # Each micro-batch of 8 rows carries a scripted number of masked rows.
    masked_per_batch = [
        0,
        4,
        6,
        7,
        7,
        8,
        8,
        8,
        8,
        8,
        8,
        8,
        8,
        8,
        8,
        8,
        8,
        8,
        8,
        8,
    ]
    x, labels = data(8 * len(masked_per_batch))
    flags = np.zeros(len(x))
    for b, m in enumerate(masked_per_batch):
        flags[8 * b : 8 * b + m] = 1
    y = np.stack([labels, flags], axis=1).astype("float32")
    model = kas.ASSpeed(make_model(), lam=1.0, max_steps=4)
    model.compile(optimizer="sgd", loss=ScriptedLoss(), jit_compile=JIT)
    log = StepLog()
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[log])

    expected, steps, window = [], 1, []
    for m in masked_per_batch:
        window.append(m)
        if len(window) >= steps:
            n_all, n_masked = 8 * len(window), sum(window)
            steps = (
                simulate(None, 1.0, 4, [(n_all, n_masked)])[0]
                if steps == 1
                else (
                    steps + 1
                    if steps < 4
                    and np.floor(n_all / max(n_all - n_masked, 1e-9) + 0.5)
                    > steps
                    else steps
                )
            )
            window = []
        expected.append(steps)
    assert log.steps == expected
    assert model.accumulation_steps == expected[-1]
    np.testing.assert_allclose(
        log.ratios[-1], sum(masked_per_batch) / len(x), rtol=1e-6
    )


# ------------------------------------------------------------ equivalence


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("k", [2, 4])
def test_k_micro_batches_equal_one_big_batch(optimizer, k):
    x, y = data(64)
    big = make_model()
    start = big.get_weights()
    big.compile(
        optimizer=keras.optimizers.get(optimizer), loss=kas.ASSoftmaxLoss(0.3)
    )
    big.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)

    inner = make_model()
    inner.set_weights(start)
    wrapped = kas.ASSpeed(inner, lam=0.5, max_steps=k)
    wrapped.accumulation_steps = k
    wrapped.compile(
        optimizer=keras.optimizers.get(optimizer),
        loss=kas.ASSoftmaxLoss(0.3),
        jit_compile=JIT,
    )
    wrapped.fit(x, y, batch_size=16 // k, epochs=2, shuffle=False, verbose=0)
    assert max_weight_diff(big, inner) < 1e-5
    # The optimizer counts updates (8), not micro-batches (8 * k).
    assert int(ops.convert_to_numpy(wrapped.optimizer.iterations)) == 8


def test_learning_rate_schedule_counts_updates():
    # lr 0.1 for updates 0-1, then 0: a schedule that counted micro-batches
    # would stop learning after the first window.
    def schedule():
        return keras.optimizers.schedules.PiecewiseConstantDecay(
            [1], [0.1, 0.0]
        )

    x, y = data(48)
    big = make_model()
    start = big.get_weights()
    big.compile(
        optimizer=keras.optimizers.SGD(schedule()), loss=kas.ASSoftmaxLoss(1.0)
    )
    big.fit(x, y, batch_size=12, shuffle=False, verbose=0)

    inner = make_model()
    inner.set_weights(start)
    wrapped = kas.ASSpeed(inner, lam=0.5, max_steps=3)
    wrapped.accumulation_steps = 3
    wrapped.compile(
        optimizer=keras.optimizers.SGD(schedule()),
        loss=kas.ASSoftmaxLoss(1.0),
        jit_compile=JIT,
    )
    wrapped.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    assert max_weight_diff(big, inner) < 1e-6
    assert max_weight_diff_arrays(start, inner.get_weights()) > 1e-3


@pytest.mark.skipif(
    not hasattr(keras.optimizers, "MultiOptimizer"), reason="Keras 3.15+"
)
def test_learning_rate_callbacks_set_each_rate_of_a_multi_optimizer():
    # Keras's callbacks set each sub-optimizer's rate through `optimizers`.
    def multi():
        optimizers = keras.optimizers
        return optimizers.MultiOptimizer(
            optimizers.OptimizerMap(
                optimizers.SGD(0.1), {".*dense/.*": optimizers.SGD(0.2)}
            )
        )

    x, y = data()
    callbacks = [
        keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate / 2),
        keras.callbacks.ReduceLROnPlateau("loss", factor=0.5, patience=0),
    ]
    model = kas.ASSpeed(make_model())
    model.compile(optimizer=multi(), loss=kas.ASSoftmaxLoss(), jit_compile=JIT)
    logs = model.fit(x, y, epochs=2, callbacks=callbacks, verbose=0).history
    rates = sorted(
        float(ops.convert_to_numpy(o.learning_rate))
        for o in model.optimizer.optimizers
    )
    assert rates[0] < 0.1 / 4 + 1e-7 and rates[1] < 0.2 / 4 + 1e-7
    assert sum(k.startswith("learning_rate_") for k in logs) == 2


def max_weight_diff_arrays(a, b):
    return max(float(np.abs(u - v).max()) for u, v in zip(a, b))


@pytest.mark.skipif(
    BACKEND == "jax", reason="a compiled JAX step runs no Python per branch"
)
def test_optimizer_update_is_not_run_between_window_ends():
    calls = []

    class CountingSGD(keras.optimizers.SGD):
        def update_step(self, gradient, variable, learning_rate):
            calls.append(1)
            return super().update_step(gradient, variable, learning_rate)

    x, y = data(32)
    inner = make_model()
    wrapped = kas.ASSpeed(inner, lam=0.5, max_steps=4)
    wrapped.accumulation_steps = 4
    wrapped.compile(
        optimizer=CountingSGD(), loss=kas.ASSoftmaxLoss(), run_eagerly=True
    )
    wrapped.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    # 8 micro-batches, 2 updates, 4 variables per update.
    assert len(calls) == 2 * len(inner.trainable_variables)


# ----------------------------------------------------------- persistence


def test_resume_mid_window_with_backup_and_restore(tmp_path):
    # 5 micro-batches per epoch, 2 per window: every epoch ends mid-window.
    x, y = data(20)

    def fresh():
        wrapped = kas.ASSpeed(make_model(), lam=0.5, max_steps=2)
        wrapped.accumulation_steps = 2
        wrapped.compile(
            optimizer="adam", loss=kas.ASSoftmaxLoss(0.3), jit_compile=JIT
        )
        return wrapped

    reference = fresh()
    reference.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0)

    class Interrupt(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if self.model.history_epoch == 1 and batch == 3:
                raise RuntimeError("interrupted")

        def on_epoch_begin(self, epoch, logs=None):
            self.model.history_epoch = epoch

    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    resumed = fresh()
    with pytest.raises(RuntimeError, match="interrupted"):
        resumed.fit(
            x,
            y,
            batch_size=4,
            epochs=3,
            shuffle=False,
            verbose=0,
            callbacks=[backup, Interrupt()],
        )
    resumed = fresh()  # a new process would start from scratch like this
    resumed.fit(
        x,
        y,
        batch_size=4,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[backup],
    )
    assert max_weight_diff(reference, resumed) < 1e-6
    assert resumed.accumulation_steps == reference.accumulation_steps


@pytest.mark.parametrize("sample_filter", [None, "skip_masked"])
def test_callbacks_read_the_current_weights_mid_epoch(sample_filter):
    # On JAX, a callback that touches `self.model` syncs the step's state
    # (`_jax_state`) back into the variables: it sees the weights as they
    # are, which change only when a window of 2 micro-batches ends.
    x, y = data(40)

    def fresh():
        wrapped = kas.ASSpeed(
            make_model(),
            lam=0.5,
            max_steps=2,
            sample_filter=sample_filter and kas.filters.SkipMasked(),
        )
        wrapped.accumulation_steps = 2
        wrapped.compile(
            optimizer="adam", loss=kas.ASSoftmaxLoss(0.3), jit_compile=JIT
        )
        return wrapped

    class ReadWeights(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seen = []

        def on_train_batch_end(self, batch, logs=None):
            self.seen.append(self.model.inner_model.get_weights())

    settings = dict(batch_size=4, epochs=2, shuffle=False, verbose=0)
    reference, reader, read = fresh(), fresh(), ReadWeights()
    reference.fit(x, y, **settings)
    reader.fit(x, y, callbacks=[read], **settings)
    assert max_weight_diff(reference, reader) == 0.0
    final = reader.inner_model.get_weights()
    assert all(np.array_equal(a, b) for a, b in zip(read.seen[-1], final))
    changed = [
        not all(np.array_equal(a, b) for a, b in zip(before, after))
        for before, after in zip(read.seen, read.seen[1:])
    ]
    # The second, fourth, ... of the 20 batches end a window.
    assert changed[0] and not any(changed[1::2])


def test_keras_file_keeps_wrapper_and_counters(tmp_path):
    x, y = data(40)
    wrapped = kas.ASSpeed(make_model(), lam=3.0, max_steps=3, name="as_speed")
    loss = kas.ASSoftmaxLoss(0.3)
    wrapped.compile(
        optimizer="adam", loss=loss, metrics=["accuracy"], jit_compile=JIT
    )
    wrapped.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert wrapped.accumulation_steps == 3
    path = str(tmp_path / "wrapped.keras")
    wrapped.save(path)

    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, kas.ASSpeed)
    assert (loaded.lam, loaded.max_steps, loaded.accumulation_steps) == (
        3.0,
        3,
        3,
    )
    for a, b in zip(wrapped.weights, loaded.weights):
        np.testing.assert_array_equal(
            ops.convert_to_numpy(a), ops.convert_to_numpy(b)
        )
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0),
        wrapped.predict(x, verbose=0),
        rtol=1e-5,
        atol=1e-6,
    )
    before = wrapped.evaluate(x, y, verbose=0, return_dict=True)
    after = loaded.evaluate(x, y, verbose=0, return_dict=True)
    np.testing.assert_allclose(after["loss"], before["loss"], rtol=1e-6)
    loaded.fit(x, y, batch_size=4, epochs=1, verbose=0)  # keeps training


@pytest.mark.skipif(
    BACKEND != "jax",
    reason="Keras's TensorFlow trainer keeps the steps_per_execution it was "
    "built with (a plain model then skips batches too); torch takes 1 only",
)
def test_steps_per_execution_set_between_fits_trains_every_batch():
    """`steps_per_execution` is a plain attribute that Keras's JAX loop
    reads at every dispatch; set between two fits without compiling again,
    the groups follow it (a scan over 4 where it was 2), and every batch
    of the epoch trains once."""
    x, y = data(13 * 8)
    seen = []

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 13

        def __getitem__(self, i):
            seen.append(i)
            return x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8]

    wrapped = kas.ASSpeed(make_model(), max_steps=1)
    wrapped.compile(
        optimizer="sgd",
        loss=kas.ASSoftmaxLoss(0.3),
        jit_compile=JIT,
        steps_per_execution=2,
    )
    wrapped.fit(Batches(), epochs=1, shuffle=False, verbose=0)
    wrapped.steps_per_execution = 4
    seen.clear()
    updates = int(ops.convert_to_numpy(wrapped.optimizer.iterations))
    wrapped.fit(Batches(), epochs=1, shuffle=False, verbose=0)
    assert sorted(set(seen)) == list(range(13))
    # One batch a window (`max_steps=1`): one update a batch.
    updates = int(ops.convert_to_numpy(wrapped.optimizer.iterations)) - updates
    assert updates == 13


@pytest.mark.parametrize("sample_filter", [None, "skip_masked"])
def test_training_outside_its_own_fit_warns_once(sample_filter):
    """Nested in another model, an `ASSpeed` trains as its inner model
    (Keras runs the outer model's step): that fit warns, once. Its own
    `fit`, `evaluate` and `predict`, with or without a filter, do not."""
    import warnings

    x, y = data(32)
    wrapped = kas.ASSpeed(
        make_model(),
        sample_filter=sample_filter and kas.filters.SkipMasked(0.0),
    )
    wrapped.compile(
        optimizer="sgd", loss=kas.ASSoftmaxLoss(0.3), jit_compile=JIT
    )
    inputs = keras.Input((6,))
    outer = keras.Model(inputs, wrapped(inputs))
    outer.compile(optimizer="sgd", loss=kas.ASSoftmaxLoss(0.3), jit_compile=JIT)

    def caught(run):
        with warnings.catch_warnings(record=True) as records:
            warnings.simplefilter("always")
            run()
        return [r for r in records if "outside its own" in str(r.message)]

    def own():
        wrapped.fit(x, y, batch_size=8, epochs=2, verbose=0)
        wrapped.evaluate(x, y, verbose=0)
        wrapped.predict(x, verbose=0)

    assert caught(own) == []
    nested = caught(lambda: outer.fit(x, y, batch_size=8, epochs=2, verbose=0))
    assert len(nested) == 1
    assert "without accumulation or sample filters" in str(nested[0].message)


@pytest.mark.parametrize("method", ["train_step", "compute_loss"])
def test_a_model_with_its_own_step_is_refused_by_name(method):
    """`ASSpeed` runs its own steps: a model's own `train_step` or
    `compute_loss` (an extra loss term) would silently not run."""

    class Custom(keras.Model):
        pass

    setattr(Custom, method, lambda self, *args, **kwargs: None)
    inputs = keras.Input((6,))
    model = Custom(inputs, keras.layers.Dense(4)(inputs))
    with pytest.raises(ValueError, match=f"Custom overrides {method}$"):
        kas.ASSpeed(model)


def test_subclassed_model():
    class Classifier(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden = keras.layers.Dense(8, activation="relu")
            self.out = keras.layers.Dense(4)

        def call(self, x):
            return self.out(self.hidden(x))

    x, y = data(32)
    wrapped = kas.ASSpeed(Classifier(), lam=0.5, max_steps=2)
    wrapped.compile(optimizer="adam", loss=kas.ASSoftmaxLoss(), jit_compile=JIT)
    history = wrapped.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert set(history.history) >= {"loss", "masked_ratio", "accum_steps"}
    assert wrapped.predict(x, verbose=0).shape == (32, 4)
    assert not hasattr(wrapped, "output_names")  # as on the inner model
    # With a filter, whose queues the first fit() adds once ASSpeed is
    # built; here built by a predict() before it.
    always = kas.filters.SkipMasked(warmup_epochs=0, min_masked_ratio=0.0)
    wrapped = kas.ASSpeed(Classifier(), sample_filter=always)
    wrapped.predict(x, verbose=0)
    wrapped.compile(optimizer="adam", loss=kas.ASSoftmaxLoss(), jit_compile=JIT)
    history = wrapped.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert history.history["scored_fraction"][-1] == 1.0
    # Built by `build(input_shape)`, which Keras allows without weights
    # when the class has no `build` of its own: weights at the first call.
    for sample_filter in (None, always):
        unweighted = Classifier()
        unweighted.build((None, 6))
        assert unweighted.built and not unweighted.weights
        wrapped = kas.ASSpeed(unweighted, sample_filter=sample_filter)
        wrapped.compile(
            optimizer="adam", loss=kas.ASSoftmaxLoss(), jit_compile=JIT
        )
        history = wrapped.fit(x, y, batch_size=8, epochs=2, verbose=0)
        assert len(unweighted.trainable_weights) == 4
        assert np.isfinite(history.history["loss"][-1])


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_trains_without_nan(policy):
    keras.config.set_dtype_policy(policy)
    x, y = data(64)
    wrapped = kas.ASSpeed(make_model(), lam=1.5, max_steps=3)
    wrapped.compile(
        optimizer="adam", loss=kas.ASSoftmaxLoss(0.3), jit_compile=JIT
    )
    if policy == "mixed_float16":
        assert isinstance(
            wrapped.optimizer.inner_optimizer,
            keras.optimizers.LossScaleOptimizer,
        )
    history = wrapped.fit(x, y, batch_size=8, epochs=3, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert all(np.all(np.isfinite(w)) for w in wrapped.get_weights())
    assert wrapped.accumulation_steps >= 2


@pytest.mark.parametrize("wrap", [False, True], ids=["keras", "as_speed"])
def test_an_accumulating_optimizer_keeps_one_window_under_mixed_float16(wrap):
    """Keras's `compile` wraps the optimizer with a `LossScaleOptimizer`:
    `ASSpeed` moves the scaling inside the window passed in (it added a
    second window), and a plain model trains with the scaled window on
    every backend (on JAX its conditional returned variables)."""
    keras.config.set_dtype_policy("mixed_float16")
    x, y = data(64)
    model = make_model()
    wrapped = kas.ASSpeed(model) if wrap else model
    wrapped.compile(
        optimizer=kas.AccumulatingOptimizer(keras.optimizers.Adam(0.01), 2),
        loss=kas.ASSoftmaxLoss(0.3),
        jit_compile=JIT,
    )
    history = wrapped.fit(x, y, batch_size=8, epochs=2, verbose=0).history
    window = wrapped.optimizer if wrap else wrapped.optimizer.inner_optimizer
    assert isinstance(window, kas.AccumulatingOptimizer)
    assert int(ops.convert_to_numpy(window.iterations)) == 2 * 64 // 8 // 2
    if wrap:
        assert isinstance(
            window.inner_optimizer, keras.optimizers.LossScaleOptimizer
        )
        assert history["accum_steps"] == [2.0, 2.0]
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())


def test_batch_normalization_updates_statistics_every_micro_batch():
    # With a zero learning rate the weights stay put, so the moving statistics
    # must equal those of the unwrapped model fed the same micro-batches.
    x, y = data(32)
    plain = make_model(batch_norm=True)
    start = plain.get_weights()
    plain.compile(optimizer=keras.optimizers.SGD(0.0), loss=kas.ASSoftmaxLoss())
    plain.fit(x, y, batch_size=4, shuffle=False, verbose=0)

    inner = make_model(batch_norm=True)
    inner.set_weights(start)
    wrapped = kas.ASSpeed(inner, lam=0.5, max_steps=4)
    wrapped.accumulation_steps = 4
    wrapped.compile(
        optimizer=keras.optimizers.SGD(0.0),
        loss=kas.ASSoftmaxLoss(),
        jit_compile=JIT,
    )
    wrapped.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    bn_plain = [
        layer
        for layer in plain.layers
        if isinstance(layer, keras.layers.BatchNormalization)
    ][0]
    bn_inner = [
        layer
        for layer in inner.layers
        if isinstance(layer, keras.layers.BatchNormalization)
    ][0]
    np.testing.assert_allclose(
        ops.convert_to_numpy(bn_inner.moving_mean),
        ops.convert_to_numpy(bn_plain.moving_mean),
        rtol=1e-5,
    )
    np.testing.assert_allclose(
        ops.convert_to_numpy(bn_inner.moving_variance),
        ops.convert_to_numpy(bn_plain.moving_variance),
        rtol=1e-5,
    )


@pytest.mark.parametrize("kind", ["functional", "subclassed"])
def test_keras_masks_need_ignore_class(kind):
    """ASSpeed counts rows by their labels: a model whose output carries a
    Keras mask trains under it once the masked positions are labelled
    `ignore_class`, and is refused without it, before any update: a
    functional model by `compile`, a subclassed one as its step is traced
    (run, on eager PyTorch). Refused here with padding labelled as a real
    class, which no label check can tell."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 20, (16, 5))
    tokens[:, 3:] = 0  # padding, masked by the embedding
    y = rng.integers(0, 3, (16, 5))
    y[tokens == 0] = -1
    y_padding_as_class = np.maximum(y, 0)

    def fit(loss, sample_filter=None):
        ignores = loss.get_config()["ignore_class"] is not None
        labels = y if ignores else y_padding_as_class
        keras.utils.set_random_seed(1)
        if kind == "subclassed":
            model = MaskedTagger()
            model(tokens[:1])
        else:
            inputs = keras.Input((5,), dtype="int32")
            hidden = keras.layers.Embedding(20, 4, mask_zero=True)(inputs)
            model = keras.Model(inputs, keras.layers.Dense(3)(hidden))
        before = [ops.convert_to_numpy(w) for w in model.weights]
        wrapped = kas.ASSpeed(model, sample_filter=sample_filter)
        wrapped.compile(optimizer="adam", loss=loss, jit_compile=JIT)
        try:
            return wrapped.fit(tokens, labels, batch_size=8, verbose=0).history
        finally:
            # Keras's JAX `fit` holds the weights outside the variables
            # until an epoch ends, so an error in the step's trace, before
            # anything ran, leaves them unread there.
            if keras.backend.backend() != "jax" or kind == "functional":
                after = [ops.convert_to_numpy(w) for w in model.weights]
                same = all(np.array_equal(a, b) for a, b in zip(before, after))
                assert same == (not ignores), "updated"

    with pytest.raises(ValueError, match="Keras masks.*ignore_class"):
        fit(kas.ASSoftmaxLoss(0.3))
    with pytest.raises(ValueError, match="Keras masks.*ignore_class"):
        fit(kas.ASSoftmaxLoss(0.3), kas.filters.SkipMasked())
    assert "masked_ratio" in fit(kas.ASSoftmaxLoss(0.3, ignore_class=-1))
    with_filter = fit(
        kas.ASSoftmaxLoss(0.3, ignore_class=-1), kas.filters.SkipMasked()
    )
    assert "trained_fraction" in with_filter
    # Keras's own loss, whose `ignore_class` Keras after 3.15 keeps only
    # in its function's arguments, under a filter that takes any loss.
    keras_loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, ignore_class=-1
    )
    assert "trained_fraction" in fit(
        keras_loss, kas.filters.SelectiveBackprop()
    )


def test_token_classification_counts_only_real_tokens():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((5, 6))
    model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    rng = np.random.default_rng(2)
    x = 3 * rng.standard_normal((16, 5, 6)).astype("float32")
    y = rng.integers(0, 3, (16, 5))
    y[:, 3:] = -1  # padding: 40% of the positions
    y[:2] = -1  # two samples that are all padding
    loss = kas.ASSoftmaxLoss(0.3, ignore_class=-1)
    wrapped = kas.ASSpeed(model, lam=0.5, max_steps=2)
    # A zero learning rate keeps the weights, so the counts can be recomputed.
    wrapped.compile(
        optimizer=keras.optimizers.SGD(0.0), loss=loss, jit_compile=JIT
    )
    history = wrapped.fit(
        x, y, batch_size=8, epochs=1, shuffle=False, verbose=0
    )
    values = ops.convert_to_numpy(
        loss.call(ops.convert_to_tensor(y, "float32"), model(x))
    )
    real = y != -1
    expected = float(np.sum((values == 0) & real) / np.sum(real))
    assert 0.0 < expected < 1.0
    np.testing.assert_allclose(
        history.history["masked_ratio"][0], expected, rtol=1e-6
    )


def joint_model(seed=1):
    """Intent (one label per sentence) plus slots (one per token)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5, 6))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    intent = keras.layers.Dense(4, name="intent")(
        keras.layers.GlobalAveragePooling1D()(hidden)
    )
    slots = keras.layers.Dense(3, name="slots")(hidden)
    return keras.Model(inputs, {"intent": intent, "slots": slots})


def joint_data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 5, 6)).astype("float32")
    intent = x.mean(1)[:, :4].argmax(-1).astype("int32")
    slots = x[..., :3].argmax(-1).astype("int32")
    return x, {"intent": intent, "slots": slots}


class SubclassedJoint(keras.Model):
    """`joint_model` in a subclassed model, which names no outputs: its
    dict of losses does."""

    def __init__(self):
        super().__init__()
        self.net = joint_model()

    def call(self, inputs):
        return self.net(inputs)


@pytest.mark.parametrize("form", ["functional", "subclassed"])
def test_several_outputs_count_the_named_output(form):
    x, y = joint_data()
    joint = joint_model() if form == "functional" else SubclassedJoint()
    with pytest.raises(ValueError, match="one loss.*for the outputs"):
        one_loss = kas.ASSpeed(joint)
        one_loss.compile(optimizer="sgd", loss=kas.ASSoftmaxLoss(0.3))
        one_loss.fit(x, y, batch_size=16, verbose=0)
    # A subclassed model's outputs are not known before its step: the
    # message names none rather than "[]".
    outputs = " of \\['intent', 'slots'\\]" if form == "functional" else ""
    with pytest.raises(ValueError, match=f"one per output{outputs}\\. Rec"):
        one_loss = kas.ASSpeed(joint, masked_outputs="intent")
        one_loss.compile(optimizer="sgd", loss=kas.ASSoftmaxLoss(0.3))
        one_loss.fit(x, y, batch_size=16, verbose=0)
    wrapped = kas.ASSpeed(joint, masked_outputs="intent")
    wrapped.compile(
        optimizer=keras.optimizers.Adam(0.05),
        loss={
            "intent": kas.ASSoftmaxLoss(0.3),
            "slots": keras.losses.SparseCategoricalCrossentropy(
                from_logits=True
            ),
        },
        jit_compile=JIT,
    )
    logs = wrapped.fit(x, y, batch_size=16, epochs=8, verbose=0).history
    assert logs["masked_ratio"][-1] > 0.3
    assert max(logs["accum_steps"]) > 1
    assert logs["loss"][-1] < logs["loss"][0]  # both heads train
    # Evaluation counts the intent rows only, as the loss would mask them.
    ratio = wrapped.evaluate(x, y, return_dict=True, verbose=0)["masked_ratio"]
    pred = wrapped.predict(x, verbose=0)["intent"]
    masked, counted = kas.count_masked_rows(
        kas.ASSoftmaxLoss(0.3), y["intent"], pred
    )
    assert counted == len(x)
    np.testing.assert_allclose(ratio, float(masked) / len(x), atol=1e-6)
    config = wrapped.get_config()
    assert config["masked_outputs"] == ["intent"]


def test_several_outputs_in_a_list_log_the_names_a_plain_model_logs():
    # Keras names each output's loss and metrics after the model's outputs.
    x, y = joint_data()

    def list_model():
        model = joint_model()
        return keras.Model(model.input, [model.output[k] for k in y])

    def logged(model):
        ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(
            optimizer="sgd",
            loss=[kas.ASSoftmaxLoss(0.3), ce],
            metrics=[["accuracy"], ["accuracy"]],
            jit_compile=JIT,
        )
        labels = list(y.values())
        history = model.fit(
            x, labels, epochs=1, validation_data=(x, labels), verbose=0
        )
        return set(history.history)

    plain = logged(list_model())
    assert "val_intent_loss" in plain and "slots_accuracy" in plain
    wrapped = kas.ASSpeed(list_model(), masked_outputs="intent")
    assert plain <= logged(wrapped)


def test_several_outputs_bad_input():
    x, y = joint_data()
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    losses = {"intent": kas.ASSoftmaxLoss(0.3), "slots": ce}

    def fit(wrapped, loss=losses):
        wrapped.compile(optimizer="adam", loss=loss)
        wrapped.fit(x, y, batch_size=16, epochs=1, verbose=0)

    with pytest.raises(ValueError, match="masked_outputs"):
        fit(kas.ASSpeed(joint_model()))
    with pytest.raises(ValueError, match="among the model's outputs"):
        fit(kas.ASSpeed(joint_model(), masked_outputs="tags"))
    with pytest.raises(ValueError, match="masks no rows"):
        fit(kas.ASSpeed(joint_model(), masked_outputs=["intent", "slots"]))
    with pytest.raises(ValueError, match="one output and one loss"):
        fit(
            kas.ASSpeed(
                joint_model(),
                masked_outputs="intent",
                sample_filter=kas.filters.SkipMasked(),
            )
        )
    with pytest.raises(ValueError, match="non-empty list"):
        kas.ASSpeed(joint_model(), masked_outputs=[])
    with pytest.raises(ValueError, match="non-empty list.*=3"):
        kas.ASSpeed(joint_model(), masked_outputs=3)
    with pytest.raises(ValueError, match=r"one loss.*\['intent', 'slots'\]"):
        fit(kas.ASSpeed(joint_model()), loss=kas.ASSoftmaxLoss(0.3))


def test_bad_arguments():
    with pytest.raises(ValueError, match="keras.Model"):
        kas.ASSpeed(keras.layers.Dense(3))
    with pytest.raises(ValueError, match="lam"):
        kas.ASSpeed(make_model(), lam=0)
    with pytest.raises(ValueError, match="max_steps"):
        kas.ASSpeed(make_model(), max_steps=0)
    wrapped = kas.ASSpeed(make_model(), max_steps=3)
    with pytest.raises(ValueError, match=r"\[1, 3\]"):
        wrapped.accumulation_steps = 5
    with pytest.raises(ValueError, match=r"Call `compile\(\)` on the ASSpeed"):
        wrapped.fit(*data(8), verbose=0)
    wrapped.compile("sgd", "sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match="Loss instance"):
        wrapped.fit(*data(8), verbose=0)
    with pytest.raises(ValueError, match="losses.*'x'"):
        kas.DeltaWarmup(losses="x")
    model = make_model()
    model.compile("sgd", kas.ASSoftmaxLoss())
    warmup = kas.DeltaWarmup(losses=[keras.losses.MeanSquaredError()])
    with pytest.raises(
        ValueError, match="Received: losses=.*mean_squared_error"
    ):
        model.fit(*data(8), verbose=0, callbacks=[warmup])
    # `masked_ratio` is ASSpeed's: a metric of that name computing
    # something else would be hidden.
    wrapped = kas.ASSpeed(make_model())
    wrapped.compile(
        "sgd",
        kas.ASSoftmaxLoss(),
        metrics=[kas.MaskedRatio(kas.ASSoftmaxLoss(0.9))],
    )
    with pytest.raises(ValueError, match="masked_ratio.*another name"):
        wrapped.fit(*data(8), verbose=0)
    # A metric computing an AS loss leads to that loss's delta.
    loss = kas.ASSoftmaxLoss(0.3)
    warmup = kas.DeltaWarmup(0.5, losses=[kas.MaskedRatio(loss)])
    model.fit(*data(8), verbose=0, callbacks=[warmup])
    assert warmup._variables == [loss.delta]


def tiny_text_classifier(keras_hub):
    """A keras-hub `BertTextClassifier` on raw strings, randomly
    initialised, with a ten-word vocabulary."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab += ["the", "cat", "dog", "sat", "ran"]
    preprocessor = keras_hub.models.BertTextClassifierPreprocessor(
        keras_hub.models.BertTokenizer(vocabulary=vocab), sequence_length=8
    )
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=len(vocab),
        num_layers=1,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
        max_sequence_length=8,
    )
    return keras_hub.models.BertTextClassifier(
        backbone, num_classes=2, preprocessor=preprocessor, activation=None
    )


def test_keras_hub_task_fed_raw_strings():
    task = tiny_text_classifier(pytest.importorskip("keras_hub"))
    wrapped = kas.ASSpeed(task, lam=0.5, max_steps=2)
    wrapped.compile(
        optimizer="adam", loss=kas.ASSoftmaxLoss(0.3), jit_compile=JIT
    )
    texts = np.array(["the cat sat", "the dog ran", "cat ran", "dog sat"] * 4)
    labels = np.array([0, 1, 0, 1] * 4)
    history = wrapped.fit(texts, labels, batch_size=4, epochs=2, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert wrapped.predict(texts, batch_size=4, verbose=0).shape == (16, 2)
    assert "loss" in wrapped.evaluate(
        texts, labels, batch_size=4, verbose=0, return_dict=True
    )
    # The last-seen filter on raw strings, a list as keras-hub takes them:
    # the ids pass the preprocessor.
    skipper = kas.filters.SkipMaskedLastSeen(16, warmup_epochs=0)
    filtered = kas.ASSpeed(task, sample_filter=skipper)
    filtered.compile(
        optimizer="adam", loss=kas.ASSoftmaxLoss(0.3), jit_compile=JIT
    )
    history = filtered.fit(
        kas.filters.with_sample_ids(list(texts)),
        labels,
        batch_size=4,
        epochs=2,
        verbose=0,
    )
    assert np.all(np.isfinite(history.history["loss"]))
    assert history.history["trained_fraction"][0] > 0


@pytest.mark.parametrize("shuffle", [True, "batch", False])
def test_a_keras_hub_task_on_raw_strings_shuffles_as_fit_says(shuffle):
    """Arrays of raw strings are shuffled as Keras shuffles arrays, where
    keras-hub's own `fit` keeps their order and warns that `shuffle` is
    ignored: a loss run eagerly shows each step's labels."""
    labels_seen, steps = [], []

    class Recording(kas.ASSoftmaxLoss):
        def call(self, y_true, y_pred):
            try:
                labels_seen.append(ops.convert_to_numpy(y_true).astype(int))
            except Exception:  # a symbolic call (Keras traces it on JAX)
                pass
            return super().call(y_true, y_pred)

    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda *_, **__: steps.append(tuple(labels_seen[-1]))
    )
    keras.utils.set_random_seed(0)
    task = tiny_text_classifier(pytest.importorskip("keras_hub"))
    wrapped = kas.ASSpeed(task)
    wrapped.compile(optimizer="sgd", loss=Recording(0.3), run_eagerly=True)
    texts = np.array(["the cat", "the dog"] * 32)
    labels = np.repeat([0, 1], 32)  # sorted: 16 batches of one label
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*shuffle")
        wrapped.fit(
            texts,
            labels,
            batch_size=4,
            epochs=2,
            shuffle=shuffle,
            callbacks=[record],
            verbose=0,
        )
    ordered = [(0,) * 4] * 8 + [(1,) * 4] * 8
    first, second = steps[:16], steps[16:]
    for epoch in first, second:  # every sample once an epoch
        assert sorted(sum(epoch, ())) == sorted(labels.tolist())
    if shuffle is False:
        assert first == second == ordered
    elif shuffle == "batch":
        assert sorted(first) == sorted(second) == ordered
        assert first != second
    else:
        assert sorted(first) != ordered and first != second


def test_a_keras_hub_task_validates_on_raw_strings():
    """`validation_data` and `validation_split` of raw strings, as the bare
    task takes them (with a filter, whose queues the split's training
    share shapes): the preprocessor runs once over each."""
    task = tiny_text_classifier(pytest.importorskip("keras_hub"))
    texts = np.array(["the cat", "cat", "the the cat", "cat the"] * 4)
    labels = np.array([0, 1, 0, 1] * 4)
    wrapped = kas.ASSpeed(task, sample_filter=kas.filters.SkipMasked())
    wrapped.compile(
        optimizer="adam", loss=kas.ASSoftmaxLoss(0.3), jit_compile=JIT
    )
    logs = wrapped.fit(
        texts,
        labels,
        batch_size=4,
        validation_data=(texts[:8], labels[:8]),
        verbose=0,
    ).history
    expected = wrapped.evaluate(
        texts[:8], labels[:8], verbose=0, return_dict=True
    )["loss"]
    np.testing.assert_allclose(logs["val_loss"], [expected], rtol=1e-5)
    logs = wrapped.fit(
        list(texts), labels, batch_size=4, validation_split=0.25, verbose=0
    ).history
    # Keras's split: the last quarter, in order.
    expected = wrapped.evaluate(
        texts[12:], labels[12:], verbose=0, return_dict=True
    )["loss"]
    np.testing.assert_allclose(logs["val_loss"], [expected], rtol=1e-5)
    assert set(logs) >= {"loss", "val_loss", "masked_ratio"}


def test_fit_evaluate_and_predict_take_keras_positional_arguments():
    x, y = data(32)
    wrapped = kas.ASSpeed(make_model(), sample_filter=kas.filters.SkipMasked())
    wrapped.compile("sgd", kas.ASSoftmaxLoss(0.3), jit_compile=JIT)
    # fit(x, y, batch_size, epochs, verbose, callbacks)
    logs = StepLog()
    history = wrapped.fit(x, y, 8, 2, 0, [logs])
    assert len(history.history["loss"]) == 2 and len(logs.steps) == 8
    # evaluate(x, y, batch_size, verbose, sample_weight, steps)
    weights = np.zeros(32)
    weights[:8] = 1.0
    assert wrapped.evaluate(x, y, 8, 0, weights, 1) == pytest.approx(
        wrapped.evaluate(x[:8], y[:8], verbose=0)
    )
    # predict(x, batch_size, verbose, steps)
    assert wrapped.predict(x, 8, 0, 2).shape == (16, 4)


@pytest.mark.skipif(BACKEND == "torch", reason="Keras exports TF and JAX")
def test_export_serves_the_inner_model(tmp_path):
    tf = pytest.importorskip("tensorflow")
    x, y = data(32)
    wrapped = kas.ASSpeed(make_model())
    wrapped.compile(optimizer="adam", loss=kas.ASSoftmaxLoss(0.3))
    wrapped.fit(x, y, batch_size=16, epochs=1, verbose=0)
    path = str(tmp_path / "served")
    wrapped.export(path, verbose=False)
    if BACKEND != "tensorflow":
        # Serving a JAX export needs a TensorFlow that reads its StableHLO
        # (not jax 0.12's with TensorFlow 2.21).
        return
    loaded = tf.saved_model.load(path)
    served = loaded.serve(tf.constant(x))
    np.testing.assert_allclose(
        np.asarray(served), wrapped.predict(x, verbose=0), rtol=1e-5
    )


@pytest.mark.parametrize("wrap", [False, True], ids=["keras", "as_speed"])
def test_delta_warmup_validates_and_fits_again_with_the_delta_it_set(wrap):
    """Validation after the switch, `evaluate` after `fit`, and a second
    `fit` use the delta the variable holds (a compiled JAX step holds it as
    a constant)."""
    x, y = data(64)
    loss = kas.ASSoftmaxLoss(0.3)
    model = make_model()
    wrapped = kas.ASSpeed(model) if wrap else model
    wrapped.compile(
        optimizer=keras.optimizers.Adam(0.05), loss=loss, jit_compile=JIT
    )

    def loss_at(delta):
        y_pred = model.predict(x, verbose=0)
        return float(kas.ASSoftmaxLoss(delta)(y, y_pred))

    def fit_with_warmup(epochs, warmup_ratio):
        warmup = kas.DeltaWarmup(warmup_ratio=warmup_ratio)
        return wrapped.fit(
            x,
            y,
            batch_size=16,
            epochs=epochs,
            validation_data=(x, y),
            verbose=0,
            callbacks=[warmup],
        ).history

    logs = fit_with_warmup(epochs=4, warmup_ratio=0.4)
    assert loss_at(0.3) < loss_at(1.0)
    assert logs["val_loss"][-1] == pytest.approx(loss_at(0.3), rel=1e-5)
    evaluated = wrapped.evaluate(x, y, verbose=0, return_dict=True)
    assert evaluated["loss"] == pytest.approx(loss_at(0.3), rel=1e-5)
    # Warm all through: delta = 1 masks nothing, and the end restores 0.3.
    logs = fit_with_warmup(epochs=1, warmup_ratio=1.0)
    if wrap:
        assert logs["masked_ratio"] == [0.0]
    assert logs["val_loss"][-1] == pytest.approx(loss_at(1.0), rel=1e-5)
    evaluated = wrapped.evaluate(x, y, verbose=0, return_dict=True)
    assert evaluated["loss"] == pytest.approx(loss_at(0.3), rel=1e-5)


@pytest.mark.parametrize("wrap", [False, True], ids=["keras", "as_speed"])
@pytest.mark.parametrize("bad", [-0.5, 1.7, float("nan")])
def test_a_delta_assigned_outside_0_1_is_refused_before_training(wrap, bad):
    """A loss checks `delta` when made; a value assigned to its variable
    since is checked by `ASSpeed.fit`, and by `DeltaWarmup` (a plain
    model), before the first batch."""
    x, y = data(32)
    loss = kas.ASSoftmaxLoss(0.3)
    model = make_model()
    wrapped = kas.ASSpeed(model) if wrap else model
    wrapped.compile(optimizer="sgd", loss=loss, jit_compile=JIT)
    before = [w.copy() for w in model.get_weights()]
    loss.delta.assign(bad)
    callbacks = [] if wrap else [kas.DeltaWarmup(warmup_ratio=0.5)]
    with pytest.raises(ValueError, match=r"delta.*\[0, 1\].*holds"):
        wrapped.fit(x, y, batch_size=16, verbose=0, callbacks=callbacks)
    for old, new in zip(before, model.get_weights()):
        np.testing.assert_array_equal(old, new)


@pytest.mark.parametrize("wrap", [False, True], ids=["keras", "as_speed"])
def test_delta_warmup_resumed_at_an_epoch_goes_on_from_that_epoch(wrap):
    """Steps count from epoch 0: a `fit` resumed at `initial_epoch=2` of 4
    with half the steps warm trains at the chosen delta throughout, and
    with three quarters warm switches where the whole run would."""
    x, y = data(64)
    loss = kas.ASSoftmaxLoss(0.3)
    wrapped = kas.ASSpeed(make_model()) if wrap else make_model()
    wrapped.compile(optimizer="adam", loss=loss, jit_compile=JIT)

    def deltas(warmup_ratio):
        seen = []
        record = keras.callbacks.LambdaCallback(
            on_train_batch_begin=lambda batch, logs: seen.append(
                round(float(ops.convert_to_numpy(loss.delta)), 2)
            )
        )
        warmup = kas.DeltaWarmup(warmup_ratio=warmup_ratio)
        wrapped.fit(
            x,
            y,
            batch_size=16,
            epochs=4,
            initial_epoch=2,
            verbose=0,
            callbacks=[warmup, record],
        )
        return seen

    assert deltas(0.5) == [0.3] * 8
    assert deltas(0.75) == [1.0] * 4 + [0.3] * 4
    assert float(ops.convert_to_numpy(loss.delta)) == pytest.approx(0.3)


def test_delta_warmup_saves_and_stops_with_the_chosen_delta(tmp_path):
    """A `.keras` file written during the warm-up keeps the chosen delta,
    and a `fit` stopped by an error in the warm-up leaves it to the next
    `DeltaWarmup`, warm or not."""
    x, y = data(64)
    loss = kas.ASSoftmaxLoss(0.3)
    model = kas.ASSpeed(make_model())
    model.compile(optimizer="adam", loss=loss, jit_compile=JIT)
    path = str(tmp_path / "warm.keras")

    def save_then_stop(epoch, logs):
        assert float(ops.convert_to_numpy(loss.delta)) == 1.0
        model.save(path)
        raise RuntimeError("stopped")

    stop = keras.callbacks.LambdaCallback(on_epoch_end=save_then_stop)
    with pytest.raises(RuntimeError, match="stopped"):
        model.fit(
            x,
            y,
            batch_size=16,
            epochs=4,
            verbose=0,
            callbacks=[kas.DeltaWarmup(warmup_ratio=0.5), stop],
        )
    loaded = keras.saving.load_model(path)
    assert float(ops.convert_to_numpy(loaded.loss.delta)) == pytest.approx(0.3)
    assert loss.get_config()["delta"] == pytest.approx(0.3)
    for warmup_ratio in (0.0, 0.5):
        model.fit(
            x,
            y,
            batch_size=16,
            epochs=1,
            verbose=0,
            callbacks=[kas.DeltaWarmup(warmup_ratio=warmup_ratio)],
        )
        assert float(ops.convert_to_numpy(loss.delta)) == pytest.approx(0.3)


def test_delta_warmup_switches_inside_compiled_training():
    x, y = data(64)
    loss = kas.ASSoftmaxLoss(0.3)
    model = make_model()
    model.compile(
        optimizer=keras.optimizers.Adam(0.05),
        loss=loss,
        metrics=[kas.MaskedRatio(loss)],
        jit_compile=JIT,
    )
    ratios = []
    cb = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: ratios.append(
            float(logs["masked_ratio"])
        )
    )
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[kas.DeltaWarmup(warmup_ratio=0.5), cb],
    )
    # delta = 1 masks nothing during the first half, then delta = 0.3
    # masks rows.
    assert ratios[:8] == [0.0] * 8
    assert ratios[-1] > 0.0
    assert float(ops.convert_to_numpy(loss.delta)) == pytest.approx(0.3)


@pytest.mark.skipif(
    BACKEND == "torch",
    reason="Keras's torch trainer takes steps_per_execution=1 only",
)
def test_delta_warmup_counts_batches_with_several_a_dispatch():
    """With 4 batches a dispatch Keras calls the batch callbacks once a
    group; the warm-up still lasts its share of the batches (13 of 52,
    where the second epoch's first group starts), so training matches one
    batch a dispatch."""
    x, _ = data(13 * 16)
    y = x[:, :4].argmax(-1)  # learnt within an epoch: masked after it

    def fit(steps_per_execution):
        loss = kas.ASSoftmaxLoss(0.3)
        wrapped = kas.ASSpeed(make_model())
        wrapped.compile(
            optimizer=keras.optimizers.Adam(0.05),
            loss=loss,
            jit_compile=JIT,
            steps_per_execution=steps_per_execution,
        )
        history = wrapped.fit(
            x,
            y,
            batch_size=16,
            epochs=4,
            shuffle=False,
            verbose=0,
            callbacks=[kas.DeltaWarmup(warmup_ratio=0.25)],
        )
        return wrapped.get_weights(), history.history["masked_ratio"]

    weights, masked = fit(1)
    grouped_weights, grouped_masked = fit(4)
    assert masked[0] == 0.0 and masked[1] > 0.0  # delta = 1 for one epoch
    np.testing.assert_allclose(grouped_masked, masked, rtol=1e-5)
    for ours, theirs in zip(grouped_weights, weights):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(
    BACKEND == "tensorflow",
    reason="Keras reads TensorFlow's logs on the training thread at each "
    "batch, whatever the callbacks",
)
@pytest.mark.parametrize(
    "wrap",
    [
        lambda model: model,
        kas.ASSpeed,
        lambda model: kas.ASSpeed(
            model, sample_filter=kas.filters.SkipMasked()
        ),
    ],
    ids=["keras", "as_speed", "skip_masked"],
)
def test_delta_warmup_leaves_keras_reading_the_logs_off_the_training_thread(
    wrap,
):
    """Keras hands each step's logs to the batch-end callbacks from a
    thread of its own, so that the training loop does not wait for the
    step to finish, unless a callback needs them on the loop's thread:
    neither `DeltaWarmup` nor `ASSpeed`'s own callbacks do."""
    x, y = data(64)
    wrapped = wrap(make_model())
    wrapped.compile(
        optimizer="adam", loss=kas.ASSoftmaxLoss(0.3), jit_compile=JIT
    )
    threads = []

    class Where(keras.callbacks.Callback):
        async_safe = True

        def on_train_batch_end(self, batch, logs=None):
            threads.append(threading.get_ident())

    callbacks = [kas.DeltaWarmup(warmup_ratio=0.5), Where()]
    wrapped.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=callbacks)
    assert len(threads) == 8
    assert threading.get_ident() not in threads


def test_delta_warmup_counts_the_batches_of_a_dataset_of_unknown_length():
    """Where `fit` does not know the steps per epoch, the warm-up counts
    the batches each epoch ran: 6 of 8 warm over two epochs of 4."""
    tf = pytest.importorskip("tensorflow")
    x, y = data(64)
    dataset = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .filter(lambda *_: True)  # of unknown length
        .batch(16)
    )
    loss = kas.ASSoftmaxLoss(0.3)
    model = make_model()
    model.compile(optimizer="adam", loss=loss, jit_compile=JIT)
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda batch, logs: seen.append(
            (batch, round(float(ops.convert_to_numpy(loss.delta)), 2))
        )
    )
    warmup = kas.DeltaWarmup(warmup_ratio=0.75, total_steps=8)
    model.fit(dataset, epochs=2, verbose=0, callbacks=[warmup, record])
    # Keras begins a fifth batch an epoch, which finds the data run out.
    assert [d for batch, d in seen if batch < 4] == [1.0] * 6 + [0.3] * 2


# Shared by the tf.distribute scripts below: the data, and the wrapped
# model built under a strategy with a callback that logs the step count.
DISTRIBUTED_SETUP = """
rng = np.random.default_rng(0)
x = rng.standard_normal((96, 6)).astype("float32")
y = rng.integers(0, 4, 96)
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)

def build(strategy):
    with strategy.scope():
        keras.utils.set_random_seed(1)
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8, activation="relu")(inputs)
        model = kas.ASSpeed(
            keras.Model(inputs, keras.layers.Dense(4)(hidden)),
            lam=3.0,
            max_steps=3,
        )
        model.compile(
            optimizer=keras.optimizers.Adam(0.02),
            loss=kas.ASSoftmaxLoss(0.3),
        )
    steps = []
    log = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: steps.append(
            int(logs["accum_steps"])
        ))
    return model, steps, log
"""

MIRRORED_SCRIPT = (
    """
import json, os, warnings
os.environ["KERAS_BACKEND"] = "tensorflow"
# Each replica traces its own train step: none trains outside it.
warnings.filterwarnings("error", message=".*outside its own")
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2
)
import numpy as np, keras, keras_as_softmax as kas

"""
    + DISTRIBUTED_SETUP
    + """
def train(strategy):
    model, steps, log = build(strategy)
    history = model.fit(data, epochs=3, verbose=0, callbacks=[log])
    per_replica = [
        int(v.numpy()[3])
        for v in strategy.experimental_local_results(
            model.optimizer.window_counts.value
        )
    ]
    return model, steps, history.history, per_replica

single, single_steps, single_hist, _ = train(tf.distribute.get_strategy())
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
mirrored, mirrored_steps, mirrored_hist, per_replica = train(strategy)

def filtered(strategy, make_filter, jit_compile, batch=8):
    with strategy.scope():
        keras.utils.set_random_seed(1)
        inputs = keras.Input((6,))
        # A weight's penalty counts once, not once per replica.
        hidden = keras.layers.Dense(
            16, activation="relu", kernel_regularizer="l2"
        )(inputs)
        model = kas.ASSpeed(
            keras.Model(inputs, keras.layers.Dense(4)(hidden)),
            sample_filter=make_filter(),
        )
        model.compile(
            optimizer=keras.optimizers.Adam(0.03),
            loss=kas.ASSoftmaxLoss(0.3),
            jit_compile=jit_compile,
        )
    # 92 rows: each epoch ends with a short batch of 4.
    labels = x[:92, :4].argmax(-1).astype("int32")
    ids = kas.filters.with_sample_ids(x[:92])
    data = tf.data.Dataset.from_tensor_slices((ids, labels)).batch(batch)
    try:
        hist = model.fit(data, epochs=5, validation_data=data, verbose=0)
    except ValueError as error:
        return str(error)
    hist = hist.history
    memory = next(
        (v for states in getattr(model.filter_engine, "states", [])
         for k, v in states.items() if k.startswith("last_seen")),
        None,
    )
    return {
        "weights": [w.tolist() for w in model.inner_model.get_weights()],
        "trained": hist.get("trained_fraction"),
        "masked": hist["masked_ratio"],
        "loss": hist["loss"],
        "val_loss": hist["val_loss"],
        "memory": None if memory is None else memory.numpy().tolist(),
    }

filter_cases = {
    "skip_xla": (lambda: kas.filters.SkipMasked(0.0, warmup_epochs=1), True),
    "hybrid_graph": (
        lambda: [
            kas.filters.SkipMaskedLastSeen(96, revisit=0.3, seed=3),
            kas.filters.SkipMasked(0.0),
        ],
        False,
    ),
    "hybrid_xla": (
        lambda: [
            kas.filters.SkipMaskedLastSeen(96, revisit=0.3, seed=3),
            kas.filters.SkipMasked(0.0),
        ],
        True,
    ),
    # XLA cannot reach a second CPU's variables: steps run as graphs.
    "none_xla": (lambda: None, True),
}
filter_results = {}
for name, (make_filter, jit_compile) in filter_cases.items():
    one = filtered(tf.distribute.get_strategy(), make_filter, jit_compile)
    two = filtered(strategy, make_filter, jit_compile)
    filter_results[name] = {
        "diff": max(
            float(np.abs(np.subtract(a, b)).max())
            for a, b in zip(one["weights"], two["weights"])
        ),
        "trained": [one["trained"], two["trained"]],
        "masked": [one["masked"], two["masked"]],
        "loss": [one["loss"], two["loss"]],
        "val_loss": [one["val_loss"], two["val_loss"]],
        "memory_equal": one["memory"] == two["memory"],
    }

# Without a filter, learning rate 0: the epoch's logged weighted accuracy,
# whose last batch (3 rows) splits unevenly over the replicas, and the
# exact one.
def weighted_accuracy(strategy):
    with strategy.scope():
        keras.utils.set_random_seed(1)
        inputs = keras.Input((6,))
        model = kas.ASSpeed(keras.Model(inputs, keras.layers.Dense(4)(inputs)))
        model.compile(
            optimizer=keras.optimizers.SGD(0.0),
            loss=kas.ASSoftmaxLoss(0.3),
            weighted_metrics=["accuracy"],
        )
    labels = x[:91, :4].argmax(-1).astype("int32")
    class_weight = {0: 0.5, 1: 1.0, 2: 2.0, 3: 1.0}
    logged = model.fit(
        x[:91], labels, batch_size=8, class_weight=class_weight, verbose=0
    ).history["accuracy"][0]
    hits = model.predict(x[:91], verbose=0).argmax(-1) == labels
    weights = np.array([class_weight[int(c)] for c in labels])
    return [logged, float(np.sum(weights * hits) / np.sum(weights))]

print(json.dumps({
    "weighted_accuracy": weighted_accuracy(strategy),
    "filters": filter_results,
    "odd_batch_error": filtered(
        strategy, lambda: kas.filters.SkipMasked(), False, batch=7
    ),
    "diff": max(
        float(np.abs(a - b).max())
        for a, b in zip(single.get_weights(), mirrored.get_weights())
    ),
    "single_steps": single_steps,
    "mirrored_steps": mirrored_steps,
    "per_replica": per_replica,
    "updates": [
        int(keras.ops.convert_to_numpy(m.optimizer.iterations))
        for m in (single, mirrored)
    ],
    "masked": [single_hist["masked_ratio"], mirrored_hist["masked_ratio"]],
}))
"""
)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.distribute")
def test_mirrored_strategy_matches_single_device():
    result = run_json_script(MIRRORED_SCRIPT)
    assert result["diff"] < 1e-5
    assert result["mirrored_steps"] == result["single_steps"]
    assert max(result["single_steps"]) == 3  # the steps really moved
    assert len(set(result["per_replica"])) == 1
    assert result["updates"][0] == result["updates"][1] < 36
    np.testing.assert_allclose(result["masked"][0], result["masked"][1])
    # The filters see the global batch on every replica: the same
    # decisions, samples and weights as one device, revisits included.
    for name, case in result["filters"].items():
        assert case["diff"] < 1e-5, name
        assert case["trained"][0] == case["trained"][1], name
        np.testing.assert_allclose(*case["masked"], err_msg=name)
        # The logged loss holds the kernel's penalty once, as on one device.
        np.testing.assert_allclose(*case["loss"], rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(*case["val_loss"], rtol=1e-5, err_msg=name)
        assert case["memory_equal"], name
        if name != "none_xla":
            assert min(case["trained"][0]) < 0.5, name  # samples left out
    error = result["odd_batch_error"]
    assert "divisible by 2" in error and "Received: 7" in error
    # The epoch's metrics are their synced results, not each replica's
    # last ratios averaged.
    np.testing.assert_allclose(*result["weighted_accuracy"], rtol=1e-6)


# One process of a two-worker MultiWorkerMirroredStrategy cluster on
# 127.0.0.1 (argv: worker index and the two ports), or the single-device
# reference (argv: "single"). Global batch 8: each worker trains on 4.
MULTI_WORKER_SCRIPT = (
    """
import json, os, sys
if sys.argv[1] != "single":
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {
            "worker": [f"127.0.0.1:{p}" for p in sys.argv[2].split(",")]
        },
        "task": {"type": "worker", "index": int(sys.argv[1])},
    })
os.environ["KERAS_BACKEND"] = "tensorflow"
import tensorflow as tf
import numpy as np, keras, keras_as_softmax as kas

if sys.argv[1] == "single":
    strategy = tf.distribute.get_strategy()
else:
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
"""
    + DISTRIBUTED_SETUP
    + """
model, steps, log = build(strategy)
history = model.fit(
    data, validation_data=data, epochs=3, verbose=0, callbacks=[log]
)
first = next(iter(strategy.experimental_distribute_dataset(data)))[0]
print(json.dumps({
    "replicas": strategy.num_replicas_in_sync,
    "local_batch": int(strategy.experimental_local_results(first)[0].shape[0]),
    "weights": [w.tolist() for w in model.get_weights()],
    "steps": steps,
    "updates": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
    "masked": history.history["masked_ratio"],
    "val_loss": history.history["val_loss"],
}))
"""
)


def _free_ports(n):
    import socket

    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.distribute")
def test_multi_worker_mirrored_strategy_matches_single_device():
    import json
    import subprocess
    import sys

    ports = ",".join(str(p) for p in _free_ports(2))
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", MULTI_WORKER_SCRIPT, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for args in (["single"], ["0", ports], ["1", ports])
    ]
    results = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, stderr[-3000:]
            results.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            proc.kill()
    single, *workers = results
    assert single["replicas"] == 1 and single["local_batch"] == 8
    for worker in workers:
        assert worker["replicas"] == 2 and worker["local_batch"] == 4
        for a, b in zip(single["weights"], worker["weights"]):
            np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5)
        # Every worker took the same decisions as one device.
        assert worker["steps"] == single["steps"]
        assert worker["updates"] == single["updates"] < 36
        np.testing.assert_allclose(
            worker["masked"], single["masked"], rtol=1e-6
        )
        np.testing.assert_allclose(
            worker["val_loss"], single["val_loss"], rtol=1e-5
        )
    assert max(single["steps"]) == 3  # the steps really moved


# Accumulation and both filters under JAX's `keras.distribution.DataParallel`
# on two host devices, against one device: the same fit, the same samples;
# also with 4 batches a dispatch (one `lax.scan`), its weights laid out as
# one batch a dispatch lays them out.
DATA_PARALLEL_SCRIPT = """import json, os
os.environ["KERAS_BACKEND"] = "jax"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import numpy as np, keras, jax
import keras_as_softmax as kas
from keras_as_softmax import filters

rng = np.random.default_rng(0)
n = 96
x = rng.standard_normal((n, 6)).astype("float32")
y = x[:, :4].argmax(-1).astype("int32")

def train(sample_filter, ids, steps_per_execution=1):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,))
    # A weight's penalty counts once, as on one device.
    hidden = keras.layers.Dense(
        16, activation="relu", kernel_regularizer="l2"
    )(inputs)
    model = kas.ASSpeed(
        keras.Model(inputs, keras.layers.Dense(4)(hidden)),
        sample_filter=sample_filter,
    )
    model.compile(
        optimizer=keras.optimizers.Adam(0.03),
        loss=kas.ASSoftmaxLoss(0.3),
        steps_per_execution=steps_per_execution,
    )
    xs = filters.with_sample_ids(x) if ids else x
    hist = model.fit(
        xs, y, batch_size=8, epochs=5, shuffle=False, verbose=0
    ).history
    layouts.append([(v.value.sharding, v.value.ndim) for v in model.variables])
    if not ids:
        return model.get_weights(), hist, None
    memory = keras.ops.convert_to_numpy(
        model.filter_engine.states[0]["last_seen_masked"]
    ).tolist()
    return model.get_weights(), hist, memory

skip = lambda: filters.SkipMasked(0.0, warmup_epochs=1)
cases = {
    "plain": (lambda: None, False, 1),
    "skip": (skip, False, 1),
    "skip_grouped": (skip, False, 4),
    "hybrid": (
        lambda: [
            filters.SkipMaskedLastSeen(n, seed=3),
            filters.SkipMasked(0.0),
        ],
        True,
        1,
    ),
}
out = {}
layouts = []
single = {k: train(f(), ids) for k, (f, ids, _) in cases.items()}
keras.distribution.set_distribution(keras.distribution.DataParallel())
assert len(jax.devices()) == 2
layouts.clear()
for k, (f, ids, steps_per_execution) in cases.items():
    w, h, mem = train(f(), ids, steps_per_execution)
    sw, sh, smem = single[k]
    out[k] = {
        "diff": max(float(np.abs(a - b).max()) for a, b in zip(w, sw)),
        "trained": [h.get("trained_fraction"), sh.get("trained_fraction")],
        "masked": [h["masked_ratio"], sh["masked_ratio"]],
        "mem_equal": mem == smem,
    }
out["grouped_layout_equal"] = all(
    a.is_equivalent_to(b, ndim) for (a, ndim), (b, _) in zip(*layouts[1:3])
)
print(json.dumps(out))
"""


@pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution on JAX")
def test_data_parallel_matches_single_device():
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", DATA_PARALLEL_SCRIPT],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result.pop("grouped_layout_equal")
    for name, case in result.items():
        assert case["diff"] < 1e-5, name
        parallel, single = case["trained"]
        assert parallel == single, name
        np.testing.assert_allclose(*case["masked"], err_msg=name)
        assert case["mem_equal"], name
    # The filters really left samples out.
    assert min(result["skip"]["trained"][1]) < 0.5
    assert min(result["hybrid"]["trained"][1]) < 0.5


@pytest.mark.skipif(BACKEND != "torch", reason="torch.distributed")
def test_torch_process_groups_are_refused(monkeypatch):
    import torch

    wrapped = kas.ASSpeed(make_model())
    wrapped.compile(optimizer="sgd", loss=kas.ASSoftmaxLoss())
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    with pytest.raises(ValueError, match="no distribution support.*2 proc"):
        wrapped.fit(*data(8), verbose=0)


@pytest.mark.skipif(BACKEND != "torch", reason="torch.compile")
@pytest.mark.parametrize("sample_filter", [None, "skip_masked"])
def test_torch_compile_gives_the_eager_weights(sample_filter):
    x, y = data(32)

    def fit(jit_compile):
        wrapped = kas.ASSpeed(
            make_model(),
            lam=3.0,
            max_steps=2,
            sample_filter=sample_filter and kas.filters.SkipMasked(0.0),
        )
        wrapped.compile(
            optimizer="adam",
            loss=kas.ASSoftmaxLoss(0.3),
            jit_compile=jit_compile,
        )
        logs = wrapped.fit(
            x, y, batch_size=4, epochs=2, shuffle=False, verbose=0
        ).history
        return wrapped, logs

    eager, eager_logs = fit(False)
    compiled, compiled_logs = fit(True)
    # Every weight the same, but the queue's stale rows (past its count).
    engine = eager.filter_engine
    queues = engine.queue_variables() if engine else []
    buffers = {id(v) for v in queues if len(v.shape) == 2}
    count = sample_filter and int(
        ops.convert_to_numpy(eager.filter_engine.train_queue.count)
    )
    for u, v in zip(eager.weights, compiled.weights):
        a, b = ops.convert_to_numpy(u), ops.convert_to_numpy(v)
        if id(u) in buffers:
            a, b = a[:count], b[:count]
        np.testing.assert_allclose(a, b, atol=1e-5, err_msg=u.path)
    assert compiled.accumulation_steps == eager.accumulation_steps == 2
    np.testing.assert_allclose(
        compiled_logs["masked_ratio"], eager_logs["masked_ratio"]
    )
