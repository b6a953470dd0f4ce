#!/usr/bin/env bash
# Sets up what the tests need and runs them: ruff, the whole suite on
# TensorFlow, the loss suite on JAX and PyTorch, the training suite on
# PyTorch, and on JAX twice: with the jax that Python 3.11 gets (0.10.2), and
# with the newest jax on Python 3.12 (tests/run_jax_latest.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check -e ".[test,jax]" -e ./lab "torch==2.13.0"
export TF_CPP_MIN_LOG_LEVEL=2 HF_HUB_OFFLINE=1
ruff check .
ruff format --check .
KERAS_BACKEND=tensorflow python -m pytest -q -p no:cacheprovider "$@"
KERAS_BACKEND=jax python -m pytest -q -p no:cacheprovider -m multibackend "$@"
KERAS_BACKEND=jax python -m pytest -q -p no:cacheprovider tests/test_as_speed.py tests/test_filters.py tests/test_accumulation.py "$@"
KERAS_BACKEND=torch python -m pytest -q -p no:cacheprovider -m multibackend tests/test_losses.py tests/test_as_speed_backends.py "$@"
KERAS_BACKEND=torch python -m pytest -q -p no:cacheprovider tests/test_as_speed.py tests/test_filters.py tests/test_accumulation.py "$@"
bash tests/run_jax_latest.sh "$@"
