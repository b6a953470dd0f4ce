"""Smoke tests: the benchmark scripts run with `--quick` and print their tables.

Only checks that the script works (tiny shapes, 2 rounds); it asserts
nothing about the times it prints.
"""

import os
import pathlib
import subprocess
import sys

import keras
import pytest

SCRIPT = (
    pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "loss_speed.py"
)


def run_quick(script, backend, timeout):
    """Runs `script --quick` on `backend`; returns its stdout."""
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run(
        [sys.executable, str(script), "--quick"],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_loss_speed_quick_runs_and_prints_table():
    backend = keras.backend.backend()
    if backend not in ("tensorflow", "jax"):
        pytest.skip(f"loss_speed.py runs on tensorflow or jax, not {backend}")
    out = run_quick(SCRIPT, backend, timeout=120)
    header = [line for line in out.splitlines() if line.startswith("case")]
    assert header, out
    for column in ("ours ms", "base ms", "time x", "peak MiB ours", "mem x"):
        assert column in header[0], out
    for name in (
        "AS-Softmax vs SCCE ",
        "AS-Softmax vs SCCE tok",
        "ML AS-Softmax vs MLCCE",
        "ML AS fn, fixed delta",
    ):
        assert name in out, out
    assert "Targets: time x <= 1.10" in out, out


STEP_COST = SCRIPT.parent / "step_cost.py"


@pytest.mark.slow
def test_step_cost_quick_runs_and_prints_the_bound():
    if keras.backend.backend() != "tensorflow":
        pytest.skip("step_cost.py times TensorFlow with XLA")
    out = run_quick(STEP_COST, "tensorflow", timeout=900)
    for part in (
        "train step [8]",
        "AdamW update alone",
        "inference forward [8]",
        "forward + backward [2]",
    ):
        assert part in out, out
    assert "s = 5:" in out and "Upper bound" in out, out
    for part in (
        "plain step, graph",
        "SkipMasked, graph, 0/8 masked",
        "SkipMasked, graph, 7/8 masked",
    ):
        assert part in out, out
    # The labels set the masked share that the train step then reports.
    row = [line for line in out.splitlines() if "graph, 6/8 masked" in line][0]
    assert "masked 0.75" in row and "trained 0.25" in row, out
