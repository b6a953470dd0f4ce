"""Investigation (issue 31): on PyTorch, does training on exactly the kept
rows of each drawn batch (dynamic shapes, eager) beat the shared queue of
`_filtering.filtered_step`?

Both designs score every drawn batch and train on the samples that are not
masked, with their drawn batch's coefficients:

* `queue`: `ASSpeed(model, sample_filter=SkipMasked(0.0))`, the package's
  step: kept rows wait in a queue, a training pass runs on every full
  batch of them.
* `kept_rows`: the subclass below: a training pass on the kept rows of
  every drawn batch (`x[keep]`), no queue.

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
import torch  # noqa: E402
from keras import ops  # noqa: E402

import keras_as_softmax as kas  # noqa: E402
from benchmarks._interleaved import epoch_fit  # noqa: E402
from benchmarks._interleaved import print_table  # noqa: E402
from benchmarks._interleaved import time_epochs  # noqa: E402
from benchmarks.step_overhead import make_data  # noqa: E402
from keras_as_softmax.training import _filtering  # noqa: E402


class KeptRows(kas.ASSpeed):
    """`SkipMasked(0.0)` on exactly the kept rows of each drawn batch."""

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        loss_fn, optimizer = self.loss, self.optimizer
        variables = self.trainable_variables
        if not optimizer.built:
            optimizer.build(variables)
        epoch, epochs = self._epoch_state()
        active = bool(self.sample_filters[0].active(epoch, epochs))
        with torch.no_grad():
            y_pred = self.inner_model(x, training=True)  # the scoring pass
            values = _filtering.row_values(loss_fn, y, y_pred)
            counted, masked, _ = _filtering.row_flags(
                loss_fn, y, values, sample_weight
            )
            coefficients = _filtering.row_coefficients(
                loss_fn, y, sample_weight, values.shape
            )
            keep = ~masked if active else torch.ones_like(masked)
        loss = ops.sum(coefficients * values)
        if bool(keep.any()):
            with torch.enable_grad():
                self.zero_grad()
                kept_pred = self.inner_model(x[keep], training=True)
                kept = _filtering.row_values(loss_fn, y[keep], kept_pred)
                ops.sum(coefficients[keep] * kept).backward()
            optimizer.accumulate([v.value.grad for v in variables])
        with torch.no_grad():
            rows = ops.sum(ops.cast(counted, "float32"))
            n_masked = ops.sum(ops.cast(masked, "float32"))
            optimizer.apply(None, variables, rows=rows, masked_rows=n_masked)
            self._loss_tracker.update_state(loss)
            logs = self._step_metrics(
                x,
                y,
                y_pred,
                sample_weight,
                counts=(n_masked, rows),
                trained=ops.mean(ops.cast(keep, "float32")),
            )
        logs["accum_steps"] = optimizer.accumulation_steps
        return logs


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
        model = kas.ASSpeed(model, sample_filter=kas.filters.SkipMasked(0.0))
    elif variant == "kept_rows":
        model = KeptRows(model, sample_filter=kas.filters.SkipMasked(0.0))
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
