"""Investigation (issue 31): on PyTorch, does training on exactly the kept
rows of each drawn batch (dynamic shapes, eager) beat the shared queue of
`_filtering.filtered_step`? It decided PyTorch's eager default.

Both designs score every drawn batch and train on the samples that are not
masked, with their drawn batch's coefficients:

* `queue`: the subclass below, `_filtering.filtered_step` (as under
  `torch.compile`): kept rows wait in a queue, a training pass runs on
  every full batch of them.
* `kept_rows`: `ASSpeed(model, sample_filter=SkipMasked(0.0))`, eager
  PyTorch's default (`_filtering.kept_rows_step`): a training pass on the
  kept rows of every drawn batch, no queue.

Plain Keras and `ASSpeed` without a filter are timed beside them, on
`benchmarks/step_overhead.py`'s tiny MLP (the stand-in for a fast
accelerator) and on a wider one (`--hidden 1024`, where compute counts).

    KERAS_BACKEND=torch python lab/torch_kept_rows.py
    KERAS_BACKEND=torch python lab/torch_kept_rows.py --hidden 1024
"""

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import keras  # noqa: E402

import keras_as_softmax as kas  # noqa: E402
from benchmarks._interleaved import epoch_fit  # noqa: E402
from benchmarks._interleaved import print_table  # noqa: E402
from benchmarks._interleaved import time_epochs  # noqa: E402
from benchmarks.step_overhead import make_data  # noqa: E402


class Queue(kas.ASSpeed):
    """The queue of `_filtering.filtered_step` in eager steps, as under
    `torch.compile`."""

    @property
    def _kept_rows(self):
        return False


def make_model(variant, hidden):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(5),
        ]
    )
    if variant == "as_speed":
        model = kas.ASSpeed(model)
    elif variant == "queue":
        model = Queue(model, sample_filter=kas.filters.SkipMasked(0.0))
    elif variant == "kept_rows":
        model = kas.ASSpeed(model, sample_filter=kas.filters.SkipMasked(0.0))
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3), loss=kas.ASSoftmaxLoss(0.3)
    )
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    x, y = make_data(args.samples)
    fits = {
        variant: epoch_fit(
            make_model(variant, args.hidden), x, y, args.batch_size
        )
        for variant in ("keras", "as_speed", "queue", "kept_rows")
    }
    seconds, logs = time_epochs(fits, args.warmup, args.rounds)
    print(
        f"backend={keras.backend.backend()} hidden={args.hidden} "
        f"samples={args.samples} batch={args.batch_size} "
        f"warmup={args.warmup} rounds={args.rounds}"
    )
    steps = args.samples // args.batch_size
    print_table(seconds, logs, steps, reference="keras")


if __name__ == "__main__":
    main()
