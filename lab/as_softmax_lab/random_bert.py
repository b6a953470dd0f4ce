"""The models of `benchmarks/gpu_check.py`, with its command line: a
randomly initialised keras-hub `BertBackbone` (or the same encoder in core
Keras layers), mean-pooled over its padding mask, dropout 0.1 and a
45-class head, on random token ids whose labels are learnable, in each of
the benchmark's variants (its docstring describes them). Here for the
benchmark and for the lab's scripts that time or compile the same models
(`lab/host_time.py`, `lab/state_tracking.py`, `lab/gpu_program.py`).
"""

import argparse

import keras
import numpy as np
from keras import ops

import keras_as_softmax as kas
from as_softmax_lab.timing import split_variant


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
CLASSES = 45
# Ids per class: few, so that every one recurs many times an epoch. With
# 678 each (the vocabulary split 45 ways), BERT-base was at chance still
# after 3 epochs.
BAND = 8


def parse_args(argv=None, description=None):
    """`gpu_check.py`'s command line; `parse_args([])` gives its
    defaults, `parse_args(["--quick"])` its smoke test's settings."""
    parser = argparse.ArgumentParser(description=description)
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
