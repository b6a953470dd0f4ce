"""The image example runs (quick mode)."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_digits_example_quick(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "digits_image_classification.py"),
            "--quick",
        ],
        cwd=tmp_path,
        env=dict(os.environ, KERAS_BACKEND="tensorflow"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for method in ("softmax", "as_softmax", "as_speed"):
        assert method in out.stdout
