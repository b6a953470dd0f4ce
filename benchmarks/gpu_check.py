"""Benchmark: on a GPU, what an `ASSpeed` step costs beside a softmax step,
and how much faster its sample filters train once most samples are masked.

A randomly initialised keras-hub `BertBackbone` (the pretrained weights are
not needed to time it), mean-pooled over its padding mask, dropout 0.1 and
a 45-class head, on random token ids whose labels are learnable: three
quarters of each sentence's tokens come from its class's band of 8 ids, so
that AS-Softmax (delta 0.3) masks most samples within two epochs. Two
shapes (`--shape`): `minilm` (all-MiniLM-L6-v2's: 6 layers, hidden 384)
and `bert_base` (12 layers, hidden 768). Sequence length 128, batch 32,
2048 samples that `fit` shuffles each epoch, AdamW (learning rate 1e-4),
`jit_compile=True`.

The variants, each a fresh model from the same seed:

* `softmax`: a plain `keras.Model`, softmax cross entropy (the reference).
* `as_softmax`: a plain `keras.Model`, `ASSoftmaxLoss(0.3)`.
* `as_speed`: `ASSpeed(model)`, the paper's accumulation.
* `skip_masked`: `ASSpeed(model, sample_filter=SkipMasked())`.
* `pair`: `[SkipMaskedLastSeen(n), SkipMasked()]`.

After `--warmup` epochs each (compilation, the filters' warm-up epoch,
masking), the variants train one epoch in turn, `--rounds` times, in one
process. The table prints each variant's median time per step, its ratio
to `softmax`'s, the trained, scored and masked fractions of its last
epoch, and the host's time a step (`host ms`: this thread's CPU time,
Keras's loop and the dispatch; near the step's time, the GPU waits for
the host). Then the verdicts on the two claims this checks:

* (a) an `ASSpeed` step costs at most 1.05x a softmax step;
* (b) with a filter, training is at least 1.5x faster end to end (at most
  0.67x softmax's time per step) once 80% or more of the samples are
  masked.

On JAX and PyTorch, TensorFlow is hidden from this process, as on a GPU
image without it. On PyTorch, `--jit-compile auto` (Keras's default there)
runs the steps eagerly; `true` uses `torch.compile`. `--variants` times a
subset (softmax always); on TensorFlow `NAME@one_program` (or
`@xla_passes`) compiles a filtered step as one XLA program (or as a graph
whose passes are XLA functions) whatever the platform.
`--steps-per-execution N` compiles every variant with it: on JAX, Keras
3.15 dispatches the N steps one by one, later Kerases run them in one
`lax.scan` (keras-team/keras#23527).
`--backbone keras` builds the same encoder from core Keras layers, for
Keras's nightly, which keras-hub 0.32 does not import with.

`--trace DIR` (JAX) then profiles `--trace-steps` more steps of each
variant with `jax.profiler`, one Perfetto trace per variant under
`DIR/<shape>/<variant>/`, for `lab/trace_summary.py` to read
where a step's time goes on the device (on a GPU, with
`XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true`: XLA
otherwise runs its CUDA graphs kernel by kernel while it profiles).
`--quick` runs a 2-layer backbone of hidden size 32 on 512 sentences of
16 tokens, a smoke test on the CPU. It prints its table;
`benchmarks/README.md` says where a run's output is kept. The models,
their data and the command line are `as_softmax_lab.random_bert`'s, which
the lab's scripts build too.

Usage:

```
python benchmarks/gpu_check.py
KERAS_BACKEND=jax python benchmarks/gpu_check.py --shape minilm
KERAS_BACKEND=jax python benchmarks/gpu_check.py --shape minilm --trace t
KERAS_BACKEND=torch python benchmarks/gpu_check.py --jit-compile auto
python benchmarks/gpu_check.py --quick
```
"""

import importlib
import math
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if os.environ["KERAS_BACKEND"] != "tensorflow":
    # `import tensorflow` now fails, as where it is not installed.
    sys.modules["tensorflow"] = None

import keras  # noqa: E402

import keras_as_softmax as kas  # noqa: E402
from as_softmax_lab import random_bert  # noqa: E402
from as_softmax_lab.random_bert import make_data  # noqa: E402
from as_softmax_lab.random_bert import make_variant  # noqa: E402
from as_softmax_lab.timing import epoch_fit  # noqa: E402
from as_softmax_lab.timing import print_table  # noqa: E402
from as_softmax_lab.timing import split_variant  # noqa: E402
from as_softmax_lab.timing import time_epochs  # noqa: E402

FILTERED = ("skip_masked", "pair")


def parse_args(argv=None):
    return random_bert.parse_args(argv, description=__doc__.split("\n\n")[0])


def print_env(args):
    backend = keras.backend.backend()
    print(f"backend: {backend}")
    if backend == "jax":
        import jax

        devices = [f"{d} ({d.device_kind})" for d in jax.devices()]
        print("tensorflow: hidden; this process runs without TensorFlow")
    elif backend == "torch":
        import torch

        devices = ["cpu"] + [
            f"cuda:{i} ({torch.cuda.get_device_name(i)})"
            for i in range(torch.cuda.device_count())
        ]
        print("tensorflow: hidden; this process runs without TensorFlow")
    else:
        import tensorflow as tf

        details = tf.config.experimental.get_device_details
        devices = [
            f"{d.name} ({details(d).get('device_name', d.device_type)})"
            for d in tf.config.list_physical_devices()
        ]
    print(f"devices: {', '.join(devices)}")
    for name in ("keras", "keras_hub", "jax", "torch", "tensorflow"):
        try:
            version = importlib.import_module(name).__version__
        except ImportError:
            version = "not importable"
        print(f"{name}: {version}")
    print(
        f"samples={args.samples} sequence_length={args.sequence_length} "
        f"batch={args.batch_size} learning_rate={args.learning_rate} "
        f"warmup={args.warmup} rounds={args.rounds} "
        f"steps_per_execution={args.steps_per_execution} "
        f"backbone={args.backbone} jit_compile={args.jit_compile}"
    )


def print_verdicts(seconds, logs):
    base = statistics.median(seconds["softmax"])

    def ratio(name):
        return statistics.median(seconds[name]) / base

    print(
        "last epoch's loss: "
        + ", ".join(f"{name} {logs[name]['loss']:.4f}" for name in logs)
    )
    for name in (n for n in seconds if split_variant(n)[0] == "as_speed"):
        met = ratio(name) <= 1.05
        print(
            f"{name} / softmax step: {ratio(name):.2f}x "
            f"(claim <= 1.05x): {'met' if met else 'NOT met'}"
        )
    for name in (n for n in seconds if split_variant(n)[0] in FILTERED):
        masked = logs[name]["masked_ratio"]
        if masked >= 0.8:
            met = ratio(name) <= 1 / 1.5
            verdict = "masked >= 0.80 reached, " + ("met" if met else "NOT met")
        else:
            verdict = "masked >= 0.80 not reached, claim not tested"
        print(
            f"{name} / softmax step: {ratio(name):.2f}x at masked "
            f"{masked:.2f} (claim <= 0.67x, 1.5x faster): {verdict}"
        )


def trace_steps(models, data, directory, args):
    """Profiles `args.trace_steps` steps of one more epoch of each model
    into `directory/<variant>/`, with the Python tracer off (its events
    would outnumber the device's)."""
    import jax

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    epoch = args.warmup + args.rounds  # each model's next epoch
    for variant, model in models.items():
        x, y = data[variant]
        with jax.profiler.trace(
            os.path.join(directory, variant),
            create_perfetto_trace=True,
            profiler_options=options,
        ):
            # `fit` returns once it has read the logs: every step has run.
            model.fit(
                x,
                y,
                batch_size=args.batch_size,
                initial_epoch=epoch,
                epochs=epoch + 1,
                steps_per_epoch=args.trace_steps,
                verbose=0,
            )
    print(f"traces: {directory}/<variant>/plugins/profile/*/")


def check_shape(name, shape, args):
    x, y = make_data(shape["vocabulary_size"], args)
    fits, models, data = {}, {}, {}
    for variant in args.variants:
        model = make_variant(variant, shape, args)
        pair = split_variant(variant)[0] == "pair"
        inputs = kas.filters.with_sample_ids(x) if pair else x
        fits[variant] = epoch_fit(model, inputs, y, args.batch_size)
        models[variant], data[variant] = model, (inputs, y)
    seconds, logs, host = time_epochs(fits, args.warmup, args.rounds)
    print(f"\n== {name}: " + ", ".join(f"{k} {v}" for k, v in shape.items()))
    steps = math.ceil(args.samples / args.batch_size)
    print_table(seconds, logs, steps, reference="softmax", host=host)
    print_verdicts(seconds, logs)
    if args.trace:
        trace_steps(models, data, os.path.join(args.trace, name), args)


def main(argv=None):
    start = time.perf_counter()
    args = parse_args(argv)
    print_env(args)
    for name, shape in args.shapes.items():
        check_shape(name, shape, args)
        keras.backend.clear_session()
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
