import keras
import numpy as np
import pytest

import keras_as_softmax as kas

pytestmark = pytest.mark.multibackend


@pytest.mark.parametrize("sample_filter", [None, "skip_masked"])
def test_as_speed_trains_on_every_backend(sample_filter):
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    wrapped = kas.ASSpeed(
        model,
        lam=3.0,
        max_steps=2,
        sample_filter=sample_filter and kas.filters.SkipMasked(0.0),
    )
    assert wrapped.accumulation_steps == 1
    wrapped.compile(optimizer="sgd", loss=kas.ASSoftmaxLoss(0.3))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 3)).astype("float32")
    history = wrapped.fit(x, rng.integers(0, 2, 16), batch_size=4, verbose=0)
    assert np.isfinite(history.history["loss"][-1])
    assert wrapped.accumulation_steps == 2
