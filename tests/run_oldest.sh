#!/usr/bin/env bash
# Runs the loss and training suites on the oldest releases that
# pyproject.toml allows, under Python 3.10, in a venv of its own that later
# runs reuse (OLDEST_VENV): Keras 3.11, TensorFlow 2.16, jax 0.4.30 and
# PyTorch 2.3. Not part of tests/run.sh (it adds about 15 minutes); run it
# when a floor moves. `torch.compile` needs PyTorch 2.6 for the losses and
# 2.8 for `ASSpeed` (README), so its two tests are left out here.
set -euo pipefail
cd "$(dirname "$0")/.."

source tests/venv.sh
source tests/suites.sh
python="$(venv_python 3.10 "${OLDEST_VENV:-$HOME/.cache/keras-as-softmax/py310-oldest}")"

"$python" -m pip install --quiet --disable-pip-version-check \
    "keras==3.11.3" "tensorflow==2.16.2" "jax[cpu]==0.4.30" "torch==2.3.1" \
    "keras-hub==0.20.0" "pytest>=8" "pytest-xdist" "hypothesis>=6"
"$python" -m pip install --quiet --disable-pip-version-check --no-deps -e .

export TF_CPP_MIN_LOG_LEVEL=2 HF_HUB_OFFLINE=1
"$python" -c '
import sys, jax, keras, tensorflow, torch
print(sys.version.split()[0], "keras", keras.__version__, "tensorflow",
      tensorflow.__version__, "jax", jax.__version__, "torch", torch.__version__)'
KERAS_BACKEND=tensorflow "$python" -m pytest "${pytest_args[@]}" \
    "${loss_tests[@]}" tests/test_multilabel_speed_math.py "${training_tests[@]}" "$@"
KERAS_BACKEND=jax "$python" -m pytest "${pytest_args[@]}" "${training_tests[@]}" "$@"
KERAS_BACKEND=torch "$python" -m pytest "${pytest_args[@]}" \
    -m multibackend "${loss_tests[@]}" "$@"
KERAS_BACKEND=torch "$python" -m pytest "${pytest_args[@]}" "${training_tests[@]}" \
    -k "not torch_compile" "$@"
