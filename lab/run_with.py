"""Runs a script with the `keras_as_softmax` of another checkout, to time
or count two versions side by side:

    git worktree add /tmp/old <commit>
    python lab/run_with.py /tmp/old benchmarks/step_overhead.py --quick

The script runs in a child process whose `PYTHONPATH` starts with the
checkout given, so that its package comes before the installed one (an
editable install's finders are dropped there too); the rest
(`as_softmax_lab`, the other dependencies) is this environment's. The
child prints the package it loaded, then runs the script as its
`__main__` with `ARGS`; the exit status is the script's.
"""

import os
import runpy
import subprocess
import sys


def run_script(script, args):
    """In the child: loads the package, says which, runs `script`."""
    sys.meta_path[:] = [
        f for f in sys.meta_path if "editable" not in repr(f).lower()
    ]
    import keras_as_softmax

    print("package:", keras_as_softmax.__file__, keras_as_softmax.__version__)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


def main():
    if sys.argv[1:2] == ["--child"]:
        run_script(sys.argv[2], sys.argv[3:])
        return
    checkout, script, *args = sys.argv[1:]
    path = [os.path.abspath(checkout), os.environ.get("PYTHONPATH")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, path)))
    command = [sys.executable, os.path.abspath(__file__), "--child", script]
    sys.exit(subprocess.run(command + args, env=env).returncode)


if __name__ == "__main__":
    main()
