"""Runs a script with the `keras_as_softmax` of another checkout, to time
or count two versions side by side:

    git worktree add /tmp/old <commit>
    python lab/run_with.py /tmp/old benchmarks/step_overhead.py --quick

An editable install puts a path hook before `sys.path`; it is dropped so
that the checkout given comes first.
"""

import runpy
import sys

checkout, script, *args = sys.argv[1:]
sys.meta_path[:] = [
    f for f in sys.meta_path if "editable" not in repr(f).lower()
]
sys.path.insert(0, checkout)
import keras_as_softmax  # noqa: E402

print("package:", keras_as_softmax.__file__, keras_as_softmax.__version__)
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
