"""Benchmark: what an `ASSpeed` step costs beyond a plain Keras step when
the model's own compute is negligible, as on a fast accelerator.

A tiny MLP (16-32-5), batch 32, 4096 samples of five Gaussian blobs,
`jit_compile=True`, AS-Softmax (delta 0.3) in every variant. After
`--warmup` epochs each, the variants train one epoch in turn, `--rounds`
times, in one process; each epoch's time over its steps is one sample, and
the table prints each variant's median per-step time and its ratio to the
plain Keras step measured beside it, and `host ms`: the calling thread's
CPU milliseconds a step (Keras's loop, the dispatch and, on a CPU, what of
the step runs in that thread). Where the wall time a step exceeds it by
far, the step waits for other threads. Compilation happens in the warm-up.

The variants:

* `keras`: a plain `keras.Model` compiled with the same loss.
* `keras_metrics` (not run by default): the plain model logging two
  metrics (`MaskedRatio`), as many log entries as `ASSpeed` adds
  (`masked_ratio`, `accum_steps`): Keras reads each entry of every
  step's logs on the host (on JAX and PyTorch in a thread beside the
  training loop, on TensorFlow in it).
* `keras_untracked` (not run by default): the plain model keeping Keras's
  per-step `_jax_state` out of attribute tracking, as `ASSpeed` does on
  JAX (elsewhere the same as `keras`): what the plain step costs without
  that host work, for a ratio that leaves it out.
* `as_speed`: `ASSpeed(model)`, the paper's accumulation (lam 0.5, cap 4).
* `skip_masked`: `ASSpeed(model, sample_filter=SkipMasked())`.
* `pair`: `[SkipMaskedLastSeen(n), SkipMasked()]`.
* `selective_backprop`: `SelectiveBackprop()`.

A variant `NAME@one_program` (or `@xla_passes`) compiles its filtered step
on TensorFlow as one XLA program (or as a graph whose passes are XLA
functions) whatever the platform; `NAME` alone takes the platform's
default (the graph on CPUs).

The filters are active after their one warm-up epoch; the trained and
scored fractions of the last epoch are printed beside each ratio.

`--row-shape 128,768` gives every sample wide inputs instead (the blobs in
the first 16 features of each of 128 positions, zeros after them), which
the model averages over the positions before its two layers: a step that
reads its batch once, as a model on precomputed token embeddings does,
to show what the filters' queues cost per byte of a row.

The model, its data and the command line are `as_softmax_lab.tiny_mlp`'s,
which the lab's scripts build too.

Usage:

```
python benchmarks/step_overhead.py
KERAS_BACKEND=jax python benchmarks/step_overhead.py
KERAS_BACKEND=torch python benchmarks/step_overhead.py --jit-compile auto
python benchmarks/step_overhead.py --steps-per-execution 8
python benchmarks/step_overhead.py --variants keras,pair,pair@one_program
python benchmarks/step_overhead.py --row-shape 128,768 --samples 512
python benchmarks/step_overhead.py --quick     # smoke run
```
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

import keras_as_softmax as kas  # noqa: E402
from as_softmax_lab import tiny_mlp  # noqa: E402
from as_softmax_lab.timing import epoch_fit  # noqa: E402
from as_softmax_lab.timing import print_table  # noqa: E402
from as_softmax_lab.timing import split_variant  # noqa: E402
from as_softmax_lab.timing import time_epochs  # noqa: E402
from as_softmax_lab.tiny_mlp import make_data  # noqa: E402
from as_softmax_lab.tiny_mlp import make_model  # noqa: E402


def parse_args(argv=None):
    return tiny_mlp.parse_args(argv, description=__doc__.split("\n\n")[0])


def main(argv=None):
    args = parse_args(argv)
    x, y = make_data(args.samples, args.row_shape)
    steps = args.samples // args.batch_size
    fits = {}
    for variant in args.variants.split(","):
        model = make_model(variant, args.samples, args)
        pair = split_variant(variant)[0] == "pair"
        inputs = kas.filters.with_sample_ids(x) if pair else x
        fits[variant] = epoch_fit(model, inputs, y, args.batch_size)
    seconds, logs, host = time_epochs(fits, args.warmup, args.rounds)
    print(
        f"keras={keras.__version__} backend={keras.backend.backend()} "
        f"samples={args.samples} "
        f"batch={args.batch_size} warmup={args.warmup} rounds={args.rounds} "
        f"steps_per_execution={args.steps_per_execution} "
        f"row_shape={','.join(map(str, args.row_shape))} "
        f"jit_compile={args.jit_compile}"
    )
    print_table(seconds, logs, steps, reference=next(iter(fits)), host=host)


if __name__ == "__main__":
    main()
