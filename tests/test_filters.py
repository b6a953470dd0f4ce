"""Sample filters: the queue, the pipeline's bookkeeping, and training."""

import sys
import time
import types

import keras
import numpy as np
import pytest
from keras import ops

import keras_as_softmax as kas
from keras_as_softmax import filters
from keras_as_softmax.training import _break_even
from keras_as_softmax.training import _filtering
from keras_as_softmax.training import _queue
from tests.backend_utils import BACKEND

pytestmark = pytest.mark.skipif(
    BACKEND not in ("tensorflow", "jax"),
    reason="ASSpeed runs on tensorflow and jax",
)

JIT = [True, False] if BACKEND == "tensorflow" else [True]
# `SkipMasked(score_precision=...)` values the backend runs.
PRECISIONS = [None, "bfloat16"] if BACKEND == "jax" else [None]
NUM_CLASSES = 4


# ------------------------------------------------------------------ queue


def test_queue_appends_kept_rows_in_order_and_pops_the_front():
    queue = _queue.RowQueue([np.zeros((8,), "int32")], np.int32(0))
    queue = _queue.push(
        queue, [np.arange(4, dtype="int32")], np.array([1, 0, 1, 1], bool)
    )
    queue = _queue.push(
        queue, [np.arange(10, 14, dtype="int32")], np.array([0, 1, 0, 1], bool)
    )
    assert int(queue.count) == 5
    np.testing.assert_array_equal(
        ops.convert_to_numpy(queue.buffers[0])[:5], [0, 2, 3, 11, 13]
    )
    rows, queue = _queue.pop(queue, 4)
    np.testing.assert_array_equal(ops.convert_to_numpy(rows[0]), [0, 2, 3, 11])
    assert int(queue.count) == 1
    assert int(ops.convert_to_numpy(queue.buffers[0])[0]) == 13


# ----------------------------------------------------- the pipeline alone


class RecordingHooks:
    """Eager hooks: the 'model' masks the samples listed in `easy`."""

    def __init__(self, easy):
        self.easy = easy
        self.trained, self.scored = [], []

    def maybe_score(self, pred, x):
        if not bool(ops.convert_to_numpy(pred)):
            return np.zeros((len(ops.convert_to_numpy(x)), NUM_CLASSES))
        logits, ids = self._predict(x)
        self.scored.append(ids)
        return logits

    def maybe_train(self, pred, x, y, coefficients):
        if not bool(ops.convert_to_numpy(pred)):
            rows = len(ops.convert_to_numpy(x))
            zeros = np.zeros(rows, "float32")
            return [zeros[:1]], np.zeros((rows, NUM_CLASSES)), zeros, 0.0
        logits, ids = self._predict(x)
        self.trained.append((ids, ops.convert_to_numpy(coefficients)))
        values = _filtering.row_values(kas.ASSoftmaxLoss(0.3), y, logits)
        return [np.zeros(1, "float32")], logits, values, ops.sum(values)

    def _predict(self, x):
        ids = ops.convert_to_numpy(x)[:, 0].astype(int)
        logits = np.zeros((len(ids), NUM_CLASSES), "float32")
        logits[np.isin(ids, list(self.easy)), 0] = 10.0  # label 0: masked
        return logits, ids


def run_pipeline(sample_filter, easy, n=32, batch=4, epochs=3):
    sample_filter = filters.as_list(sample_filter)
    last_seen = next((f for f in sample_filter if f.needs_sample_ids), None)
    skip = next((f for f in sample_filter if f.scores), None)
    leaves = [
        ((1,), "float32"),
        ((), "float32"),
        ((), "float32"),
        ((), "float32"),
        ((), "int32"),
        ((), "float32"),
    ]

    def queue():
        return _queue.RowQueue(
            [np.zeros((2 * batch, *s), d) for s, d in leaves], np.int32(0)
        )

    state = _filtering.FilterState(
        score_queue=queue() if last_seen and skip else None,
        train_queue=queue(),
        memory=np.full(n, last_seen.memory_initial, "float32")
        if last_seen
        else None,
        masked_share=np.float32(1.0),
        min_masked_ratio=np.float32(0.5),
    )
    epoch = [0]
    model = types.SimpleNamespace(
        _filter_pair=(last_seen, skip),
        loss=kas.ASSoftmaxLoss(0.3),
        _filter_batch_size=batch,
        _row_tail=(),
        _output_tail=(NUM_CLASSES,),
        _output_dtype="float32",
        _epoch_state=lambda: (epoch[0], epochs),
    )
    hooks = RecordingHooks(easy)
    rng = np.random.default_rng(0)
    per_epoch = []
    for e in range(epochs):
        epoch[0] = e
        start = len(hooks.trained)
        for ids in rng.permutation(n).reshape(-1, batch):
            x = ids[:, None].astype("float32")
            y = np.zeros(batch, "float32")
            output, state = _filtering.filtered_step(
                model,
                state,
                x,
                y,
                None,
                ids.astype("int32"),
                rng.uniform(size=batch).astype("float32"),
                hooks,
            )
        per_epoch.append(hooks.trained[start:])
    return hooks, per_epoch, state


@pytest.mark.parametrize(
    "sample_filter",
    [
        filters.SkipMasked(min_masked_ratio=0.0),
        filters.SkipMaskedLastSeen(32, revisit=0.25),
        [filters.SkipMaskedLastSeen(32, revisit=0.25), filters.SkipMasked(0.0)],
        filters.InfoBatch(32, prune=0.75, anneal_fraction=0.0),
    ],
    ids=["skip_masked", "last_seen", "both", "infobatch"],
)
def test_every_training_pass_holds_a_full_batch_of_kept_samples(sample_filter):
    easy = set(range(0, 32, 2))  # half of the samples are masked
    hooks, per_epoch, _ = run_pipeline(sample_filter, easy)
    # Warm-up epoch: everything, each sample once.
    first = np.concatenate([ids for ids, _ in per_epoch[0]])
    assert sorted(first.tolist()) == list(range(32))
    for ids, coefficients in hooks.trained:
        assert len(ids) == 4  # every pass is a full batch
        assert np.all(coefficients > 0)
    later = np.concatenate([ids for e in per_epoch[1:] for ids, _ in e])
    if isinstance(sample_filter, filters.SkipMasked):
        # Scored samples: only the hard ones train, each once per epoch.
        assert set(later.tolist()) <= set(range(1, 32, 2))
        counts = np.bincount(later, minlength=32)
        assert counts.max() <= 2 and counts[1::2].sum() == len(later)
    else:
        # Hard samples are never left out; easy ones only when revisited.
        hard_counts = np.bincount(later, minlength=32)[1::2]
        assert hard_counts.min() >= 1
        assert len(later) < 2 * 32


def test_revisited_samples_are_weighted_by_the_inverse_probability():
    f = filters.SkipMaskedLastSeen(100, revisit=0.25, max_skipped_fraction=1.0)
    was = np.array([True, True, False, True])
    keep, weight = f.select(was, np.array([0.1, 0.9, 0.9, 0.2], "float32"))
    np.testing.assert_array_equal(
        ops.convert_to_numpy(keep), [True, False, True, True]
    )
    np.testing.assert_allclose(
        ops.convert_to_numpy(weight), [4.0, 1.0, 1.0, 4.0]
    )
    # The cap: at most half left out, so the revisit probability rises to 1/2.
    capped = filters.SkipMaskedLastSeen(
        100, revisit=0.25, max_skipped_fraction=0.5
    )
    keep, weight = capped.select(
        np.ones(4, bool), np.array([0.1, 0.4, 0.6, 0.9], "float32")
    )
    np.testing.assert_array_equal(
        ops.convert_to_numpy(keep), [True, True, False, False]
    )
    np.testing.assert_allclose(
        ops.convert_to_numpy(weight), [2.0, 2.0, 1.0, 1.0]
    )


def test_infobatch_prunes_below_mean_losses_and_rescales():
    f = filters.InfoBatch(100, prune=0.75)
    memory = np.array([1.0, 0.2, 3.0, 0.1, 0.0, 2.0], "float32")  # mean 1.05
    remembered = memory[[0, 1, 2, 3]]
    candidate = f.candidates(remembered, memory, 1)
    np.testing.assert_array_equal(
        ops.convert_to_numpy(candidate), [True, True, False, True]
    )
    keep, weight = f.select(
        candidate, np.array([0.1, 0.9, 0.1, 0.2], "float32")
    )
    # No cap: a below-mean sample is kept with probability 1 - prune.
    np.testing.assert_array_equal(
        ops.convert_to_numpy(keep), [True, False, True, True]
    )
    np.testing.assert_allclose(
        ops.convert_to_numpy(weight), [4.0, 1.0, 1.0, 4.0]
    )
    np.testing.assert_array_equal(
        ops.convert_to_numpy(f.masked_when_seen(memory)), [0, 0, 0, 0, 1, 0]
    )
    # What a pass records: each sample's mean loss over its counted rows.
    values = np.array([[0.5, 1.5, 9.0], [0.0, 0.0, 0.0]], "float32")
    counted = np.array([[True, True, False], [True, False, False]])
    masked = np.logical_and(counted, values == 0)
    memory = _filtering._record(
        f,
        np.ones(4, "float32"),
        np.array([2, 0], "int32"),
        counted,
        masked,
        values,
        np.array([True, True]),
        np.int32(3),
    )
    np.testing.assert_allclose(ops.convert_to_numpy(memory), [0, 1, 1, 1])


def test_last_seen_memory_ages_out_after_max_skipped_epochs():
    f = filters.SkipMaskedLastSeen(4, max_skipped_epochs=2)
    # Sample 0 seen with a gradient, 1 and 2 seen masked, 3 not written.
    memory = _filtering._record(
        f,
        np.zeros(4, "float32"),
        np.array([0, 1, 2], "int32"),
        np.ones((3,), bool),
        np.array([False, True, True]),
        np.array([0.7, 0.0, 0.0], "float32"),
        np.array([True, True, True]),
        np.int32(1),
    )
    np.testing.assert_allclose(ops.convert_to_numpy(memory), [0, 2, 2, 0])
    np.testing.assert_array_equal(
        ops.convert_to_numpy(f.masked_when_seen(memory)), [0, 1, 1, 0]
    )
    # Left out in epochs 2 and 3, seen again in epoch 4.
    for epoch, expected in [(2, True), (3, True), (4, False)]:
        candidate = f.candidates(memory, memory, np.int32(epoch))
        np.testing.assert_array_equal(
            ops.convert_to_numpy(candidate), [False, expected, expected, False]
        )
    no_limit = filters.SkipMaskedLastSeen(4)
    np.testing.assert_array_equal(
        ops.convert_to_numpy(no_limit.candidates(memory, memory, 40)),
        [False, True, True, False],
    )


def test_schedule_warms_up_and_anneals():
    f = filters.SkipMasked(warmup_epochs=1, anneal_fraction=0.25)
    active = [bool(ops.convert_to_numpy(f.active(e, 8))) for e in range(8)]
    assert active == [False, True, True, True, True, True, False, False]


# --------------------------------------------------------------- training


# ------------------------------------------------ the measured break-even


def timed_steps(rng, n, a=0.01, b=0.1, c=0.3):
    """`n` single steps: scored and trained at random, timed as
    `a + b * scored + c * trained` with noise and a few stalls."""
    scored = rng.integers(0, 2, n)
    trained = rng.integers(0, 2, n)
    seconds = a + b * scored + c * trained + rng.normal(0, 0.005, n)
    seconds[rng.choice(n, n // 20, replace=False)] += 2.0
    return seconds, np.ones(n), scored, trained


def test_break_even_share_is_the_scoring_pass_over_the_training_pass():
    rng = np.random.default_rng(0)
    share = _break_even.break_even_share(*timed_steps(rng, 200))
    assert share == pytest.approx(1 / 3, abs=0.02)
    # Clipped, and undecided while a flag has not varied.
    fast_training = timed_steps(rng, 200, b=0.3, c=0.1)
    assert _break_even.break_even_share(*fast_training) == 0.95
    seconds, steps, _, trained = timed_steps(rng, 200)
    never_scored = (seconds, steps, np.zeros(200), trained)
    assert _break_even.break_even_share(*never_scored) is None


def test_break_even_compares_steps_that_end_windows_as_often():
    """As in a fit: a first epoch that never scores, a window ending at
    every step (`k = 1`), then scored steps with `k` growing to 5. The
    window's cost is `w` where one ends. With one intercept, the unscored
    steps look a window dearer and the scoring pass that much cheaper;
    with one per accumulation length, `b / c` is measured."""
    rng = np.random.default_rng(2)
    a, b, c, w = 0.003, 0.15, 0.53, 0.07
    k = np.repeat([1, 1, 2, 3, 5, 5], 64)
    scored = (np.arange(len(k)) >= 64).astype(int)
    trained = np.where(scored > 0, rng.random(len(k)) < 0.4, 1).astype(int)
    position = np.zeros(len(k), int)  # micro-batches into the window
    for i in range(1, len(k)):
        position[i] = (position[i - 1] + 1) % k[i]
    ends = position == k - 1
    seconds = a + b * scored + c * trained + w * ends
    seconds = seconds + rng.normal(0, 0.005, len(k))
    timings = (seconds, np.ones(len(k)), scored, trained)
    share = _break_even.break_even_share(*timings, accumulation=k)
    assert share == pytest.approx(b / c, abs=0.02)
    assert _break_even.break_even_share(*timings) < b / c - 0.06
    # No accumulation length with both scored and unscored steps: no
    # measurement.
    late = slice(128, None)
    timings = [t[late] for t in timings]
    assert _break_even.break_even_share(*timings, accumulation=k[late]) is None


def test_break_even_meter_sets_the_weight_once_measured_then_refits(
    monkeypatch,
):
    rng = np.random.default_rng(1)
    n = 101
    seconds, _, scored, trained = timed_steps(rng, n)
    clock = iter(np.stack([np.zeros(n), seconds], 1).ravel())
    monkeypatch.setattr(_break_even.time, "perf_counter", lambda: next(clock))
    variable = keras.Variable(0.5)
    meter = _break_even.BreakEvenMeter(variable)
    meter.on_epoch_begin(0)
    written = []  # (step, value) at each change of the weight
    for step in range(n):
        meter.on_train_batch_begin(step)
        meter.on_train_batch_end(
            step,
            {  # the epoch's means so far, as the trackers report them
                "scored_fraction": scored[: step + 1].mean(),
                "trained_fraction": trained[: step + 1].mean(),
            },
        )
        value = float(variable.numpy())
        if value != (written[-1][1] if written else 0.5):
            written.append((step, value))

    def measured(steps):
        # The first step of an epoch is left out.
        return _break_even.break_even_share(
            seconds[1 : steps + 1],
            np.ones(steps),
            scored[1 : steps + 1],
            trained[1 : steps + 1],
        )

    # Written at the first step the timings can tell, within the epoch.
    first = next(s for s in range(1, n) if measured(s) is not None)
    assert written[0] == (first, pytest.approx(measured(first)))
    # Then refitted every REFIT_EVERY timed steps.
    for step, value in written[1:]:
        assert (step - first) % _break_even.REFIT_EVERY == 0
        assert value == pytest.approx(measured(step))
    assert len(written) >= 2
    assert float(variable.numpy()) == pytest.approx(1 / 3, abs=0.03)


class _WriteAt(keras.callbacks.Callback):
    """Writes `value` to the model's break-even weight after batch `at`,
    as `BreakEvenMeter` does, and keeps each batch's logs."""

    def __init__(self, at, value):
        super().__init__()
        self.at, self.value, self.logs = at, value, []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append({k: float(v) for k, v in logs.items()})
        if batch == self.at:
            self.model._min_masked_ratio.assign(self.value)


def test_a_break_even_written_mid_epoch_reaches_the_next_step():
    # Every sample is masked, but the moving masked share stays below 1
    # (it starts at 0): nothing is scored until the callback writes 0
    # after the fourth step (on JAX, `fit` holds the weights in its own
    # state within an epoch).
    y = np.arange(64) % NUM_CLASSES
    x = 8.0 * np.eye(NUM_CLASSES, dtype="float32")[y]
    wrapped = kas.ASSpeed(
        identity_model(),
        sample_filter=filters.SkipMasked(1.0, warmup_epochs=0),
    )
    wrapped.compile(
        optimizer=keras.optimizers.SGD(0.0),
        loss=kas.ASSoftmaxLoss(0.3),
        jit_compile=JIT[0],
    )
    writer = _WriteAt(3, 0.0)
    wrapped.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[writer])
    scored = [
        logs["scored_fraction"] * (i + 1) for i, logs in enumerate(writer.logs)
    ]
    assert np.round(scored).tolist() == [0] * 4 + list(range(1, 13))


def identity_model():
    """Logits = inputs @ W with W = I at first, so the data picks the masks."""
    inputs = keras.Input((NUM_CLASSES,))
    outputs = keras.layers.Dense(NUM_CLASSES, kernel_initializer="identity")(
        inputs
    )
    return keras.Model(inputs, outputs)


def two_batches(seed=0):
    """Two batches of 4; in each, 2 samples are masked (delta 0.3)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, NUM_CLASSES, 8)
    x = 8.0 * np.eye(NUM_CLASSES, dtype="float32")[y]
    for hard in (0, 3, 5, 6):
        x[hard] = 0.1 * rng.standard_normal(NUM_CLASSES).astype("float32")
    weights = rng.uniform(0.5, 2.0, 8).astype("float32")
    return x, y, weights


def fit_window(sample_filter, jit_compile):
    x, y, weights = two_batches()
    model = identity_model()
    wrapped = kas.ASSpeed(
        model, lam=0.5, max_steps=2, sample_filter=sample_filter
    )
    wrapped.accumulation_steps = 2
    wrapped.compile(
        optimizer=keras.optimizers.SGD(0.5),
        loss=kas.ASSoftmaxLoss(0.3),
        jit_compile=jit_compile,
    )
    history = wrapped.fit(
        x,
        y,
        sample_weight=weights,
        batch_size=4,
        epochs=1,
        shuffle=False,
        verbose=0,
    )
    return model, history.history


@pytest.mark.parametrize("score_precision", PRECISIONS)
@pytest.mark.parametrize("score_training", [True, False])
@pytest.mark.parametrize("jit_compile", JIT)
def test_skip_masked_gives_the_plain_update(
    jit_compile, score_training, score_precision
):
    """A window of two batches with two unmasked samples each: one training
    pass on the four, with their batches' coefficients, equals the plain
    accumulated update (without dropout, in either scoring mode, and with
    the scoring pass's products in bfloat16, which moves no lead here
    across the margin)."""
    plain, plain_logs = fit_window(None, jit_compile)
    skip, skip_logs = fit_window(
        filters.SkipMasked(
            0.0,
            warmup_epochs=0,
            score_training=score_training,
            score_precision=score_precision,
        ),
        jit_compile,
    )
    assert not np.allclose(plain.get_weights()[0], np.eye(NUM_CLASSES))
    for a, b in zip(plain.get_weights(), skip.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert skip_logs["trained_fraction"][0] == 0.5
    np.testing.assert_allclose(
        skip_logs["masked_ratio"][0], plain_logs["masked_ratio"][0]
    )


@pytest.mark.skipif(BACKEND != "jax", reason="JAX needs no TensorFlow")
def test_filters_on_jax_fit_arrays_without_tensorflow(monkeypatch):
    """A machine with JAX alone (a GPU image, say) has no TensorFlow: a
    filtered `fit` on arrays must not import it."""
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    with pytest.raises(ImportError):
        import tensorflow  # noqa: F401
    _, logs = fit_window(filters.SkipMasked(0.0, warmup_epochs=0), True)
    assert logs["trained_fraction"][0] == 0.5


@pytest.mark.parametrize("score_training", [True, False])
def test_scoring_mode_decides_what_dropout_can_unmask(score_training):
    """Every sample leads by a wide margin without dropout; dropout at 0.5
    drops the lead of about half of them. Scoring in inference mode leaves
    them all out; scoring in training mode, as the training pass runs,
    keeps the ones dropout unmasks."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, NUM_CLASSES, 64)
    x = 8.0 * np.eye(NUM_CLASSES, dtype="float32")[y]
    inputs = keras.Input((NUM_CLASSES,))
    hidden = keras.layers.Dropout(0.5, seed=1)(inputs)
    outputs = keras.layers.Dense(NUM_CLASSES, kernel_initializer="identity")(
        hidden
    )
    wrapped = kas.ASSpeed(
        keras.Model(inputs, outputs),
        sample_filter=filters.SkipMasked(
            0.0, warmup_epochs=0, score_training=score_training
        ),
    )
    wrapped.compile(  # a learning rate of 0 keeps every margin as it is
        optimizer=keras.optimizers.SGD(0.0),
        loss=kas.ASSoftmaxLoss(0.3),
        jit_compile=JIT[0],
    )
    logs = wrapped.fit(x, y, batch_size=8, epochs=1, verbose=0).history
    if score_training:
        assert 0.0 < logs["trained_fraction"][0] < 1.0
    else:
        assert logs["trained_fraction"] == [0.0]
        assert logs["masked_ratio"] == [1.0]


@pytest.mark.parametrize("score_margin, trained", [(0.0, 0.0), (0.2, 0.5)])
def test_score_margin_trains_the_masked_samples_within_it(
    score_margin, trained
):
    """Every sample is masked at delta 0.3: half lead by 0.47, half by
    0.93. A scoring margin of 0.2 sends the first half to training (the
    two batches that hold them), and the counts still see every sample
    masked."""
    y = np.arange(32) % NUM_CLASSES
    lead = np.where(np.arange(32) < 16, 1.5, 4.0).astype("float32")
    x = lead[:, None] * np.eye(NUM_CLASSES, dtype="float32")[y]
    wrapped = kas.ASSpeed(
        identity_model(),
        sample_filter=filters.SkipMasked(
            0.0, warmup_epochs=0, score_margin=score_margin
        ),
    )
    wrapped.compile(
        optimizer="sgd", loss=kas.ASSoftmaxLoss(0.3), jit_compile=JIT[0]
    )
    logs = wrapped.fit(
        x, y, batch_size=8, epochs=1, shuffle=False, verbose=0
    ).history
    assert logs["trained_fraction"] == [trained]
    assert logs["masked_ratio"] == [1.0]


@pytest.mark.skipif(BACKEND != "jax", reason="a jaxpr rewrite")
def test_bfloat16_matmuls_computes_the_products_from_bfloat16():
    """Products inside `jax.jit` calls and custom-derivative functions are
    computed from bfloat16 operands, accumulated in float32; the rest
    (here a softmax, a custom_jvp function) stays in float32."""
    import jax

    from keras_as_softmax.training._jax import bfloat16_matmuls

    rng = np.random.default_rng(0)
    x, w = (rng.standard_normal(s).astype("float32") for s in [(8, 64)] * 2)

    def fn(x, w):
        logits = jax.numpy.matmul(x, w.T)  # a jit-wrapped dot_general
        return jax.nn.softmax(jax.numpy.einsum("ij,jk->ik", logits, x))

    def bfloat16(a):
        return a.astype("bfloat16").astype("float32")

    def by_hand(x, w):
        logits = bfloat16(x) @ bfloat16(w).T
        return jax.nn.softmax(bfloat16(logits) @ bfloat16(x))

    rewritten = jax.jit(bfloat16_matmuls(fn))(x, w)
    assert rewritten.dtype == "float32"
    np.testing.assert_allclose(rewritten, by_hand(x, w), rtol=1e-4, atol=1e-6)
    assert np.abs(rewritten - fn(x, w)).max() > 1e-4
    text = str(jax.make_jaxpr(bfloat16_matmuls(fn))(x, w))
    assert text.count("preferred_element_type=float32") == 2
    assert "bf16" in text


def test_low_masked_share_takes_plain_steps():
    x, y, _ = two_batches()
    x = 0.01 * x  # nothing is masked
    model = identity_model()
    wrapped = kas.ASSpeed(
        model, sample_filter=filters.SkipMasked(warmup_epochs=0)
    )
    wrapped.compile(
        optimizer="sgd", loss=kas.ASSoftmaxLoss(0.3), jit_compile=JIT[0]
    )
    logs = wrapped.fit(x, y, batch_size=4, epochs=2, verbose=0).history
    # No scoring pass, and one training pass per drawn batch, as a plain step.
    assert logs["trained_fraction"] == [1.0, 1.0]
    start = filters.SkipMasked.MEASURED_START
    assert float(ops.convert_to_numpy(wrapped._masked_share)) < start


@pytest.mark.parametrize("jit_compile", JIT)
def test_filters_train_a_multi_label_model(jit_compile):
    # MultiLabelASSoftmaxLoss has no `ignore_class`: every row counts.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 6)).astype("float32")
    y = (x[:, :4] > 0.3).astype("float32")
    wrapped = kas.ASSpeed(
        small_model(),
        sample_filter=[
            filters.SkipMaskedLastSeen(64, revisit=0.5, seed=0),
            filters.SkipMasked(0.0),
        ],
    )
    wrapped.compile(
        optimizer=keras.optimizers.Adam(0.05),
        loss=kas.MultiLabelASSoftmaxLoss(0.05),
        jit_compile=jit_compile,
    )
    logs = wrapped.fit(
        filters.with_sample_ids(x), y, batch_size=8, epochs=8, verbose=0
    ).history
    assert logs["trained_fraction"][0] == 1.0  # the warm-up epoch
    assert logs["masked_ratio"][-1] > 0.5
    assert logs["trained_fraction"][-1] < 0.5
    assert np.isfinite(logs["loss"]).all()


class _EpochTimes(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.times = []

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.times.append(time.perf_counter() - self.start)


@pytest.mark.slow
def test_filtered_epoch_costs_a_plain_one_at_a_low_masked_share():
    # Nothing is masked (random labels, a learning rate of 0): the filters
    # must cost what plain ASSpeed does. After a compiling fit, the three
    # models take one epoch each in turn, in a rotating order, for several
    # rounds. Each round gives a ratio of epochs timed side by side, so a
    # stretch of machine load slows both sides of a ratio or neither; the
    # median over rounds leaves one stalled epoch where it is.
    rng = np.random.default_rng(0)
    n, width = 2048, 2048
    x = rng.standard_normal((n, 256)).astype("float32")
    y = rng.integers(0, 10, n).astype("int32")

    def model():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((256,))
        hidden = keras.layers.Dense(width, activation="relu")(inputs)
        hidden = keras.layers.Dense(width, activation="relu")(hidden)
        return keras.Model(inputs, keras.layers.Dense(10)(hidden))

    candidates = {
        "plain": None,
        "skip": filters.SkipMasked(warmup_epochs=0),
        "last_seen": filters.SkipMaskedLastSeen(n, warmup_epochs=0),
    }
    wrapped = {}
    for name, sample_filter in candidates.items():
        wrapped[name] = kas.ASSpeed(model(), sample_filter=sample_filter)
        wrapped[name].compile(
            optimizer=keras.optimizers.SGD(0.0),
            loss=kas.ASSoftmaxLoss(0.3),
            jit_compile=JIT[0],
        )

    def epoch(name, epochs=1):
        inputs = x if name != "last_seen" else filters.with_sample_ids(x)
        timer = _EpochTimes()
        logs = (
            wrapped[name]
            .fit(
                inputs,
                y,
                batch_size=128,
                epochs=epochs,
                verbose=0,
                callbacks=[timer],
            )
            .history
        )
        assert logs["masked_ratio"][-1] == 0.0
        if name != "plain":
            assert logs["trained_fraction"] == [1.0] * epochs
        return timer.times[-1]

    for name in wrapped:
        epoch(name, epochs=2)  # compiles, and measures the break-even
    names = list(wrapped)
    ratios = {"skip": [], "last_seen": []}
    for round_ in range(9):
        order = names[round_ % 3 :] + names[: round_ % 3]
        times = {name: epoch(name) for name in order}
        for name in ratios:
            ratios[name].append(times[name] / times["plain"])
    for name, per_round in ratios.items():
        ratio = np.median(per_round)
        print(f"{name}: {ratio:.2f}x plain ASSpeed's epoch, median of rounds")
        assert ratio < 1.25, (name, ratio, np.round(per_round, 2))


def sentence_data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 6)).astype("float32")
    return x, (x[:, :NUM_CLASSES].argmax(-1)).astype("int32")


def small_model(seed=1):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(NUM_CLASSES)(hidden))


@pytest.mark.parametrize("jit_compile", JIT)
def test_last_seen_trains_on_fewer_and_round_trips(tmp_path, jit_compile):
    x, y = sentence_data()
    f = filters.SkipMaskedLastSeen(
        64, revisit=0.3, seed=1, max_skipped_epochs=2
    )
    skip = filters.SkipMasked(score_training=False, score_margin=0.1)
    wrapped = kas.ASSpeed(small_model(), sample_filter=[f, skip])
    wrapped.compile(
        optimizer=keras.optimizers.Adam(0.03),
        loss=kas.ASSoftmaxLoss(0.3),
        metrics=["accuracy"],
        jit_compile=jit_compile,
    )
    logs = wrapped.fit(
        filters.with_sample_ids(x), y, batch_size=8, epochs=6, verbose=0
    ).history
    assert logs["trained_fraction"][0] == 1.0  # the first epoch trains on all
    assert min(logs["trained_fraction"][1:]) < 1.0
    assert logs["scored_fraction"][0] == 0.0
    # The measured break-even (or its start, while it cannot tell).
    threshold = float(ops.convert_to_numpy(wrapped._min_masked_ratio))
    assert 0.05 <= threshold <= 0.95
    memory = ops.convert_to_numpy(wrapped._memory)
    assert 0.0 < wrapped.last_seen_masked_fraction < 1.0
    path = str(tmp_path / "filtered.keras")
    wrapped.save(path)
    loaded = keras.saving.load_model(path)
    assert [type(g) for g in loaded.sample_filters] == [
        filters.SkipMaskedLastSeen,
        filters.SkipMasked,
    ]
    assert loaded.sample_filters[0].get_config() == f.get_config()
    assert loaded.sample_filters[1].get_config() == skip.get_config()
    np.testing.assert_array_equal(ops.convert_to_numpy(loaded._memory), memory)
    assert float(ops.convert_to_numpy(loaded._min_masked_ratio)) == threshold
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0),
        wrapped.predict(x, verbose=0),
        rtol=1e-5,
        atol=1e-6,
    )
    # Prediction and evaluation also take inputs with ids.
    loaded.evaluate(filters.with_sample_ids(x), y, verbose=0)


def test_resume_mid_epoch_keeps_filters_and_memory(tmp_path):
    # Interrupted in the third epoch, with both filters skipping: the
    # resumed run restores the weights, the queues, the memory and the
    # epoch, and ends where an uninterrupted run does.
    x, y = sentence_data()
    inputs = filters.with_sample_ids(x)

    def fresh():
        wrapped = kas.ASSpeed(
            small_model(),
            sample_filter=[
                filters.SkipMaskedLastSeen(64, revisit=0.3, seed=1),
                filters.SkipMasked(0.0),
            ],
        )
        wrapped.compile(
            optimizer=keras.optimizers.Adam(0.03),
            loss=kas.ASSoftmaxLoss(0.3),
            jit_compile=JIT[0],
        )
        return wrapped

    def fit(wrapped, callbacks=()):
        return wrapped.fit(
            inputs,
            y,
            batch_size=8,
            epochs=4,
            shuffle=False,
            verbose=0,
            callbacks=list(callbacks),
        ).history

    reference = fresh()
    logs = fit(reference)
    assert min(logs["trained_fraction"][1:]) < 1.0  # the filters skipped

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            if self.epoch == 2 and batch == 3:
                raise RuntimeError("interrupted")

    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(RuntimeError, match="interrupted"):
        fit(fresh(), [backup, Interrupt()])
    resumed = fresh()  # a new process would start from scratch like this
    resumed_logs = fit(resumed, [backup])
    assert resumed_logs["trained_fraction"] == logs["trained_fraction"][2:]
    for a, b in zip(reference.weights, resumed.weights):
        np.testing.assert_allclose(
            ops.convert_to_numpy(a), ops.convert_to_numpy(b), atol=1e-6
        )


def test_a_second_fit_reuses_the_compiled_step():
    x, y = sentence_data()
    wrapped = kas.ASSpeed(
        small_model(),
        sample_filter=[
            filters.SkipMaskedLastSeen(64, seed=1),
            filters.SkipMasked(),
        ],
    )
    wrapped.compile(
        optimizer=keras.optimizers.Adam(0.03),
        loss=kas.ASSoftmaxLoss(0.3),
        jit_compile=JIT[0],
    )
    inputs = filters.with_sample_ids(x)
    wrapped.fit(inputs, y, batch_size=8, epochs=2, verbose=0)
    train_function = wrapped.train_function
    logs = wrapped.fit(
        inputs, y, batch_size=8, epochs=3, initial_epoch=2, verbose=0
    ).history
    assert wrapped.train_function is train_function
    # The schedule follows `fit`'s epochs: epoch 2 skips, and a new `fit`
    # from epoch 0 warms up again.
    assert logs["trained_fraction"][0] < 1.0
    logs = wrapped.fit(inputs, y, batch_size=8, epochs=1, verbose=0).history
    assert wrapped.train_function is train_function
    assert logs["trained_fraction"] == [1.0]


@pytest.mark.parametrize("jit_compile", JIT)
def test_infobatch_trains_softmax_on_fewer_and_round_trips(
    tmp_path, jit_compile
):
    x, y = sentence_data()
    f = filters.InfoBatch(64, prune=0.5, seed=2)
    wrapped = kas.ASSpeed(small_model(), max_steps=1, sample_filter=f)
    wrapped.compile(
        optimizer=keras.optimizers.Adam(0.03),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    logs = wrapped.fit(
        filters.with_sample_ids(x), y, batch_size=8, epochs=8, verbose=0
    ).history
    fractions = logs["trained_fraction"]
    # Everything in the first epoch and in the annealed last one (12.5%).
    assert fractions[0] == 1.0 and fractions[-1] == 1.0
    assert 0.5 <= min(fractions[1:-1]) < 1.0
    assert logs["accum_steps"][-1] == 1
    memory = ops.convert_to_numpy(wrapped._memory)
    assert wrapped._memory.name == "last_seen_loss"
    # Losses, not 0/1 flags.
    assert memory.min() >= 0.0 and np.any((memory > 0.0) & (memory < 1.0))
    path = str(tmp_path / "infobatch.keras")
    wrapped.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.sample_filters[0].get_config() == f.get_config()
    np.testing.assert_array_equal(ops.convert_to_numpy(loaded._memory), memory)


def test_index_dataset_ids_follow_samples_through_shuffling():
    import tensorflow as tf

    x, y = sentence_data()
    data = filters.index_dataset(tf.data.Dataset.from_tensor_slices((x, y)))
    batches = list(data.shuffle(64, seed=0).batch(8).as_numpy_iterator())
    for inputs, labels in batches:
        ids = inputs[filters.SAMPLE_ID_KEY]
        assert ids.dtype == np.int32
        np.testing.assert_array_equal(inputs[filters.INPUTS_KEY], x[ids])
        np.testing.assert_array_equal(labels, y[ids])
    ids = np.concatenate([b[0][filters.SAMPLE_ID_KEY] for b in batches])
    np.testing.assert_array_equal(np.sort(ids), np.arange(64))

    wrapped = kas.ASSpeed(
        small_model(), sample_filter=filters.SkipMaskedLastSeen(64, seed=1)
    )
    wrapped.compile(
        optimizer=keras.optimizers.Adam(0.03), loss=kas.ASSoftmaxLoss(0.3)
    )
    wrapped.fit(data.shuffle(64, seed=0).batch(8), epochs=4, verbose=0)
    assert 0.0 < wrapped.last_seen_masked_fraction < 1.0


def test_token_rows_with_ignored_positions():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 5, 6)).astype("float32")
    y = x[..., :NUM_CLASSES].argmax(-1).astype("int32")
    y[:, 3:] = -1
    inputs = keras.Input((5, 6))
    model = keras.Model(inputs, keras.layers.Dense(NUM_CLASSES)(inputs))
    wrapped = kas.ASSpeed(
        model, sample_filter=filters.SkipMasked(0.0, warmup_epochs=0)
    )
    wrapped.compile(
        optimizer=keras.optimizers.Adam(0.05),
        loss=kas.ASSoftmaxLoss(0.3, ignore_class=-1),
        jit_compile=JIT[0],
    )
    logs = wrapped.fit(x, y, batch_size=8, epochs=8, verbose=0).history
    assert logs["masked_ratio"][-1] > 0.2
    assert logs["trained_fraction"][-1] < 1.0


def test_bad_input():
    with pytest.raises(ValueError, match="revisit"):
        filters.SkipMaskedLastSeen(10, revisit=1.5)
    with pytest.raises(ValueError, match="revisit"):
        filters.SkipMaskedLastSeen(10, revisit=0.0)
    with pytest.raises(ValueError, match="max_skipped_epochs"):
        filters.SkipMaskedLastSeen(10, max_skipped_epochs=0)
    with pytest.raises(ValueError, match="num_samples"):
        filters.SkipMaskedLastSeen(0)
    with pytest.raises(ValueError, match="min_masked_ratio"):
        filters.SkipMasked(min_masked_ratio=-0.1)
    with pytest.raises(ValueError, match="score_training.*'no'"):
        filters.SkipMasked(score_training="no")
    with pytest.raises(ValueError, match=r"score_margin.*\[0, 1\].*1.5"):
        filters.SkipMasked(score_margin=1.5)
    with pytest.raises(ValueError, match="score_precision.*'float16'"):
        filters.SkipMasked(score_precision="float16")
    config = filters.SkipMasked(score_precision="bfloat16").get_config()
    assert filters.SkipMasked.from_config(config).score_precision == "bfloat16"
    with pytest.raises(ValueError, match="sample_filter"):
        kas.ASSpeed(small_model(), sample_filter="skip")
    with pytest.raises(ValueError, match="prune"):
        filters.InfoBatch(10, prune=1.0)
    with pytest.raises(ValueError, match="prune"):
        filters.InfoBatch(10, prune=-0.1)
    with pytest.raises(ValueError, match="last-seen filter first"):
        kas.ASSpeed(
            small_model(),
            sample_filter=[filters.SkipMasked(), filters.SkipMaskedLastSeen(4)],
        )
    x, y = sentence_data(32)
    wrapped = kas.ASSpeed(
        small_model(), sample_filter=filters.SkipMaskedLastSeen(16)
    )
    wrapped.compile(optimizer="sgd", loss=kas.ASSoftmaxLoss(0.3))
    with pytest.raises(ValueError, match=r"\[0, 16\).*\[0, 31\]"):
        wrapped.fit(filters.with_sample_ids(x), y, batch_size=8, verbose=0)
    with pytest.raises(ValueError, match="sample_id"):
        wrapped.fit(x, y, batch_size=8, verbose=0)
    wrapped = kas.ASSpeed(small_model(), sample_filter=filters.SkipMasked())
    wrapped.compile(
        optimizer="sgd", loss=kas.ASSoftmaxLoss(0.3, reduction="mean")
    )
    with pytest.raises(ValueError, match="reduction"):
        wrapped.fit(x, y, batch_size=8, verbose=0)
    if BACKEND != "jax":
        wrapped = kas.ASSpeed(
            small_model(),
            sample_filter=filters.SkipMasked(score_precision="bfloat16"),
        )
        wrapped.compile(optimizer="sgd", loss=kas.ASSoftmaxLoss(0.3))
        with pytest.raises(ValueError, match="score_precision=None.*bfloat16"):
            wrapped.fit(x, y, batch_size=8, verbose=0)
