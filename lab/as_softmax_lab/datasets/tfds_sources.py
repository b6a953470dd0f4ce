"""Public benchmark datasets read with TensorFlow Datasets (TFDS).

These need `pip install tensorflow-datasets` and either network access (TFDS
downloads and prepares the data on first use) or a TFDS `data_dir` that
already holds the prepared dataset. Feature names follow the TFDS builders:

* `clinc_oos`: `text` (str), `intent` (int32 id), `intent_name` (str); splits
  `train`, `validation`, `test`, and the out-of-scope queries in
  `train_oos`, `validation_oos`, `test_oos`.
* `goemotions`: `comment_text` (str) and 28 boolean features, one per emotion
  (`admiration` ... `neutral`); splits `train`, `validation`, `test`.
* `conll2003`: `tokens` (str sequence), `ner` (ClassLabel sequence with the
  names `O`, `B-PER`, ..., `I-MISC`), also `pos` and `chunks`; splits
  `train`, `dev`, `test`.
"""

import numpy as np

from as_softmax_lab.datasets.structures import SPLITS
from as_softmax_lab.datasets.structures import ClassificationData
from as_softmax_lab.datasets.structures import TextSplit
from as_softmax_lab.datasets.structures import TokenClassificationData
from as_softmax_lab.datasets.structures import TokenSplit
from as_softmax_lab.datasets.structures import normalize_max_examples

# The 28 GoEmotions labels, in the order of the TFDS builder (and of the
# original dataset's emotion ids).
GOEMOTIONS_LABELS = (
    "admiration",
    "amusement",
    "anger",
    "annoyance",
    "approval",
    "caring",
    "confusion",
    "curiosity",
    "desire",
    "disappointment",
    "disapproval",
    "disgust",
    "embarrassment",
    "excitement",
    "fear",
    "gratitude",
    "grief",
    "joy",
    "love",
    "nervousness",
    "optimism",
    "pride",
    "realization",
    "relief",
    "remorse",
    "sadness",
    "surprise",
    "neutral",
)


def _import_tfds():
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise ImportError(
            "This data source needs TensorFlow Datasets: "
            "`pip install tensorflow-datasets`."
        ) from e
    return tfds


def _to_str(value):
    if isinstance(value, bytes):
        return value.decode("utf-8")
    return str(value)


def _examples(name, split, limit, data_dir):
    """Yields numpy examples of one TFDS split, at most `limit` of them."""
    tfds = _import_tfds()
    ds = tfds.load(name, split=split, data_dir=data_dir, shuffle_files=False)
    if limit is not None:
        ds = ds.take(limit)
    return tfds.as_numpy(ds)


def load_clinc_oos(max_examples=None, data_dir=None, include_oos=False):
    """Loads CLINC150 intent classification (`clinc_oos` in TFDS).

    Args:
        max_examples: `None`, an int, or a dict from split name to int.
            Keep at most this many examples of each split.
        data_dir: TFDS data directory. Defaults to TFDS's default.
        include_oos: bool. Whether to append the out-of-scope queries
            (TFDS splits `*_oos`) to each split, with their own intent id.

    Returns:
        A `ClassificationData` with `multi_label=False`. Labels are the TFDS
        `intent` ids; `class_names[i]` is the `intent_name` seen with id `i`
        (or `"intent_<i>"` for an id absent from the loaded examples).
    """
    limits = normalize_max_examples(max_examples)
    id_to_name = {}
    splits = {}
    for name in SPLITS:
        sources = [name] + ([name + "_oos"] if include_oos else [])
        texts, labels = [], []
        for source in sources:
            limit = limits[name]
            if limit is not None:
                limit -= len(texts)
            for ex in _examples("clinc_oos", source, limit, data_dir):
                intent = int(ex["intent"])
                texts.append(_to_str(ex["text"]))
                labels.append(intent)
                id_to_name.setdefault(intent, _to_str(ex["intent_name"]))
        splits[name] = (texts, labels)
    num_classes = max(id_to_name, default=-1) + 1
    class_names = tuple(
        id_to_name.get(i, f"intent_{i}") for i in range(num_classes)
    )
    return ClassificationData(
        name="clinc_oos",
        class_names=class_names,
        multi_label=False,
        **{
            name: TextSplit(texts, np.asarray(labels, dtype="int32"))
            for name, (texts, labels) in splits.items()
        },
    )


def load_goemotions(max_examples=None, data_dir=None):
    """Loads GoEmotions multi-label emotion classification (TFDS).

    Args:
        max_examples: `None`, an int, or a dict from split name to int.
            Keep at most this many examples of each split.
        data_dir: TFDS data directory. Defaults to TFDS's default.

    Returns:
        A `ClassificationData` with `multi_label=True`, the 28
        `GOEMOTIONS_LABELS` as `class_names` and multi-hot `float32` labels
        of shape `(num_examples, 28)`.
    """
    limits = normalize_max_examples(max_examples)
    splits = {}
    for name in SPLITS:
        texts, rows = [], []
        for ex in _examples("goemotions", name, limits[name], data_dir):
            texts.append(_to_str(ex["comment_text"]))
            rows.append([bool(ex[label]) for label in GOEMOTIONS_LABELS])
        labels = np.asarray(rows, dtype="float32").reshape(
            len(rows), len(GOEMOTIONS_LABELS)
        )
        splits[name] = TextSplit(texts, labels)
    return ClassificationData(
        name="goemotions",
        class_names=GOEMOTIONS_LABELS,
        multi_label=True,
        **splits,
    )


def load_conll2003(max_examples=None, data_dir=None):
    """Loads CoNLL-2003 English named entity recognition (TFDS).

    The TFDS `dev` split is returned as `validation`.

    Args:
        max_examples: `None`, an int, or a dict from split name to int.
            Keep at most this many sentences of each split.
        data_dir: TFDS data directory. Defaults to TFDS's default.

    Returns:
        A `TokenClassificationData` with the 9 NER tags (`O`, `B-PER`, ...,
        `I-MISC`) as `class_names`.

    Raises:
        ValueError: if a sentence has a different number of tokens and tags.
    """
    tfds = _import_tfds()
    limits = normalize_max_examples(max_examples)
    tfds_split = {"train": "train", "validation": "dev", "test": "test"}
    splits = {}
    for name in SPLITS:
        tokens, tags = [], []
        examples = _examples(
            "conll2003", tfds_split[name], limits[name], data_dir
        )
        for ex in examples:
            sentence = [_to_str(t) for t in ex["tokens"]]
            sentence_tags = [int(t) for t in ex["ner"]]
            if len(sentence) != len(sentence_tags):
                raise ValueError(
                    "Expected one NER tag per token in conll2003 split "
                    f"{tfds_split[name]!r}. Received {len(sentence)} tokens "
                    f"and {len(sentence_tags)} tags: tokens={sentence}"
                )
            tokens.append(sentence)
            tags.append(sentence_tags)
        splits[name] = TokenSplit(tokens, tags)
    builder = tfds.builder("conll2003", data_dir=data_dir)
    class_names = tuple(builder.info.features["ner"].feature.names)
    return TokenClassificationData(
        name="conll2003", class_names=class_names, **splits
    )
