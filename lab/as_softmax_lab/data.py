"""Datasets tokenized once into numpy arrays, and fed as `tf.data`.

Texts are tokenized once, up front, into numpy arrays (`prepare_data`), so
that timings measure the model and not the tokenizer.
"""

import dataclasses

import numpy as np
from keras import ops

from as_softmax_lab.methods import IGNORE_CLASS
from as_softmax_lab.methods import METRIC_NAMES


@dataclasses.dataclass
class PreparedData:
    """A dataset tokenized once into numpy arrays.

    Attributes:
        name: dataset name.
        task: one of `TASKS`.
        class_names: tuple of class (or tag) names.
        train, validation, test: `(x, y)` with `x` a dict of int32 arrays
            `(n, sequence_length)` and `y` the labels: int32 `(n,)`,
            float32 multi-hot `(n, C)`, or int32 `(n, sequence_length)` tags
            with `-1` on non-first word pieces, special tokens and padding.
    """

    name: str
    task: str
    class_names: tuple
    train: tuple
    validation: tuple
    test: tuple

    @property
    def num_classes(self):
        return len(self.class_names)

    @property
    def metric_name(self):
        return METRIC_NAMES[self.task]

    def __repr__(self):
        sizes = ", ".join(
            f"{s}={len(getattr(self, s)[1])}"
            for s in ("train", "validation", "test")
        )
        return (
            f"PreparedData(name={self.name!r}, task={self.task!r}, "
            f"num_classes={self.num_classes}, {sizes})"
        )


def tokenize_texts(tokenizer, texts, sequence_length, batch_size=1024):
    """Tokenizes sentences into `[CLS] ... [SEP]` padded numpy arrays.

    Returns:
        dict of int32 arrays `token_ids`, `padding_mask`, `segment_ids`,
        each `(len(texts), sequence_length)`.
    """
    from as_softmax_lab.backbones import text_classifier_preprocessor

    preprocessor = text_classifier_preprocessor(tokenizer, sequence_length)
    parts = []
    for start in range(0, len(texts), batch_size):
        out = preprocessor(list(texts[start : start + batch_size]))
        parts.append(
            {
                k: np.asarray(ops.convert_to_numpy(v)).astype("int32")
                for k, v in out.items()
            }
        )
    if not parts:
        return {
            k: np.zeros((0, sequence_length), "int32")
            for k in ("token_ids", "padding_mask", "segment_ids")
        }
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def tokenize_tagged(
    tokenizer, sentences, tags, sequence_length, ignore_class=IGNORE_CLASS
):
    """Tokenizes word-tagged sentences, aligning tags to word pieces.

    Every word is split into word pieces; its first piece gets the word's
    tag, its other pieces, `[CLS]`, `[SEP]` and padding get `ignore_class`.
    Sentences longer than `sequence_length - 2` pieces are truncated (their
    last words are dropped from training and evaluation alike).

    Returns:
        `(x, y)`: dict of int32 arrays `(n, sequence_length)` and int32 tags
        `(n, sequence_length)`.
    """
    words = [w for sentence in sentences for w in sentence]
    pieces = tokenizer(words) if words else []
    pieces = (
        [list(np.asarray(ops.convert_to_numpy(p)).reshape(-1)) for p in pieces]
        if words
        else []
    )
    cls_id, sep_id = tokenizer.cls_token_id, tokenizer.sep_token_id
    pad_id = tokenizer.pad_token_id
    n = len(sentences)
    token_ids = np.full((n, sequence_length), pad_id, "int32")
    padding_mask = np.zeros((n, sequence_length), "int32")
    labels = np.full((n, sequence_length), ignore_class, "int32")
    k = 0
    for i, (_, sentence_tags) in enumerate(zip(sentences, tags, strict=True)):
        ids, lab = [cls_id], [ignore_class]
        for tag in sentence_tags:
            word_pieces = pieces[k] or [tokenizer.unk_token_id]
            k += 1
            if len(ids) + len(word_pieces) > sequence_length - 1:
                continue
            ids.extend(int(p) for p in word_pieces)
            lab.extend([int(tag)] + [ignore_class] * (len(word_pieces) - 1))
        ids.append(sep_id)
        lab.append(ignore_class)
        token_ids[i, : len(ids)] = ids
        padding_mask[i, : len(ids)] = 1
        labels[i, : len(lab)] = lab
    x = {
        "token_ids": token_ids,
        "padding_mask": padding_mask,
        "segment_ids": np.zeros_like(token_ids),
    }
    return x, labels


def prepare_data(data, tokenizer, sequence_length=64):
    """Tokenizes a dataset from `as_softmax_lab.datasets` once.

    Args:
        data: a `ClassificationData` (multi-class or multi-label) or a
            `TokenClassificationData`.
        tokenizer: a `keras_hub.models.BertTokenizer` (e.g.
            `Backbone.tokenizer`).
        sequence_length: padded length, `[CLS]`/`[SEP]` included.

    Returns:
        A `PreparedData`.
    """
    from as_softmax_lab.datasets import TokenClassificationData

    splits = {}
    if isinstance(data, TokenClassificationData):
        task = "tokens"
        for name, split in data.splits.items():
            splits[name] = tokenize_tagged(
                tokenizer, split.tokens, split.tags, sequence_length
            )
    else:
        task = "multilabel" if data.multi_label else "multiclass"
        for name, split in data.splits.items():
            labels = np.asarray(
                split.labels, "float32" if data.multi_label else "int32"
            )
            splits[name] = (
                tokenize_texts(tokenizer, split.texts, sequence_length),
                labels,
            )
    return PreparedData(data.name, task, tuple(data.class_names), **splits)


def make_dataset(
    split, batch_size, shuffle_seed=None, drop_remainder=False, sample_ids=False
):
    """A `tf.data.Dataset` of `(x, y)` batches, shuffled given a seed.

    With `sample_ids=True`, `x` carries each sample's index, as
    `keras_as_softmax.filters.SkipMaskedLastSeen` needs.
    """
    import tensorflow as tf

    from keras_as_softmax import filters

    x, y = split
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    if sample_ids:
        ds = filters.index_dataset(ds)
    if shuffle_seed is not None:
        ds = ds.shuffle(
            len(y), seed=shuffle_seed, reshuffle_each_iteration=True
        )
    return ds.batch(batch_size, drop_remainder=drop_remainder).prefetch(
        tf.data.AUTOTUNE
    )
