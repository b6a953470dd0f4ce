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


# Run logs that do not belong in the package: measured ratios, timings,
# release numbers, dates, our issue numbers and paths into the tool folders.
# They go stale; CHANGELOG.md and benchmarks/RESULTS.md keep them.
_RUN_LOG = re.compile(
    r"\b\d+\.\d+x\b"
    r"|\b\d+(\.\d+)?(-\d+(\.\d+)?)? ?(ms|us|µs)\b"
    r"|\b\d+\.\d+\.\d+\b"
    r"|\b(keras|jax|jaxlib|tensorflow|torch|python|numpy|keras-hub) "
    r"\d+\.\d+"
    r"|\b20\d\d-\d\d-\d\d\b"
    r"|\bissue \d+|(?<![\w/-])#\d+"
    r"|(?-i:\b(lab|benchmarks)/|RESULTS\.md)",
    re.IGNORECASE,
)


def test_library_quotes_no_run_log():
    # Docstrings and comments say what and why, in the present tense.
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sorted(CORE.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if _RUN_LOG.search(line) and not line.startswith("__version__ =")
    ]
    assert not found, "\n".join(found)


def test_run_log_pattern_finds_what_it_names():
    for line in [
        "costs 0.7-0.8 ms for MiniLM",
        "a 1.5x speed-up",
        "saved by 0.5.19 or earlier",
        "Keras 3.15's fit",
        "measured on 2026-12-07",
        "see issue 87",
        "fixed in #42",
        "`lab/state_tracking.py`",
        "benchmarks/RESULTS.md",
    ]:
        assert _RUN_LOG.search(line), line
    for line in [
        "keras-team/keras#23527",
        "lam=0.5",
        "delta + 0.1",
        "github.com/NUS-HPC-AI-Lab/InfoBatch",
    ]:
        assert not _RUN_LOG.search(line), line


def _asspeed_privates():
    """Private names `ASSpeed` defines itself (methods and attributes it
    sets), not those it overrides from `keras.Model`."""
    tree = ast.parse((CORE / "training" / "as_speed.py").read_text())
    (cls,) = [
        node
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.name == "ASSpeed"
    ]
    names = {
        node.name
        for node in cls.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    names |= {
        target.id
        for node in cls.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    names |= {
        node.attr
        for node in ast.walk(cls)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and isinstance(node.ctx, ast.Store)
    }
    return {
        name
        for name in names
        if name.startswith("_")
        and not name.startswith("__")
        and not hasattr(keras.Model, name)
    }


def test_no_module_but_as_speed_reads_its_private_members():
    privates = _asspeed_privates()
    assert {"_check_compiled", "_start_steps", "_create_queues"} <= privates
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}"
        for path in sorted(CORE.rglob("*.py"))
        if path.name != "as_speed.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in privates
    ]
    assert not found, "\n".join(found)


def test_no_class_of_the_package_is_over_450_lines():
    long = [
        f"{path.relative_to(ROOT)}: {node.name}, "
        f"{node.end_lineno - node.lineno + 1} lines"
        for path in sorted(CORE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
        and node.end_lineno - node.lineno + 1 > 450
    ]
    assert not long, "\n".join(long)
    lines = len((CORE / "training" / "as_speed.py").read_text().splitlines())
    assert lines <= 600, lines


def _sys_path_edits(tree):
    """Lines of `tree` that change `sys.path`: a call of one of its methods
    (`insert`, `append`, ...), an assignment to it or to a slice of it,
    `from sys import path`, `site.addsitedir`."""
    sys_names = {"sys"} | {
        alias.asname
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
        if alias.name == "sys" and alias.asname
    }

    def is_sys_path(node):
        while isinstance(node, ast.Subscript):
            node = node.value
        return (
            isinstance(node, ast.Attribute)
            and node.attr == "path"
            and isinstance(node.value, ast.Name)
            and node.value.id in sys_names
        )

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = node.func
            if is_sys_path(func.value) or (
                func.attr == "addsitedir"
                and isinstance(func.value, ast.Name)
                and func.value.id == "site"
            ):
                yield node.lineno
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = getattr(node, "targets", None) or [node.target]
            if any(is_sys_path(target) for target in targets):
                yield node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module == "sys":
            if any(alias.name == "path" for alias in node.names):
                yield node.lineno


def _benchmark_imports(tree):
    """Lines of `tree` that import the `benchmarks/` folder."""
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None))
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            names = [str(node.args[0].value)]
        if any(name.split(".")[0] == "benchmarks" for name in names):
            yield node.lineno


def test_tool_folders_import_one_way_without_editing_sys_path():
    # lab/ may import the package; benchmarks/ the package and lab's
    # `as_softmax_lab`; nothing imports benchmarks/ from lab/. Both
    # packages are installed (editable), so no script edits `sys.path`.
    edits = (
        "import sys\nimport sys as s\nimport site\n"
        "sys.path.insert(0, 'x')\nsys.path[:0] = ['x']\ns.path.append('x')\n"
        "sys.path += ['x']\nsite.addsitedir('x')\nfrom sys import path\n"
        "print(sys.path[0])\nsys.argv = []\n"
    )
    assert sorted(_sys_path_edits(ast.parse(edits))) == [4, 5, 6, 7, 8, 9]
    imports = (
        "import benchmarks.gpu_check\nfrom benchmarks import step_overhead\n"
        "importlib.import_module('benchmarks._interleaved')\n"
        "import as_softmax_lab\nfrom . import benchmarks\n"
    )
    assert sorted(_benchmark_imports(ast.parse(imports))) == [1, 2, 3]
    files = sorted((ROOT / "lab").rglob("*.py"))
    files += sorted((ROOT / "benchmarks").rglob("*.py"))
    assert ROOT / "lab" / "run_with.py" in files
    assert ROOT / "benchmarks" / "gpu_check.py" in files
    found = []
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        where = path.relative_to(ROOT)
        edits = sorted(_sys_path_edits(tree))
        found += [f"{where}:{n}: edits sys.path" for n in edits]
        if where.parts[0] == "lab":
            found += [
                f"{where}:{n}: imports benchmarks/"
                for n in sorted(_benchmark_imports(tree))
            ]
    assert not found, "\n".join(found)
