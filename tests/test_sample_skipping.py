import keras
import numpy as np
import pytest

import keras_as_softmax as kas
from tests.backend_utils import BACKEND

pytestmark = pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.data pipeline")


def model_and_data(n=128):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 6)).astype("float32")
    y = x[:, :4].argmax(1)
    inputs = keras.Input((6,), name="features")
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    model = keras.Model({"features": inputs}, keras.layers.Dense(4)(hidden))
    return model, {"features": x}, y


def test_keep_leaves_out_what_was_masked_and_revisits_nothing_at_zero():
    skipper = kas.MaskedSampleSkipper(10, revisit=0.0)
    skipper.masked.assign(np.isin(np.arange(10), [1, 4, 7]))
    ids = np.array([4, 0, 7, 2, 1], "int32")
    np.testing.assert_array_equal(skipper.keep(ids).numpy(), [False, True, False, True, False])
    # A batch of masked samples only keeps its first: a step never runs empty.
    np.testing.assert_array_equal(skipper.keep(np.array([7, 1, 4], "int32")).numpy(), [True, False, False])
    skipper = kas.MaskedSampleSkipper(10, revisit=1.0)
    skipper.masked.assign(np.ones(10, bool))
    assert skipper.keep(np.arange(10, dtype="int32")).numpy().all()


def test_revisit_fraction_is_drawn_per_sample():
    skipper = kas.MaskedSampleSkipper(4000, revisit=0.25, seed=0)
    skipper.masked.assign(np.ones(4000, bool))
    kept = skipper.keep(np.arange(4000, dtype="int32")).numpy()
    assert 0.2 < kept.mean() < 0.3


def test_dataset_carries_every_sample_id_once_per_pass():
    skipper = kas.MaskedSampleSkipper(10)
    skipper.masked.assign(np.ones(10, bool))
    x = {"features": np.arange(10, dtype="float32")[:, None]}
    seen = [int(i) for batch_x, _ in skipper.dataset(x, np.arange(10), batch_size=2, seed=0)
            for i in batch_x["sample_id"]]
    assert sorted(seen) == list(range(10))


def test_token_sample_is_masked_only_when_all_counted_tokens_are():
    import tensorflow as tf

    skipper = kas.MaskedSampleSkipper(3)
    masked = tf.constant([[True, True, False], [True, False, False], [False, False, False]])
    counted = tf.constant([[True, True, False], [True, True, False], [False, False, False]])
    skipper.record(tf.constant([2, 0, 1]), masked, counted)
    np.testing.assert_array_equal(skipper.masked.numpy(), [False, True, True])


@pytest.mark.parametrize("skip_masked", [False, True])
def test_training_records_masked_samples_and_trains_on_fewer(skip_masked):
    model, x, y = model_and_data()
    skipper = kas.MaskedSampleSkipper(len(y), revisit=0.0, seed=0)
    wrapped = kas.ASSpeed(
        model, lam=0.5, max_steps=2, sample_skipper=skipper, skip_masked=skip_masked
    )
    loss = kas.ASSoftmaxLoss(0.3)
    wrapped.compile(optimizer=keras.optimizers.Adam(0.05), loss=loss, jit_compile=False)
    batches = []
    counter = keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda e, logs: batches.append(0),
        on_train_batch_end=lambda b, logs: batches.__setitem__(-1, batches[-1] + 1),
    )
    history = wrapped.fit(
        skipper.dataset(x, y, batch_size=8, seed=0).repeat(),
        steps_per_epoch=16, epochs=4, verbose=0, callbacks=[counter],
    )
    # One iterator, fixed epochs; the skipping happens inside the steps.
    assert batches == [16] * 4
    fractions = history.history["backward_fraction"]
    if not skip_masked:  # the first pass has seen no sample before
        assert fractions[0] == 1.0
    assert fractions[-1] < 0.9
    # The memory agrees with the loss on the samples trained on: every
    # sample it calls masked was masked when it was last trained on.
    assert 0.0 < skipper.masked_fraction < 1.0
    ids = np.arange(len(y), dtype="int32")
    trained_on = skipper.keep(ids).numpy()
    assert not trained_on[skipper.masked.numpy()].any()
    # Prediction and evaluation take inputs without sample ids.
    assert wrapped.predict(x, verbose=0).shape == (len(y), 4)


def test_skipper_needs_graph_mode():
    model, x, y = model_and_data()
    skipper = kas.MaskedSampleSkipper(len(y))
    wrapped = kas.ASSpeed(model, sample_skipper=skipper)
    wrapped.compile(optimizer="adam", loss=kas.ASSoftmaxLoss(0.3), jit_compile=True)
    with pytest.raises(ValueError, match="jit_compile=False"):
        wrapped.fit(skipper.dataset(x, y, batch_size=8), epochs=1, verbose=0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_samples"):
        kas.MaskedSampleSkipper(0)
    with pytest.raises(ValueError, match="revisit"):
        kas.MaskedSampleSkipper(5, revisit=2.0)
    skipper = kas.MaskedSampleSkipper(5)
    with pytest.raises(ValueError, match="dict"):
        skipper.dataset(np.zeros((5, 2)), np.zeros(5), batch_size=2)
    with pytest.raises(ValueError, match="Expected 5 samples"):
        skipper.dataset({"a": np.zeros((4, 2))}, np.zeros(4), batch_size=2)
