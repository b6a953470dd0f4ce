"""One entry point per task, with a `source` argument choosing the data."""

from as_softmax_lab.datasets import tfds_sources
from as_softmax_lab.datasets import wordnet

TEXT_CLASSIFICATION_SOURCES = ("wordnet", "clinc_oos")
MULTILABEL_CLASSIFICATION_SOURCES = ("wordnet", "goemotions")
TOKEN_CLASSIFICATION_SOURCES = ("wordnet", "conll2003")


def _check_source(source, allowed, function):
    if source not in allowed:
        raise ValueError(
            f"`{function}` expects `source` to be one of {allowed}. "
            f"Received: source={source!r}"
        )


def load_text_classification(
    source="wordnet", max_examples=None, data_dir=None, include_oos=False
):
    """Loads a multi-class text classification dataset.

    Sources:

    * `"wordnet"` (default, offline): WordNet 3.0 synset definitions labelled
      with one of 45 lexicographer categories (`noun.animal`,
      `verb.motion`, ...); 20,060 / 2,006 / 2,006 examples, bundled with the
      package. See `as_softmax_lab.datasets.wordnet.load_wordnet_lexname`.
    * `"clinc_oos"`: CLINC150 intent classification (150 intents, plus the
      out-of-scope class with `include_oos=True`) from TensorFlow Datasets;
      needs `tensorflow-datasets` and network access or a prepared
      `data_dir`.

    Args:
        source: str. `"wordnet"` or `"clinc_oos"`.
        max_examples: `None`, an int, or a dict from split name (`"train"`,
            `"validation"`, `"test"`) to int: keep at most this many
            examples of each split. Defaults to `None` (all).
        data_dir: optional folder. For `"wordnet"`, the folder with the
            `.json.gz` files (defaults to the bundled ones); for TFDS
            sources, the TFDS data directory.
        include_oos: bool. Only for `"clinc_oos"`: also include the
            out-of-scope queries.

    Returns:
        A `ClassificationData` with `train`, `validation` and `test`
        `TextSplit`s of `(texts, labels)`, where `texts` is a list of `str`
        and `labels` an `int32` array of class ids, plus `class_names`.

    Example:

    ```python
    data = load_text_classification("wordnet", max_examples=1000)
    x_train, y_train = data.train
    model.fit(x_train, y_train, validation_data=data.validation)
    print(data.num_classes, data.class_names[y_train[0]])
    ```
    """
    _check_source(
        source, TEXT_CLASSIFICATION_SOURCES, "load_text_classification"
    )
    if include_oos and source != "clinc_oos":
        raise ValueError(
            "`include_oos=True` is only supported with source='clinc_oos'. "
            f"Received: source={source!r}"
        )
    if source == "wordnet":
        return wordnet.load_wordnet_lexname(max_examples, data_dir=data_dir)
    return tfds_sources.load_clinc_oos(
        max_examples, data_dir=data_dir, include_oos=include_oos
    )


def load_multilabel_classification(
    source="wordnet", max_examples=None, data_dir=None
):
    """Loads a multi-label text classification dataset.

    Sources:

    * `"wordnet"` (default, offline): for each polysemous WordNet 3.0 word,
      the definitions of its senses (the word itself is left out), labelled
      with the set of lexicographer categories of those senses (45 classes,
      2.05 labels per example on average); 12,000 / 1,500 / 1,500 examples,
      bundled with the package. See
      `as_softmax_lab.datasets.wordnet.load_wordnet_multilabel`.
    * `"goemotions"`: GoEmotions Reddit comments with 28 emotion labels,
      from TensorFlow Datasets; needs `tensorflow-datasets` and network
      access or a prepared `data_dir`.

    Args:
        source: str. `"wordnet"` or `"goemotions"`.
        max_examples: `None`, an int, or a dict from split name (`"train"`,
            `"validation"`, `"test"`) to int: keep at most this many
            examples of each split. Defaults to `None` (all).
        data_dir: optional folder. For `"wordnet"`, the folder with the
            `.json.gz` files (defaults to the bundled ones); for TFDS
            sources, the TFDS data directory.

    Returns:
        A `ClassificationData` with `multi_label=True` and `train`,
        `validation` and `test` `TextSplit`s of `(texts, labels)`, where
        `labels` is a multi-hot `float32` array of shape
        `(num_examples, num_classes)`.

    Example:

    ```python
    data = load_multilabel_classification("wordnet", max_examples=1000)
    x_train, y_train = data.train  # y_train: (1000, 45) multi-hot.
    ```
    """
    _check_source(
        source,
        MULTILABEL_CLASSIFICATION_SOURCES,
        "load_multilabel_classification",
    )
    if source == "wordnet":
        return wordnet.load_wordnet_multilabel(max_examples, data_dir=data_dir)
    return tfds_sources.load_goemotions(max_examples, data_dir=data_dir)


def load_token_classification(
    source="wordnet", max_examples=None, data_dir=None
):
    """Loads a token classification (BIO tagging) dataset.

    Sources:

    * `"wordnet"` (default, offline): WordNet 3.0 example sentences where
      the word(s) realising the illustrated sense are tagged with its
      coarse category (49 tags: `O` and `B-`/`I-` of 24 types such as
      `verb.motion`, `noun.person`, `adj`); 20,000 / 2,000 / 2,000
      sentences, bundled with the package. See
      `as_softmax_lab.datasets.wordnet.load_wordnet_tokens`.
    * `"conll2003"`: CoNLL-2003 English NER (9 tags), from TensorFlow
      Datasets; its `dev` split is returned as `validation`. Needs
      `tensorflow-datasets` and network access or a prepared `data_dir`.

    Args:
        source: str. `"wordnet"` or `"conll2003"`.
        max_examples: `None`, an int, or a dict from split name (`"train"`,
            `"validation"`, `"test"`) to int: keep at most this many
            sentences of each split. Defaults to `None` (all).
        data_dir: optional folder. For `"wordnet"`, the folder with the
            `.json.gz` files (defaults to the bundled ones); for TFDS
            sources, the TFDS data directory.

    Returns:
        A `TokenClassificationData` with `train`, `validation` and `test`
        `TokenSplit`s of `(tokens, tags)`: lists of word-token lists and of
        `int` tag-id lists of the same lengths, plus `class_names` (tag
        names, `"O"` first).

    Example:

    ```python
    data = load_token_classification("wordnet", max_examples=100)
    tokens, tags = data.train
    print(list(zip(tokens[0], [data.class_names[t] for t in tags[0]])))
    ```
    """
    _check_source(
        source, TOKEN_CLASSIFICATION_SOURCES, "load_token_classification"
    )
    if source == "wordnet":
        return wordnet.load_wordnet_tokens(max_examples, data_dir=data_dir)
    return tfds_sources.load_conll2003(max_examples, data_dir=data_dir)
