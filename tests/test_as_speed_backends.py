import keras
import pytest

import keras_as_softmax as kas
from tests.backend_utils import BACKEND

pytestmark = pytest.mark.multibackend


def test_construction_names_the_supported_backends():
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    if BACKEND in ("tensorflow", "jax"):
        assert kas.ASSpeed(model).accumulation_steps == 1
    else:
        with pytest.raises(ValueError, match="tensorflow and jax.*'torch'"):
            kas.ASSpeed(model)
