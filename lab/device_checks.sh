#!/usr/bin/env bash
# The GPU checks of one lent device session, in priority order, each under
# its own time limit so that one slow part leaves the rest their turn.
# Runs from the repository root on a machine whose image has JAX and
# PyTorch with CUDA but no Keras: wheels for keras, keras-hub, namex and
# optree (Python 3.12) wait in .whl/. Outputs go to $OUT (or results/gpu).
set -u
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/device.txt"
run() {  # run NAME SECONDS BACKEND ARGS...
    local name=$1 seconds=$2 backend=$3
    shift 3
    echo "== $name: KERAS_BACKEND=$backend python3 $*"
    local start=$SECONDS
    KERAS_BACKEND=$backend timeout "$seconds" python3 "$@" 2>&1 \
        | grep -v -e "^WARNING" -e "^I0000" | tee "$OUT/$name.txt"
    echo "== $name: exit ${PIPESTATUS[0]}, $((SECONDS - start)) s"
}
run gpu_check_jax 180 jax benchmarks/gpu_check.py --shape minilm
run gpu_check_torch 130 torch benchmarks/gpu_check.py --shape minilm --jit-compile auto
run step_overhead_jax 50 jax benchmarks/step_overhead.py --rounds 7
run step_overhead_torch 70 torch benchmarks/step_overhead.py --jit-compile auto --rounds 7
run torch_kept_rows 50 torch lab/torch_kept_rows.py --hidden 1024 --rounds 5
