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
`benchmarks/README.md` says where a run's output is kept.

Usage:

```
python benchmarks/gpu_check.py
KERAS_BACKEND=jax python benchmarks/gpu_check.py --shape minilm
KERAS_BACKEND=jax python benchmarks/gpu_check.py --shape minilm --trace t
KERAS_BACKEND=torch python benchmarks/gpu_check.py --jit-compile auto
python benchmarks/gpu_check.py --quick
```
"""

import argparse
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
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

import keras_as_softmax as kas  # noqa: E402
from benchmarks._interleaved import epoch_fit  # noqa: E402
from benchmarks._interleaved import print_table  # noqa: E402
from benchmarks._interleaved import split_variant  # noqa: E402
from benchmarks._interleaved import time_epochs  # noqa: E402


def bert_shape(layers, heads, hidden, vocabulary=30522):
    """`BertBackbone`'s size arguments, with BERT's 4x wider feed-forward."""
    return dict(
        vocabulary_size=vocabulary,
        num_layers=layers,
        num_heads=heads,
        hidden_dim=hidden,
        intermediate_dim=4 * hidden,
    )


SHAPES = {
    "minilm": bert_shape(6, 12, 384),
    "bert_base": bert_shape(12, 12, 768),
}
TINY = bert_shape(2, 2, 32, vocabulary=512)
VARIANTS = ("softmax", "as_softmax", "as_speed", "skip_masked", "pair")
FILTERED = ("skip_masked", "pair")
CLASSES = 45
# Ids per class: few, so that every one recurs many times an epoch. With
# 678 each (the vocabulary split 45 ways), BERT-base was at chance still
# after 3 epochs.
BAND = 8


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run")
    parser.add_argument("--shape", choices=(*SHAPES, "both"), default="both")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--sequence-length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps-per-execution", type=int, default=1)
    parser.add_argument(
        "--backbone",
        choices=("keras_hub", "keras"),
        default="keras_hub",
        help="`keras`: the same encoder in core Keras layers",
    )
    parser.add_argument(
        "--jit-compile",
        choices=("true", "auto"),
        default="true",
        help="`auto`: Keras's default (eager on PyTorch)",
    )
    parser.add_argument(
        "--trace",
        metavar="DIR",
        help="JAX: profile more steps of each variant into DIR",
    )
    parser.add_argument("--trace-steps", type=int, default=8)
    args = parser.parse_args(argv)
    if args.trace and keras.backend.backend() != "jax":
        parser.error("--trace: JAX only (KERAS_BACKEND=jax)")
    args.variants = args.variants.split(",")
    try:
        names = {split_variant(v)[0] for v in args.variants}
    except ValueError as error:
        parser.error(f"--variants: {error}")
    if "softmax" not in args.variants or names - set(VARIANTS):
        parser.error(
            f"--variants: softmax and any of {', '.join(VARIANTS)}, "
            "each optionally with @one_program or @xla_passes"
        )
    names = list(SHAPES) if args.shape == "both" else [args.shape]
    args.shapes = {name: SHAPES[name] for name in names}
    if args.quick:
        args.shapes = {"tiny": TINY}
        args.samples, args.sequence_length = 512, 16
        args.learning_rate, args.rounds = 1e-2, 2
    return args


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


def make_data(vocabulary_size, args, seed=0):
    """Random sentences whose labels are learnable: three quarters of each
    sentence's tokens come from its class's band of `BAND` ids, the rest
    from the whole vocabulary. Ids 0, 1 and 2 are padding, `[CLS]` and
    `[SEP]`; a sentence fills half to all of the sequence."""
    rng = np.random.default_rng(seed)
    n, length = args.samples, args.sequence_length
    y = rng.integers(0, CLASSES, n)
    in_band = 3 + y[:, None] * BAND + rng.integers(0, BAND, (n, length))
    anywhere = rng.integers(3, vocabulary_size, (n, length))
    ids = np.where(rng.random((n, length)) < 0.75, in_band, anywhere)
    lengths = rng.integers(length // 2, length + 1, n)
    mask = np.arange(length) < lengths[:, None]
    ids[:, 0] = 1
    ids[np.arange(n), lengths - 1] = 2
    x = {
        "token_ids": np.where(mask, ids, 0).astype("int32"),
        "segment_ids": np.zeros((n, length), "int32"),
        "padding_mask": mask.astype("int32"),
    }
    return x, y.astype("int32")


class _AddPositions(keras.layers.Layer):
    """Adds a learned embedding of each position."""

    def __init__(self, length, dim, **kwargs):
        super().__init__(**kwargs)
        self.table = self.add_weight(
            shape=(length, dim), initializer="random_normal", name="table"
        )

    def call(self, x):
        return x + self.table[: ops.shape(x)[1]]

    def compute_output_shape(self, input_shape):
        return input_shape


def core_keras_encoder(inputs, shape):
    """BERT's encoder at `shape` in core Keras layers (post-norm, GELU,
    dropout 0.1), for a Keras that keras-hub 0.32 does not import with."""
    hidden, heads = shape["hidden_dim"], shape["num_heads"]
    x = keras.layers.Embedding(shape["vocabulary_size"], hidden)(
        inputs["token_ids"]
    )
    x = _AddPositions(512, hidden)(x)
    x = x + keras.layers.Embedding(2, hidden)(inputs["segment_ids"])
    x = keras.layers.Dropout(0.1)(keras.layers.LayerNormalization()(x))
    attend = ops.cast(inputs["padding_mask"], "bool")[:, None, :]
    for _ in range(shape["num_layers"]):
        attention = keras.layers.MultiHeadAttention(
            heads, hidden // heads, dropout=0.1
        )(x, x, attention_mask=attend)
        x = keras.layers.LayerNormalization()(
            x + keras.layers.Dropout(0.1)(attention)
        )
        inner = keras.layers.Dense(shape["intermediate_dim"], activation="gelu")
        outer = keras.layers.Dense(hidden)(inner(x))
        x = keras.layers.LayerNormalization()(
            x + keras.layers.Dropout(0.1)(outer)
        )
    return x


def build_model(shape, backbone="keras_hub"):
    """A `BertBackbone` of `shape` (or `core_keras_encoder`), mean
    pooling, dropout, the class head."""
    keras.utils.set_random_seed(0)
    inputs = {
        name: keras.Input((None,), dtype="int32", name=name)
        for name in ("token_ids", "segment_ids", "padding_mask")
    }
    if backbone == "keras":
        sequence = core_keras_encoder(inputs, shape)
    else:
        import keras_hub

        bert = keras_hub.models.BertBackbone(**shape, max_sequence_length=512)
        # The pooled `[CLS]` output goes unused: nothing for AdamW to update.
        bert.get_layer("pooled_dense").trainable = False
        sequence = bert(inputs)["sequence_output"]
    mask = ops.expand_dims(ops.cast(inputs["padding_mask"], sequence.dtype), -1)
    pooled = ops.sum(sequence * mask, axis=1) / ops.sum(mask, axis=1)
    pooled = keras.layers.Dropout(0.1)(pooled)
    return keras.Model(inputs, keras.layers.Dense(CLASSES)(pooled))


def make_variant(variant, shape, args):
    variant, step = split_variant(variant)
    model = build_model(shape, args.backbone)
    loss = kas.ASSoftmaxLoss(0.3)
    if variant == "softmax":
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    elif variant == "as_speed":
        model = kas.ASSpeed(model)
    elif variant == "skip_masked":
        model = kas.ASSpeed(model, sample_filter=kas.filters.SkipMasked())
    elif variant == "pair":
        sample_filter = [
            kas.filters.SkipMaskedLastSeen(args.samples, seed=0),
            kas.filters.SkipMasked(),
        ]
        model = kas.ASSpeed(model, sample_filter=sample_filter)
    if isinstance(model, kas.ASSpeed):
        model._tf_filtered_step = step
    model.compile(
        optimizer=keras.optimizers.AdamW(args.learning_rate),
        loss=loss,
        jit_compile=True if args.jit_compile == "true" else "auto",
        steps_per_execution=args.steps_per_execution,
    )
    return model


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
