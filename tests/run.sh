#!/usr/bin/env bash
# Sets up what the tests need and runs them: ruff, the whole suite on
# TensorFlow, the loss suite on JAX and PyTorch, the training suite on
# PyTorch, and on JAX: its core with the jax that Python 3.11 gets (0.10.2),
# all of it with the newest jax on Python 3.12 (tests/run_jax_latest.sh),
# then its core under Keras's next release on Python 3.13
# (tests/run_keras_next.sh). Each suite runs its tests in parallel
# (tests/suites.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check -e ".[test,jax]" -e ./lab "torch==2.13.0"
source tests/suites.sh
export TF_CPP_MIN_LOG_LEVEL=2 HF_HUB_OFFLINE=1
ruff check .
ruff format --check .
KERAS_BACKEND=tensorflow python -m pytest "${pytest_args[@]}" "$@"
KERAS_BACKEND=jax python -m pytest "${pytest_args[@]}" -m multibackend "$@"
KERAS_BACKEND=jax python -m pytest "${pytest_args[@]}" "${training_tests[@]}" \
    -k "$core_training" "$@"
KERAS_BACKEND=torch python -m pytest "${pytest_args[@]}" "${loss_tests[@]}" \
    "${training_tests[@]}" "$@"
bash tests/run_jax_latest.sh "$@"
bash tests/run_keras_next.sh "$@"
