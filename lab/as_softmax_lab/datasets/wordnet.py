"""Offline text datasets built from WordNet 3.0 and bundled with the package.

The files in `lab/as_softmax_lab/datasets/data/` are made by
`examples/data/build_wordnet_datasets.py` from Debian's `wordnet-base`
package (WordNet 3.0, Princeton University, WordNet 3.0 license; see
`data/README.md`). They are small gzip-compressed JSON files, so these
loaders need no network access and no dataset download.

Labels are WordNet's 45 lexicographer categories ("lexnames" or
supersenses), such as `noun.animal`, `verb.motion` or `adj.all`.
"""

import functools
import gzip
import json
import os

import numpy as np

from as_softmax_lab.datasets.structures import SPLITS
from as_softmax_lab.datasets.structures import ClassificationData
from as_softmax_lab.datasets.structures import TextSplit
from as_softmax_lab.datasets.structures import TokenClassificationData
from as_softmax_lab.datasets.structures import TokenSplit
from as_softmax_lab.datasets.structures import multi_hot
from as_softmax_lab.datasets.structures import normalize_max_examples

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")

LEXNAME_FILE = "wordnet_lexname.json.gz"
MULTILABEL_FILE = "wordnet_multilabel.json.gz"
TOKENS_FILE = "wordnet_tokens.json.gz"


def _read(file_name, data_dir=None):
    path = os.path.join(data_dir or DATA_DIR, file_name)
    return _read_path(os.path.abspath(path))


@functools.lru_cache(maxsize=8)
def _read_path(path):
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"WordNet dataset file not found: {path}. It is bundled with "
            "`keras-as-softmax-lab`; rebuild it with "
            "`python examples/data/build_wordnet_datasets.py` (needs "
            "`apt-get install wordnet-base`)."
        )
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def _limit(values, limit):
    return values if limit is None else values[:limit]


def load_wordnet_lexname(max_examples=None, data_dir=None):
    """Loads the bundled multi-class WordNet supersense dataset.

    Each example is the definition of one WordNet 3.0 synset (its gloss
    without the quoted example sentences, and without the synset's words,
    which would give the answer away), labelled with the synset's
    lexicographer category, one of 45 classes such as `noun.artifact`,
    `verb.motion` or `adj.pert`. Definitions that are empty, duplicated, or
    shared by synsets of different categories are dropped. The sample is
    stratified by class and keeps at least 30 examples of every class, so the
    class distribution is long-tailed (`adj.all` 12% of the examples,
    `noun.artifact` and `noun.person` ~10% each; `noun.Tops`, `noun.motive`,
    `verb.weather` and `adj.ppl` 0.13%, 26 train examples each).

    Sizes: 20,060 train, 2,006 validation, 2,006 test examples.

    Args:
        max_examples: `None`, an int, or a dict from split name to int. Keep
            only the first `max_examples` examples of each split (the stored
            order is already shuffled). Defaults to `None` (all).
        data_dir: folder with the `.json.gz` files. Defaults to the files
            bundled with the package.

    Returns:
        A `ClassificationData` with `multi_label=False`; each split's
        `labels` is an `int32` array of class ids into `class_names`.

    Example:

    >>> data = load_wordnet_lexname(max_examples=4)
    >>> data.num_classes
    45
    >>> texts, labels = data.train
    >>> len(texts), labels.shape
    (4, (4,))
    """
    raw = _read(LEXNAME_FILE, data_dir)
    limits = normalize_max_examples(max_examples)
    splits = {}
    for name in SPLITS:
        split = raw["splits"][name]
        texts = _limit(split["texts"], limits[name])
        labels = np.asarray(
            _limit(split["labels"], limits[name]), dtype="int32"
        ).reshape(-1)
        splits[name] = TextSplit(list(texts), labels)
    return ClassificationData(
        name=raw["name"],
        class_names=tuple(raw["class_names"]),
        multi_label=False,
        **splits,
    )


def load_wordnet_multilabel(max_examples=None, data_dir=None):
    """Loads the bundled multi-label WordNet dataset.

    One example per polysemous WordNet 3.0 lemma, i.e. a word with at least
    two senses counting all its parts of speech (for instance *limbo*, or
    *run* as a noun and as a verb). The text is the list of definitions of
    (up to 6 of) its senses joined with `" | "`, in random order; the senses
    are chosen round-robin over the parts of speech in WordNet's
    sense-frequency order. The word itself is not part of the text. The
    labels are the set of lexicographer categories of those senses (45
    possible classes), so a text whose senses are a `noun.cognition` and a
    `noun.state` carries both labels. Texts are deduplicated.

    Label cardinality is 1 to 6, 2.05 on average (train: 34% of the examples
    have one label, 43% two, 13% three, 10% four or more). Classes are
    long-tailed: the rarest, `adj.ppl`, `noun.motive` and `noun.Tops`, have
    7, 8 and 25 train examples, and the test split has no `adj.ppl`
    example.

    Sizes: 12,000 train, 1,500 validation, 1,500 test examples.

    Args:
        max_examples: `None`, an int, or a dict from split name to int. Keep
            only the first `max_examples` examples of each split. Defaults to
            `None` (all).
        data_dir: folder with the `.json.gz` files. Defaults to the files
            bundled with the package.

    Returns:
        A `ClassificationData` with `multi_label=True`; each split's
        `labels` is a multi-hot `float32` array of shape
        `(num_examples, 45)`.

    Example:

    >>> data = load_wordnet_multilabel(max_examples=4)
    >>> texts, labels = data.train
    >>> labels.shape
    (4, 45)
    >>> bool((labels.sum(axis=1) >= 1).all())
    True
    """
    raw = _read(MULTILABEL_FILE, data_dir)
    limits = normalize_max_examples(max_examples)
    num_classes = len(raw["class_names"])
    splits = {}
    for name in SPLITS:
        split = raw["splits"][name]
        texts = _limit(split["texts"], limits[name])
        labels = multi_hot(_limit(split["labels"], limits[name]), num_classes)
        splits[name] = TextSplit(list(texts), labels)
    return ClassificationData(
        name=raw["name"],
        class_names=tuple(raw["class_names"]),
        multi_label=True,
        **splits,
    )


def load_wordnet_tokens(max_examples=None, data_dir=None):
    """Loads the bundled WordNet token classification (BIO tagging) dataset.

    Sentences are the quoted example sentences of WordNet 3.0 glosses
    (e.g. *"he ran into the house"* under a sense of *run*), split into word
    and punctuation tokens. The token(s) that realise the synset's word are
    tagged `B-<type>` (first token) and `I-<type>` (following tokens of a
    multi-word expression such as *look up*); every other token is `O`.
    Inflected forms are matched with WordNet's exception lists and regular
    suffix rules. `<type>` is the synset's lexicographer category for nouns
    and verbs (e.g. `verb.motion`), `adj` for adjectives and `adv` for
    adverbs; noun and verb categories with fewer than 400 sentences in
    WordNet are folded into `noun.other` and `verb.other`. That gives 24
    types, hence 49 tags with `O`. The splits are disjoint by synset.

    Sizes: 20,000 train, 2,000 validation, 2,000 test sentences (about 6
    tokens each; ~83% of the tokens are `O`, ~7% `B-adj`).

    Args:
        max_examples: `None`, an int, or a dict from split name to int. Keep
            only the first `max_examples` sentences of each split. Defaults to
            `None` (all).
        data_dir: folder with the `.json.gz` files. Defaults to the files
            bundled with the package.

    Returns:
        A `TokenClassificationData`; each split's `tokens` is a list of lists
        of `str` and its `tags` a list of lists of `int` tag ids into
        `class_names` (`class_names[0] == "O"`), of the same lengths.

    Example:

    >>> data = load_wordnet_tokens(max_examples=2)
    >>> tokens, tags = data.train
    >>> [len(t) for t in tokens] == [len(t) for t in tags]
    True
    >>> data.class_names[0]
    'O'
    """
    raw = _read(TOKENS_FILE, data_dir)
    limits = normalize_max_examples(max_examples)
    splits = {}
    for name in SPLITS:
        split = raw["splits"][name]
        tokens = [list(t) for t in _limit(split["tokens"], limits[name])]
        tags = [list(t) for t in _limit(split["tags"], limits[name])]
        splits[name] = TokenSplit(tokens, tags)
    return TokenClassificationData(
        name=raw["name"],
        class_names=tuple(raw["class_names"]),
        **splits,
    )
