"""The core package stays apart from the experiment harness.

`keras_as_softmax` holds what a user imports to train. The harness
(`as_softmax_lab` in `lab/`: runner, datasets, backbones, plots) and its
dependencies stay out of it and out of its wheel.
"""

import ast
import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import keras
import pytest

import keras_as_softmax

ROOT = pathlib.Path(__file__).resolve().parents[1]
CORE = ROOT / "keras_as_softmax"
# Top-level packages that only the harness may import.
HARNESS_ONLY = (
    "keras_hub",
    "keras_nlp",
    "tensorflow_datasets",
    "matplotlib",
    "sklearn",
    "scipy",
    "as_softmax_lab",
)


def _run_python(code):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_import_loads_no_harness_dependency():
    # `import keras` alone loads matplotlib and scikit-learn when they are
    # installed (keras.visualization, keras.wrappers), and TensorFlow loads
    # scipy: so count only what `import keras_as_softmax` adds to them.
    out = _run_python(
        "import sys\n"
        "import keras\n"
        "before = set(sys.modules)\n"
        "import keras_as_softmax\n"
        "added = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "loaded = {m.split('.')[0] for m in sys.modules}\n"
        f"names = {HARNESS_ONLY!r}\n"
        "print(sorted(n for n in names if n in added))\n"
        "print(sorted(n for n in names[:3] if n in loaded))\n"
    )
    added, hub_like = out.strip().splitlines()[-2:]
    assert added == "[]", f"import keras_as_softmax loaded {added}"
    assert hub_like == "[]", f"import keras_as_softmax loaded {hub_like}"


def test_core_works_with_harness_dependencies_absent():
    # A `None` entry in sys.modules makes `import name` raise ImportError,
    # as if the package were not installed. JAX itself needs scipy.
    blocked = [n for n in HARNESS_ONLY if n != "scipy"]
    if keras.backend.backend() != "jax":
        blocked.append("scipy")
    out = _run_python(
        "import sys\n"
        f"for name in {blocked!r}:\n"
        "    sys.modules[name] = None\n"
        "import numpy as np\n"
        "import keras_as_softmax\n"
        "loss = keras_as_softmax.ASSoftmaxLoss(0.3)\n"
        "value = loss(np.array([0, 1]), np.array([[2.0, 0.0], [0.0, 2.0]]))\n"
        "print(float(value))\n"
    )
    assert float(out.strip().splitlines()[-1]) >= 0.0


def _imported_modules(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module


def test_no_core_module_imports_the_harness_or_its_dependencies():
    files = sorted(CORE.rglob("*.py"))
    assert CORE / "__init__.py" in files
    found = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in files
        for name in _imported_modules(path)
        if name.split(".")[0] in HARNESS_ONLY
    ]
    assert not found, found


def test_harness_lives_outside_the_core():
    for moved in ("experiments.py", "backbones.py", "datasets"):
        assert not (CORE / moved).exists(), moved
    assert not list(CORE.rglob("*.json.gz"))


def test_wheel_holds_only_the_core(tmp_path):
    # Built from a copy of the checkout, so that setuptools' build/ and
    # egg-info folders land in tmp_path. Offline: no build isolation.
    pytest.importorskip("setuptools")
    source = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    # lab/ and tests/ (a package too) are there to check that they stay out.
    for name in ("keras_as_softmax", "lab", "tests"):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"):
        shutil.copy(ROOT / name, source / name)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "--quiet",
            "--wheel-dir",
            str(tmp_path / "dist"),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("keras_as_softmax-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "keras_as_softmax/__init__.py" in names
    stray = [
        n
        for n in names
        if n.split("/")[0] != "keras_as_softmax"
        and not n.split("/")[0].endswith(".dist-info")
    ]
    assert not stray, stray
    data = [
        n
        for n in names
        if n.startswith("keras_as_softmax/") and not n.endswith(".py")
    ]
    assert not data, data
    # The licence travels with the wheel; TensorFlow is a backend's extra.
    (info,) = {n.split("/")[0] for n in names if ".dist-info/" in n}
    assert f"{info}/licenses/LICENSE" in names
    metadata = zipfile.ZipFile(wheel).read(f"{info}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata
    requires = re.findall(r"^Requires-Dist: (.+)$", metadata, re.M)
    assert 'tensorflow>=2.16; extra == "tensorflow"' in requires, requires
    assert not [
        r for r in requires if "extra ==" not in r and "tensorflow" in r
    ]


@pytest.mark.parametrize(
    "path, limit",
    [
        ("README.md", 8000),
        ("benchmarks/RESULTS.md", 12000),
        ("docs/design.md", 12000),
    ],
)
def test_documents_stay_within_their_length(path, limit):
    # What a reader reads: characters, and prose lines that fit a screen.
    text = (ROOT / path).read_text()
    assert len(text) <= limit, (
        f"{path}: {len(text)} characters, at most {limit}"
    )
    prose, in_code = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and not line.startswith(("|", "    ")):
            prose.append(line)
    long = [line for line in prose if len(line) > 100]
    assert not long, f"{path}: prose lines over 100 characters: {long[:3]}"


def test_version_agrees_everywhere():
    # pyproject.toml, the package, the README's first lines and the
    # changelog's newest entry name one version.
    version = re.search(
        r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M
    )[1]
    readme = re.search(
        r"Version (\d+\.\d+\.\d+)", (ROOT / "README.md").read_text()
    )
    changelog = re.search(
        r"^## (\S+)$", (ROOT / "CHANGELOG.md").read_text(), re.M
    )
    found = {
        "pyproject.toml": version,
        "keras_as_softmax.__version__": keras_as_softmax.__version__,
        "README.md": readme and readme[1],
        "CHANGELOG.md": changelog and changelog[1],
    }
    assert set(found.values()) == {version}, found


def test_library_quotes_no_measured_figure():
    # Docstrings say what and why; figures go stale and live in RESULTS.md.
    figure = re.compile(r"\b\d+\.\d+x\b")
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sorted(CORE.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if figure.search(line)
    ]
    assert not found, "\n".join(found)
