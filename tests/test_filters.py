"""Sample filters: the queue, the pipeline's bookkeeping, and training."""

import importlib.util
import json
import re
import sys
import types
import warnings

import keras
import numpy as np
import pytest
from keras import ops

import keras_as_softmax as kas
from keras_as_softmax import filters
from keras_as_softmax.training import _filtering
from keras_as_softmax.training import _layout
from keras_as_softmax.training import _queue
from keras_as_softmax.training import _rows
from tests.backend_utils import BACKEND
from tests.backend_utils import MaskedTagger
from tests.backend_utils import release

# `jit_compile` values, through the fixture below: on TensorFlow also
# "one_program", XLA with a filtered step in one program.
JIT = {"tensorflow": [True, False, "one_program"], "jax": [True]}.get(
    BACKEND, [False]
)
COMPILED = [mode for mode in JIT if mode] or JIT
NUM_CLASSES = 4


@pytest.fixture
def jit_compile(request, monkeypatch):
    """`compile`'s `jit_compile`. For "one_program", True with a filtered
    step compiled as one XLA program, as on one GPU or TPU; on CPUs it
    is by default a graph whose passes are XLA functions."""
    if request.param != "one_program":
        return request.param
    from keras_as_softmax.training import _tensorflow

    monkeypatch.setattr(
        _tensorflow.ASSpeedTrainer, "_tf_filtered_step", "one_program"
    )
    return True


# ------------------------------------------------------------------ queue


def test_queue_appends_kept_rows_in_order_and_pops_the_front():
    queue = _queue.RowQueue([np.zeros((8, 1), "int32")], np.int32(0))

    def push_pop(queue, values, keep):
        rows = [np.array(values, "int32")[:, None]]
        popped, ready, queue = _queue.push_pop(
            queue, rows, np.array(keep, bool), 4
        )
        waiting = ops.convert_to_numpy(queue.buffers[0])[: int(queue.count)]
        return ops.convert_to_numpy(popped[0])[:, 0], bool(ready), waiting

    popped, ready, waiting = push_pop(queue, [0, 1, 2, 3], [1, 0, 1, 1])
    assert not ready
    np.testing.assert_array_equal(waiting[:, 0], [0, 2, 3])
    queue = _queue.RowQueue([np.array([[0], [2], [3], *[[9]] * 5])], 3)
    popped, ready, waiting = push_pop(queue, [10, 11, 12, 13], [0, 1, 0, 1])
    assert ready
    np.testing.assert_array_equal(popped, [0, 2, 3, 11])
    np.testing.assert_array_equal(waiting[:, 0], [13])
    # A short batch, all kept, fills the front exactly.
    queue = _queue.RowQueue([np.array([[5], *[[9]] * 7])], 1)
    popped, ready, waiting = push_pop(queue, [20, 21, 22], [1, 1, 1])
    assert ready and len(waiting) == 0
    np.testing.assert_array_equal(popped, [5, 20, 21, 22])


def test_layout_packs_a_rows_leaves_into_one_buffer_per_dtype():
    layout = _layout.Layout(
        [((3,), "int32"), ((2, 2), "float32"), ((), "int32"), ((), "bool")],
        rows=True,
    )
    assert layout.dtypes == ["int32", "float32", "bool"]
    assert layout.widths == [4, 4, 1]
    rng = np.random.default_rng(0)
    leaves = [
        rng.integers(0, 9, (5, 3)).astype("int32"),
        rng.normal(size=(5, 2, 2)).astype("float32"),
        np.arange(5, dtype="int32"),
        np.array([True, False, True, True, False]),
    ]
    packed = layout.pack([ops.convert_to_tensor(a) for a in leaves])
    assert [tuple(ops.shape(b)) for b in packed] == [(5, 4), (5, 4), (5, 1)]
    for a, b in zip(leaves, layout.unpack(packed)):
        np.testing.assert_array_equal(ops.convert_to_numpy(b), a)


def test_layout_keeps_a_wide_row_leaf_in_a_buffer_of_its_own():
    # Packed beside the others, it would be copied at every push and pop.
    wide = (2, _layout.Layout.OWN_BUFFER_WIDTH // 2)
    leaves = [((), "float32"), (wide, "float32"), ((3,), "float32")]
    layout = _layout.Layout(leaves, rows=True)
    assert layout.buffer_shapes(4) == [
        ((4, 4), "float32"),
        ((4, _layout.Layout.OWN_BUFFER_WIDTH), "float32"),
    ]
    rng = np.random.default_rng(0)
    values = [rng.normal(size=(4, *s)).astype("float32") for s, _ in leaves]
    packed = layout.pack([ops.convert_to_tensor(a) for a in values])
    for a, b in zip(values, layout.unpack(packed)):
        np.testing.assert_array_equal(ops.convert_to_numpy(b), a)
    # Without a row axis (the optimizer's sums), one buffer per dtype.
    assert len(_layout.Layout(leaves).buffer_shapes()) == 1


def test_layout_packs_tensors_end_to_end_without_a_row_axis():
    # As the accumulating optimizer holds the gradient sums of every weight.
    layout = _layout.Layout([((3, 2), "float32"), ((4,), "float32")])
    assert layout.buffer_shapes() == [((10,), "float32")]
    rng = np.random.default_rng(0)
    leaves = [rng.normal(size=s).astype("float32") for s in ((3, 2), (4,))]
    (packed,) = layout.pack([ops.convert_to_tensor(a) for a in leaves])
    flat = np.concatenate([a.ravel() for a in leaves])
    np.testing.assert_array_equal(ops.convert_to_numpy(packed), flat)
    for a, b in zip(leaves, layout.unpack([packed])):
        np.testing.assert_array_equal(ops.convert_to_numpy(b), a)


# ----------------------------------------------------- the pipeline alone


class RecordingHooks:
    """Eager hooks: the 'model' masks the samples listed in `easy`."""

    def __init__(self, easy):
        self.easy = easy
        self.trained, self.scored = [], []

    def maybe_score(self, pred, x):
        no_penalty = ops.zeros((), "float32")
        if not bool(ops.convert_to_numpy(pred)):
            rows = len(ops.convert_to_numpy(x))
            return ops.zeros((rows, NUM_CLASSES), "float32"), no_penalty
        logits, ids = self._predict(x)
        self.scored.append(ids)
        return ops.convert_to_tensor(logits), no_penalty

    def maybe_train(self, pred, x, y, coefficients):
        if not bool(ops.convert_to_numpy(pred)):
            rows = len(ops.convert_to_numpy(x))
            zeros = ops.zeros((rows,), "float32")
            logits = ops.zeros((rows, NUM_CLASSES), "float32")
            return [zeros[:1]], logits, zeros, ops.sum(zeros)
        logits, ids = self._predict(x)
        self.trained.append((ids, ops.convert_to_numpy(coefficients)))
        logits = ops.convert_to_tensor(logits)
        values = _filtering.row_values(kas.ASSoftmaxLoss(0.3), y, logits)
        return [ops.zeros((1,), "float32")], logits, values, ops.sum(values)

    def _predict(self, x):
        ids = ops.convert_to_numpy(x)[:, 0].astype(int)
        logits = np.zeros((len(ids), NUM_CLASSES), "float32")
        logits[np.isin(ids, list(self.easy)), 0] = 10.0  # label 0: masked
        return logits, ids


def run_pipeline(
    sample_filter, easy, n=32, batch=4, epochs=3, step=_filtering.filtered_step
):
    sample_filter = filters.base.as_list(sample_filter)
    last_seen = next((f for f in sample_filter if not f.scores), None)
    skip = next((f for f in sample_filter if f.scores), None)
    leaves = [
        ((1,), "float32"),
        ((), "float32"),
        ((), "float32"),
        ((), "float32"),
        ((), "int32"),
        ((), "float32"),
        ((), "float32"),
    ]

    layout = _layout.Layout(leaves, rows=True)

    def queue():
        return _queue.RowQueue(
            [
                ops.zeros((2 * batch, width), dtype)
                for dtype, width in zip(layout.dtypes, layout.widths)
            ],
            ops.convert_to_tensor(0, "int32"),
        )

    state = _filtering.FilterState(
        score_queue=queue() if last_seen and skip else None,
        train_queue=queue(),
        states=[
            {
                k: ops.full(shape, value, dtype)
                for k, (shape, dtype, value) in f.state_spec().items()
            }
            for f in sample_filter
        ],
    )
    epoch = [0]
    engine = types.SimpleNamespace(
        filters=sample_filter,
        batch_size=batch,
        layout=layout,
        row_tail=(),
        epoch_state=lambda: (epoch[0], epochs),
    )
    hooks = RecordingHooks(easy)
    rng = np.random.default_rng(0)
    per_epoch = []
    for e in range(epochs):
        epoch[0] = e
        start = len(hooks.trained)
        for ids in rng.permutation(n).reshape(-1, batch):
            x = ops.convert_to_tensor(ids[:, None], "float32")
            y = ops.zeros((batch,), "float32")
            draws = ops.convert_to_tensor(
                rng.uniform(size=batch).astype("float32")
            )
            output, state = step(
                engine,
                kas.ASSoftmaxLoss(0.3),
                state,
                x,
                y,
                None,
                ops.convert_to_tensor(ids, "int32"),
                lambda index, size, draws=draws: draws[:size],
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


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's eager queue")
@pytest.mark.parametrize(
    "make_filter",
    [
        lambda: filters.SkipMasked(min_masked_ratio=0.0),
        lambda: [
            filters.SkipMaskedLastSeen(32, revisit=0.25),
            filters.SkipMasked(0.0),
        ],
        lambda: filters.InfoBatch(32, prune=0.75, anneal_fraction=0.0),
    ],
    ids=["skip_masked", "both", "infobatch"],
)
def test_eager_queue_runs_the_static_queues_passes(make_filter):
    import functools

    from keras_as_softmax.training._torch import EagerQueue

    easy = set(range(0, 32, 2))
    eager_step = functools.partial(
        _filtering.filtered_step, queue_ops=EagerQueue
    )
    static, _, static_state = run_pipeline(make_filter(), easy)
    eager, _, eager_state = run_pipeline(make_filter(), easy, step=eager_step)
    # The same rows waiting in the queues (the stale ones may differ).
    for name in ("score_queue", "train_queue"):
        a, b = getattr(eager_state, name), getattr(static_state, name)
        assert (a is None) == (b is None)
        if a is None:
            continue
        count = int(a.count)
        assert count == int(b.count)
        for x, y in zip(a.buffers, b.buffers):
            np.testing.assert_array_equal(
                ops.convert_to_numpy(x)[:count], ops.convert_to_numpy(y)[:count]
            )
    assert len(eager.trained) == len(static.trained)
    for (ids, coefficients), (ids_, coefficients_) in zip(
        eager.trained, static.trained
    ):
        np.testing.assert_array_equal(ids, ids_)
        np.testing.assert_array_equal(coefficients, coefficients_)


class T:
    """NumPy constructors that return backend tensors, as the filters get
    them from the step (PyTorch does not mix its tensors with arrays)."""

    @staticmethod
    def array(*args, **kwargs):
        return ops.convert_to_tensor(np.array(*args, **kwargs))

    @staticmethod
    def ones(*args, **kwargs):
        return ops.convert_to_tensor(np.ones(*args, **kwargs))

    @staticmethod
    def zeros(*args, **kwargs):
        return ops.convert_to_tensor(np.zeros(*args, **kwargs))

    @staticmethod
    def int32(value):
        return ops.convert_to_tensor(value, "int32")


def test_revisited_samples_are_weighted_by_the_inverse_probability():
    f = filters.SkipMaskedLastSeen(100, revisit=0.25, max_skipped_fraction=1.0)
    was = T.array([True, True, False, True])
    keep, weight = f.revisit_some(was, T.array([0.1, 0.9, 0.9, 0.2], "float32"))
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
    keep, weight = capped.revisit_some(
        T.ones(4, bool), T.array([0.1, 0.4, 0.6, 0.9], "float32")
    )
    np.testing.assert_array_equal(
        ops.convert_to_numpy(keep), [True, True, False, False]
    )
    np.testing.assert_allclose(
        ops.convert_to_numpy(weight), [2.0, 2.0, 1.0, 1.0]
    )


def test_infobatch_prunes_below_mean_losses_and_rescales():
    f = filters.InfoBatch(100, prune=0.75)
    memory = T.array([1.0, 0.2, 3.0, 0.1, 0.0, 2.0], "float32")  # mean 1.05
    remembered = memory[:4]
    candidate = f.candidates(remembered, memory, 1)
    np.testing.assert_array_equal(
        ops.convert_to_numpy(candidate), [True, True, False, True]
    )
    keep, weight = f.revisit_some(
        candidate, T.array([0.1, 0.9, 0.1, 0.2], "float32")
    )
    # No cap: a below-mean sample is kept with probability 1 - prune.
    np.testing.assert_array_equal(
        ops.convert_to_numpy(keep), [True, False, True, True]
    )
    np.testing.assert_allclose(
        ops.convert_to_numpy(weight), [4.0, 1.0, 1.0, 4.0]
    )
    np.testing.assert_array_equal(
        ops.convert_to_numpy(f.masked_when_seen({f.memory_name: memory})),
        [0, 0, 0, 0, 1, 0],
    )
    # What a pass records: each sample's mean loss over its counted rows.
    values = T.array([[0.5, 1.5, 9.0], [0.0, 0.0, 0.0]], "float32")
    counted = T.array([[True, True, False], [True, False, False]])
    masked = ops.logical_and(counted, ops.equal(values, 0.0))
    memory = observe(f, T.ones(4, "float32"), [2, 0], counted, masked, values)
    np.testing.assert_allclose(ops.convert_to_numpy(memory), [0, 1, 1, 1])


def test_infobatch_prunes_no_sample_before_it_is_seen():
    f = filters.InfoBatch(4, prune=0.75)
    # Samples 2 and 3 not seen yet: no candidates, and out of the mean.
    memory = T.array([2.0, 1.2, f.memory_initial, f.memory_initial], "float32")
    candidate = f.candidates(memory, memory, 0)
    np.testing.assert_array_equal(
        ops.convert_to_numpy(candidate), [False, True, False, False]
    )
    np.testing.assert_array_equal(
        ops.convert_to_numpy(f.masked_when_seen({f.memory_name: memory})),
        [0, 0, 0, 0],
    )
    # Nothing seen: nothing left out.
    memory = ops.full((4,), f.memory_initial, "float32")
    assert not np.any(ops.convert_to_numpy(f.candidates(memory, memory, 0)))
    # A pass writes the losses of the samples it ran on only.
    values = T.array([[0.5], [3.0]], "float32")
    counted = T.ones((2, 1), bool)
    memory = observe(
        f, memory, [3, 1], counted, ops.zeros_like(counted), values
    )
    np.testing.assert_allclose(
        ops.convert_to_numpy(memory), [-np.inf, 3.0, -np.inf, 0.5]
    )
    np.testing.assert_array_equal(
        ops.convert_to_numpy(f.candidates(memory, memory, 0)),
        [False, False, False, True],
    )
    # Files saved before the sentinel hold 1.0 where nothing was seen:
    # those samples count as seen with a loss of 1, as they did then.
    memory = T.array([2.0, 1.2, 1.0, 1.0], "float32")  # mean 1.3
    np.testing.assert_array_equal(
        ops.convert_to_numpy(f.candidates(memory, memory, 0)),
        [False, True, True, True],
    )


def observe(f, memory, ids, counted, masked, values, epoch=3):
    """The memory after a pass that ran on `ids` saw these rows."""
    seen = filters.base.Seen(
        T.array(ids, "int32"),
        T.ones(len(ids), bool),
        _filtering._sample_loss(counted, values),
        _filtering._sample_masked(counted, masked),
        0.0,
        0.0,
        T.int32(epoch),
    )
    update = f.observe(seen, {f.memory_name: memory})[f.memory_name]
    return _rows.write_rows(memory, update)


def test_last_seen_memory_ages_out_after_max_skipped_epochs():
    f = filters.SkipMaskedLastSeen(4, max_skipped_epochs=2)
    # Sample 0 seen with a gradient, 1 and 2 seen masked, 3 not written.
    memory = observe(
        f,
        T.zeros(4, "float32"),
        [0, 1, 2],
        T.ones((3,), bool),
        T.array([False, True, True]),
        T.array([0.7, 0.0, 0.0], "float32"),
        epoch=1,
    )
    np.testing.assert_allclose(ops.convert_to_numpy(memory), [0, 2, 2, 0])
    np.testing.assert_array_equal(
        ops.convert_to_numpy(f.masked_when_seen({f.memory_name: memory})),
        [0, 1, 1, 0],
    )
    # Left out in epochs 2 and 3, seen again in epoch 4.
    for epoch, expected in [(2, True), (3, True), (4, False)]:
        candidate = f.candidates(memory, memory, T.int32(epoch))
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


def test_draws_are_uniform_and_a_function_of_seed_and_counter():
    backend = importlib.import_module(
        f"keras_as_softmax.training._{keras.backend.backend()}"
    )
    stateless_uniform = backend.stateless_uniform

    def draws(size, seed, counter):
        seed = ops.convert_to_tensor(seed, "int32")
        counter = ops.convert_to_tensor(counter, "int32")
        return ops.convert_to_numpy(stateless_uniform(size, seed, counter))

    first = draws(20000, 7, 3)
    assert 0.0 <= first.min() and first.max() < 1.0
    assert abs(first.mean() - 0.5) < 0.01
    np.testing.assert_array_equal(draws(20000, 7, 3), first)
    for other in (draws(20000, 7, 4), draws(20000, 8, 3)):
        assert abs(np.corrcoef(first, other)[0, 1]) < 0.03
        assert np.mean(first == other) < 0.01


# --------------------------------------------------------------- training


def identity_model(**regularizers):
    """Logits = inputs @ W with W = I at first, so the data picks the masks;
    `regularizers` go to the `Dense` layer."""
    inputs = keras.Input((NUM_CLASSES,))
    outputs = keras.layers.Dense(
        NUM_CLASSES, kernel_initializer="identity", **regularizers
    )(inputs)
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


def fit_window(sample_filter, jit_compile, classes="kept", **regularizers):
    x, y, weights = two_batches()
    model = identity_model(**regularizers)
    wrapped = kas.ASSpeed(
        model, lam=0.5, max_steps=2, sample_filter=sample_filter
    )
    wrapped.accumulation_steps = 2
    wrapped.compile(
        optimizer=keras.optimizers.SGD(0.5),
        loss=kas.ASSoftmaxLoss(0.3, classes=classes),
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


@pytest.mark.parametrize(
    "score_training, regularizers, classes",
    [
        (True, {}, "kept"),
        (False, {}, "kept"),
        (True, {"kernel_regularizer": keras.regularizers.L2(0.05)}, "kept"),
        (True, {}, "all"),
    ],
    ids=["score_training", "score_inference", "weight_penalty", "all_classes"],
)
@pytest.mark.parametrize("jit_compile", JIT, indirect=True)
def test_skip_masked_gives_the_plain_update(
    jit_compile, score_training, regularizers, classes
):
    """A window of two batches with two unmasked samples each: one training
    pass on the four, with their batches' coefficients, equals the plain
    accumulated update (without dropout, in either scoring mode). A
    weight's penalty acts once in the update, as in the plain one's mean
    of two micro-batches that each held it, not once per training pass.
    With softmax cross entropy on the rows not masked (`classes="all"`)
    as well."""
    plain, plain_logs = fit_window(
        None, jit_compile, classes=classes, **regularizers
    )
    skip, skip_logs = fit_window(
        filters.SkipMasked(
            0.0,
            warmup_epochs=0,
            score_training=score_training,
        ),
        jit_compile,
        classes=classes,
        **regularizers,
    )
    assert not np.allclose(plain.get_weights()[0], np.eye(NUM_CLASSES))
    for a, b in zip(plain.get_weights(), skip.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert skip_logs["trained_fraction"][0] == 0.5
    np.testing.assert_allclose(
        skip_logs["masked_ratio"][0], plain_logs["masked_ratio"][0]
    )


@pytest.mark.parametrize("jit_compile", JIT, indirect=True)
def test_drawn_batches_without_a_training_pass_update_nothing(jit_compile):
    """Every sample masked: `SkipMasked` runs no training pass, so no
    window holds a gradient and the optimizer takes no step. An update of
    zero gradient would still move the weights by AdamW's weight decay."""
    x, y, _ = two_batches()
    x = 8.0 * np.eye(NUM_CLASSES, dtype="float32")[y]  # every sample masked
    model = identity_model()
    wrapped = kas.ASSpeed(
        model,
        max_steps=1,
        sample_filter=filters.SkipMasked(0.0, warmup_epochs=0),
    )
    wrapped.compile(
        optimizer=keras.optimizers.AdamW(0.1, weight_decay=0.5),
        loss=kas.ASSoftmaxLoss(0.3),
        jit_compile=jit_compile,
    )
    logs = wrapped.fit(x, y, batch_size=4, epochs=2, verbose=0).history
    assert logs["trained_fraction"] == [0.0, 0.0]
    assert logs["masked_ratio"] == [1.0, 1.0]
    np.testing.assert_array_equal(model.get_weights()[0], np.eye(NUM_CLASSES))
    assert int(ops.convert_to_numpy(wrapped.optimizer.iterations)) == 0


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
    share = wrapped.filter_engine.states[0]["masked_share"]
    assert float(ops.convert_to_numpy(share)) < 1 / 3


def test_skip_masked_follows_the_share_of_masked_samples_not_rows():
    """A sequence is left out only when all of its tokens are masked, so
    the break-even share is one of samples: here 5 of 6 tokens are
    masked, and 1 of 2 sequences."""
    counted = ops.ones((2, 3), "bool")
    masked = ops.convert_to_tensor([[True, True, True], [True, True, False]])
    values = ops.convert_to_tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.7]])
    rows = types.SimpleNamespace(
        ids=ops.zeros((2,), "int32"),
        counted=ops.zeros((2,), "float32"),  # not seen earlier this step
    )
    n_rows, n_masked, seen = _filtering._pass_counts(
        rows, True, counted, masked, values, 3
    )
    # AS-Speed's rule counts tokens; the filters, sequences.
    assert float(ops.convert_to_numpy(n_rows)) == 6.0
    assert float(ops.convert_to_numpy(n_masked)) == 5.0
    assert float(ops.convert_to_numpy(seen.samples)) == 2.0
    assert float(ops.convert_to_numpy(seen.masked_samples)) == 1.0
    f = filters.SkipMasked()
    share = f.observe(seen, {"masked_share": ops.zeros(())})["masked_share"]
    np.testing.assert_allclose(ops.convert_to_numpy(share), 0.1 * 0.5)
    # A training pass over rows a scoring pass saw counts none of them.
    rows.counted = ops.ones((2,), "float32")
    n_rows, _, seen = _filtering._pass_counts(
        rows, True, counted, masked, values, 3
    )
    assert float(ops.convert_to_numpy(n_rows)) == 0.0
    assert float(ops.convert_to_numpy(seen.samples)) == 0.0


@pytest.mark.parametrize("jit_compile", JIT, indirect=True)
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


@pytest.mark.parametrize("jit_compile", JIT, indirect=True)
def test_filters_train_with_a_float64_floatx(jit_compile):
    """Under `keras.config.set_floatx("float64")` Keras's default integer
    is int64: the queues' arithmetic stays int32 (a Python int in a
    `where` made the step refuse to trace)."""
    x, y = sentence_data()
    keras.config.set_floatx("float64")
    try:
        wrapped = kas.ASSpeed(
            small_model(),
            sample_filter=[
                filters.SkipMaskedLastSeen(64, seed=0),
                filters.SkipMasked(0.0, warmup_epochs=0),
            ],
        )
        wrapped.compile(
            optimizer=keras.optimizers.Adam(0.05),
            loss=kas.ASSoftmaxLoss(0.3),
            jit_compile=jit_compile,
        )
        logs = wrapped.fit(
            filters.with_sample_ids(x.astype("float64")),
            y,
            batch_size=8,
            epochs=3,
            verbose=0,
        ).history
    finally:
        keras.config.set_floatx("float32")
    assert logs["scored_fraction"][-1] > 0.0
    assert np.isfinite(logs["loss"]).all()


def sentence_data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 6)).astype("float32")
    return x, (x[:, :NUM_CLASSES].argmax(-1)).astype("int32")


def small_model(seed=1):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(NUM_CLASSES)(hidden))


def test_filters_train_on_any_input_keras_takes_as_on_its_arrays():
    """A PyDataset, a generator and a torch DataLoader of the same batches
    train the weights the arrays do: the filters' queues are shaped after
    the first batch, which a generator gets back."""
    x, y = sentence_data(64)

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8]

    def generator():
        while True:
            for i in range(8):
                yield x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8]

    def fit(*data, **kwargs):
        wrapped = kas.ASSpeed(
            small_model(),
            max_steps=2,
            sample_filter=filters.SkipMasked(
                min_masked_ratio=0.0, warmup_epochs=0
            ),
        )
        wrapped.compile(
            optimizer=keras.optimizers.SGD(0.5), loss=kas.ASSoftmaxLoss(0.3)
        )
        logs = wrapped.fit(
            *data, epochs=2, shuffle=False, verbose=0, **kwargs
        ).history
        return wrapped.get_weights(), logs

    expected, expected_logs = fit(x, y, batch_size=8)
    assert expected_logs["trained_fraction"][-1] < 1.0
    inputs = {
        "PyDataset": (Batches(),),
        "generator": (generator(),),
    }
    if "torch" in sys.modules or importlib.util.find_spec("torch"):
        import torch

        inputs["DataLoader"] = (
            torch.utils.data.DataLoader(
                torch.utils.data.TensorDataset(
                    torch.tensor(x), torch.tensor(y)
                ),
                batch_size=8,
            ),
        )
    for name, data in inputs.items():
        weights, logs = fit(*data, steps_per_epoch=8)
        for a, b in zip(expected, weights, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)
        assert logs["trained_fraction"] == pytest.approx(
            expected_logs["trained_fraction"]
        ), name
    # The generator stays open, as Keras leaves it: a later `fit` draws on.
    logs = fit(inputs["generator"][0], steps_per_epoch=8)[1]
    assert len(logs["trained_fraction"]) == 2

    last_seen = kas.ASSpeed(
        small_model(), sample_filter=filters.SkipMaskedLastSeen(64)
    )
    last_seen.compile("sgd", kas.ASSoftmaxLoss(0.3))

    def with_ids():
        while True:
            yield filters.with_sample_ids(x[:8], np.arange(8)), y[:8]

    with pytest.raises(ValueError, match="Received: a generator"):
        last_seen.fit(with_ids(), steps_per_epoch=8, verbose=0)
    scoring = kas.ASSpeed(small_model(), sample_filter=filters.SkipMasked())
    scoring.compile("sgd", kas.ASSoftmaxLoss(0.3))
    with pytest.raises(ValueError, match="Expected labels"):
        scoring.fit(x, batch_size=8, verbose=0)


@pytest.mark.parametrize("jit_compile", JIT, indirect=True)
def test_rows_of_zero_weight_count_neither_as_rows_nor_masked(jit_compile):
    """`masked_ratio` counts the rows of nonzero weight, also those a
    memory filter leaves out. At a learning rate of 0 and delta 0 every
    sample of nonzero weight is masked (its label is the model's argmax)
    and every other one is not: the ratio is 1.0 in every epoch, with or
    without the filter, whatever the filter's draws and whichever epoch
    trains the rows its queue carries over."""
    x, _ = sentence_data(64)
    weights = (np.arange(64) % 4 == 0).astype("float32")
    logits = small_model().predict(x, verbose=0)
    y = np.where(weights > 0, logits.argmax(-1), logits.argmin(-1))
    logs = {}
    for name, chosen in [
        ("plain", None),
        ("last_seen", filters.SkipMaskedLastSeen(64, warmup_epochs=0, seed=1)),
    ]:
        wrapped = kas.ASSpeed(small_model(), sample_filter=chosen)
        wrapped.compile(
            optimizer=keras.optimizers.SGD(0.0),
            loss=kas.ASSoftmaxLoss(0.0),
            jit_compile=jit_compile,
        )
        inputs = x if chosen is None else filters.with_sample_ids(x)
        logs[name] = wrapped.fit(
            inputs, y, sample_weight=weights, batch_size=8, epochs=3, verbose=0
        ).history
    assert logs["last_seen"]["trained_fraction"][-1] < 1.0
    assert logs["plain"]["masked_ratio"] == [1.0, 1.0, 1.0]
    assert logs["last_seen"]["masked_ratio"] == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("jit_compile", JIT, indirect=True)
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
    memory = state_of(wrapped, "last_seen_masked")
    share = state_of(wrapped, "masked_share")
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
    np.testing.assert_array_equal(state_of(loaded, "last_seen_masked"), memory)
    assert state_of(loaded, "masked_share") == share
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0),
        wrapped.predict(x, verbose=0),
        rtol=1e-5,
        atol=1e-6,
    )
    # Prediction and evaluation also take inputs with ids.
    loaded.evaluate(filters.with_sample_ids(x), y, verbose=0)
    # A weights file loads into a new ASSpeed before its first fit, the
    # queues included, and training goes on.
    weights = str(tmp_path / "filtered.weights.h5")
    wrapped.save_weights(weights)
    fresh = kas.ASSpeed(
        small_model(),
        sample_filter=[
            filters.SkipMaskedLastSeen.from_config(f.get_config()),
            filters.SkipMasked.from_config(skip.get_config()),
        ],
    )
    fresh.load_weights(weights)
    assert len(fresh.weights) == len(wrapped.weights)
    for a, b in zip(wrapped.weights, fresh.weights, strict=True):
        np.testing.assert_array_equal(
            ops.convert_to_numpy(a), ops.convert_to_numpy(b)
        )
    fresh.compile(
        optimizer="adam", loss=kas.ASSoftmaxLoss(0.3), jit_compile=jit_compile
    )
    fresh.fit(filters.with_sample_ids(x), y, batch_size=8, verbose=0)
    with pytest.raises(ValueError, match="queues of an ASSpeed with sample"):
        kas.ASSpeed(small_model()).load_weights(weights)
    other = kas.ASSpeed(small_model(), sample_filter=filters.SkipMasked())
    other.compile(optimizer="adam", loss=kas.ASSoftmaxLoss(0.3))
    other.fit(x, y, batch_size=16, verbose=0)
    with pytest.raises(ValueError, match="Expected: batch_size=16.*=8"):
        other.load_weights(weights)


def spy_on_assign(monkeypatch):
    """The variables `keras.Variable.assign` is called on from now, in a
    list that grows as they are."""
    assigned = []
    assign = keras.Variable.assign

    def recording(variable, value):
        assigned.append(variable)
        return assign(variable, value)

    monkeypatch.setattr(keras.Variable, "assign", recording)
    return assigned


@pytest.mark.parametrize("jit_compile", JIT, indirect=True)
@pytest.mark.parametrize(
    "make_filters",
    [
        lambda: [filters.SkipMaskedLastSeen(64, seed=1)],
        lambda: [filters.InfoBatch(64, seed=1)],
        lambda: [filters.SkipMasked(0.0)],
        lambda: [filters.SkipMaskedLastSeen(64, seed=1), filters.SkipMasked()],
    ],
    ids=["last_seen", "infobatch", "skip_masked", "pair"],
)
def test_a_filtered_step_writes_only_the_rows_it_touches(
    monkeypatch, jit_compile, make_filters
):
    """A step writes the rows it queues, pops or saw in its queues and a
    per-sample memory in place, never a buffer whole: on TensorFlow
    without XLA and on PyTorch an assignment copied it at every step (a
    memory: 0.1 s a step at 10M samples; a queue: in proportion to a
    row's width). JAX scatters into the value, which XLA updates in
    place."""
    if BACKEND == "jax":
        pytest.skip("a step's state is a value on JAX")
    assigned = spy_on_assign(monkeypatch)
    x, y = sentence_data()
    sample_filter = make_filters()
    wrapped = kas.ASSpeed(small_model(), sample_filter=sample_filter)
    wrapped.compile(
        optimizer="adam", loss=kas.ASSoftmaxLoss(0.3), jit_compile=jit_compile
    )
    history = wrapped.fit(
        filters.with_sample_ids(x), y, batch_size=8, epochs=3, verbose=0
    ).history
    assert min(history["trained_fraction"]) < 1.0  # it left samples out
    paths = [v.path for v in assigned]
    assert any(p.endswith("queue_count") for p in paths)  # the spy saw it
    buffers = [p for p in paths if re.search(r"queue_\d+$", p)]
    assert not buffers, buffers
    for f in sample_filter:
        if f.scores:
            continue
        assert not [p for p in paths if p.endswith(f.memory_name)]
        memory = state_of(wrapped, f.memory_name)
        assert np.any(memory != f.memory_initial)  # yet it was written
    queues = [
        q
        for q in (
            wrapped.filter_engine.score_queue,
            wrapped.filter_engine.train_queue,
        )
        if q
    ]
    buffers = [ops.convert_to_numpy(b) for q in queues for b in q.buffers]
    assert any(np.any(b != 0) for b in buffers)  # rows were queued


def _gpu_kernel(op, attrs, devices=("GPU", "DEFAULT")):
    """Whether TensorFlow registers a GPU kernel for `op` with the type
    attributes `attrs` (`{name: DataType enum}`): a kernel of one of the
    device types `devices` (`("XLA_GPU_JIT",)`: XLA compiles it for a
    GPU; listed once the process has compiled with XLA)."""
    from tensorflow.python.framework import kernels

    return any(
        kernel.device_type in devices
        and all(
            attrs[c.name] in c.allowed_values.list.type
            for c in kernel.constraint
            if c.name in attrs
        )
        for kernel in kernels.get_registered_kernels_for_op(op).kernel
    )


# TensorFlow's GPU kernels, listed by a build that has them.
needs_gpu_kernels = pytest.mark.skipif(
    BACKEND != "tensorflow" or not _gpu_kernel("ResourceGather", {"dtype": 1}),
    reason="TensorFlow's GPU kernels",
)
GPU = "/job:localhost/replica:0/task:0/device:GPU:0"


@needs_gpu_kernels
def test_in_place_rows_follow_tensorflows_gpu_kernels():
    """`_rows.in_place` refuses what TensorFlow cannot gather or scatter
    in a variable on a GPU: int32 alone, in its kernel registry."""
    import tensorflow as tf

    dtypes = ("float32", "float16", "bfloat16", "int32", "int64", "bool")
    for dtype in map(tf.as_dtype, (*dtypes, "uint8", "int8")):
        attrs = {"dtype": dtype.as_datatype_enum, "Tindices": 3}
        kernel = _gpu_kernel("ResourceGather", attrs) and _gpu_kernel(
            "ResourceScatterUpdate", attrs
        )
        assert _rows.in_place(dtype, GPU) == kernel, dtype
        assert _rows.in_place(dtype, GPU.replace("GPU", "CPU"))
    assert not _rows.in_place("int32", "")


STEP_FILTERS = pytest.mark.parametrize(
    "make_filters",
    [
        lambda: [filters.SkipMaskedLastSeen(64, seed=1), filters.SkipMasked()],
        lambda: [filters.InfoBatch(64, seed=1)],
        lambda: [filters.SelectiveBackprop(seed=1)],
        lambda: None,
    ],
    ids=["pair", "infobatch", "selective_backprop", "no_filter"],
)


def _step_nodes_on_gpu(monkeypatch, make_filters, jit_compile):
    """The fitted `ASSpeed` model and the nodes of its TensorFlow train
    and test steps, every function's included, built as on a GPU: one XLA
    program if `jit_compile`, else a graph, with `_rows.in_place`
    answering for a GPU. Token ids and labels are int32, whose rows
    TensorFlow cannot gather or scatter in a variable on a GPU."""
    import tensorflow as tf

    in_place = _rows.in_place
    monkeypatch.setattr(_rows, "in_place", lambda t, d: in_place(t, GPU))
    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, (64, 6)).astype("int32")
    y = (x[:, 0] % NUM_CLASSES).astype("int32")
    inputs = keras.Input((6,), dtype="int32")
    pooled = keras.layers.GlobalAveragePooling1D()(
        keras.layers.Embedding(50, 8)(inputs)
    )
    wrapped = kas.ASSpeed(
        keras.Model(inputs, keras.layers.Dense(NUM_CLASSES)(pooled)),
        sample_filter=make_filters(),
    )
    wrapped._tf_filtered_step = "one_program"
    wrapped.compile(
        optimizer="adam",
        loss=kas.ASSoftmaxLoss(0.3),
        metrics=["accuracy"],
        jit_compile=jit_compile,
    )
    x = filters.with_sample_ids(x)
    wrapped.fit(x, y, batch_size=8, verbose=0)
    batch = keras.tree.map_structure(lambda t: tf.constant(t[:8]), x)
    nodes = []
    for step in (wrapped.train_step, wrapped.test_step):
        traced = tf.function(
            step, jit_compile=jit_compile
        ).get_concrete_function((batch, tf.constant(y[:8])))
        graph = traced.graph.as_graph_def()
        nodes += graph.node
        for function in graph.library.function:
            nodes += function.node_def
    return wrapped, nodes


def _kernel_audit(nodes, devices):
    """`(found, missing)`: the `(op, *type attributes)` of `nodes`, and
    those without a kernel of the device types `devices`."""
    found, missing = set(), set()
    for node in nodes:
        attrs = {k: v.type for k, v in node.attr.items() if v.type}
        key = (node.op, *sorted(attrs.items()))
        found.add(key)
        if not _gpu_kernel(node.op, attrs, devices):
            missing.add(key)
    return found, missing


@needs_gpu_kernels
@STEP_FILTERS
def test_a_graph_step_has_gpu_kernels_for_every_variable_op(
    monkeypatch, make_filters
):
    """Each operation of an `ASSpeed` TensorFlow graph step, training and
    evaluation (what `jit_compile=False`, `run_eagerly=True` and several
    replicas run), that reads or writes a variable has a GPU kernel for
    its dtypes, as its variable would be on a GPU: TensorFlow places it
    there or fails."""
    import tensorflow as tf
    from tensorflow.python.framework import op_def_registry

    wrapped, nodes = _step_nodes_on_gpu(monkeypatch, make_filters, False)
    resource = tf.resource.as_datatype_enum
    found, missing = _kernel_audit(
        [
            node
            for node in nodes
            if any(
                a.type == resource
                for a in op_def_registry.get(node.op).input_arg
            )
        ],
        ("GPU", "DEFAULT"),
    )
    assert ("AssignVariableOp", ("dtype", 1)) in found  # the walk saw them
    if wrapped.sample_filters:  # and rows written in place
        assert ("ResourceScatterUpdate", ("Tindices", 3), ("dtype", 1)) in found
    assert not missing, sorted(missing)


@needs_gpu_kernels
@STEP_FILTERS
def test_one_program_step_compiles_for_a_gpu(monkeypatch, make_filters):
    """Each operation of an `ASSpeed` TensorFlow step as one XLA program
    (the default on one GPU), training and evaluation, conditionals'
    branches included, has a kernel that XLA compiles for a GPU, for its
    dtypes; XLA's CPU kernels, which the other tests compile, differ from
    them (int32 convolutions have none on a GPU)."""
    wrapped, nodes = _step_nodes_on_gpu(monkeypatch, make_filters, True)
    found, missing = _kernel_audit(
        # Placeholders are the program's arguments.
        [node for node in nodes if node.op != "Placeholder"],
        ("XLA_GPU_JIT",),
    )
    assert not wrapped._passes_jit_compile  # one program
    assert ("MatMul", ("T", 1)) in found  # the walk saw the passes
    if wrapped.sample_filters:
        assert any(key[0] in ("If", "StatelessIf") for key in found)
    assert not missing, sorted(missing)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's kernels")
@pytest.mark.parametrize("jit_compile", JIT, indirect=True)
def test_int32_rows_read_and_written_whole_train_the_same(
    monkeypatch, jit_compile
):
    """Where a step cannot write an int32 variable's rows in place (a GPU:
    `_rows.in_place`), it assigns the int32 queue buffers whole, and
    trains the weights and queues the in-place step does."""
    import tensorflow as tf

    x, y = sentence_data()

    def fit():
        wrapped = kas.ASSpeed(
            small_model(),
            sample_filter=[
                filters.SkipMaskedLastSeen(64, seed=1),
                filters.SkipMasked(0.0),
            ],
        )
        wrapped.compile(
            optimizer="adam",
            loss=kas.ASSoftmaxLoss(0.3),
            jit_compile=jit_compile,
        )
        history = wrapped.fit(
            filters.with_sample_ids(x), y, batch_size=8, epochs=3, verbose=0
        ).history
        assert min(history["trained_fraction"]) < 1.0
        return [ops.convert_to_numpy(v) for v in wrapped.variables]

    by_rows = fit()
    assigned = spy_on_assign(monkeypatch)
    monkeypatch.setattr(
        _rows, "in_place", lambda dtype, device: tf.as_dtype(dtype) != "int32"
    )
    whole = fit()
    buffers = {
        v.path: v.dtype for v in assigned if re.search(r"queue_\d+$", v.path)
    }
    assert buffers and set(buffers.values()) == {"int32"}, buffers
    for a, b in zip(by_rows, whole):
        np.testing.assert_array_equal(a, b)


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


@pytest.mark.parametrize("jit_compile", JIT, indirect=True)
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
    memory = state_of(wrapped, "last_seen_loss")
    # Losses, not 0/1 flags.
    assert memory.min() >= 0.0 and np.any((memory > 0.0) & (memory < 1.0))
    path = str(tmp_path / "infobatch.keras")
    wrapped.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.sample_filters[0].get_config() == f.get_config()
    np.testing.assert_array_equal(state_of(loaded, "last_seen_loss"), memory)


@pytest.mark.parametrize("jit_compile", JIT, indirect=True)
def test_infobatch_trains_every_sample_before_it_has_seen_it(jit_compile):
    """Without the warm-up epoch (`warmup_epochs=0`, or a first `fit` from
    an `initial_epoch` past it) the first epoch still trains on every
    sample, none reweighted: at a learning rate of 0 it logs the plain
    model's loss. Initial losses are near ln 4 > 1 here."""
    x, y = sentence_data()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    plain = small_model()
    plain.compile(
        optimizer=keras.optimizers.SGD(0.0), loss=loss, jit_compile=jit_compile
    )
    (expected,) = plain.fit(
        x, y, batch_size=8, shuffle=False, verbose=0
    ).history["loss"]
    assert expected > 1.0
    for options, epochs in [
        ({"warmup_epochs": 0}, {"epochs": 3}),
        ({}, {"epochs": 4, "initial_epoch": 1}),
    ]:
        f = filters.InfoBatch(64, seed=0, anneal_fraction=0.0, **options)
        wrapped = kas.ASSpeed(small_model(), max_steps=1, sample_filter=f)
        wrapped.compile(
            optimizer=keras.optimizers.SGD(0.0),
            loss=loss,
            jit_compile=jit_compile,
        )
        logs = wrapped.fit(
            filters.with_sample_ids(x),
            y,
            batch_size=8,
            shuffle=False,
            verbose=0,
            **epochs,
        ).history
        assert logs["trained_fraction"][0] == 1.0, options
        np.testing.assert_allclose(logs["loss"][0], expected, rtol=1e-5)
        # Every sample seen and recorded; then it prunes.
        assert np.all(np.isfinite(state_of(wrapped, "last_seen_loss")))
        assert max(logs["trained_fraction"][1:]) < 1.0, options


def state_of(model, name):
    """A filter state's value, found by its weight's name."""
    (variable,) = [
        v
        for states in model.filter_engine.states
        for k, v in states.items()
        if k == name
    ]
    assert variable.name == name
    return ops.convert_to_numpy(variable)


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


def test_batches_of_another_length_are_refused_by_name():
    """The queues hold rows of the first batch's shape: a batch padded to
    its own length fails with a message that says so (on TensorFlow,
    where the length is unknown until the step runs, TensorFlow's)."""
    rng = np.random.default_rng(0)

    def batches():
        for length in (3, 4, 3, 4):
            x = rng.standard_normal((8, length, 6)).astype("float32")
            yield x, x[..., :NUM_CLASSES].argmax(-1).astype("int32")

    inputs = keras.Input((None, 6))
    model = keras.Model(inputs, keras.layers.Dense(NUM_CLASSES)(inputs))
    wrapped = kas.ASSpeed(model, sample_filter=filters.SkipMasked())
    wrapped.compile(
        optimizer="sgd", loss=kas.ASSoftmaxLoss(0.3), jit_compile=JIT[0]
    )
    if BACKEND == "tensorflow":
        import tensorflow as tf

        expected = (tf.errors.InvalidArgumentError, r"expected shape \[\?,3")
    else:
        expected = (ValueError, "queue rows of one shape.*Received: \\[\\(4,")
    with pytest.raises(expected[0], match=expected[1]):
        wrapped.fit(batches(), steps_per_epoch=4, verbose=0)


def test_a_batch_larger_than_the_first_is_refused_by_name():
    """The queues hold passes of the first batch's size: a larger batch
    later (a generator's) is refused, not trained on rows that overflow
    (on TensorFlow, where the size is unknown until the step runs, as the
    graph runs)."""
    rng = np.random.default_rng(0)

    def batches():
        for size in (8, 16, 16):
            x = rng.standard_normal((size, 6)).astype("float32")
            yield x, x[:, :NUM_CLASSES].argmax(-1).astype("int32")

    inputs = keras.Input((6,))
    model = keras.Model(inputs, keras.layers.Dense(NUM_CLASSES)(inputs))
    wrapped = kas.ASSpeed(model, sample_filter=filters.SkipMasked())
    wrapped.compile(
        optimizer="sgd", loss=kas.ASSoftmaxLoss(0.3), jit_compile=JIT[0]
    )
    expected = ValueError
    if BACKEND == "tensorflow":
        import tensorflow as tf

        expected = tf.errors.InvalidArgumentError
    with pytest.raises(expected, match="size, 8: a larger batch"):
        wrapped.fit(batches(), steps_per_epoch=3, verbose=0)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="ragged inputs: TF")
def test_ragged_inputs_are_refused_by_name():
    import tensorflow as tf

    class ToDense(keras.layers.Layer):
        def call(self, x):
            return x.to_tensor(shape=(None, 8))

        def compute_output_spec(self, x):
            return keras.KerasTensor((x.shape[0], 8), "int32")

    rng = np.random.default_rng(0)
    y = rng.integers(0, NUM_CLASSES, 16).astype("int32")
    rows = [[1] * int(rng.integers(1, 6)) for _ in y]
    data = tf.data.Dataset.from_tensor_slices((tf.ragged.constant(rows), y))
    inputs = keras.Input((None,), dtype="int32", ragged=True)
    hidden = keras.layers.Embedding(8, 4)(ToDense()(inputs))
    outputs = keras.layers.Dense(NUM_CLASSES)(keras.layers.Flatten()(hidden))
    wrapped = kas.ASSpeed(
        keras.Model(inputs, outputs), sample_filter=filters.SkipMasked()
    )
    wrapped.compile(optimizer="sgd", loss=kas.ASSoftmaxLoss(0.3))
    with pytest.raises(ValueError, match="one shape.*ragged.*\\[\\(None,\\)"):
        wrapped.fit(data.batch(8), verbose=0)


@pytest.mark.parametrize(
    "how",
    [{"steps_per_epoch": 2}, {"batch_size": 64, "validation_split": 0.5}],
    ids=["steps_per_epoch", "validation_split"],
)
def test_array_batches_keras_draws_size_the_queues(how):
    """Arrays without `batch_size` are drawn in `steps_per_epoch` equal
    batches, and `validation_split` leaves fewer samples to draw: the
    queues take the size Keras draws, and every batch trains, as without
    a filter."""
    x, y = sentence_data(96)
    always = filters.SkipMasked(0.0, warmup_epochs=0)
    wrapped = kas.ASSpeed(small_model(), max_steps=1, sample_filter=always)
    wrapped.compile(
        optimizer="sgd", loss=kas.ASSoftmaxLoss(1.0), jit_compile=JIT[0]
    )
    logs = wrapped.fit(x, y, epochs=2, verbose=0, **how).history
    assert wrapped.filter_engine.batch_size == 48
    assert logs["trained_fraction"] == [1.0, 1.0]


def test_train_on_batch_continues_a_fit():
    """A filter's state is shaped by `fit`'s data and scheduled by its
    epochs: `train_on_batch` before any fit says so; after one it trains."""
    x, y = sentence_data(32)
    wrapped = kas.ASSpeed(small_model(), sample_filter=filters.SkipMasked())
    wrapped.compile(optimizer="sgd", loss=kas.ASSoftmaxLoss(0.3))
    with pytest.raises(ValueError, match="fit.*before any fit"):
        wrapped.train_on_batch(x[:8], y[:8])
    wrapped.fit(x, y, batch_size=8, verbose=0)
    before = wrapped.get_weights()
    logs = wrapped.train_on_batch(x[:8], y[:8], return_dict=True)
    assert np.isfinite(logs["loss"])
    assert not all(
        np.array_equal(a, b) for a, b in zip(before, wrapped.get_weights())
    )


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
    with pytest.raises(ValueError, match="score_training.*0"):
        filters.SelectiveBackprop(score_training=0)
    with pytest.raises(ValueError, match=r"score_margin.*\[0, 1\].*1.5"):
        filters.SkipMasked(score_margin=1.5)
    with pytest.raises(ValueError, match="keep"):
        filters.SelectiveBackprop(keep=0.0)
    with pytest.raises(ValueError, match="sample_filter"):
        kas.ASSpeed(small_model(), sample_filter="skip")
    with pytest.raises(ValueError, match="prune"):
        filters.InfoBatch(10, prune=1.0)
    with pytest.raises(ValueError, match="prune"):
        filters.InfoBatch(10, prune=-0.1)
    with pytest.raises(ValueError, match="without a pass.*first"):
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
    # Ids one per sample, in int32's range, attached before batching.
    with pytest.raises(ValueError, match=r"32 integers.*\(32, 1\)"):
        filters.with_sample_ids(x, np.arange(32)[:, None])
    with pytest.raises(ValueError, match=r"2\*\*31"):
        filters.with_sample_ids(x, np.arange(32) + 2**33)
    float_ids = {"inputs": x, "sample_id": np.arange(32) * 0.5}
    with pytest.raises(ValueError, match="integer sample id.*float64"):
        wrapped.fit(float_ids, y, batch_size=8, verbose=0)
    import tensorflow as tf

    batched = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    # Numbered after `batch`, or not batched at all: one id an element.
    for data in (batched, tf.data.Dataset.from_tensor_slices((x, y))):
        with pytest.raises(ValueError, match=r"one id for.*before `batch`"):
            wrapped.fit(filters.index_dataset(data), verbose=0)
    with pytest.raises(ValueError, match=r"\(x, y\)"):
        filters.index_dataset(tf.data.Dataset.from_tensor_slices(x))
    wrapped = kas.ASSpeed(small_model(), sample_filter=filters.SkipMasked())
    wrapped.compile(
        optimizer="sgd", loss=kas.ASSoftmaxLoss(0.3, reduction="mean")
    )
    with pytest.raises(ValueError, match="reduction"):
        wrapped.fit(x, y, batch_size=8, verbose=0)
    # Skipping masked samples needs a loss that masks them.
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for f in (filters.SkipMasked(), filters.SkipMaskedLastSeen(32)):
        wrapped = kas.ASSpeed(small_model(), sample_filter=f)
        wrapped.compile(optimizer="sgd", loss=ce)
        with pytest.raises(ValueError, match=f"{type(f).__name__} skips"):
            wrapped.fit(filters.with_sample_ids(x), y, batch_size=8, verbose=0)
    # The queues' weights exist once a fit (or a weights file) built them.
    trained = kas.ASSpeed(small_model(), sample_filter=filters.SkipMasked())
    trained.compile(optimizer="sgd", loss=kas.ASSoftmaxLoss(0.3))
    trained.fit(x, y, batch_size=8, verbose=0)
    fresh = kas.ASSpeed(small_model(), sample_filter=filters.SkipMasked())
    fresh.compile(optimizer="sgd", loss=kas.ASSoftmaxLoss(0.3))
    with pytest.raises(ValueError, match="Fit first"):
        fresh.set_weights(trained.get_weights())
    # A later fit on batches of another size names the sizes.
    wrapped = kas.ASSpeed(small_model(), sample_filter=filters.SkipMasked())
    wrapped.compile(optimizer="sgd", loss=kas.ASSoftmaxLoss(0.3))
    wrapped.fit(x, y, batch_size=8, verbose=0)
    with pytest.raises(ValueError, match="batch_size=8.*batch_size=16"):
        wrapped.fit(x, y, batch_size=16, verbose=0)


# ------------------------------------------- selective backprop, one program


def test_selective_backprop_keeps_its_share_drawn_by_loss_rank():
    f = filters.SelectiveBackprop(keep=0.25)
    loss = np.arange(16, dtype="float32")  # each sample's rank is its loss
    rng = np.random.default_rng(0)
    kept = np.zeros(16)
    for _ in range(300):
        view = filters.base.View(
            np.arange(16, dtype="int32"),
            rng.uniform(size=16).astype("float32"),
            np.int32(1),
            np.int32(2),
            sample_loss=loss,
        )
        keep, weight = f.select(view, {})
        keep = ops.convert_to_numpy(keep)
        assert keep.sum() == 4  # a fixed share of the batch
        np.testing.assert_allclose(ops.convert_to_numpy(weight), 4.0)
        kept += keep
    # Drawn with probability rising with the loss's rank (as q ** 3).
    assert kept[-1] > kept[12] > kept[8] > kept[2]
    assert kept[:4].sum() < 0.05 * kept.sum()


@pytest.mark.parametrize("jit_compile", JIT, indirect=True)
def test_selective_backprop_trains_its_share_of_any_loss(jit_compile):
    x, y = sentence_data()
    f = filters.SelectiveBackprop(keep=0.5, seed=3)
    wrapped = kas.ASSpeed(small_model(), max_steps=1, sample_filter=f)
    wrapped.compile(
        optimizer=keras.optimizers.Adam(0.03),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=jit_compile,
    )
    logs = wrapped.fit(x, y, batch_size=8, epochs=3, verbose=0).history
    assert logs["trained_fraction"] == [1.0, 0.5, 0.5]
    assert logs["scored_fraction"] == [0.0, 1.0, 1.0]
    assert logs["accum_steps"][-1] == 1
    # From a dataset whose batch size the traced step does not know (no
    # `drop_remainder`): the same training as from arrays.
    import tensorflow as tf

    weights = []
    for data in (
        (x, y),
        (tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat(),),
    ):
        f = filters.SelectiveBackprop(keep=0.5, seed=3)
        wrapped = kas.ASSpeed(small_model(), max_steps=1, sample_filter=f)
        wrapped.compile(
            optimizer=keras.optimizers.Adam(0.03),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=jit_compile,
        )
        kwargs = {"batch_size": 8} if len(data) == 2 else {}
        wrapped.fit(
            *data,
            epochs=3,
            steps_per_epoch=8,
            shuffle=False,
            verbose=0,
            **kwargs,
        )
        weights.append([ops.convert_to_numpy(w) for w in wrapped.weights])
    for a, b in zip(*weights, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_keras_loss_ignore_class_leaves_its_rows_out_under_a_filter():
    """Keras's own loss with `ignore_class`, which Keras after 3.15 keeps
    only in its function's arguments: in a filter's warm-up epoch, which
    trains every row, the ignored rows weigh nothing and the mean is over
    the others, so the weights are those of a plain Keras fit."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 5, 6)).astype("float32")
    y = x[..., :NUM_CLASSES].argmax(-1).astype("int32")
    y[:, 3:] = -1
    loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, ignore_class=-1
    )

    def fit(wrap):
        keras.utils.set_random_seed(2)
        inputs = keras.Input((5, 6))
        model = keras.Model(inputs, keras.layers.Dense(NUM_CLASSES)(inputs))
        model = wrap(model)
        model.compile(
            optimizer=keras.optimizers.SGD(0.5), loss=loss, jit_compile=JIT[0]
        )
        logs = model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        weights = getattr(model, "inner_model", model).weights
        return [ops.convert_to_numpy(w) for w in weights], logs.history

    plain, _ = fit(lambda model: model)
    filtered, logs = fit(
        lambda model: kas.ASSpeed(
            model, max_steps=1, sample_filter=filters.SelectiveBackprop()
        )
    )
    assert logs["trained_fraction"] == [1.0]
    for a, b in zip(plain, filtered, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("jit_compile", COMPILED, indirect=True)
@pytest.mark.parametrize("pair", [False, True], ids=["skip", "pair"])
def test_default_filters_train_the_same_weights_every_time(pair, jit_compile):
    """No decision reads the clock: three seeded fits with the default
    filters end with the same weights."""
    x, y = sentence_data(128)
    weights, trained = [], []
    for _ in range(3):
        keras.utils.set_random_seed(4)
        chosen = filters.SkipMasked()
        if pair:
            chosen = [filters.SkipMaskedLastSeen(128), chosen]
        wrapped = kas.ASSpeed(small_model(), sample_filter=chosen)
        wrapped.compile(
            optimizer=keras.optimizers.Adam(0.05),
            loss=kas.ASSoftmaxLoss(0.3),
            jit_compile=jit_compile,
        )
        inputs = filters.with_sample_ids(x) if pair else x
        logs = wrapped.fit(inputs, y, batch_size=8, epochs=5, verbose=0)
        weights.append(wrapped.get_weights())
        trained.append(logs.history["trained_fraction"][-1])
    assert trained[0] < 1.0  # the filters skipped samples
    assert trained[0] == trained[1] == trained[2]
    for other in weights[1:]:
        for a, b in zip(weights[0], other):
            np.testing.assert_array_equal(a, b)


def _scoring_every_batch(**regularizers):
    """`identity_model(**regularizers)` under `SkipMasked`, which scores
    every batch from the start; compiled with a learning rate of 0."""
    wrapped = kas.ASSpeed(
        identity_model(**regularizers),
        sample_filter=filters.SkipMasked(0.0, warmup_epochs=0),
    )
    wrapped.compile(
        optimizer=keras.optimizers.SGD(0.0),
        loss=kas.ASSoftmaxLoss(0.3),
        metrics=["accuracy"],
        jit_compile=JIT[0],
    )
    return wrapped


@pytest.mark.filterwarnings("ignore:ASSpeed's sample filters skip")
@pytest.mark.parametrize(
    "penalties, batch_size",
    [(False, 4), (True, 4), (False, 3)],
    ids=["plain", "penalties", "partial_last_batch"],
)
def test_training_logs_cover_the_drawn_batches(penalties, batch_size):
    """With a scoring pass, the training loss and accuracy are those of
    the drawn batches, as a plain step's are, not of the hard samples that
    a training pass ran on; the loss holds the regularization penalties
    (a weight's and an activity's), as Keras's does. An epoch's last,
    smaller batch is scored as it comes and weighs in by its size."""
    x, y, _ = two_batches()
    regularizers = {}
    if penalties:
        regularizers = {
            "kernel_regularizer": keras.regularizers.L2(0.01),
            "activity_regularizer": keras.regularizers.L1(0.001),
        }
    wrapped = _scoring_every_batch(**regularizers)
    logs = wrapped.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)
    logs = logs.history
    # 4 hard rows of 8: one training pass of `batch_size` rows, over two
    # drawn batches or three (the last of 2 rows).
    expected = 1 / 2 if batch_size == 4 else 1 / 3
    assert logs["trained_fraction"] == [pytest.approx(expected)]
    assert logs["scored_fraction"] == [1.0]
    evaluated = wrapped.evaluate(
        x, y, batch_size=batch_size, verbose=0, return_dict=True
    )
    assert logs["accuracy"][0] == pytest.approx(evaluated["accuracy"])
    assert logs["loss"][0] == pytest.approx(evaluated["loss"], rel=1e-5)
    # Evaluation runs no training pass: it reports no training shares.
    on_batch = wrapped.test_on_batch(x, y, return_dict=True)
    for logs in (evaluated, on_batch):
        assert "trained_fraction" not in logs
        assert "scored_fraction" not in logs


@pytest.mark.parametrize("memory", [False, True], ids=["scoring", "memory"])
def test_unweighted_metrics_skip_the_rows_the_logs_do_not_cover(memory):
    """Keras gives no sample weight to the compiled `metrics`: a step's
    padding (an epoch's short last batch) and the rows of a training pass
    that did not run (a memory filter's) still stay out of them, as out of
    `weighted_metrics`."""
    x, y = sentence_data(60)  # batches of 8, the last of 4
    chosen = (
        filters.SkipMaskedLastSeen(60, revisit=0.2, seed=0)
        if memory
        else filters.SkipMasked(0.0, warmup_epochs=0)
    )
    wrapped = kas.ASSpeed(small_model(), sample_filter=chosen)
    wrapped.compile(
        optimizer=keras.optimizers.Adam(0.05),
        loss=kas.ASSoftmaxLoss(0.3),
        metrics=["accuracy"],
        weighted_metrics=["accuracy"],
        jit_compile=JIT[0],
    )
    inputs = filters.with_sample_ids(x) if memory else x
    logs = wrapped.fit(inputs, y, batch_size=8, epochs=4, verbose=0).history
    assert min(logs["trained_fraction"]) < 0.9  # steps without a pass
    np.testing.assert_allclose(
        logs["accuracy"], logs["weighted_accuracy"], rtol=1e-6
    )


def test_fit_warns_that_activity_penalties_act_in_training_passes_only():
    """An activity penalty depends on a pass's inputs: with a filter it
    acts on the batches a pass ran on. `fit` says so and names the layers;
    it says nothing of the weights' penalties, which act once per update
    (`test_skip_masked_gives_the_plain_update`), nor of a model without
    any."""
    x, y, _ = two_batches()

    def fit(**regularizers):
        wrapped = _scoring_every_batch(**regularizers)
        wrapped.fit(x, y, batch_size=4, epochs=1, verbose=0)

    expected = r"activity penalties .* activity_regularizer: dense"
    with pytest.warns(UserWarning, match=expected) as caught:
        fit(kernel_regularizer="l2", activity_regularizer="l1")
    assert caught[0].filename == __file__  # it points at the `fit` call
    for regularizers in ({"kernel_regularizer": "l2"}, {}):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit(**regularizers)
        assert not [w for w in caught if "penalt" in str(w.message)]


def _one_program_filters():
    return {
        "none": lambda n: None,
        "skip": lambda n: filters.SkipMasked(0.0),
        "pair": lambda n: [
            filters.SkipMaskedLastSeen(n, seed=0),
            filters.SkipMasked(0.0),
        ],
        "selective": lambda n: filters.SelectiveBackprop(seed=0),
    }


def _compiled(name, n, **kwargs):
    """`ASSpeed` with the filter `name` for `n` samples, compiled."""
    wrapped = kas.ASSpeed(
        small_model(), sample_filter=_one_program_filters()[name](n)
    )
    wrapped.compile(
        optimizer=keras.optimizers.Adam(0.05),
        loss=kas.ASSoftmaxLoss(0.3),
        **kwargs,
    )
    return wrapped


def _fitted_for_jax_steps(name, n=64):
    """`_compiled(name)`, fitted two epochs on JAX (its filters past
    their warm-up); its state as `train_step` takes it; the 8 batches of
    its data."""
    x, y = sentence_data(n)
    wrapped = _compiled(name, n, jit_compile=True)
    inputs = filters.with_sample_ids(x) if name == "pair" else x
    wrapped.fit(inputs, y, batch_size=8, epochs=2, verbose=0)
    state = wrapped._get_jax_state(
        trainable_variables=True,
        non_trainable_variables=True,
        optimizer_variables=True,
        metrics_variables=True,
    )
    batches = [
        (keras.tree.map_structure(lambda a, i=i: a[i : i + 8], inputs),)
        + (y[i : i + 8],)
        for i in range(0, n, 8)
    ]
    return wrapped, state, batches


@pytest.mark.skipif(
    BACKEND == "torch",
    reason="Keras's torch trainer takes steps_per_execution=1 only",
)
@pytest.mark.parametrize("jit_compile", JIT, indirect=True)
@pytest.mark.parametrize("name", ["skip", "pair"])
def test_steps_per_execution_trains_as_steps_one_at_a_time(name, jit_compile):
    """`steps_per_execution=4` runs 4 drawn batches a dispatch (on
    TensorFlow in one graph; on JAX, Keras 3.15 loops on the host and
    later Kerases scan on the device) and trains as 1 does: the same
    weights and epoch logs, with 9 batches an epoch, so that a group of
    one ends each epoch."""
    n = 72
    x, y = sentence_data(n)
    inputs = filters.with_sample_ids(x) if name == "pair" else x

    def fit(steps_per_execution):
        wrapped = _compiled(
            name,
            n,
            jit_compile=jit_compile,
            steps_per_execution=steps_per_execution,
        )
        history = wrapped.fit(
            inputs, y, batch_size=8, epochs=3, shuffle=False, verbose=0
        )
        return wrapped.get_weights(), history.history

    weights, logs = fit(1)
    grouped_weights, grouped_logs = fit(4)
    assert min(logs["trained_fraction"]) < 1.0  # the filter skipped rows
    for ours, theirs in zip(weights, grouped_weights):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    assert set(grouped_logs) == set(logs)
    for key, values in logs.items():
        np.testing.assert_allclose(grouped_logs[key], values, rtol=1e-5)


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's lax.scan")
def test_steps_per_execution_runs_a_group_of_batches_in_one_scan(monkeypatch):
    """On JAX a full group of `steps_per_execution` batches is one dispatch
    of one `jax.lax.scan` in `fit`, `evaluate` and `predict`: `ASSpeed`'s
    own on Keras 3.15, whose loop dispatches each batch, and Keras's after
    it. An epoch of 9 batches runs two groups of 4, then one batch; the
    results are those of one batch a dispatch."""
    import jax

    lengths = []
    scan = jax.lax.scan

    def recording(f, init, xs=None, length=None, **kwargs):
        lengths.append(length or jax.tree.leaves(xs)[0].shape[0])
        return scan(f, init, xs, length, **kwargs)

    n = 72
    x, y = sentence_data(n)

    def run(steps_per_execution):
        keras.utils.set_random_seed(0)
        wrapped = _compiled(
            "skip", n, jit_compile=True, steps_per_execution=steps_per_execution
        )
        wrapped.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return (
            wrapped.evaluate(x, y, batch_size=8, verbose=0),
            wrapped.predict(x, batch_size=8, verbose=0),
        )

    evaluated, predicted = run(1)
    monkeypatch.setattr(jax.lax, "scan", recording)
    grouped_evaluated, grouped_predicted = run(4)
    # fit, evaluate and predict each traced one scan over 4 batches.
    assert lengths.count(4) == 3, lengths
    np.testing.assert_allclose(grouped_evaluated, evaluated, rtol=1e-5)
    assert grouped_predicted.shape == (n, *predicted.shape[1:])
    np.testing.assert_allclose(
        grouped_predicted, predicted, rtol=1e-5, atol=1e-6
    )


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's pure train step")
@pytest.mark.parametrize("name", list(_one_program_filters()))
def test_steps_in_one_lax_scan_end_where_steps_one_at_a_time_do(name):
    """Keras's JAX trainer after 3.15 runs `steps_per_execution` steps in
    one `jax.lax.scan` (keras-team/keras#23527), one dispatch for N drawn
    batches. The filtered step is pure and keeps its shapes, so a scan
    over 8 batches ends with the state and logs of 8 calls."""
    import jax

    wrapped, start, batches = _fitted_for_jax_steps(name)
    step = jax.jit(wrapped.train_step)
    state = start
    for batch in batches:
        logs, state = step(state, batch)

    def body(state, batch):
        logs, state = wrapped.train_step(state, batch)
        return state, logs

    stacked = jax.tree.map(lambda *a: np.stack(a), *batches)
    scanned, scan_logs = jax.jit(lambda s, b: jax.lax.scan(body, s, b))(
        start, stacked
    )
    # The 8 steps moved the weights: the comparison below is not trivial.
    assert not all(np.array_equal(a, b) for a, b in zip(start[0], state[0]))
    for ours, theirs in zip(jax.tree.leaves(state), jax.tree.leaves(scanned)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    assert set(scan_logs) == set(logs)
    for key, value in logs.items():
        np.testing.assert_allclose(value, scan_logs[key][-1], rtol=1e-5)
    if name != "none":
        assert float(logs["scored_fraction"]) > 0.0


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's compiled train step")
@pytest.mark.parametrize("name", list(_one_program_filters()))
def test_a_step_copies_no_weight_sized_buffer(name):
    """The window's sums, the weights and the optimizer's state are updated
    in place: XLA copies a buffer that a conditional's branch returns
    unchanged, which on a BERT is hundreds of megabytes per step. The
    compiled step holds no copy shaped like a kernel, nor does the loop
    that runs 8 steps a dispatch (`steps_per_execution`)."""
    import re

    import jax

    from keras_as_softmax.training import _jax

    wrapped, state, batches = _fitted_for_jax_steps(name)
    step = jax.jit(wrapped.train_step, donate_argnums=0)
    scanned = _jax.scan(wrapped.train_step)
    kernels = {
        ",".join(map(str, v.shape))
        for v in wrapped.inner_model.trainable_variables
        if len(v.shape) == 2
    }
    for hlo in (
        step.lower(state, batches[0]).compile().as_text(),
        scanned.lower(state, batches).compile().as_text(),
    ):
        copies = re.findall(r"= f32\[([\d,]+)\]\S* copy\(", hlo)
        assert kernels and not kernels & set(copies), copies


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's choice")
def test_tf_filtered_step_is_one_program_on_one_gpu_or_tpu():
    """Under `jit_compile=True` a filtered step is one XLA program on one
    GPU or TPU; a graph whose passes are XLA functions on CPUs and on
    several replicas; `_tf_filtered_step` overrides the choice."""
    import tensorflow as tf

    from keras_as_softmax.training import _tensorflow

    def model(devices=None, step="auto", **kwargs):
        if devices is None:  # this machine's default strategy: its CPU
            strategy = tf.distribute.get_strategy()
        else:
            extended = types.SimpleNamespace(worker_devices=devices)
            strategy = types.SimpleNamespace(
                extended=extended, num_replicas_in_sync=len(devices)
            )
        settings = dict(sample_filters=[filters.SkipMasked()], jit_compile=True)
        settings.update(run_eagerly=False, distribute_strategy=strategy)
        settings.update(_tf_filtered_step=step, **kwargs)
        return types.SimpleNamespace(**settings)

    gpu, cpu = "/job:localhost/replica:0/task:0/device:GPU:{}", "/cpu:0"
    xla_passes = _tensorflow.xla_passes
    assert not xla_passes(model([gpu.format(0)]))
    assert not xla_passes(model(["/job:worker/task:0/device:TPU:0"]))
    assert xla_passes(model([cpu]))
    assert xla_passes(model())
    assert xla_passes(model([gpu.format(0), gpu.format(1)]))
    assert not xla_passes(model([cpu], step="one_program"))
    assert xla_passes(model([gpu.format(0)], step="xla_passes"))
    # Without a filter, XLA or a graph step, Keras's own step.
    assert not xla_passes(model([cpu], sample_filters=[]))
    assert not xla_passes(model([cpu], jit_compile=False))
    assert not xla_passes(model([cpu], run_eagerly=True))
    with pytest.raises(ValueError, match="one_program.*Received: 'one'"):
        xla_passes(model(step="one"))


def _conditionals(wrapped):
    """`(inside, outside)`: the conditionals (`If`, `StatelessIf`,
    `Switch`) of a fitted TensorFlow model's train function that XLA
    compiles, and those that run in the graph."""
    function = wrapped.train_function
    cells = dict(
        zip(
            function.__code__.co_freevars,
            (cell.cell_contents for cell in function.__closure__),
        )
    )
    traced = cells["multi_step_on_iterator"]._list_all_concrete_functions()
    graph = traced[0].graph.as_graph_def()
    library = {f.signature.name: f for f in graph.library.function}

    def callees(nodes):
        names = set()
        for node in nodes:
            if node.op in library:
                names.add(node.op)
            for value in node.attr.values():
                if value.HasField("func"):
                    names.add(value.func.name)
        return names

    compiled = {
        name
        for name, f in library.items()
        if "_XlaMustCompile" in f.attr and f.attr["_XlaMustCompile"].b
    }
    called = set(compiled)
    while called:  # with every function they call
        nodes = [node for name in called for node in library[name].node_def]
        called = callees(nodes) - compiled
        compiled |= called

    def count(nodes):
        return sum(node.op in ("If", "StatelessIf", "Switch") for node in nodes)

    inside = sum(count(library[name].node_def) for name in compiled)
    outside = count(graph.node) + sum(
        count(f.node_def) for name, f in library.items() if name not in compiled
    )
    return inside, outside


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's two steps")
@pytest.mark.parametrize("name", ["skip", "pair", "selective"])
def test_tf_one_program_takes_the_graph_steps_decisions(name, monkeypatch):
    """A filtered step compiled as one XLA program takes the decisions of
    the graph whose passes are XLA functions: the same logs, gradient sums
    in the window and filter state. Every conditional of the step is
    inside XLA, decided on the device, where the graph decides its own.
    At a learning rate of 0, so that both score the same weights: XLA
    fuses one program otherwise than two passes, and a difference in the
    last bit can flip a choice between close losses, after which two
    runs part. TensorFlow's stateless random ops draw other numbers from
    one key under XLA than in a graph: the draws here come from an
    integer hash that both compute alike."""
    import tensorflow as tf

    from keras_as_softmax.training import _tensorflow

    def hashed_uniform(size, seed, counter):
        key = tf.range(size) * 7919 + counter * 104729 + seed
        return tf.cast(tf.math.floormod(key, 65536), "float32") / 65536.0

    monkeypatch.setattr(_tensorflow, "stateless_uniform", hashed_uniform)
    n = 64
    x, y = sentence_data(n)
    inputs = filters.with_sample_ids(x) if name == "pair" else x
    results = []
    for step in ("one_program", "xla_passes"):
        wrapped = kas.ASSpeed(
            small_model(), sample_filter=_one_program_filters()[name](n)
        )
        wrapped._tf_filtered_step = step
        wrapped.compile(
            optimizer=keras.optimizers.SGD(0.0),
            loss=kas.ASSoftmaxLoss(0.3),
            jit_compile=True,
        )
        history = wrapped.fit(
            inputs, y, batch_size=8, epochs=3, shuffle=False, verbose=0
        )
        state = wrapped.optimizer.variables + wrapped.filter_engine.variables()
        results.append((wrapped, history.history, state))
    (one, one_logs, one_state), (graph, graph_logs, graph_state) = results
    assert min(one_logs["trained_fraction"]) < 1.0  # rows were left out
    for key, values in graph_logs.items():
        np.testing.assert_allclose(one_logs[key], values, rtol=1e-5)
    assert len(one_state) == len(graph_state)
    for ours, theirs in zip(one_state, graph_state):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), atol=1e-6)
    inside, outside = _conditionals(one)
    assert inside >= 3 and outside == 0  # scoring, training, update
    assert _conditionals(graph)[1] >= 3


@pytest.mark.parametrize("jit_compile", COMPILED, indirect=True)
def test_training_pass_logs_weigh_each_row_as_its_drawn_batch_does(
    jit_compile,
):
    """Rows that an epoch's shorter last batch leaves in the queue train
    in the next epoch's first pass; the logged loss weighs each as Keras
    weighs a row of its drawn batch, not by its larger coefficient."""
    x, y = sentence_data(60)  # batches of 8, the last of 4
    wrapped = kas.ASSpeed(
        small_model(), sample_filter=filters.SkipMasked(min_masked_ratio=1.0)
    )
    wrapped.compile(
        optimizer=keras.optimizers.SGD(0.0),
        loss=kas.ASSoftmaxLoss(0.3),
        jit_compile=jit_compile,
    )
    logs = wrapped.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    per_row = kas.ASSoftmaxLoss(0.3, reduction=None)(
        y, wrapped.predict(x, verbose=0)
    )
    per_row = ops.convert_to_numpy(per_row)
    assert logs.history["scored_fraction"] == [0.0, 0.0]
    # Epoch 1 trains rows 0-55; epoch 2 rows 56-59, then all 60.
    expected = [per_row[:56].mean(), (per_row.sum() + per_row[56:].sum()) / 64]
    np.testing.assert_allclose(logs.history["loss"], expected, rtol=1e-5)


def test_weights_saved_by_0_5_13_resume_with_every_queued_row_full_size():
    """Files saved by 0.5.13 or earlier hold queues without the size of
    the batch each row was drawn in; they load as if each came from a full
    batch."""
    x, y = sentence_data(60)

    def fitted(epochs):
        wrapped = kas.ASSpeed(small_model(), sample_filter=filters.SkipMasked())
        wrapped.compile(optimizer="sgd", loss=kas.ASSoftmaxLoss(0.3))
        wrapped.fit(x, y, batch_size=8, epochs=epochs, verbose=0)
        return wrapped

    saved = fitted(1)
    store = {}
    saved.save_own_variables(store)
    variables = saved._trainable_variables + saved._non_trainable_variables
    queue = saved.filter_engine.train_queue.buffers
    (index,) = [
        i
        for i, v in enumerate(variables)
        if any(v is b for b in queue if b.dtype == "float32")
    ]
    # The file as 0.5.13 wrote it: no format, the rows' last leaf missing.
    spec = json.loads(bytes(store["filter_spec"]).decode())
    del spec["format"]
    spec["leaves"] = spec["leaves"][:-1]
    store["filter_spec"] = np.frombuffer(json.dumps(spec).encode(), "uint8")
    full = ops.convert_to_numpy(variables[index])
    store[f"{index}"] = full[:, :-1]

    restored = fitted(0)
    restored.load_own_variables(store)
    loaded = ops.convert_to_numpy(restored.filter_engine.train_queue.buffers[0])
    np.testing.assert_array_equal(loaded[:, :-1], full[:, :-1])
    np.testing.assert_array_equal(loaded[:, -1], 8.0)
    assert (
        int(ops.convert_to_numpy(restored.filter_engine.train_queue.count)) == 4
    )
    restored.fit(x, y, batch_size=8, epochs=1, verbose=0)


@pytest.mark.parametrize("width", [6, 4096])
def test_a_file_of_0_5_19_loads_unless_its_rows_are_wide(width):
    """0.5.14 to 0.5.19 (format 2) packed a wide leaf with the others;
    0.5.20 keeps it in a buffer of its own, so such a file is refused
    with a way out, and any other loads as it is."""
    x, y = sentence_data()
    x = np.tile(x, (1, width // 6 + 1))[:, :width]

    def fitted(epochs):
        wrapped = kas.ASSpeed(small_model(), sample_filter=filters.SkipMasked())
        wrapped.compile(optimizer="sgd", loss=kas.ASSoftmaxLoss(0.3))
        wrapped.fit(x, y, batch_size=8, epochs=epochs, verbose=0)
        return wrapped

    def small_model():
        keras.utils.set_random_seed(1)
        inputs = keras.Input((width,))
        return keras.Model(inputs, keras.layers.Dense(NUM_CLASSES)(inputs))

    store = {}
    fitted(1).save_own_variables(store)
    spec = json.loads(bytes(store["filter_spec"]).decode())
    assert spec["format"] == 3
    spec["format"] = 2
    store["filter_spec"] = np.frombuffer(json.dumps(spec).encode(), "uint8")
    restored = kas.ASSpeed(small_model(), sample_filter=filters.SkipMasked())
    if width < _layout.Layout.OWN_BUFFER_WIDTH:
        restored.load_own_variables(store)
        assert (
            len(restored.filter_engine.train_queue.buffers) == 2
        )  # float32, int32
        return
    match = r"format 2.*\[\[4096\]\].*inner_model"
    with pytest.raises(ValueError, match=match):
        restored.load_own_variables(store)


@pytest.mark.parametrize("how", ["load_weights", "set_weights"])
def test_weights_taken_before_the_first_fit_restart_training(tmp_path, how):
    """Weights saved before the first `fit` created the queues load after
    it, with the queues empty: training again from the initial weights
    (a restart, a fold) trains as the first time."""
    x, y = sentence_data(60)
    wrapped = kas.ASSpeed(
        small_model(),
        sample_filter=[
            filters.SkipMaskedLastSeen(60, warmup_epochs=0),
            filters.SkipMasked(min_masked_ratio=0.0, warmup_epochs=0),
        ],
    )
    wrapped.compile(optimizer="adam", loss=kas.ASSoftmaxLoss(0.3))
    path = str(tmp_path / "initial.weights.h5")
    wrapped.save_weights(path)
    initial = wrapped.get_weights()
    initial_model = wrapped.inner_model.get_weights()
    x = filters.with_sample_ids(x)

    def fit():
        wrapped.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return wrapped.inner_model.get_weights()

    trained = fit()
    assert (
        int(ops.convert_to_numpy(wrapped.filter_engine.train_queue.count)) > 0
    )
    if how == "load_weights":
        wrapped.load_weights(path)
    else:  # which leaves the optimizer as it is, as Keras's does
        wrapped.set_weights(initial)
        wrapped.compile(optimizer="adam", loss=kas.ASSoftmaxLoss(0.3))
    for ours, theirs in zip(wrapped.inner_model.get_weights(), initial_model):
        np.testing.assert_array_equal(ours, theirs)
    assert (
        int(ops.convert_to_numpy(wrapped.filter_engine.train_queue.count)) == 0
    )
    assert (
        int(ops.convert_to_numpy(wrapped.filter_engine.score_queue.count)) == 0
    )
    for ours, theirs in zip(fit(), trained):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("form", ["functional", "subclassed"])
def test_metrics_leave_out_what_a_keras_mask_hides_as_keras_does(form):
    """Padding that `Embedding(mask_zero=True)` masks, labelled with the
    loss's `ignore_class`: the filtered step's metrics leave it out, as a
    plain step's do (except on JAX, whose plain metrics count it too). In
    its warm-up epoch `SelectiveBackprop` trains every sample, as a plain
    step does, so the logs are the same."""
    if release(keras.version()) < (3, 12):
        pytest.skip(
            "Keras 3.11's metrics apply a Keras mask only with a sample "
            "weight: its plain step counts the padding, which ASSpeed's "
            "leaves out, as Keras does from 3.12"
        )
    rng = np.random.default_rng(0)
    x = rng.integers(1, 20, size=(64, 6)).astype("int32")
    for i, length in enumerate(rng.integers(1, 7, size=64)):
        x[i, length:] = 0
    y = np.where(x == 0, -1, (x * 3) % 5).astype("int32")

    def fit(wrap):
        keras.utils.set_random_seed(1)
        if form == "subclassed":
            model = wrap(MaskedTagger(width=8, classes=5))
        else:
            inputs = keras.Input((6,), dtype="int32")
            hidden = keras.layers.Embedding(20, 8, mask_zero=True)(inputs)
            model = wrap(keras.Model(inputs, keras.layers.Dense(5)(hidden)))
        model.compile(
            keras.optimizers.SGD(0.5),
            kas.ASSoftmaxLoss(1.0, ignore_class=-1),
            metrics=["accuracy"],
        )
        logs = model.fit(x, y, batch_size=32, verbose=0, shuffle=False)
        return logs.history

    plain = fit(lambda model: model)
    filtered = fit(
        lambda model: kas.ASSpeed(
            model,
            max_steps=1,
            sample_filter=filters.SelectiveBackprop(0.5, seed=0),
        )
    )
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose(filtered[name], plain[name], rtol=1e-5)
