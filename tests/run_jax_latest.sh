#!/usr/bin/env bash
# Runs the training suite on JAX with the newest jax that pip finds, under
# Python 3.12, in a venv of its own that later runs reuse. Delete the venv
# (or point JAX_LATEST_VENV elsewhere) to pick up a newer jax release.
set -euo pipefail
cd "$(dirname "$0")/.."

source tests/venv.sh
source tests/suites.sh
python="$(venv_python 3.12 "${JAX_LATEST_VENV:-$HOME/.cache/keras-as-softmax/py312-jax}")"

# TensorFlow comes in through the `test` extra: the
# training suite needs it on JAX too (tf.data in filters.index_dataset).
# keras-hub for the raw-strings test; the lab (and the PyTorch it pulls in)
# is not needed here.
"$python" -m pip install --quiet --disable-pip-version-check \
    -e ".[test,jax]" keras-hub

export TF_CPP_MIN_LOG_LEVEL=2 HF_HUB_OFFLINE=1
"$python" --version
# The lane tests the jax that README.md names for Python 3.12, or newer:
# an older one (a stale venv, a pin elsewhere) stops it here.
KERAS_BACKEND=jax "$python" -c '
import re, jax, jaxlib, keras
print("jax", jax.__version__)
print("jaxlib", jaxlib.__version__)
print("keras", keras.__version__)
named = re.search(r"and (\d+\.\d+) \(3\.12", open("README.md").read())
assert named, "README.md names no jax release for Python 3.12"
have = tuple(int(p) for p in jax.__version__.split(".")[:2])
need = tuple(int(p) for p in named.group(1).split("."))
assert have >= need, f"jax {jax.__version__} is older than README.md names: {named.group(1)}"'
KERAS_BACKEND=jax "$python" -m pytest "${pytest_args[@]}" "${training_tests[@]}" "$@"
