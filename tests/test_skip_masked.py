"""ASSpeed(skip_masked=True): training passes only on samples not masked."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_as_softmax as kas
from tests.backend_utils import BACKEND

pytestmark = pytest.mark.skipif(BACKEND != "tensorflow", reason="skip_masked is TensorFlow only")

NUM_CLASSES = 4
BATCH = 16  # branches: none, 4 (a quarter), 8 (a half), 16 samples


def identity_model(row_shape=()):
    """Logits = inputs @ W with W = I at first, so the data picks the masks."""
    inputs = keras.Input(row_shape + (NUM_CLASSES,))
    outputs = keras.layers.Dense(NUM_CLASSES, kernel_initializer="identity")(inputs)
    return keras.Model(inputs, outputs)


def sentence_data(unmasked, seed=0):
    """`unmasked` samples with a nonzero loss, the others masked (delta 0.3)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, NUM_CLASSES, BATCH)
    x = 8.0 * np.eye(NUM_CLASSES, dtype="float32")[y]
    hard = rng.permutation(BATCH)[:unmasked]
    x[hard] = 0.1 * rng.standard_normal((unmasked, NUM_CLASSES)).astype("float32")
    weights = rng.uniform(0.5, 2.0, BATCH).astype("float32")
    return x, y, weights


def one_step(x, y, weights, skip_masked, loss, jit_compile=True):
    keras.utils.set_random_seed(0)
    model = identity_model(x.shape[1:-1])
    wrapped = kas.ASSpeed(model, lam=0.5, max_steps=1, skip_masked=skip_masked)
    wrapped.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss, jit_compile=jit_compile)
    if skip_masked:
        wrapped._last_masked_ratio.assign(1.0)  # score from the first batch on
    history = wrapped.fit(x, y, sample_weight=weights, batch_size=BATCH, epochs=1, verbose=0)
    return model, history.history


@pytest.mark.parametrize(
    "unmasked, chunked", [(0, 0.0), (3, 0.25), (4, 0.25), (7, 0.5), (12, 0.75), (16, 1.0)]
)
@pytest.mark.parametrize("jit_compile", [True, False], ids=["xla_chunks", "graph_gather"])
def test_update_equals_the_whole_batch_update(unmasked, chunked, jit_compile):
    x, y, weights = sentence_data(unmasked)
    loss = kas.ASSoftmaxLoss(0.3)
    masked = ops.convert_to_numpy(loss.call(ops.convert_to_tensor(y, "float32"), x)) == 0
    assert masked.sum() == BATCH - unmasked
    full, full_logs = one_step(x, y, weights, False, kas.ASSoftmaxLoss(0.3), jit_compile)
    skip, skip_logs = one_step(x, y, weights, True, kas.ASSoftmaxLoss(0.3), jit_compile)
    # Under XLA the training passes run on quarter-batch chunks; as a graph,
    # on exactly the samples not masked.
    fraction = chunked if jit_compile else unmasked / BATCH
    for a, b in zip(full.get_weights(), skip.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    if unmasked:
        assert not np.allclose(full.get_weights()[0], np.eye(NUM_CLASSES))
    assert skip_logs["backward_fraction"][0] == fraction
    np.testing.assert_allclose(skip_logs["loss"][0], full_logs["loss"][0], rtol=1e-5)
    np.testing.assert_allclose(skip_logs["masked_ratio"][0], full_logs["masked_ratio"][0])


@pytest.mark.parametrize("jit_compile", [True, False], ids=["xla_chunks", "graph_gather"])
def test_tokens_with_ignored_positions_and_sum_reduction(jit_compile):
    rng = np.random.default_rng(1)
    y = rng.integers(0, NUM_CLASSES, (BATCH, 5))
    x = 8.0 * np.eye(NUM_CLASSES, dtype="float32")[y]
    hard = rng.random((BATCH, 5)) < 0.08  # a few hard tokens in a few samples
    x[hard] = 0.1 * rng.standard_normal((int(hard.sum()), NUM_CLASSES))
    y[:, 4] = -1  # padding
    y[0, :] = -1  # a sample that is all padding
    weights = rng.uniform(0.5, 2.0, BATCH).astype("float32")
    for reduction in ("sum_over_batch_size", "sum"):
        make_loss = lambda: kas.ASSoftmaxLoss(  # noqa: E731
            0.3, ignore_class=-1, reduction=reduction
        )
        full, _ = one_step(x, y, weights, False, make_loss(), jit_compile)
        skip, logs = one_step(x, y, weights, True, make_loss(), jit_compile)
        for a, b in zip(full.get_weights(), skip.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        assert logs["backward_fraction"][0] < 1.0


def test_scores_first_only_once_enough_samples_are_masked():
    x, y, weights = sentence_data(3)
    keras.utils.set_random_seed(0)
    wrapped = kas.ASSpeed(identity_model(), skip_masked=True)
    wrapped.compile(optimizer="sgd", loss=kas.ASSoftmaxLoss(0.3), jit_compile=True)
    # The first batch has no previous ratio: it runs the plain passes.
    x2, y2 = np.concatenate([x, x]), np.concatenate([y, y])
    history = wrapped.fit(x2, y2, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["backward_fraction"][0], (1.0 + 0.25) / 2)
    np.testing.assert_allclose(float(ops.convert_to_numpy(wrapped._last_masked_ratio)), 13 / 16)


def test_graph_mode_and_config(tmp_path):
    x, y, weights = sentence_data(5)
    graph, _ = one_step(x, y, weights, True, kas.ASSoftmaxLoss(0.3), jit_compile=False)
    full, _ = one_step(x, y, weights, False, kas.ASSoftmaxLoss(0.3), jit_compile=False)
    for a, b in zip(full.get_weights(), graph.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    wrapped = kas.ASSpeed(identity_model(), skip_masked=True)
    wrapped.compile(optimizer="sgd", loss=kas.ASSoftmaxLoss(0.3), jit_compile=False)
    path = str(tmp_path / "skip.keras")
    wrapped.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.skip_masked is True and loaded.compiled


def test_xla_on_cpu_warns_when_training_starts():
    x, y, weights = sentence_data(5)
    with pytest.warns(UserWarning, match="jit_compile=False"):
        one_step(x, y, weights, True, kas.ASSoftmaxLoss(0.3), jit_compile=True)


@pytest.mark.parametrize("jit_compile", [True, False], ids=["xla_chunks", "graph_gather"])
def test_batch_norm_statistics_follow_the_training_passes_only(jit_compile):
    """The scoring pass runs in training mode (dropout on) but puts back the
    moving statistics it changed: as a graph they see the unmasked samples
    once. (Under XLA they see each chunk, padding rows included.)"""
    for unmasked in (0,) if jit_compile else (0, 5):
        x, y, weights = sentence_data(unmasked)
        inputs = keras.Input((NUM_CLASSES,))
        norm = keras.layers.BatchNormalization(momentum=0.5)
        logits = keras.layers.Dense(NUM_CLASSES, kernel_initializer="identity")(inputs)
        # The statistics are updated, the logits (hence the masks) unchanged.
        outputs = logits + 0.0 * norm(inputs)
        model = keras.Model(inputs, outputs)
        wrapped = kas.ASSpeed(model, max_steps=1, skip_masked=True)
        wrapped.compile(optimizer="sgd", loss=kas.ASSoftmaxLoss(0.3), jit_compile=jit_compile)
        wrapped._last_masked_ratio.assign(1.0)
        wrapped.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        loss = kas.ASSoftmaxLoss(0.3, reduction=None)
        trained = ops.convert_to_numpy(loss(y, x)) > 0
        assert trained.sum() == unmasked
        expected = 0.5 * x[trained].mean(axis=0) if unmasked else np.zeros(NUM_CLASSES)
        np.testing.assert_allclose(ops.convert_to_numpy(norm.moving_mean), expected, rtol=1e-5, atol=1e-6)
