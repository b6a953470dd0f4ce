"""Filters written outside the package, as a user would: public names only
(`keras_as_softmax.filters`' base classes, `RowUpdate`, `View`, `Seen`)."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_as_softmax as kas
from keras_as_softmax import filters

NUM_CLASSES = 4
N = 64
BATCH = 8


@keras.saving.register_keras_serializable(package="tests")
class EvenIds(filters.ScoringFilter):
    """Scores every batch and keeps the samples of even id: a scoring
    filter that reads sample ids."""

    needs_sample_ids = True

    def select(self, view, state):
        keep = ops.equal(ops.mod(view.ids, 2), 0)
        # The view carries what the pass saw, for a filter to use.
        assert view.y_pred is not None and view.loss is not None
        return keep, ops.ones_like(view.sample_loss)


@keras.saving.register_keras_serializable(package="tests")
class TrainTwice(filters.MemoryFilter):
    """Leaves out, without a pass, the samples trained on twice already:
    a memory filter with a per-sample count."""

    def state_spec(self):
        return {"trained": ((self.num_samples,), "float32", 0.0)}

    def select(self, view, state):
        count = ops.take(state["trained"], view.ids, axis=0)
        keep = count < 2.0
        return keep, ops.ones_like(count)

    def observe(self, seen, state):
        count = ops.take(state["trained"], seen.ids, axis=0)
        count = count + ops.cast(seen.ran, "float32")
        return {"trained": filters.RowUpdate(seen.ids, count)}

    def masked_when_seen(self, state):
        return ops.cast(state["trained"] >= 2.0, "float32")


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 6)).astype("float32")
    y = rng.integers(0, NUM_CLASSES, size=(N,)).astype("int32")
    return x, y


def wrapped(sample_filter):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    model = keras.Model(inputs, keras.layers.Dense(NUM_CLASSES)(inputs))
    model = kas.ASSpeed(model, max_steps=1, sample_filter=sample_filter)
    model.compile(
        optimizer="sgd",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=keras.backend.backend() != "torch",
    )
    return model


def test_a_user_scoring_filter_decides_what_trains():
    x, y = data()
    model = wrapped(EvenIds(warmup_epochs=0))
    history = model.fit(
        filters.with_sample_ids(x),
        y,
        batch_size=BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
    )
    # Every batch scored, half of each kept: a pass every other batch.
    assert history.history["scored_fraction"] == [1.0, 1.0]
    np.testing.assert_allclose(history.history["trained_fraction"], 0.5)


def test_a_user_memory_filter_keeps_its_state_and_saves(tmp_path):
    x, y = data()
    model = wrapped(TrainTwice(N, warmup_epochs=0))
    history = model.fit(
        filters.with_sample_ids(x), y, batch_size=BATCH, epochs=4, verbose=0
    )
    # Two epochs train everything, then every sample is left out.
    np.testing.assert_allclose(
        history.history["trained_fraction"], [1.0, 1.0, 0.0, 0.0]
    )
    # Samples left out count as masked for AS-Speed's rule.
    np.testing.assert_allclose(history.history["masked_ratio"][2:], 1.0)
    assert model.last_seen_masked_fraction == 1.0

    path = str(tmp_path / "model.keras")
    model.save(path)
    restored = keras.models.load_model(path)
    (memory,) = [f for f in restored.sample_filters if not f.scores]
    assert isinstance(memory, TrainTwice) and memory.num_samples == N
    assert restored.last_seen_masked_fraction == 1.0


def test_user_filters_chain_memory_first():
    x, y = data()
    model = wrapped([TrainTwice(N, warmup_epochs=0), EvenIds(warmup_epochs=0)])
    history = model.fit(
        filters.with_sample_ids(x), y, batch_size=BATCH, epochs=4, verbose=0
    )
    # Every pass counts as seen: the scoring pass of every sample and the
    # training pass of the even ones, so the even samples reach two in the
    # first epoch and the odd ones in the second, which trains none.
    np.testing.assert_allclose(
        history.history["trained_fraction"], [0.5, 0.0, 0.0, 0.0]
    )
    np.testing.assert_allclose(
        history.history["scored_fraction"], [1.0, 0.5, 0.0, 0.0]
    )
    assert model.last_seen_masked_fraction == 1.0
    with pytest.raises(ValueError, match="MemoryFilter.*first.*ScoringFilter"):
        kas.ASSpeed(model.inner_model, sample_filter=[EvenIds(), TrainTwice(N)])


def test_a_filter_that_needs_ids_is_refused_data_without_them():
    x, y = data()
    model = wrapped(EvenIds())
    with pytest.raises(ValueError, match="EvenIds needs each sample's id"):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
