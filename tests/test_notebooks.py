"""Runs the three example notebooks top to bottom in quick mode (CI)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
NOTEBOOKS = (
    "multiclass_text_classification.ipynb",
    "multilabel_text_classification.ipynb",
    "token_classification.ipynb",
)

pytest.importorskip("nbclient")
pytest.importorskip("nbformat")
pytest.importorskip("keras_hub")


@pytest.mark.slow
def test_notebooks_run_in_quick_mode(tmp_path):
    sources = {
        n: open(os.path.join(EXAMPLES, n), "rb").read() for n in NOTEBOOKS
    }
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(EXAMPLES, "run_notebooks.py"),
            "--quick",
            "--jobs",
            str(len(NOTEBOOKS)),
            "-o",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]

    import nbformat

    for name in NOTEBOOKS:
        nb = nbformat.read(str(tmp_path / name), as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert "parameters" in code[0].metadata.get("tags", [])
        assert "injected-parameters" in code[1].metadata.get("tags", [])
        assert "QUICK = True" in code[1].source
        errors = [
            o
            for c in code
            for o in c.get("outputs", [])
            if o.get("output_type") == "error"
        ]
        assert not errors, errors
        text = "".join(
            o.get("text", "") for c in code for o in c.get("outputs", [])
        )
        for method in ("softmax", "as_softmax", "as_skip_hybrid"):
            assert method in text
        images = [
            o
            for c in code
            for o in c.get("outputs", [])
            if "image/png" in o.get("data", {})
        ]
        assert len(images) == 3, name  # Fig. 1, Table 4 and Fig. 4 plots
        # The source notebooks are not modified without --inplace.
        assert open(os.path.join(EXAMPLES, name), "rb").read() == sources[name]
