"""Executes the example notebooks with nbclient, papermill-style.

A cell of parameter overrides is injected right after each notebook's cell
tagged `parameters`; the executed copies are written to `--output-dir`
(the source notebooks are only overwritten with `--inplace`). Exits with a
non-zero status if any notebook fails.

Usage:

```
# CI smoke run, the three notebooks at once:
python examples/run_notebooks.py --quick --jobs 3 -o /tmp/nb
# full offline run, outputs committed:
python examples/run_notebooks.py --inplace
python examples/run_notebooks.py token_classification.ipynb \\
    -p EPOCHS=3 -p SEEDS=[0,1]
# online (network needed):
python examples/run_notebooks.py -p SOURCE='"clinc_oos"' \\
    -p PRESET='"bert_base_en_uncased"' multiclass_text_classification.ipynb
```

`-p NAME=VALUE` takes a Python literal (`ast.literal_eval`); a value that
is not a literal is taken as a string (`-p SOURCE=clinc_oos`).
"""

import argparse
import ast
import concurrent.futures
import copy
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
NOTEBOOKS = (
    "multiclass_text_classification.ipynb",
    "multilabel_text_classification.ipynb",
    "token_classification.ipynb",
)
# Tiny sizes for CI: every code path runs (3 methods, several evaluations,
# all plots) in well under a minute of training per notebook on 2 CPU cores,
# on a one-layer random BERT with MiniLM's tokenizer (compiling MiniLM's six
# layers for each method took most of the time).
QUICK_PARAMETERS = {
    "QUICK": True,
    "PRESET": "tiny-random",
    "TRAIN_SIZE": 32,
    "EVAL_SIZE": 16,
    "SEQUENCE_LENGTH": 16,
    "EPOCHS": 1,
    "BATCH_SIZE": 16,
    "EVALS_PER_EPOCH": 2,
    "SEEDS": [0],
    "JIT_COMPILE": False,  # XLA compilation of BERT dominates a tiny CPU run
}


def parse_value(text):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_parameters(items):
    params = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep or not name.strip().isidentifier():
            raise SystemExit(f"-p expects NAME=VALUE. Received: {item!r}")
        params[name.strip()] = parse_value(value)
    return params


def ensure_kernel(name):
    """Makes sure the Jupyter kernel `name` exists; installs `python3` from
    this interpreter's ipykernel (`python -m ipykernel install --user`) when
    it is missing, e.g. on a fresh CI machine."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.kernelspec import NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec(name)
        return
    except NoSuchKernel:
        if name != "python3":
            raise
    print(
        f"[run_notebooks] kernel {name!r} not found; "
        "installing it with ipykernel",
        flush=True,
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "ipykernel",
            "install",
            "--user",
            "--name",
            name,
        ],
        check=True,
    )
    KernelSpecManager().get_kernel_spec(name)


def inject_parameters(nb, params):
    """Returns a copy of `nb` with an `injected-parameters` cell right after
    the cell tagged `parameters` (at the top if there is none)."""
    import nbformat

    nb = copy.deepcopy(nb)
    cells = [
        c
        for c in nb.cells
        if "injected-parameters" not in c.get("metadata", {}).get("tags", [])
    ]
    nb.cells = cells
    if not params:
        return nb
    index = next(
        (
            i + 1
            for i, c in enumerate(cells)
            if "parameters" in c.get("metadata", {}).get("tags", [])
        ),
        0,
    )
    source = "# Parameters injected by examples/run_notebooks.py\n" + "".join(
        f"{name} = {value!r}\n" for name, value in params.items()
    )
    cell = nbformat.v4.new_code_cell(
        source, metadata={"tags": ["injected-parameters"]}
    )
    cells.insert(index, cell)
    return nb


def run_notebook(
    path, output_path, params, kernel_name="python3", timeout=1800
):
    """Executes one notebook; writes the executed copy (also on failure).

    Returns:
        `(ok, seconds, error message or None)`.
    """
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = inject_parameters(nbformat.read(path, as_version=4), params)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name=kernel_name,
        resources={
            "metadata": {"path": os.path.dirname(os.path.abspath(path))}
        },
    )
    start = time.perf_counter()
    error = None
    try:
        client.execute()
    except CellExecutionError as e:
        error = str(e)
    except Exception as e:  # kernel death, timeout: report it as a failure.
        error = f"{type(e).__name__}: {e}"
    seconds = time.perf_counter() - start
    nb.metadata.setdefault("keras_as_softmax", {})["execution"] = {
        "parameters": params,
        "seconds": round(seconds, 1),
    }
    os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
    nbformat.write(nb, output_path)
    return error is None, seconds, error


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "notebooks",
        nargs="*",
        help=f"notebooks to run (default: the {len(NOTEBOOKS)} examples)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"tiny smoke run: {QUICK_PARAMETERS}",
    )
    parser.add_argument(
        "-p",
        "--parameter",
        action="append",
        metavar="NAME=VALUE",
        help="override a parameter",
    )
    parser.add_argument(
        "-o",
        "--output-dir",
        default="executed_notebooks",
        help="where executed copies go",
    )
    parser.add_argument(
        "--inplace",
        action="store_true",
        help="overwrite the source notebooks with their outputs",
    )
    parser.add_argument("--kernel", default="python3")
    parser.add_argument(
        "--timeout", type=int, default=1800, help="seconds per cell"
    )
    parser.add_argument(
        "-j",
        "--jobs",
        type=int,
        default=1,
        help="notebooks run at once, each in a kernel of its own",
    )
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs expects 1 or more. Received: {args.jobs}")

    params = dict(QUICK_PARAMETERS) if args.quick else {}
    params.update(parse_parameters(args.parameter))
    paths = [
        p if os.path.exists(p) else os.path.join(HERE, p)
        for p in (args.notebooks or NOTEBOOKS)
    ]
    ensure_kernel(args.kernel)
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("MPLBACKEND", "Agg")

    def run(path):
        output = (
            path
            if args.inplace
            else os.path.join(args.output_dir, os.path.basename(path))
        )
        print(
            f"[run_notebooks] {os.path.basename(path)} -> {output} "
            f"{params or ''}",
            flush=True,
        )
        ok, seconds, error = run_notebook(
            path, output, params, args.kernel, args.timeout
        )
        print(
            f"[run_notebooks] {os.path.basename(path)} "
            f"{'ok' if ok else 'FAILED'} in {seconds:.0f}s",
            flush=True,
        )
        if not ok:
            print(error, file=sys.stderr, flush=True)
        return ok

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(run, paths))
    failures = [path for path, ok in zip(paths, results) if not ok]
    if failures:
        print(
            f"[run_notebooks] {len(failures)} notebook(s) failed: {failures}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
