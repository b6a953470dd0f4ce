"""The classifier a run trains: a BERT backbone with a linear head."""

import keras
from keras import ops

from as_softmax_lab.methods import check_task


class Backbone:
    """A BERT backbone loaded once, cloned fresh for every run.

    Attributes:
        backbone: the loaded `keras_hub.models.BertBackbone`.
        tokenizer: its `keras_hub.models.BertTokenizer`.
        preset: the preset it came from (or `None`).

    Use `load_backbone(preset)` for a pretrained one, or wrap any backbone
    and tokenizer (e.g. a tiny randomly initialised one in tests).
    """

    def __init__(self, backbone, tokenizer, preset=None):
        self.backbone = backbone
        self.tokenizer = tokenizer
        self.preset = preset
        self._config = backbone.get_config()
        self._weights = backbone.get_weights()

    def fresh(self):
        """A new backbone with the loaded (initial) weights."""
        import keras_hub

        backbone = keras_hub.models.BertBackbone.from_config(self._config)
        backbone.set_weights(self._weights)
        return backbone


# `load_backbone`'s preset for smoke runs: `tiny_backbone` on the offline
# MiniLM's tokenizer, with none of its weights.
TINY_RANDOM = "tiny-random"


def load_backbone(preset="offline-minilm", **kwargs):
    """Loads a pretrained BERT backbone and tokenizer as a `Backbone`.

    Args:
        preset: `"offline-minilm"` (default, no network), any KerasHub
            BERT preset (see `as_softmax_lab.backbones.load_bert`), or
            `"tiny-random"`: a one-layer randomly initialised BERT on the
            offline MiniLM's tokenizer (`tiny_backbone`), for smoke runs.
        **kwargs: passed to `load_bert`.

    Returns:
        A `Backbone`.
    """
    from as_softmax_lab import backbones

    if preset == TINY_RANDOM:
        tokenizer = backbones.load_tokenizer(backbones.OFFLINE_MINILM)
        tiny = tiny_backbone(tokenizer, max_sequence_length=512)
        return Backbone(tiny.backbone, tokenizer, preset)
    backbone, tokenizer = backbones.load_bert(preset, **kwargs)
    return Backbone(backbone, tokenizer, preset)


def tiny_backbone(tokenizer, max_sequence_length=64):
    """A one-layer, 16-wide randomly initialised BERT on `tokenizer`, as a
    `Backbone`: for smoke runs and tests."""
    import keras_hub

    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=tokenizer.vocabulary_size(),
        num_layers=1,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=max_sequence_length,
    )
    return Backbone(backbone, tokenizer)


def build_classifier(
    task, num_classes, backbone="offline-minilm", dropout=0.1, pooling="mean"
):
    """Builds a classifier returning logits on a KerasHub BERT backbone.

    Inputs are the dict `{"token_ids", "padding_mask", "segment_ids"}` of
    `(batch, sequence_length)` arrays. For `"multiclass"`/`"multilabel"`
    the sentence vector (`pooling`) goes through dropout and a
    `Dense(num_classes)`; for `"tokens"` every position of the sequence
    output does, giving `(batch, sequence_length, num_classes)` logits.

    Args:
        task: one of `TASKS`.
        num_classes: number of classes (or tags).
        backbone: a `Backbone` (a fresh copy is used), a
            `keras_hub.models.BertBackbone` (used as is), or a preset string.
        dropout: dropout rate before the output layer. Defaults to `0.1`.
        pooling: sentence vector for the sentence tasks: `"mean"` (masked
            mean of the sequence output, what all-MiniLM-L6-v2 was trained
            with; default), `"cls"` (the `[CLS]` position) or `"pooled"`
            (the backbone's `pooled_output`).

    Returns:
        A functional `keras.Model` returning logits.
    """
    check_task(task)
    if isinstance(backbone, str):
        backbone = load_backbone(backbone)
    if isinstance(backbone, Backbone):
        backbone = backbone.fresh()
    names = ("token_ids", "padding_mask", "segment_ids")
    inputs = {
        n: keras.Input(shape=(None,), dtype="int32", name=n) for n in names
    }
    outputs = backbone(inputs)
    if pooling != "pooled" or task == "tokens":
        # The pooler gets no gradient: leave it out of training, so Keras
        # does not warn about it.
        for layer in backbone.layers:
            if layer.name == "pooled_dense":
                layer.trainable = False
    if task == "tokens":
        x = outputs["sequence_output"]
    elif pooling == "mean":
        mask = ops.expand_dims(
            ops.cast(inputs["padding_mask"], outputs["sequence_output"].dtype),
            -1,
        )
        x = ops.sum(outputs["sequence_output"] * mask, axis=1) / ops.maximum(
            ops.sum(mask, axis=1), 1.0
        )
    elif pooling == "cls":
        x = outputs["sequence_output"][:, 0, :]
    elif pooling == "pooled":
        x = outputs["pooled_output"]
    else:
        raise ValueError(
            "Expected `pooling` in ('mean', 'cls', 'pooled'). "
            f"Received: {pooling!r}"
        )
    x = keras.layers.Dropout(dropout)(x)
    logits = keras.layers.Dense(num_classes, dtype="float32", name="logits")(x)
    return keras.Model(inputs, logits, name=f"bert_{task}_classifier")


def build_scratch_classifier(
    task,
    num_classes,
    vocabulary_size,
    embedding_dim=64,
    hidden_dim=128,
    kernel_size=5,
    dropout=0.1,
):
    """A small classifier on token ids, to train from scratch.

    Inputs are the dict `{"token_ids", "padding_mask"}` of
    `(batch, sequence_length)` int arrays (what `prepare_data` makes, less
    `segment_ids`). For `"multiclass"`/`"multilabel"` it is an embedding
    bag (fastText-like): the masked mean of the token embeddings, dropout,
    `Dense(num_classes)`. For `"tokens"` it is a small CNN: the embeddings
    through two `Conv1D(hidden_dim, kernel_size, "relu")` layers, dropout,
    and `Dense(num_classes)` at every position.

    Args:
        task: one of `TASKS`.
        num_classes: number of classes (or tags).
        vocabulary_size: size of the token id vocabulary (e.g.
            `tokenizer.vocabulary_size()`).
        embedding_dim: embedding width. Defaults to `64`.
        hidden_dim: convolution width (tokens only). Defaults to `128`.
        kernel_size: convolution width in tokens (tokens only). Defaults
            to `5`.
        dropout: dropout rate before the output layer. Defaults to `0.1`.

    Returns:
        A functional `keras.Model` returning logits.
    """
    check_task(task)
    for name, value in (
        ("num_classes", num_classes),
        ("vocabulary_size", vocabulary_size),
        ("embedding_dim", embedding_dim),
        ("hidden_dim", hidden_dim),
        ("kernel_size", kernel_size),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(
                f"Expected `{name}` to be an int >= 1. Received: {value!r}"
            )
    inputs = {
        n: keras.Input(shape=(None,), dtype="int32", name=n)
        for n in ("token_ids", "padding_mask")
    }
    x = keras.layers.Embedding(vocabulary_size, embedding_dim)(
        inputs["token_ids"]
    )
    mask = ops.expand_dims(ops.cast(inputs["padding_mask"], x.dtype), -1)
    if task == "tokens":
        x = x * mask
        for _ in range(2):
            x = keras.layers.Conv1D(
                hidden_dim, kernel_size, padding="same", activation="relu"
            )(x)
    else:
        x = ops.sum(x * mask, axis=1) / ops.maximum(ops.sum(mask, axis=1), 1.0)
    x = keras.layers.Dropout(dropout)(x)
    logits = keras.layers.Dense(num_classes, dtype="float32", name="logits")(x)
    return keras.Model(inputs, logits, name=f"scratch_{task}_classifier")
