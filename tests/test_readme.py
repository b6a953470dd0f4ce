"""The README's quickstart runs as written."""

import os
import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def quickstart_code():
    text = README.read_text()
    section = text.split("## Quickstart", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_quickstart_runs_as_written(tmp_path):
    env = dict(
        os.environ, KERAS_BACKEND=os.environ.get("KERAS_BACKEND", "tensorflow")
    )
    out = subprocess.run(
        [sys.executable, "-c", quickstart_code()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "masked_ratio" in out.stdout or "[" in out.stdout
