import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402

if keras.backend.backend() == "jax":
    import jax

    # float64 finite-difference checks need real float64 on JAX.
    jax.config.update("jax_enable_x64", True)


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    keras.utils.set_random_seed(0)
    yield
    keras.config.set_dtype_policy("float32")
    # Without a full `gc.collect()` per test: with TensorFlow, JAX and
    # PyTorch loaded it takes a second or more, most of a loss test's time.
    keras.backend.clear_session(free_memory=False)
