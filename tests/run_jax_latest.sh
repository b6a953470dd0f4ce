#!/usr/bin/env bash
# Runs the training suite on JAX with the newest jax that pip finds, under
# Python 3.12, in a venv of its own that later runs reuse. Delete the venv
# (or point JAX_LATEST_VENV elsewhere) to pick up a newer jax release.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${JAX_LATEST_VENV:-$HOME/.cache/keras-as-softmax/py312-jax}"

python312=/root/.pyenv/versions/3.12.1/bin/python
if [[ ! -x "$python312" ]]; then
    python312="$(command -v python3.12 || true)"
fi
if [[ -z "$python312" ]] || ! "$python312" --version >/dev/null 2>&1; then
    echo "run_jax_latest.sh: no Python 3.12 found" \
        "(neither /root/.pyenv/versions/3.12.1/bin/python nor python3.12)" >&2
    exit 1
fi

healthy() {
    "$venv/bin/python" -c \
        'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null &&
        "$venv/bin/python" -m pip --version >/dev/null 2>&1
}

if [[ -e "$venv" ]] && ! healthy; then
    if [[ -f "$venv/pyvenv.cfg" ]]; then
        echo "run_jax_latest.sh: $venv is broken; recreating it" >&2
        rm -rf "$venv"
    else
        echo "run_jax_latest.sh: $venv exists and is not a venv;" \
            "remove it or set JAX_LATEST_VENV" >&2
        exit 1
    fi
fi
if [[ ! -e "$venv" ]]; then
    mkdir -p "$(dirname "$venv")"
    "$python312" -m venv "$venv"
fi
python="$venv/bin/python"

# TensorFlow comes in through the package's own `tensorflow` dependency: the
# training suite needs it on JAX too (tf.data in filters.index_dataset).
# keras-hub for the raw-strings test; the lab (and the PyTorch it pulls in)
# is not needed here.
"$python" -m pip install --quiet --disable-pip-version-check \
    -e ".[test,jax]" keras-hub

export TF_CPP_MIN_LOG_LEVEL=2 HF_HUB_OFFLINE=1
"$python" --version
KERAS_BACKEND=jax "$python" -c '
import jax, jaxlib, keras
print("jax", jax.__version__)
print("jaxlib", jaxlib.__version__)
print("keras", keras.__version__)'
KERAS_BACKEND=jax "$python" -m pytest -q -p no:cacheprovider \
    tests/test_as_speed.py tests/test_filters.py tests/test_accumulation.py "$@"
