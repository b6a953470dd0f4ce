#!/usr/bin/env bash
# Runs the loss suite on TensorFlow and the training suite's core on JAX
# (tests/suites.sh) with the newest of everything: Keras's next release, as
# one pinned nightly build carries it (KERAS_NEXT), the newest jax, under
# Python 3.13, in a venv of its own that later runs reuse. That Keras runs `steps_per_execution`
# steps in one `jax.lax.scan` on JAX (keras-team/keras#23527), one dispatch
# for N drawn batches: how a GPU user cuts the host's time a step. The
# build goes into a folder of its own that shadows the venv's Keras
# (PYTHONPATH), so the venv keeps its release. keras-hub 0.32 does not
# import with it: its test is left out.
set -euo pipefail
cd "$(dirname "$0")/.."

source tests/venv.sh
source tests/suites.sh
python="$(venv_python 3.13 "${KERAS_NEXT_VENV:-$HOME/.cache/keras-as-softmax/py313}")"
"$python" -m pip install --quiet --disable-pip-version-check -e ".[test,jax]"
next="${KERAS_NEXT:-keras-nightly==3.16.0.dev2026102704}"
site="$HOME/.cache/keras-as-softmax/keras-next/${next##*==}"
if [[ ! -d "$site/keras" ]]; then
    "$python" -m pip install --quiet --disable-pip-version-check --no-deps \
        --target "$site" "$next"
fi

export PYTHONPATH="$site" TF_CPP_MIN_LOG_LEVEL=2 HF_HUB_OFFLINE=1
"$python" --version
KERAS_BACKEND=jax "$python" -c '
import jax, keras
print("jax", jax.__version__)
print("keras", keras.__version__)'
KERAS_BACKEND=tensorflow "$python" -m pytest "${pytest_args[@]}" "${loss_tests[@]}" "$@"
KERAS_BACKEND=jax "$python" -m pytest "${pytest_args[@]}" "${training_tests[@]}" \
    -k "$core_training" "$@"
